//! `Engine::submit_objects` against a batch of one hand-built request per chunk: the
//! same bytes land in the node's slots, are read back whole, the caller's registered
//! regions are used in place and other memory is registered only until release.

use std::sync::Arc;

use super::tests::{bytes, cfg, fill, req, T};
use super::*;

const CHUNK: u64 = 256;

struct Obj {
    /// (offset in the caller's memory, size) of each piece
    pieces: Vec<(u64, u64)>,
    total: u64,
    /// slot of each chunk in the node's region (in units of CHUNK)
    slots: Vec<u64>,
}

fn objects() -> Vec<Obj> {
    vec![
        Obj { pieces: vec![(0, 1000)], total: 1000, slots: vec![0, 1, 2, 3] }, // contiguous: one span
        Obj { pieces: vec![(1000, 300), (1400, 500)], total: 800, slots: vec![9, 5, 6, 20] }, // scattered, clipped
        Obj { pieces: vec![(2000, 0), (2000, 256)], total: 256, slots: vec![30] }, // an empty piece first
        Obj { pieces: vec![(2300, 0)], total: 0, slots: vec![31] },            // empty: nothing moves
    ]
}

fn two_engines() -> (Engine, Engine, Arc<Peer>) {
    let reg = EngineRegistry::new();
    let a = Engine::new(cfg("client", &["local"]), Some(reg.clone())).unwrap();
    let b = Engine::new(cfg("node", &["local"]), Some(reg)).unwrap();
    let p = a.connect("node", None).unwrap();
    (a, b, p)
}

/// Submits `objs` with pieces at `base + offset`.
fn submit(
    a: &Engine,
    p: &Arc<Peer>,
    op: Op,
    base: u64,
    objs: &[Obj],
    region: RegionId,
    reg: &[Arc<Region>],
) -> ObjectBatch {
    let addrs: Vec<Vec<u64>> = objs.iter().map(|o| o.pieces.iter().map(|&(at, _)| base + at).collect()).collect();
    let sizes: Vec<Vec<u64>> = objs.iter().map(|o| o.pieces.iter().map(|&(_, n)| n).collect()).collect();
    let offsets: Vec<Vec<u64>> = objs.iter().map(|o| o.slots.iter().map(|s| s * CHUNK).collect()).collect();
    let remote: Vec<RemoteObject<'_>> = (0..objs.len())
        .map(|i| RemoteObject {
            addrs: &addrs[i],
            sizes: &sizes[i],
            total: objs[i].total,
            region,
            chunk_bytes: CHUNK,
            offsets: &offsets[i],
        })
        .collect();
    // SAFETY: every piece lies inside the caller's 4096-byte buffer at `base`, alive until the batch ended.
    unsafe { a.submit_objects(op, p, &remote, reg, T) }.unwrap()
}

