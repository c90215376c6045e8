//! The prompt stage: text encoding off the engine's step loop. FLUX.1's T5-XXL takes tens of
//! milliseconds a prompt on a GPU (seconds on a CPU); encoded on the engine thread, every
//! running job would wait for it. The stage is a sync actor on a thread of its own that owns
//! the model's text encoder; the engine keeps a [`PreEncoded`] stand-in that hands out what the
//! stage encoded for the job being admitted.
//!
//! A job is submitted to the engine with an empty [`PromptSlot`]; once accepted, the stage is
//! asked to fill the slot with the embeddings of the job's prompts. The engine passes over a job
//! whose slot is still empty (as it does over a template cache still being fetched), so queueing
//! and encoding overlap and the step loop never waits.
//!
//! Embeddings are cached by (model, prompt, max tokens), bounded in bytes, least recently used
//! first out: a template's edits and repeated prompts encode once.
use actix::{Actor, Addr, Handler, Message, SyncContext};
use diffmesh_model::components::{TextEmbeddings, TextEncoder};
use diffmesh_model::tch::Tensor;
use diffmesh_model::ModelError;
use diffmesh_shared::panic_message;
use lru::LruCache;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

/// Each prompt of a job with its embeddings.
pub type PromptEmbeddings = Vec<(String, TextEmbeddings)>;

/// Where the stage leaves a job's embeddings (or why it has none). `Mutex`, not `OnceLock`:
/// tch tensors are `Send` but not `Sync`.
pub type PromptSlot = Arc<Mutex<Option<Result<PromptEmbeddings, String>>>>;

/// Whether the stage has answered for `slot`.
pub fn slot_ready(slot: &PromptSlot) -> bool {
    slot.lock().unwrap_or_else(|p| p.into_inner()).is_some()
}

