//! The transfer engine against peers that misbehave on purpose (issue 17): relays that
//! inject frames, floods of unauthenticated connections, callers that reconnect in a
//! loop. Each test states the load it applied; all run on 127.0.0.1 and end by
//! themselves.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::auth::AuthKey;
use super::protocol::{encode, Msg};
use super::tcp::seal::FrameWriter;
use super::tests::{bytes, cfg, closed_within, roundtrip, wait_until, T};
use super::*;

fn with_token(name: &str, token: &str, io_timeout: Duration) -> Engine {
    let mut c = cfg(name, &["tcp"]);
    c.auth_token = Some(token.into());
    c.io_timeout = io_timeout;
    Engine::new(c, None).unwrap()
}

// Item 11: after a real handshake (forwarded by a relay, which then knows none of the
// connection's frame keys), a frame the relay made up used to be served: its write
// landed in the region. Now every frame carries a tag keyed from the handshake.
#[test]
fn frames_after_the_handshake_must_carry_the_connections_tag() {
    let b = with_token("srv", "secret", T);
    let rb = b.allocate(1 << 16, false).unwrap().id;
    let before = bytes(&b, rb);
    let key = AuthKey::from_token("secret");
    let chosen = vec![0x5Au8; 4096];
    let write = encode(&Msg::WriteReq { id: 1, region: rb, offset: 0, data_len: chosen.len() });

    // 1. With a made-up tag, as the relay would send it.
    let mut s = TcpStream::connect(b.address()).unwrap();
    tcp::handshake::client(&mut s, Some(&key), "relay").unwrap();
    FrameWriter::new(&s, None).send(&write, &chosen).unwrap();
    s.write_all(&[0u8; tcp::seal::TAG_LEN]).unwrap();
    assert!(closed_within(&mut s, T), "the server kept a connection that sent an untagged frame");

    // 2. Tagged with another connection's keys (a frame recorded elsewhere).
    let mut other = TcpStream::connect(b.address()).unwrap();
    let (_, other_keys) = tcp::handshake::client(&mut other, Some(&key), "relay").unwrap();
    let mut s = TcpStream::connect(b.address()).unwrap();
    tcp::handshake::client(&mut s, Some(&key), "relay").unwrap();
    FrameWriter::new(&s, other_keys.send).send(&write, &chosen).unwrap();
    assert!(closed_within(&mut s, T), "a frame tagged for another connection was served");
    drop(other);

    wait_until("both bad frames counted", || b.stats().bad_frames >= 2);
    assert!(bytes(&b, rb) == before, "an unauthenticated frame wrote into the region");

    // 3. A replay of a genuine frame on its own connection fails the sequence number.
    let mut s = TcpStream::connect(b.address()).unwrap();
    let (_, keys) = tcp::handshake::client(&mut s, Some(&key), "good").unwrap();
    let mut w = FrameWriter::new(Vec::new(), keys.send);
    w.send(&write, &chosen).unwrap();
    let genuine = w.get_ref().clone();
    s.write_all(&genuine).unwrap();
    wait_until("the genuine write", || bytes(&b, rb)[..4096] == chosen[..]);
    let marker = vec![0u8; 4096];
    // SAFETY: only this test touches the region; reset it to see whether the replay lands.
    unsafe { std::ptr::copy_nonoverlapping(marker.as_ptr(), b.region(rb).unwrap().ptr(), marker.len()) };
    s.write_all(&genuine).unwrap();
    assert!(closed_within(&mut s, T), "a replayed frame was served");
    assert!(bytes(&b, rb)[..4096] == marker[..], "a replayed write landed");
    assert_eq!(b.stats().bad_frames, 3);

    // Engines that share the token still work end to end, through tagged frames.
    let a = with_token("cli", "secret", T);
    let p = a.connect("srv", Some(&b.address())).unwrap();
    roundtrip(&a, &b, &p, 3 << 20);
}

