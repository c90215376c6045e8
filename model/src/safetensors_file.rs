//! A safetensors file read one tensor at a time: the header first (names, dtypes, shapes), then
//! each tensor's bytes when asked for. Loading a checkpoint so holds the model's own copy of the
//! weights and one tensor of the file, never the whole file (a FLUX.1 shard is ~10 GB).
use crate::error::{ModelError, Result};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// Headers larger than this are refused rather than allocated (the format's own limit).
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// One tensor's entry in the header.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorEntry {
    pub kind: Kind,
    pub shape: Vec<i64>,
    /// Byte range in the data section (after the header).
    begin: u64,
    end: u64,
}

#[derive(serde::Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<i64>,
    data_offsets: [u64; 2],
}

/// Where a file's bytes are read from: the file itself, or its bytes in memory.
trait ReadSeek: Read + Seek + Send {}
impl<T: Read + Seek + Send> ReadSeek for T {}

/// An open safetensors file and its parsed header.
pub struct SafetensorsFile {
    /// Its path (in memory: the name errors give it).
    path: PathBuf,
    file: Box<dyn ReadSeek>,
    data_start: u64,
    entries: BTreeMap<String, TensorEntry>,
    /// The header's `__metadata__` (string to string; other values are skipped).
    metadata: BTreeMap<String, String>,
}

fn kind_of(dtype: &str) -> Option<Kind> {
    Some(match dtype {
        "F64" => Kind::Double,
        "F32" => Kind::Float,
        "F16" => Kind::Half,
        "BF16" => Kind::BFloat16,
        "I64" => Kind::Int64,
        "I32" => Kind::Int,
        "I16" => Kind::Int16,
        "I8" => Kind::Int8,
        "U8" => Kind::Uint8,
        "BOOL" => Kind::Bool,
        _ => return None,
    })
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<Self> {
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        Self::read_header(path, Box::new(file), file_len)
    }

    /// A file's bytes held in memory (`bytes::Bytes`, `Vec<u8>`, ...), called `name` in errors.
    pub fn from_bytes<B: AsRef<[u8]> + Send + 'static>(name: &str, bytes: B) -> Result<Self> {
        let len = bytes.as_ref().len() as u64;
        Self::read_header(Path::new(name), Box::new(std::io::Cursor::new(bytes)), len)
    }

    fn read_header(path: &Path, mut file: Box<dyn ReadSeek>, file_len: u64) -> Result<Self> {
        let bad = |report: String| ModelError::Weights {
            dir: path.to_path_buf(),
            report,
        };
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut len = [0u8; 8];
        file.read_exact(&mut len).map_err(io)?;
        let header_len = u64::from_le_bytes(len);
        if header_len > MAX_HEADER_BYTES || 8 + header_len > file_len {
            return Err(bad(format!(
                "header of {header_len} bytes does not fit the file"
            )));
        }
        let mut header = vec![0u8; header_len as usize];
        file.read_exact(&mut header).map_err(io)?;
        let raw: BTreeMap<String, serde_json::Value> =
            serde_json::from_slice(&header).map_err(|e| bad(format!("header is not JSON: {e}")))?;
        let data_start = 8 + header_len;
        let mut entries = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        for (name, value) in raw {
            if name == "__metadata__" {
                if let serde_json::Value::Object(m) = value {
                    metadata = m
                        .into_iter()
                        .filter_map(|(k, v)| v.as_str().map(|v| (k, v.to_string())))
                        .collect();
                }
                continue;
            }
            let e: RawEntry = serde_json::from_value(value)
                .map_err(|e| bad(format!("header entry {name}: {e}")))?;
            let kind = kind_of(&e.dtype)
                .ok_or_else(|| bad(format!("{name}: dtype {} is not supported", e.dtype)))?;
            let [begin, end] = e.data_offsets;
            let elements: i64 = e.shape.iter().product();
            let expected = elements.max(0) as u64 * kind.elt_size_in_bytes() as u64;
            if e.shape.iter().any(|d| *d < 0)
                || end < begin
                || end - begin != expected
                || data_start + end > file_len
            {
                return Err(bad(format!(
                    "{name}: offsets {begin}..{end} do not hold {:?} {}",
                    e.shape, e.dtype
                )));
            }
            entries.insert(
                name,
                TensorEntry {
                    kind,
                    shape: e.shape,
                    begin,
                    end,
                },
            );
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            data_start,
            entries,
            metadata,
        })
    }

    pub fn entries(&self) -> &BTreeMap<String, TensorEntry> {
        &self.entries
    }

    /// The header's `__metadata__` entries.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// Read tensor `name` into a new CPU tensor of its stored dtype.
    pub fn read(&mut self, name: &str) -> Result<Tensor> {
        let entry = self.entries.get(name).ok_or_else(|| ModelError::Weights {
            dir: self.path.clone(),
            report: format!("no tensor {name}"),
        })?;
        let io = |source| ModelError::Io {
            path: self.path.clone(),
            source,
        };
        let mut bytes = vec![0u8; (entry.end - entry.begin) as usize];
        self.file
            .seek(SeekFrom::Start(self.data_start + entry.begin))
            .map_err(io)?;
        self.file.read_exact(&mut bytes).map_err(io)?;
        Ok(Tensor::f_from_data_size(&bytes, &entry.shape, entry.kind)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_tch_writes_tensor_by_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let a = Tensor::arange(12, (Kind::Float, tch::Device::Cpu)).view([3, 4]);
        let b = Tensor::from_slice(&[1i64, -2, 3]).to_kind(Kind::Int64);
        let c = Tensor::arange(6, (Kind::Float, tch::Device::Cpu)).to_kind(Kind::BFloat16);
        Tensor::write_safetensors(&[("a", &a), ("b", &b), ("c", &c)], &path).unwrap();
        let mut file = SafetensorsFile::open(&path).unwrap();
        assert_eq!(file.entries()["a"].shape, [3, 4]);
        assert_eq!(file.entries()["c"].kind, Kind::BFloat16);
        for (name, want) in [("c", &c), ("a", &a), ("b", &b)] {
            let got = file.read(name).unwrap();
            assert_eq!(got.kind(), want.kind());
            assert!(got.equal(want), "{name}");
        }
        assert!(file
            .read("d")
            .unwrap_err()
            .to_string()
            .contains("no tensor d"));
    }

    #[test]
    fn a_truncated_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let a = Tensor::arange(100, (Kind::Float, tch::Device::Cpu));
        Tensor::write_safetensors(&[("a", &a)], &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 8]).unwrap();
        let err = SafetensorsFile::open(&path).err().unwrap().to_string();
        assert!(err.contains("offsets"), "{err}");
        std::fs::write(&path, [255u8; 8]).unwrap();
        let err = SafetensorsFile::open(&path).err().unwrap().to_string();
        assert!(err.contains("header"), "{err}");
    }
}
