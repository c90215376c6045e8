//! LoRA adapters as the mesh stores them: the file format (diffusers' PEFT layout, as
//! `FluxPipeline.save_lora_weights` writes it), its checks, and each module's scale.
//!
//! A file holds, per adapted `Linear` of the transformer, `transformer.<module>.lora_A.weight`
//! (`[rank, in]`) and `transformer.<module>.lora_B.weight` (`[out, rank]`); the adapted weight is
//! `W + scale * B @ A`. A UNet's file (SD 2.x, SDXL) has the same keys under `unet.`, or kohya's
//! (`lora_unet_<name>.lora_down.weight`, `.lora_up.weight`, `.alpha`, `<name>` the module path
//! with `_` for `.`, resolved against the UNet by the denoiser, which alone knows its modules).
//! Text-encoder adapters (`text_encoder*.`, `lora_te*_`) are counted here and not checked: a
//! UNet model with CLIP encoders patches them around its prompts' encoding (the denoiser
//! resolves them against its encoders), Flux models and the tiny text encoder leave them out.
//! The scale is `lora_alpha / rank` (`/ sqrt(rank)` with `use_rslora`) from
//! the PEFT config diffusers stores in the safetensors metadata (`lora_adapter_metadata`, keys
//! prefixed `transformer.`), with its `rank_pattern` / `alpha_pattern` overrides; a
//! `<module>.alpha` tensor (kohya style) overrides both; with neither, alpha is the rank (scale 1),
//! as diffusers loads such files. Only the header is read here, so the gateway can check an upload
//! without tensors; the denoiser reads the tensors from the same bytes (`LoraBlob::adapter`).
mod file_keys;

use file_keys::{dtype_name, key_role, scalar, KeyRole, PeftConfig};
use safetensors::tensor::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// The key prefix diffusers writes for the transformer's adapters.
pub const TRANSFORMER_PREFIX: &str = "transformer.";
/// The key prefix diffusers writes for a UNet's adapters.
pub const UNET_PREFIX: &str = "unet.";
/// The key prefix of kohya's (A1111's) UNet adapters.
pub const KOHYA_UNET_PREFIX: &str = "lora_unet_";
/// Metadata entry holding the PEFT config (JSON).
pub const METADATA_KEY: &str = "lora_adapter_metadata";
/// Most LoRAs one request may combine.
pub const MAX_LORAS_PER_REQUEST: usize = 4;
/// Largest rank accepted (larger adapters are fine-tunes, not LoRAs).
pub const MAX_RANK: usize = 1024;
/// Largest weight (absolute) a request may apply a LoRA with.
pub const MAX_LORA_SCALE: f32 = 8.0;

/// A LoRA a request asks for: a registered adapter and the weight to apply it with
/// (diffusers' `set_adapters(..., adapter_weights=[scale])`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraRef {
    pub id: String,
    pub scale: f32,
}

/// Object-store key (in `subjects::LORA_BUCKET`) of a registered LoRA's weights file.
pub fn weights_key(lora_id: &str) -> String {
    format!("{lora_id}/weights.safetensors")
}

/// A registered LoRA, as the gateway keeps it (JSON in the KV bucket `subjects::LORA_BUCKET`,
/// key = id); its weights file is at [`weights_key`] in the object store of the same name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraRecord {
    pub id: String,
    /// The client's label for it (not unique).
    #[serde(default)]
    pub name: Option<String>,
    /// The API key that registered it (as templates keep theirs); `None` without API keys.
    #[serde(default)]
    pub owner: Option<String>,
    /// Size of the weights file.
    pub bytes: u64,
    pub parameters: u64,
    /// Adapted layers.
    pub modules: usize,
    /// Largest rank among them.
    pub max_rank: usize,
    pub dtype: String,
    /// SHA-256 of the weights file (hex). A LoRA's weights never change (a new upload gets a new
    /// id), so denoisers cache adapters by id.
    pub sha256: String,
    /// RFC 3339.
    pub created_at: String,
    /// The network it adapts (records from before UNet LoRAs are the transformer's).
    #[serde(default)]
    pub target: LoraTarget,
    /// Text-encoder keys in the file (applied by UNet models with CLIP encoders, left out by
    /// Flux models).
    #[serde(default)]
    pub text_encoder_keys: usize,
}

