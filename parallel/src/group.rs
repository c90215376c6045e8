//! Logical execution groups (GF-DiT §4.3): a group is only a descriptor, the ordered ranks
//! taking part, an id the control plane gives it, and this rank's position in the order.
//! Creating one builds no communicator and allocates no per-group communication state: the
//! world's symmetric buffers and per-edge signals (`shm`) serve every group. So a policy may
//! form any group online, for one trajectory task, at the cost of this struct.
use std::sync::Arc;

use crate::Error;

/// One logical group as one of its ranks sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// Given by whoever forms the group (the node's policy); carried in every signal of its
    /// collectives, so a rank that meets another group's collective on an edge says so.
    pub id: u64,
    /// World ranks in group order: position `i` holds the `i`-th shard of a sharded tensor.
    pub ranks: Arc<[usize]>,
    /// This rank's position in `ranks`.
    pub position: usize,
}

impl Group {
    /// The descriptor of group `id` over `ranks` (in group order) for world rank `me`, in a
    /// world of `world` ranks. Refused: an empty group, a rank outside the world or named
    /// twice, or `me` not in it.
    pub fn new(id: u64, ranks: &[usize], me: usize, world: usize) -> Result<Self, Error> {
        if ranks.is_empty() {
            return Err(Error::BadGroup {
                id,
                reason: "has no ranks".into(),
            });
        }
        let mut seen = 0u128;
        for &r in ranks {
            if r >= world || r >= 128 {
                return Err(Error::BadGroup {
                    id,
                    reason: format!("names rank {r}, outside the world of {world}"),
                });
            }
            if seen & (1 << r) != 0 {
                return Err(Error::BadGroup {
                    id,
                    reason: format!("names rank {r} twice"),
                });
            }
            seen |= 1 << r;
        }
        let position = ranks
            .iter()
            .position(|&r| r == me)
            .ok_or_else(|| Error::BadGroup {
                id,
                reason: format!("does not contain rank {me}"),
            })?;
        Ok(Self {
            id,
            ranks: ranks.into(),
            position,
        })
    }

    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// This rank's world rank.
    pub fn me(&self) -> usize {
        self.ranks[self.position]
    }

    /// The other members, with their positions.
    pub fn peers(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.ranks
            .iter()
            .copied()
            .enumerate()
            .filter(move |&(i, _)| i != self.position)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_descriptor_knows_its_position_and_peers() {
        let g = Group::new(7, &[3, 1, 2], 1, 4).unwrap();
        assert_eq!((g.position, g.me(), g.size()), (1, 1, 3));
        assert_eq!(g.peers().collect::<Vec<_>>(), [(0, 3), (2, 2)]);
    }

    #[test]
    fn bad_groups_say_why() {
        let why = |ranks: &[usize], me| Group::new(1, ranks, me, 4).unwrap_err().to_string();
        assert!(why(&[], 0).contains("no ranks"));
        assert!(why(&[0, 4], 0).contains("rank 4, outside the world of 4"));
        assert!(why(&[0, 1, 0], 0).contains("rank 0 twice"));
        assert!(why(&[1, 2], 0).contains("does not contain rank 0"));
    }
}
