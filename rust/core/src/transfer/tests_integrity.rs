//! Integrity-only token sessions (`wire_protection = Integrity`, issue 26's cost of
//! security): the bytes they move, what they refuse, and what they do not hide.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use super::auth::AuthKey;
use super::protocol::{encode, Msg};
use super::tcp::seal::FrameWriter;
use super::tests::{bytes, cfg, closed_within, fill, req, wait_until, T};
use super::*;

fn keyed(name: &str, token: &str, protection: Option<WireProtection>) -> Engine {
    let mut c = cfg(name, &["tcp"]);
    c.auth_token = Some(token.into());
    c.wire_protection = protection;
    c.slice_size = 256 << 10;
    c.connections_per_endpoint = 2;
    Engine::new(c, None).unwrap()
}

/// Writes the first half of a fresh region of `a` into `b` and reads `b`'s second half
/// back, in requests of uneven sizes (records cut mid-way, several slices); returns
/// both regions afterwards.
fn move_both_ways(a: &Engine, b: &Engine, p: &Arc<Peer>, len: usize, label: &str) -> (Vec<u8>, Vec<u8>) {
    let la = a.allocate(len, false).unwrap().id;
    let rb = b.allocate(len, false).unwrap().id;
    let (va, vb) = (fill(a, la, 21), fill(b, rb, 22));
    let half = len / 2;
    let mut reqs = Vec::new();
    let mut at = 0;
    for size in [300_000usize, 1 << 20, 77_777, 65_536, 900_001].iter().cycle() {
        if at >= len {
            break;
        }
        let n = (*size).min(if at < half { half - at } else { len - at });
        let op = if at < half { Op::Write } else { Op::Read };
        reqs.push(req(op, la, at as u64, p, rb, at as u64, n as u64));
        at += n;
    }
    let st = a.submit(reqs, T).unwrap().wait(None);
    assert!(st.iter().all(|s| s.is_ok()), "{st:?}");
    let (ga, gb) = (bytes(a, la), bytes(b, rb));
    assert!(gb[..half] == va[..half], "written half differs");
    let first_bad = (half..len).find(|&i| ga[i] != vb[i]);
    assert!(first_bad.is_none(), "read half differs at byte {first_bad:?} of {len} ({label}; {:?})", st);
    (ga, gb)
}

#[test]
fn integrity_and_encrypted_sessions_move_the_same_bytes_as_a_plain_one() {
    let len = (3 << 20) + 1234;
    let mut results = Vec::new();
    for mode in [None, Some(WireProtection::Encrypted), Some(WireProtection::Integrity)] {
        let (a, b) = match mode {
            None => {
                (Engine::new(cfg("cli", &["tcp"]), None).unwrap(), Engine::new(cfg("srv", &["tcp"]), None).unwrap())
            }
            Some(m) => (keyed("cli", "tok", Some(m)), keyed("srv", "tok", Some(m))),
        };
        let p = a.connect("srv", Some(&b.address())).unwrap();
        results.push(move_both_ways(&a, &b, &p, len, &format!("{mode:?}")));
        assert_eq!(b.stats().bad_frames, 0);
    }
    assert!(results[0] == results[1] && results[1] == results[2], "a protected transfer differs from the plain one");
}

#[test]
fn the_protection_must_match_on_both_ends() {
    for (srv, cli) in
        [(WireProtection::Integrity, WireProtection::Encrypted), (WireProtection::Encrypted, WireProtection::Integrity)]
    {
        let b = keyed("srv", "tok", Some(srv));
        let a = keyed("cli", "tok", Some(cli));
        match a.connect("srv", Some(&b.address())) {
            Err(TransferError::Unauthorized(why)) => {
                assert!(why.contains("wire_protection mismatch"), "{why}");
                assert!(why.contains(srv.as_str()) && why.contains(cli.as_str()), "{why}");
            }
            other => panic!("a {cli:?} client reached a {srv:?} server: {:?}", other.map(|_| ())),
        }
        assert_eq!(b.stats().connections, 0);
    }
    // The default (None) is encrypted: it talks to an explicit "encrypted" engine.
    let b = keyed("srv", "tok", Some(WireProtection::Encrypted));
    let a = keyed("cli", "tok", None);
    let p = a.connect("srv", Some(&b.address())).unwrap();
    move_both_ways(&a, &b, &p, 1 << 20, "default");
}

