//! One engine instance's map from its own block hashes to ours, bounded in memory.
//!
//! An engine's hashes are opaque, so the index keys blocks by hashes we recompute from
//! `BlockStored`'s token ids; `BlockRemoved` carries only the engine's hashes, and this
//! map translates them back. Per entry it also keeps which media of the instance hold the
//! block (a bit each, at most [`MEDIA_BITS`]).
//!
//! Semantics (those of the Python `dict` map it replaces, `DictEngineHashMap`): entries
//! are kept in the order they were last stored (storing an engine hash again moves it
//! to the back, clearing a medium does not); an entry stays after its block left every
//! medium, so a later store can still name it as parent; when more than `capacity`
//! entries are held, [`EngineHashMap::evict_overflow`] drops the oldest and hands back
//! the blocks still held, for the caller to remove from the index.
//!
//! Entries are keyed by (engine hash, group): a hybrid model's KV cache groups each
//! publish their blocks (the same engine hash may name a block of each group), and the
//! caller decides which groups count. Several entries may map to one hash of ours (the
//! same tokens under several engine hashes: two groups, or an engine hash we cannot
//! tell apart from another); our block stays held while any of them holds it on a
//! medium of the key asked about, for every group that decides ([`EngineHashMap::held`]):
//! a removal, a reuse or an eviction of one entry does not drop a block the others hold.
//!
//! Layout: the entries live in a slab (`Vec<Node>`) linked in storing order, and a
//! `hashbrown::HashTable` of (32-bit hash tag, slab index) finds them by engine hash and
//! group. Entries with the same hash of ours form a ring (`sib`), found through a second
//! table of (32-bit tag, slab index) per distinct hash of ours (`memory_bytes` at 1M
//! int-keyed entries: 105 bytes an entry, 86 before the rings).

use hashbrown::HashTable;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::error::{Categorized, ErrorCategory};
use crate::hash::BlockHash;
use crate::interop::events::KeyRef;

/// Media one entry can track.
pub const MEDIA_BITS: u32 = 8;

/// The largest capacity (slab indices are `u32`, and one event may overshoot it).
pub const MAX_CAPACITY: usize = 1 << 31;

/// An engine's block hash, owned (see [`KeyRef`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EngineHash {
    Int(i128),
    Bytes(Box<[u8]>),
}

impl EngineHash {
    pub fn as_key(&self) -> KeyRef<'_> {
        match self {
            EngineHash::Int(v) => KeyRef::Int(*v),
            EngineHash::Bytes(b) => KeyRef::Bytes(b),
        }
    }
}

