//! The shared-memory backend of group-free collectives, for ranks that are threads of one
//! process (a CPU node's `--ranks R`; a GPU backend sits behind the same `Collectives` trait).
//!
//! Set up once for the world ([`World::new`]): every rank owns a symmetric buffer every other
//! rank can read, and every ordered rank edge `(s, r)` owns two mailbox slots and an ack
//! counter. No per-group state exists. A message on an edge is a chunk the sender staged in
//! its own buffer: the sender writes the chunk's place in the edge's slot chosen by the parity
//! of the edge's sequence number (GF-DiT's per-edge phase bit) and publishes the sequence
//! number with release ordering; the receiver waits for exactly the next sequence number
//! (acquire), checks that the message belongs to the group it expects (the token), copies
//! the chunk out and acks it. The sender reuses a slot only after the ack of the message two
//! before, and a staged chunk's place in its buffer only after every receiver acked it.
//!
//! Correct under GF-DiT's pairwise-consistent ordering: any two ranks issue the collectives
//! they share in the same order (each rank runs its collectives from one ordered queue,
//! `ranks::Ranks`). A violation is detected, not silently mixed: the receiver names the group
//! the message was for. A peer that left the world, or stays silent past the world's
//! timeout, fails the collective with an error naming it; nothing waits forever.
use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::Error;

/// One rank's symmetric buffer: written by its owner only, read by peers only where a
/// published, not yet acked message points.
struct Region {
    cells: Box<[UnsafeCell<f32>]>,
}

// Safety: the mailbox protocol gives each range one writer (the owner, before publishing) and
// readers only between publish (release) and ack (release), which the owner waits for
// (acquire) before writing the range again.
unsafe impl Sync for Region {}

impl Region {
    fn new(len: usize) -> Self {
        Self {
            cells: (0..len).map(|_| UnsafeCell::new(0.0)).collect(),
        }
    }

    fn ptr(&self) -> *mut f32 {
        // `UnsafeCell<f32>` has the layout of `f32`.
        self.cells.as_ptr() as *mut f32
    }
}

/// One slot of an edge's double buffer.
#[derive(Default)]
struct Slot {
    /// Sequence number of the message in the slot (0: none yet); published last.
    seq: AtomicU64,
    /// The group the message belongs to (the collective instance's token with `seq`).
    group: AtomicU64,
    offset: AtomicU64,
    len: AtomicU64,
}

/// Everything the ranks of one world share, set up once.
pub struct World {
    size: usize,
    capacity: usize,
    regions: Vec<Region>,
    /// Per ordered edge `s * size + r`: its two slots.
    slots: Vec<[Slot; 2]>,
    /// Per ordered edge: the last sequence number its receiver consumed.
    acked: Vec<AtomicU64>,
    alive: Vec<AtomicBool>,
    timeout: Duration,
}

impl World {
    /// A world of `size` ranks, each with a symmetric buffer of `capacity` floats; a peer
    /// silent for `timeout` fails the collective waiting on it.
    pub fn new(size: usize, capacity: usize, timeout: Duration) -> Arc<Self> {
        assert!(size > 0, "a world needs a rank");
        Arc::new(Self {
            size,
            capacity,
            regions: (0..size).map(|_| Region::new(capacity)).collect(),
            slots: (0..size * size).map(|_| Default::default()).collect(),
            acked: (0..size * size).map(|_| AtomicU64::new(0)).collect(),
            alive: (0..size).map(|_| AtomicBool::new(true)).collect(),
            timeout,
        })
    }

    pub fn size(&self) -> usize {
        self.size
    }

    fn edge(&self, from: usize, to: usize) -> usize {
        from * self.size + to
    }

    /// Whether `rank` is still in the world.
    pub fn is_alive(&self, rank: usize) -> bool {
        self.alive[rank].load(Ordering::Acquire)
    }