// Item 4: 256 connection slots and a per-read handshake timeout let 500 idle sockets or
// slowloris peers keep a client with the right token out. Now handshakes have their
// own slots and a deadline from accept, and a new connection evicts the oldest one.
#[test]
fn unauthenticated_floods_do_not_lock_out_good_clients() {
    let b = with_token("srv", "secret", Duration::from_millis(800));
    let a = with_token("cli", "secret", T);
    let early = a.connect("srv", Some(&b.address())).unwrap();
    let addr = b.address();

    // Load: 300 idle sockets held open, plus 16 slowloris peers trickling a byte every
    // 50 ms (each reconnects when dropped), for as long as the checks below run.
    let idle: Vec<TcpStream> = (0..300).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let trickle: Vec<_> = (0..16)
        .map(|_| {
            let (stop, addr) = (stop.clone(), addr.clone());
            std::thread::spawn(move || {
                let hello = encode(&Msg::Hello {
                    version: protocol::VERSION,
                    nonce: [1; 32],
                    name: "slow".into(),
                    protection: 0,
                });
                let mut reconnects = 0u32;
                while !stop.load(Ordering::SeqCst) {
                    let Ok(mut s) = TcpStream::connect(&addr) else { continue };
                    for byte in hello.iter().cycle() {
                        if stop.load(Ordering::SeqCst) || s.write_all(&[*byte]).is_err() {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    reconnects += 1;
                }
                reconnects
            })
        })
        .collect();
    wait_until("the flood to fill the handshake slots", || b.stats().handshakes_evicted > 0);

    // Under that load: the peer connected before it keeps being served, and 20 clients
    // with the token connect (each on its first try) and move data.
    for i in 0..20 {
        roundtrip(&a, &b, &early, 64 << 10);
        let c = with_token(&format!("late-{i}"), "secret", T);
        let p = c.connect("srv", Some(&addr)).unwrap();
        roundtrip(&c, &b, &p, 64 << 10);
    }
    stop.store(true, Ordering::SeqCst);
    let reconnects: u32 = trickle.into_iter().map(|t| t.join().unwrap()).sum();
    // The trickling peers were cut off by the deadline (0.8 s), never served.
    assert!(reconnects >= 16, "slowloris peers were never dropped ({reconnects} reconnects)");
    let mut idle = idle;
    let mut first = idle.swap_remove(0);
    assert!(closed_within(&mut first, T), "an idle unauthenticated socket was kept open");
    assert_eq!(b.stats().auth_failures, 0);
}

// Item 10: each connect() opened new connections that stayed until the engine closed;
// 257 connects exhausted the server. Now a live peer at the same endpoints is reused,
// and a peer with no connection left is replaced by a fresh one.
#[test]
fn connect_again_reuses_the_peer_and_replaces_a_dead_one() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let mut c = cfg("srv", &["tcp"]);
    c.listen = vec![addr.clone()];
    let b = Engine::new(c.clone(), None).unwrap();
    let a = engine_plain("cli");
    let first = a.connect("srv", Some(&addr)).unwrap();
    for _ in 0..300 {
        let p = a.connect("srv", Some(&addr)).unwrap();
        assert!(Arc::ptr_eq(&p, &first));
    }
    roundtrip(&a, &b, &first, 10_000);
    // The server counts a connection after its handshake reply, so a connection the
    // round trip did not use may be counted a moment after the client holds it: wait for
    // the count to reach the client's, then check it did not go past (a connect() that
    // opened and dropped connections would have been counted too).
    wait_until("the server to count the peer's connections", || b.stats().connections as usize >= first.connections());
    assert_eq!(b.stats().connections as usize, first.connections(), "connect() opened new connections");

    // The peer restarts at the same address: the old connections die, connect() again
    // gives a working peer.
    b.close();
    drop(b);
    wait_until("the old connection to die", || first.connections() == 0);
    let b = Engine::new(c, None).unwrap();
    let again = a.connect("srv", Some(&addr)).unwrap();
    assert!(!Arc::ptr_eq(&again, &first));
    roundtrip(&a, &b, &again, 10_000);
}

fn engine_plain(name: &str) -> Engine {
    Engine::new(cfg(name, &["tcp"]), None).unwrap()
}

// Issue 26 item 7: without a token anyone completes the handshake, and a served
// connection used to stay until its peer closed it: 300 idle ones took every served slot
// and locked good clients out. Now the idlest is evicted to admit a new connection (per
// server and per peer address), and an idle one is closed after `idle_timeout`.
#[test]
fn idle_handshaken_connections_do_not_lock_out_good_clients_without_a_token() {
    let mut c = cfg("srv", &["tcp"]);
    c.idle_timeout = Duration::from_secs(2);
    let b = Engine::new(c, None).unwrap();
    let addr = b.address();
    // Load: 300 connections that complete the (tokenless) handshake, then idle.
    let mut idle: Vec<TcpStream> = (0..300)
        .map(|i| {
            let mut s = TcpStream::connect(&addr).unwrap();
            tcp::handshake::client(&mut s, None, &format!("idle-{i}")).unwrap();
            s
        })
        .collect();
    wait_until("the server to admit all 300 (evicting the idlest past its caps)", || b.stats().connections >= 300);
    // Good clients connect on their first try and move data, under that load.
    for i in 0..10 {
        let a = engine_plain(&format!("good-{i}"));
        let p = a.connect("srv", Some(&addr)).unwrap();
        roundtrip(&a, &b, &p, 64 << 10);
    }
    assert!(b.stats().idle_evicted > 0);
    // And an idle handshaken connection is closed by the deadline (2 s) at the latest.
    let mut last = idle.pop().unwrap();
    assert!(closed_within(&mut last, T), "an idle connection was kept open past idle_timeout");
}
