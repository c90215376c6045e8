//! GF-DiT's parallel runtime (issue 47): a node's ranks, logical execution groups and
//! group-free collectives.
//!
//! - [`ranks`]: one worker per rank (threads here on the CPU), each running its work in
//!   submission order.
//! - [`group`]: a logical group is a descriptor (ordered ranks, id, own position), made in
//!   well under a microsecond; no communicator is built per group.
//! - [`shm`]: the world set up once: a symmetric buffer per rank and double-buffered signal
//!   slots per ordered rank edge with per-edge sequence numbers (GF-DiT §4.4), so overlapping
//!   groups never mistake one collective's signal for another's.
//! - [`collectives`]: all-gather, all-to-all, reduce-scatter, send/recv and barrier on any
//!   group, staged in chunks.
//!
//! The Flux forward split over a group by sequence (Ulysses, ring attention) and CFG
//! parallelism use these collectives (`diffmesh_model::flux::sequence_parallel`,
//! `cfg_parallel`, `elastic`), and the denoiser's elastic ranks (`--ranks`) run every
//! denoising step on a group its policy forms. Still to come: a GPU backend (CUDA IPC or NCCL
//! through cudarc) behind the same [`collectives::Collectives`] trait.
pub mod collectives;
pub mod group;
pub mod ranks;
pub mod shm;

pub use collectives::Collectives;
pub use group::Group;
pub use ranks::{RankConfig, Ranks};

use std::time::Duration;

/// Why a group or a collective failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    #[error("group {id} {reason}")]
    BadGroup { id: u64, reason: String },
    #[error("collective on group {group}: rank {rank} has left the world")]
    PeerLeft { group: u64, rank: usize },
    #[error("collective on group {group}: no word from rank {rank} within {waited:?}")]
    Timeout {
        group: u64,
        rank: usize,
        waited: Duration,
    },
    #[error(
        "collective on group {group}: rank {rank}'s next message on the shared edge is for \
         group {got}: the two ranks issued their shared collectives in different orders"
    )]
    OutOfOrder { group: u64, rank: usize, got: u64 },
    #[error("collective on group {group}: {what}")]
    Shape { group: u64, what: String },
}
