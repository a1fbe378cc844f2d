//! A region's owner told of each write the TCP server lands (landing.rs), with the
//! pool's object table (landing_table.rs) as the owner: a group of objects written in
//! many slices over two connections is completed exactly once, before the write that
//! completed it is answered; a refused completion fails that write; writes over the local
//! path are not seen.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::landing_table::{Expected, LandingTable};
use super::tests::{bytes, cfg, fill, req, T};
use super::*;

const CB: u64 = 64 << 10;

/// A server engine with one watched region of `slots` slots, and a TCP-only client whose
/// slices are smaller than a slot (so one object lands in many writes, over two
/// connections). The completions are recorded as (object id, the bytes of its slots at
/// that moment); object 13 is refused.
struct Rig {
    srv: Engine,
    cli: Engine,
    peer: Arc<Peer>,
    region: RegionId,
    table: Arc<LandingTable<Vec<u64>>>,
    seen: Completions,
}

/// Each completed group: its object ids, and the bytes of its slots at that moment.
type Completions = Arc<Mutex<Vec<(Vec<u64>, Vec<u8>)>>>;

fn rig(slots: u64) -> Rig {
    let mut c = cfg("srv", &["tcp"]);
    c.listen = vec!["127.0.0.1:0".into()];
    let srv = Engine::new(c, None).unwrap();
    let mut ca = cfg("cli", &["tcp"]);
    ca.slice_size = 16 << 10;
    ca.connections_per_endpoint = 2;
    let cli = Engine::new(ca, None).unwrap();
    let peer = cli.connect("srv", Some(&srv.address())).unwrap();
    assert_eq!(peer.transport(), "tcp");
    let region = srv.allocate((slots * CB) as usize, false).unwrap();
    let seen: Completions = Arc::new(Mutex::new(Vec::new()));
    let (s, r) = (seen.clone(), region.clone());
    let table = Arc::new(LandingTable::new(Box::new(move |ids: Vec<u64>, offsets: Vec<u64>| {
        // the bytes of the group's slots, as they are when the group completes
        // SAFETY: the region outlives the engine's serving threads in this test.
        let got = offsets
            .iter()
            .flat_map(|&o| unsafe { std::slice::from_raw_parts(r.ptr().add(o as usize), CB as usize) }.to_vec())
            .collect();
        let refuse = ids[0] == 13;
        s.lock().push((ids, got));
        if refuse {
            Err(AccessError::OwnerRefused)
        } else {
            Ok(())
        }
    })));
    table.add_region(region.id, CB).unwrap();
    srv.watch_writes(region.id, table.clone()).unwrap();
    Rig { srv, cli, peer, region: region.id, table, seen }
}

#[test]
fn an_object_is_completed_once_before_its_last_write_is_answered() {
    let r = rig(8);
    let src = r.cli.allocate((8 * CB) as usize, false).unwrap().id;
    let want = fill(&r.cli, src, 5);
    // one group of two objects: 1 in slots 5 and 2 (1.5 slots' bytes), 2 in slot 7
    let size1 = CB + CB / 2;
    let group = [
        Expected { id: 1, region: r.region, offsets: &[5 * CB, 2 * CB], size: size1 },
        Expected { id: 2, region: r.region, offsets: &[7 * CB], size: CB },
    ];
    r.table.expect(&group, vec![5 * CB, 2 * CB, 7 * CB]).unwrap();
    let reqs = vec![
        req(Op::Write, src, 0, &r.peer, r.region, 5 * CB, CB),
        req(Op::Write, src, CB, &r.peer, r.region, 2 * CB, CB / 2),
        req(Op::Write, src, 2 * CB, &r.peer, r.region, 7 * CB, CB),
    ];
    let st = r.cli.submit(reqs, T).unwrap().wait(None);
    assert!(st.iter().all(|s| s.is_ok()), "{st:?}");
    // by the time the batch ended, the group was completed, once, with every byte there
    let seen = r.seen.lock().clone();
    assert_eq!(seen.len(), 1, "{:?}", seen.iter().map(|s| s.0.clone()).collect::<Vec<_>>());
    let (ids, got) = &seen[0];
    assert_eq!(ids, &vec![1, 2]);
    let cb = CB as usize;
    assert_eq!(&got[..cb], &want[..cb], "object 1, its first slot");
    assert_eq!(&got[cb..cb + cb / 2], &want[cb..cb + cb / 2], "object 1, its last slot");
    assert_eq!(&got[2 * cb..], &want[2 * cb..3 * cb], "object 2");
    assert_eq!(r.table.pending(), 0);
    let dst = bytes(&r.srv, r.region);
    assert_eq!(&dst[(7 * CB) as usize..(8 * CB) as usize], &want[(2 * CB) as usize..(3 * CB) as usize]);
}

#[test]
fn a_refused_completion_fails_the_write_that_completed_it() {
    let r = rig(4);
    let src = r.cli.allocate((4 * CB) as usize, false).unwrap().id;
    fill(&r.cli, src, 6);
    r.table.expect(&[Expected { id: 13, region: r.region, offsets: &[CB], size: CB }], vec![CB]).unwrap();
    let st = r.cli.submit(vec![req(Op::Write, src, 0, &r.peer, r.region, CB, CB)], T).unwrap().wait(None);
    match st[0].error() {
        Some(TransferError::Refused { reason: AccessError::OwnerRefused, .. }) => {}
        other => panic!("expected the owner's refusal, got {other:?} ({st:?})"),
    }
    assert_eq!(r.seen.lock().len(), 1);
    // a write that completes nothing is answered as before
    let st = r.cli.submit(vec![req(Op::Write, src, 0, &r.peer, r.region, 0, CB)], T).unwrap().wait(None);
    assert!(st[0].is_ok(), "{st:?}");
    assert_eq!(r.srv.stats().refused, 1);
}

#[test]
fn writes_over_the_local_path_are_not_seen() {
    // same process, registry: the local (memcpy) path, which never reaches the server
    let reg = EngineRegistry::new();
    let srv = Engine::new(cfg("lsrv", &["local"]), Some(reg.clone())).unwrap();
    let cli = Engine::new(cfg("lcli", &["local"]), Some(reg)).unwrap();
    let peer = cli.connect("lsrv", None).unwrap();
    assert_eq!(peer.transport(), "local");
    let region = srv.allocate(CB as usize, false).unwrap().id;
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let table = Arc::new(LandingTable::new(Box::new(move |_, _: ()| {
        c.fetch_add(1, Ordering::SeqCst);
        Ok(())
    })));
    table.add_region(region, CB).unwrap();
    srv.watch_writes(region, table.clone()).unwrap();
    assert!(srv.watch_writes(region, table.clone()).is_err(), "one watcher a region");
    table.expect(&[Expected { id: 1, region, offsets: &[0], size: CB }], ()).unwrap();
    let src = cli.allocate(CB as usize, false).unwrap().id;
    let st = cli.submit(vec![req(Op::Write, src, 0, &peer, region, 0, CB)], T).unwrap().wait(None);
    assert!(st[0].is_ok());
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(table.pending(), 1);
}
