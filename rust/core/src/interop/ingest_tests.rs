use std::sync::Arc;

use super::*;
use crate::interop::events::tests::{bytes, V};
use crate::HashAlgorithm;

const BS: usize = 4;

fn toks(xs: std::ops::Range<i128>) -> V {
    V::A(xs.map(V::Int).collect())
}

fn stored(hashes: &[i128], parent: Option<i128>, tokens: V, medium: Option<&'static str>) -> V {
    V::A(vec![
        V::S("BlockStored"),
        V::A(hashes.iter().map(|&h| V::Int(h)).collect()),
        parent.map_or(V::Nil, V::Int),
        tokens,
        V::Int(BS as i128),
        V::Nil,
        medium.map_or(V::Nil, V::S),
    ])
}

fn removed(hashes: &[i128], medium: Option<&'static str>) -> V {
    V::A(vec![V::S("BlockRemoved"), V::A(hashes.iter().map(|&h| V::Int(h)).collect()), medium.map_or(V::Nil, V::S)])
}

fn batch(events: Vec<V>) -> Vec<u8> {
    bytes(&V::A(vec![V::F(0.0), V::A(events)]))
}

struct Fixture {
    ing: EventIngestor,
    gpu: Arc<BlockIndex>,
    cpu: Arc<BlockIndex>,
    hasher: PrefixHasher,
}

fn fixture(capacity: usize) -> Fixture {
    let hasher = PrefixHasher::new(BS, 7, None, HashAlgorithm::Xxh3).unwrap();
    let (gpu, cpu) = (Arc::new(BlockIndex::new()), Arc::new(BlockIndex::new()));
    let ing =
        EventIngestor::new(3, ChainHasher::Prefix(hasher.clone()), capacity, vec![gpu.clone(), cpu.clone()]).unwrap();
    Fixture { ing, gpu, cpu, hasher }
}

impl Fixture {
    /// Applies a payload, registering media as a per-medium target would.
    fn apply(&mut self, payload: &[u8]) -> Result<(), IngestError> {
        let mut start = None;
        loop {
            match self.ing.apply_payload(payload, start)? {
                Step::Done => return Ok(()),
                Step::NeedMedium { event, name } => {
                    let index = if name == "CPU" { self.cpu.clone() } else { self.gpu.clone() };
                    self.ing.add_medium(&name, &name, Sink { index, tier: None }).unwrap();
                    start = Some(event);
                }
            }
        }
    }
}

#[test]
fn stores_chain_on_the_parent_and_removes_translate_back() {
    let mut f = fixture(1 << 10);
    let all: Vec<u32> = (100..116).collect();
    let ours = f.hasher.hash_tokens(&all, None);
    f.apply(&batch(vec![
        stored(&[10, 11], None, toks(100..108), Some("GPU")),
        stored(&[12, 13], Some(11), toks(108..116), None),
    ]))
    .unwrap();
    assert_eq!(f.gpu.match_prefix(&ours)[0].total(), 4);
    // offloaded to CPU, then evicted from GPU: CPU still holds it
    f.apply(&batch(vec![stored(&[10], None, toks(100..104), Some("cpu")), removed(&[10, 11, 99], Some("gpu"))]))
        .unwrap();
    assert!(f.gpu.match_prefix(&ours).is_empty());
    assert_eq!(f.cpu.match_prefix(&ours)[0].total(), 1);
    let st = f.ing.stats().clone();
    assert_eq!((st.batches, st.stored_blocks, st.removed_blocks, st.unknown_removed), (2, 5, 2, 1));
    assert_eq!(f.ing.media(), vec![("GPU".to_string(), "GPU".to_string()), ("CPU".to_string(), "CPU".to_string())]);
    // orphans and mismatched sizes are counted and skipped
    f.apply(&batch(vec![
        stored(&[20], Some(12345), toks(0..4), None),
        stored(&[21], None, toks(0..6), None),
        V::A(vec![V::S("BlockStored"), V::A(vec![V::Int(22)]), V::Nil, toks(0..4), V::Int(8)]),
    ]))
    .unwrap();
    assert_eq!((f.ing.stats().orphans, f.ing.stats().mismatched), (1, 2));
    f.apply(&batch(vec![V::A(vec![V::S("AllBlocksCleared")])])).unwrap();
    assert!(f.gpu.is_empty() && f.cpu.is_empty() && f.ing.map().is_empty());
    f.gpu.check_integrity().unwrap();
}

