use super::*;

/// A tiny msgpack writer for test input.
#[derive(Clone, Debug)]
pub(crate) enum V {
    Nil,
    Int(i128),
    F(f64),
    S(&'static str),
    B(Vec<u8>),
    A(Vec<V>),
    M(Vec<(V, V)>),
}

pub(crate) fn enc(v: &V, out: &mut Vec<u8>) {
    match v {
        V::Nil => out.push(0xc0),
        V::Int(i) => {
            let i = *i;
            if (0..128).contains(&i) {
                out.push(i as u8);
            } else if i >= 0 {
                out.push(0xcf);
                out.extend_from_slice(&(i as u64).to_be_bytes());
            } else {
                out.push(0xd3);
                out.extend_from_slice(&(i as i64).to_be_bytes());
            }
        }
        V::F(f) => {
            out.push(0xcb);
            out.extend_from_slice(&f.to_be_bytes());
        }
        V::S(s) => {
            out.push(0xd9);
            out.push(s.len() as u8);
            out.extend_from_slice(s.as_bytes());
        }
        V::B(b) => {
            out.push(0xc4);
            out.push(b.len() as u8);
            out.extend_from_slice(b);
        }
        V::A(a) => {
            out.push(0xdc);
            out.extend_from_slice(&(a.len() as u16).to_be_bytes());
            for x in a {
                enc(x, out);
            }
        }
        V::M(m) => {
            out.push(0xde);
            out.extend_from_slice(&(m.len() as u16).to_be_bytes());
            for (k, x) in m {
                enc(k, out);
                enc(x, out);
            }
        }
    }
}

pub(crate) fn bytes(v: &V) -> Vec<u8> {
    let mut out = Vec::new();
    enc(v, &mut out);
    out
}

fn ints(xs: &[i128]) -> V {
    V::A(xs.iter().map(|&x| V::Int(x)).collect())
}

fn stored_pos(hashes: V, parent: V, toks: &[i128], medium: V) -> V {
    V::A(vec![V::S("BlockStored"), hashes, parent, ints(toks), V::Int(4), V::Nil, medium])
}

#[test]
fn positional_and_map_batches_decode_alike() {
    let pos = V::A(vec![
        V::F(1.5),
        V::A(vec![
            stored_pos(ints(&[1, 2]), V::Nil, &[1, 2, 3, 4, 5, 6, 7, 8], V::S("GPU")),
            V::A(vec![V::S("BlockRemoved"), V::A(vec![V::B(vec![0xaa])]), V::S("CPU")]),
            V::A(vec![V::S("AllBlocksCleared")]),
        ]),
        V::Int(3),
    ]);
    let map = V::M(vec![
        (V::S("data_parallel_rank"), V::Int(3)),
        (
            V::S("events"),
            V::A(vec![
                V::M(vec![
                    (V::S("block_hashes"), ints(&[1, 2])),
                    (V::S("token_ids"), ints(&[1, 2, 3, 4, 5, 6, 7, 8])),
                    (V::S("block_size"), V::Int(4)),
                    (V::S("type"), V::S("BlockStored")), // the tag need not come first
                    (V::S("medium"), V::S("GPU")),
                ]),
                V::M(vec![
                    (V::S("type"), V::S("BlockRemoved")),
                    (V::S("block_hashes"), V::A(vec![V::B(vec![0xaa])])),
                    (V::S("medium"), V::S("CPU")),
                ]),
                V::M(vec![(V::S("type"), V::S("AllBlocksCleared"))]),
            ]),
        ),
        (V::S("ts"), V::F(1.5)),
    ]);
    let (pb, mb) = (bytes(&pos), bytes(&map));
    let (a, b) = (decode_batch(&pb).unwrap(), decode_batch(&mb).unwrap());
    assert_eq!(a.ts, 1.5);
    assert_eq!(a.dp_rank, Some(3));
    assert_eq!(a.keys, b.keys);
    assert_eq!(a.keys, vec![KeyRef::Int(1), KeyRef::Int(2), KeyRef::Bytes(&[0xaa])]);
    assert_eq!(a.events.len(), 3);
    assert_eq!(b.events.len(), 3);
    for (x, y) in a.events.iter().zip(&b.events) {
        match (x, y) {
            (Event::Stored(x), Event::Stored(y)) => {
                assert_eq!(
                    (x.hashes.clone(), x.parent, x.block_size, x.medium),
                    (y.hashes.clone(), y.parent, y.block_size, y.medium)
                );
                let tok = |b: &Batch<'_>, t: &TokenIds<'_>| match t {
                    TokenIds::Decoded(r) => b.tokens[r.clone()].to_vec(),
                    TokenIds::Raw(_) => panic!("not decoded"),
                };
                assert_eq!(tok(&a, &x.tokens), (1..=8).collect::<Vec<u32>>());
                assert_eq!(tok(&a, &x.tokens), tok(&b, &y.tokens));
            }
            (x, y) => assert_eq!(x, y),
        }
    }
}

#[test]
fn defaults_unknown_fields_and_unknown_events() {
    // Only the hashes: the other fields take their defaults; i64 and u64 hashes; a
    // two-element batch (no rank); trailing fields and an unknown event type skipped.
    let p = V::A(vec![
        V::Int(2),
        V::A(vec![
            V::A(vec![V::S("BlockStored"), ints(&[-(1 << 63), (1 << 64) - 1])]),
            V::A(vec![V::S("BlockRemoved"), ints(&[7]), V::Nil, V::Int(0), V::S("future"), V::A(vec![])]),
            V::A(vec![V::S("BlockUpdated"), V::Int(1)]),
            V::M(vec![(V::S("type"), V::S("SomethingNew")), (V::S("x"), V::Int(1))]),
            V::A(vec![V::S("AllBlocksCleared"), V::Int(5)]),
        ]),
    ]);
    let b = bytes(&p);
    let got = decode_batch(&b).unwrap();
    assert_eq!((got.ts, got.dp_rank, got.unknown, got.events.len()), (2.0, None, 2, 3));
    match &got.events[0] {
        Event::Stored(s) => {
            assert_eq!(got.hashes(&s.hashes), &[KeyRef::Int(-(1 << 63)), KeyRef::Int((1 << 64) - 1)]);
            assert_eq!((s.parent, s.tokens.clone(), s.block_size, s.medium), (None, TokenIds::Decoded(0..0), 0, None));
        }
        e => panic!("{e:?}"),
    }
    assert_eq!(got.events[2], Event::Cleared);
    let map = bytes(&V::M(vec![
        (V::S("ts"), V::Int(1)),
        (V::S("new_batch_field"), V::A(vec![V::Int(1)])),
        (
            V::S("events"),
            V::A(vec![V::M(vec![
                (V::S("type"), V::S("BlockRemoved")),
                (V::S("block_hashes"), ints(&[3])),
                (V::S("future"), V::M(vec![])),
            ])]),
        ),
    ]));
    let got = decode_batch(&map).unwrap();
    assert_eq!(got.events, vec![Event::Removed(Removed { hashes: 0..1, medium: None, group_idx: None })]);
}

#[test]
fn malformed_payloads_are_typed_errors() {
    let good = bytes(&V::A(vec![
        V::F(1.0),
        V::A(vec![stored_pos(ints(&[1]), V::Nil, &[1, 2, 3, 4], V::S("GPU"))]),
        V::Int(0),
    ]));
    assert!(decode_batch(&good).is_ok());
    for cut in 0..good.len() {
        let e = decode_batch(&good[..cut]).unwrap_err();
        assert_eq!(e.category(), ErrorCategory::MalformedEvent, "cut {cut}: {e}");
    }
    let mut trailing = good.clone();
    trailing.push(0);
    assert_eq!(decode_batch(&trailing), Err(EventError::Trailing(1)));
    let bad: Vec<(V, &str)> = vec![
        (V::S("a string"), "must be a msgpack array"),
        (V::A(vec![V::F(1.0)]), "at least length 2"),
        (V::A(vec![V::Nil, V::A(vec![])]), "ts: expected float"),
        (V::A(vec![V::F(1.0), V::A(vec![]), V::S("x")]), "data_parallel_rank"),
        (V::M(vec![(V::S("events"), V::A(vec![]))]), "missing the \"ts\""),
        (V::A(vec![V::F(1.0), V::A(vec![V::A(vec![V::S("BlockStored"), V::S("not a list")])])]), "KV event 0"),
        (V::A(vec![V::F(1.0), V::A(vec![V::A(vec![V::S("BlockStored")])])]), "at least length 2"),
        (V::A(vec![V::F(1.0), V::A(vec![V::A(vec![])])]), "at least length 1"),
        (V::A(vec![V::F(1.0), V::A(vec![V::Int(5)])]), "an array or a map"),
        (V::A(vec![V::F(1.0), V::A(vec![V::A(vec![V::Int(5)])])]), "the type tag"),
        (V::A(vec![V::F(1.0), V::A(vec![V::M(vec![(V::S("block_hashes"), ints(&[1]))])])]), "missing the \"type\""),
        (V::A(vec![V::F(1.0), V::A(vec![V::A(vec![V::S("BlockRemoved"), V::A(vec![V::F(1.0)])])])]), "int | bytes"),
        (V::A(vec![V::F(1.0), V::A(vec![V::A(vec![V::S("BlockRemoved"), ints(&[1]), V::Int(5)])])]), "medium"),
        (
            V::A(vec![V::F(1.0), V::A(vec![V::A(vec![V::S("BlockStored"), ints(&[1]), V::Nil, V::Nil, V::Nil])])]),
            "block_size",
        ),
        (
            V::A(vec![V::F(1.0), V::A(vec![V::A(vec![V::S("BlockStored"), ints(&[1]), V::F(2.0)])])]),
            "parent_block_hash",
        ),
        (
            V::A(vec![
                V::F(1.0),
                V::A(vec![V::A(vec![V::S("BlockStored"), ints(&[1]), V::Nil, V::Nil, V::Int(4), V::S("x")])]),
            ]),
            "lora_id",
        ),
        (
            V::A(vec![
                V::F(1.0),
                V::A(vec![V::M(vec![(V::S("type"), V::S("BlockRemoved")), (V::S("block_hashes"), V::S("x"))])]),
            ]),
            "block_hashes",
        ),
        (V::A(vec![V::F(1.0), V::A(vec![V::M(vec![(V::Int(1), V::Int(2))])])]), "a key"),
    ];
    for (v, want) in bad {
        let e = decode_batch(&bytes(&v)).unwrap_err();
        assert!(e.to_string().contains(want), "{v:?}: {e} (wanted {want:?})");
        assert_eq!(e.category(), ErrorCategory::MalformedEvent);
    }
    // token_ids are kept raw: anything that is one msgpack value decodes here.
    let odd =
        bytes(&V::A(vec![V::F(1.0), V::A(vec![V::A(vec![V::S("BlockStored"), ints(&[1]), V::Nil, V::S("abc")])])]));
    match &decode_batch(&odd).unwrap().events[0] {
        Event::Stored(s) => assert_eq!(s.tokens, TokenIds::Raw(&[0xd9, 3, b'a', b'b', b'c'])),
        e => panic!("{e:?}"),
    }
    let neg =
        bytes(&V::A(vec![V::F(1.0), V::A(vec![V::A(vec![V::S("BlockStored"), ints(&[1]), V::Nil, ints(&[1, -1])])])]));
    match &decode_batch(&neg).unwrap().events[0] {
        Event::Stored(s) => assert!(matches!(s.tokens, TokenIds::Raw(_))),
        e => panic!("{e:?}"),
    }
}

#[test]
fn random_bytes_never_panic() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let good = bytes(&V::A(vec![
        V::F(1.0),
        V::A(vec![
            stored_pos(ints(&[1, 2]), V::B(vec![1; 16]), &[1, 2, 3, 4, 5, 6, 7, 8], V::S("GPU")),
            V::M(vec![(V::S("type"), V::S("BlockRemoved")), (V::S("block_hashes"), ints(&[1]))]),
        ]),
    ]));
    for _ in 0..20_000 {
        let mut b = good.clone();
        for _ in 0..rng.gen_range(1..4) {
            let i = rng.gen_range(0..b.len());
            b[i] = rng.gen();
        }
        b.truncate(rng.gen_range(0..=b.len()));
        let _ = decode_batch(&b);
        let junk: Vec<u8> = (0..rng.gen_range(0..40)).map(|_| rng.gen()).collect();
        let _ = decode_batch(&junk);
    }
}

