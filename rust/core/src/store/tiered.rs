//! `Store`: the tiered block store of one instance.
//!
//! Lock order: the DRAM policy, then one table shard (eviction is the only path that
//! holds both); the event log and the free list are leaves. Copies and file I/O run with
//! no lock held: a slot being written belongs to its reservation alone, a slot being
//! read is protected by its lease's reference.

use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use super::arena::{Arena, Lease, Reservation};
use super::config::StoreConfig;
use super::error::StoreError;
use super::events::{bump, Counters, EventKind, EventLog, StoreEvent};
use super::eviction::{policy_by_name, EvictionPolicy, Verdict};
use super::ssd::{Job, SsdTier};
use super::table::{Entry, Table};
use crate::hash::BlockHash;
use crate::index::Tier;
use crate::mem::MappedMemory;

/// The bytes a `get` returned: a leased DRAM slot (zero-copy), or a private copy read
/// straight from SSD (`promote = false`, or no DRAM slot could be freed).
pub enum BlockRef {
    Slot(Lease),
    Owned(Vec<u8>),
}

impl BlockRef {
    pub fn bytes(&self) -> &[u8] {
        match self {
            BlockRef::Slot(l) => l.bytes(),
            BlockRef::Owned(v) => v,
        }
    }

    pub fn tier(&self) -> Tier {
        match self {
            BlockRef::Slot(_) => Tier::Dram,
            BlockRef::Owned(_) => Tier::Ssd,
        }
    }
}

pub struct Store {
    pub(super) cfg: StoreConfig,
    pub(super) arena: Arc<Arena>,
    pub(super) table: Table,
    pub(super) policy: Mutex<Box<dyn EvictionPolicy>>,
    pub(super) ssd: Option<Arc<SsdTier>>,
    pub(super) jobs: Option<SyncSender<Job>>,
    pub(super) writer: Option<JoinHandle<()>>,
    pub(super) log: Arc<EventLog>,
    pub(super) counters: Arc<Counters>,
}

impl Store {
    pub fn open(cfg: StoreConfig) -> Result<Self, StoreError> {
        let slots = cfg.validate()?;
        let arena = Arena::new(cfg.block_bytes, slots, cfg.shared_memory)
            .map_err(|e| StoreError::Invalid(format!("cannot map a {}-byte DRAM arena: {e}", cfg.dram_bytes)))?;
        let policy = policy_by_name(&cfg.eviction, slots)
            .ok_or_else(|| StoreError::Invalid(format!("unknown eviction policy {:?}", cfg.eviction)))?;
        let log = Arc::new(EventLog::new(cfg.max_events));
        let counters = Arc::new(Counters::default());
        let (mut ssd, mut jobs, mut writer) = (None, None, None);
        if let Some(dir) = &cfg.ssd_path {
            let tier = Arc::new(SsdTier::open(
                dir,
                cfg.block_bytes,
                cfg.ssd_bytes,
                &cfg.eviction,
                log.clone(),
                counters.clone(),
            )?);
            let (tx, rx) = sync_channel(cfg.demotion_queue);
            let t = tier.clone();
            let handle = std::thread::Builder::new()
                .name("mooncake-demote".into())
                .spawn(move || t.run_writer(rx))
                .map_err(|e| StoreError::io("starting the demotion thread", e))?;
            ssd = Some(tier);
            jobs = Some(tx);
            writer = Some(handle);
        }
        Ok(Store {
            table: Table::new(cfg.shards),
            arena: Arc::new(arena),
            policy: Mutex::new(policy),
            cfg,
            ssd,
            jobs,
            writer,
            log,
            counters,
        })
    }

    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    pub fn block_bytes(&self) -> usize {
        self.cfg.block_bytes
    }

    pub fn slots(&self) -> usize {
        self.arena.slots()
    }

    /// The DRAM arena (for registering it with a transfer engine).
    pub fn arena(&self) -> Arc<MappedMemory> {
        self.arena.memory().clone()
    }

    /// Byte offset of `key`'s DRAM slot in the arena, if it is in DRAM.
    pub fn slot_offset(&self, key: BlockHash) -> Option<usize> {
        self.table.shard(key).get(&key).map(|e| self.arena.offset(e.slot))
    }

