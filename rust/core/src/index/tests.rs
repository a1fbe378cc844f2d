//! BlockIndex against a brute-force reference.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;

/// Every tier, fastest to load first (the order the model looks a block up in).
const BY_SPEED: [Tier; 3] = [Tier::Gpu, Tier::Dram, Tier::Ssd];

/// The obvious model: a set of (block, instance, tier).
#[derive(Default)]
struct Reference {
    entries: BTreeSet<(BlockHash, InstanceId, Tier)>,
}

impl Reference {
    /// The fastest tier `i` holds `h` in.
    fn holds(&self, h: BlockHash, i: InstanceId) -> Option<Tier> {
        BY_SPEED.into_iter().find(|&t| self.entries.contains(&(h, i, t)))
    }

    fn match_prefix(&self, hashes: &[BlockHash]) -> Vec<PrefixMatch> {
        let instances: BTreeSet<InstanceId> = self.entries.iter().map(|e| e.1).collect();
        let mut out = vec![];
        for i in instances {
            let mut m = PrefixMatch { instance: i, ..Default::default() };
            for &h in hashes {
                match self.holds(h, i) {
                    Some(Tier::Dram) => m.dram += 1,
                    Some(Tier::Ssd) => m.ssd += 1,
                    Some(Tier::Gpu) => m.gpu += 1,
                    None => break,
                }
            }
            if m.total() > 0 {
                out.push(m);
            }
        }
        out
    }
}

#[test]
fn hand_computed_prefixes() {
    let idx = BlockIndex::new();
    idx.insert(1, &[10, 11, 12], Tier::Dram).unwrap();
    idx.insert(2, &[10, 11], Tier::Ssd).unwrap();
    idx.insert(2, &[13], Tier::Dram).unwrap();
    idx.insert(3, &[11, 12], Tier::Dram).unwrap(); // no first block: no match
    let m = idx.match_prefix(&[10, 11, 12, 13]);
    assert_eq!(
        m,
        vec![
            PrefixMatch { instance: 1, dram: 3, ssd: 0, gpu: 0 },
            PrefixMatch { instance: 2, dram: 0, ssd: 2, gpu: 0 },
        ]
    );
    assert_eq!(idx.best_prefix(&[10, 11, 12, 13]).unwrap().instance, 1);
    assert_eq!(idx.holders(11), vec![(1, Tier::Dram), (2, Tier::Ssd), (3, Tier::Dram)]);
    assert_eq!(idx.len(), 4);
    assert_eq!(idx.remove(1, &[11], None), 1);
    assert_eq!(idx.match_prefix(&[10, 11, 12])[0], PrefixMatch { instance: 1, dram: 1, ssd: 0, gpu: 0 });
    assert_eq!(idx.remove_instance(2), 3);
    assert_eq!(idx.holders(10), vec![(1, Tier::Dram)]);
    assert!(idx.match_prefix(&[]).is_empty());
    idx.check_integrity().unwrap();
}

#[test]
fn both_tiers_count_as_dram_and_once() {
    let idx = BlockIndex::new();
    idx.insert(7, &[1, 2], Tier::Ssd).unwrap();
    idx.insert(7, &[1], Tier::Dram).unwrap();
    assert_eq!(idx.match_prefix(&[1, 2]), vec![PrefixMatch { instance: 7, dram: 1, ssd: 1, gpu: 0 }]);
    let s = idx.stats();
    assert_eq!((s.blocks, s.entries, s.instances), (2, 3, 1));
    assert_eq!(s.per_instance, vec![(7, 1, 2)]);
}

#[test]
fn slots_are_reused_without_stale_holders() {
    let idx = BlockIndex::new();
    for round in 0..5u64 {
        idx.insert(round, &[1, 2, 3], Tier::Dram).unwrap();
        idx.remove_instance(round);
        idx.insert(100 + round, &[3], Tier::Dram).unwrap();
        assert_eq!(idx.holders(1), vec![]);
        idx.check_integrity().unwrap();
    }
}

