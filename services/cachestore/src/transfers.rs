//! Large values being read in ranges (`CacheGetReply::Ranged`): a get that offers ranges holds
//! the value here under a fresh transfer id, so every range of one read comes from the same
//! bytes whatever the tiers evict meanwhile. A transfer ends once its bytes have all been sent,
//! or when nobody reads it for a while; the total held is bounded in bytes, the oldest going
//! first (a reader that finds its transfer gone reads the value through the object store). A value read from the memory tier shares its buffer with
//! it: holding it costs memory only once the tier has evicted it.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use moka::policy::EvictionPolicy;
use moka::sync::Cache;

/// How long a transfer stays after its last range was read.
const IDLE: Duration = Duration::from_secs(30);

struct Transfer {
    value: Bytes,
    /// Bytes sent so far (a range asked twice counts twice: the transfer may end early, and
    /// the reader then falls back).
    sent: AtomicU64,
}

pub struct Transfers {
    held: Cache<String, Arc<Transfer>>,
    capacity_bytes: u64,
    next: AtomicU64,
}

impl Transfers {
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            held: Cache::builder()
                // LRU admits every new transfer (the default TinyLFU may refuse one that has
                // to evict others), pushing out the least recently read.
                .eviction_policy(EvictionPolicy::lru())
                .max_capacity(capacity_bytes)
                .weigher(|_: &String, t: &Arc<Transfer>| -> u32 {
                    t.value.len().try_into().unwrap_or(u32::MAX)
                })
                .time_to_idle(IDLE)
                .build(),
            capacity_bytes,
            next: AtomicU64::new(0),
        }
    }

    /// Whether a value of `len` bytes may be held: half the capacity at most, so one transfer
    /// never evicts all the others.
    pub fn fits(&self, len: usize) -> bool {
        len as u64 <= self.capacity_bytes / 2
    }

    /// Hold `value` for a ranged read (check [`Transfers::fits`] first): its transfer id.
    pub fn begin(&self, value: Bytes) -> String {
        let id = self.next.fetch_add(1, Ordering::Relaxed).to_string();
        let transfer = Transfer {
            value,
            sent: AtomicU64::new(0),
        };
        self.held.insert(id.clone(), Arc::new(transfer));
        id
    }

    /// Bytes `offset .. offset + len` of a transfer. `Err(None)`: no such transfer (expired);
    /// `Err(Some(why))`: a range outside the value.
    pub fn range(&self, transfer: &str, offset: u64, len: u64) -> Result<Bytes, Option<String>> {
        let held = self.held.get(transfer).ok_or(None)?;
        let size = held.value.len() as u64;
        let Some(end) = offset.checked_add(len).filter(|&end| end <= size) else {
            return Err(Some(format!(
                "range {offset}+{len} is outside the value's {size} bytes"
            )));
        };
        let bytes = held.value.slice(offset as usize..end as usize);
        if held.sent.fetch_add(len, Ordering::Relaxed) + len >= size {
            self.held.invalidate(transfer);
        }
        Ok(bytes)
    }

    /// Transfers held now (after pending evictions ran).
    #[cfg(test)]
    fn count(&self) -> u64 {
        self.held.run_pending_tasks();
        self.held.entry_count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_slice_the_held_value_and_refuse_outside_it() {
        let t = Transfers::new(1 << 20);
        let id = t.begin(Bytes::from_static(b"0123456789"));
        assert_eq!(t.range(&id, 2, 3).unwrap(), Bytes::from_static(b"234"));
        assert!(matches!(t.range(&id, 8, 3), Err(Some(_))));
        assert!(matches!(t.range(&id, u64::MAX, 2), Err(Some(_))));
        assert_eq!(t.range("no-such", 0, 1), Err(None));
        let other = t.begin(Bytes::from_static(b"x"));
        assert_ne!(id, other, "each read gets its own transfer");
    }

    #[test]
    fn a_transfer_ends_once_all_its_bytes_were_sent() {
        let t = Transfers::new(1 << 20);
        let id = t.begin(Bytes::from_static(b"0123456789"));
        t.range(&id, 5, 5).unwrap();
        t.range(&id, 0, 5).unwrap();
        assert_eq!(t.range(&id, 0, 1), Err(None));
        assert_eq!(t.count(), 0);
    }

    #[test]
    fn a_new_transfer_pushes_out_the_least_recently_read() {
        let t = Transfers::new(100);
        let old = t.begin(Bytes::from(vec![1u8; 40]));
        let recent = t.begin(Bytes::from(vec![2u8; 40]));
        t.range(&recent, 0, 1).unwrap();
        let new = t.begin(Bytes::from(vec![3u8; 40]));
        t.count();
        assert_eq!(t.range(&old, 0, 1), Err(None));
        assert!(t.range(&recent, 1, 1).is_ok() && t.range(&new, 0, 1).is_ok());
    }

    #[test]
    fn a_value_above_half_the_capacity_is_not_held() {
        let t = Transfers::new(40);
        assert!(!t.fits(21));
        assert!(t.fits(20));
    }
}