/// The network a LoRA file adapts, by its keys.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoraTarget {
    /// A Flux transformer (`transformer.` keys).
    #[default]
    Transformer,
    /// A UNet (`unet.` keys, or kohya's `lora_unet_`).
    Unet,
}

impl LoraTarget {
    pub fn as_str(self) -> &'static str {
        match self {
            LoraTarget::Transformer => "transformer",
            LoraTarget::Unet => "unet",
        }
    }

    /// The adapters a model of `family` (its card's) takes.
    pub fn of_family(family: &str) -> Self {
        match family {
            "sd" | "sdxl" => LoraTarget::Unet,
            _ => LoraTarget::Transformer,
        }
    }

    /// The prefix of this target's entries in the PEFT metadata.
    fn metadata_prefix(self) -> &'static str {
        match self {
            LoraTarget::Transformer => TRANSFORMER_PREFIX,
            LoraTarget::Unet => UNET_PREFIX,
        }
    }
}

/// One adapted linear layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraModule {
    /// The layer's path in the transformer, e.g. `transformer_blocks.0.attn.to_q` (a UNet's:
    /// diffusers' path, or for kohya files the name with `_` for `.`, see [`LoraModule::kohya`]).
    pub module: String,
    /// Named in kohya's spelling (`_` for `.`): the denoiser resolves it against its UNet.
    #[serde(default)]
    pub kohya: bool,
    pub rank: usize,
    pub in_features: usize,
    pub out_features: usize,
    /// `alpha / rank` (or `/ sqrt(rank)`): multiplies `B @ A`, before the request's own scale.
    pub scale: f64,
    /// Keys of A (`[rank, in]`) and B (`[out, rank]`) in the file.
    pub down_key: String,
    pub up_key: String,
}

/// The checked header of a LoRA file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraFile {
    /// Sorted by module path.
    pub modules: Vec<LoraModule>,
    /// Storage dtype of the weights (`F32`, `F16` or `BF16`).
    pub dtype: String,
    /// Parameters in all A and B matrices.
    pub parameters: u64,
    /// The network it adapts.
    #[serde(default)]
    pub target: LoraTarget,
    /// Text-encoder keys (applied by UNet models with CLIP encoders, left out by Flux models).
    #[serde(default)]
    pub text_encoder_keys: usize,
}

/// Why a file is not a LoRA we can apply; `key` names the tensor or metadata entry at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct LoraFormatError {
    pub key: String,
    pub message: String,
}

fn bad(key: impl Into<String>, message: impl Into<String>) -> LoraFormatError {
    LoraFormatError {
        key: key.into(),
        message: message.into(),
    }
}

impl LoraFile {
    /// Largest rank among the modules.
    pub fn max_rank(&self) -> usize {
        self.modules.iter().map(|m| m.rank).max().unwrap_or(0)
    }

    /// Check a LoRA file's header: every key a LoRA key of the transformer, A and B paired with
    /// one rank, 2-D float weights of one dtype, the PEFT config one we can apply.
    pub fn parse(bytes: &[u8]) -> Result<Self, LoraFormatError> {
        let (n, meta) = SafeTensors::read_metadata(bytes)
            .map_err(|e| bad("file", format!("is not a safetensors file: {e}")))?;
        // `read_metadata` checked that the tensors cover the file exactly.
        let data = &bytes[8 + n..];
        Self::check_metadata(&meta, &mut |start, len| {
            Ok(data[start..start + len].to_vec())
        })
    }

    /// The length of the JSON header a file starting with `prefix` (at least 8 bytes) has,
    /// refused above `max_header` bytes: what a reader that streams a file must keep of it.
    pub fn header_len(prefix: &[u8; 8], max_header: usize) -> Result<usize, LoraFormatError> {
        let n = u64::from_le_bytes(*prefix);
        match usize::try_from(n) {
            Ok(n) if n <= max_header => Ok(n),
            _ => Err(bad(
                "file",
                format!("is not a safetensors file: its header claims {n} bytes, above the limit of {max_header}"),
            )),
        }
    }

