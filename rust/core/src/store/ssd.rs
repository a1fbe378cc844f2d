//! The SSD tier: an index over the slot file, its own eviction policy, the blocks
//! waiting to be written (the demotion queue's contents), and the background writer.
//!
//! Demotion: DRAM eviction copies the block into a heap buffer, records it as pending
//! (so gets still find it) and offers it to a bounded queue. **A full queue drops the
//! block** (counted as `demotions_dropped`): eviction never waits for the disk. The
//! writer thread takes jobs in order; `flush()` queues a marker behind them and waits.
//! Lock order: `pending`, then `state`; neither is held during file I/O. Both are leaves
//! below the store's table shards: a key's membership in this tier changes only under
//! its table shard lock (eviction claims a pending entry there, `remove` drops it there),
//! or under `pending` (the writer moving a pending block onto disk), so a removed key
//! cannot come back through a demotion or promotion in flight.
//!
//! Removal is durable: the slot header of a removed block is zeroed on disk before the
//! slot is reused (and a block removed while being written is zeroed by the writer), so a
//! reopen after `remove()` + `flush()` does not recover it.

use std::path::Path;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::Mutex;

use super::error::StoreError;
use super::events::{bump, Counters, EventKind, EventLog};
use super::eviction::{policy_by_name, EvictionPolicy, Verdict};
use super::slotfile::SlotFile;
use crate::hash::BlockHash;
use crate::index::Tier;

pub enum Job {
    Write(BlockHash, Arc<Vec<u8>>),
    Flush(SyncSender<Result<(), StoreError>>),
}

struct State {
    /// key -> (slot, generation)
    index: HashMap<BlockHash, (u32, u64)>,
    free: Vec<u32>,
    policy: Box<dyn EvictionPolicy>,
    next_gen: u64,
}

pub struct SsdTier {
    file: SlotFile,
    state: Mutex<State>,
    /// Blocks on their way to disk. `None`: claimed by an eviction that is still copying
    /// the bytes out of its DRAM slot (not readable yet).
    pending: Mutex<HashMap<BlockHash, Option<Arc<Vec<u8>>>>>,
    /// The first write error since the last flush.
    io_error: Mutex<Option<String>>,
    log: Arc<EventLog>,
    counters: Arc<Counters>,
}

/// Where a block of the SSD tier currently is.
pub enum Location {
    Pending(Arc<Vec<u8>>),
    Disk(u32, u64),
}

impl SsdTier {
    /// Opens the tier and recovers every intact block of an existing file.
    pub fn open(
        dir: &Path,
        block_bytes: usize,
        ssd_bytes: u64,
        eviction: &str,
        log: Arc<EventLog>,
        counters: Arc<Counters>,
    ) -> Result<Self, StoreError> {
        let file = SlotFile::open(dir, block_bytes, ssd_bytes)?;
        let slots = file.slots();
        let policy = policy_by_name(eviction, slots as usize)
            .ok_or_else(|| StoreError::Invalid(format!("unknown eviction policy {eviction:?}")))?;
        let rec = file.recover()?;
        let mut intact = rec.intact;
        // Oldest first, so the policy sees them in write order; a key found twice keeps
        // its newest copy.
        intact.sort_by_key(|(_, h)| h.generation);
        let mut index: HashMap<BlockHash, (u32, u64)> = HashMap::new();
        let mut used = vec![false; slots as usize];
        let mut next_gen = 1;
        for (slot, h) in &intact {
            if let Some((old, _)) = index.insert(h.key, (*slot, h.generation)) {
                used[old as usize] = false;
            }
            used[*slot as usize] = true;
            next_gen = next_gen.max(h.generation + 1);
        }
        let mut policy = policy;
        let mut by_gen: Vec<_> = index.iter().map(|(k, (_, g))| (*g, *k)).collect();
        by_gen.sort_unstable();
        for (_, k) in by_gen {
            policy.begin_access();
            policy.insert(k, 0);
            // Announced like any block that reaches the tier: an index fed from this
            // store's events (a conductor, a worker's re-announcement) learns what the
            // store holds after a restart instead of missing it until it is touched.
            log.push(EventKind::Stored, k, Tier::Ssd);
        }
        counters.recovered.fetch_add(index.len() as u64, std::sync::atomic::Ordering::Relaxed);
        counters.corrupt_dropped.fetch_add(rec.corrupt, std::sync::atomic::Ordering::Relaxed);
        // Older copies of a key found twice: clear their headers, so removing the newest
        // copy later cannot bring an older one back at the next open.
        for (slot, h) in &intact {
            if index.get(&h.key).is_some_and(|(s, _)| s != slot) {
                file.erase(*slot).map_err(|e| StoreError::io("clearing a superseded SSD slot", e))?;
            }
        }
        let free = (0..slots).rev().filter(|&s| !used[s as usize]).collect();
        Ok(SsdTier {
            file,
            state: Mutex::new(State { index, free, policy, next_gen }),
            pending: Mutex::new(HashMap::new()),
            io_error: Mutex::new(None),
            log,
            counters,
        })
    }

