//! Loading a diffusers-format model directory: `model_index.json` names each component folder's
//! class, and each class maps to one diffmesh implementation.
//!
//! Real FLUX.1 directories (`FluxPipeline`, `FluxFillPipeline`: CLIP and T5 text encoders with
//! their tokenizers) and diffmesh's tiny model load alike. Classes diffmesh has no implementation
//! of are reported as [`ModelError::Unsupported`], naming component and class; nothing is
//! substituted for them.
use crate::components::{LatentCodec, TextEncoder};
use crate::error::{read_json, ModelError, Result};
use crate::flux::FluxTransformer;
use crate::noise_scheduler::FlowMatchEulerDiscreteScheduler;
use crate::text::{
    ClipTextModel, FluxPromptEncoder, PromptTokenizer, T5EncoderModel, TokenizerClass,
};
use crate::tiny::{DiffmeshPixelCodec, DiffmeshTinyTextEncoder};
use crate::vae::AutoencoderKL;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{nn, Device, Kind};

/// Tokenizer classes that are read by their text encoder's loader rather than loaded on their own.
const TOKENIZERS_READ_BY_ENCODER: &[&str] = &["DiffmeshWordTokenizer"];

/// One `model_index.json` entry: `"name": [library, class]` (both may be null for absent parts).
#[derive(Debug, Clone, PartialEq)]
pub struct ComponentSpec {
    pub library: Option<String>,
    pub class: Option<String>,
}

/// The parsed `model_index.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelIndex {
    /// The pipeline class (`_class_name`), e.g. `FluxPipeline`.
    pub pipeline_class: String,
    /// Components by folder name; keys starting with `_` are metadata and not included.
    pub components: BTreeMap<String, ComponentSpec>,
}

impl ModelIndex {
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("model_index.json");
        let raw: serde_json::Map<String, serde_json::Value> = read_json(&path)?;
        let pipeline_class = raw
            .get("_class_name")
            .and_then(|v| v.as_str())
            .ok_or_else(|| {
                ModelError::config("_class_name", format!("missing in {}", path.display()))
            })?
            .to_string();
        let mut components = BTreeMap::new();
        for (name, value) in raw.iter().filter(|(k, _)| !k.starts_with('_')) {
            let pair = value.as_array().filter(|a| a.len() == 2).ok_or_else(|| {
                ModelError::config(
                    name.clone(),
                    format!("expected [library, class] in {}", path.display()),
                )
            })?;
            let text = |v: &serde_json::Value| v.as_str().map(str::to_string);
            components.insert(
                name.clone(),
                ComponentSpec {
                    library: text(&pair[0]),
                    class: text(&pair[1]),
                },
            );
        }
        Ok(Self {
            pipeline_class,
            components,
        })
    }

    /// The class of component `name`, or an error naming it when it is absent.
    pub fn class_of(&self, name: &str) -> Result<&str> {
        self.components
            .get(name)
            .and_then(|c| c.class.as_deref())
            .ok_or_else(|| ModelError::config(name, "component not present in model_index.json"))
    }
}

/// One loaded component. Stores that own the weights travel with the model.
pub enum Component {
    Transformer(Box<FluxTransformer>, nn::VarStore),
    Codec(Box<dyn LatentCodec>),
    TextEncoder(Box<dyn TextEncoder>, nn::VarStore),
    Scheduler(FlowMatchEulerDiscreteScheduler),
    /// A tokenizer folder consumed by its text encoder's loader.
    Tokenizer,
    /// A Hugging Face tokenizer (CLIP's or T5's).
    PromptTokenizer(Box<PromptTokenizer>),
    ClipText(Box<ClipTextModel>, nn::VarStore),
    T5Text(Box<T5EncoderModel>, nn::VarStore),
}

impl std::fmt::Debug for Component {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Component::Transformer(..) => "Transformer",
            Component::Codec(_) => "Codec",
            Component::TextEncoder(..) => "TextEncoder",
            Component::Scheduler(_) => "Scheduler",
            Component::Tokenizer => "Tokenizer",
            Component::PromptTokenizer(_) => "PromptTokenizer",
            Component::ClipText(..) => "ClipText",
            Component::T5Text(..) => "T5Text",
        })
    }
}