#[test]
fn bad_token_ids_stop_the_batch_after_the_events_before() {
    let mut f = fixture(1 << 10);
    let p = batch(vec![
        stored(&[1], None, toks(0..4), None),
        stored(&[2], None, V::A(vec![V::Int(1), V::Int(2), V::Int(3), V::Int(-1)]), None),
    ]);
    let e = f.apply(&p).unwrap_err();
    assert_eq!(e.category(), ErrorCategory::MalformedEvent);
    assert!(e.to_string().starts_with("BlockStored token_ids"), "{e}");
    assert_eq!(f.gpu.len(), 1);
    // an undecodable payload changes nothing, not even the batch count
    let before = f.ing.stats().clone();
    assert!(f.apply(&p[..p.len() - 1]).is_err());
    assert_eq!(f.ing.stats(), &before);
}

#[test]
fn the_map_bound_evicts_the_oldest_blocks_from_the_index() {
    let mut f = fixture(8);
    for i in 0..10 {
        f.apply(&batch(vec![stored(&[2 * i, 2 * i + 1], None, toks(8 * i..8 * i + 8), Some("GPU"))])).unwrap();
        assert!(f.ing.map().len() <= 8);
    }
    assert_eq!(f.gpu.len(), 8);
    assert_eq!(f.ing.map().evicted(), 12);
    f.ing.map().check_integrity().unwrap();
}

#[test]
fn more_than_eight_media_overflow() {
    let mut f = fixture(64);
    let names = ["A", "B", "C", "D", "E", "F", "G", "H", "I"];
    let evs = names.iter().enumerate().map(|(i, m)| stored(&[i as i128], None, toks(0..4), Some(m))).collect();
    f.apply(&batch(evs)).unwrap();
    assert_eq!(f.ing.stats().media_overflow, 1);
    assert_eq!(f.ing.media().len(), 8);
    assert!(matches!(
        f.ing.add_medium("Z", "Z", Sink { index: f.gpu.clone(), tier: None }),
        Err(IngestError::TooManyMedia(_))
    ));
}

/// A vLLM 0.32 BlockStored (a map) with a group, its kind and extra_keys.
fn stored_in(hashes: &[i128], tokens: V, group: i128, kind: &'static str, extra_keys: V) -> V {
    V::M(vec![
        (V::S("type"), V::S("BlockStored")),
        (V::S("block_hashes"), V::A(hashes.iter().map(|&h| V::Int(h)).collect())),
        (V::S("token_ids"), tokens),
        (V::S("block_size"), V::Int(BS as i128)),
        (V::S("extra_keys"), extra_keys),
        (V::S("group_idx"), V::Int(group)),
        (V::S("kv_cache_spec_kind"), V::S(kind)),
    ])
}

fn removed_in(hashes: &[i128], group: i128) -> V {
    V::M(vec![
        (V::S("type"), V::S("BlockRemoved")),
        (V::S("block_hashes"), V::A(hashes.iter().map(|&h| V::Int(h)).collect())),
        (V::S("group_idx"), V::Int(group)),
    ])
}

