//! The streamed cache pipeline (FlashPS §4.2, Algorithm 1's copy stream): a loader thread turns
//! one step's encoded blocks into tensors, block after block, while the engine thread computes.
//! The engine reads them through [`StreamedKv`] (a `KvCache`), which waits only when the block it
//! needs next has not arrived yet.
//!
//! Blocks are produced block-major across all requests of the step (block b of every request,
//! then block b + 1), the order in which the mask-aware forward consumes them, so a bounded
//! channel per request (`lookahead` blocks, like a ring of pinned buffers on a GPU) never stalls
//! the pipeline. On CPU the "load" is decoding from the local tier (dtype conversion and copy);
//! on a GPU with a [`GpuCopy`] the thread queues a copy from pinned memory on a copy stream and
//! the engine thread decodes on the device once the copy's event fires.
use super::entry::TemplateEntry;
use super::gpu_copy::{DeviceBlock, GpuCopy};
use diffmesh_model::flux::kv_codec::decode_block;
use diffmesh_model::flux::{KvCache, KvFormat};
use diffmesh_model::tch::{Device, Kind, Tensor};
use diffmesh_model::{ModelError, Result};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A block as the loader hands it over: decoded on the host, or on its way to the device.
enum Loaded {
    Host(Tensor, Tensor),
    Device(DeviceBlock),
}

type Block = std::result::Result<Loaded, String>;

/// One request's part of a step's load: its cache, step, the format each block is read in, and
/// where the blocks go.
struct LoadPart {
    entry: Arc<TemplateEntry>,
    step: usize,
    formats: Arc<[KvFormat]>,
    tx: SyncSender<Block>,
}

/// One step's load: for each request, its part; blocks `from_block..blocks`.
struct LoadJob {
    parts: Vec<LoadPart>,
    from_block: usize,
    blocks: usize,
    kind: Kind,
    device: Device,
}

/// What the loader measured (for the planner's load-cost model and for metrics).
#[derive(Debug, Clone, Copy, Default)]
pub struct LoadStats {
    pub blocks: u64,
    pub bytes: u64,
    pub seconds: f64,
}

impl LoadStats {
    /// Measured load bandwidth, bytes per second (None before any load).
    pub fn bytes_per_second(&self) -> Option<f64> {
        (self.seconds > 0.0).then(|| self.bytes as f64 / self.seconds)
    }
}

/// The loader thread. Dropping it ends the thread once queued loads finish.
pub struct KvLoader {
    tx: Option<mpsc::Sender<LoadJob>>,
    thread: Option<std::thread::JoinHandle<()>>,
    lookahead: usize,
    stats: Arc<Mutex<LoadStats>>,
}

impl KvLoader {
    /// Start the thread; `lookahead` bounds the blocks decoded ahead per request. With `gpu`,
    /// loads for its device go through its copy stream.
    pub fn spawn(lookahead: usize, gpu: Option<Arc<GpuCopy>>) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<LoadJob>();
        let stats = Arc::new(Mutex::new(LoadStats::default()));
        let thread_stats = stats.clone();
        let thread = std::thread::Builder::new()
            .name("kv-loader".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    run_job(job, gpu.as_ref(), &thread_stats);
                }
            })?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            lookahead: lookahead.max(1),
            stats,
        })
    }

    /// Start streaming blocks `from_block..` of `step` of each cache, every block in the
    /// layout's first format; one [`StreamedKv`] per part, in order. Tensors arrive as `kind`
    /// on `device`.
    pub fn load_step(
        &self,
        parts: Vec<(Arc<TemplateEntry>, usize)>,
        from_block: usize,
        kind: Kind,
        device: Device,
    ) -> Vec<StreamedKv> {
        let parts = parts
            .into_iter()
            .map(|(entry, step)| {
                let formats = vec![entry.layout.kv(); entry.blocks()];
                (entry, step, formats)
            })
            .collect();
        self.load_step_as(parts, from_block, kind, device)
    }

    /// [`Self::load_step`] with the format each block of each part is read in (the three-way
    /// planner's choice of K/V or Y per block; a format its cache does not hold fails that
    /// block's read).
    pub fn load_step_as(
        &self,
        parts: Vec<(Arc<TemplateEntry>, usize, Vec<KvFormat>)>,
        from_block: usize,
        kind: Kind,
        device: Device,
    ) -> Vec<StreamedKv> {
        let blocks = parts.iter().map(|(e, _, _)| e.blocks()).max().unwrap_or(0);
        let mut caches = Vec::with_capacity(parts.len());
        let mut job_parts = Vec::with_capacity(parts.len());
        for (entry, step, formats) in parts {
            let (tx, rx) = mpsc::sync_channel(self.lookahead);
            let formats: Arc<[KvFormat]> = formats.into();
            let mut reads: Vec<KvFormat> = Vec::new();
            for &f in formats.iter().skip(from_block) {
                if !reads.contains(&f) {
                    reads.push(f);
                }
            }
            caches.push(StreamedKv {
                rx: Mutex::new(rx),
                formats: formats.clone(),
                reads,
                primary: entry.layout.kv(),
                kind,
                next: Mutex::new(from_block),
                waited: Mutex::new(Duration::ZERO),
            });
            job_parts.push(LoadPart {
                entry,
                step,
                formats,
                tx,
            });
        }
        let job = LoadJob {
            parts: job_parts,
            from_block,
            blocks,
            kind,
            device,
        };
        if let Some(tx) = &self.tx {
            // A closed channel means the thread died; every StreamedKv then reports it on read.
            let _ = tx.send(job);
        }
        caches
    }

    pub fn stats(&self) -> LoadStats {
        self.stats.lock().map(|s| *s).unwrap_or_default()
    }
}