    pub fn slots(&self) -> u32 {
        self.file.slots()
    }

    pub fn len(&self) -> usize {
        self.state.lock().index.len()
    }

    pub fn pending_len(&self) -> usize {
        self.pending.lock().len()
    }

    /// Every key on disk or on its way there with its bytes (a claimed entry, still being
    /// copied out of DRAM, is not held here yet: its `Demoted` event comes later).
    pub fn keys(&self) -> Vec<BlockHash> {
        let mut out: Vec<BlockHash> = self.state.lock().index.keys().copied().collect();
        out.extend(self.pending.lock().iter().filter(|(_, d)| d.is_some()).map(|(k, _)| *k));
        out.sort_unstable();
        out.dedup();
        out
    }

    /// On disk or waiting to be written.
    pub fn contains(&self, key: BlockHash) -> bool {
        self.pending.lock().contains_key(&key) || self.state.lock().index.contains_key(&key)
    }

    fn locate(&self, key: BlockHash) -> Option<Location> {
        if let Some(d) = self.pending.lock().get(&key) {
            // A claimed entry has no bytes yet: a miss for this read.
            return d.clone().map(Location::Pending);
        }
        let mut st = self.state.lock();
        let loc = st.index.get(&key).copied()?;
        st.policy.begin_access();
        st.policy.touch(key);
        Some(Location::Disk(loc.0, loc.1))
    }

    /// Copies the block into `out`; false if absent, damaged or replaced meanwhile.
    pub fn read(&self, key: BlockHash, out: &mut [u8]) -> Result<bool, StoreError> {
        match self.locate(key) {
            None => Ok(false),
            Some(Location::Pending(d)) => {
                out.copy_from_slice(&d);
                Ok(true)
            }
            Some(Location::Disk(slot, gen)) => {
                let ok = self.file.read(slot, key, gen, out).map_err(|e| StoreError::io("SSD read", e))?;
                if !ok {
                    // Still indexed at the same place: the slot itself is damaged.
                    let mut st = self.state.lock();
                    if st.index.get(&key) == Some(&(slot, gen)) {
                        st.index.remove(&key);
                        st.policy.remove(key);
                        st.free.push(slot);
                        drop(st);
                        bump(&self.counters.corrupt_dropped);
                        self.log.push(EventKind::Removed, key, Tier::Ssd);
                    }
                }
                Ok(ok)
            }
        }
    }

    /// Claims a pending entry for a block leaving DRAM (called under its table shard
    /// lock); false if the tier holds it already (nothing to write).
    pub fn claim_pending(&self, key: BlockHash) -> bool {
        let mut pending = self.pending.lock();
        if pending.contains_key(&key) || self.state.lock().index.contains_key(&key) {
            return false;
        }
        pending.insert(key, None);
        true
    }

    /// Gives a claimed entry its bytes; false if it was removed meanwhile (drop them).
    pub fn fill_pending(&self, key: BlockHash, data: Arc<Vec<u8>>) -> bool {
        match self.pending.lock().get_mut(&key) {
            Some(slot @ None) => {
                *slot = Some(data);
                true
            }
            _ => false,
        }
    }

    pub fn drop_pending(&self, key: BlockHash) {
        self.pending.lock().remove(&key);
    }

