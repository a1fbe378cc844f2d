use std::collections::{HashMap, VecDeque};

use rand::{Rng, SeedableRng};

use super::*;

/// The Python dict map's semantics, written the simple way (a dict of values and an
/// insertion-order list).
struct Model {
    map: HashMap<EngineHash, (BlockHash, u8)>,
    order: VecDeque<EngineHash>,
    capacity: usize,
    evicted: u64,
}

impl Model {
    fn store_one(&mut self, k: &EngineHash, o: BlockHash, bit: u8) -> Option<(BlockHash, u8)> {
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
        let mut m = EngineHashMap::new(cap).unwrap();
        let mut model = Model { map: HashMap::new(), order: VecDeque::new(), capacity: cap, evicted: 0 };
        for _ in 0..2000 {
            match rng.gen_range(0..10) {
                0..=5 => {
                    let n = rng.gen_range(0..6);
                    let ks: Vec<EngineHash> = (0..n).map(|_| key(rng.gen_range(0..60))).collect();
                    let os: Vec<BlockHash> = (0..n).map(|_| rng.gen_range(0..8u128)).collect();
                    let bit = 1u8 << rng.gen_range(0..3);
                    let refs: Vec<KeyRef<'_>> = ks.iter().map(|k| k.as_key()).collect();
                    let mut rep = Vec::new();
                    m.store(&refs, &os, bit, &mut rep);
                    let want: Vec<_> = ks.iter().zip(&os).filter_map(|(k, &o)| model.store_one(k, o, bit)).collect();
                    assert_eq!(rep, want);
                    let mut gone = Vec::new();
                    m.evict_overflow(&mut gone);
                    assert_eq!(gone, model.evict());
                }
                6..=8 => {
                    let ks: Vec<EngineHash> = (0..rng.gen_range(0..6)).map(|_| key(rng.gen_range(0..60))).collect();
                    let bit = 1u8 << rng.gen_range(0..3);
                    let same = bit | if rng.gen_bool(0.5) { 1 << rng.gen_range(0..3) } else { 0 };
                    let refs: Vec<KeyRef<'_>> = ks.iter().map(|k| k.as_key()).collect();
                    let mut out = Vec::new();
                    let unknown = m.remove(&refs, bit, same, &mut out);
                    let (mut want, mut want_unknown) = (Vec::new(), 0);
                    for k in &ks {
                        match model.map.get_mut(k) {
                            None => want_unknown += 1,
                            Some(v) if v.1 & bit != 0 => {
                                v.1 &= !bit;
                                if v.1 & (same & !bit) == 0 {
                                    want.push(v.0);
                                }
                            }
                            Some(_) => {}
                        }
                    }
                    assert_eq!((out, unknown), (want, want_unknown));
                }
                _ => {
                    m.clear();
                    model.map.clear();
                    model.order.clear();
                }
            }
            m.check_integrity().unwrap();
            let got: Vec<(EngineHash, BlockHash, u8)> = m.iter().map(|(k, o, b)| (k.to_owned_hash(), o, b)).collect();
            let want: Vec<(EngineHash, BlockHash, u8)> = model.order.iter().map(|k| (k.clone(), model.map[k].0, model.map[k].1)).collect();
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
