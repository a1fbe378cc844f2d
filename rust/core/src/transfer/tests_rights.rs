//! Per-peer grants on restricted regions (issue 17, items 1 and 9): a peer reaches a
//! restricted region only inside a live grant made out to its authenticated engine name,
//! on every path (in-process, TCP, and a same-host peer that would otherwise use shm),
//! and a revoked or expired grant stops the next request.

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use super::auth::AuthKey;
use super::protocol::{encode, Msg, VERSION};
use super::tcp::read_control;
use super::tests::{bytes, cfg, fill, req, T};
use super::*;

const TOKEN: &str = "cluster-token";

fn engine_in(name: &str, transports: &[&str], reg: &Arc<EngineRegistry>) -> Engine {
    let mut c = cfg(name, transports);
    c.auth_token = Some(TOKEN.into());
    Engine::new(c, Some(reg.clone())).unwrap()
}

fn connect(a: &Engine, b: &Engine) -> Arc<Peer> {
    let addr = b.address();
    a.connect(b.name(), Some(addr.as_str()).filter(|s| !s.is_empty())).unwrap()
}

fn code(st: &RequestStatus) -> &'static str {
    st.error().map_or("ok", |e| e.code())
}

fn restricted() -> Access {
    Access { restricted: true, ..Access::default() }
}

/// One write of `len` bytes from `a`'s region `l` into `b`'s region `rb` at `off`.
fn write(a: &Engine, l: RegionId, p: &Arc<Peer>, rb: RegionId, off: u64, len: u64) -> &'static str {
    let st = a.submit(vec![req(Op::Write, l, 0, p, rb, off, len)], T).unwrap().wait(None);
    code(&st[0])
}

fn read(a: &Engine, l: RegionId, p: &Arc<Peer>, rb: RegionId, off: u64, len: u64) -> &'static str {
    let st = a.submit(vec![req(Op::Read, l, 0, p, rb, off, len)], T).unwrap().wait(None);
    code(&st[0])
}

#[test]
fn a_restricted_region_is_reached_only_inside_a_live_grant_on_every_path() {
    for transports in [&["local"][..], &["tcp"], &["shm", "tcp"]] {
        let reg = EngineRegistry::new();
        let decode = engine_in("decode-0", transports, &reg);
        let prefill = engine_in("prefill-0", transports, &reg);
        let other = engine_in("prefill-1", transports, &reg);
        let p = connect(&prefill, &decode);
        let q = connect(&other, &decode);
        let arena = decode.allocate_with(1 << 16, restricted()).unwrap().id;
        let open = decode.allocate(4096, false).unwrap().id;
        let before = fill(&decode, arena, 11);
        let (l, lo) = (prefill.allocate(1 << 16, false).unwrap().id, other.allocate(1 << 16, false).unwrap().id);
        let src = fill(&prefill, l, 12);
        fill(&other, lo, 13);
        let ctx = format!("{transports:?}");

        // No grant: refused, nothing moved, counted.
        assert_eq!(write(&prefill, l, &p, arena, 4096, 8192), "no_grant", "{ctx}");
        assert_eq!(read(&prefill, l, &p, arena, 4096, 8192), "no_grant", "{ctx}");
        assert!(bytes(&decode, arena) == before, "{ctx}: an ungranted write landed");
        assert_eq!(decode.stats().grant_refusals, 2, "{ctx}");
        // The default (unrestricted) region behaves as before.
        assert_eq!(write(&prefill, l, &p, open, 0, 4096), "ok", "{ctx}");

        // A write grant of 8 KiB at 4 KiB, to prefill-0 only.
        let g = decode.grant(arena, "prefill-0", 4096, 8192, true, None).unwrap();
        assert_eq!(write(&prefill, l, &p, arena, 4096, 8192), "ok", "{ctx}");
        let got = bytes(&decode, arena);
        assert!(got[4096..12288] == src[..8192], "{ctx}: granted bytes differ");
        assert!(got[..4096] == before[..4096] && got[12288..] == before[12288..], "{ctx}");
        assert_eq!(read(&prefill, l, &p, arena, 6000, 100), "ok", "{ctx}: a write grant covers reads");
        // Outside the range (also by one byte), or another peer: refused, untouched.
        let now = bytes(&decode, arena);
        assert_eq!(write(&prefill, l, &p, arena, 12287, 2), "no_grant", "{ctx}");
        assert_eq!(write(&prefill, l, &p, arena, 0, 100), "no_grant", "{ctx}");
        assert_eq!(write(&other, lo, &q, arena, 4096, 100), "no_grant", "{ctx}: another peer used the grant");
        // Bounds still come first: a range past the end is out_of_bounds, not no_grant.
        assert_eq!(write(&prefill, l, &p, arena, (1 << 16) - 10, 100), "out_of_bounds", "{ctx}");
        assert!(bytes(&decode, arena) == now, "{ctx}: a refused write landed");

        // Revoked: refused again at once.
        assert_eq!(decode.revoke(arena, "prefill-0", Some(g)).unwrap(), 1);
        assert_eq!(write(&prefill, l, &p, arena, 4096, 100), "no_grant", "{ctx}: a revoked grant still applied");

        // A read-only grant lets it read, not write.
        decode.grant(arena, "prefill-0", 0, 4096, false, None).unwrap();
        assert_eq!(read(&prefill, l, &p, arena, 0, 4096), "ok", "{ctx}");
        assert_eq!(write(&prefill, l, &p, arena, 0, 4096), "no_grant", "{ctx}");
        assert_eq!(decode.revoke(arena, "prefill-0", None).unwrap(), 1);

        // An expired grant: refused (we wait well past its expiry, no timing asserted).
        decode.grant(arena, "prefill-0", 0, 4096, true, Some(Duration::from_millis(20))).unwrap();
        std::thread::sleep(Duration::from_millis(120));
        assert_eq!(write(&prefill, l, &p, arena, 0, 100), "no_grant", "{ctx}: an expired grant applied");
        assert!(decode.grants(arena).unwrap().is_empty(), "{ctx}");

        // Unregistered: gone on every path (a restricted region is never mapped by a peer).
        decode.grant(arena, "prefill-0", 0, 4096, true, None).unwrap();
        assert_eq!(write(&prefill, l, &p, arena, 0, 100), "ok", "{ctx}");
        assert!(decode.unregister(arena));
        assert_eq!(write(&prefill, l, &p, arena, 0, 100), "no_such_region", "{ctx}: unregister did not revoke");
        assert!(decode.stats().grant_refusals >= 8, "{ctx}");
    }
}

