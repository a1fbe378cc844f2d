//! Prefixes on their way: the blocks an admitted request's prefill will leave on its
//! prefill instance.
//!
//! Cache events tell the conductor what an instance holds once a prefill has run. In an
//! agent loop the next step of a session (the same prompt plus a tool result) often
//! arrives while the previous step is still queued: from the index alone the conductor
//! would price it as recomputing the previous step's tokens on every instance, think the
//! session's instance is busier than it is, and move the session away, where it really
//! does recompute them. But a request routed to an instance runs after what is already
//! queued there (FIFO), so the previous step's blocks will be there when it starts.
//!
//! Each admitted request with full blocks is keyed by its last full block. Block hashes
//! are chained (`PrefixHasher`: equal hashes at position `j` mean equal prefixes of
//! `j + 1` blocks); as a guard against ids that are not (a trace whose generator reuses
//! a document's ids under different system prompts), an entry also keeps its length and
//! its first block, and matches a later prompt only at the same position with the same
//! first block. A later prompt whose block `j` matches can reuse `j + 1` blocks on that
//! instance, if it runs there. Only the instance itself may count them: they are
//! not a fetch source until they are stored (the index says so then). An entry leaves
//! when its request's prefill ends (the cache events take over), or when the request is
//! cancelled or its instance removed.
//!
//! The same structure keeps the prefixes admitted fetches are bringing to their prefill
//! instance (`State::fetching`, one entry per fetch: block 0 to its last fetched block),
//! which the index learns only when the instance reports the blocks stored.

use hashbrown::HashMap;

use super::RequestId;
use crate::hash::BlockHash;
use crate::index::InstanceId;

#[derive(Debug, Clone, Copy)]
struct Entry {
    instance: InstanceId,
    rid: RequestId,
    /// Full blocks of the prompt.
    blocks: usize,
    first: BlockHash,
}

#[derive(Debug, Default)]
pub(crate) struct Pending {
    /// Last full block of an admitted prompt -> its entries.
    by_last: HashMap<BlockHash, Vec<Entry>>,
}

impl Pending {
    /// Request `rid` on `instance` will leave `blocks` (its full blocks, non-empty) there.
    pub fn add(&mut self, blocks: &[BlockHash], instance: InstanceId, rid: RequestId) {
        if let (Some(&first), Some(&last)) = (blocks.first(), blocks.last()) {
            self.by_last.entry(last).or_default().push(Entry { instance, rid, blocks: blocks.len(), first });
        }
    }

    pub fn remove(&mut self, last: BlockHash, rid: RequestId) {
        if let Some(v) = self.by_last.get_mut(&last) {
            v.retain(|e| e.rid != rid);
            if v.is_empty() {
                self.by_last.remove(&last);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.by_last.values().map(|v| v.len()).sum()
    }

    /// Every prefix of `blocks` longer than `floor` blocks that an admitted request will
    /// leave on an instance: calls `f(instance, blocks, request)` (in no particular
    /// order; an instance may be reported more than once: keep the longest).
    pub fn longest(&self, blocks: &[BlockHash], floor: usize, mut f: impl FnMut(InstanceId, usize, RequestId)) {
        if self.by_last.is_empty() {
            return;
        }
        let Some(&first) = blocks.first() else { return };
        if self.by_last.len() < blocks.len().saturating_sub(floor) {
            // fewer entries than positions to probe: check each entry instead
            for (last, v) in &self.by_last {
                for e in v {
                    if e.blocks > floor && e.blocks <= blocks.len() && blocks[e.blocks - 1] == *last && e.first == first
                    {
                        f(e.instance, e.blocks, e.rid);
                    }
                }
            }
            return;
        }
        for j in (floor..blocks.len()).rev() {
            if let Some(v) = self.by_last.get(&blocks[j]) {
                for e in v {
                    if e.blocks == j + 1 && e.first == first {
                        f(e.instance, j + 1, e.rid);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_prefix_per_instance_against_a_scan() {
        let h = |i: u64| i as BlockHash;
        let mut p = Pending::default();
        let prompt: Vec<BlockHash> = (0..6).map(h).collect();
        // request 1 on instance 7 will leave blocks 0..3, request 2 on 8 blocks 0..5
        p.add(&prompt[..3], 7, 1);
        p.add(&prompt[..5], 8, 2);
        p.add(&prompt[..2], 8, 3);
        // ids that are not chained: the same last block at another position, or after
        // another first block, is no match
        p.add(&[h(40), h(2)], 9, 4);
        p.add(&[h(41), h(1), h(2)], 9, 5);
        let mut seen: Vec<(InstanceId, usize)> = Vec::new();
        p.longest(&prompt, 0, |i, n, _| match seen.iter_mut().find(|s| s.0 == i) {
            Some(s) => s.1 = s.1.max(n),
            None => seen.push((i, n)),
        });
        seen.sort_unstable();
        assert_eq!(seen, vec![(7, 3), (8, 5)]);
        // the same with more entries than positions (the probing path)
        let mut q = Pending::default();
        for k in 0..20u64 {
            q.add(&[h(1000 + k)], 50, 100 + k);
        }
        q.add(&prompt[..3], 7, 1);
        q.add(&prompt[..5], 8, 2);
        let mut many = Vec::new();
        q.longest(&prompt, 0, |i, n, _| many.push((i, n)));
        many.sort_unstable();
        assert_eq!(many, vec![(7, 3), (8, 5)]);
        assert_eq!(q.len(), 22);
        let mut above = Vec::new();
        p.longest(&prompt, 3, |i, n, r| above.push((i, n, r)));
        above.sort_unstable();
        assert_eq!(above, vec![(8, 5, 2)]);
        p.remove(h(4), 2);
        p.remove(h(4), 99); // unknown: nothing
        let mut after = Vec::new();
        p.longest(&prompt, 0, |i, n, _| after.push((i, n)));
        after.sort_unstable();
        assert_eq!(after, vec![(7, 3), (8, 2)]);
        assert_eq!(p.len(), 4);
    }
}
