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
//! Each admitted request's full blocks are indexed by position: a later prompt that
//! shares its first `j + 1` blocks with a queued one (the same block at position `j`:
//! block hashes are chained, `PrefixHasher`, so equal hashes at `j` mean equal prefixes
//! of `j + 1` blocks) can reuse those blocks on that instance, if it runs there. That
//! covers the next step of a session (which extends the queued prompt) and two requests
//! that branch from one prefix (a document asked two questions): both are priced as
//! reuse, not recompute. As a guard against ids that are not chained (a trace whose
//! generator reuses a document's ids under different system prompts), an entry also
//! keeps its position and the prompt's first block, and matches only at the same
//! position after the same first block. Only the instance itself may count them: they
//! are not a fetch source until they are stored (the index says so then). An entry
//! leaves when its request's prefill ends (the cache events take over), or when the
//! request is cancelled or its instance removed.

use hashbrown::HashMap;

use super::RequestId;
use crate::hash::BlockHash;
use crate::index::InstanceId;

#[derive(Debug, Clone, Copy)]
struct Entry {
    instance: InstanceId,
    rid: RequestId,
    /// The block's position in its prompt.
    pos: u32,
    first: BlockHash,
}

#[derive(Debug, Default)]
pub(crate) struct Pending {
    /// A full block of an admitted prompt -> where it will be left.
    by_block: HashMap<BlockHash, Vec<Entry>>,
    /// Each admitted request's full blocks (what `remove` takes out).
    by_rid: HashMap<RequestId, Box<[BlockHash]>>,
}

impl Pending {
    /// Request `rid` on `instance` will leave `blocks` (its full blocks) there.
    pub fn add(&mut self, blocks: &[BlockHash], instance: InstanceId, rid: RequestId) {
        let Some(&first) = blocks.first() else { return };
        self.remove(rid);
        for (j, &b) in blocks.iter().enumerate() {
            let pos = u32::try_from(j).unwrap_or(u32::MAX);
            self.by_block.entry(b).or_default().push(Entry { instance, rid, pos, first });
        }
        self.by_rid.insert(rid, blocks.into());
    }

    /// Request `rid`'s blocks are no longer on their way (nothing if it had none).
    pub fn remove(&mut self, rid: RequestId) {
        let Some(blocks) = self.by_rid.remove(&rid) else { return };
        for b in blocks.iter() {
            if let Some(v) = self.by_block.get_mut(b) {
                v.retain(|e| e.rid != rid);
                if v.is_empty() {
                    self.by_block.remove(b);
                }
            }
        }
    }

    /// Requests with blocks on their way.
    pub fn len(&self) -> usize {
        self.by_rid.len()
    }

    /// For each instance an admitted request will leave a prefix of `blocks` on that is
    /// longer than `floor` blocks: calls `f(instance, blocks)` once, with the longest.
    pub fn longest(&self, blocks: &[BlockHash], floor: usize, mut f: impl FnMut(InstanceId, usize)) {
        if self.by_block.is_empty() {
            return;
        }
        let Some(&first) = blocks.first() else { return };
        let mut seen: Vec<InstanceId> = Vec::new();
        for j in (floor..blocks.len()).rev() {
            let Some(v) = self.by_block.get(&blocks[j]) else { continue };
            for e in v {
                if e.pos as usize == j && e.first == first && !seen.contains(&e.instance) {
                    seen.push(e.instance);
                    f(e.instance, j + 1);
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
        p.longest(&prompt, 0, |i, n| match seen.iter_mut().find(|s| s.0 == i) {
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
        q.longest(&prompt, 0, |i, n| many.push((i, n)));
        many.sort_unstable();
        assert_eq!(many, vec![(7, 3), (8, 5)]);
        assert_eq!(q.len(), 22);
        let mut above = Vec::new();
        p.longest(&prompt, 3, |i, n| above.push((i, n)));
        above.sort_unstable();
        assert_eq!(above, vec![(8, 5)]);
        p.remove(2);
        p.remove(99); // unknown: nothing
        let mut after = Vec::new();
        p.longest(&prompt, 0, |i, n| after.push((i, n)));
        after.sort_unstable();
        assert_eq!(after, vec![(7, 3), (8, 2)]);
        assert_eq!(p.len(), 4);
    }

    #[test]
    fn a_prefix_shared_with_a_queued_prompt_that_branches_off_counts() {
        let h = |i: u64| i as BlockHash;
        let mut p = Pending::default();
        // a document (blocks 0..3) asked two questions: the first is queued on 7
        p.add(&[h(0), h(1), h(2), h(10), h(11)], 7, 1);
        let mut got = Vec::new();
        p.longest(&[h(0), h(1), h(2), h(20)], 0, |i, n| got.push((i, n)));
        assert_eq!(got, vec![(7, 3)]);
        // above the floor only; and nothing once the queued request's prefill is over
        got.clear();
        p.longest(&[h(0), h(1), h(2), h(20)], 3, |i, n| got.push((i, n)));
        assert!(got.is_empty());
        p.remove(1);
        p.longest(&[h(0), h(1), h(2), h(20)], 0, |i, n| got.push((i, n)));
        assert!(got.is_empty() && p.by_block.is_empty() && p.len() == 0);
    }

    /// Against a plain scan of every admitted prompt: the longest common prefix per
    /// instance (same first block, same position), over random chained prompts.
    #[test]
    fn longest_equals_a_scan_of_every_queued_prompt() {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        // chained ids: a block's id is a function of its parent's and a small token
        let chain = |toks: &[u64]| -> Vec<BlockHash> {
            let mut out = Vec::new();
            let mut parent: u64 = 1;
            for &t in toks {
                parent = parent.wrapping_mul(0x100_0000_01b3).wrapping_add(t + 1);
                out.push(parent as BlockHash);
            }
            out
        };
        for _ in 0..50 {
            let mut p = Pending::default();
            let mut queued: Vec<(InstanceId, Vec<BlockHash>)> = Vec::new();
            for rid in 0..(next() % 12) {
                let toks: Vec<u64> = (0..1 + next() % 8).map(|_| next() % 3).collect();
                let inst = (next() % 4) as InstanceId;
                let blocks = chain(&toks);
                p.add(&blocks, inst, rid);
                queued.push((inst, blocks));
            }
            let toks: Vec<u64> = (0..1 + next() % 8).map(|_| next() % 3).collect();
            let prompt = chain(&toks);
            let floor = (next() % 3) as usize;
            let mut got = Vec::new();
            p.longest(&prompt, floor, |i, n| got.push((i, n)));
            got.sort_unstable();
            let mut want: Vec<(InstanceId, usize)> = Vec::new();
            for (inst, blocks) in &queued {
                let common = blocks.iter().zip(&prompt).take_while(|(a, b)| a == b).count();
                if common > floor {
                    match want.iter_mut().find(|w| w.0 == *inst) {
                        Some(w) => w.1 = w.1.max(common),
                        None => want.push((*inst, common)),
                    }
                }
            }
            want.sort_unstable();
            assert_eq!(got, want);
        }
    }
}