#[test]
fn objects_land_where_one_request_per_chunk_puts_them_and_read_back_whole() {
    let (a, b, p) = two_engines();
    let (fast, slow) =
        (b.allocate(64 * CHUNK as usize, false).unwrap().id, b.allocate(64 * CHUNK as usize, false).unwrap().id);
    let src = a.allocate(4096, false).unwrap();
    let data = fill(&a, src.id, 11);
    let base = src.ptr() as u64;
    let objs = objects();
    // the reference: a request per (piece, chunk) overlap, written out directly
    let mut by_hand = Vec::new();
    for o in &objs {
        let mut pos = 0;
        for &(at, n) in &o.pieces {
            let end = (pos + n).min(o.total);
            for (c, slot) in o.slots.iter().enumerate() {
                let (cs, ce) = (c as u64 * CHUNK, (c as u64 + 1) * CHUNK);
                let (lo, hi) = (cs.max(pos), ce.min(end));
                if lo < hi {
                    by_hand.push(req(Op::Write, src.id, at + lo - pos, &p, slow, slot * CHUNK + lo - cs, hi - lo));
                }
            }
            pos += n;
        }
    }
    assert!(a.submit(by_hand, T).unwrap().wait(None).iter().all(RequestStatus::is_ok));
    // the caller's region registered: no temporary one
    let before = a.stats().regions;
    let put = submit(&a, &p, Op::Write, base, &objs, fast, std::slice::from_ref(&src));
    assert_eq!(put.temporary_regions(), 0);
    assert_eq!(put.requests(), 1 + 4 + 1, "contiguous slots merge; the empty object has none");
    assert_eq!(put.wait(None), vec![true; objs.len()]);
    assert_eq!(bytes(&b, fast), bytes(&b, slow));
    // read back into memory nobody registered: registered for the batch, then released
    let mut back = vec![0u8; 4096];
    let get = submit(&a, &p, Op::Read, back.as_mut_ptr() as u64, &objs, fast, &[]);
    assert_eq!(get.temporary_regions(), 4, "one per touched piece");
    assert_eq!(a.stats().regions, before + 4);
    assert_eq!(get.wait(None), vec![true; objs.len()]);
    for o in &objs {
        let mut pos = 0;
        for &(at, n) in &o.pieces {
            let m = n.min(o.total.saturating_sub(pos)) as usize;
            assert_eq!(back[at as usize..at as usize + m], data[at as usize..at as usize + m]);
            pos += n;
        }
    }
    assert_eq!(get.release(), 4);
    assert_eq!(get.release(), 0);
    assert_eq!(a.stats().regions, before);
    drop(put);
    // dropped unreleased: released too
    let again = submit(&a, &p, Op::Read, back.as_mut_ptr() as u64, &objs[..1], fast, &[]);
    assert_eq!(again.wait(None), vec![true]);
    drop(again);
    assert_eq!(a.stats().regions, before);
}

#[test]
fn an_object_the_node_refuses_fails_alone_and_bad_answers_are_refused_with_nothing_left_registered() {
    let (a, b, p) = two_engines();
    let node = b.allocate(64 * CHUNK as usize, false).unwrap().id;
    let src = a.allocate(4096, false).unwrap();
    let base = src.ptr() as u64;
    let mut objs = objects();
    objs[0].slots = vec![0, 1, 2, 100]; // chunk 3 out of bounds: the node refuses that request
    let out = submit(&a, &p, Op::Write, base, &objs, node, std::slice::from_ref(&src)).wait(None);
    assert_eq!(out, vec![false, true, true, true]);
    // an answer with too few chunk offsets, pieces and sizes of different lengths
    let before = a.stats().regions;
    let mut mem = vec![0u8; 4096];
    let addr = [mem.as_mut_ptr() as u64];
    let short = RemoteObject {
        addrs: &addr,
        sizes: &[1000],
        total: 1000,
        region: node,
        chunk_bytes: CHUNK,
        offsets: &[0, 256],
    };
    let fine = RemoteObject { offsets: &[0, 256, 512, 768], ..short };
    let uneven = RemoteObject { sizes: &[10, 10], ..fine };
    let wraps = RemoteObject { addrs: &[u64::MAX - 100], ..fine };
    for bad in [[fine, short], [fine, uneven], [fine, wraps]] {
        // SAFETY: the piece lies inside `mem`.
        let e = unsafe { a.submit_objects(Op::Read, &p, &bad, &[], T) }.err().unwrap();
        assert!(matches!(e, TransferError::InvalidRequest(ref m) if m.starts_with("object 1:")), "{e}");
        assert_eq!(a.stats().regions, before, "the first object's temporary region is released");
    }
    // a read into a read-only registered region is refused, as a plain request's is
    let ro = a.allocate(4096, true).unwrap();
    let one = [RemoteObject { addrs: &[ro.ptr() as u64], ..fine }];
    // SAFETY: the piece lies inside `ro`'s memory, alive while `ro` is.
    let e = unsafe { a.submit_objects(Op::Read, &p, &one, std::slice::from_ref(&ro), T) }.err().unwrap();
    assert!(matches!(e, TransferError::InvalidRequest(_)), "{e}");
}