    /// [`LoraFile::parse`] from the file's first `8 + header_len` bytes and its length, for a
    /// file streamed to disk rather than held whole: the header must cover exactly
    /// `file_len` bytes of tensor data, as `parse` checks. `read_at(offset, len)` reads bytes
    /// of the file (only `alpha` scalars are read, a few bytes each).
    pub fn parse_header(
        head: &[u8],
        file_len: u64,
        read_at: &mut dyn FnMut(u64, usize) -> std::io::Result<Vec<u8>>,
    ) -> Result<Self, LoraFormatError> {
        let not = |why: String| bad("file", format!("is not a safetensors file: {why}"));
        let prefix: [u8; 8] = head
            .get(..8)
            .and_then(|p| p.try_into().ok())
            .ok_or_else(|| not("shorter than its 8-byte header length".into()))?;
        let n = Self::header_len(&prefix, usize::MAX)?;
        // A length near u64::MAX (found by fuzz/lora_safetensors) must not overflow.
        let json = 8usize
            .checked_add(n)
            .and_then(|end| head.get(8..end))
            .ok_or_else(|| not(format!("the header claims {n} bytes; the file ends first")))?;
        let meta: safetensors::tensor::Metadata =
            serde_json::from_slice(json).map_err(|e| not(format!("invalid header: {e}")))?;
        let covered = (8 + n as u64).saturating_add(meta.data_len() as u64);
        if covered != file_len {
            return Err(not(format!(
                "the header covers {covered} bytes, the file is {file_len}"
            )));
        }
        let data_start = 8 + n as u64;
        Self::check_metadata(&meta, &mut |start, len| {
            read_at(data_start + start as u64, len).map_err(|e| e.to_string())
        })
    }