/// Take what the stage left in `slot` (`None` while it has not answered).
pub fn take_slot(slot: &PromptSlot) -> Option<Result<PromptEmbeddings, String>> {
    slot.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// The engine's text encoder once the stage owns the real one: it answers with the embeddings
/// offered for the job being prepared, and refuses any other prompt (nothing is encoded on the
/// step loop).
pub struct PreEncoded {
    offered: Arc<Mutex<HashMap<String, TextEmbeddings>>>,
    max_tokens: i64,
}

/// The engine's side of a [`PreEncoded`]: offer a job's embeddings before preparing it, clear
/// them after.
#[derive(Clone)]
pub struct PreEncodedHandle(Arc<Mutex<HashMap<String, TextEmbeddings>>>);

impl PreEncodedHandle {
    pub fn offer(&self, embeddings: PromptEmbeddings) {
        let mut offered = self.0.lock().unwrap_or_else(|p| p.into_inner());
        offered.clear();
        offered.extend(embeddings);
    }

    pub fn clear(&self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

impl TextEncoder for PreEncoded {
    fn encode(&self, prompts: &[String]) -> diffmesh_model::Result<TextEmbeddings> {
        let offered = self.offered.lock().unwrap_or_else(|p| p.into_inner());
        let mut hidden = Vec::with_capacity(prompts.len());
        let mut pooled = Vec::with_capacity(prompts.len());
        for prompt in prompts {
            let e = offered.get(prompt).ok_or_else(|| {
                ModelError::input(
                    "prompt",
                    "was not encoded by the prompt stage before the job was admitted",
                )
            })?;
            hidden.push(e.hidden.shallow_clone());
            pooled.push(e.pooled.shallow_clone());
        }
        Ok(TextEmbeddings {
            hidden: tch_cat(&hidden)?,
            pooled: tch_cat(&pooled)?,
        })
    }

    fn max_tokens(&self) -> i64 {
        self.max_tokens
    }
}

fn tch_cat(parts: &[Tensor]) -> diffmesh_model::Result<Tensor> {
    match parts {
        [one] => Ok(one.shallow_clone()),
        _ => Ok(Tensor::f_cat(parts, 0)?),
    }
}

impl PreEncodedHandle {
    /// A stand-in text encoder of `max_tokens` that serves what the stage encoded, and the
    /// handle the stage offers its encodings through ([`crate::model::EngineModel::split_text_encoder`]).
    pub fn stand_in(max_tokens: i64) -> (Box<dyn TextEncoder>, PreEncodedHandle) {
        let offered = Arc::new(Mutex::new(HashMap::new()));
        let stand_in = PreEncoded {
            offered: offered.clone(),
            max_tokens,
        };
        (Box::new(stand_in), PreEncodedHandle(offered))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PromptKey {
    model: String,
    prompt: String,
    max_tokens: i64,
}

/// The stage actor: the text encoder and its cache.
pub struct PromptStage {
    encoder: Box<dyn TextEncoder>,
    model_id: String,
    cache: LruCache<PromptKey, (TextEmbeddings, u64)>,
    cached_bytes: u64,
    budget_bytes: u64,
}

impl Actor for PromptStage {
    type Context = SyncContext<Self>;
}

fn shallow(e: &TextEmbeddings) -> TextEmbeddings {
    TextEmbeddings {
        hidden: e.hidden.shallow_clone(),
        pooled: e.pooled.shallow_clone(),
    }
}

fn bytes_of(e: &TextEmbeddings) -> u64 {
    [&e.hidden, &e.pooled]
        .iter()
        .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
        .sum()
}

impl PromptStage {
    fn new(encoder: Box<dyn TextEncoder>, model_id: String, budget_bytes: u64) -> Self {
        Self {
            encoder,
            model_id,
            cache: LruCache::unbounded(),
            cached_bytes: 0,
            budget_bytes,
        }
    }

    fn embeddings(&mut self, prompt: &str) -> diffmesh_model::Result<TextEmbeddings> {
        let key = PromptKey {
            model: self.model_id.clone(),
            prompt: prompt.to_string(),
            max_tokens: self.encoder.max_tokens(),
        };
        if let Some((e, _)) = self.cache.get(&key) {
            return Ok(shallow(e));
        }
        let e = diffmesh_model::tch::no_grad(|| self.encoder.encode(&[prompt.to_string()]))?;
        let bytes = bytes_of(&e);
        if bytes <= self.budget_bytes {
            self.cache.put(key, (shallow(&e), bytes));
            self.cached_bytes += bytes;
            while self.cached_bytes > self.budget_bytes {
                match self.cache.pop_lru() {
                    Some((_, (_, b))) => self.cached_bytes -= b,
                    None => break,
                }
            }
        }
        Ok(e)
    }

    fn encode_all(&mut self, prompts: &[String]) -> Result<PromptEmbeddings, String> {
        let mut out: PromptEmbeddings = Vec::with_capacity(prompts.len());
        for prompt in prompts {
            if out.iter().any(|(p, _)| p == prompt) {
                continue;
            }
            let e = self.embeddings(prompt).map_err(|e| e.to_string())?;
            out.push((prompt.clone(), e));
        }
        Ok(out)
    }
}

/// Fill `slot` with the embeddings of `prompts`. The slot is answered whatever happens: a
/// message dropped unhandled (the stage stopping) answers it with an error.
pub struct EncodePrompts {
    prompts: Vec<String>,
    slot: AnswerOnDrop,
}

struct AnswerOnDrop(PromptSlot);

impl Drop for AnswerOnDrop {
    fn drop(&mut self) {
        let mut slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(Err(
                "the prompt stage stopped before encoding the prompt".into()
            ));
        }
    }
}

impl Message for EncodePrompts {
    type Result = ();
}

impl Handler<EncodePrompts> for PromptStage {
    type Result = ();

    fn handle(&mut self, msg: EncodePrompts, _: &mut SyncContext<Self>) {
        let answer = catch_unwind(AssertUnwindSafe(|| self.encode_all(&msg.prompts)))
            .unwrap_or_else(|p| Err(format!("text encoder panicked: {}", panic_message(p))));
        *msg.slot.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(answer);
    }
}

/// The async side's handle on the stage.
#[derive(Clone)]
pub struct PromptStageHandle {
    addr: Addr<PromptStage>,
}

impl PromptStageHandle {
    /// Start the stage on a thread of its own with `encoder` (see `EngineModel::split_text_encoder`),
    /// caching up to `budget_bytes` of embeddings.
    pub fn start(encoder: Box<dyn TextEncoder>, model_id: String, budget_bytes: u64) -> Self {
        // A sync actor's factory may run again; only the first start has the encoder.
        let encoder = Mutex::new(Some(encoder));
        let addr = diffmesh_shared::process::actors::start_sync("denoiser-prompts", 1, move || {
            let encoder = encoder
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
                .expect("the prompt stage is started once (its handler catches panics)");
            PromptStage::new(encoder, model_id.clone(), budget_bytes)
        });
        Self { addr }
    }

    /// Ask for `prompts` to be encoded into `slot`. The stage's mailbox holds at most one
    /// message per job the engine accepted, which its queue bounds.
    pub fn encode(&self, prompts: Vec<String>, slot: PromptSlot) {
        self.addr.do_send(EncodePrompts {
            prompts,
            slot: AnswerOnDrop(slot),
        });
    }
}
