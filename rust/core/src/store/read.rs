//! The read paths of [`Store`]: views (`get`, `get_batch`, `lookup_prefix`), copies
//! (`get_into`) and promotion from the SSD tier. A DRAM hit is leased under its shard
//! lock; copies run on the leased slot with no lock held.

use super::arena::Lease;
use super::error::StoreError;
use super::events::{bump, EventKind};
use super::tiered::{BlockRef, Store};
use crate::hash::BlockHash;

impl Store {
    pub(super) fn lease_dram(&self, key: BlockHash) -> Option<Lease> {
        let shard = self.table.shard(key);
        shard.get(&key).map(|e| Lease::acquire(&self.arena, e.slot))
    }

    /// A view of `key`. From SSD the block is promoted into a DRAM slot, unless
    /// `promote` is false (or no slot can be freed): then it is read into a private copy.
    pub fn get(&self, key: BlockHash, promote: bool) -> Result<Option<BlockRef>, StoreError> {
        let got = self.get_batch(&[key], promote)?;
        Ok(got.into_iter().next().flatten())
    }

    /// [`get`](Self::get) for many keys, touching the DRAM hits as one access.
    pub fn get_batch(&self, keys: &[BlockHash], promote: bool) -> Result<Vec<Option<BlockRef>>, StoreError> {
        let mut out: Vec<Option<BlockRef>> = keys.iter().map(|&k| self.lease_dram(k).map(BlockRef::Slot)).collect();
        let hits = out.iter().filter(|o| o.is_some()).count();
        if hits > 0 {
            let mut p = self.policy.lock();
            p.begin_access();
            for (k, o) in keys.iter().zip(&out) {
                if o.is_some() {
                    p.touch(*k);
                }
            }
        }
        self.counters.hits_dram.fetch_add(hits as u64, std::sync::atomic::Ordering::Relaxed);
        for (k, o) in keys.iter().zip(out.iter_mut()) {
            if o.is_none() {
                *o = self.get_lower(*k, promote)?;
                if o.is_none() {
                    bump(&self.counters.misses);
                }
            }
        }
        Ok(out)
    }

    /// A DRAM miss: try the SSD tier.
    pub(super) fn get_lower(&self, key: BlockHash, promote: bool) -> Result<Option<BlockRef>, StoreError> {
        let Some(ssd) = &self.ssd else { return Ok(None) };
        if !ssd.contains(key) {
            return Ok(None);
        }
        if promote {
            if let Ok(mut r) = self.reserve(key) {
                if !ssd.read(key, r.bytes_mut())? {
                    return Ok(None);
                }
                bump(&self.counters.hits_ssd);
                // The caller's lease exists before the block is visible, so it cannot be
                // evicted between publishing and returning.
                let lease = Lease::acquire(&self.arena, r.slot);
                if self.publish(&mut r, 0, EventKind::Promoted) {
                    bump(&self.counters.promotions);
                    return Ok(Some(BlockRef::Slot(lease)));
                }
                // promoted (or put) concurrently: serve the DRAM copy
                drop(lease);
                drop(r);
                return Ok(self.lease_dram(key).map(BlockRef::Slot));
            }
        }
        let mut buf = vec![0u8; self.cfg.block_bytes];
        if ssd.read(key, &mut buf)? {
            bump(&self.counters.hits_ssd);
            Ok(Some(BlockRef::Owned(buf)))
        } else {
            Ok(None)
        }
    }

    /// Copies `key` into `out`; false if absent.
    /// [`get_into`](Self::get_into) for many keys: key `i`'s block into row `i` of `out`
    /// (exactly `keys.len() * block_bytes` bytes); per key, whether it was found (rows of
    /// missing keys are left as they were).
    pub fn get_many_into(&self, keys: &[BlockHash], out: &mut [u8], promote: bool) -> Result<Vec<bool>, StoreError> {
        let bb = self.block_bytes();
        if Some(out.len()) != keys.len().checked_mul(bb) {
            let need = keys.len().saturating_mul(bb);
            return Err(StoreError::Invalid(format!("out has {} bytes; {} keys need {need}", out.len(), keys.len())));
        }
        keys.iter().zip(out.chunks_exact_mut(bb.max(1))).map(|(k, row)| self.get_into(*k, row, promote)).collect()
    }

    pub fn get_into(&self, key: BlockHash, out: &mut [u8], promote: bool) -> Result<bool, StoreError> {
        self.check_len(out.len())?;
        if let Some(l) = self.lease_dram(key) {
            {
                let mut p = self.policy.lock();
                p.begin_access();
                p.touch(key);
            }
            bump(&self.counters.hits_dram);
            out.copy_from_slice(l.bytes());
            return Ok(true);
        }
        if !promote {
            if let Some(ssd) = &self.ssd {
                if ssd.read(key, out)? {
                    bump(&self.counters.hits_ssd);
                    return Ok(true);
                }
            }
            bump(&self.counters.misses);
            return Ok(false);
        }
        match self.get_lower(key, true)? {
            Some(b) => {
                out.copy_from_slice(b.bytes());
                Ok(true)
            }
            None => {
                bump(&self.counters.misses);
                Ok(false)
            }
        }
    }

    /// Leases on the longest leading run of `keys` that the store holds, in order (one
    /// call instead of a `get` per key). A key found only on SSD is promoted into a DRAM
    /// slot as [`get`](Self::get) does, so every block returned has an arena offset; the
    /// run ends at the first key that is in neither tier, or (with `promote = false`) not
    /// in DRAM, or that cannot be given a DRAM slot (every slot leased, pinned or
    /// reserved). The DRAM hits are touched as one access.
    pub fn lookup_prefix(&self, keys: &[BlockHash], promote: bool) -> Result<Vec<Lease>, StoreError> {
        let mut out = Vec::with_capacity(keys.len());
        let mut dram_hits = 0u64;
        for &k in keys {
            if let Some(l) = self.lease_dram(k) {
                out.push(l);
                dram_hits += 1;
                continue;
            }
            if !promote {
                break;
            }
            match self.get_lower(k, true)? {
                Some(BlockRef::Slot(l)) => out.push(l),
                // Read into a private copy only (no DRAM slot): not addressable in the
                // arena, so the run ends here.
                Some(BlockRef::Owned(_)) => break,
                None => {
                    bump(&self.counters.misses);
                    break;
                }
            }
        }
        if !out.is_empty() {
            let mut p = self.policy.lock();
            p.begin_access();
            for k in &keys[..out.len()] {
                p.touch(*k);
            }
        }
        self.counters.hits_dram.fetch_add(dram_hits, std::sync::atomic::Ordering::Relaxed);
        Ok(out)
    }
}