    /// Forgets `key` in this tier (called under its table shard lock, so no demotion or
    /// promotion of it is half-way). Returns whether it was there, and the disk slot
    /// whose header the caller must clear with [`erase`](Self::erase) (no lock held).
    pub fn remove(&self, key: BlockHash) -> (bool, Option<u32>) {
        let mut pending = self.pending.lock();
        let was_pending = pending.remove(&key).is_some();
        let mut st = self.state.lock();
        match st.index.remove(&key) {
            Some((slot, _)) => {
                st.policy.remove(key);
                (true, Some(slot))
            }
            None => (was_pending, None),
        }
    }

    /// Zeroes the header of a removed block's slot (durable at the next flush), then
    /// frees the slot. A failed write is reported by the next `flush()`.
    pub fn erase(&self, slot: u32) {
        if let Err(e) = self.file.erase(slot) {
            self.note_error(&e);
        }
        self.state.lock().free.push(slot);
    }

    fn note_error(&self, e: &std::io::Error) {
        let mut err = self.io_error.lock();
        if err.is_none() {
            *err = Some(format!("writing {}: {e}", self.file.path().display()));
        }
    }

    /// A slot for a new write (evicting the policy's victim when none is free).
    fn take_slot(&self) -> Option<(u32, u64)> {
        let mut st = self.state.lock();
        let slot = match st.free.pop() {
            Some(s) => s,
            None => {
                let State { policy, index, .. } = &mut *st;
                let mut got = None;
                let victim = policy.evict(&mut |k| match index.remove(&k) {
                    Some((s, _)) => {
                        got = Some(s);
                        Verdict::Evicted
                    }
                    None => Verdict::Gone,
                });
                let (Some(k), Some(s)) = (victim, got) else {
                    return None;
                };
                bump(&self.counters.evictions_ssd);
                self.log.push(EventKind::Evicted, k, Tier::Ssd);
                s
            }
        };
        let gen = st.next_gen;
        st.next_gen += 1;
        Some((slot, gen))
    }

    /// On disk (not merely pending).
    pub fn on_disk(&self, key: BlockHash) -> bool {
        self.state.lock().index.contains_key(&key)
    }

    /// The writer's handling of one demotion (also called directly by a write-through,
    /// durable.rs). Returns whether `key` is on disk afterwards.
    pub(super) fn write(&self, key: BlockHash, data: &[u8]) -> bool {
        {
            let pending = self.pending.lock();
            if !pending.contains_key(&key) {
                return false; // removed before its turn
            }
            if self.state.lock().index.contains_key(&key) {
                drop(pending);
                self.drop_pending(key);
                return true;
            }
        }
        let Some((slot, gen)) = self.take_slot() else {
            self.drop_pending(key);
            return false;
        };
        if let Err(e) = self.file.write(slot, key, gen, data) {
            self.state.lock().free.push(slot);
            self.drop_pending(key);
            bump(&self.counters.demotion_failures);
            self.note_error(&e);
            return false;
        }
        let mut pending = self.pending.lock();
        let mut st = self.state.lock();
        if pending.remove(&key).is_none() {
            // Removed while it was being written: its header is on disk now, clear it.
            drop(st);
            drop(pending);
            self.erase(slot);
            return false;
        }
        st.index.insert(key, (slot, gen));
        st.policy.begin_access();
        st.policy.insert(key, 0);
        drop(st);
        drop(pending);
        bump(&self.counters.demotions);
        self.log.push(EventKind::Demoted, key, Tier::Ssd);
        true
    }

    fn flush(&self) -> Result<(), StoreError> {
        let sync = self.file.sync();
        if let Some(e) = self.io_error.lock().take() {
            return Err(StoreError::Io(e));
        }
        sync.map_err(|e| StoreError::io("syncing the SSD tier", e))
    }

    /// The writer thread's loop; ends when every sender is gone.
    pub fn run_writer(self: Arc<Self>, jobs: Receiver<Job>) {
        for job in jobs {
            match job {
                Job::Write(key, data) => {
                    self.write(key, &data);
                }
                Job::Flush(reply) => {
                    let _ = reply.send(self.flush());
                }
            }
        }
    }
}