impl Drop for KvLoader {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run_job(job: LoadJob, gpu: Option<&Arc<GpuCopy>>, stats: &Mutex<LoadStats>) {
    let gpu = gpu.filter(|g| g.device() == job.device);
    let mut open: Vec<bool> = vec![true; job.parts.len()];
    for block in job.from_block..job.blocks {
        for (i, part) in job.parts.iter().enumerate() {
            if !open[i] {
                continue;
            }
            let (entry, step, tx) = (&part.entry, part.step, &part.tx);
            let format = part
                .formats
                .get(block)
                .copied()
                .unwrap_or(entry.layout.kv());
            let started = Instant::now();
            let blob = block_bytes(entry, step, block, format);
            let loaded_bytes = blob.as_ref().map_or(0, |b| b.len() as u64);
            let result = match gpu {
                Some(gpu) => blob.and_then(|blob| gpu.upload(blob)).map(Loaded::Device),
                None => blob.and_then(|blob| load_blob(blob, job.kind, job.device)),
            };
            if let Ok(mut s) = stats.lock() {
                match gpu {
                    // The host only queued the copy: count the copies the GPU has timed.
                    Some(gpu) => {
                        let (blocks, bytes, seconds) = gpu.finished_copies();
                        s.blocks += blocks;
                        s.bytes += bytes;
                        s.seconds += seconds;
                    }
                    None => {
                        s.blocks += 1;
                        s.bytes += loaded_bytes;
                        s.seconds += started.elapsed().as_secs_f64();
                    }
                }
            }
            // The reader is gone (step failed or finished early): stop loading for it.
            if tx.send(result).is_err() {
                open[i] = false;
            }
        }
    }
}

fn block_bytes(
    entry: &TemplateEntry,
    step: usize,
    block: usize,
    format: KvFormat,
) -> Result<&[u8], String> {
    entry.block_as(step, block, format).ok_or_else(|| {
        format!(
            "cache {} ({}) has no step {step} block {block} as {}",
            entry.meta.cache_key,
            entry.layout.as_str(),
            format.as_str()
        )
    })
}

/// One encoded block decoded on the host, as `kind` on `device`.
fn load_blob(blob: &[u8], kind: Kind, device: Device) -> Block {
    let (k, v) = decode_blob(blob, kind, device)?;
    Ok(Loaded::Host(k, v))
}

fn decode_blob(
    blob: &[u8],
    kind: Kind,
    device: Device,
) -> std::result::Result<(Tensor, Tensor), String> {
    let (k, v, _) = decode_block(blob, kind).map_err(|e| e.to_string())?;
    let on = |t: Tensor| t.f_to_device(device).map_err(|e| e.to_string());
    Ok((on(k)?, on(v)?))
}

/// Block `block` of `step` decoded on the host, as `kind` on `device`.
fn decode_on(
    entry: &TemplateEntry,
    step: usize,
    block: usize,
    kind: Kind,
    device: Device,
) -> std::result::Result<(Tensor, Tensor), String> {
    decode_blob(
        block_bytes(entry, step, block, entry.layout.kv())?,
        kind,
        device,
    )
}

/// One step of a resident cache, each block decoded when attention asks for it, on the
/// reader's own thread: what a rank of `--ranks` reads (every member of a group its own
/// copy, on its own device), where no loader thread streams ahead.
pub struct StepKv {
    entry: Arc<TemplateEntry>,
    step: usize,
    kind: Kind,
    device: Device,
}

impl StepKv {
    pub fn new(entry: Arc<TemplateEntry>, step: usize, kind: Kind, device: Device) -> Self {
        Self {
            entry,
            step,
            kind,
            device,
        }
    }
}

impl KvCache for StepKv {
    fn block_kv(&self, block: usize) -> Result<(Tensor, Tensor)> {
        decode_on(&self.entry, self.step, block, self.kind, self.device)
            .map_err(|message| ModelError::input("cache", message))
    }

