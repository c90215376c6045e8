//! The GPU side of the streamed cache pipeline (FlashPS §4.2, Algorithm 1's copy stream).
//!
//! A GPU denoiser keeps its local tier in pinned host memory ([`GpuCopy::pin`]), so a copy to
//! the device is a DMA that runs beside the compute. The loader thread copies each encoded block
//! into one buffer of a small device ring on a non-blocking stream of its own (cudarc), records
//! an event, and hands the block on; the engine thread makes the compute stream (libtorch's, the
//! legacy default stream) wait on that event, not the host, and decodes the block on the device
//! ([`decode_block_bytes`], the same decode CPU tests check against the host one). Only the
//! narrow stored form (bf16 or fp8) crosses the bus.
//!
//! Ordering, all on the GPU's side: the copy into a ring buffer waits for the event the compute
//! recorded after decoding the buffer's previous block; the decode waits for the copy. A buffer
//! freshly taken from libtorch's allocator first waits for everything already queued on the
//! compute stream (the memory may have been freed by work still queued there). Pinned memory is
//! freed only after the copy stream has drained.
//!
//! An fp8 block wanted in bf16 decodes in one fused kernel ([`super::fused_decode`]) where
//! NVRTC loads; every other block, and every block where it does not, through tch.
//!
//! Without a GPU nothing here runs: the CPU loader decodes on the host, and the decode itself is
//! the shared, tested part.
use cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaStream, DriverError, PinnedHostSlice,
};
use diffmesh_model::flux::kv_codec::{decode_block_bytes, read_header, BlobHeader};
use diffmesh_model::tch::{Device, Kind, Tensor};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};

use super::entry::TemplateEntry;
use super::fused_decode::Fp8Decoder;

fn cuda(e: DriverError) -> String {
    format!("CUDA: {e:?}")
}

/// A returned ring buffer, with the compute's event after its last reader (none: never read).
struct Free {
    slot: usize,
    released: Option<CudaEvent>,
}

/// The copy stream, its device ring, and the pinned-memory allocator of one GPU.
pub struct GpuCopy {
    ctx: Arc<CudaContext>,
    copy: Arc<CudaStream>,
    /// libtorch's stream: the legacy default stream (tch never switches streams).
    compute: Arc<CudaStream>,
    device: Device,
    /// Device buffers (u8), grown to the largest block seen.
    ring: Vec<Mutex<Option<Tensor>>>,
    free_tx: Sender<Free>,
    free_rx: Mutex<Receiver<Free>>,
    /// Copies queued with timing events (start, end, bytes), oldest first: the planner's load
    /// bandwidth comes from the GPU's own clock, not the host's queueing.
    timed: Mutex<VecDeque<(CudaEvent, CudaEvent, u64)>>,
    /// The fused fp8 -> bf16 decode (None where NVRTC did not load).
    fp8: Option<Fp8Decoder>,
    /// Whether blocks use `fp8` (benchmarks turn it off to compare).
    fused: AtomicBool,
}

impl std::fmt::Debug for GpuCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuCopy")
            .field("device", &self.device)
            .field("ring", &self.ring.len())
            .finish()
    }
}

impl GpuCopy {
    /// Device buffers a denoiser's ring holds: blocks copied ahead of the compute, over all
    /// requests of a step.
    pub const RING: usize = 8;

