//! Store events (for the conductor's index) and the counters behind `stats()`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::hash::BlockHash;
use crate::index::Tier;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// A block was committed to DRAM (put / reserve+commit).
    Stored,
    /// A block left a tier to make room (from DRAM: it may still be demoted to SSD).
    Evicted,
    /// A block evicted from DRAM reached the SSD tier.
    Demoted,
    /// An SSD block was read back into a DRAM slot.
    Promoted,
    /// `remove()` (or a corrupt SSD slot) dropped the block from this tier.
    Removed,
}

impl EventKind {
    pub fn name(self) -> &'static str {
        match self {
            EventKind::Stored => "stored",
            EventKind::Evicted => "evicted",
            EventKind::Demoted => "demoted",
            EventKind::Promoted => "promoted",
            EventKind::Removed => "removed",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreEvent {
    pub kind: EventKind,
    pub key: BlockHash,
    /// The tier the event happened in (for `Demoted`/`Promoted`: the tier it arrived in).
    pub tier: Tier,
}

/// What a store event means for the conductor's index: the block is now held in a tier,
/// or no longer held in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IndexEffect {
    Held(Tier),
    Dropped(Tier),
}

impl StoreEvent {
    /// A commit, a demotion (it arrived in SSD) or a promotion (it arrived in DRAM) makes
    /// the block held in the event's tier; an eviction or a removal drops it from that
    /// tier. (A DRAM eviction that is then demoted is followed by its `Demoted` event.)
    pub fn index_effect(&self) -> IndexEffect {
        match self.kind {
            EventKind::Stored | EventKind::Demoted | EventKind::Promoted => IndexEffect::Held(self.tier),
            EventKind::Evicted | EventKind::Removed => IndexEffect::Dropped(self.tier),
        }
    }
}

/// A bounded FIFO of events; when full the oldest is dropped and counted.
pub struct EventLog {
    queue: Mutex<VecDeque<StoreEvent>>,
    cap: usize,
    pub dropped: AtomicU64,
    /// `Evicted` and `Removed` events pushed since the last drain (a reader that keeps a
    /// table of what the store holds must drain before it answers from that table; a log
    /// of `Stored` events alone changes nothing it answers)
    losses: AtomicUsize,
}

impl EventLog {
    pub fn new(cap: usize) -> Self {
        EventLog { queue: Mutex::new(VecDeque::new()), cap, dropped: AtomicU64::new(0), losses: AtomicUsize::new(0) }
    }

    pub fn push(&self, kind: EventKind, key: BlockHash, tier: Tier) {
        if self.cap == 0 {
            return;
        }
        let mut q = self.queue.lock();
        if q.len() >= self.cap {
            q.pop_front();
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        if matches!(kind, EventKind::Evicted | EventKind::Removed) {
            // (under the queue's lock, as the drain that resets it: never reset past a loss)
            self.losses.fetch_add(1, Ordering::Release);
        }
        q.push_back(StoreEvent { kind, key, tier });
    }

    pub fn drain(&self) -> Vec<StoreEvent> {
        let mut q = self.queue.lock();
        self.losses.store(0, Ordering::Release);
        q.drain(..).collect()
    }

    /// `Evicted` and `Removed` events pushed since the last drain (counted even when the
    /// log was full and dropped them: a reader must still drain).
    pub fn pending_losses(&self) -> usize {
        self.losses.load(Ordering::Acquire)
    }

    /// Events waiting to be drained.
    pub fn len(&self) -> usize {
        self.queue.lock().len()
    }
}

/// Monotonic counters, updated without locks.
#[derive(Default)]
pub struct Counters {
    pub puts: AtomicU64,
    pub hits_dram: AtomicU64,
    pub hits_ssd: AtomicU64,
    pub misses: AtomicU64,
    pub evictions_dram: AtomicU64,
    pub evictions_ssd: AtomicU64,
    pub demotions: AtomicU64,
    pub demotions_dropped: AtomicU64,
    pub demotion_failures: AtomicU64,
    pub promotions: AtomicU64,
    pub corrupt_dropped: AtomicU64,
    pub recovered: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// A snapshot of the store's counters and occupancy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub puts: u64,
    pub hits_dram: u64,
    pub hits_ssd: u64,
    /// Gets that found the block in neither tier.
    pub misses: u64,
    pub evictions_dram: u64,
    pub evictions_ssd: u64,
    /// Blocks written to the SSD tier after DRAM eviction.
    pub demotions: u64,
    /// Blocks dropped because the demotion queue was full (never reached SSD).
    pub demotions_dropped: u64,
    /// Demotion writes that failed (I/O error; reported by the next `flush()`).
    pub demotion_failures: u64,
    pub promotions: u64,
    /// SSD slots found torn or corrupted (at recovery or on read), dropped, never served.
    pub corrupt_dropped: u64,
    /// Blocks recovered from the SSD tier when the store was opened.
    pub recovered: u64,
    pub events_dropped: u64,
    pub blocks_dram: u64,
    pub blocks_ssd: u64,
    pub bytes_dram: u64,
    pub bytes_ssd: u64,
    pub slots_dram: u64,
    pub slots_ssd: u64,
    pub pinned: u64,
    /// Demotions waiting in the queue.
    pub demotion_queue: u64,
}

impl Counters {
    pub fn fill(&self, s: &mut StoreStats) {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        s.puts = g(&self.puts);
        s.hits_dram = g(&self.hits_dram);
        s.hits_ssd = g(&self.hits_ssd);
        s.misses = g(&self.misses);
        s.evictions_dram = g(&self.evictions_dram);
        s.evictions_ssd = g(&self.evictions_ssd);
        s.demotions = g(&self.demotions);
        s.demotions_dropped = g(&self.demotions_dropped);
        s.demotion_failures = g(&self.demotion_failures);
        s.promotions = g(&self.promotions);
        s.corrupt_dropped = g(&self.corrupt_dropped);
        s.recovered = g(&self.recovered);
    }
}
