use std::collections::{HashMap, VecDeque};

use rand::{Rng, SeedableRng};

use super::*;

type Key = (EngineHash, u8);

/// The Python dict map's semantics, written the simple way (a dict of values keyed by
/// (engine hash, group), an insertion-order list, and `held` by scanning every entry).
struct Model {
    map: HashMap<Key, (BlockHash, u8)>,
    order: VecDeque<Key>,
    capacity: usize,
    evicted: u64,
}

impl Model {
    fn held(&self, o: BlockHash, mask: u8, deciding: u64) -> bool {
        let have = self.map.iter().filter(|(_, v)| v.0 == o && v.1 & mask != 0).fold(0u64, |a, ((_, g), _)| a | 1 << g);
        have & deciding == deciding
    }

    fn store_one(&mut self, k: &Key, o: BlockHash, bit: u8) -> Option<(BlockHash, u8)> {
        let mut rep = None;
        let v = match self.map.get(k) {
            None => (o, bit),
            Some(&(old, m)) if old == o => (o, m | bit),
            Some(&(old, m)) => {
                if m != 0 {
                    rep = Some((old, m));
                }
                (o, bit)
            }
        };
        self.order.retain(|x| x != k);
        self.order.push_back(k.clone());
        self.map.insert(k.clone(), v);
        rep
    }

    fn evict(&mut self) -> Vec<(BlockHash, u8)> {
        let mut out = Vec::new();
        while self.map.len() > self.capacity {
            let k = self.order.pop_front().unwrap();
            let (o, m) = self.map.remove(&k).unwrap();
            if m != 0 {
                out.push((o, m));
            }
            self.evicted += 1;
        }
        out
    }
}

fn key(i: u32) -> EngineHash {
    if i.is_multiple_of(3) {
        EngineHash::Bytes(vec![i as u8, (i >> 8) as u8].into())
    } else {
        EngineHash::Int(i as i128 - 20)
    }
}

#[test]
fn matches_the_dict_model_on_random_operations() {
    for seed in 0..20u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let cap = rng.gen_range(1..40);
        // half the seeds: one group (the usual case), half: two
        let groups: &[u8] = if seed % 2 == 0 { &[0] } else { &[0, 1] };
        let mut m = EngineHashMap::new(cap).unwrap();
        let mut model = Model { map: HashMap::new(), order: VecDeque::new(), capacity: cap, evicted: 0 };
        for _ in 0..2000 {
            match rng.gen_range(0..10) {
                0..=5 => {
                    let n = rng.gen_range(0..6);
                    let group = groups[rng.gen_range(0..groups.len())];
                    let ks: Vec<EngineHash> = (0..n).map(|_| key(rng.gen_range(0..60))).collect();
                    let os: Vec<BlockHash> = (0..n).map(|_| rng.gen_range(0..8u128)).collect();
                    let bit = 1u8 << rng.gen_range(0..3);
                    let refs: Vec<KeyRef<'_>> = ks.iter().map(|k| k.as_key()).collect();
                    let mut rep = Vec::new();
                    m.store(&refs, &os, bit, group, &mut rep);
                    let want: Vec<_> =
                        ks.iter().zip(&os).filter_map(|(k, &o)| model.store_one(&(k.clone(), group), o, bit)).collect();
                    assert_eq!(rep, want);
                    let mut gone = Vec::new();
                    m.evict_overflow(&mut gone);
                    assert_eq!(gone, model.evict());
                }
                6..=8 => {
                    let group = groups[rng.gen_range(0..groups.len())];
                    let deciding = if groups.len() == 1 { 1 } else { [1, 3, 2][rng.gen_range(0..3)] };
                    let ks: Vec<EngineHash> = (0..rng.gen_range(0..6)).map(|_| key(rng.gen_range(0..60))).collect();
                    let bit = 1u8 << rng.gen_range(0..3);
                    let same = bit | if rng.gen_bool(0.5) { 1 << rng.gen_range(0..3) } else { 0 };
                    let refs: Vec<KeyRef<'_>> = ks.iter().map(|k| k.as_key()).collect();
                    let mut out = Vec::new();
                    let unknown = m.remove(&refs, bit, same, group, deciding, &mut out);
                    let (mut want, mut want_unknown) = (Vec::new(), 0);
                    for k in &ks {
                        let k = (k.clone(), group);
                        match model.map.get_mut(&k) {
                            None => want_unknown += 1,
                            Some(v) if v.1 & bit != 0 => {
                                v.1 &= !bit;
                                let o = v.0;
                                if !model.held(o, same, deciding) {
                                    want.push(o);
                                }
                            }
                            Some(_) => {}
                        }
                    }
                    assert_eq!((out, unknown), (want, want_unknown));
                    for o in 0..8u128 {
                        for mask in [1u8, 3, 7] {
                            assert_eq!(
                                m.held(o, mask, deciding),
                                model.held(o, mask, deciding),
                                "{o} {mask} {deciding}"
                            );
                        }
                    }
                }
                _ => {
                    m.clear();
                    model.map.clear();
                    model.order.clear();
                }
            }
            m.check_integrity().unwrap();
            let got: Vec<(EngineHash, BlockHash, u8)> = m.iter().map(|(k, o, b)| (k.to_owned_hash(), o, b)).collect();
            let want: Vec<(EngineHash, BlockHash, u8)> =
                model.order.iter().map(|k| (k.0.clone(), model.map[k].0, model.map[k].1)).collect();
            assert_eq!(got, want);
            assert_eq!(m.evicted(), model.evicted);
        }
    }
}