    /// The endpoint of `rank` (one per rank: it holds the rank's sequence numbers).
    pub fn endpoint(self: &Arc<Self>, rank: usize, chunk: usize) -> Endpoint {
        assert!(
            rank < self.size,
            "rank {rank} outside a world of {}",
            self.size
        );
        // Room for at least four chunks in flight, so staging never waits on itself.
        let chunk = chunk.clamp(1, (self.capacity / 4).max(1));
        Endpoint {
            world: self.clone(),
            rank,
            sent: vec![0; self.size],
            seen: vec![0; self.size],
            staged: VecDeque::new(),
            head: 0,
            chunk,
        }
    }
}

/// A chunk staged in this rank's buffer, and the acks that free it.
struct Staged {
    start: usize,
    len: usize,
    /// `(peer, seq)`: freed once the peer acked `seq` on the edge to it.
    acks: Vec<(usize, u64)>,
}

/// One rank's side of the world: its own sequence numbers and staging ring. Used by one
/// thread (the rank's ordered queue), so it needs no locking of its own.
pub struct Endpoint {
    world: Arc<World>,
    rank: usize,
    /// Per peer: the last sequence number sent on the edge to it.
    sent: Vec<u64>,
    /// Per peer: the last sequence number received on the edge from it.
    seen: Vec<u64>,
    staged: VecDeque<Staged>,
    /// Where the next chunk is staged.
    head: usize,
    /// Largest chunk staged at once (floats).
    chunk: usize,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.world.alive[self.rank].store(false, Ordering::Release);
    }
}

impl Endpoint {
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> &Arc<World> {
        &self.world
    }

    /// Floats per staged chunk.
    pub fn chunk_len(&self) -> usize {
        self.chunk
    }

    /// Floats per chunk in a collective of `members` ranks: one round stages a chunk for
    /// each peer, and the ring must hold a round and the next with room to spare, or two
    /// ranks could each wait for room the other's acks would free.
    pub fn chunk_for(&self, members: usize) -> usize {
        self.chunk
            .min((self.world.capacity / (4 * members.max(1))).max(1))
    }

    /// Leave the world: collectives of the others that need this rank fail from now on.
    pub fn leave(self) {}