    /// `data(start, len)`: bytes of the data section (offsets as the header gives them).
    fn check_metadata(
        meta: &safetensors::tensor::Metadata,
        data: &mut dyn FnMut(usize, usize) -> Result<Vec<u8>, String>,
    ) -> Result<Self, LoraFormatError> {
        let tensors = meta.tensors();
        if tensors.is_empty() {
            return Err(bad("file", "holds no tensors"));
        }
        let mut names: Vec<&String> = tensors.keys().collect();
        names.sort();
        // module -> (down shape, up shape, alpha)
        struct Parts {
            down: Option<(String, Vec<usize>)>,
            up: Option<(String, Vec<usize>)>,
            alpha: Option<String>,
        }
        let mut parts: BTreeMap<String, Parts> = BTreeMap::new();
        let mut dtype: Option<&'static str> = None;
        // The network and naming of the first adapter key; every other must agree.
        let mut layout: Option<(LoraTarget, bool)> = None;
        let mut text_encoder_keys: Vec<&String> = Vec::new();
        for name in names {
            let info = tensors[name];
            let Some((target, kohya, role)) = key_role(name)? else {
                text_encoder_keys.push(name);
                continue;
            };
            match layout {
                Some(first) if first != (target, kohya) => {
                    return Err(bad(
                        name.as_str(),
                        "mixes layouts: one file holds the adapters of one network, all in diffusers' keys or all in kohya's",
                    ))
                }
                _ => layout = Some((target, kohya)),
            }
            let module = match &role {
                KeyRole::Down(m) | KeyRole::Up(m) | KeyRole::Alpha(m) => m.to_string(),
            };
            if module.is_empty() {
                return Err(bad(name.as_str(), "names no module"));
            }
            let entry = parts.entry(module).or_insert(Parts {
                down: None,
                up: None,
                alpha: None,
            });
            match role {
                KeyRole::Alpha(_) => {
                    if info.shape.iter().product::<usize>() != 1 {
                        return Err(bad(
                            name.as_str(),
                            format!("alpha must be a scalar, got shape {:?}", info.shape),
                        ));
                    }
                    entry.alpha = Some(name.clone());
                    continue;
                }
                KeyRole::Down(_) | KeyRole::Up(_) => {}
            }
            let Some(d) = dtype_name(info.dtype) else {
                return Err(bad(
                    name.as_str(),
                    format!("dtype {:?} is not F32, F16 or BF16", info.dtype),
                ));
            };
            match dtype {
                Some(first) if first != d => {
                    return Err(bad(
                        name.as_str(),
                        format!("dtype {d} differs from the file's {first}"),
                    ))
                }
                _ => dtype = Some(d),
            }
            if info.shape.len() != 2 || info.shape.contains(&0) {
                return Err(bad(
                    name.as_str(),
                    format!("must be a non-empty 2-D matrix, got shape {:?}", info.shape),
                ));
            }
            let slot = (name.clone(), info.shape.clone());
            match role {
                KeyRole::Down(_) => entry.down = Some(slot),
                _ => entry.up = Some(slot),
            }
        }
        let Some((target, kohya)) = layout else {
            let key = text_encoder_keys.first().map_or("file", |k| k.as_str());
            return Err(bad(
                key,
                "the file holds only text-encoder adapters: no transformer or UNet adapter",
            ));
        };
        if target == LoraTarget::Unet {
            // UNet models apply them: a key the denoiser could not read is refused now, not
            // at the first step of every job naming the file.
            for name in &text_encoder_keys {
                text_encoder_key_problem(name, &tensors[*name].shape)
                    .map_or(Ok(()), |why| Err(bad(name.as_str(), why)))?;
            }
        }
        let config = PeftConfig::from_metadata(meta.metadata().as_ref(), target.metadata_prefix())?;
        if config.use_dora {
            return Err(bad(
                METADATA_KEY,
                "DoRA adapters (use_dora) are not supported",
            ));
        }
        if config.lora_bias {
            return Err(bad(
                METADATA_KEY,
                "LoRA biases (lora_bias) are not supported",
            ));
        }
        // The UNet's reader (`diffmesh_model::unet::lora`) applies one rank and alpha.
        if target == LoraTarget::Unet
            && !(config.rank_pattern.is_empty() && config.alpha_pattern.is_empty())
        {
            return Err(bad(
                METADATA_KEY,
                "rank_pattern / alpha_pattern in a UNet LoRA are not supported",
            ));
        }
        let mut modules = Vec::with_capacity(parts.len());
        let mut parameters = 0u64;
        for (module, p) in parts {
            let (Some((down_key, down)), Some((up_key, up))) = (p.down, p.up) else {
                let (prefix, both) = if kohya {
                    (KOHYA_UNET_PREFIX, "lora_down.weight and lora_up.weight")
                } else {
                    (target.metadata_prefix(), "lora_A.weight and lora_B.weight")
                };
                return Err(bad(
                    format!("{prefix}{module}"),
                    format!("needs both {both}"),
                ));
            };
            let rank = down[0];
            if up[1] != rank {
                return Err(bad(
                    up_key,
                    format!("has rank {} but lora_A has rank {rank}", up[1]),
                ));
            }
            if rank > MAX_RANK {
                return Err(bad(down_key, format!("rank {rank} is above {MAX_RANK}")));
            }
            let alpha = match p.alpha {
                Some(key) => {
                    let info = tensors[&key];
                    let (start, end) = info.data_offsets;
                    let bytes = data(start, end - start)
                        .map_err(|e| bad(key.as_str(), format!("cannot be read: {e}")))?;
                    Some(scalar(&key, info.dtype, &bytes)?)
                }
                None => None,
            };
            // diffusers builds the layers from the metadata's rank, so one that disagrees with the
            // weights would not load there either.
            if let Some(r) =
                PeftConfig::pattern(&config.rank_pattern, &module).or(config.r.as_ref())
            {
                if *r != rank as f64 {
                    return Err(bad(
                        down_key,
                        format!("has rank {rank} but the metadata says {r}"),
                    ));
                }
            }
            let scale = config.scale(&module, rank, alpha);
            if !scale.is_finite() {
                return Err(bad(down_key, format!("scale {scale} is not finite")));
            }
            parameters += (down[0] * down[1] + up[0] * up[1]) as u64;
            modules.push(LoraModule {
                in_features: down[1],
                out_features: up[0],
                kohya,
                module,
                rank,
                scale,
                down_key,
                up_key,
            });
        }
        Ok(Self {
            modules,
            dtype: dtype.unwrap_or("F32").to_string(),
            parameters,
            target,
            text_encoder_keys: text_encoder_keys.len(),
        })
    }
}