// Item 9: a same-host peer maps an unrestricted shared region and copies on its own; a
// restricted one is never offered over shm, so the server moves (and checks) every byte.
#[test]
fn a_restricted_region_is_never_offered_over_shm() {
    let reg = EngineRegistry::new();
    let decode = engine_in("decode-0", &["shm", "tcp"], &reg);
    let prefill = engine_in("prefill-0", &["shm", "tcp"], &reg);
    // Not through the registry: a real same-host peer.
    let p = prefill.connect("decode-0", Some(&decode.address())).unwrap();
    assert_eq!(p.transport(), "shm");
    let open = decode.allocate(4096, false).unwrap().id;
    let arena = decode.allocate_with(4096, restricted()).unwrap().id;
    let l = prefill.allocate(4096, false).unwrap().id;
    assert_eq!(write(&prefill, l, &p, open, 0, 4096), "ok");
    assert_eq!(decode.stats().bytes_served, 0, "the unrestricted region went over shm");
    decode.grant(arena, "prefill-0", 0, 4096, true, None).unwrap();
    assert_eq!(write(&prefill, l, &p, arena, 0, 4096), "ok");
    assert_eq!(decode.stats().bytes_served, 4096, "the restricted region must go through the server");
    decode.revoke(arena, "prefill-0", None).unwrap();
    assert_eq!(write(&prefill, l, &p, arena, 0, 4096), "no_grant");
}