    fn format(&self) -> KvFormat {
        self.entry.layout.kv()
    }
}

/// One request's K/V of one step, arriving block by block from the loader thread.
pub struct StreamedKv {
    rx: Mutex<Receiver<Block>>,
    /// The format each block is read in.
    formats: Arc<[KvFormat]>,
    /// The formats of the blocks this step reads (those from its first streamed block on).
    reads: Vec<KvFormat>,
    /// The cache layout's first format (blocks past `formats`).
    primary: KvFormat,
    /// What blocks decoded on the device become.
    kind: Kind,
    next: Mutex<usize>,
    waited: Mutex<Duration>,
}

impl StreamedKv {
    /// Time the compute side spent waiting for blocks (pipeline bubbles).
    pub fn waited(&self) -> Duration {
        self.waited.lock().map(|w| *w).unwrap_or_default()
    }
}

impl KvCache for StreamedKv {
    fn block_kv(&self, block: usize) -> Result<(Tensor, Tensor)> {
        let mut next = self
            .next
            .lock()
            .map_err(|_| ModelError::input("cache", "loader state poisoned"))?;
        if block != *next {
            return Err(ModelError::input(
                "cache",
                format!(
                    "blocks must be read in order: expected {}, got {block}",
                    *next
                ),
            ));
        }
        let started = Instant::now();
        let got = self
            .rx
            .lock()
            .map_err(|_| ModelError::input("cache", "loader state poisoned"))?
            .recv();
        if let Ok(mut w) = self.waited.lock() {
            *w += started.elapsed();
        }
        *next += 1;
        match got {
            Ok(Ok(Loaded::Host(k, v))) => Ok((k, v)),
            Ok(Ok(Loaded::Device(block))) => block
                .decode(self.kind)
                .map_err(|message| ModelError::input("cache", message)),
            Ok(Err(message)) => Err(ModelError::input("cache", message)),
            Err(_) => Err(ModelError::input("cache", "the loader thread stopped")),
        }
    }

    fn format(&self) -> KvFormat {
        self.primary
    }

    fn block_format(&self, block: usize) -> KvFormat {
        self.formats.get(block).copied().unwrap_or(self.primary)
    }