/// Whether diffmesh can load `class`.
pub fn is_supported(class: &str) -> bool {
    matches!(
        class,
        "FluxTransformer2DModel"
            | "AutoencoderKL"
            | "FlowMatchEulerDiscreteScheduler"
            | "CLIPTextModel"
            | "T5EncoderModel"
    ) || TokenizerClass::from_class_name(class).is_some()
        || class == crate::tiny::codec::CLASS_NAME
        || class == crate::tiny::text_encoder::CLASS_NAME
        || TOKENIZERS_READ_BY_ENCODER.contains(&class)
}

/// Load the folder `dir/<name>` as an instance of `class` (the class registry).
/// `kind` applies to every component with weights but the tiny text encoder, which runs in f32.
pub fn load_component(
    dir: &Path,
    name: &str,
    class: &str,
    device: Device,
    kind: Kind,
) -> Result<Component> {
    let folder = dir.join(name);
    Ok(match class {
        "FluxTransformer2DModel" => {
            let (model, vs) = FluxTransformer::load(&folder, device, kind)?;
            Component::Transformer(Box::new(model), vs)
        }
        "AutoencoderKL" => Component::Codec(Box::new(AutoencoderKL::load(&folder, device, kind)?)),
        "FlowMatchEulerDiscreteScheduler" => {
            Component::Scheduler(FlowMatchEulerDiscreteScheduler::from_config_file(
                &folder.join("scheduler_config.json"),
            )?)
        }
        c if c == crate::tiny::codec::CLASS_NAME => {
            Component::Codec(Box::new(DiffmeshPixelCodec::load(&folder, device)?))
        }
        c if c == crate::tiny::text_encoder::CLASS_NAME => {
            let (encoder, vs) = DiffmeshTinyTextEncoder::load(&folder, device)?;
            Component::TextEncoder(Box::new(encoder), vs)
        }
        c if TOKENIZERS_READ_BY_ENCODER.contains(&c) => Component::Tokenizer,
        "CLIPTextModel" => {
            let (model, vs) = ClipTextModel::load(&folder, device, kind)?;
            Component::ClipText(Box::new(model), vs)
        }
        "T5EncoderModel" => {
            let (model, vs) = T5EncoderModel::load(&folder, device, kind)?;
            Component::T5Text(Box::new(model), vs)
        }
        c if TokenizerClass::from_class_name(c).is_some() => {
            Component::PromptTokenizer(Box::new(PromptTokenizer::load(&folder, Some(c))?))
        }
        other => {
            return Err(ModelError::Unsupported {
                component: name.into(),
                class: other.into(),
                reason: "diffmesh has no implementation of this class".into(),
            })
        }
    })
}

/// The text components of a FLUX.1 directory as they are loaded, paired into one encoder at the end.
#[derive(Default)]
struct FluxTextParts {
    clip_tokenizer: Option<PromptTokenizer>,
    t5_tokenizer: Option<PromptTokenizer>,
    clip: Option<ClipTextModel>,
    t5: Option<T5EncoderModel>,
}

impl FluxTextParts {
    fn check_first(name: &str, taken: bool, class: &str) -> Result<()> {
        if taken {
            return Err(ModelError::config(
                name,
                format!("a second {class} is not supported"),
            ));
        }
        Ok(())
    }

    fn tokenizer(&mut self, name: &str, tokenizer: PromptTokenizer) -> Result<()> {
        let slot = match tokenizer.class() {
            TokenizerClass::Clip => &mut self.clip_tokenizer,
            TokenizerClass::T5 => &mut self.t5_tokenizer,
        };
        if slot.replace(tokenizer).is_some() {
            return Err(ModelError::config(
                name,
                "a second tokenizer of this class is not supported",
            ));
        }
        Ok(())
    }