    /// The copy stream and a ring of `ring` device buffers on CUDA device `ordinal` (the
    /// primary context, which libtorch uses too). Fails where no CUDA driver answers.
    pub fn new(ordinal: usize, ring: usize) -> Result<Arc<Self>, String> {
        // cudarc panics when it cannot load libcuda: that is an error here, not a crash.
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| "the CUDA driver library (libcuda) could not be loaded".to_string())?
            .map_err(cuda)?;
        let copy = ctx.new_stream().map_err(cuda)?;
        let compute = ctx.default_stream();
        let (free_tx, free_rx) = mpsc::channel();
        let ring = ring.max(1);
        let fp8 = Fp8Decoder::load(&ctx)
            .inspect_err(|e| {
                tracing::warn!(error = %e, "fused fp8 cache decode unavailable: decoding through tch")
            })
            .ok();
        for slot in 0..ring {
            let _ = free_tx.send(Free {
                slot,
                released: None,
            });
        }
        Ok(Arc::new(Self {
            ctx,
            copy,
            compute,
            device: Device::Cuda(ordinal),
            ring: (0..ring).map(|_| Mutex::new(None)).collect(),
            free_tx,
            free_rx: Mutex::new(free_rx),
            timed: Mutex::new(VecDeque::new()),
            fused: AtomicBool::new(fp8.is_some()),
            fp8,
        }))
    }

    /// A timing event recorded on the compute stream now (`None` where the driver refuses):
    /// two of them time the work queued between on the GPU's clock.
    pub fn compute_mark(&self) -> Option<CudaEvent> {
        self.ctx.bind_to_thread().ok()?;
        self.compute
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .ok()
    }

    /// Decode fp8 blocks wanted in bf16 with the fused kernel (`true`, where it loaded) or
    /// through tch (`false`). Returns whether the kernel is now in use.
    pub fn use_fused_kernels(&self, on: bool) -> bool {
        let on = on && self.fp8.is_some();
        self.fused.store(on, Ordering::Relaxed);
        on
    }

    /// Free and total memory of this device, in bytes (the driver's count, all processes).
    pub fn mem_get_info(&self) -> Result<(u64, u64), String> {
        let (free, total) = self.ctx.mem_get_info().map_err(cuda)?;
        Ok((free as u64, total as u64))
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// A copy of `entry` whose step entries live in pinned host memory (so copies from it
    /// overlap the compute). Runs on the caller's thread: a memcpy of the whole cache.
    pub fn pin(&self, entry: &TemplateEntry) -> Result<TemplateEntry, String> {
        self.ctx.bind_to_thread().map_err(cuda)?;
        let mut steps = Vec::with_capacity(entry.steps());
        for bytes in entry.step_entries() {
            // Plain (cacheable) pinned memory: the host still reads headers and re-stores
            // captures from it, which write-combined memory would make slow.
            let pinned = unsafe {
                self.ctx
                    .alloc_pinned_with_flags::<u8>(bytes.len().max(1), 0)
            }
            .map_err(cuda)?;
            // `as_ptr` waits for cudarc's own event on this memory, which nothing records.
            let ptr = pinned.as_ptr().map_err(cuda)?;
            let owner = PinnedBytes {
                pinned: Some(pinned),
                ptr,
                len: bytes.len(),
                copy: self.copy.clone(),
            };
            // SAFETY: fresh allocation of at least `len` bytes, written once here, before any
            // reader exists.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr.cast_mut(), bytes.len());
            }
            steps.push(bytes::Bytes::from_owner(owner));
        }
        TemplateEntry::new(entry.meta.clone(), steps)
    }

    /// Start copying one encoded block to the device (loader thread). Blocks while every ring
    /// buffer holds a block the compute has not decoded yet.
    pub fn upload(self: &Arc<Self>, blob: &[u8]) -> Result<DeviceBlock, String> {
        let header = read_header(blob).map_err(|e| e.to_string())?;
        self.ctx.bind_to_thread().map_err(cuda)?;
        let Free { slot, released } = self
            .free_rx
            .lock()
            .map_err(|_| "GPU ring poisoned".to_string())?
            .recv()
            .map_err(|_| "GPU ring closed".to_string())?;
        // From here the slot goes back to the ring whatever happens.
        let mut block = DeviceBlock {
            gpu: self.clone(),
            slot,
            header,
            len: blob.len(),
            ready: None,
        };
        if let Some(e) = &released {
            if let Err(err) = self.copy.wait(e) {
                // The slot goes back unordered: its last decode must be done first.
                let _ = e.synchronize();
                return Err(cuda(err));
            }
        }
        let mut buf = self.ring[slot]
            .lock()
            .map_err(|_| "GPU ring poisoned".to_string())?;
        if buf
            .as_ref()
            .is_none_or(|b| (b.size()[0] as usize) < blob.len())
        {
            let fresh = Tensor::f_empty(
                [blob.len().next_power_of_two() as i64],
                (Kind::Uint8, self.device),
            )
            .map_err(|e| e.to_string())?;
            // The allocator may hand out memory that queued compute work still reads.
            self.copy.join(&self.compute).map_err(cuda)?;
            *buf = Some(fresh);
        }
        let dst = buf.as_ref().map_or(0, |b| b.data_ptr() as sys::CUdeviceptr);
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.copy.record_event(timing).map_err(cuda)?;
        // SAFETY: `dst` holds at least `blob.len()` bytes and no reader uses it until the event
        // below; `blob` lives in a pinned entry that the engine holds until the step is done
        // (and whose memory is freed only after this stream drains).
        unsafe { result::memcpy_htod_async(dst, blob, self.copy.cu_stream()) }.map_err(cuda)?;
        match self.copy.record_event(None) {
            Ok(ready) => block.ready = Some(ready),
            Err(e) => {
                // No event for the queued copy: it must be done before the slot goes back.
                let _ = self.copy.synchronize();
                return Err(cuda(e));
            }
        }
        // Timing only (a failure leaves the copy uncounted).
        if let (Ok(end), Ok(mut timed)) = (self.copy.record_event(timing), self.timed.lock()) {
            timed.push_back((start, end, blob.len() as u64));
        }
        Ok(block)
    }

    /// Copies completed since the last call: (blocks, bytes, seconds on the GPU's clock).
    pub fn finished_copies(&self) -> (u64, u64, f64) {
        let mut done = (0, 0, 0.0);
        let Ok(mut timed) = self.timed.lock() else {
            return done;
        };
        // One stream: copies complete in the order they were queued.
        while let Some((_, end, _)) = timed.front() {
            let complete = end.try_is_complete();
            if complete == Ok(false) {
                break;
            }
            let Some((start, end, bytes)) = timed.pop_front() else {
                break;
            };
            // A copy whose events report an error is dropped, not counted.
            if let (Ok(true), Ok(ms)) = (complete, start.elapsed_ms(&end)) {
                done.0 += 1;
                done.1 += bytes;
                done.2 += f64::from(ms) / 1e3;
            }
        }
        done
    }
}

