//! Engine-level reconnect: a peer whose connections are all lost (its server restarted,
//! evicted them, or they broke) is redialed at its known address by the next batch, with
//! the same authentication; requests in flight on the lost connections fail and are not
//! sent again; a redial that cannot reach the peer (or reaches another engine) fails the
//! batch with `connection_lost`, in bounded time.

use std::sync::Arc;
use std::time::Instant;

use super::inner::PeerKind;
use super::tests::{bytes, cfg, fill, req, wait_until, T};
use super::*;

const TOKEN: &str = "redial-token";

fn engine_at(name: &str, transports: &[&str], listen: &str) -> Engine {
    let mut c = cfg(name, transports);
    c.auth_token = Some(TOKEN.into());
    c.listen = vec![listen.into()];
    // No registry: peers reach each other over the network, not in-process.
    Engine::new(c, None).unwrap()
}

fn alive(p: &Peer) -> usize {
    match &p.kind {
        PeerKind::Remote { tcp, .. } => tcp.alive(),
        PeerKind::Local(_) => usize::MAX,
    }
}

fn code(st: &RequestStatus) -> &'static str {
    st.error().map_or("ok", |e| e.code())
}

/// The server at `addr` restarts (same name, same token, a fresh region with the id the
/// old one had): the client's next batch redials it and lands in the new server's region,
/// whether the old region went over TCP or was mapped over shm (a restarted server backs
/// none of its old segments: a stale mapping would take the bytes and lose them).
fn restart_and_write(transports: &[&str]) {
    let srv = engine_at("srv", transports, "127.0.0.1:0");
    let addr = srv.address();
    let cli = engine_at("cli", transports, "127.0.0.1:0");
    let p = cli.connect("srv", Some(&addr)).unwrap();
    let len = 8usize << 20;
    let region = srv.allocate(len, false).unwrap().id;
    let l = cli.allocate(len, false).unwrap().id;
    let src = fill(&cli, l, 3);
    let st = cli.submit(vec![req(Op::Write, l, 0, &p, region, 0, 4096)], T).unwrap().wait(None);
    assert_eq!(code(&st[0]), "ok");

    // A batch in flight when the server goes: each request ends ok or lost, none later.
    let k = 256u64 << 10;
    let batch = cli.submit((0..32).map(|i| req(Op::Write, l, i * k, &p, region, i * k, k)).collect(), T).unwrap();
    srv.close();
    let codes: Vec<_> = batch.wait(None).iter().map(code).collect();
    assert!(codes.iter().all(|c| matches!(*c, "ok" | "connection_lost" | "closed")), "{codes:?}");
    wait_until("the client sees every connection lost", || alive(&p) == 0);

    // Nobody listens: the redial fails, fast and typed.
    let t0 = Instant::now();
    let st = cli.submit(vec![req(Op::Write, l, 0, &p, region, 0, 4096)], T).unwrap().wait(None);
    assert_eq!(code(&st[0]), "connection_lost", "{:?}", st[0].error());
    assert!(st[0].error().unwrap().to_string().contains("redialing"), "{:?}", st[0].error());
    assert!(t0.elapsed() < T, "a failed redial ran into the batch timeout");
    assert_eq!(cli.stats().reconnects, 0);

    // The same engine back at the same address: nothing of the old batch reaches it, the
    // next batch does, over a redialed connection.
    let srv2 = engine_at("srv", transports, &addr);
    let region2 = srv2.allocate(len, false).unwrap().id;
    assert_eq!(region2, region, "a fresh engine numbered its first region differently");
    assert!(bytes(&srv2, region2).iter().all(|&b| b == 0));
    let reqs: Vec<_> = (0..8).map(|i| req(Op::Write, l, i * k, &p, region2, i * k, k)).collect();
    let st = cli.submit(reqs, T).unwrap().wait(None);
    assert!(st.iter().all(|s| s.is_ok()), "{:?}", st.iter().find(|s| !s.is_ok()));
    assert!(bytes(&srv2, region2)[..8 * k as usize] == src[..8 * k as usize], "the write did not reach the new server");
    assert_eq!(cli.stats().reconnects, 1);
    assert!(alive(&p) >= 1);
    // Reads too, and later batches need no redial.
    let st = cli.submit(vec![req(Op::Read, l, 0, &p, region2, 0, k)], T).unwrap().wait(None);
    assert!(st[0].is_ok(), "{:?}", st[0].error());
    assert_eq!(cli.stats().reconnects, 1);

    // Another engine at the address is not this peer: refused, nothing sent to it.
    srv2.close();
    wait_until("the client sees every connection lost", || alive(&p) == 0);
    let other = engine_at("other", transports, &addr);
    let r3 = other.allocate(len, false).unwrap().id;
    let st = cli.submit(vec![req(Op::Write, l, 0, &p, r3, 0, 4096)], T).unwrap().wait(None);
    assert_eq!(code(&st[0]), "connection_lost");
    assert!(st[0].error().unwrap().to_string().contains("now serves engine \"other\""), "{:?}", st[0].error());
    assert!(bytes(&other, r3).iter().all(|&b| b == 0));
}

#[test]
fn a_restarted_server_is_redialed_by_the_next_batch_over_tcp() {
    restart_and_write(&["tcp"]);
}

#[test]
fn a_restarted_server_is_redialed_and_its_stale_shm_mappings_forgotten() {
    restart_and_write(&["shm", "tcp"]);
}

// Many batches at once to a peer whose connections are gone: while nothing listens they
// all fail typed; once the server is back, one redial serves them all.
#[test]
fn concurrent_batches_share_one_redial() {
    let srv = engine_at("srv", &["tcp"], "127.0.0.1:0");
    let addr = srv.address();
    let cli = Arc::new(engine_at("cli", &["tcp"], "127.0.0.1:0"));
    let p = cli.connect("srv", Some(&addr)).unwrap();
    let region = srv.allocate(1 << 20, false).unwrap().id;
    let l = cli.allocate(1 << 20, false).unwrap().id;
    fill(&cli, l, 9);
    srv.close();
    wait_until("the client sees every connection lost", || alive(&p) == 0);
    // Nothing listens: every batch fails typed (those that waited share a failed redial).
    let batches: Vec<_> = (0..8u64)
        .map(|i| cli.submit(vec![req(Op::Write, l, i * 4096, &p, region, i * 4096, 4096)], T).unwrap())
        .collect();
    for b in batches {
        let st = b.wait(None);
        assert_eq!(code(&st[0]), "connection_lost");
        assert!(st[0].error().unwrap().to_string().contains("redialing"), "{:?}", st[0].error());
    }
    let srv2 = engine_at("srv", &["tcp"], &addr);
    assert_eq!(srv2.allocate(1 << 20, false).unwrap().id, region);
    let batches: Vec<_> = (0..8u64)
        .map(|i| cli.submit(vec![req(Op::Write, l, i * 4096, &p, region, i * 4096, 4096)], T).unwrap())
        .collect();
    for b in batches {
        let st = b.wait(None);
        assert!(st[0].is_ok(), "{:?}", st[0].error());
    }
    assert_eq!(cli.stats().reconnects, 1);
    assert!(bytes(&srv2, region)[..8 * 4096] == bytes(&cli, l)[..8 * 4096]);
}
