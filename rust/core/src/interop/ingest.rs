//! One engine instance's KV events applied to block indexes, a whole message per call.
//!
//! [`EventIngestor::apply_payload`] takes the msgpack payload of one ZMQ message and
//! does everything the Python `Ingestor` did event by event: decode the batch
//! ([`super::events`]), decode each `BlockStored`'s token ids, recompute our chained
//! hashes from the parent's (translated through the instance's [`EngineHashMap`]),
//! record engine hash -> ours, insert into the index of the event's medium; translate
//! `BlockRemoved` back and remove; drop everything on `AllBlocksCleared`. No Python
//! object is made per block. The semantics, counters included, are those of the Python
//! reference (`mooncake_rs/interop/ingest_ref.py`), which the tests compare it with.
//!
//! Media: each canonical medium the instance names gets a bit (at most
//! [`MEDIA_BITS`](super::engine_map::MEDIA_BITS)) and a [`Sink`]: an index and a tier.
//! Which index and tier a medium maps to is the Python target's choice, so a medium
//! seen for the first time stops the call with [`Step::NeedMedium`] (nothing of that
//! event applied); the caller registers it ([`EventIngestor::add_medium`]) and calls
//! again from that event.

use std::sync::Arc;

use crate::error::{Categorized, ErrorCategory};
use crate::hash::{BlockHash, HashError, PrefixHasher};
use crate::hash_xxh3::Xxh3RollingHasher;
use crate::index::{BlockIndex, IndexError, InstanceId, Tier};
use crate::interop::engine_map::{EngineHashMap, MapError, MAX_GROUPS, MEDIA_BITS};
use crate::interop::events::{decode_batch, Event, EventError, KeyRef, TokenIds};
use crate::interop::media::canonical_medium;
use crate::interop::msgpack::decode_u32_array;

/// Our chain: the 128-bit prefix hash or the RFC's 64-bit rolling hash.
#[derive(Debug, Clone)]
pub enum ChainHasher {
    Prefix(PrefixHasher),
    Rfc(Xxh3RollingHasher),
}

impl ChainHasher {
    pub fn block_size(&self) -> usize {
        match self {
            ChainHasher::Prefix(h) => h.block_size(),
            ChainHasher::Rfc(h) => h.block_size(),
        }
    }

    /// The chain of `tokens`' blocks; `extras` (one entry per block, or fewer) folded in.
    /// Without any extra, one call over every block (the common case).
    fn hash(
        &self,
        tokens: &[u32],
        parent: Option<BlockHash>,
        extras: &[Option<&[u8]>],
    ) -> Result<Vec<BlockHash>, HashError> {
        let plain = extras.iter().all(Option::is_none);
        match self {
            ChainHasher::Prefix(h) => {
                h.check_parent(parent)?;
                if plain {
                    Ok(h.hash_tokens(tokens, parent))
                } else {
                    h.hash_tokens_with_extras(tokens, parent, extras)
                }
            }
            ChainHasher::Rfc(h) => {
                let parent = match parent {
                    Some(p) => Some(u64::try_from(p).map_err(|_| HashError::ParentOutOfRange(p))?),
                    None => None,
                };
                let got = if plain {
                    h.hash_tokens(tokens, parent)
                } else {
                    h.hash_tokens_with_extras(tokens, parent, extras)?
                };
                Ok(got.into_iter().map(BlockHash::from).collect())
            }
        }
    }
}

/// Where one target key's blocks go.
#[derive(Clone)]
pub struct Sink {
    pub index: Arc<BlockIndex>,
    /// `Some`: insert and remove in this tier. `None`: insert in `dram`, remove from
    /// every tier (an index of one medium, `MediumIndex`).
    pub tier: Option<Tier>,
}

impl Sink {
    fn insert(&self, slot: InstanceId, hashes: &[BlockHash]) -> Result<usize, IndexError> {
        self.index.insert(slot, hashes, self.tier.unwrap_or(Tier::Dram))
    }

    fn remove(&self, slot: InstanceId, hashes: &[BlockHash]) -> usize {
        self.index.remove(slot, hashes, self.tier)
    }
}