#[test]
fn extra_keys_lora_group_and_kind_are_kept() {
    let salt = V::A(vec![V::S("tenant-a")]);
    let extras = V::A(vec![salt.clone(), V::Nil, V::A(vec![V::S("img"), V::Int(3)])]);
    let pos = V::A(vec![
        V::S("BlockStored"),
        ints(&[1, 2, 3]),
        V::Nil,
        ints(&[0; 12]),
        V::Int(4),
        V::Nil,
        V::S("GPU"),
        V::S("lora-x"),
        extras.clone(),
        V::Int(1),
        V::S("sliding_window"),
        V::Int(128), // kv_cache_spec_sliding_window and later: skipped
    ]);
    let map = V::M(vec![
        (V::S("kv_cache_spec_kind"), V::S("sliding_window")),
        (V::S("type"), V::S("BlockStored")),
        (V::S("block_hashes"), ints(&[1, 2, 3])),
        (V::S("token_ids"), ints(&[0; 12])),
        (V::S("block_size"), V::Int(4)),
        (V::S("medium"), V::S("GPU")),
        (V::S("lora_name"), V::S("lora-x")),
        (V::S("extra_keys"), extras),
        (V::S("group_idx"), V::Int(1)),
    ]);
    for ev in [pos, map] {
        let buf = bytes(&V::A(vec![
            V::F(0.0),
            V::A(vec![ev, V::A(vec![V::S("BlockRemoved"), ints(&[2]), V::Nil, V::Int(1)])]),
        ]));
        let got = decode_batch(&buf).unwrap();
        let Event::Stored(s) = &got.events[0] else { panic!("{:?}", got.events) };
        assert_eq!((s.lora_name, s.group_idx, s.kind), (Some("lora-x"), Some(1), Some("sliding_window")));
        let ex = got.extras(&s.extras);
        assert_eq!(ex.len(), 3);
        assert_eq!(ex[0], Some(&bytes(&salt)[..]));
        assert_eq!(ex[1], None);
        assert_eq!(ex[2], Some(&bytes(&V::A(vec![V::S("img"), V::Int(3)]))[..]));
        assert_eq!(got.events[1], Event::Removed(Removed { hashes: 3..4, medium: None, group_idx: Some(1) }));
    }
    // nil or missing: no extras; anything else is malformed
    let stored_with_extras = |extras: V| {
        bytes(&V::A(vec![
            V::F(0.0),
            V::A(vec![V::A(vec![
                V::S("BlockStored"),
                ints(&[1]),
                V::Nil,
                ints(&[0; 4]),
                V::Int(4),
                V::Nil,
                V::Nil,
                V::Nil,
                extras,
            ])]),
        ]))
    };
    let nil_bytes = stored_with_extras(V::Nil);
    let nil = decode_batch(&nil_bytes).unwrap();
    let Event::Stored(s) = &nil.events[0] else { panic!() };
    assert!(s.extras.is_empty());
    let bad = stored_with_extras(V::S("x"));
    let err = decode_batch(&bad).unwrap_err();
    assert!(err.to_string().contains("extra_keys: expected array | nil"), "{err}");
}