/// One block on its way to (or in) a ring buffer.
pub struct DeviceBlock {
    gpu: Arc<GpuCopy>,
    slot: usize,
    header: BlobHeader,
    len: usize,
    /// The copy's completion (None until the copy is queued).
    ready: Option<CudaEvent>,
}

impl DeviceBlock {
    /// Decode on the device (engine thread): the compute stream waits for the copy, the
    /// decode writes fresh tensors, and the buffer goes back to the ring.
    pub fn decode(mut self, kind: Kind) -> Result<(Tensor, Tensor), String> {
        let gpu = self.gpu.clone();
        gpu.ctx.bind_to_thread().map_err(cuda)?;
        // `ready` stays with the block until the decode is queued: on an early return its
        // drop waits for the copy before the slot goes back.
        let ready = self.ready.as_ref().ok_or("block was never copied")?;
        gpu.compute.wait(ready).map_err(cuda)?;
        let kv = {
            let buf = gpu.ring[self.slot]
                .lock()
                .map_err(|_| "GPU ring poisoned".to_string())?;
            let raw = buf
                .as_ref()
                .ok_or("ring buffer missing")?
                .f_narrow(0, 0, self.len as i64)
                .map_err(|e| e.to_string())?;
            match &gpu.fp8 {
                Some(fp8)
                    if gpu.fused.load(Ordering::Relaxed)
                        && Fp8Decoder::serves(&self.header, kind) =>
                {
                    fp8.decode(&gpu.compute, &self.header, &raw)
                }
                _ => decode_block_bytes(&self.header, &raw, kind).map_err(|e| e.to_string()),
            }
        };
        match gpu.compute.record_event(None) {
            Ok(released) => self.give_back(Some(released)),
            Err(e) => {
                // No event to order the next copy after this decode: wait for it here.
                let synced = gpu.compute.synchronize();
                self.give_back(None);
                synced.map_err(cuda)?;
                return Err(cuda(e));
            }
        }
        kv
    }

    fn give_back(&mut self, released: Option<CudaEvent>) {
        let _ = self.gpu.free_tx.send(Free {
            slot: self.slot,
            released,
        });
        self.slot = usize::MAX;
    }
}

impl Drop for DeviceBlock {
    fn drop(&mut self) {
        if self.slot == usize::MAX {
            return;
        }
        // Never decoded (its step failed): the next copy into the buffer is ordered after this
        // one on the copy stream, so no event is needed; wait for the copy so the pinned source
        // may be freed.
        if let Some(ready) = self.ready.take() {
            let _ = ready.synchronize();
        }
        self.give_back(None);
    }
}

/// A pinned step entry, freed only once the copy stream has drained (a copy may still read it).
struct PinnedBytes {
    /// Owns the allocation (handed to the reaper on drop); read only through `ptr`.
    pinned: Option<PinnedHostSlice<u8>>,
    /// The allocation's start, non-null (checked by cudarc).
    ptr: *const u8,
    len: usize,
    copy: Arc<CudaStream>,
}

// SAFETY: `ptr` points into `pinned` (itself Send + Sync), which is only read after `pin`.
unsafe impl Send for PinnedBytes {}
unsafe impl Sync for PinnedBytes {}

impl AsRef<[u8]> for PinnedBytes {
    fn as_ref(&self) -> &[u8] {
        let p = self.ptr;
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `len` bytes of the allocation, initialised in `GpuCopy::pin`, never written
        // again, alive as long as `self`.
        unsafe { std::slice::from_raw_parts(p, self.len) }
    }
}

impl Drop for PinnedBytes {
    fn drop(&mut self) {
        if let Some(pinned) = self.pinned.take() {
            reap(pinned, self.copy.clone());
        }
    }
}

type Reaped = (PinnedHostSlice<u8>, Arc<CudaStream>);

/// Free pinned memory once its copy stream has drained, on a thread of its own: the last
/// holder of an evicted cache may be the engine thread, which must not wait for the GPU.
fn reap(pinned: PinnedHostSlice<u8>, copy: Arc<CudaStream>) {
    static REAPER: OnceLock<Option<Sender<Reaped>>> = OnceLock::new();
    let reaper = REAPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Reaped>();
        std::thread::Builder::new()
            .name("pinned-reaper".into())
            .spawn(move || {
                for (pinned, copy) in rx {
                    let _ = copy.synchronize();
                    drop(pinned);
                }
            })
            .ok()
            .map(|_| tx)
    });
    let unsent = match reaper {
        Some(tx) => tx.send((pinned, copy)).err().map(|e| e.0),
        None => Some((pinned, copy)),
    };
    // No reaper thread: wait here.
    if let Some((pinned, copy)) = unsent {
        let _ = copy.synchronize();
        drop(pinned);
    }
}
