//! Feeding a store's drained events straight into the conductor's index, so no caller
//! has to translate them (kind → stored/evicted, batching runs) on its side.

use super::{Conductor, ConductorError};
use crate::hash::BlockHash;
use crate::index::InstanceId;
use crate::store::{IndexEffect, StoreEvent};

/// What one `apply_store_events` call changed in the index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AppliedEvents {
    /// (block, tier) entries that were new.
    pub inserted: usize,
    /// (block, tier) entries that were dropped.
    pub removed: usize,
}

impl Conductor {
    /// Applies `events` of `instance`'s store, in store order: a commit, demotion or
    /// promotion records the block in the event's tier, an eviction or removal forgets
    /// it there. Consecutive events with the same effect go to the index as one batch
    /// (order between batches is kept: a block may be stored, evicted and stored again
    /// within one drain). `UnknownInstance` (and nothing applied) if `instance` was never
    /// added or was removed.
    pub fn apply_store_events(
        &self,
        instance: InstanceId,
        events: &[StoreEvent],
    ) -> Result<AppliedEvents, ConductorError> {
        // The state lock is held throughout, as in on_blocks_stored/evicted, so a
        // concurrent remove_instance cannot interleave and leave entries of a dropped
        // instance behind.
        let st = self.state.lock();
        if !st.knows(instance) {
            return Err(ConductorError::UnknownInstance(instance));
        }
        let mut out = AppliedEvents::default();
        let mut run: Vec<BlockHash> = Vec::with_capacity(events.len().min(1024));
        let mut i = 0;
        while i < events.len() {
            let effect = events[i].index_effect();
            run.clear();
            while i < events.len() && events[i].index_effect() == effect {
                run.push(events[i].key);
                i += 1;
            }
            match effect {
                IndexEffect::Held(tier) => out.inserted += self.index.insert(instance, &run, tier)?,
                IndexEffect::Dropped(tier) => out.removed += self.index.remove(instance, &run, Some(tier)),
            }
        }
        drop(st);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conductor::{ConductorConfig, DecodeSpec, PrefillSpec};
    use crate::index::Tier;
    use crate::store::EventKind;
    use proptest::prelude::*;

    fn conductor() -> Conductor {
        let c = Conductor::new(ConductorConfig::default()).unwrap();
        c.add_prefill(1, PrefillSpec { speed: 1.0 }).unwrap();
        c.add_decode(2, DecodeSpec { max_batch: 8, kv_capacity_tokens: 1 << 20 }).unwrap();
        c
    }

    const KINDS: [EventKind; 5] =
        [EventKind::Stored, EventKind::Evicted, EventKind::Demoted, EventKind::Promoted, EventKind::Removed];

    proptest! {
        /// The same as applying one event at a time with on_blocks_stored/evicted (what
        /// a caller translating the events did), checked on every key's holders.
        #[test]
        fn store_events_match_one_at_a_time(evs in proptest::collection::vec((0usize..5, any::<bool>(), 0u128..12), 0..80)) {
            let evs: Vec<StoreEvent> = evs
                .into_iter()
                .map(|(k, t, key)| StoreEvent { kind: KINDS[k], key, tier: if t { Tier::Ssd } else { Tier::Dram } })
                .collect();
            let a = conductor();
            let b = conductor();
            a.apply_store_events(1, &evs).unwrap();
            for e in &evs {
                match e.index_effect() {
                    IndexEffect::Held(t) => { b.on_blocks_stored(1, &[e.key], t).unwrap(); }
                    IndexEffect::Dropped(t) => { b.on_blocks_evicted(1, &[e.key], Some(t)).unwrap(); }
                }
            }
            for key in 0u128..12 {
                prop_assert_eq!(a.index().holders(key), b.index().holders(key));
            }
            a.check_integrity().unwrap();
        }
    }

    #[test]
    fn unknown_instance_changes_nothing() {
        let c = conductor();
        let e = [StoreEvent { kind: EventKind::Stored, key: 5, tier: Tier::Dram }];
        assert!(matches!(c.apply_store_events(9, &e), Err(ConductorError::UnknownInstance(9))));
        assert!(c.index().holders(5).is_empty());
        let r = c.apply_store_events(1, &e).unwrap();
        assert_eq!(r, AppliedEvents { inserted: 1, removed: 0 });
        assert_eq!(c.apply_store_events(1, &[]).unwrap(), AppliedEvents::default());
    }
}