    pub(super) fn check_len(&self, len: usize) -> Result<(), StoreError> {
        if len != self.cfg.block_bytes {
            return Err(StoreError::Invalid(format!(
                "a block must be exactly block_bytes={} bytes, got {len}",
                self.cfg.block_bytes
            )));
        }
        Ok(())
    }

    /// In DRAM or in the SSD tier.
    pub fn contains(&self, key: BlockHash) -> bool {
        self.table.shard(key).contains_key(&key) || self.ssd.as_ref().is_some_and(|s| s.contains(key))
    }

    /// The fastest tier holding `key`.
    pub fn tier_of(&self, key: BlockHash) -> Option<Tier> {
        if self.table.shard(key).contains_key(&key) {
            Some(Tier::Dram)
        } else if self.ssd.as_ref().is_some_and(|s| s.contains(key)) {
            Some(Tier::Ssd)
        } else {
            None
        }
    }

    /// A slot for new bytes, owned by the caller: a free one, or the policy's victim.
    fn alloc_slot(&self) -> Result<u32, StoreError> {
        if let Some(s) = self.arena.pop_free() {
            return Ok(s);
        }
        let mut slot = None;
        let mut demote = false;
        let victim = {
            let mut policy = self.policy.lock();
            policy.evict(&mut |k| {
                let mut shard = self.table.shard(k);
                match shard.get(&k) {
                    None => Verdict::Gone,
                    Some(e) if e.pins > 0 || self.arena.refs(e.slot) > 1 => Verdict::Keep,
                    Some(e) => {
                        slot = Some(e.slot);
                        shard.remove(&k);
                        // Leaving DRAM and entering the SSD tier's pending set is one step
                        // under the shard lock, so a concurrent remove() sees it in one
                        // tier or the other, never in neither to come back later.
                        demote = self.ssd.as_ref().is_some_and(|s| s.claim_pending(k));
                        Verdict::Evicted
                    }
                }
            })
        };
        match (victim, slot) {
            (Some(key), Some(slot)) => {
                self.evicted(key, slot, demote);
                Ok(slot)
            }
            // A lease may have been released meanwhile.
            _ => self.arena.pop_free().ok_or(StoreError::Full { slots: self.slots() }),
        }
    }

