//! Loading a diffusers-format model directory: `model_index.json` names each component folder's
//! class, and each class maps to one diffmesh implementation.
//!
//! Classes diffmesh has no implementation of (e.g. `CLIPTextModel` and `T5EncoderModel` of real
//! FLUX.1 checkpoints) are reported as [`ModelError::Unsupported`], naming component and class;
//! nothing is substituted for them.
use crate::components::{LatentCodec, TextEncoder};
use crate::error::{read_json, ModelError, Result};
use crate::flux::FluxTransformer;
use crate::noise_scheduler::FlowMatchEulerDiscreteScheduler;
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
}

impl std::fmt::Debug for Component {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Component::Transformer(..) => "Transformer",
            Component::Codec(_) => "Codec",
            Component::TextEncoder(..) => "TextEncoder",
            Component::Scheduler(_) => "Scheduler",
            Component::Tokenizer => "Tokenizer",
        })
    }
}

/// Whether diffmesh can load `class`.
pub fn is_supported(class: &str) -> bool {
    matches!(
        class,
        "FluxTransformer2DModel" | "AutoencoderKL" | "FlowMatchEulerDiscreteScheduler"
    ) || class == crate::tiny::codec::CLASS_NAME
        || class == crate::tiny::text_encoder::CLASS_NAME
        || TOKENIZERS_READ_BY_ENCODER.contains(&class)
}

/// Load the folder `dir/<name>` as an instance of `class` (the class registry).
/// `kind` applies to the transformer and the VAE; the tiny text encoder runs in f32.
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
        other => {
            return Err(ModelError::Unsupported {
                component: name.into(),
                class: other.into(),
                reason: "diffmesh has no implementation of this class".into(),
            })
        }
    })
}

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
        if transformer.cfg.in_channels != codec.latent_channels() * 4 {
            return Err(ModelError::config(
                "transformer.in_channels",
                format!(
                    "{} != 4 x vae latent channels {}",
                    transformer.cfg.in_channels,
                    codec.latent_channels()
                ),
            ));
        }
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
