//! Compact storage of the holders of one block.
//!
//! Most blocks have one or two holders, so a block's entry in the shard map is 8 bytes
//! inline: two `Holder`s, or a spill marker plus an index into the shard's spill slab for
//! blocks replicated more widely. With a 16-byte key that is 24 bytes of payload per
//! block in the hash table, which keeps the index far below 64 bytes per entry.

/// A (dense instance slot, tier) pair packed into 32 bits: `slot << 2 | tier code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Holder(u32);

/// Reserved raw values (never valid holders: the slot space stops below them).
const EMPTY: u32 = u32::MAX;
const SPILLED: u32 = u32::MAX - 1;
/// Largest dense slot number that can be encoded.
pub(crate) const MAX_SLOT: u32 = (u32::MAX >> 2) - 2;

impl Holder {
    pub(crate) fn new(slot: u32, tier: super::Tier) -> Self {
        debug_assert!(slot <= MAX_SLOT);
        Holder(slot << 2 | tier as u32)
    }
    pub(crate) fn slot(self) -> u32 {
        self.0 >> 2
    }
    pub(crate) fn tier(self) -> super::Tier {
        super::Tier::from_code(self.0 & 3)
    }
    /// `self.tier().rank()` without the match (the prefix match's inner loop).
    #[inline]
    pub(crate) fn rank(self) -> usize {
        super::Tier::rank_of_code(self.0)
    }
}

/// The 8-byte inline value of a block in a shard map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot2([u32; 2]);

/// Holder sets of blocks with more than two holders, addressed by index.
#[derive(Default, Debug)]
pub(crate) struct SpillSlab {
    lists: Vec<Vec<Holder>>,
    free: Vec<u32>,
}

impl SpillSlab {
    pub(crate) fn heap_bytes(&self) -> usize {
        self.lists.capacity() * std::mem::size_of::<Vec<Holder>>()
            + self.lists.iter().map(|l| l.capacity() * 4).sum::<usize>()
            + self.free.capacity() * 4
    }
}

impl Slot2 {
    pub(crate) const EMPTY: Slot2 = Slot2([EMPTY, EMPTY]);
    /// A placeholder that counts as occupied, for a bucket about to be removed.
    pub(crate) const PENDING_REMOVAL: Slot2 = Slot2([0, EMPTY]);

    pub(crate) fn is_empty(&self) -> bool {
        self.0[0] == EMPTY
    }

    /// Calls `f` with every holder.
    pub(crate) fn for_each(&self, slab: &SpillSlab, mut f: impl FnMut(Holder)) {
        match self.0 {
            [SPILLED, i] => slab.lists[i as usize].iter().copied().for_each(f),
            [a, b] => {
                if a != EMPTY {
                    f(Holder(a));
                }
                if b != EMPTY {
                    f(Holder(b));
                }
            }
        }
    }

    pub(crate) fn len(&self, slab: &SpillSlab) -> usize {
        let mut n = 0;
        self.for_each(slab, |_| n += 1);
        n
    }

    /// Adds `h`; returns false if it was already there.
    pub(crate) fn insert(&mut self, slab: &mut SpillSlab, h: Holder) -> bool {
        match self.0 {
            [SPILLED, i] => {
                let list = &mut slab.lists[i as usize];
                if list.contains(&h) {
                    return false;
                }
                list.push(h);
                true
            }
            [a, _] if a == h.0 => false,
            [_, b] if b == h.0 => false,
            [EMPTY, _] => {
                self.0[0] = h.0;
                true
            }
            [_, EMPTY] => {
                self.0[1] = h.0;
                true
            }
            [a, b] => {
                let list = vec![Holder(a), Holder(b), h];
                let idx = match slab.free.pop() {
                    Some(i) => {
                        slab.lists[i as usize] = list;
                        i
                    }
                    None => {
                        slab.lists.push(list);
                        (slab.lists.len() - 1) as u32
                    }
                };
                self.0 = [SPILLED, idx];
                true
            }
        }
    }

    /// Removes every holder for which `pred` is true; returns how many were removed.
    /// Leaves the value empty (`is_empty`) when no holder remains.
    pub(crate) fn remove_where(&mut self, slab: &mut SpillSlab, mut pred: impl FnMut(Holder) -> bool) -> usize {
        match self.0 {
            [SPILLED, i] => {
                let list = &mut slab.lists[i as usize];
                let before = list.len();
                list.retain(|h| !pred(*h));
                let removed = before - list.len();
                if list.len() <= 2 {
                    // Fold back inline and recycle the slab entry.
                    let mut inline = [EMPTY, EMPTY];
                    for (dst, h) in inline.iter_mut().zip(list.iter()) {
                        *dst = h.0;
                    }
                    *list = Vec::new();
                    slab.free.push(i);
                    self.0 = inline;
                }
                removed
            }
            [a, b] => {
                let keep_a = a != EMPTY && !pred(Holder(a));
                let keep_b = b != EMPTY && !pred(Holder(b));
                let removed = (a != EMPTY && !keep_a) as usize + (b != EMPTY && !keep_b) as usize;
                self.0 = match (keep_a, keep_b) {
                    (true, true) => [a, b],
                    (true, false) => [a, EMPTY],
                    (false, true) => [b, EMPTY],
                    (false, false) => [EMPTY, EMPTY],
                };
                removed
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Tier;
    use super::*;

    #[test]
    fn inline_spill_and_fold_back() {
        let mut slab = SpillSlab::default();
        let mut v = Slot2::EMPTY;
        let hs: Vec<Holder> = (0..5).map(|s| Holder::new(s, Tier::Dram)).collect();
        for h in &hs {
            assert!(v.insert(&mut slab, *h));
            assert!(!v.insert(&mut slab, *h));
        }
        assert_eq!(v.len(&slab), 5);
        assert_eq!(v.remove_where(&mut slab, |h| h.slot() >= 2), 3);
        assert_eq!(v.len(&slab), 2);
        assert_eq!(slab.free.len(), 1);
        assert_eq!(v.remove_where(&mut slab, |h| h.slot() == 0), 1);
        let mut got = vec![];
        v.for_each(&slab, |h| got.push(h));
        assert_eq!(got, vec![hs[1]]);
        assert_eq!(v.remove_where(&mut slab, |_| true), 1);
        assert!(v.is_empty());
    }
}