    /// After `key` left DRAM: count it, and queue its demotion if the eviction claimed a
    /// pending SSD entry for it (`demote`: not on SSD already, e.g. promoted from there).
    /// The caller now owns `slot` (its table reference).
    fn evicted(&self, key: BlockHash, slot: u32, demote: bool) {
        bump(&self.counters.evictions_dram);
        self.log.push(EventKind::Evicted, key, Tier::Dram);
        let (Some(ssd), Some(jobs)) = (&self.ssd, &self.jobs) else { return };
        if !demote {
            return;
        }
        // SAFETY: the caller owns `slot` (removed from the table with count 1).
        let data = Arc::new(unsafe { self.arena.bytes(slot) }.to_vec());
        if !ssd.fill_pending(key, data.clone()) {
            return; // removed while its bytes were being copied
        }
        match jobs.try_send(Job::Write(key, data)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                ssd.drop_pending(key);
                bump(&self.counters.demotions_dropped);
            }
        }
    }

    /// A writable slot for `key`, committed with [`commit`](Self::commit).
    pub fn reserve(&self, key: BlockHash) -> Result<Reservation, StoreError> {
        let slot = self.alloc_slot()?;
        Ok(Reservation { arena: self.arena.clone(), slot, key, done: false })
    }

    /// Publishes a reservation; false (and the slot is freed) if `key` is already stored.
    pub fn commit(&self, mut r: Reservation, position: u32) -> bool {
        self.publish(&mut r, position, EventKind::Stored)
    }

    /// [`commit`](Self::commit), returning a lease on the published slot (taken before
    /// the block became visible, so it cannot be evicted in between); `None` if `key`
    /// was stored meanwhile (the reservation's slot is freed).
    pub fn commit_leased(&self, mut r: Reservation, position: u32) -> Option<Lease> {
        let lease = Lease::acquire(&self.arena, r.slot);
        if self.publish(&mut r, position, EventKind::Stored) {
            Some(lease)
        } else {
            drop(lease);
            None
        }
    }

    /// Inserts the reservation's slot into the table. For a promotion the SSD tier must
    /// still hold the key, checked under the shard lock that `remove` holds: a block
    /// removed while it was being read back is not resurrected.
    pub(super) fn publish(&self, r: &mut Reservation, position: u32, kind: EventKind) -> bool {
        let key = r.key;
        {
            let mut shard = self.table.shard(key);
            if shard.contains_key(&key) {
                return false;
            }
            let on_ssd = self.ssd.as_ref().is_some_and(|s| s.contains(key));
            match kind {
                EventKind::Stored if on_ssd => return false, // content-addressed: stored already
                EventKind::Promoted if !on_ssd => return false, // removed (or evicted) meanwhile
                _ => {}
            }
            shard.insert(key, Entry { slot: r.slot, pins: 0 });
            r.done = true; // the table owns the reference now
        }
        {
            let mut p = self.policy.lock();
            p.begin_access();
            p.insert(key, position);
        }
        if kind == EventKind::Stored {
            bump(&self.counters.puts);
        }
        self.log.push(kind, key, Tier::Dram);
        true
    }

    /// Stores a copy of `data`; false if `key` is already stored (nothing changes).
    pub fn put(&self, key: BlockHash, data: &[u8]) -> Result<bool, StoreError> {
        self.put_at(key, data, 0)
    }

    /// [`put`](Self::put) of a value shorter than a block: `data` (1..=block_bytes bytes)
    /// goes at the front of the slot and the rest is zeroed, so a caller holding a small
    /// value need not build a padded copy first. False if `key` is already stored.
    pub fn put_padded(&self, key: BlockHash, data: &[u8]) -> Result<bool, StoreError> {
        let bb = self.cfg.block_bytes;
        if data.is_empty() || data.len() > bb {
            return Err(StoreError::Invalid(format!(
                "a padded block must be 1..={bb} bytes (block_bytes), got {}",
                data.len()
            )));
        }
        self.put_filled(key, 0, |slot| {
            let (head, tail) = slot.split_at_mut(data.len());
            head.copy_from_slice(data);
            tail.fill(0);
        })
    }

    fn put_at(&self, key: BlockHash, data: &[u8], position: u32) -> Result<bool, StoreError> {
        self.check_len(data.len())?;
        self.put_filled(key, position, |slot| slot.copy_from_slice(data))
    }

    /// Put-if-absent of one block whose slot `fill` writes (all `block_bytes` of it)
    /// between the reservation and the commit; false if `key` is already stored.
    fn put_filled(&self, key: BlockHash, position: u32, fill: impl FnOnce(&mut [u8])) -> Result<bool, StoreError> {
        if self.contains(key) {
            return Ok(false);
        }
        let mut r = self.reserve(key)?;
        fill(r.bytes_mut());
        Ok(self.commit(r, position))
    }

    /// Stores a chain of blocks (positions 0..n for the prefix-aware policy). Stops at
    /// the first error; the blocks before it stay stored.
    /// [`put_many`](Self::put_many) of one buffer holding the blocks back to back
    /// (exactly `keys.len() * block_bytes` bytes).
    pub fn put_many_packed(&self, keys: &[BlockHash], data: &[u8]) -> Result<Vec<bool>, StoreError> {
        let bb = self.block_bytes();
        if Some(data.len()) != keys.len().checked_mul(bb) {
            let need = keys.len().saturating_mul(bb);
            return Err(StoreError::Invalid(format!(
                "datas has {} bytes; {} keys need {need} (block_bytes each)",
                data.len(),
                keys.len()
            )));
        }
        let items: Vec<(BlockHash, &[u8])> = keys.iter().copied().zip(data.chunks_exact(bb.max(1))).collect();
        self.put_many(&items)
    }

    pub fn put_many(&self, items: &[(BlockHash, &[u8])]) -> Result<Vec<bool>, StoreError> {
        for (_, d) in items {
            self.check_len(d.len())?;
        }
        let mut out = Vec::with_capacity(items.len());
        for (i, (k, d)) in items.iter().enumerate() {
            out.push(self.put_at(*k, d, i.min(u32::MAX as usize) as u32)?);
        }
        Ok(out)
    }

    /// Forgets `key` in every tier; live views keep their bytes until dropped. Final:
    /// no demotion or promotion in flight brings it back, and its SSD slot header is
    /// cleared (durable at the next `flush()`), so a reopen does not recover it. A pinned
    /// block is refused (`Invalid`): its pinner relies on it; unpin it first.
    pub fn remove(&self, key: BlockHash) -> Result<bool, StoreError> {
        let (entry, (in_ssd, erase)) = {
            let mut policy = self.policy.lock();
            let mut shard = self.table.shard(key);
            if let Some(e) = shard.get(&key) {
                if e.pins > 0 {
                    return Err(StoreError::Invalid(format!(
                        "block {key:#x} is pinned ({} pins); unpin it before remove()",
                        e.pins
                    )));
                }
            }
            let entry = shard.remove(&key);
            policy.remove(key);
            // Both tiers under the shard lock: an eviction hands a key from DRAM to the
            // SSD tier, and a promotion publishes one, only under this same lock.
            let ssd = self.ssd.as_ref().map_or((false, None), |s| s.remove(key));
            (entry, ssd)
        };
        let in_dram = match entry {
            Some(e) => {
                self.arena.release(e.slot);
                self.log.push(EventKind::Removed, key, Tier::Dram);
                true
            }
            None => false,
        };
        if let (Some(ssd), Some(slot)) = (&self.ssd, erase) {
            ssd.erase(slot); // file I/O, no lock held
        }
        if in_ssd {
            self.log.push(EventKind::Removed, key, Tier::Ssd);
        }
        Ok(in_dram || in_ssd)
    }

    /// Pins `key` in DRAM (promoting it from SSD if needed); returns its pin count.
    pub fn pin(&self, key: BlockHash) -> Result<u32, StoreError> {
        for _ in 0..3 {
            if let Some(e) = self.table.shard(key).get_mut(&key) {
                e.pins += 1;
                return Ok(e.pins);
            }
            match self.get_lower(key, true)? {
                Some(BlockRef::Slot(_)) => continue,
                Some(BlockRef::Owned(_)) => return Err(StoreError::Full { slots: self.slots() }),
                None => return Err(StoreError::NotFound(key)),
            }
        }
        Err(StoreError::NotFound(key))
    }

    /// Drops one pin; returns the pins left.
    pub fn unpin(&self, key: BlockHash) -> Result<u32, StoreError> {
        match self.table.shard(key).get_mut(&key) {
            Some(e) if e.pins > 0 => {
                e.pins -= 1;
                Ok(e.pins)
            }
            Some(_) => Err(StoreError::Invalid(format!("block {key:#x} is not pinned"))),
            None => Err(StoreError::NotFound(key)),
        }
    }

    pub fn drain_events(&self) -> Vec<StoreEvent> {
        self.log.drain()
    }

    /// Events waiting for `drain_events` (a caller that drains often asks first: most
    /// times there are none).
    pub fn pending_events(&self) -> usize {
        self.log.len()
    }

    /// `Evicted` and `Removed` events waiting for `drain_events`: a table of what this
    /// store holds, kept from its events, is current while this is 0 (`Stored` events
    /// only add).
    pub fn pending_losses(&self) -> usize {
        self.log.pending_losses()
    }

    /// Waits until every queued demotion is on disk (and synced); reports the first
    /// write error since the last flush as `StoreError::Io`.
    pub fn flush(&self) -> Result<(), StoreError> {
        let Some(jobs) = &self.jobs else { return Ok(()) };
        let (tx, rx) = sync_channel(1);
        jobs.send(Job::Flush(tx)).map_err(|_| StoreError::Io("the demotion thread is gone".into()))?;
        rx.recv().map_err(|_| StoreError::Io("the demotion thread is gone".into()))?
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // Closing the queue lets the writer finish what is queued, then exit.
        self.jobs = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}
