//! `Store::stats` and the integrity check (read-only views over the store's parts).

use std::sync::atomic::Ordering;

use super::events::{EventKind, StoreEvent, StoreStats};
use super::tiered::Store;
use crate::index::Tier;

impl Store {
    pub fn stats(&self) -> StoreStats {
        let mut s = StoreStats::default();
        self.counters.fill(&mut s);
        let entries = self.table.snapshot();
        s.events_dropped = self.log.dropped.load(Ordering::Relaxed);
        s.blocks_dram = entries.len() as u64;
        s.pinned = entries.iter().filter(|(_, e)| e.pins > 0).count() as u64;
        s.bytes_dram = s.blocks_dram * self.cfg.block_bytes as u64;
        s.slots_dram = self.slots() as u64;
        if let Some(ssd) = &self.ssd {
            s.blocks_ssd = ssd.len() as u64;
            s.bytes_ssd = s.blocks_ssd * self.cfg.block_bytes as u64;
            s.slots_ssd = ssd.slots() as u64;
            s.demotion_queue = ssd.pending_len() as u64;
        }
        s
    }

    /// What the store holds now, as one `Stored` event per block and tier (DRAM blocks
    /// first): for an index that was not fed this store's events from the start (a new
    /// conductor, a new pool). Applying it, then the events drained after it, gives the
    /// store's state even if some of those events happened before it (each event sets a
    /// block's presence in one tier, so the last one for a block and tier decides).
    pub fn held_events(&self) -> Vec<StoreEvent> {
        let mut out: Vec<StoreEvent> = self
            .table
            .snapshot()
            .into_iter()
            .map(|(key, _)| StoreEvent { kind: EventKind::Stored, key, tier: Tier::Dram })
            .collect();
        if let Some(ssd) = &self.ssd {
            out.extend(ssd.keys().into_iter().map(|key| StoreEvent { kind: EventKind::Stored, key, tier: Tier::Ssd }));
        }
        out
    }

    /// Checks the store's invariants (quiescent state): every slot is free, in the table
    /// once, or held only by live leases; the policy tracks exactly the table's keys.
    pub fn check_integrity(&self) -> Result<(), String> {
        let entries = self.table.snapshot();
        let mut seen = vec![false; self.slots()];
        for (k, e) in &entries {
            let s = e.slot as usize;
            if s >= seen.len() || seen[s] {
                return Err(format!("slot {s} of {k:#x} out of range or shared"));
            }
            seen[s] = true;
            if self.arena.refs(e.slot) == 0 {
                return Err(format!("slot {s} of {k:#x} has no reference"));
            }
        }
        let policy = self.policy.lock();
        if policy.len() != entries.len() || entries.iter().any(|(k, _)| !policy.contains(*k)) {
            return Err(format!("policy tracks {} keys, table has {}", policy.len(), entries.len()));
        }
        let free = self.arena.free_count();
        let leased_only = (0..self.slots() as u32).filter(|&s| !seen[s as usize] && self.arena.refs(s) > 0).count();
        if free + entries.len() + leased_only != self.slots() {
            return Err(format!(
                "{} free + {} stored + {leased_only} leased-only != {} slots",
                free,
                entries.len(),
                self.slots()
            ));
        }
        Ok(())
    }
}