    /// Spin briefly, then yield, until `ready` holds; fails when `peer` left or stays silent.
    fn wait(&self, group: u64, peer: usize, mut ready: impl FnMut() -> bool) -> Result<(), Error> {
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            if ready() {
                return Ok(());
            }
            if !self.world.is_alive(peer) {
                // It may have published before leaving.
                if ready() {
                    return Ok(());
                }
                return Err(Error::PeerLeft { group, rank: peer });
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                // Ranks may outnumber cores: give the peer the core.
                std::thread::yield_now();
                // A yield can take a time slice on a loaded machine: look at the clock often.
                if spins.is_multiple_of(16) && started.elapsed() > self.world.timeout {
                    return Err(Error::Timeout {
                        group,
                        rank: peer,
                        waited: self.world.timeout,
                    });
                }
            }
        }
    }

    /// Fail at once when a member of the group has already left.
    pub(crate) fn check_members(&self, group: u64, ranks: &[usize]) -> Result<(), Error> {
        match ranks.iter().find(|&&r| !self.world.is_alive(r)) {
            Some(&rank) => Err(Error::PeerLeft { group, rank }),
            None => Ok(()),
        }
    }

    /// Whether `peer` is done with message `seq` this rank sent it (acked, or gone).
    fn freed(&self, peer: usize, seq: u64) -> bool {
        self.world.acked[self.world.edge(self.rank, peer)].load(Ordering::Acquire) >= seq
            || !self.world.is_alive(peer)
    }

    /// Room for `len` floats in the staging ring: frees chunks every receiver acked, waiting
    /// for acks when the ring is full. A place is taken only where it overlaps no chunk still
    /// staged (checked against each: "head caught up with the oldest chunk" reads the same
    /// for a full ring and an empty one, and zero-length chunks sit anywhere).
    fn alloc(&mut self, group: u64, len: usize) -> Result<usize, Error> {
        let cap = self.world.capacity;
        assert!(len <= cap / 2, "chunks are at most a quarter of the buffer");
        loop {
            while let Some(front) = self.staged.front() {
                // A rank that left reads nothing more: its acks are not waited for.
                if front.acks.iter().all(|&(p, s)| self.freed(p, s)) {
                    self.staged.pop_front();
                } else {
                    break;
                }
            }
            if self.staged.is_empty() {
                self.head = 0;
            }
            for start in [self.head, 0] {
                let clear = start + len <= cap
                    && !self.staged.iter().any(|c| {
                        len > 0 && c.len > 0 && start < c.start + c.len && c.start < start + len
                    });
                if clear {
                    self.head = start;
                    return self.take(len);
                }
            }
            // Full: wait for the oldest chunk's receivers.
            let front = self.staged.front().expect("a full ring holds chunks");
            let (peer, seq) = *front
                .acks
                .iter()
                .find(|&&(p, s)| !self.freed(p, s))
                .expect("an unfreed chunk waits for an ack");
            let (world, me) = (self.world.clone(), self.rank);
            let freed = || {
                world.acked[world.edge(me, peer)].load(Ordering::Acquire) >= seq
                    || !world.is_alive(peer)
            };
            self.wait(group, peer, freed)?;
        }
    }

    fn take(&mut self, len: usize) -> Result<usize, Error> {
        let start = self.head;
        self.head += len;
        Ok(start)
    }

    /// Stage `data` once in this rank's buffer and post it to every rank in `to`.
    pub(crate) fn post(&mut self, group: u64, to: &[usize], data: &[f32]) -> Result<(), Error> {
        if to.is_empty() {
            return Ok(());
        }
        let start = self.alloc(group, data.len())?;
        // Safety: [start, start + len) is outside every chunk a peer may still read (alloc),
        // and only this rank writes its buffer.
        unsafe {
            let dst = self.world.regions[self.rank].ptr().add(start);
            std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len());
        }
        let mut acks = Vec::with_capacity(to.len());
        for &peer in to {
            let seq = self.sent[peer] + 1;
            // The slot last held message seq - 2: its receiver must have taken it.
            if seq > 2 {
                let (world, me) = (self.world.clone(), self.rank);
                self.wait(group, peer, || {
                    world.acked[world.edge(me, peer)].load(Ordering::Acquire) >= seq - 2
                })?;
            }
            let slot = &self.world.slots[self.world.edge(self.rank, peer)][(seq % 2) as usize];
            slot.group.store(group, Ordering::Relaxed);
            slot.offset.store(start as u64, Ordering::Relaxed);
            slot.len.store(data.len() as u64, Ordering::Relaxed);
            slot.seq.store(seq, Ordering::Release);
            self.sent[peer] = seq;
            acks.push((peer, seq));
        }
        self.staged.push_back(Staged {
            start,
            len: data.len(),
            acks,
        });
        Ok(())
    }

    /// Take the next message from `peer`, which must belong to `group`, and hand its data to
    /// `read` (it is acked when `read` returns).
    pub(crate) fn take_from(
        &mut self,
        group: u64,
        peer: usize,
        read: impl FnOnce(&[f32]) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let seq = self.seen[peer] + 1;
        let edge = self.world.edge(peer, self.rank);
        let world = self.world.clone();
        let slot = &world.slots[edge][(seq % 2) as usize];
        self.wait(group, peer, || slot.seq.load(Ordering::Acquire) == seq)?;
        let got = slot.group.load(Ordering::Relaxed);
        if got != group {
            return Err(Error::OutOfOrder {
                group,
                rank: peer,
                got,
            });
        }
        let offset = slot.offset.load(Ordering::Relaxed) as usize;
        let len = slot.len.load(Ordering::Relaxed) as usize;
        // Safety: published by the peer (acquired above) and not written again before our
        // ack below.
        let data = unsafe {
            std::slice::from_raw_parts(world.regions[peer].ptr().add(offset) as *const f32, len)
        };
        let result = read(data);
        self.seen[peer] = seq;
        world.acked[edge].store(seq, Ordering::Release);
        result
    }

    /// Floats still staged for receivers that have not taken them (tests, metrics).
    pub fn staged_len(&self) -> usize {
        self.staged.iter().map(|s| s.len).sum()
    }
}