#[test]
fn best_prefix_ties_prefer_dram_then_low_id() {
    let m = [
        PrefixMatch { instance: 5, dram: 1, ssd: 1, gpu: 0 },
        PrefixMatch { instance: 3, dram: 0, ssd: 2, gpu: 0 },
        PrefixMatch { instance: 9, dram: 1, ssd: 1, gpu: 0 },
    ];
    assert_eq!(best_of(&m).unwrap().instance, 5);
}

#[test]
fn concurrent_inserts_and_matches_keep_invariants() {
    let idx = std::sync::Arc::new(BlockIndex::new());
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let idx = idx.clone();
            std::thread::spawn(move || {
                let hashes: Vec<BlockHash> = (0..200).collect();
                for round in 0..50 {
                    idx.insert(t, &hashes, Tier::Dram).unwrap();
                    let m = idx.match_prefix(&hashes);
                    assert!(m.iter().all(|x| x.total() <= 200));
                    if round % 7 == 0 {
                        idx.remove_instance(t);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    idx.check_integrity().unwrap();
}

#[derive(Debug, Clone)]
enum Op {
    Insert(InstanceId, Vec<BlockHash>, u8),
    Remove(InstanceId, Vec<BlockHash>, Option<u8>),
    RemoveInstance(InstanceId),
    Match(Vec<BlockHash>),
}

fn op() -> impl Strategy<Value = Op> {
    // Few instances and few distinct hashes, so matches, spills and removals collide.
    let inst = 0u64..6;
    let hashes = proptest::collection::vec(0u128..24, 0..10);
    prop_oneof![
        4 => (inst.clone(), hashes.clone(), 0u8..3).prop_map(|(i, h, s)| Op::Insert(i, h, s)),
        2 => (inst.clone(), hashes.clone(), proptest::option::of(0u8..3)).prop_map(|(i, h, t)| Op::Remove(i, h, t)),
        1 => inst.prop_map(Op::RemoveInstance),
        3 => hashes.prop_map(Op::Match),
    ]
}

fn tier(code: u8) -> Tier {
    Tier::from_code(code as u32)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn agrees_with_brute_force(ops in proptest::collection::vec(op(), 1..60)) {
        let idx = BlockIndex::new();
        let mut r = Reference::default();
        for op in ops {
            match op {
                Op::Insert(i, hs, ssd) => {
                    let want = hs.iter().collect::<BTreeSet<_>>().into_iter()
                        .filter(|&&h| r.entries.insert((h, i, tier(ssd)))).count();
                    prop_assert_eq!(idx.insert(i, &hs, tier(ssd)).unwrap(), want);
                }
                Op::Remove(i, hs, t) => {
                    let mut want = 0;
                    for h in hs.iter().collect::<BTreeSet<_>>() {
                        for tt in BY_SPEED {
                            if t.is_none_or(|s| tier(s) == tt) && r.entries.remove(&(*h, i, tt)) {
                                want += 1;
                            }
                        }
                    }
                    prop_assert_eq!(idx.remove(i, &hs, t.map(tier)), want);
                }
                Op::RemoveInstance(i) => {
                    let before = r.entries.len();
                    r.entries.retain(|e| e.1 != i);
                    prop_assert_eq!(idx.remove_instance(i), before - r.entries.len());
                }
                Op::Match(hs) => {
                    prop_assert_eq!(idx.match_prefix(&hs), r.match_prefix(&hs));
                    let best = idx.best_prefix(&hs);
                    prop_assert_eq!(best, best_of(&r.match_prefix(&hs)));
                }
            }
            idx.check_integrity().map_err(TestCaseError::fail)?;
            let blocks: BTreeSet<_> = r.entries.iter().map(|e| e.0).collect();
            prop_assert_eq!(idx.len(), blocks.len());
            let stats = idx.stats();
            prop_assert_eq!(stats.entries, r.entries.len());
            let mut per: BTreeMap<InstanceId, [usize; 3]> = BTreeMap::new();
            for e in &r.entries {
                per.entry(e.1).or_default()[e.2 as usize] += 1;
            }
            let want: Vec<_> = per.iter().filter(|(_, n)| n[0] + n[1] > 0).map(|(&i, n)| (i, n[0], n[1])).collect();
            prop_assert_eq!(stats.per_instance, want);
            let want_gpu: Vec<_> = per.iter().filter(|(_, n)| n[2] > 0).map(|(&i, n)| (i, n[2])).collect();
            prop_assert_eq!(stats.per_instance_gpu, want_gpu);
        }
    }
}

#[test]
fn table_survives_growth_and_backward_shift_deletion() {
    // Small sequential keys (as in traces) and many removals exercise probe runs,
    // wrap-around and the backward shift.
    let idx = BlockIndex::new();
    let keys: Vec<BlockHash> = (0..20_000).collect();
    idx.insert(1, &keys, Tier::Dram).unwrap();
    let odd: Vec<BlockHash> = keys.iter().copied().filter(|k| k % 2 == 1).collect();
    assert_eq!(idx.remove(1, &odd, None), 10_000);
    idx.check_integrity().unwrap();
    for k in (0..20_000u128).step_by(997) {
        assert_eq!(idx.holders(k).is_empty(), k % 2 == 1, "key {k}");
    }
    idx.insert(2, &odd, Tier::Ssd).unwrap();
    assert_eq!(idx.remove_instance(1), 10_000);
    idx.check_integrity().unwrap();
    assert_eq!(idx.len(), 10_000);
    assert_eq!(idx.match_prefix(&[1, 3, 5, 6]), vec![PrefixMatch { instance: 2, dram: 0, ssd: 3, gpu: 0 }]);
}

#[test]
fn gpu_tier_counts_first_and_wins_ties() {
    // A block held on the GPU and in DRAM by one instance counts once, as gpu; between
    // equally long matches the one with more in memory wins, then the one with more gpu.
    let idx = BlockIndex::new();
    idx.insert(1, &[10, 11, 12], Tier::Dram).unwrap();
    idx.insert(1, &[10], Tier::Gpu).unwrap();
    idx.insert(2, &[10, 11, 12], Tier::Gpu).unwrap();
    idx.insert(3, &[10, 11], Tier::Dram).unwrap();
    idx.insert(3, &[12], Tier::Ssd).unwrap();
    assert_eq!(
        idx.match_prefix(&[10, 11, 12]),
        vec![
            PrefixMatch { instance: 1, dram: 2, ssd: 0, gpu: 1 },
            PrefixMatch { instance: 2, dram: 0, ssd: 0, gpu: 3 },
            PrefixMatch { instance: 3, dram: 2, ssd: 1, gpu: 0 },
        ]
    );
    assert_eq!(idx.best_prefix(&[10, 11, 12]).unwrap().instance, 2);
    assert_eq!(idx.holders(10), vec![(1, Tier::Dram), (1, Tier::Gpu), (2, Tier::Gpu), (3, Tier::Dram)]);
    assert_eq!(idx.remove(1, &[10], Some(Tier::Gpu)), 1);
    assert_eq!(idx.match_prefix(&[10])[0], PrefixMatch { instance: 1, dram: 1, ssd: 0, gpu: 0 });
    let s = idx.stats();
    assert_eq!(s.per_instance, vec![(1, 3, 0), (3, 2, 1)]);
    assert_eq!(s.per_instance_gpu, vec![(2, 3)]);
    assert_eq!(Tier::parse("gpu").unwrap(), Tier::Gpu);
    assert!(Tier::parse("hbm").unwrap_err().to_string().contains("\"gpu\""));
}
