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

/// Where a block will be left: an instance, at a position after a first block, by
/// `count` admitted requests (requests on one instance sharing a prefix share slots, so a
/// block's slots are bounded by the instances, not by the queue).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Slot {
    instance: InstanceId,
    /// The block's position in its prompt.
    pos: u32,
    first: BlockHash,
    count: u32,
}

impl Slot {
    fn same_place(&self, o: &Slot) -> bool {
        self.instance == o.instance && self.pos == o.pos && self.first == o.first
    }
}

#[derive(Debug, Default)]
pub(crate) struct Pending {
    /// A full block of an admitted prompt -> its first slot (most blocks have one: no
    /// allocation per block at admission, which `schedule` pays for).
    by_block: HashMap<BlockHash, Slot>,
    /// The block's other slots (another instance, or ids that are not chained).
    more: HashMap<BlockHash, Vec<Slot>>,
    /// Each admitted request's instance and full blocks (what `remove` takes out).
    by_rid: HashMap<RequestId, (InstanceId, Box<[BlockHash]>)>,
}

impl Pending {
    /// Request `rid` on `instance` will leave `blocks` (its full blocks) there.
    pub fn add(&mut self, blocks: &[BlockHash], instance: InstanceId, rid: RequestId) {
        let Some(&first) = blocks.first() else { return };
        self.remove(rid);
        for (j, &b) in blocks.iter().enumerate() {
            let new = Slot { instance, pos: u32::try_from(j).unwrap_or(u32::MAX), first, count: 1 };
            match self.by_block.entry(b) {
                hashbrown::hash_map::Entry::Vacant(v) => {
                    v.insert(new);
                }
                hashbrown::hash_map::Entry::Occupied(mut o) if o.get().same_place(&new) => o.get_mut().count += 1,
                hashbrown::hash_map::Entry::Occupied(_) => {
                    let v = self.more.entry(b).or_default();
                    match v.iter_mut().find(|s| s.same_place(&new)) {
                        Some(s) => s.count += 1,
                        None => v.push(new),
                    }
                }
            }
        }
        self.by_rid.insert(rid, (instance, blocks.into()));
    }

    /// Request `rid`'s blocks are no longer on their way (nothing if it had none).
    pub fn remove(&mut self, rid: RequestId) {
        let Some((instance, blocks)) = self.by_rid.remove(&rid) else { return };
        let first = blocks[0];
        for (j, b) in blocks.iter().enumerate() {
            let gone = Slot { instance, pos: u32::try_from(j).unwrap_or(u32::MAX), first, count: 0 };
            if let Some(s) = self.by_block.get_mut(b).filter(|s| s.same_place(&gone)) {
                s.count -= 1;
                if s.count == 0 {
                    // promote one of the other slots, if any
                    match self.more.get_mut(b).and_then(|v| v.pop()) {
                        Some(next) => *s = next,
                        None => {
                            self.by_block.remove(b);
                        }
                    }
                    if self.more.get(b).is_some_and(|v| v.is_empty()) {
                        self.more.remove(b);
                    }
                }
            } else if let Some(v) = self.more.get_mut(b) {
                if let Some(k) = v.iter().position(|s| s.same_place(&gone)) {
                    v[k].count -= 1;
                    if v[k].count == 0 {
                        v.swap_remove(k);
                    }
                }
                if v.is_empty() {
                    self.more.remove(b);
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
        let mut visit = |s: &Slot, j: usize| {
            if s.pos as usize == j && s.first == first && !seen.contains(&s.instance) {
                seen.push(s.instance);
                f(s.instance, j + 1);
            }
        };
        for j in (floor..blocks.len()).rev() {
            let Some(s) = self.by_block.get(&blocks[j]) else { continue };
            visit(s, j);
            if let Some(v) = self.more.get(&blocks[j]) {
                v.iter().for_each(|s| visit(s, j));
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
        // a document (blocks 0..9) asked two questions: the first is queued on 7
        let doc: Vec<BlockHash> = (0..9).map(h).collect();
        p.add(&[&doc[..], &[h(10), h(11)]].concat(), 7, 1);
        let second = [&doc[..], &[h(20)]].concat();
        let mut got = Vec::new();
        p.longest(&second, 0, |i, n| got.push((i, n)));
        assert_eq!(got, vec![(7, 9)]);
        // above the floor only; and nothing once the queued request's prefill is over
        got.clear();
        p.longest(&second, 9, |i, n| got.push((i, n)));
        assert!(got.is_empty());
        p.remove(1);
        p.longest(&second, 0, |i, n| got.push((i, n)));
        assert!(got.is_empty() && p.by_block.is_empty() && p.more.is_empty() && p.len() == 0);
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
                let toks: Vec<u64> = (0..1 + next() % 12).map(|_| next() % 3).collect();
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
