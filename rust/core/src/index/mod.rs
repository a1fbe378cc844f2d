//! The block index: which instance holds which block, in which tier.
//!
//! This is the conductor's global view of the cluster-wide KVCache pool. Keys are
//! [`BlockHash`]es; values are the holders of that block, each an (instance, tier) pair.
//! Because block hashes are chained, "instance I holds the first n blocks of a prompt"
//! is answered by n point lookups, with no tree.
//!
//! Concurrency: the map is split into shards, each behind its own `RwLock`; a lookup
//! holds one shard lock at a time, for one probe. The instance table (instance id ↔ dense
//! slot) has its own lock, taken shared by every operation and exclusively only by
//! `remove_instance`, so a slot is never reused while an operation still refers to it.
//! Lock order: instances, then one shard.

mod holders;
mod instances;
mod table;

use hashbrown::HashMap;
use parking_lot::{RwLock, RwLockReadGuard};

use crate::error::{Categorized, ErrorCategory};
use crate::hash::BlockHash;
use holders::{Holder, Slot2, SpillSlab};
use instances::Instances;
use table::BlockTable;

/// An instance id as the caller names it (any u64).
pub type InstanceId = u64;

/// Where a holder keeps the block. `Gpu` is an engine's own device cache (what vLLM or
/// SGLang report as "GPU"): nothing to load. Our stores hold `Dram` and `Ssd` only.
///
/// The codes are stable (they are on the wire and in the index's packed entries); the
/// preference between copies is [`Tier::rank`], not the code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Tier {
    Dram = 0,
    Ssd = 1,
    Gpu = 2,
}

/// The rank of each tier code (0: the cheapest to load): dram 1, ssd 2, gpu 0 (code 3
/// is never stored). One table for [`Tier::rank`] and the packed holders' inner loop.
const RANK_OF_CODE: [usize; 4] = [1, 2, 0, 0];

