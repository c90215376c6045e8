//! A node's ranks (GF-DiT's workers): one thread per rank here on the CPU (one per device on
//! a GPU node), each owning its [`Endpoint`] and running the work submitted to it strictly in
//! submission order. That single ordered queue per rank is what makes the collectives of
//! overlapping groups safe: two ranks that share collectives were handed them in the same
//! order by the one policy that forms groups, and each runs them in that order.
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::shm::{Endpoint, World};

type Work = Box<dyn FnOnce(&mut Endpoint) + Send>;

/// Sizes of a node's world.
#[derive(Debug, Clone, Copy)]
pub struct RankConfig {
    pub ranks: usize,
    /// Floats in each rank's symmetric buffer.
    pub buffer_floats: usize,
    /// Floats per staged chunk (at most a quarter of the buffer).
    pub chunk_floats: usize,
    /// How long a collective waits for a silent peer before failing.
    pub timeout: Duration,
}

impl RankConfig {
    pub fn new(ranks: usize) -> Self {
        Self {
            ranks,
            buffer_floats: 4 << 20,
            chunk_floats: 64 << 10,
            timeout: Duration::from_secs(30),
        }
    }
}

/// The ranks of one node, each a thread with its ordered work queue.
pub struct Ranks {
    world: Arc<World>,
    queues: Vec<Option<mpsc::Sender<Work>>>,
    threads: Vec<Option<JoinHandle<()>>>,
}

impl Ranks {
    /// Set up the world once (the symmetric buffers and edge signals) and start a thread
    /// per rank.
    pub fn start(config: RankConfig) -> std::io::Result<Self> {
        let world = World::new(config.ranks, config.buffer_floats, config.timeout);
        let mut queues = Vec::with_capacity(config.ranks);
        let mut threads = Vec::with_capacity(config.ranks);
        for rank in 0..config.ranks {
            let (tx, rx) = mpsc::channel::<Work>();
            let mut endpoint = world.endpoint(rank, config.chunk_floats);
            let thread = std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn(move || {
                    while let Ok(work) = rx.recv() {
                        work(&mut endpoint);
                    }
                })?;
            queues.push(Some(tx));
            threads.push(Some(thread));
        }
        Ok(Self {
            world,
            queues,
            threads,
        })
    }

    pub fn world(&self) -> &Arc<World> {
        &self.world
    }

    pub fn len(&self) -> usize {
        self.queues.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queues.is_empty()
    }

    /// Queue `work` on `rank`, behind what was submitted to it before; its result comes back
    /// on the returned channel (closed without one when the rank has stopped).
    pub fn submit<T: Send + 'static>(
        &self,
        rank: usize,
        work: impl FnOnce(&mut Endpoint) -> T + Send + 'static,
    ) -> mpsc::Receiver<T> {
        let (tx, rx) = mpsc::channel();
        if let Some(Some(queue)) = self.queues.get(rank) {
            let _ = queue.send(Box::new(move |endpoint: &mut Endpoint| {
                let _ = tx.send(work(endpoint));
            }));
        }
        rx
    }

    /// Run `work` on every rank (each in its own order) and wait for all results, by rank.
    /// `None` for a rank that stopped.
    pub fn on_all<T: Send + 'static>(
        &self,
        work: impl Fn(&mut Endpoint) -> T + Clone + Send + 'static,
    ) -> Vec<Option<T>> {
        let pending: Vec<_> = (0..self.len())
            .map(|rank| self.submit(rank, work.clone()))
            .collect();
        pending.into_iter().map(|rx| rx.recv().ok()).collect()
    }

    /// Stop `rank`: its queue closes, its thread ends and it leaves the world (collectives
    /// that need it fail from then on).
    pub fn stop(&mut self, rank: usize) {
        if let Some(queue) = self.queues.get_mut(rank) {
            queue.take();
        }
        if let Some(Some(thread)) = self.threads.get_mut(rank).map(Option::take) {
            let _ = thread.join();
        }
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for rank in 0..self.queues.len() {
            self.stop(rank);
        }
    }
}
