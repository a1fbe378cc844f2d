//! Prefix-aware eviction: the oldest access batch goes first, and within it the block
//! with the highest chain position (the tail of a chain before its head).

use std::collections::BTreeSet;

use hashbrown::HashMap;

use super::{EvictionPolicy, Verdict};
use crate::hash::BlockHash;

/// Order key: (batch, u32::MAX - position, key); the smallest is evicted first.
type Rank = (u64, u32, BlockHash);

pub struct PrefixAware {
    batch: u64,
    order: BTreeSet<Rank>,
    /// key -> (batch of its last access, chain position)
    meta: HashMap<BlockHash, (u64, u32)>,
}

impl PrefixAware {
    pub fn new() -> Self {
        PrefixAware { batch: 0, order: BTreeSet::new(), meta: HashMap::new() }
    }

    fn rank(key: BlockHash, batch: u64, position: u32) -> Rank {
        (batch, u32::MAX - position, key)
    }
}

impl Default for PrefixAware {
    fn default() -> Self {
        Self::new()
    }
}

impl EvictionPolicy for PrefixAware {
    fn name(&self) -> &'static str {
        "prefix"
    }

    fn begin_access(&mut self) {
        self.batch += 1;
    }

    fn insert(&mut self, key: BlockHash, position: u32) {
        if let Some((b, p)) = self.meta.insert(key, (self.batch, position)) {
            self.order.remove(&Self::rank(key, b, p));
        }
        self.order.insert(Self::rank(key, self.batch, position));
    }

    fn touch(&mut self, key: BlockHash) -> bool {
        let Some(m) = self.meta.get_mut(&key) else {
            return false;
        };
        let (b, p) = *m;
        if b != self.batch {
            self.order.remove(&Self::rank(key, b, p));
            m.0 = self.batch;
            self.order.insert(Self::rank(key, self.batch, p));
        }
        true
    }

    fn remove(&mut self, key: BlockHash) -> bool {
        match self.meta.remove(&key) {
            Some((b, p)) => {
                self.order.remove(&Self::rank(key, b, p));
                true
            }
            None => false,
        }
    }

    fn contains(&self, key: BlockHash) -> bool {
        self.meta.contains_key(&key)
    }

    fn len(&self) -> usize {
        self.meta.len()
    }

    fn evict(&mut self, judge: &mut dyn FnMut(BlockHash) -> Verdict) -> Option<BlockHash> {
        let mut gone = Vec::new();
        let mut found = None;
        for &rank in self.order.iter() {
            match judge(rank.2) {
                Verdict::Keep => {}
                Verdict::Gone => gone.push(rank),
                Verdict::Evicted => {
                    found = Some(rank);
                    break;
                }
            }
        }
        for r in gone.into_iter().chain(found) {
            self.order.remove(&r);
            self.meta.remove(&r.2);
        }
        found.map(|r| r.2)
    }
}