    fn formats(&self) -> Vec<KvFormat> {
        match self.reads.is_empty() {
            true => vec![self.primary],
            false => self.reads.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diffmesh_model::flux::kv_codec::{encode_block, CacheDtype};
    use diffmesh_shared::wire::templates::{pack_step, CacheMeta};

    /// A cache whose (step, block) K is filled with `100 * step + block`.
    fn entry(steps: usize, blocks: usize) -> Arc<TemplateEntry> {
        let entries: Vec<bytes::Bytes> = (0..steps)
            .map(|s| {
                let blocks: Vec<Vec<u8>> = (0..blocks)
                    .map(|b| {
                        let k =
                            Tensor::full([3, 4], (100 * s + b) as f64, (Kind::Float, Device::Cpu));
                        encode_block(&k, &k, KvFormat::Raw, CacheDtype::F32).unwrap()
                    })
                    .collect();
                bytes::Bytes::from(pack_step(&blocks))
            })
            .collect();
        let meta = CacheMeta {
            cache_key: "k".into(),
            steps: steps as u32,
            blocks: blocks as u32,
            bytes: entries.iter().map(|e| e.len() as u64).sum(),
            format: "raw".into(),
            dtype: "f32".into(),
        };
        Arc::new(TemplateEntry::new(meta, entries).unwrap())
    }

    #[test]
    fn streams_each_requests_step_in_block_order() {
        let loader = KvLoader::spawn(1, None).unwrap();
        let e = entry(3, 5);
        let caches = loader.load_step(vec![(e.clone(), 2), (e, 0)], 1, Kind::Float, Device::Cpu);
        // Consume as the forward does: block-major across requests.
        for block in 1..5 {
            for (c, step) in caches.iter().zip([2usize, 0]) {
                let (k, _) = c.block_kv(block).unwrap();
                assert_eq!(k.double_value(&[0, 0]), (100 * step + block) as f64);
            }
        }
        let err = caches[0].block_kv(1).unwrap_err().to_string();
        assert!(err.contains("in order"), "{err}");
        let s = loader.stats();
        assert_eq!(s.blocks, 8);
        assert!(s.bytes > 0);
    }

    #[test]
    fn an_abandoned_step_does_not_stall_the_next() {
        let loader = KvLoader::spawn(1, None).unwrap();
        let e = entry(2, 6);
        let first = loader.load_step(vec![(e.clone(), 0)], 0, Kind::Float, Device::Cpu);
        let _ = first[0].block_kv(0).unwrap();
        drop(first); // the step failed after one block
        let second = loader.load_step(vec![(e, 1)], 0, Kind::Float, Device::Cpu);
        for b in 0..6 {
            assert_eq!(
                second[0].block_kv(b).unwrap().0.double_value(&[0, 0]),
                (100 + b) as f64
            );
        }
    }

    /// The GPU path (pinned entry, copy stream, a ring of two device buffers reused many times,
    /// decode on the device) streams what the host decodes, also after an abandoned step. Run
    /// where a GPU is: `cargo test -p diffmesh-denoiser --lib -- --ignored gpu_copy`.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_copy_streams_what_the_host_decodes() {
        use super::super::gpu_copy::GpuCopy;
        use diffmesh_model::flux::kv_codec::decode_block;
        let gpu = GpuCopy::new(0, 2).unwrap();
        let e = Arc::new(gpu.pin(&entry(3, 5)).unwrap());
        let loader = KvLoader::spawn(1, Some(gpu)).unwrap();
        let cuda = Device::Cuda(0);
        let first = loader.load_step(vec![(e.clone(), 0)], 0, Kind::Float, cuda);
        let _ = first[0].block_kv(0).unwrap();
        drop(first);
        for _ in 0..3 {
            let caches =
                loader.load_step(vec![(e.clone(), 2), (e.clone(), 0)], 1, Kind::Float, cuda);
            for block in 1..5 {
                for (c, step) in caches.iter().zip([2usize, 0]) {
                    let (k, v) = c.block_kv(block).unwrap();
                    assert_eq!(k.device(), cuda);
                    let (hk, hv, _) =
                        decode_block(e.block(step, block).unwrap(), Kind::Float).unwrap();
                    assert!(
                        k.to_device(Device::Cpu).equal(&hk),
                        "step {step} block {block}"
                    );
                    assert!(
                        v.to_device(Device::Cpu).equal(&hv),
                        "step {step} block {block}"
                    );
                }
            }
        }
        // Bandwidth from the GPU's timings of the copies done so far.
        let s = loader.stats();
        assert!(s.blocks > 0 && s.bytes > 0 && s.seconds > 0.0, "{s:?}");
    }

    #[test]
    fn a_missing_step_is_an_error_naming_the_cache() {
        let loader = KvLoader::spawn(2, None).unwrap();
        let caches = loader.load_step(vec![(entry(1, 2), 5)], 0, Kind::Float, Device::Cpu);
        let err = caches[0].block_kv(0).unwrap_err().to_string();
        assert!(err.contains("no step 5"), "{err}");
    }
}