/// Counters of what was applied and what was skipped (not raised).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IngestStats {
    pub batches: u64,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub cleared: u64,
    pub resets: u64,
    /// `BlockStored` events whose parent we never saw (skipped: we cannot chain them).
    pub orphans: u64,
    /// `BlockStored` events whose block size or token count does not fit our hasher (or
    /// with more `extra_keys` entries than blocks).
    pub mismatched: u64,
    /// Removed engine hashes we had no entry for.
    pub unknown_removed: u64,
    pub unknown_events: u64,
    /// Events naming a medium beyond the [`MEDIA_BITS`] one instance can track.
    pub media_overflow: u64,
    /// Events of a KV cache group that does not decide what the instance holds (not
    /// full attention: sliding window, mamba...; or beyond the [`MAX_GROUPS`] tracked):
    /// skipped.
    pub other_groups: u64,
}

/// What a `BlockStored` says beyond its blocks and tokens.
#[derive(Debug, Clone, Copy, Default)]
pub struct StoredMeta<'e, 'a> {
    /// `extra_keys`: one entry per block (msgpack bytes; none: empty), folded into our chain.
    pub extras: &'e [Option<&'a [u8]>],
    pub group_idx: Option<i128>,
    /// `kv_cache_spec_kind`.
    pub kind: Option<&'e str>,
}

