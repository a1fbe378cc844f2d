//! The per-shard block table: open addressing with linear probing, one 24-byte bucket
//! per block (key and inline holders side by side).
//!
//! Why not a general hash map: with a large index every lookup of `match_prefix` is a
//! cache miss, and a SwissTable-style map pays two (the control bytes, then the bucket).
//! Here a probe reads the bucket itself, so a hit is usually one miss, and the memory is
//! 24 bytes a bucket with no control array. An empty bucket is one whose value has no
//! holder (`Slot2::is_empty`): a stored block always has at least one. Deletion shifts
//! the following run back (no tombstones), so probe runs stay short.

use super::holders::Slot2;
use crate::hash::BlockHash;

#[derive(Clone, Copy)]
struct Bucket {
    /// The block hash as two halves: keeps the bucket 8-byte aligned (24 bytes, where a
    /// `u128` field would pad it to 32).
    key: [u64; 2],
    value: Slot2,
}

const EMPTY_BUCKET: Bucket = Bucket { key: [0, 0], value: Slot2::EMPTY };
/// Grow past 7/10 full: linear probing's expected probe length stays ~2 for hits.
const MAX_LOAD_NUM: usize = 7;
const MAX_LOAD_DEN: usize = 10;
const MIN_CAPACITY: usize = 16;

fn split(h: BlockHash) -> [u64; 2] {
    [h as u64, (h >> 64) as u64]
}

fn join(k: [u64; 2]) -> BlockHash {
    k[0] as u128 | (k[1] as u128) << 64
}

#[derive(Default)]
pub(crate) struct BlockTable {
    buckets: Vec<Bucket>,
    len: usize,
}

impl BlockTable {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn allocation_size(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<Bucket>()
    }

    #[inline]
    fn mask(&self) -> usize {
        self.buckets.len() - 1
    }

    /// Bucket index holding `h`, if present.
    #[inline]
    fn find(&self, h: BlockHash) -> Option<usize> {
        if self.buckets.is_empty() {
            return None;
        }
        let key = split(h);
        let mask = self.mask();
        let mut i = super::mix(h) as usize & mask;
        loop {
            let b = &self.buckets[i];
            if b.value.is_empty() {
                return None;
            }
            if b.key == key {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// Hints the CPU to start loading the bucket where `h` would be, so a batch of
    /// lookups overlaps its cache misses (`match_prefix` prefetches a chunk, then probes).
    #[inline]
    pub(crate) fn prefetch(&self, h: BlockHash) {
        if self.buckets.is_empty() {
            return;
        }
        let i = super::mix(h) as usize & self.mask();
        let p = self.buckets.as_ptr().wrapping_add(i) as *const i8;
        #[cfg(target_arch = "x86_64")]
        #[allow(unused_unsafe)]
        // SAFETY: a prefetch is only a hint; it never faults, and `p` points into the
        // bucket array anyway.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }

    #[inline]
    pub(crate) fn get(&self, h: BlockHash) -> Option<&Slot2> {
        self.find(h).map(|i| &self.buckets[i].value)
    }

    /// Runs `f` on the value of `h` (an empty value if absent) and stores the result:
    /// a value left empty is removed (or never added). Returns `f`'s result.
    pub(crate) fn update<R>(&mut self, h: BlockHash, f: impl FnOnce(&mut Slot2) -> R) -> R {
        if let Some(i) = self.find(h) {
            let r = f(&mut self.buckets[i].value);
            if self.buckets[i].value.is_empty() {
                self.remove_at(i);
            }
            return r;
        }
        let mut value = Slot2::EMPTY;
        let r = f(&mut value);
        if !value.is_empty() {
            self.insert_new(h, value);
        }
        r
    }

    fn insert_new(&mut self, h: BlockHash, value: Slot2) {
        if (self.len + 1) * MAX_LOAD_DEN > self.buckets.len() * MAX_LOAD_NUM {
            self.grow();
        }
        let mask = self.mask();
        let mut i = super::mix(h) as usize & mask;
        while !self.buckets[i].value.is_empty() {
            i = (i + 1) & mask;
        }
        self.buckets[i] = Bucket { key: split(h), value };
        self.len += 1;
    }

    fn grow(&mut self) {
        let cap = (self.buckets.len() * 2).max(MIN_CAPACITY);
        let old = std::mem::replace(&mut self.buckets, vec![EMPTY_BUCKET; cap]);
        self.len = 0;
        for b in old.into_iter().filter(|b| !b.value.is_empty()) {
            self.insert_new(join(b.key), b.value);
        }
    }

    /// Backward-shift deletion: moves later members of the probe run into the hole.
    fn remove_at(&mut self, mut hole: usize) {
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let b = self.buckets[j];
            if b.value.is_empty() {
                break;
            }
            let ideal = super::mix(join(b.key)) as usize & mask;
            // `b` may move into the hole iff its ideal slot is not in (hole, j] cyclically.
            let stays = if hole <= j { hole < ideal && ideal <= j } else { hole < ideal || ideal <= j };
            if !stays {
                self.buckets[hole] = b;
                hole = j;
            }
        }
        self.buckets[hole] = EMPTY_BUCKET;
        self.len -= 1;
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (BlockHash, &Slot2)> {
        self.buckets.iter().filter(|b| !b.value.is_empty()).map(|b| (join(b.key), &b.value))
    }

    /// Applies `f` to every value; values it leaves empty are removed.
    pub(crate) fn for_each_mut(&mut self, mut f: impl FnMut(&mut Slot2)) {
        let mut emptied = Vec::new();
        for b in self.buckets.iter_mut().filter(|b| !b.value.is_empty()) {
            f(&mut b.value);
            if b.value.is_empty() {
                // Keep it findable until removed, so the backward shift sees a sound run.
                b.value = Slot2::PENDING_REMOVAL;
                emptied.push(join(b.key));
            }
        }
        for h in emptied {
            if let Some(i) = self.find(h) {
                self.remove_at(i);
            }
        }
    }

    /// Bucket of `h` is where probing would find it, and the count is right (tests).
    pub(crate) fn check(&self) -> Result<(), String> {
        let live = self.buckets.iter().filter(|b| !b.value.is_empty()).count();
        if live != self.len {
            return Err(format!("block table counts {} blocks, holds {live}", self.len));
        }
        for (h, _) in self.iter() {
            if self.find(h).is_none() {
                return Err(format!("block {h:#x} is stored but cannot be found"));
            }
        }
        Ok(())
    }
}