// The name grants are checked against is covered by the handshake proof: a relay (or a
// peer) cannot announce one name and prove with another's transcript.
#[test]
fn the_announced_engine_name_is_bound_into_the_proof() {
    let reg = EngineRegistry::new();
    let decode = engine_in("decode-0", &["tcp"], &reg);
    let key = AuthKey::from_token(TOKEN);
    let mut s = TcpStream::connect(decode.address()).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    let cn = auth::nonce().unwrap();
    s.write_all(&encode(&Msg::Hello { version: VERSION, nonce: cn, name: "intruder".into(), protection: 1 })).unwrap();
    let Msg::Challenge { nonce: sn, .. } = read_control(&mut s).unwrap() else { panic!("no challenge") };
    s.write_all(&encode(&Msg::Proof { mac: key.client_proof(&sn, &cn, "prefill-0") })).unwrap();
    assert!(!matches!(read_control(&mut s), Ok(Msg::Welcome { .. })), "a proof for another name was accepted");
    let t0 = std::time::Instant::now();
    while decode.stats().auth_failures == 0 {
        assert!(t0.elapsed() < T, "the mismatched proof was not counted");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn grant_arguments_are_checked() {
    let reg = EngineRegistry::new();
    let e = engine_in("decode-0", &["local"], &reg);
    let open = e.allocate(4096, false).unwrap().id;
    let arena = e.allocate_with(4096, restricted()).unwrap().id;
    let ro = e.allocate_with(4096, Access { restricted: true, remote_readonly: true, ..Access::default() }).unwrap().id;
    let bad = |r: Result<u64, TransferError>| matches!(r, Err(TransferError::InvalidRequest(_)));
    assert!(bad(e.grant(open, "p", 0, 10, true, None)), "grant on an unrestricted region");
    assert!(bad(e.grant(arena, "p", 4000, 200, true, None)), "grant past the end");
    assert!(bad(e.grant(arena, "p", u64::MAX, 2, true, None)), "grant that wraps");
    assert!(bad(e.grant(arena, "", 0, 10, true, None)), "grant to no one");
    assert!(bad(e.grant(arena, &"p".repeat(256), 0, 10, true, None)), "a name no handshake can carry");
    assert!(bad(e.grant(ro, "p", 0, 10, true, None)), "write grant on a peer-read-only region");
    assert!(bad(e.grant(999, "p", 0, 10, true, None)), "grant on an unknown region");
    assert!(bad(e.grant(arena, "p", 0, 10, true, Some(Duration::MAX))), "expiry that overflows");
    e.grant(ro, "p", 0, 10, false, None).unwrap();
    let a = e.grant(arena, "p", 0, 10, true, None).unwrap();
    let b = e.grant(arena, "p", 100, 10, true, None).unwrap();
    e.grant(arena, "q", 0, 10, true, None).unwrap();
    assert_ne!(a, b);
    assert_eq!(e.grants(arena).unwrap().len(), 3);
    assert_eq!(e.revoke(arena, "p", Some(b)).unwrap(), 1);
    assert_eq!(e.revoke(arena, "p", None).unwrap(), 1);
    assert_eq!(e.revoke(arena, "p", None).unwrap(), 0);
    assert_eq!(e.grants(arena).unwrap().iter().map(|g| g.peer.as_str()).collect::<Vec<_>>(), vec!["q"]);
}

#[test]
fn check_access_grant_rule() {
    use region::{check_access, Grant, GrantCheck};
    let now = std::time::Instant::now();
    let g = |peer: &str, offset, len, write| Grant { id: 1, peer: peer.into(), offset, len, write, expires: None };
    let grants =
        vec![g("a", 100, 50, true), g("a", 0, 10, false), Grant { expires: Some(now), ..g("b", 0, 1000, true) }];
    let chk = |peer, off, len, write| {
        check_access(off, len, 1000, false, write, Some(GrantCheck { grants: &grants, peer, now }))
    };
    assert_eq!(chk("a", 100, 50, true), Ok(()));
    assert_eq!(chk("a", 149, 1, true), Ok(()));
    assert_eq!(chk("a", 149, 2, true), Err(AccessError::NoGrant));
    assert_eq!(chk("a", 99, 2, false), Err(AccessError::NoGrant));
    assert_eq!(chk("a", 0, 10, false), Ok(()));
    assert_eq!(chk("a", 0, 10, true), Err(AccessError::NoGrant));
    assert_eq!(chk("b", 0, 1, false), Err(AccessError::NoGrant), "expired at `now`");
    assert_eq!(chk("c", 100, 1, false), Err(AccessError::NoGrant));
    assert_eq!(chk("a", u64::MAX, 2, false), Err(AccessError::OutOfBounds));
    assert_eq!(
        check_access(100, 50, 1000, true, true, Some(GrantCheck { grants: &grants, peer: "a", now })),
        Err(AccessError::ReadOnly)
    );
}

// Per-peer tokens: the name a grant is made out to can be claimed only with that name's
// own token, so a holder of the shared cluster token cannot borrow the grant.
#[test]
fn with_per_peer_tokens_a_cluster_token_holder_cannot_pass_for_the_granted_peer() {
    let mk = |name: &str, token: &str, peer_tokens: Vec<(String, String)>| {
        let mut c = cfg(name, &["tcp"]);
        c.auth_token = Some(token.into());
        c.peer_tokens = peer_tokens;
        Engine::new(c, None).unwrap()
    };
    let decode = mk("decode-0", TOKEN, vec![("prefill-0".into(), "prefill-0-token".into())]);
    let arena = decode.allocate_with(4096, restricted()).unwrap().id;
    decode.grant(arena, "prefill-0", 0, 4096, true, None).unwrap();

    let prefill = mk("prefill-0", "prefill-0-token", vec![]);
    let p = prefill.connect("decode-0", Some(&decode.address())).unwrap();
    let l = prefill.allocate(4096, false).unwrap().id;
    assert_eq!(write(&prefill, l, &p, arena, 0, 4096), "ok");

    // The shared token under the granted name: refused at the handshake.
    let impostor = mk("prefill-0", TOKEN, vec![]);
    match impostor.connect("decode-0", Some(&decode.address())) {
        Err(TransferError::Unauthorized(_)) => {}
        other => panic!("an impostor with the cluster token connected as prefill-0: {other:?}"),
    }
    // The shared token under its own (unlisted) name: served, but the grant is not its.
    let other = mk("prefill-1", TOKEN, vec![]);
    let q = other.connect("decode-0", Some(&decode.address())).unwrap();
    let lo = other.allocate(4096, false).unwrap().id;
    assert_eq!(write(&other, lo, &q, arena, 0, 16), "no_grant");

    let mut c = cfg("x", &["tcp"]);
    c.peer_tokens = vec![("p".into(), "t".into())];
    assert!(matches!(Engine::new(c, None), Err(TransferError::InvalidRequest(_))), "peer_tokens without auth_token");
}