#[test]
fn a_wrong_token_is_refused_in_integrity_mode_too() {
    let b = keyed("srv", "right", Some(WireProtection::Integrity));
    let a = keyed("cli", "wrong", Some(WireProtection::Integrity));
    assert!(matches!(a.connect("srv", Some(&b.address())), Err(TransferError::Unauthorized(_))));
    wait_until("the wrong token counted", || b.stats().auth_failures >= 1);
    assert_eq!(b.stats().connections, 0);
}

#[test]
fn the_option_needs_a_token_and_a_known_name() {
    let mut c = cfg("x", &["tcp"]);
    c.wire_protection = Some(WireProtection::Integrity);
    assert!(matches!(Engine::new(c, None), Err(TransferError::InvalidRequest(m)) if m.contains("auth_token")));
    assert!(
        matches!(WireProtection::parse("none"), Err(TransferError::InvalidRequest(m)) if m.contains("\"integrity\""))
    );
    assert_eq!(WireProtection::parse("integrity").unwrap(), WireProtection::Integrity);
    assert_eq!(WireProtection::parse("encrypted").unwrap(), WireProtection::Encrypted);
}

/// A relay between a client and a server that copies both directions; on every
/// connection it flips the client's byte number `flip_at` (when set), and it records
/// whether `needle` crossed it in clear.
struct Relay {
    address: String,
    connections: Arc<AtomicUsize>,
    saw_needle: Arc<AtomicBool>,
}

fn relay(to: String, flip_at: Option<usize>, needle: Vec<u8>) -> Relay {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = l.local_addr().unwrap().to_string();
    let (connections, saw_needle) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
    let (count, saw) = (connections.clone(), saw_needle.clone());
    std::thread::spawn(move || {
        for c in l.incoming().take(8) {
            let Ok(c) = c else { return };
            count.fetch_add(1, Ordering::SeqCst);
            let s = TcpStream::connect(&to).unwrap();
            let (mut c2, mut s2) = (c.try_clone().unwrap(), s.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut s2, &mut c2);
                let _ = c2.shutdown(std::net::Shutdown::Both);
            });
            let (mut c, mut s, saw, needle) = (c, s, saw.clone(), needle.clone());
            std::thread::spawn(move || {
                let (mut at, mut buf, mut seen) = (0usize, vec![0u8; 64 << 10], Vec::new());
                loop {
                    let n = match c.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if let Some(k) = flip_at.filter(|k| (at..at + n).contains(k)) {
                        buf[k - at] ^= 0x01;
                    }
                    at += n;
                    if seen.len() < 1 << 20 {
                        seen.extend_from_slice(&buf[..n]);
                        if seen.windows(needle.len()).any(|w| w == &needle[..]) {
                            saw.store(true, Ordering::SeqCst);
                        }
                    }
                    if s.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = s.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    Relay { address, connections, saw_needle }
}

// What a token holder's integrity-only session does and does not protect: a byte
// flipped on the wire fails its tag, the request fails and nothing lands; the KV bytes
// themselves cross the wire in clear (they do not with encryption).
#[test]
fn a_byte_flipped_on_the_wire_is_refused_and_integrity_only_does_not_hide_the_bytes() {
    let hello = encode(&Msg::Hello { version: protocol::VERSION, nonce: [0; 32], name: "cli".into(), protection: 2 });
    let proof = encode(&Msg::Proof { mac: [0; 32] });
    let write_head = encode(&Msg::WriteReq { id: 0, region: 0, offset: 0, data_len: 0 }).len();
    // Byte 1000 of the first write's payload (its first record).
    let flip = hello.len() + proof.len() + write_head + 1000;
    let needle: Vec<u8> = b"KV-BYTES-IN-CLEAR?".repeat(4);
    for mode in [WireProtection::Integrity, WireProtection::Encrypted] {
        let b = keyed("srv", "tok", Some(mode));
        let rb = b.allocate(1 << 20, false).unwrap().id;
        let before = bytes(&b, rb);
        let mut c = cfg("cli", &["tcp"]);
        c.auth_token = Some("tok".into());
        c.wire_protection = Some(mode);
        c.connections_per_endpoint = 1;
        c.max_attempts = 2;
        let a = Engine::new(c, None).unwrap();
        let la = a.allocate(1 << 20, false).unwrap().id;
        let mut payload = vec![0x33u8; 1 << 20];
        payload[4096..4096 + needle.len()].copy_from_slice(&needle);
        // SAFETY: only this test touches the region, 1 MiB long.
        unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), a.region(la).unwrap().ptr(), payload.len()) };

        // Tampered on every connection: refused, the connection closed, nothing landed.
        let r = relay(b.address(), Some(flip), needle.clone());
        let p = a.connect("srv", Some(&r.address)).unwrap();
        let st = a.submit(vec![req(Op::Write, la, 0, &p, rb, 0, 1 << 20)], T).unwrap().wait(None);
        assert!(!st[0].is_ok(), "a tampered write reported ok ({mode:?})");
        wait_until("the bad frames counted", || b.stats().bad_frames >= 1);
        assert!(bytes(&b, rb) == before, "a tampered write landed ({mode:?})");
        assert!(r.connections.load(Ordering::SeqCst) >= 1);
        assert_eq!(r.saw_needle.load(Ordering::SeqCst), mode == WireProtection::Integrity, "{mode:?}");

        // Through a relay that only copies: the same write lands whole.
        let r = relay(b.address(), None, needle.clone());
        let a2 = keyed("cli2", "tok", Some(mode));
        let la2 = a2.allocate(1 << 20, false).unwrap().id;
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), a2.region(la2).unwrap().ptr(), payload.len()) };
        let p = a2.connect("srv", Some(&r.address)).unwrap();
        let st = a2.submit(vec![req(Op::Write, la2, 0, &p, rb, 0, 1 << 20)], T).unwrap().wait(None);
        assert!(st[0].is_ok(), "{st:?}");
        assert!(bytes(&b, rb) == payload);
    }
}