impl Tier {
    pub fn parse(name: &str) -> Result<Self, IndexError> {
        match name {
            "dram" => Ok(Tier::Dram),
            "ssd" => Ok(Tier::Ssd),
            "gpu" => Ok(Tier::Gpu),
            other => Err(IndexError::UnknownTier(other.to_string())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Tier::Dram => "dram",
            Tier::Ssd => "ssd",
            Tier::Gpu => "gpu",
        }
    }

    /// 0 for the cheapest to load (gpu), then dram, then ssd: a block held in several
    /// tiers by one instance counts in its lowest rank.
    #[inline]
    pub fn rank(self) -> usize {
        RANK_OF_CODE[self as usize]
    }

    /// The rank of a packed tier code (its low two bits), without building the `Tier`.
    #[inline]
    pub(crate) fn rank_of_code(code: u32) -> usize {
        RANK_OF_CODE[(code & 3) as usize]
    }

    pub(crate) fn from_code(code: u32) -> Tier {
        match code {
            0 => Tier::Dram,
            1 => Tier::Ssd,
            _ => Tier::Gpu,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    #[error("unknown tier {0:?}; expected \"gpu\", \"dram\" or \"ssd\"")]
    UnknownTier(String),
    #[error("too many instances in one index (at most {0})")]
    TooManyInstances(u32),
}

impl Categorized for IndexError {
    fn category(&self) -> ErrorCategory {
        ErrorCategory::InvalidArgument
    }
}

/// How many leading blocks of a prompt one instance holds, split by tier.
/// A block held in several tiers counts in the fastest (the copy that is used).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixMatch {
    pub instance: InstanceId,
    pub dram: usize,
    pub ssd: usize,
    pub gpu: usize,
}

impl PrefixMatch {
    pub fn total(&self) -> usize {
        self.gpu + self.dram + self.ssd
    }

    /// Blocks held in memory (gpu or dram): no storage read to use them.
    pub fn in_memory(&self) -> usize {
        self.gpu + self.dram
    }
}

/// Sizes, for monitoring and the memory target.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct blocks.
    pub blocks: usize,
    /// (block, holder) pairs.
    pub entries: usize,
    pub instances: usize,
    /// Heap bytes held by the index's tables.
    pub memory_bytes: usize,
    /// (instance, dram entries, ssd entries), sorted by instance.
    pub per_instance: Vec<(InstanceId, usize, usize)>,
    /// (instance, gpu entries) of the instances with any, sorted by instance.
    pub per_instance_gpu: Vec<(InstanceId, usize)>,
}

/// Block hashes are already uniform, but simulator traces use small integer ids, so the
/// key is mixed once (a folded 64×64→128 multiply) before it picks a shard and a bucket.
#[inline]
fn mix(key: u128) -> u64 {
    let x = (key as u64) ^ ((key >> 64) as u64).rotate_left(29);
    let m = (x as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
    (m as u64) ^ ((m >> 64) as u64)
}

#[derive(Default)]
struct Shard {
    map: BlockTable,
    slab: SpillSlab,
    entries: usize,
}

const SHARD_BITS: u32 = 6;
const SHARDS: usize = 1 << SHARD_BITS;

#[inline]
fn shard_of(key: BlockHash) -> usize {
    // Bits 50..56 of the mix: disjoint from the bucket bits (the low bits) of any
    // shard table below 2^50 buckets.
    ((mix(key) >> 50) as usize) & (SHARDS - 1)
}

/// Holders of one block copied out of a shard, so the lock is held only for the probe.
type HolderBuf = Vec<Holder>;

pub struct BlockIndex {
    shards: Box<[RwLock<Shard>]>,
    instances: RwLock<Instances>,
}

impl Default for BlockIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl BlockIndex {
    pub fn new() -> Self {
        BlockIndex {
            shards: (0..SHARDS).map(|_| RwLock::new(Shard::default())).collect(),
            instances: RwLock::new(Instances::default()),
        }
    }

    /// Records that `instance` holds `hashes` in `tier`. Returns how many entries are new.
    pub fn insert(&self, instance: InstanceId, hashes: &[BlockHash], tier: Tier) -> Result<usize, IndexError> {
        loop {
            {
                let instances = self.instances.read();
                if let Some(slot) = instances.slot_of(instance) {
                    // The shared lock is held for the whole call, so the slot cannot be
                    // freed (and reused by another instance) under us.
                    let holder = Holder::new(slot, tier);
                    let mut added = 0;
                    for &h in hashes {
                        let mut shard = self.shards[shard_of(h)].write();
                        let shard = &mut *shard;
                        let Shard { map, slab, .. } = shard;
                        if map.update(h, |value| value.insert(slab, holder)) {
                            shard.entries += 1;
                            added += 1;
                        }
                    }
                    return Ok(added);
                }
            }
            self.instances.write().get_or_add(instance)?;
        }
    }

    /// Forgets that `instance` holds `hashes` (in `tier`, or in any tier when `None`).
    /// Returns how many entries were removed; unknown instances or blocks remove nothing.
    pub fn remove(&self, instance: InstanceId, hashes: &[BlockHash], tier: Option<Tier>) -> usize {
        let instances = self.instances.read();
        let Some(slot) = instances.slot_of(instance) else {
            return 0;
        };
        let mut removed = 0;
        for &h in hashes {
            let mut shard = self.shards[shard_of(h)].write();
            removed += Self::remove_in_shard(&mut shard, h, |x| x.slot() == slot && tier.is_none_or(|t| x.tier() == t));
        }
        removed
    }

    fn remove_in_shard(shard: &mut Shard, h: BlockHash, pred: impl FnMut(Holder) -> bool) -> usize {
        let Shard { map, slab, entries } = shard;
        let n = map.update(h, |value| if value.is_empty() { 0 } else { value.remove_where(slab, pred) });
        *entries -= n;
        n
    }

    /// Drops every entry of `instance` (a scan of the whole index). Returns how many.
    pub fn remove_instance(&self, instance: InstanceId) -> usize {
        let mut instances = self.instances.write();
        let Some(slot) = instances.slot_of(instance) else {
            return 0;
        };
        let mut removed = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.write();
            let Shard { map, slab, entries } = &mut *shard;
            map.for_each_mut(|value| {
                let n = value.remove_where(slab, |x| x.slot() == slot);
                *entries -= n;
                removed += n;
            });
        }
        instances.remove(instance);
        removed
    }

    fn holders_raw(&self, h: BlockHash, out: &mut HolderBuf) {
        out.clear();
        let shard = self.shards[shard_of(h)].read();
        if let Some(v) = shard.map.get(h) {
            v.for_each(&shard.slab, |x| out.push(x));
        }
    }

    /// Every (instance, tier) that holds `h`, sorted.
    pub fn holders(&self, h: BlockHash) -> Vec<(InstanceId, Tier)> {
        let instances = self.instances.read();
        let mut buf = Vec::new();
        self.holders_raw(h, &mut buf);
        let mut out: Vec<_> = buf.iter().filter_map(|x| instances.id_of(x.slot()).map(|id| (id, x.tier()))).collect();
        out.sort_unstable();
        out
    }

    /// For every instance that holds at least `hashes[0]`: how many leading blocks it
    /// holds without a gap, split by tier. Sorted by instance id. Empty for no hashes.
    pub fn match_prefix(&self, hashes: &[BlockHash]) -> Vec<PrefixMatch> {
        let mut out = Vec::new();
        self.match_prefix_into(hashes, &mut out);
        out
    }

    /// [`match_prefix`](Self::match_prefix) into a caller-owned buffer, for the
    /// conductor's hot path.
    ///
    /// Speed comes from memory-level parallelism: with a large index every probe is a
    /// cache miss, and a lock acquisition per probe (an atomic read-modify-write, which
    /// orders memory) would serialise those misses. So the shard read locks a chunk needs
    /// are taken first, then the chunk's probes run back to back with no atomics between
    /// them and the CPU overlaps their misses. Locks are taken with `read_recursive`, so a
    /// waiting writer never blocks a reader that already holds other shards (writers hold
    /// one shard at a time and wait on nothing else, so there is no cycle); all are
    /// released when the call returns.
    pub fn match_prefix_into(&self, hashes: &[BlockHash], out: &mut Vec<PrefixMatch>) {
        const CHUNK: usize = 16;
        out.clear();
        if hashes.is_empty() {
            return;
        }
        let instances = self.instances.read();
        let mut guards: [Option<RwLockReadGuard<'_, Shard>>; SHARDS] = [const { None }; SHARDS];
        // Candidates: (slot, blocks by tier rank, still matching).
        let mut cands: Vec<(u32, [usize; 3], bool)> = Vec::new();
        let mut alive = 0usize;
        let mut buf = HolderBuf::with_capacity(8);
        for (c, chunk) in hashes.chunks(CHUNK).enumerate() {
            let mut shard_ids = [0usize; CHUNK];
            for (sid, &h) in shard_ids.iter_mut().zip(chunk) {
                *sid = shard_of(h);
                if guards[*sid].is_none() {
                    guards[*sid] = Some(self.shards[*sid].read_recursive());
                }
            }
            for (&h, &sid) in chunk.iter().zip(&shard_ids) {
                if let Some(g) = &guards[sid] {
                    g.map.prefetch(h);
                }
            }
            let mut values = [Slot2::EMPTY; CHUNK];
            for ((v, &h), &sid) in values.iter_mut().zip(chunk).zip(&shard_ids) {
                if let Some(g) = &guards[sid] {
                    if let Some(found) = g.map.get(h) {
                        *v = *found;
                    }
                }
            }
            for (j, (v, &sid)) in values.iter().zip(&shard_ids).take(chunk.len()).enumerate() {
                buf.clear();
                if let Some(g) = &guards[sid] {
                    v.for_each(&g.slab, |x| buf.push(x));
                }
                if c == 0 && j == 0 {
                    buf.sort_unstable_by_key(|x| (x.slot(), x.rank())); // by slot, fastest tier first
                    for x in &buf {
                        match cands.last_mut() {
                            Some(c) if c.0 == x.slot() => {} // the same instance's slower copy
                            _ => {
                                let mut by_rank = [0; 3];
                                by_rank[x.rank()] = 1;
                                cands.push((x.slot(), by_rank, true));
                            }
                        }
                    }
                    alive = cands.len();
                    continue;
                }
                for cand in cands.iter_mut().filter(|c| c.2) {
                    let mut best = usize::MAX; // the fastest rank this instance holds the block in
                    for x in buf.iter().filter(|x| x.slot() == cand.0) {
                        best = best.min(x.rank());
                    }
                    if best < 3 {
                        cand.1[best] += 1;
                    } else {
                        cand.2 = false;
                        alive -= 1;
                    }
                }
                if alive == 0 {
                    break;
                }
            }
            if alive == 0 {
                break;
            }
        }
        drop(guards);
        out.extend(cands.iter().filter_map(|&(slot, n, _)| {
            instances.id_of(slot).map(|instance| PrefixMatch {
                instance,
                gpu: n[Tier::Gpu.rank()],
                dram: n[Tier::Dram.rank()],
                ssd: n[Tier::Ssd.rank()],
            })
        }));
        out.sort_unstable_by_key(|m| m.instance);
    }

    /// The instance with the longest match (ties: more blocks in memory, more on the
    /// GPU, then the lowest id).
    pub fn best_prefix(&self, hashes: &[BlockHash]) -> Option<PrefixMatch> {
        best_of(&self.match_prefix(hashes))
    }

    /// Number of distinct blocks.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.read().map.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn instances(&self) -> Vec<InstanceId> {
        self.instances.read().ids()
    }

    pub fn stats(&self) -> IndexStats {
        let instances = self.instances.read();
        let mut per_slot: HashMap<u32, [usize; 3]> = HashMap::new();
        let mut stats = IndexStats {
            instances: instances.len(),
            memory_bytes: instances.heap_bytes() + std::mem::size_of::<Self>(),
            ..Default::default()
        };
        for shard in self.shards.iter() {
            let shard = shard.read();
            stats.blocks += shard.map.len();
            stats.entries += shard.entries;
            stats.memory_bytes += shard.map.allocation_size() + shard.slab.heap_bytes();
            for (_, v) in shard.map.iter() {
                v.for_each(&shard.slab, |x| {
                    per_slot.entry(x.slot()).or_default()[x.tier() as usize] += 1;
                });
            }
        }
        let mut by_id: Vec<(InstanceId, [usize; 3])> =
            per_slot.into_iter().filter_map(|(slot, n)| instances.id_of(slot).map(|id| (id, n))).collect();
        by_id.sort_unstable();
        stats.per_instance = by_id
            .iter()
            .filter(|(_, n)| n[Tier::Dram as usize] + n[Tier::Ssd as usize] > 0)
            .map(|&(id, n)| (id, n[Tier::Dram as usize], n[Tier::Ssd as usize]))
            .collect();
        stats.per_instance_gpu = by_id
            .iter()
            .filter(|(_, n)| n[Tier::Gpu as usize] > 0)
            .map(|&(id, n)| (id, n[Tier::Gpu as usize]))
            .collect();
        stats
    }

    /// Checks every internal invariant; tests call it after random operation sequences.
    pub fn check_integrity(&self) -> Result<(), String> {
        let instances = self.instances.read();
        instances.check()?;
        for (i, shard) in self.shards.iter().enumerate() {
            let shard = shard.read();
            let mut entries = 0;
            shard.map.check()?;
            for (h, v) in shard.map.iter() {
                if shard_of(h) != i {
                    return Err(format!("block {h:#x} in shard {i}, belongs in {}", shard_of(h)));
                }
                if v.is_empty() {
                    return Err(format!("block {h:#x} has no holders but is still indexed"));
                }
                let mut seen = Vec::new();
                v.for_each(&shard.slab, |x| seen.push(x));
                entries += seen.len();
                for x in &seen {
                    if instances.id_of(x.slot()).is_none() {
                        return Err(format!("block {h:#x} held by a freed slot {}", x.slot()));
                    }
                }
                seen.sort_unstable();
                seen.dedup();
                if seen.len() != v.len(&shard.slab) {
                    return Err(format!("block {h:#x} lists a holder twice"));
                }
            }
            if entries != shard.entries {
                return Err(format!("shard {i} counts {} entries, holds {entries}", shard.entries));
            }
        }
        Ok(())
    }
}

/// The longest match (ties: more blocks in memory, then more on the GPU, then the
/// lowest instance id).
pub fn best_of(matches: &[PrefixMatch]) -> Option<PrefixMatch> {
    matches.iter().copied().max_by(|a, b| {
        a.total()
            .cmp(&b.total())
            .then(a.in_memory().cmp(&b.in_memory()))
            .then(a.gpu.cmp(&b.gpu))
            .then(b.instance.cmp(&a.instance))
    })
}

#[cfg(test)]
mod tests;