#[test]
fn a_bytes_hash_longer_than_the_cap_is_a_malformed_event_not_memory_kept() {
    // issue 26: a 64 KiB bytes hash was kept whole in the engine hash map
    let ok = V::A(vec![
        V::Int(1),
        V::A(vec![V::A(vec![V::S("BlockRemoved"), V::A(vec![V::B(vec![7; MAX_ENGINE_HASH_BYTES])])])]),
    ]);
    let b = bytes(&ok);
    assert_eq!(decode_batch(&b).unwrap().keys, vec![KeyRef::Bytes(&[7; MAX_ENGINE_HASH_BYTES])]);
    let long = V::A(vec![
        V::Int(1),
        V::A(vec![V::A(vec![V::S("BlockRemoved"), V::A(vec![V::B(vec![7; MAX_ENGINE_HASH_BYTES + 1])])])]),
    ]);
    let b = bytes(&long);
    let err = decode_batch(&b).unwrap_err();
    assert!(matches!(err, EventError::Event { index: 0, .. }), "{err}");
    assert!(err.to_string().contains("at most 64"), "{err}");
    let parent = V::A(vec![
        V::Int(1),
        V::A(vec![V::A(vec![V::S("BlockStored"), ints(&[1]), V::B(vec![1; 200]), ints(&[1, 2, 3, 4]), V::Int(4)])]),
    ]);
    let b = bytes(&parent);
    assert!(decode_batch(&b).is_err());
}