    /// The FLUX.1 encoder when any part is present; all four must be.
    fn assemble(self) -> Result<Option<FluxPromptEncoder>> {
        match (self.clip_tokenizer, self.clip, self.t5_tokenizer, self.t5) {
            (None, None, None, None) => Ok(None),
            (Some(clip_tokenizer), Some(clip), Some(t5_tokenizer), Some(t5)) => Ok(Some(
                FluxPromptEncoder::new(clip_tokenizer, clip, t5_tokenizer, t5)?,
            )),
            (clip_tokenizer, clip, t5_tokenizer, t5) => {
                let missing: Vec<&str> = [
                    (clip_tokenizer.is_none(), "tokenizer (CLIPTokenizer)"),
                    (clip.is_none(), "text_encoder (CLIPTextModel)"),
                    (t5_tokenizer.is_none(), "tokenizer_2 (T5TokenizerFast)"),
                    (t5.is_none(), "text_encoder_2 (T5EncoderModel)"),
                ]
                .into_iter()
                .filter_map(|(absent, what)| absent.then_some(what))
                .collect();
                Err(ModelError::config(
                    "text_encoder",
                    format!(
                        "FLUX.1 prompt encoding needs CLIP and T5 with their tokenizers; missing: {}",
                        missing.join(", ")
                    ),
                ))
            }
        }
    }
}

/// Whether the transformer's input and output widths fit the VAE and the pipeline: `4C` in and
/// out for `FluxPipeline`; for `FluxFillPipeline` the masked image's latents (`4C`) and the packed
/// mask (`4 f^2`) come in too.
fn check_channels(
    pipeline_class: &str,
    transformer: &FluxTransformer,
    codec: &dyn LatentCodec,
) -> Result<()> {
    let packed = 4 * codec.latent_channels();
    let f = codec.downscale_factor();
    let expected_in = if pipeline_class == FILL_PIPELINE {
        2 * packed + 4 * f * f
    } else {
        packed
    };
    if transformer.cfg.in_channels != expected_in {
        return Err(ModelError::config(
            "transformer.in_channels",
            format!(
                "{} does not fit {pipeline_class} over a VAE of {} latent channels (expected {expected_in})",
                transformer.cfg.in_channels,
                codec.latent_channels()
            ),
        ));
    }
    if transformer.cfg.proj_out_dim() != packed {
        return Err(ModelError::config(
            "transformer.out_channels",
            format!(
                "predicts {} channels per token; the VAE's packed latents have {packed}",
                transformer.cfg.proj_out_dim()
            ),
        ));
    }
    Ok(())
}

/// Only the prompt encoding of a FLUX.1 directory (`tokenizer`, `tokenizer_2`, `text_encoder`,
/// `text_encoder_2`), without reading the transformer or the VAE.
pub fn load_flux_prompt_encoder(
    dir: &Path,
    device: Device,
    kind: Kind,
) -> Result<(FluxPromptEncoder, Vec<nn::VarStore>)> {
    let index = ModelIndex::read(dir)?;
    let mut parts = FluxTextParts::default();
    let mut stores = Vec::new();
    for name in ["tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2"] {
        let class = index.class_of(name)?;
        match load_component(dir, name, class, device, kind)? {
            Component::PromptTokenizer(t) => parts.tokenizer(name, *t)?,
            Component::ClipText(m, vs) if parts.clip.is_none() => {
                parts.clip = Some(*m);
                stores.push(vs);
            }
            Component::T5Text(m, vs) if parts.t5.is_none() => {
                parts.t5 = Some(*m);
                stores.push(vs);
            }
            other => {
                return Err(ModelError::config(
                    name,
                    format!("{class} ({other:?}) is not one of FLUX.1's text components"),
                ))
            }
        }
    }
    let encoder = parts
        .assemble()?
        .ok_or_else(|| ModelError::config("text_encoder", "no FLUX.1 text components"))?;
    Ok((encoder, stores))
}

/// `model_index.json`'s class of FLUX.1-Fill-dev.
pub const FILL_PIPELINE: &str = "FluxFillPipeline";

/// Everything a Flux-style pipeline needs, loaded from one directory.
pub struct LoadedModel {
    pub dir: PathBuf,
    pub index: ModelIndex,
    pub transformer: FluxTransformer,
    pub text_encoder: Box<dyn TextEncoder>,
    pub codec: Box<dyn LatentCodec>,
    pub scheduler: FlowMatchEulerDiscreteScheduler,
    /// Owns the weights of `transformer` (LoRA patching writes them in place).
    pub transformer_store: nn::VarStore,
    /// Own the weights of `text_encoder`.
    pub stores: Vec<nn::VarStore>,
}