/// Write f32 tensors `(key, shape, values)` as a safetensors file, with optional metadata
/// entries (e.g. [`METADATA_KEY`]): what tools and tests use to make LoRA files.
pub fn write_f32_safetensors(
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>, LoraFormatError> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((key, shape, _), b)| {
            safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), b)
                .map(|v| (key.clone(), v))
                .map_err(|e| bad(key.as_str(), e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize(views, metadata).map_err(|e| bad("file", e.to_string()))
}

/// Why a text encoder's key of a UNet LoRA cannot be applied (`None`: it can, as far as its
/// name's form and shape tell; the denoiser resolves the layer against its encoders): an
/// adapter's down or up matrix (2-D) or its alpha (a scalar), under diffusers' or kohya's
/// names.
fn text_encoder_key_problem(name: &str, shape: &[usize]) -> Option<String> {
    let matrix = [
        ".lora_A.weight",
        ".lora_B.weight",
        ".lora_down.weight",
        ".lora_up.weight",
    ]
    .iter()
    .any(|s| name.ends_with(s));
    if matrix {
        return (shape.len() != 2 || shape.contains(&0))
            .then(|| format!("must be a non-empty 2-D matrix, got shape {shape:?}"));
    }
    if name.ends_with(".alpha") {
        return (shape.iter().product::<usize>() != 1)
            .then(|| format!("alpha must be a scalar, got shape {shape:?}"));
    }
    Some(
        "not a text encoder's LoRA key (`.lora_A.weight` / `.lora_B.weight`, kohya's \
         `.lora_down.weight` / `.lora_up.weight` / `.alpha`)"
            .into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file of f32 tensors `(key, shape)` filled with 0.5, plus metadata.
    fn file(tensors: &[(&str, Vec<usize>)], metadata: Option<serde_json::Value>) -> Vec<u8> {
        let data: Vec<(String, Vec<usize>, Vec<f32>)> = tensors
            .iter()
            .map(|(k, s)| (k.to_string(), s.clone(), vec![0.5; s.iter().product()]))
            .collect();
        let info = metadata.map(|m| HashMap::from([(METADATA_KEY.to_string(), m.to_string())]));
        write_f32_safetensors(&data, info).unwrap()
    }

    fn pair(module: &str, rank: usize, inp: usize, out: usize) -> Vec<(String, Vec<usize>)> {
        vec![
            (
                format!("transformer.{module}.lora_A.weight"),
                vec![rank, inp],
            ),
            (
                format!("transformer.{module}.lora_B.weight"),
                vec![out, rank],
            ),
        ]
    }

    fn parse(
        tensors: Vec<(String, Vec<usize>)>,
        meta: Option<serde_json::Value>,
    ) -> Result<LoraFile, LoraFormatError> {
        let refs: Vec<(&str, Vec<usize>)> = tensors
            .iter()
            .map(|(k, s)| (k.as_str(), s.clone()))
            .collect();
        LoraFile::parse(&file(&refs, meta))
    }

    #[test]
    fn scales_follow_the_peft_config_and_its_patterns() {
        let mut t = pair("transformer_blocks.0.attn.to_q", 4, 32, 32);
        t.extend(pair("transformer_blocks.0.attn.to_k", 4, 32, 32));
        t.extend(pair("single_transformer_blocks.0.proj_out", 2, 64, 32));
        let meta = serde_json::json!({
            "transformer.r": 4, "transformer.lora_alpha": 8,
            "transformer.rank_pattern": {"single_transformer_blocks.0.proj_out": 2},
            "transformer.alpha_pattern": {"to_k": 3},
            "text_encoder.r": 99,
        });
        let f = parse(t, Some(meta)).unwrap();
        let by: HashMap<&str, &LoraModule> =
            f.modules.iter().map(|m| (m.module.as_str(), m)).collect();
        assert_eq!(by["transformer_blocks.0.attn.to_q"].scale, 2.0);
        assert_eq!(by["transformer_blocks.0.attn.to_k"].scale, 0.75);
        assert_eq!(by["single_transformer_blocks.0.proj_out"].scale, 4.0);
        assert_eq!(by["single_transformer_blocks.0.proj_out"].in_features, 64);
        assert_eq!(f.parameters, (4 * 32 + 32 * 4) * 2 + 2 * 64 + 32 * 2);
        assert_eq!(f.dtype, "F32");
    }

    #[test]
    fn without_metadata_alpha_is_the_rank_and_rslora_divides_by_its_root() {
        let f = parse(pair("x_embedder", 8, 16, 32), None).unwrap();
        assert_eq!(f.modules[0].scale, 1.0);
        let meta = serde_json::json!({"transformer.r": 4, "transformer.lora_alpha": 4, "transformer.use_rslora": true});
        let f = parse(pair("x_embedder", 4, 16, 32), Some(meta)).unwrap();
        assert_eq!(f.modules[0].scale, 2.0);
    }

    #[test]
    fn bad_files_name_the_key_at_fault() {
        let err = |t: Vec<(String, Vec<usize>)>, m| parse(t, m).unwrap_err();
        let e = err(pair("x", 4, 8, 8).into_iter().take(1).collect(), None);
        assert_eq!(e.key, "transformer.x");
        assert!(e.message.contains("lora_B"), "{e}");
        let e = err(
            vec![("text_encoder.a.lora_A.weight".into(), vec![2, 2])],
            None,
        );
        assert_eq!(e.key, "text_encoder.a.lora_A.weight");
        let mut t = pair("x", 4, 8, 8);
        t[1].1 = vec![8, 3];
        assert!(err(t, None).message.contains("rank 3"));
        let meta = serde_json::json!({"transformer.r": 8});
        assert!(err(pair("x", 4, 8, 8), Some(meta))
            .message
            .contains("metadata"));
        let meta = serde_json::json!({"transformer.use_dora": true});
        assert_eq!(err(pair("x", 4, 8, 8), Some(meta)).key, METADATA_KEY);
        let e = err(
            vec![("transformer.x.lora_magnitude_vector".into(), vec![8])],
            None,
        );
        assert!(e.message.contains("DoRA"));
        let mut t = pair("x", 4, 8, 8);
        t[0].1 = vec![4, 8, 1];
        assert!(err(t, None).message.contains("2-D"));
        assert_eq!(LoraFile::parse(b"not a file").unwrap_err().key, "file");
        assert_eq!(LoraFile::parse(&file(&[], None)).unwrap_err().key, "file");
    }

    #[test]
    fn the_header_alone_checks_a_file_as_the_whole_does() {
        let mut t = pair("transformer_blocks.0.attn.to_q", 4, 32, 32);
        t.push((
            "transformer.transformer_blocks.0.attn.to_q.alpha".into(),
            vec![],
        ));
        let refs: Vec<(&str, Vec<usize>)> =
            t.iter().map(|(k, s)| (k.as_str(), s.clone())).collect();
        let bytes = file(&refs, Some(serde_json::json!({"transformer.r": 4})));
        let n = LoraFile::header_len(bytes[..8].try_into().unwrap(), 1 << 20).unwrap();
        let head = &bytes[..8 + n];
        let whole = LoraFile::parse(&bytes).unwrap();
        let mut reads = 0;
        let mut read_at = |offset: u64, len: usize| {
            reads += 1;
            Ok(bytes[offset as usize..offset as usize + len].to_vec())
        };
        let streamed = LoraFile::parse_header(head, bytes.len() as u64, &mut read_at).unwrap();
        assert_eq!(reads, 1, "only the alpha scalar is read");
        assert_eq!(streamed.modules, whole.modules);
        assert_eq!(
            (streamed.parameters, streamed.dtype),
            (whole.parameters, whole.dtype)
        );
        // A file cut short, or with bytes after its tensors, is refused as `parse` refuses it.
        let mut unread = |_: u64, _: usize| -> std::io::Result<Vec<u8>> { panic!("read") };
        for len in [bytes.len() as u64 - 1, bytes.len() as u64 + 1] {
            let e = LoraFile::parse_header(head, len, &mut unread).unwrap_err();
            assert_eq!(e.key, "file");
            assert!(e.message.contains("covers"), "{e}");
        }
        let cut = LoraFile::parse_header(&head[..8 + n / 2], bytes.len() as u64, &mut unread);
        assert_eq!(cut.unwrap_err().key, "file");
        // A header length of u64::MAX (a fuzzer's find: it overflowed).
        let huge = LoraFile::parse_header(&[255; 136], 136, &mut unread).unwrap_err();
        assert!(huge.message.contains("ends first"), "{huge}");
        let e = LoraFile::header_len(bytes[..8].try_into().unwrap(), n - 1).unwrap_err();
        assert!(e.message.contains("above the limit"), "{e}");
    }

    #[test]
    fn alpha_tensors_override_the_config() {
        let mut t = pair("x", 4, 8, 8);
        t.push(("transformer.x.alpha".into(), vec![]));
        let f = parse(t, Some(serde_json::json!({"transformer.lora_alpha": 16}))).unwrap();
        // The alpha tensor holds 0.5 (see `file`): 0.5 / 4.
        assert_eq!(f.modules[0].scale, 0.125);
    }

    #[test]
    fn unet_files_in_both_layouts_parse_and_text_encoder_keys_are_left_out() {
        let module = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q";
        let peft: Vec<(String, Vec<usize>)> = pair(module, 4, 8, 8)
            .into_iter()
            .map(|(k, s)| (k.replacen("transformer.", "unet.", 1), s))
            .collect();
        let meta = serde_json::json!({"unet.r": 4, "unet.lora_alpha": 8, "transformer.r": 2});
        let f = parse(peft.clone(), Some(meta)).unwrap();
        assert_eq!(f.target, LoraTarget::Unet);
        assert_eq!(
            (f.modules[0].module.as_str(), f.modules[0].kohya),
            (module, false)
        );
        assert_eq!(f.modules[0].scale, 2.0);
        let kohya_name = module.replace('.', "_");
        let kohya = vec![
            (
                format!("lora_unet_{kohya_name}.lora_down.weight"),
                vec![4, 8],
            ),
            (format!("lora_unet_{kohya_name}.lora_up.weight"), vec![8, 4]),
            (format!("lora_unet_{kohya_name}.alpha"), vec![]),
            (
                "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight".into(),
                vec![4, 8],
            ),
            (
                "lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_up.weight".into(),
                vec![8, 4],
            ),
        ];
        let f = parse(kohya.clone(), None).unwrap();
        assert_eq!(f.target, LoraTarget::Unet);
        assert_eq!(f.text_encoder_keys, 2);
        // A text encoder's key the denoiser could not apply is refused by name at once.
        for (key, shape) in [
            (
                "lora_te1_text_model_encoder_layers_0_mlp_fc1.dora_scale",
                vec![1, 8],
            ),
            (
                "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight",
                vec![8, 4, 1],
            ),
            (
                "lora_te2_text_model_encoder_layers_0_mlp_fc1.alpha",
                vec![2],
            ),
        ] {
            let mut bad = kohya[..3].to_vec();
            bad.push((key.into(), shape));
            let e = parse(bad, None).unwrap_err();
            assert_eq!(e.key, key, "{e}");
        }
        assert!(f.modules[0].kohya);
        assert_eq!(f.modules[0].module, kohya_name);
        // alpha 0.5 (see `file`) over rank 4.
        assert_eq!(f.modules[0].scale, 0.125);
        // A file mixing layouts or networks is refused, naming the first key out of line.
        let mut mixed = kohya[..2].to_vec();
        mixed.extend(peft);
        let e = parse(mixed, None).unwrap_err();
        assert!(e.message.contains("mixes"), "{e}");
        let mut mixed = pair("x", 4, 8, 8);
        mixed.push(("unet.x.lora_A.weight".into(), vec![4, 8]));
        assert!(parse(mixed, None).unwrap_err().message.contains("mixes"));
        let patterned = serde_json::json!({"unet.rank_pattern": {"to_q": 4}});
        let e = parse(
            pair("x", 4, 8, 8)
                .into_iter()
                .map(|(k, s)| (k.replacen("transformer.", "unet.", 1), s))
                .collect(),
            Some(patterned),
        )
        .unwrap_err();
        assert_eq!(e.key, METADATA_KEY, "{e}");
        let e = parse(
            vec![(format!("lora_unet_{kohya_name}.hada_w1_a"), vec![4, 8])],
            None,
        )
        .unwrap_err();
        assert!(e.message.contains("kohya"), "{e}");
        assert_eq!(LoraTarget::of_family("sdxl"), LoraTarget::Unet);
        assert_eq!(LoraTarget::of_family("flux.1"), LoraTarget::Transformer);
    }
}