#[test]
fn a_block_is_held_while_every_full_attention_group_holds_it() {
    let mut f = fixture(1 << 10);
    let ours = f.hasher.hash_tokens(&(0..8).collect::<Vec<u32>>(), None);
    // two full-attention groups (same engine hashes in both) and a sliding-window one
    f.apply(&batch(vec![
        stored_in(&[1, 2], toks(0..8), 0, "full_attention", V::Nil),
        stored_in(&[1, 2], toks(0..8), 1, "full_attention", V::Nil),
        stored_in(&[1, 2], toks(0..8), 2, "sliding_window", V::Nil),
    ]))
    .unwrap();
    assert_eq!(f.gpu.match_prefix(&ours)[0].total(), 2);
    assert_eq!(f.ing.groups(), vec![(0, true), (1, true), (2, false)]);
    // the sliding-window group's removals change nothing (counted)
    f.apply(&batch(vec![removed_in(&[1, 2], 2)])).unwrap();
    assert_eq!(f.gpu.match_prefix(&ours)[0].total(), 2);
    assert_eq!(f.ing.stats().other_groups, 2);
    // a removal in one full-attention group drops the block
    f.apply(&batch(vec![removed_in(&[2], 1)])).unwrap();
    assert_eq!(f.gpu.match_prefix(&ours)[0].total(), 1);
    // stored again in group 1: held by both again
    f.apply(&batch(vec![stored_in(&[1, 2], toks(0..8), 1, "full_attention", V::Nil)])).unwrap();
    assert_eq!(f.gpu.match_prefix(&ours)[0].total(), 2);
    // group 0 loses block 0: the prefix is gone
    f.apply(&batch(vec![removed_in(&[1], 0)])).unwrap();
    assert!(f.gpu.match_prefix(&ours).is_empty());
    f.ing.map().check_integrity().unwrap();
}

#[test]
fn salted_and_plain_copies_are_distinct_and_refcounted() {
    let mut f = fixture(1 << 10);
    let all: Vec<u32> = (0..8).collect();
    let salt = bytes(&V::A(vec![V::S("tenant-a")]));
    let salted = f.hasher.hash_tokens_with_extras(&all, None, &[Some(&salt)]).unwrap();
    let plain = f.hasher.hash_tokens(&all, None);
    f.apply(&batch(vec![stored_in(
        &[1, 2],
        toks(0..8),
        0,
        "full_attention",
        V::A(vec![V::A(vec![V::S("tenant-a")]), V::Nil]),
    )]))
    .unwrap();
    assert!(f.gpu.match_prefix(&plain).is_empty());
    assert_eq!(f.gpu.match_prefix(&salted)[0].total(), 2);
    // the plain copy under two engine hashes each (say, two engines' hashing of it)
    f.apply(&batch(vec![stored(&[3, 4], None, toks(0..8), None), stored(&[5, 6], None, toks(0..8), None)])).unwrap();
    f.apply(&batch(vec![removed(&[1, 2], None), removed(&[3, 4], None)])).unwrap();
    assert!(f.gpu.match_prefix(&salted).is_empty());
    assert_eq!(f.gpu.match_prefix(&plain)[0].total(), 2); // 5, 6 still hold it
    f.apply(&batch(vec![removed(&[5, 6], None)])).unwrap();
    assert!(f.gpu.match_prefix(&plain).is_empty());
}

#[test]
fn counters_name_every_stat_once_with_the_maps_evictions() {
    let mut f = fixture(8);
    for i in 0..10 {
        f.apply(&batch(vec![stored(&[2 * i, 2 * i + 1], None, toks(8 * i..8 * i + 8), Some("GPU"))])).unwrap();
    }
    let c = f.ing.counters();
    let names: std::collections::HashSet<_> = c.iter().map(|(n, _)| n).collect();
    assert_eq!(names.len(), c.len(), "names are unique");
    let get = |name: &str| c.iter().find(|(n, _)| *n == name).unwrap().1;
    assert_eq!(get("evicted"), f.ing.map().evicted());
    assert_eq!(get("evicted"), 12);
    assert_eq!(get("batches"), f.ing.stats().batches);
    assert_eq!(get("stored_blocks"), f.ing.stats().stored_blocks);
    assert_eq!(get("stored_blocks"), 20);
}