#[test]
fn ints_and_bytes_are_different_keys_and_capacity_is_checked() {
    let mut m = EngineHashMap::new(4).unwrap();
    m.store_one(KeyRef::Int(5), 1, 1);
    m.store_one(KeyRef::Bytes(&[5]), 2, 1);
    m.store_one(KeyRef::Int(-1), 3, 2);
    m.store_one(KeyRef::Int(u64::MAX as i128), 4, 2);
    assert_eq!(m.len(), 4);
    assert_eq!(m.get(KeyRef::Int(5)), Some((1, 1)));
    assert_eq!(m.ours(KeyRef::Bytes(&[5])), Some(2));
    assert_eq!(m.media(KeyRef::Int(-1)), 2);
    assert_eq!(m.ours(KeyRef::Int(u64::MAX as i128)), Some(4));
    assert_eq!(m.ours(KeyRef::Int(6)), None);
    assert!(m.heap_bytes() > 0);
    assert!(EngineHashMap::new(0).is_err());
    assert!(EngineHashMap::new(MAX_CAPACITY + 1).is_err());
}

#[test]
fn a_block_under_two_engine_hashes_stays_until_both_go() {
    let mut m = EngineHashMap::new(3).unwrap();
    let mut rep = Vec::new();
    m.store(&[KeyRef::Int(1), KeyRef::Int(2)], &[7, 7], 1, 0, &mut rep);
    assert!(rep.is_empty() && m.held(7, 1, 1));
    let mut out = Vec::new();
    assert_eq!(m.remove(&[KeyRef::Int(1)], 1, 1, 0, 1, &mut out), 0);
    assert!(out.is_empty() && m.held(7, 1, 1)); // engine hash 2 still holds it
                                                // reusing engine hash 2 for other tokens hands back 7, no longer held by anyone
    m.store_one(KeyRef::Int(2), 8, 1);
    assert!(!m.held(7, 1, 1) && m.held(8, 1, 1));
    // eviction of one of two entries of a block: still held
    m.store(&[KeyRef::Int(3), KeyRef::Int(4)], &[9, 9], 1, 0, &mut rep);
    let mut gone = Vec::new();
    m.evict_overflow(&mut gone); // drops 1 (held nothing)
    assert!(gone.is_empty());
    m.store_one(KeyRef::Int(5), 10, 1);
    m.evict_overflow(&mut gone); // drops 2 (block 8)
    assert_eq!(gone, vec![(8, 1)]);
    assert!(m.held(9, 1, 1));
    // two groups: held when each holds it
    m.store_one_in(KeyRef::Int(3), 1, 9, 1);
    assert!(m.held(9, 1, 0b11));
    m.remove(&[KeyRef::Int(3)], 1, 1, 1, 0b11, &mut out);
    assert_eq!(out, vec![9]); // group 1 lost it
    assert!(m.held(9, 1, 0b01) && !m.held(9, 1, 0b11));
    m.check_integrity().unwrap();
}
