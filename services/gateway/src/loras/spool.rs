//! A LoRA upload streamed to a file instead of memory: each chunk of the `weights` part is
//! written to a temporary file in the spool directory (`--upload-spool-dir`) as it arrives,
//! hashed on the way, and only the safetensors header is kept in memory (bounded by
//! [`MAX_HEADER_BYTES`]) for the check. The object store then reads the file. The file is
//! removed when the upload is dropped, registered or not.
//!
//! Writes are plain `std::fs` writes from the request's task: one chunk (tens of KB) lands in
//! the page cache in microseconds, less than a hop to a blocking thread would cost, and the
//! multipart readers also run outside a Tokio runtime (fuzzing, form tests).
use std::io::Write;
use std::path::{Path, PathBuf};

use diffmesh_shared::wire::lora::LoraFile;
use diffmesh_shared::wire::messages::FieldError;
use sha2::{Digest, Sha256};

use crate::error::ApiError;

/// Largest safetensors header (the JSON naming every tensor) an upload may have: a LoRA of
/// every linear layer of FLUX.1 at any rank has a header of a few hundred KB.
pub const MAX_HEADER_BYTES: usize = 16 * 1024 * 1024;

/// The weights file of an upload, on disk.
#[derive(Debug)]
pub struct SpooledWeights {
    path: tempfile::TempPath,
    len: u64,
    sha256: String,
    /// The first `8 + header length` bytes (fewer when the file is shorter).
    head: Vec<u8>,
}

impl SpooledWeights {
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Lower-case hex SHA-256 of the whole file.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    pub fn head(&self) -> &[u8] {
        &self.head
    }

    /// `len` bytes of the file from `offset` (the check reads `alpha` scalars so).
    pub fn read_at(&self, offset: u64, len: usize) -> std::io::Result<Vec<u8>> {
        use std::io::{Read, Seek, SeekFrom};
        let mut file = std::fs::File::open(&self.path)?;
        file.seek(SeekFrom::Start(offset))?;
        let mut buf = vec![0; len];
        file.read_exact(&mut buf)?;
        Ok(buf)
    }
}

/// Writes one upload's chunks to its spool file.
pub struct Spooler {
    file: std::fs::File,
    path: tempfile::TempPath,
    dir: PathBuf,
    field: &'static str,
    limit: usize,
    len: u64,
    hasher: Sha256,
    head: Vec<u8>,
    /// How many bytes `head` must hold: 8 until the header's length is known.
    head_wanted: usize,
}

impl Spooler {
    /// A new spool file in `dir` for the part `field`, refused past `limit` bytes (413).
    pub fn new(dir: &Path, field: &'static str, limit: usize) -> Result<Self, ApiError> {
        let (file, path) = tempfile::Builder::new()
            .prefix("lora-upload-")
            .tempfile_in(dir)
            .map_err(|e| spool_error(dir, e))?
            .into_parts();
        Ok(Self {
            file,
            path,
            dir: dir.to_path_buf(),
            field,
            limit,
            len: 0,
            hasher: Sha256::new(),
            head: Vec::new(),
            head_wanted: 8,
        })
    }

    /// Append a chunk: counted against the limit, hashed, its header bytes kept, written.
    pub fn push(&mut self, chunk: &[u8]) -> Result<(), ApiError> {
        if self.len + chunk.len() as u64 > self.limit as u64 {
            return Err(ApiError::TooLarge {
                field: self.field.to_string(),
                limit: self.limit,
            });
        }
        self.keep_head(chunk)?;
        self.hasher.update(chunk);
        self.file
            .write_all(chunk)
            .map_err(|e| spool_error(&self.dir, e))?;
        self.len += chunk.len() as u64;
        Ok(())
    }

    fn keep_head(&mut self, mut chunk: &[u8]) -> Result<(), ApiError> {
        while self.head.len() < self.head_wanted && !chunk.is_empty() {
            let take = (self.head_wanted - self.head.len()).min(chunk.len());
            self.head.extend_from_slice(&chunk[..take]);
            chunk = &chunk[take..];
            if self.head.len() == 8 && self.head_wanted == 8 {
                let prefix: [u8; 8] = self.head[..8].try_into().expect("8 bytes");
                let n = LoraFile::header_len(&prefix, MAX_HEADER_BYTES).map_err(|e| {
                    FieldError::invalid(self.field, format!("not a LoRA we can apply: {e}"))
                })?;
                self.head_wanted = 8 + n;
            }
        }
        Ok(())
    }

    /// The whole file, flushed to the spool directory.
    pub fn finish(mut self) -> Result<SpooledWeights, ApiError> {
        self.file.flush().map_err(|e| spool_error(&self.dir, e))?;
        Ok(SpooledWeights {
            path: self.path,
            len: self.len,
            sha256: self
                .hasher
                .finalize()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect(),
            head: self.head,
        })
    }
}

/// The spool directory is the gateway's own trouble (full or unwritable), not the client's.
fn spool_error(dir: &Path, e: std::io::Error) -> ApiError {
    ApiError::Internal(format!(
        "could not spool the upload to {} (--upload-spool-dir): {e}",
        dir.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_reach_the_file_and_only_the_header_stays_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let header = br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        file.extend_from_slice(&[7u8; 8]);
        let mut spooler = Spooler::new(dir.path(), "weights", 1 << 20).unwrap();
        // One byte at a time: the header length straddles chunks.
        for b in &file {
            spooler.push(std::slice::from_ref(b)).unwrap();
        }
        let spooled = spooler.finish().unwrap();
        assert_eq!(spooled.len(), file.len() as u64);
        assert_eq!(spooled.head(), &file[..8 + header.len()]);
        assert_eq!(std::fs::read(spooled.path()).unwrap(), file);
        let sha: String = Sha256::digest(&file)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(spooled.sha256(), sha);
        let path = spooled.path().to_path_buf();
        drop(spooled);
        assert!(!path.exists(), "the spool file outlived its upload");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn too_large_files_and_headers_are_refused_as_they_arrive() {
        let dir = tempfile::tempdir().unwrap();
        let mut spooler = Spooler::new(dir.path(), "weights", 10).unwrap();
        spooler.push(&8u64.to_le_bytes()).unwrap();
        match spooler.push(&[b' '; 3]) {
            Err(ApiError::TooLarge { field, limit }) => {
                assert_eq!((field.as_str(), limit), ("weights", 10))
            }
            other => panic!("{other:?}"),
        }
        drop(spooler);
        let mut spooler = Spooler::new(dir.path(), "weights", 1 << 30).unwrap();
        let huge = (MAX_HEADER_BYTES as u64 + 1).to_le_bytes();
        match spooler.push(&huge) {
            Err(ApiError::Invalid(f)) => {
                assert_eq!(f.field, "weights");
                assert!(f.message.contains("above the limit"), "{}", f.message);
            }
            other => panic!("{other:?}"),
        }
        drop(spooler);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "refused uploads leave no file"
        );
    }
}