impl LoadedModel {
    /// Load every component listed in `model_index.json`. Fails on the first unsupported class
    /// (listing the others in the reason) before reading any weights.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        let index = ModelIndex::read(dir)?;
        let present: Vec<(&String, &str)> = index
            .components
            .iter()
            .filter_map(|(n, c)| c.class.as_deref().map(|cl| (n, cl)))
            .collect();
        let unsupported: Vec<String> = present
            .iter()
            .filter(|(_, c)| !is_supported(c))
            .map(|(n, c)| format!("{n} ({c})"))
            .collect();
        if let Some((name, class)) = present.iter().find(|(_, c)| !is_supported(c)) {
            return Err(ModelError::Unsupported {
                component: (*name).clone(),
                class: (*class).to_string(),
                reason: format!(
                    "diffmesh has no implementation of this class; unsupported components in {}: {}",
                    dir.display(),
                    unsupported.join(", ")
                ),
            });
        }
        let (mut transformer, mut text_encoder, mut codec, mut scheduler) =
            (None, None, None, None);
        let mut transformer_store = None;
        let mut stores = Vec::new();
        let mut flux_text = FluxTextParts::default();
        for (name, class) in present {
            match load_component(dir, name, class, device, kind)? {
                Component::Transformer(m, vs) => {
                    transformer = Some(*m);
                    transformer_store = Some(vs);
                }
                Component::TextEncoder(e, vs) => {
                    if text_encoder.replace(e).is_some() {
                        return Err(ModelError::config(
                            name.clone(),
                            "a second text encoder is not supported",
                        ));
                    }
                    stores.push(vs);
                }
                Component::Codec(c) => codec = Some(c),
                Component::Scheduler(s) => scheduler = Some(s),
                Component::Tokenizer => {}
                Component::PromptTokenizer(t) => flux_text.tokenizer(name, *t)?,
                Component::ClipText(m, vs) => {
                    FluxTextParts::check_first(name, flux_text.clip.is_some(), "CLIPTextModel")?;
                    flux_text.clip = Some(*m);
                    stores.push(vs);
                }
                Component::T5Text(m, vs) => {
                    FluxTextParts::check_first(name, flux_text.t5.is_some(), "T5EncoderModel")?;
                    flux_text.t5 = Some(*m);
                    stores.push(vs);
                }
            }
        }
        if let Some(encoder) = flux_text.assemble()? {
            if text_encoder.replace(Box::new(encoder)).is_some() {
                return Err(ModelError::config(
                    "text_encoder",
                    "a second text encoder is not supported",
                ));
            }
        }
        let missing = |what: &str| {
            ModelError::config(what, format!("no such component in {}", dir.display()))
        };
        let transformer = transformer.ok_or_else(|| missing("transformer"))?;
        let transformer_store = transformer_store.ok_or_else(|| missing("transformer"))?;
        let text_encoder = text_encoder.ok_or_else(|| missing("text_encoder"))?;
        let codec = codec.ok_or_else(|| missing("vae"))?;
        let scheduler = scheduler.ok_or_else(|| missing("scheduler"))?;
        check_channels(&index.pipeline_class, &transformer, codec.as_ref())?;
        Ok(Self {
            dir: dir.to_path_buf(),
            index,
            transformer,
            transformer_store,
            text_encoder,
            codec,
            scheduler,
            stores,
        })
    }

    /// Bytes the weights of each component with weights take: `transformer`, `text_encoders`
    /// (all of them together) and `vae`.
    pub fn resident_bytes(&self) -> Vec<(&'static str, u64)> {
        vec![
            (
                "transformer",
                crate::weights::store_bytes(&self.transformer_store),
            ),
            (
                "text_encoders",
                self.stores.iter().map(crate::weights::store_bytes).sum(),
            ),
            ("vae", self.codec.resident_bytes()),
        ]
    }

    /// Borrow the components as a pipeline.
    pub fn pipeline(&self) -> crate::pipeline::FluxPipeline<'_> {
        crate::pipeline::FluxPipeline {
            transformer: &self.transformer,
            text_encoder: self.text_encoder.as_ref(),
            codec: self.codec.as_ref(),
            scheduler: &self.scheduler,
        }
    }
}
