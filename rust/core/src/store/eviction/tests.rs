//! Behaviour shared by every policy, plus each policy's own ordering.

use proptest::prelude::*;

use super::*;

fn all(capacity: usize) -> Vec<Box<dyn EvictionPolicy>> {
    POLICY_NAMES.iter().map(|n| policy_by_name(n, capacity).unwrap()).collect()
}

fn evict_any(p: &mut dyn EvictionPolicy) -> Option<BlockHash> {
    p.evict(&mut |_| Verdict::Evicted)
}

#[test]
fn unknown_name_is_none() {
    assert!(policy_by_name("fifo-ish", 4).is_none());
}

#[test]
fn lru_evicts_least_recent() {
    let mut p = Lru::new();
    for k in 0..4 {
        p.insert(k, 0);
    }
    p.touch(0);
    assert_eq!(evict_any(&mut p), Some(1));
    assert_eq!(evict_any(&mut p), Some(2));
}

#[test]
fn prefix_evicts_tail_of_oldest_chain_first() {
    let mut p = PrefixAware::new();
    p.begin_access();
    for (i, k) in [10, 11, 12].into_iter().enumerate() {
        p.insert(k, i as u32);
    }
    p.begin_access();
    p.insert(20, 0);
    assert_eq!(evict_any(&mut p), Some(12));
    assert_eq!(evict_any(&mut p), Some(11));
    p.begin_access();
    p.touch(10);
    assert_eq!(evict_any(&mut p), Some(20), "10 is now newer than 20");
}

#[test]
fn s3fifo_resists_a_scan() {
    let mut p = S3Fifo::new(10);
    // a hot set of 5, accessed twice so it reaches main
    for k in 0..5 {
        p.insert(k, 0);
    }
    for k in 0..5 {
        p.touch(k);
    }
    let mut resident: std::collections::HashSet<BlockHash> = (0..5).collect();
    for k in 100..200 {
        if p.len() >= 10 {
            let v = evict_any(&mut p).unwrap();
            resident.remove(&v);
        }
        p.insert(k, 0);
        resident.insert(k);
    }
    assert!((0..5).all(|k| p.contains(k)), "hot set survived a one-hit scan");
}

#[test]
fn keep_and_gone_verdicts() {
    for mut p in all(8) {
        p.begin_access();
        for k in 0..4 {
            p.insert(k, k as u32);
        }
        // nothing evictable
        assert_eq!(p.evict(&mut |_| Verdict::Keep), None, "{}", p.name());
        assert_eq!(p.len(), 4);
        // key 1 is gone, key 2 is the only evictable one
        let got = p.evict(&mut |k| match k {
            1 => Verdict::Gone,
            2 => Verdict::Evicted,
            _ => Verdict::Keep,
        });
        assert_eq!(got, Some(2), "{}", p.name());
        assert!(!p.contains(2));
        assert_eq!(p.len(), 2 + usize::from(p.contains(1)), "{}", p.name());
    }
}

proptest! {
    /// Every policy tracks exactly the keys inserted and not removed / evicted.
    #[test]
    fn policies_track_a_set(ops in proptest::collection::vec((0u8..4, 0u128..20), 1..200)) {
        for mut p in all(8) {
            let mut model = std::collections::HashSet::new();
            for &(op, k) in &ops {
                match op {
                    0 => { p.begin_access(); p.insert(k, (k % 5) as u32); model.insert(k); }
                    1 => { prop_assert_eq!(p.touch(k), model.contains(&k)); }
                    2 => { prop_assert_eq!(p.remove(k), model.remove(&k)); }
                    _ => {
                        match evict_any(p.as_mut()) {
                            Some(v) => prop_assert!(model.remove(&v)),
                            None => prop_assert!(model.is_empty()),
                        }
                    }
                }
                prop_assert_eq!(p.len(), model.len());
                for &m in &model { prop_assert!(p.contains(m)); }
            }
        }
    }
}
