//! `BlockCache`: the metadata-only twin of the store for the trace simulator. It runs
//! the same eviction policy code over keys only (capacity in blocks, no bytes).

use super::error::StoreError;
use super::eviction::{policy_by_name, EvictionPolicy, Verdict, POLICY_NAMES};
use crate::hash::BlockHash;

/// What a cache operation did (for the simulator's index).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheEvent {
    Inserted(BlockHash),
    Evicted(BlockHash),
}

pub struct BlockCache {
    policy: Box<dyn EvictionPolicy>,
    capacity: usize,
    hits: u64,
    lookups: u64,
    evictions: u64,
}

impl BlockCache {
    /// A cache of `capacity` blocks (>= 1) with the policy named `eviction`.
    pub fn new(capacity: usize, eviction: &str) -> Result<Self, StoreError> {
        if capacity == 0 {
            return Err(StoreError::Invalid("capacity_blocks must be at least 1".into()));
        }
        let policy = policy_by_name(eviction, capacity).ok_or_else(|| {
            StoreError::Invalid(format!("unknown eviction policy {eviction:?}; expected one of {POLICY_NAMES:?}"))
        })?;
        Ok(BlockCache { policy, capacity, hits: 0, lookups: 0, evictions: 0 })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.policy.len()
    }

    pub fn is_empty(&self) -> bool {
        self.policy.is_empty()
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    pub fn contains(&self, key: BlockHash) -> bool {
        self.policy.contains(key)
    }

    /// Records one access to `key` (its own access batch); false if absent.
    pub fn touch(&mut self, key: BlockHash) -> bool {
        self.policy.begin_access();
        self.policy.touch(key)
    }

    /// Forgets `key`; returns whether it was cached.
    pub fn remove(&mut self, key: BlockHash) -> bool {
        self.policy.remove(key)
    }

    /// Length of the leading run of `keys` present; touches them as one access.
    pub fn lookup_prefix(&mut self, keys: &[BlockHash]) -> usize {
        self.policy.begin_access();
        let mut n = 0;
        for &k in keys {
            if !self.policy.touch(k) {
                break;
            }
            n += 1;
        }
        self.lookups += 1;
        self.hits += n as u64;
        n
    }

    /// Stores every key of the chain `keys` (position = index), touching those already
    /// present, in order, as one access; calls `on_event` for each insertion/eviction.
    pub fn insert_with(&mut self, keys: &[BlockHash], mut on_event: impl FnMut(CacheEvent)) {
        self.policy.begin_access();
        for (i, &k) in keys.iter().enumerate() {
            if self.policy.touch(k) {
                continue;
            }
            if self.policy.len() >= self.capacity {
                if let Some(v) = self.policy.evict(&mut |_| Verdict::Evicted) {
                    self.evictions += 1;
                    on_event(CacheEvent::Evicted(v));
                }
            }
            self.policy.insert(k, i.min(u32::MAX as usize) as u32);
            on_event(CacheEvent::Inserted(k));
        }
    }

    /// [`insert_with`](Self::insert_with), returning the evicted keys.
    pub fn insert(&mut self, keys: &[BlockHash]) -> Vec<BlockHash> {
        let mut out = Vec::new();
        self.insert_with(keys, |e| {
            if let CacheEvent::Evicted(k) = e {
                out.push(k)
            }
        });
        out
    }

    /// Total evictions so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// (blocks hit, lookup calls) summed over `lookup_prefix` calls.
    pub fn hit_counts(&self) -> (u64, u64) {
        (self.hits, self.lookups)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_arguments() {
        assert!(BlockCache::new(0, "lru").is_err());
        assert!(BlockCache::new(4, "nope").is_err());
    }

    #[test]
    fn capacity_is_respected_and_prefix_counts_leading_run() {
        for name in POLICY_NAMES {
            let mut c = BlockCache::new(4, name).unwrap();
            assert!(c.insert(&[1, 2, 3]).is_empty());
            assert_eq!(c.lookup_prefix(&[1, 2, 9, 3]), 2, "{name}");
            let ev = c.insert(&[5, 6, 7]);
            assert_eq!(ev.len(), 2, "{name}");
            assert_eq!(c.len(), 4);
            assert!(ev.iter().all(|k| !c.contains(*k)));
            if name != "s3fifo" {
                // (S3-FIFO lets one-hit blocks leave through its small queue first)
                assert!([5, 6, 7].iter().all(|&k| c.contains(k)), "{name}: a chain no longer than capacity stays");
            }
        }
    }

    #[test]
    fn prefix_policy_keeps_heads() {
        let mut c = BlockCache::new(4, "prefix").unwrap();
        c.insert(&[1, 2, 3, 4]);
        c.insert(&[10, 11]);
        // the tail of the older chain went first
        assert!(c.contains(1) && c.contains(2));
        assert!(!c.contains(3) && !c.contains(4));
        assert_eq!(c.lookup_prefix(&[1, 2, 3]), 2);
    }
}