// A replayed or reordered integrity-only frame on a genuine connection fails its
// sequence number: the server closes the connection and the frame does not land.
#[test]
fn replayed_and_reordered_integrity_frames_are_refused() {
    let b = keyed("srv", "tok", Some(WireProtection::Integrity));
    let rb = b.allocate(1 << 16, false).unwrap().id;
    let key = AuthKey::from_token("tok").with_protection(WireProtection::Integrity);
    let first = vec![0x11u8; 4096];
    let second = vec![0x22u8; 4096];
    let w1 = encode(&Msg::WriteReq { id: 1, region: rb, offset: 0, data_len: 4096 });
    let w2 = encode(&Msg::WriteReq { id: 2, region: rb, offset: 8192, data_len: 4096 });

    // Replay: frame 1 sent twice.
    let mut s = TcpStream::connect(b.address()).unwrap();
    let (_, keys) = tcp::handshake::client(&mut s, Some(&key), "good").unwrap();
    let mut w = FrameWriter::new(Vec::new(), keys.send);
    w.send(&w1, &first).unwrap();
    let genuine = w.get_ref().clone();
    assert!(genuine.windows(64).any(|x| x == &first[..64]), "integrity-only frames carry the bytes in clear");
    s.write_all(&genuine).unwrap();
    wait_until("the genuine write", || bytes(&b, rb)[..4096] == first[..]);
    s.write_all(&genuine).unwrap();
    assert!(closed_within(&mut s, T), "a replayed frame was served");
    wait_until("the replay counted", || b.stats().bad_frames >= 1);

    // Reorder: frames 1 and 2 tagged in order, sent swapped.
    let mut s = TcpStream::connect(b.address()).unwrap();
    let (_, keys) = tcp::handshake::client(&mut s, Some(&key), "good").unwrap();
    let mut w = FrameWriter::new(Vec::new(), keys.send);
    w.send(&w1, &first).unwrap();
    let n1 = w.get_ref().len();
    w.send(&w2, &second).unwrap();
    let wire = w.get_ref().clone();
    s.write_all(&wire[n1..]).unwrap();
    s.write_all(&wire[..n1]).unwrap();
    assert!(closed_within(&mut s, T), "a reordered frame was served");
    assert!(bytes(&b, rb)[8192..8192 + 4096].iter().all(|&x| x == 0), "a reordered write landed");
    wait_until("the reorder counted", || b.stats().bad_frames >= 2);
}
