//! Hot-prefix tracking and replica hints (the paper's hotspot migration).
//!
//! Every accepted decision that reuses a prefix counts one hit for that prefix (keyed by
//! its last reused block, which identifies the whole chain). Counts decay with a
//! half-life. `hints` proposes, for each prefix hit at least `min_hits` times whose every
//! prefill holder is busy, a copy from the least busy holder to the least busy prefill
//! instance that lacks it.

use hashbrown::HashMap;

use crate::hash::BlockHash;
use crate::index::InstanceId;

#[derive(Debug, Clone, PartialEq)]
pub struct ReplicationHint {
    /// The prefix's block hashes, in order.
    pub blocks: Vec<BlockHash>,
    pub from_instance: InstanceId,
    pub to_instance: InstanceId,
    /// Decayed hit count.
    pub hits: f64,
    pub from_queue_s: f64,
    pub to_queue_s: f64,
}

#[derive(Debug, Clone)]
struct Hot {
    score: f64,
    last_t: f64,
    blocks: Box<[BlockHash]>,
}

#[derive(Debug)]
pub(crate) struct HotTable {
    map: HashMap<BlockHash, Hot>,
    half_life_s: f64,
    capacity: usize,
}

impl HotTable {
    pub fn new(half_life_s: f64, capacity: usize) -> Self {
        HotTable { map: HashMap::new(), half_life_s, capacity }
    }

    fn decayed(&self, h: &Hot, now: f64) -> f64 {
        h.score * 0.5f64.powf(((now - h.last_t).max(0.0)) / self.half_life_s)
    }

    pub fn record(&mut self, prefix: &[BlockHash], now: f64) {
        let Some(&last) = prefix.last() else { return };
        if let Some(h) = self.map.get_mut(&last) {
            let s = h.score * 0.5f64.powf(((now - h.last_t).max(0.0)) / self.half_life_s);
            h.score = s + 1.0;
            h.last_t = h.last_t.max(now);
            return;
        }
        if self.map.len() >= self.capacity {
            // Forget everything cold; if that is not enough, start over (bounded memory).
            let hl = self.half_life_s;
            self.map.retain(|_, h| h.score * 0.5f64.powf(((now - h.last_t).max(0.0)) / hl) >= 2.0);
            if self.map.len() >= self.capacity {
                self.map.clear();
            }
        }
        self.map.insert(last, Hot { score: 1.0, last_t: now, blocks: prefix.into() });
    }

    /// (prefix blocks, decayed hits) of every prefix with at least `min_hits`, hottest first.
    pub fn hot(&self, now: f64, min_hits: f64) -> Vec<(Vec<BlockHash>, f64)> {
        let mut v: Vec<_> = self
            .map
            .values()
            .map(|h| (h, self.decayed(h, now)))
            .filter(|(_, s)| *s >= min_hits)
            .map(|(h, s)| (h.blocks.to_vec(), s))
            .collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }

    pub fn check(&self) -> Result<(), String> {
        if self.map.len() > self.capacity {
            return Err(format!("hot table holds {} prefixes, capacity {}", self.map.len(), self.capacity));
        }
        for (k, h) in &self.map {
            if h.blocks.last() != Some(k) || !h.score.is_finite() {
                return Err(format!("hot entry {k:#x} is inconsistent"));
            }
        }
        Ok(())
    }
}
