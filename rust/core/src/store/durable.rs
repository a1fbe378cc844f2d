//! Write-through to the SSD tier, for a store whose contents must survive its process
//! (a pool node with `--ssd-path`): `persist` writes blocks that are in DRAM into the
//! slot file now, in the calling thread, and `put_ssd` writes a block straight to the
//! slot file without taking a DRAM slot. Both use the tier's own write path (the pending
//! entry a demotion uses, then `SsdTier::write`), so a `remove()` racing with them is
//! final exactly as it is for a demotion, and what is written is found again by the
//! recovery scan of `SsdTier::open` (checksummed slots: a torn write is dropped there).
//!
//! A persisted block stays in DRAM as well (the SSD tier then holds a copy, as it does
//! after a promotion); its later DRAM eviction writes nothing, the disk has it already.

use std::sync::Arc;

use super::arena::Lease;
use super::error::StoreError;
use super::tiered::Store;
use crate::hash::BlockHash;

impl Store {
    fn ssd_or_err(&self) -> Result<&Arc<super::ssd::SsdTier>, StoreError> {
        self.ssd
            .as_ref()
            .ok_or_else(|| StoreError::Invalid("this store has no SSD tier; open it with ssd_path to persist".into()))
    }

    /// Writes every key's DRAM block into the SSD tier now. Per key: true if it is on
    /// disk afterwards (written now, or there already), false if it is not stored, was
    /// removed meanwhile, or the write failed (the error is reported by `flush()`).
    pub fn persist(&self, keys: &[BlockHash]) -> Result<Vec<bool>, StoreError> {
        let ssd = self.ssd_or_err()?;
        let mut out = Vec::with_capacity(keys.len());
        for &key in keys {
            // Claimed under the shard lock while the block is in DRAM (as an eviction
            // claims it), with a lease so the slot is not reused while it is copied.
            let lease = {
                let shard = self.table.shard(key);
                match shard.get(&key) {
                    Some(e) if ssd.claim_pending(key) => Some(Lease::acquire(&self.arena, e.slot)),
                    _ => None,
                }
            };
            let Some(lease) = lease else {
                out.push(ssd.on_disk(key));
                continue;
            };
            // The pending entry carries the bytes for readers until the write is indexed.
            let data = Arc::new(lease.bytes().to_vec());
            drop(lease);
            if !ssd.fill_pending(key, data.clone()) {
                out.push(false); // removed while being copied
                continue;
            }
            out.push(ssd.write(key, &data));
        }
        Ok(out)
    }

    /// Stores `data` (block_bytes) in the SSD tier only, written now. False if `key` is
    /// stored already (in either tier) or the write failed.
    pub fn put_ssd(&self, key: BlockHash, data: &[u8]) -> Result<bool, StoreError> {
        self.check_len(data.len())?;
        let ssd = self.ssd_or_err()?;
        {
            let shard = self.table.shard(key);
            if shard.contains_key(&key) || !ssd.claim_pending(key) {
                return Ok(false);
            }
        }
        let data = Arc::new(data.to_vec());
        if !ssd.fill_pending(key, data.clone()) {
            return Ok(false);
        }
        Ok(ssd.write(key, &data))
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::super::{Store, StoreConfig, SSD_FILE_NAME, SSD_SLOT_HEADER};
    use crate::index::Tier;

    const BB: usize = 4096;

    fn block(key: u128) -> Vec<u8> {
        (0..BB).map(|i| (key as u8).wrapping_mul(7).wrapping_add(i as u8)).collect()
    }

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("mooncake_durable_{tag}_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn open(d: &Path, dram_slots: usize, ssd_slots: u64) -> Store {
        Store::open(StoreConfig {
            block_bytes: BB,
            dram_bytes: dram_slots * crate::mem::page_size(),
            ssd_path: Some(d.to_path_buf()),
            ssd_bytes: 4096 + ssd_slots * 8192,
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn persisted_blocks_are_recovered_byte_for_byte_and_removed_ones_are_not() {
        let d = dir("persist");
        {
            let s = open(&d, 8, 16);
            for k in 1..=6u128 {
                s.put(k, &block(k)).unwrap();
            }
            assert_eq!(s.persist(&[1, 2, 3, 4, 5, 99]).unwrap(), vec![true, true, true, true, true, false]);
            // still served from DRAM, the disk holds a copy
            assert_eq!(s.tier_of(1), Some(Tier::Dram));
            assert_eq!(s.persist(&[1]).unwrap(), vec![true], "on disk already");
            s.remove(5).unwrap();
            assert!(s.put_ssd(7, &block(7)).unwrap());
            assert!(!s.put_ssd(7, &block(7)).unwrap(), "exists");
            assert!(!s.put_ssd(1, &block(1)).unwrap(), "exists in DRAM");
            assert_eq!(s.tier_of(7), Some(Tier::Ssd));
            s.check_integrity().unwrap();
            // no flush: what a killed process leaves is what pwrite put in the file
        }
        let s = open(&d, 8, 16);
        for k in [1u128, 2, 3, 4, 7] {
            assert_eq!(s.get(k, false).unwrap().unwrap().bytes(), &block(k)[..], "key {k}");
        }
        assert!(!s.contains(5), "removed after its persist");
        assert!(!s.contains(6), "never persisted");
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_damaged_persisted_block_is_dropped_at_recovery() {
        let d = dir("damaged");
        {
            let s = open(&d, 4, 8);
            s.put(1, &block(1)).unwrap();
            s.persist(&[1]).unwrap();
        }
        let path = d.join(SSD_FILE_NAME);
        let mut bytes = std::fs::read(&path).unwrap();
        let slot = (0..8).find(|i| bytes[4096 + i * 8192] != 0).unwrap();
        bytes[4096 + slot * 8192 + SSD_SLOT_HEADER + 100] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let s = open(&d, 4, 8);
        assert!(!s.contains(1));
        assert_eq!(s.stats().corrupt_dropped, 1);
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn persist_without_an_ssd_tier_is_refused() {
        let s =
            Store::open(StoreConfig { block_bytes: BB, dram_bytes: 4 * crate::mem::page_size(), ..Default::default() })
                .unwrap();
        assert!(s.persist(&[1]).is_err());
        assert!(s.put_ssd(1, &block(1)).is_err());
    }
}