/// A `BlockStored`'s token ids as they came.
pub enum Tokens<'a> {
    /// A msgpack array (the payload's bytes): decoded first, an error raised at once.
    Msgpack(&'a [u8]),
    U32(&'a [u32]),
    /// Token ids that are not u32s (from Python objects): `len` of them; the error is
    /// raised where the hash would be computed, as the reference does.
    Invalid {
        len: usize,
        message: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IngestError {
    #[error(transparent)]
    Event(#[from] EventError),
    #[error("BlockStored token_ids: {0}")]
    Tokens(String),
    #[error(transparent)]
    Index(#[from] IndexError),
    #[error(transparent)]
    Map(#[from] MapError),
    #[error("an instance tracks at most {MEDIA_BITS} media; {0:?} is one more")]
    TooManyMedia(String),
}

impl Categorized for IngestError {
    fn category(&self) -> ErrorCategory {
        match self {
            IngestError::Event(_) | IngestError::Tokens(_) => ErrorCategory::MalformedEvent,
            IngestError::Index(_) | IngestError::Map(_) | IngestError::TooManyMedia(_) => {
                ErrorCategory::InvalidArgument
            }
        }
    }
}

/// How far a call got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Done,
    /// Event `event` names the canonical medium `name`, not registered yet: nothing of
    /// it was applied. Register it and call again from `event`.
    NeedMedium {
        event: usize,
        name: String,
    },
}

struct KeySink {
    key: String,
    sink: Sink,
    /// The bits of the media that share this key.
    same: u8,
}

enum Medium {
    Bit(u8),
    Overflow,
    Need(String),
}

/// A KV cache group an instance's events name (hybrid models have one per attention
/// kind; `group_idx` nil is group 0).
struct Group {
    idx: i128,
    /// Its number in the engine-hash map (its bit in `deciding`).
    number: u8,
    /// Full attention (or a kind not said yet): decides whether the instance holds a block.
    full: bool,
}

/// The kind vLLM gives full-attention groups (`kv_cache_spec_kind`).
const FULL_ATTENTION: &str = "full_attention";

/// Raw medium spellings remembered (beyond, each is resolved again: still cheap).
const RAW_CACHE: usize = 64;

pub struct EventIngestor {
    slot: InstanceId,
    hasher: ChainHasher,
    block_size: usize,
    map: EngineHashMap,
    stats: IngestStats,
    keys: Vec<KeySink>,
    /// Bit -> (canonical medium, index in `keys`).
    bits: Vec<(String, usize)>,
    /// Raw medium as sent -> its bit (`None`: beyond the media one instance tracks).
    raw: Vec<(Option<String>, Option<u8>)>,
    /// Indexes an `AllBlocksCleared` drops this instance from.
    clear: Vec<Arc<BlockIndex>>,
    toks: Vec<u32>,
    replaced: Vec<(BlockHash, u8)>,
    out: Vec<BlockHash>,
    groups: Vec<Group>,
    /// The groups (by number) that decide: a block is held when each holds it.
    deciding: u64,
}

impl EventIngestor {
    /// `clear`: the indexes to drop the instance from on `AllBlocksCleared` besides
    /// those of the media registered later.
    pub fn new(
        slot: InstanceId,
        hasher: ChainHasher,
        map_capacity: usize,
        clear: Vec<Arc<BlockIndex>>,
    ) -> Result<Self, IngestError> {
        let mut ing = EventIngestor {
            slot,
            block_size: hasher.block_size(),
            hasher,
            map: EngineHashMap::new(map_capacity)?,
            stats: IngestStats::default(),
            keys: Vec::new(),
            bits: Vec::new(),
            raw: Vec::new(),
            clear: Vec::new(),
            toks: Vec::new(),
            replaced: Vec::new(),
            out: Vec::new(),
            groups: Vec::new(),
            deciding: 0,
        };
        for idx in clear {
            ing.add_clear(idx);
        }
        Ok(ing)
    }

    fn add_clear(&mut self, idx: Arc<BlockIndex>) {
        if !self.clear.iter().any(|c| Arc::ptr_eq(c, &idx)) {
            self.clear.push(idx);
        }
    }

    pub fn slot(&self) -> InstanceId {
        self.slot
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn map(&self) -> &EngineHashMap {
        &self.map
    }

    pub fn map_mut(&mut self) -> &mut EngineHashMap {
        &mut self.map
    }

    pub fn stats(&self) -> &IngestStats {
        &self.stats
    }

    /// Every counter by name, in one fixed order (`evicted` is the map's): what a front
    /// end reports as a dict.
    pub fn counters(&self) -> [(&'static str, u64); 12] {
        let s = &self.stats;
        [
            ("batches", s.batches),
            ("stored_blocks", s.stored_blocks),
            ("removed_blocks", s.removed_blocks),
            ("cleared", s.cleared),
            ("resets", s.resets),
            ("orphans", s.orphans),
            ("mismatched", s.mismatched),
            ("unknown_removed", s.unknown_removed),
            ("unknown_events", s.unknown_events),
            ("evicted", self.map.evicted()),
            ("media_overflow", s.media_overflow),
            ("other_groups", s.other_groups),
        ]
    }

    /// The registered media in bit order: (canonical name, target key).
    pub fn media(&self) -> Vec<(String, String)> {
        self.bits.iter().map(|(n, k)| (n.clone(), self.keys[*k].key.clone())).collect()
    }

    /// Gives the next bit to canonical medium `name`, whose blocks go to `sink` under
    /// the target key `key` (media with the same key share the sink). A name already
    /// registered is left as it is.
    pub fn add_medium(&mut self, name: &str, key: &str, sink: Sink) -> Result<(), IngestError> {
        if self.bits.iter().any(|(n, _)| n == name) {
            return Ok(());
        }
        if self.bits.len() >= MEDIA_BITS as usize {
            return Err(IngestError::TooManyMedia(name.to_string()));
        }
        let bit = self.bits.len();
        let k = match self.keys.iter().position(|k| k.key == key) {
            Some(k) => k,
            None => {
                self.add_clear(sink.index.clone());
                self.keys.push(KeySink { key: key.to_string(), sink, same: 0 });
                self.keys.len() - 1
            }
        };
        self.keys[k].same |= 1 << bit;
        self.bits.push((name.to_string(), k));
        Ok(())
    }

    fn medium(&mut self, raw: Option<&str>) -> Medium {
        if let Some((_, got)) = self.raw.iter().find(|(m, _)| m.as_deref() == raw) {
            return got.map_or(Medium::Overflow, Medium::Bit);
        }
        let name = canonical_medium(raw);
        let got = match self.bits.iter().position(|(n, _)| *n == name) {
            Some(b) => Some(b as u8),
            None if self.bits.len() >= MEDIA_BITS as usize => None,
            None => return Medium::Need(name),
        };
        if self.raw.len() < RAW_CACHE {
            self.raw.push((raw.map(str::to_owned), got));
        }
        got.map_or(Medium::Overflow, Medium::Bit)
    }

    /// The map number of the group of an event (`group_idx`, and `kind` when a
    /// `BlockStored` says it), learning the group and its kind; `None` when the group
    /// does not decide (its events are skipped). A group is full attention until a
    /// `BlockStored` says otherwise (the kind a later one says wins).
    fn group(&mut self, idx: Option<i128>, kind: Option<&str>) -> Option<u8> {
        let idx = idx.unwrap_or(0);
        let full = kind.map(|k| k == FULL_ATTENTION);
        let g = match self.groups.iter().position(|g| g.idx == idx) {
            Some(g) => g,
            None if self.groups.len() >= MAX_GROUPS as usize => return None,
            None => {
                let number = self.groups.len() as u8; // < MAX_GROUPS
                self.groups.push(Group { idx, number, full: true });
                self.deciding |= 1 << number;
                self.groups.len() - 1
            }
        };
        let group = &mut self.groups[g];
        if let Some(full) = full {
            group.full = full;
            if full {
                self.deciding |= 1 << group.number;
            } else {
                self.deciding &= !(1 << group.number);
            }
        }
        group.full.then_some(group.number)
    }

    /// The groups known so far: (group_idx, full attention).
    pub fn groups(&self) -> Vec<(i128, bool)> {
        self.groups.iter().map(|g| (g.idx, g.full)).collect()
    }

    /// Decodes the payload only (the whole batch must decode, as for `apply_payload`).
    pub fn check_payload(payload: &[u8]) -> Result<(), EventError> {
        decode_batch(payload).map(|_| ())
    }

    /// Applies one message's batch (`resume`: `None`, or the event a
    /// [`Step::NeedMedium`] stopped at, to go on from there; the batch is counted only
    /// on the first call). An undecodable payload changes nothing; an error in an event
    /// (token ids that are not u32s) leaves the events before it applied.
    pub fn apply_payload(&mut self, payload: &[u8], resume: Option<usize>) -> Result<Step, IngestError> {
        let batch = decode_batch(payload)?;
        let start = match resume {
            Some(i) => i,
            None => {
                self.stats.batches += 1;
                self.stats.unknown_events += batch.unknown as u64;
                0
            }
        };
        for (i, ev) in batch.events.iter().enumerate().skip(start) {
            let need = match ev {
                Event::Stored(s) => {
                    let tokens = match &s.tokens {
                        TokenIds::Decoded(r) => Tokens::U32(&batch.tokens[r.clone()]),
                        TokenIds::Raw(b) => Tokens::Msgpack(b),
                    };
                    let ev = StoredMeta { extras: batch.extras(&s.extras), group_idx: s.group_idx, kind: s.kind };
                    self.stored(batch.hashes(&s.hashes), s.parent, tokens, s.block_size, s.medium, ev)?
                }
                Event::Removed(r) => self.removed(batch.hashes(&r.hashes), r.medium, r.group_idx),
                Event::Cleared => {
                    self.cleared();
                    None
                }
            };
            if let Some(name) = need {
                return Ok(Step::NeedMedium { event: i, name });
            }
        }
        Ok(Step::Done)
    }

    /// Counts batches applied event by event (the object path) and events of unknown types.
    pub fn count_batch(&mut self, batches: u64, unknown: u64) {
        self.stats.batches += batches;
        self.stats.unknown_events += unknown;
    }

    /// One `BlockStored`. `Ok(Some(name))`: medium `name` must be registered first
    /// (nothing applied).
    pub fn stored(
        &mut self,
        hashes: &[KeyRef<'_>],
        parent: Option<KeyRef<'_>>,
        tokens: Tokens<'_>,
        block_size: i128,
        medium: Option<&str>,
        meta: StoredMeta<'_, '_>,
    ) -> Result<Option<String>, IngestError> {
        let n = hashes.len();
        if n == 0 {
            return Ok(None);
        }
        let Some(group) = self.group(meta.group_idx, meta.kind) else {
            self.stats.other_groups += 1;
            return Ok(None);
        };
        let mut toks = std::mem::take(&mut self.toks);
        let got = self.stored_with(hashes, parent, &tokens, &mut toks, block_size, medium, meta.extras, group);
        self.toks = toks;
        got
    }

    #[allow(clippy::too_many_arguments)]
    fn stored_with(
        &mut self,
        hashes: &[KeyRef<'_>],
        parent: Option<KeyRef<'_>>,
        tokens: &Tokens<'_>,
        scratch: &mut Vec<u32>,
        block_size: i128,
        medium: Option<&str>,
        extras: &[Option<&[u8]>],
        group: u8,
    ) -> Result<Option<String>, IngestError> {
        let n = hashes.len();
        let bs = self.block_size;
        let len = match tokens {
            Tokens::Msgpack(raw) => {
                decode_u32_array(raw, scratch).map_err(|e| IngestError::Tokens(e.to_string()))?;
                scratch.len()
            }
            Tokens::U32(t) => t.len(),
            Tokens::Invalid { len, .. } => *len,
        };
        if (block_size != 0 && block_size != bs as i128) || Some(len) != n.checked_mul(bs) || extras.len() > n {
            self.stats.mismatched += 1;
            return Ok(None);
        }
        let parent = match parent {
            None => None,
            Some(p) => match self.map.ours_in(p, group) {
                Some(o) => Some(o),
                None => {
                    self.stats.orphans += 1;
                    return Ok(None);
                }
            },
        };
        let bit = match self.medium(medium) {
            Medium::Bit(b) => b,
            Medium::Overflow => {
                self.stats.media_overflow += 1;
                return Ok(None);
            }
            Medium::Need(name) => return Ok(Some(name)),
        };
        let toks: &[u32] = match tokens {
            Tokens::Msgpack(_) => scratch,
            Tokens::U32(t) => t,
            Tokens::Invalid { message, .. } => return Err(IngestError::Tokens(message.clone())),
        };
        let ours = self.hasher.hash(toks, parent, extras).map_err(|e| IngestError::Tokens(e.to_string()))?;
        let mut replaced = std::mem::take(&mut self.replaced);
        replaced.clear();
        self.map.store(hashes, &ours, 1 << bit, group, &mut replaced);
        if !replaced.is_empty() {
            self.remove_masks(&replaced);
        }
        let key = self.bits[bit as usize].1;
        // With one deciding group, every block just stored is held; with several, those
        // every deciding group holds.
        let inserted = if self.deciding == 1 << group {
            self.keys[key].sink.insert(self.slot, &ours)
        } else {
            let same = self.keys[key].same;
            let held: Vec<BlockHash> =
                ours.iter().copied().filter(|&o| self.map.held(o, same, self.deciding)).collect();
            self.keys[key].sink.insert(self.slot, &held)
        };
        if let Err(e) = inserted {
            self.replaced = replaced;
            return Err(e.into());
        }
        self.stats.stored_blocks += n as u64;
        if self.map.len() > self.map.capacity() {
            replaced.clear();
            self.map.evict_overflow(&mut replaced);
            self.remove_masks(&replaced);
        }
        self.replaced = replaced;
        Ok(None)
    }

    /// One `BlockRemoved`. `Some(name)`: medium `name` must be registered first.
    pub fn removed(&mut self, hashes: &[KeyRef<'_>], medium: Option<&str>, group_idx: Option<i128>) -> Option<String> {
        let Some(group) = self.group(group_idx, None) else {
            self.stats.other_groups += 1;
            return None;
        };
        let bit = match self.medium(medium) {
            Medium::Bit(b) => b,
            Medium::Overflow => {
                self.stats.media_overflow += 1;
                return None;
            }
            Medium::Need(name) => return Some(name),
        };
        let key = self.bits[bit as usize].1;
        let mut out = std::mem::take(&mut self.out);
        out.clear();
        let unknown = self.map.remove(hashes, 1 << bit, self.keys[key].same, group, self.deciding, &mut out);
        self.stats.unknown_removed += unknown as u64;
        if !out.is_empty() {
            self.keys[key].sink.remove(self.slot, &out);
            self.stats.removed_blocks += out.len() as u64;
        }
        self.out = out;
        None
    }

    /// `AllBlocksCleared`: the instance leaves every index it was fed into.
    pub fn cleared(&mut self) {
        self.stats.cleared += 1;
        for idx in &self.clear {
            idx.remove_instance(self.slot);
        }
        self.map.clear();
    }

    /// Events were lost: the map is forgotten (the caller drops the index entries, its
    /// target's whole instance) and the reset counted.
    pub fn reset_map(&mut self) {
        self.stats.resets += 1;
        self.map.clear();
    }

    /// Removes these (our hash, media mask) blocks, entries just replaced or evicted,
    /// from every key their media use, unless the map still holds them there (under
    /// other engine hashes).
    fn remove_masks(&mut self, entries: &[(BlockHash, u8)]) {
        let mut hs = std::mem::take(&mut self.out);
        for k in &self.keys {
            hs.clear();
            hs.extend(
                entries
                    .iter()
                    .filter(|&&(o, m)| m & k.same != 0 && !self.map.held(o, k.same, self.deciding))
                    .map(|(o, _)| *o),
            );
            if !hs.is_empty() {
                k.sink.remove(self.slot, &hs);
            }
        }
        self.out = hs;
    }
}

#[cfg(test)]
#[path = "ingest_tests.rs"]
mod tests;