impl KeyRef<'_> {
    pub fn to_owned_hash(self) -> EngineHash {
        match self {
            KeyRef::Int(v) => EngineHash::Int(v),
            KeyRef::Bytes(b) => EngineHash::Bytes(b.into()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    #[error("EngineHashMap capacity must be in 1..=2^31, got {0}")]
    Capacity(u128),
}

impl Categorized for MapError {
    fn category(&self) -> ErrorCategory {
        ErrorCategory::InvalidArgument
    }
}

/// Groups one map tells apart (a `u64` mask of them decides holding).
pub const MAX_GROUPS: u32 = 64;

/// 32 bits of a key's hash: the table keeps them beside each entry's slab index, so
/// growing the table and probing past other keys never read the slab.
#[inline]
fn tag_of(k: KeyRef<'_>, group: u8) -> u32 {
    key_tag(k) ^ u32::from(group).wrapping_mul(0x9E37_79B9)
}

/// 32 bits of one of our hashes (for the ring table; hashes of ours are already uniform).
#[inline]
fn ours_tag(o: BlockHash) -> u32 {
    let x = (o as u64) ^ ((o >> 64) as u64);
    (x ^ (x >> 32)) as u32
}

#[inline]
fn key_tag(k: KeyRef<'_>) -> u32 {
    let h = match k {
        KeyRef::Int(v) => {
            let v = v as u128;
            let x = (v as u64) ^ ((v >> 64) as u64).rotate_left(29);
            let m = (x as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
            (m as u64) ^ ((m >> 64) as u64)
        }
        KeyRef::Bytes(b) => xxh3_64_with_seed(b, 0x6d6f_6f6e_6361_6b65),
    };
    (h ^ (h >> 32)) as u32
}

/// The table's 64-bit hash, from the 32-bit tag alone (spread over every bit).
#[inline]
fn table_hash(tag: u32) -> u64 {
    (tag as u64 | 1 << 32).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// A table entry: the tag above, the slab index below.
#[inline]
fn entry(tag: u32, i: u32) -> u64 {
    (tag as u64) << 32 | i as u64
}

#[inline]
fn entry_hash(e: &u64) -> u64 {
    table_hash((*e >> 32) as u32)
}

const NIL: u32 = u32::MAX;

#[derive(Debug)]
struct Node {
    key: EngineHash,
    ours: BlockHash,
    media: u8,
    group: u8,
    prev: u32,
    next: u32,
    /// The next entry with the same `ours` (itself when alone).
    sib: u32,
}

/// `engine hash -> (our hash, media bit mask)`, at most `capacity` entries after
/// [`evict_overflow`](Self::evict_overflow).
#[derive(Debug)]
pub struct EngineHashMap {
    /// [`entry`]s: (tag, slab index).
    table: HashTable<u64>,
    /// One [`entry`] per distinct `ours`: (its 32-bit tag, the slab index of a member of
    /// its ring); the tag lets the table grow without reading the slab.
    rings: HashTable<u64>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    /// Oldest and newest entry (`NIL` when empty).
    head: u32,
    tail: u32,
    capacity: usize,
    evicted: u64,
}

impl EngineHashMap {
    pub fn new(capacity: usize) -> Result<Self, MapError> {
        if capacity == 0 || capacity > MAX_CAPACITY {
            return Err(MapError::Capacity(capacity as u128));
        }
        Ok(EngineHashMap {
            table: HashTable::new(),
            rings: HashTable::new(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            capacity,
            evicted: 0,
        })
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Entries dropped because the map was full.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    #[inline]
    fn find(&self, k: KeyRef<'_>, group: u8) -> Option<u32> {
        let nodes = &self.nodes;
        let tag = tag_of(k, group);
        self.table
            .find(table_hash(tag), |&e| {
                let n = &nodes[e as u32 as usize];
                (e >> 32) as u32 == tag && n.group == group && n.key.as_key() == k
            })
            .map(|&e| e as u32)
    }

    /// (our hash, media mask) of an engine hash of group 0 seen in a store (held or not).
    pub fn get(&self, k: KeyRef<'_>) -> Option<(BlockHash, u8)> {
        self.get_in(k, 0)
    }

    /// [`get`](Self::get) in `group`.
    pub fn get_in(&self, k: KeyRef<'_>, group: u8) -> Option<(BlockHash, u8)> {
        self.find(k, group).map(|i| {
            let n = &self.nodes[i as usize];
            (n.ours, n.media)
        })
    }

    pub fn ours(&self, k: KeyRef<'_>) -> Option<BlockHash> {
        self.get(k).map(|(o, _)| o)
    }

    pub fn ours_in(&self, k: KeyRef<'_>, group: u8) -> Option<BlockHash> {
        self.get_in(k, group).map(|(o, _)| o)
    }

    /// The media mask that holds the block now (0: none or unknown).
    pub fn media(&self, k: KeyRef<'_>) -> u8 {
        self.get(k).map_or(0, |(_, m)| m)
    }

    pub fn media_in(&self, k: KeyRef<'_>, group: u8) -> u8 {
        self.get_in(k, group).map_or(0, |(_, m)| m)
    }

    /// A member of the ring of entries mapping to `ours`.
    fn ring_of(&self, ours: BlockHash) -> Option<u32> {
        let nodes = &self.nodes;
        let tag = ours_tag(ours);
        self.rings
            .find(table_hash(tag), |&e| (e >> 32) as u32 == tag && nodes[e as u32 as usize].ours == ours)
            .map(|&e| e as u32)
    }

    fn ring_join(&mut self, i: u32) {
        let ours = self.nodes[i as usize].ours;
        self.nodes[i as usize].sib = i;
        let nodes = &self.nodes;
        // One probe for both outcomes (this runs for every new entry: the ingest's hot path).
        let tag = ours_tag(ours);
        let same = |e: &u64| (*e >> 32) as u32 == tag && nodes[*e as u32 as usize].ours == ours;
        let j = match self.rings.entry(table_hash(tag), same, entry_hash) {
            hashbrown::hash_table::Entry::Occupied(e) => *e.get() as u32,
            hashbrown::hash_table::Entry::Vacant(e) => {
                e.insert(entry(tag, i));
                return;
            }
        };
        let after = self.nodes[j as usize].sib;
        self.nodes[i as usize].sib = after;
        self.nodes[j as usize].sib = i;
    }

    fn ring_leave(&mut self, i: u32) {
        let (ours, next) = (self.nodes[i as usize].ours, self.nodes[i as usize].sib);
        let tag = ours_tag(ours);
        let h = table_hash(tag);
        let nodes = &self.nodes;
        let Ok(slot) = self.rings.find_entry(h, |&e| (e >> 32) as u32 == tag && nodes[e as u32 as usize].ours == ours)
        else {
            return;
        };
        if next == i {
            slot.remove();
            return;
        }
        // The ring's predecessor of `i` (rings are short: one entry per engine hash and
        // group naming these tokens).
        let mut p = next;
        while self.nodes[p as usize].sib != i {
            p = self.nodes[p as usize].sib;
        }
        let nodes = &self.nodes;
        if let Ok(mut slot) =
            self.rings.find_entry(h, |&e| (e >> 32) as u32 == tag && nodes[e as u32 as usize].ours == ours)
        {
            if *slot.get() as u32 == i {
                *slot.get_mut() = entry(tag, p);
            }
        }
        self.nodes[p as usize].sib = next;
        self.nodes[i as usize].sib = i;
    }

    /// Whether our block `ours` is held on a medium of `mask` by every group of
    /// `deciding` (a mask of group numbers): some entry of each of those groups maps to
    /// it and holds one of those media.
    pub fn held(&self, ours: BlockHash, mask: u8, deciding: u64) -> bool {
        let Some(start) = self.ring_of(ours) else { return deciding == 0 };
        let mut have = 0u64;
        let mut i = start;
        loop {
            let n = &self.nodes[i as usize];
            if n.media & mask != 0 {
                have |= 1u64 << (u32::from(n.group) % MAX_GROUPS);
                if have & deciding == deciding {
                    return true;
                }
            }
            i = n.sib;
            if i == start {
                return have & deciding == deciding;
            }
        }
    }

    fn unlink(&mut self, i: u32) {
        let (prev, next) = {
            let n = &self.nodes[i as usize];
            (n.prev, n.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    fn push_back(&mut self, i: u32) {
        let tail = self.tail;
        {
            let n = &mut self.nodes[i as usize];
            n.prev = tail;
            n.next = NIL;
        }
        if tail == NIL {
            self.head = i;
        } else {
            self.nodes[tail as usize].next = i;
        }
        self.tail = i;
    }

    /// Records that `k` (= our `ours`) is now held in medium `bit` (a mask). Returns the
    /// (our old hash, media mask) of an entry whose engine hash now names other tokens
    /// (the engine reused a hash) and that some medium still held.
    pub fn store_one(&mut self, k: KeyRef<'_>, ours: BlockHash, bit: u8) -> Option<(BlockHash, u8)> {
        self.store_one_in(k, 0, ours, bit)
    }

    /// [`store_one`](Self::store_one) in `group`. The caller checks [`held`](Self::held)
    /// for a replaced block before removing it (another entry may still hold it).
    pub fn store_one_in(&mut self, k: KeyRef<'_>, group: u8, ours: BlockHash, bit: u8) -> Option<(BlockHash, u8)> {
        let tag = tag_of(k, group);
        if let Some(i) = self.find(k, group) {
            self.unlink(i);
            let mut replaced = None;
            if self.nodes[i as usize].ours == ours {
                self.nodes[i as usize].media |= bit;
            } else {
                self.ring_leave(i);
                let n = &mut self.nodes[i as usize];
                if n.media != 0 {
                    replaced = Some((n.ours, n.media));
                }
                n.ours = ours;
                n.media = bit;
                self.ring_join(i);
            }
            self.push_back(i);
            return replaced;
        }
        let node = Node { key: k.to_owned_hash(), ours, media: bit, group, prev: NIL, next: NIL, sib: NIL };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                // `len <= capacity + one event's hashes`, far below u32::MAX for a capacity <= 2^31.
                let i = u32::try_from(self.nodes.len()).unwrap_or(NIL - 1);
                self.nodes.push(node);
                i
            }
        };
        self.table.insert_unique(table_hash(tag), entry(tag, i), entry_hash);
        self.ring_join(i);
        self.push_back(i);
        None
    }

    /// [`store_one_in`](Self::store_one_in) for each pair of `engine` and `ours` (up to
    /// the shorter); the replaced entries are appended to `replaced`.
    pub fn store(
        &mut self,
        engine: &[KeyRef<'_>],
        ours: &[BlockHash],
        bit: u8,
        group: u8,
        replaced: &mut Vec<(BlockHash, u8)>,
    ) {
        for (&k, &o) in engine.iter().zip(ours) {
            if let Some(r) = self.store_one_in(k, group, o, bit) {
                replaced.push(r);
            }
        }
    }

    /// Clears medium `bit` of these engine hashes of `group`. Our hashes whose index
    /// entry must go are appended to `out`: those the cleared entry held and that are no
    /// longer [`held`](Self::held) on a medium of `same_key` (the media sharing the
    /// removed medium's index key) by every group of `deciding`. Returns how many
    /// engine hashes were unknown.
    pub fn remove(
        &mut self,
        engine: &[KeyRef<'_>],
        bit: u8,
        same_key: u8,
        group: u8,
        deciding: u64,
        out: &mut Vec<BlockHash>,
    ) -> usize {
        let only_this_group = deciding == 1u64 << (u32::from(group) % MAX_GROUPS);
        let mut unknown = 0;
        for &k in engine {
            match self.find(k, group) {
                None => unknown += 1,
                Some(i) => {
                    let n = &mut self.nodes[i as usize];
                    if n.media & bit != 0 {
                        n.media &= !bit;
                        let ours = n.ours;
                        // The usual case: the only entry of its block, one group decides.
                        let gone = if n.sib == i && only_this_group {
                            n.media & same_key == 0
                        } else {
                            !self.held(ours, same_key, deciding)
                        };
                        if gone {
                            out.push(ours);
                        }
                    }
                }
            }
        }
        unknown
    }

    fn pop_front(&mut self) -> Option<(BlockHash, u8)> {
        let i = self.head;
        if i == NIL {
            return None;
        }
        self.unlink(i);
        self.ring_leave(i);
        let tag = tag_of(self.nodes[i as usize].key.as_key(), self.nodes[i as usize].group);
        if let Ok(e) = self.table.find_entry(table_hash(tag), |&e| e == entry(tag, i)) {
            e.remove();
        }
        let n = &mut self.nodes[i as usize];
        n.key = EngineHash::Int(0); // free a bytes key now
        self.free.push(i);
        Some((n.ours, n.media))
    }

    /// Drops the oldest entries beyond capacity; appends (our hash, media mask) of those
    /// still held to `out`. Returns how many were dropped.
    pub fn evict_overflow(&mut self, out: &mut Vec<(BlockHash, u8)>) -> usize {
        let over = self.len().saturating_sub(self.capacity);
        for _ in 0..over {
            if let Some((ours, media)) = self.pop_front() {
                if media != 0 {
                    out.push((ours, media));
                }
            }
        }
        self.evicted += over as u64;
        over
    }

    /// Forgets every entry (`evicted` stays).
    pub fn clear(&mut self) {
        self.table.clear();
        self.rings.clear();
        self.nodes.clear();
        self.free.clear();
        self.head = NIL;
        self.tail = NIL;
    }

    /// (engine hash, our hash, media mask) of every entry, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = (KeyRef<'_>, BlockHash, u8)> + '_ {
        let mut i = self.head;
        std::iter::from_fn(move || {
            if i == NIL {
                return None;
            }
            let n = &self.nodes[i as usize];
            i = n.next;
            Some((n.key.as_key(), n.ours, n.media))
        })
    }

    /// Heap bytes held (the slab, its free list and the table).
    pub fn heap_bytes(&self) -> usize {
        let bytes_keys: usize = self
            .iter()
            .map(|(k, _, _)| match k {
                KeyRef::Bytes(b) => b.len(),
                KeyRef::Int(_) => 0,
            })
            .sum();
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.free.capacity() * 4
            + self.table.allocation_size()
            + self.rings.allocation_size()
            + bytes_keys
    }

    fn ring_len(&self, start: u32) -> usize {
        let mut n = 1;
        let mut i = self.nodes[start as usize].sib;
        while i != start && n <= self.len() {
            n += 1;
            i = self.nodes[i as usize].sib;
        }
        n
    }

    /// Checks the invariants: the order list and the table hold the same entries, each
    /// once, and every table entry is found by its own key.
    pub fn check_integrity(&self) -> Result<(), String> {
        let mut seen = 0usize;
        let mut prev = NIL;
        let mut i = self.head;
        while i != NIL {
            let n = self.nodes.get(i as usize).ok_or_else(|| format!("entry {i} past the slab"))?;
            if n.prev != prev {
                return Err(format!("entry {i} links back to {}, not {prev}", n.prev));
            }
            if self.find(n.key.as_key(), n.group) != Some(i) {
                return Err(format!("entry {i} ({:?}) is not found by its key", n.key));
            }
            if self.ring_of(n.ours).is_none() {
                return Err(format!("entry {i} ({:?}): its hash of ours has no ring", n.key));
            }
            // its ring closes and holds only its hash of ours
            let mut j = n.sib;
            let mut steps = 0usize;
            while j != i {
                let m = self.nodes.get(j as usize).ok_or_else(|| format!("ring of entry {i} leaves the slab"))?;
                if m.ours != n.ours {
                    return Err(format!("ring of entry {i} reaches entry {j} of another hash"));
                }
                steps += 1;
                if steps > self.len() {
                    return Err(format!("ring of entry {i} does not close"));
                }
                j = m.sib;
            }
            seen += 1;
            if seen > self.len() {
                return Err("the order list is longer than the table (a cycle?)".into());
            }
            prev = i;
            i = n.next;
        }
        if prev != self.tail {
            return Err(format!("the list ends at {prev}, the tail is {}", self.tail));
        }
        if seen != self.len() {
            return Err(format!("the order list has {seen} entries, the table {}", self.len()));
        }
        let ringed: usize = self.rings.iter().map(|&e| self.ring_len(e as u32)).sum();
        if ringed != self.len() {
            return Err(format!("the rings hold {ringed} entries, the table {}", self.len()));
        }
        if self.nodes.len() != self.len() + self.free.len() {
            return Err(format!("slab {} != entries {} + free {}", self.nodes.len(), self.len(), self.free.len()));
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "engine_map_tests.rs"]
mod tests;
