//! Tests of the whole engine over its three paths, in one process, on 127.0.0.1.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use rand::{Rng, SeedableRng};

use super::inner::PeerKind;
use super::protocol::{self, decode_frame, encode, Msg};
use super::*;

pub(super) fn cfg(name: &str, transports: &[&str]) -> EngineConfig {
    EngineConfig {
        name: name.into(),
        transports: Transports::parse(transports.iter().copied()).unwrap(),
        io_timeout: Duration::from_secs(3),
        ..Default::default()
    }
}

pub(super) fn engine(name: &str, transports: &[&str]) -> Engine {
    Engine::new(cfg(name, transports), None).unwrap()
}

pub(super) fn fill(e: &Engine, id: RegionId, seed: u64) -> Vec<u8> {
    let r = e.region(id).unwrap();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let v: Vec<u8> = (0..r.len()).map(|_| rng.gen()).collect();
    // SAFETY: the region is r.len() bytes and only this test touches it.
    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), r.ptr(), v.len()) };
    v
}

pub(super) fn bytes(e: &Engine, id: RegionId) -> Vec<u8> {
    let r = e.region(id).unwrap();
    // SAFETY: as above; read after the batch completed.
    unsafe { std::slice::from_raw_parts(r.ptr(), r.len()) }.to_vec()
}

pub(super) fn req(op: Op, local: RegionId, lo: u64, peer: &Arc<Peer>, remote: RegionId, ro: u64, len: u64) -> Request {
    Request { op, local, local_offset: lo, peer: peer.clone(), remote_region: remote, remote_offset: ro, length: len }
}

pub(super) const T: Duration = Duration::from_secs(10);

/// A "peer" named `mute` that completes the handshake on every connection a client opens
/// (a client opens one or more per endpoint), then never answers (for 2 s): its address
/// and its thread.
pub(super) fn mute_peer() -> (String, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let t = std::thread::spawn(move || {
        let end = Instant::now() + Duration::from_secs(2);
        l.set_nonblocking(true).unwrap();
        let mut held = Vec::new();
        while Instant::now() < end {
            match l.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false).unwrap();
                    tcp::handshake::server(&mut s, None, [0; 16], "mute").ok().unwrap();
                    held.push(s);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    });
    (addr, t)
}

/// Reads until EOF or error; true when the peer closed within `within`.
pub(super) fn closed_within(s: &mut std::net::TcpStream, within: Duration) -> bool {
    use std::io::Read;
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

/// Polls `f` every 5 ms until it holds; fails the test after `T`.
pub(super) fn wait_until(what: &str, f: impl Fn() -> bool) {
    let t0 = std::time::Instant::now();
    while !f() {
        assert!(t0.elapsed() < T, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Writes the first half of `a`'s region into `b`, reads `b`'s second half back, checks.
pub(super) fn roundtrip(a: &Engine, b: &Engine, peer: &Arc<Peer>, len: usize) {
    let la = a.allocate(len, false).unwrap().id;
    let rb = b.allocate(len, false).unwrap().id;
    let va = fill(a, la, 1);
    let vb = fill(b, rb, 2);
    let half = (len / 2) as u64;
    let batch = a
        .submit(
            vec![req(Op::Write, la, 0, peer, rb, 0, half), req(Op::Read, la, half, peer, rb, half, len as u64 - half)],
            T,
        )
        .unwrap();
    let st = batch.wait(None);
    assert!(st.iter().all(|s| s.is_ok()), "{st:?}");
    assert_eq!(st[0].bytes(), half);
    let (ga, gb) = (bytes(a, la), bytes(b, rb));
    let h = half as usize;
    assert!(gb[..h] == va[..h], "written half differs");
    assert!(gb[h..] == vb[h..], "the rest of the remote region changed");
    assert!(ga[h..len] == vb[h..len], "read half differs");
}

#[test]
fn local_path_same_engine_and_registry_peer() {
    let reg = EngineRegistry::new();
    let a = Engine::new(cfg("a", &["local"]), Some(reg.clone())).unwrap();
    let b = Engine::new(cfg("b", &["local"]), Some(reg.clone())).unwrap();
    assert_eq!(reg.names(), vec!["a".to_string(), "b".to_string()]);
    assert!(Engine::new(cfg("a", &["local"]), Some(reg.clone())).is_err(), "duplicate name");
    let p = a.connect("b", None).unwrap();
    assert_eq!(p.transport(), "local");
    roundtrip(&a, &b, &p, 3 << 20); // large: goes through the copy pool
    roundtrip(&a, &b, &p, 8192); // small: inline
    let me = a.connect("a", None).unwrap();
    roundtrip(&a, &a, &me, 10000);
    b.close();
    assert_eq!(reg.names(), vec!["a".to_string()]);
    let l = a.allocate(4096, false).unwrap().id;
    let st = a.submit(vec![req(Op::Read, l, 0, &p, 1, 0, 10)], T).unwrap().wait(None);
    assert_eq!(st[0].error(), Some(&TransferError::Closed));
}

#[test]
fn tcp_roundtrip_with_many_slices_over_two_endpoints() {
    let mut c = cfg("srv", &["tcp"]);
    c.listen = vec!["127.0.0.1:0".into(), "127.0.0.1:0".into()];
    let b = Engine::new(c, None).unwrap();
    let mut ca = cfg("cli", &["tcp"]);
    ca.slice_size = 64 << 10;
    ca.window = 3;
    ca.connections_per_endpoint = 1; // one per endpoint: two in all
    let a = Engine::new(ca, None).unwrap();
    let p = a.connect("srv", Some(&b.address())).unwrap();
    assert_eq!((p.transport(), p.connections()), ("tcp", 2));
    roundtrip(&a, &b, &p, (1 << 20) + 12345);
    assert!(b.stats().bytes_served > 1 << 20);
    // Two data connections, plus the control one on which the client learned the
    // region's size (a request of many slices is checked whole before it is sent).
    assert_eq!(b.stats().connections, 3);
}

// k24v: a batch of reads over two connections. A read request is a few bytes to send, so
// without the byte window the first sender to wake took every slice of the batch and
// all the bytes came back over one connection. Checked: every byte equals the reference
// (the remote region's bytes, copied with copy_from_slice), both connections answered
// a share, and a window smaller than one slice (one slice at a time per connection)
// still completes the batch with the same bytes.
#[test]
fn a_batch_of_reads_spreads_over_two_connections_and_reads_the_reference_bytes() {
    let b = engine("srv", &["tcp"]);
    for window_bytes in [1 << 20, 1] {
        let mut ca = cfg("cli", &["tcp"]);
        ca.connections_per_endpoint = 2;
        ca.window_bytes = window_bytes;
        ca.slice_size = 256 << 10;
        let a = Engine::new(ca, None).unwrap();
        let p = a.connect("srv", Some(&b.address())).unwrap();
        assert_eq!(p.connections(), 2);
        let (n, size) = (32usize, (512 << 10) + 777); // the last slice of each is short
        let la = a.allocate(n * size, false).unwrap().id;
        let rb = b.allocate(n * size, false).unwrap().id;
        let vb = fill(&b, rb, 21);
        fill(&a, la, 22);
        let reqs =
            (0..n).map(|i| req(Op::Read, la, (i * size) as u64, &p, rb, (i * size) as u64, size as u64)).collect();
        let st = a.submit(reqs, T).unwrap().wait(None);
        assert!(st.iter().all(|s| s.is_ok() && s.bytes() == size as u64), "{st:?}");
        let mut want = vec![0u8; n * size];
        want.copy_from_slice(&vb[..n * size]);
        assert!(bytes(&a, la)[..n * size] == want[..], "read bytes differ (window_bytes {window_bytes})");
        let PeerKind::Remote { tcp, .. } = &p.kind else { panic!("not a tcp peer") };
        let per = tcp.answered_per_connection();
        assert_eq!(per.iter().sum::<u64>(), (n * size) as u64);
        assert!(per.iter().all(|&x| x > 0), "one connection carried the whole batch: {per:?}");
        a.close();
    }
}

#[test]
fn shm_path_copies_without_the_server() {
    let b = engine("srv", &["shm", "tcp"]);
    let a = engine("cli", &["shm", "tcp"]);
    let p = a.connect("srv", Some(&b.address())).unwrap();
    assert_eq!(p.transport(), "shm");
    roundtrip(&a, &b, &p, 1 << 20);
    roundtrip(&a, &b, &p, 5000); // second time: mapping cached, copied inline
    assert_eq!(b.stats().bytes_served, 0, "the initiator copied, the server moved nothing");
    // A registered non-shared region falls back to TCP.
    let mut keep = vec![7u8; 4096];
    // SAFETY: `keep` outlives both engines (closed before it is dropped below).
    let rid = unsafe { b.register_raw(keep.as_mut_ptr(), 4096, false, false, Box::new(())) }.unwrap();
    let l = a.allocate(4096, false).unwrap().id;
    let st = a.submit(vec![req(Op::Read, l, 0, &p, rid, 0, 4096)], T).unwrap().wait(None);
    assert!(st[0].is_ok(), "{st:?}");
    assert_eq!(bytes(&a, l), vec![7u8; 4096]);
    assert_eq!(b.stats().bytes_served, 4096);
    a.close();
    b.close();
    drop(keep);
}

fn refusal(st: &RequestStatus) -> Option<AccessError> {
    match st.error() {
        Some(TransferError::Refused { reason, .. }) => Some(*reason),
        _ => None,
    }
}

#[test]
fn remote_violations_are_refused_and_memory_untouched() {
    for transports in [&["tcp"][..], &["shm", "tcp"][..], &["local"][..]] {
        let reg = EngineRegistry::new();
        let b = Engine::new(cfg("srv", transports), Some(reg.clone())).unwrap();
        let a = Engine::new(cfg("cli", transports), Some(reg.clone())).unwrap();
        let p = a.connect("srv", Some(&b.address()).filter(|s| !s.is_empty()).map(|x| x.as_str())).unwrap();
        let ro = b.allocate(4096, true).unwrap().id;
        let rw = b.allocate(4096, false).unwrap().id;
        let before = (fill(&b, ro, 5), fill(&b, rw, 6));
        let l = a.allocate(8192, false).unwrap().id;
        fill(&a, l, 7);
        let batch = a
            .submit(
                vec![
                    req(Op::Write, l, 0, &p, ro, 0, 100),
                    req(Op::Write, l, 0, &p, rw, 4000, 200),
                    req(Op::Read, l, 0, &p, rw, u64::MAX - 5, 10),
                    req(Op::Write, l, 0, &p, 999, 0, 10),
                    req(Op::Read, l, 0, &p, ro, 0, 4096),
                ],
                T,
            )
            .unwrap();
        let st = batch.wait(None);
        let got: Vec<_> = st.iter().map(refusal).collect();
        use AccessError::*;
        assert_eq!(
            got,
            vec![Some(ReadOnly), Some(OutOfBounds), Some(OutOfBounds), Some(NoSuchRegion), None],
            "{transports:?}"
        );
        assert!(st[4].is_ok());
        assert_eq!((bytes(&b, ro), bytes(&b, rw)), before, "{transports:?}");
        assert_eq!(st[0].error().unwrap().code(), "read_only");
    }
}

#[test]
fn local_side_errors_fail_the_submit() {
    let a = engine("a", &["local"]);
    let me = a.connect("a", None).unwrap();
    let l = a.allocate(4096, true).unwrap().id;
    let e = a.submit(vec![req(Op::Read, l, 0, &me, l, 0, 10)], T).unwrap_err();
    assert_eq!(e.category(), crate::ErrorCategory::InvalidArgument);
    assert!(a.submit(vec![req(Op::Write, 77, 0, &me, l, 0, 10)], T).is_err());
    assert!(a.submit(vec![req(Op::Write, l, 4090, &me, l, 0, 10)], T).is_err());
}

#[test]
fn auth_wrong_or_missing_token_is_refused_and_counted() {
    let mut c = cfg("srv", &["tcp"]);
    c.auth_token = Some("right".into());
    let b = Engine::new(c, None).unwrap();
    let mk = |tok: Option<&str>| {
        let mut c = cfg("cli", &["tcp"]);
        c.auth_token = tok.map(Into::into);
        Engine::new(c, None).unwrap()
    };
    let wrong = mk(Some("wrong")).connect("srv", Some(&b.address())).unwrap_err();
    assert!(matches!(wrong, TransferError::Unauthorized(_)), "{wrong:?}");
    assert!(matches!(mk(None).connect("srv", Some(&b.address())), Err(TransferError::Unauthorized(_))));
    let a = mk(Some("right"));
    let p = a.connect("srv", Some(&b.address())).unwrap();
    roundtrip(&a, &b, &p, 10000);
    // The server with no token cannot prove itself to a client that has one.
    let open = engine("open", &["tcp"]);
    assert!(matches!(mk(Some("right")).connect("open", Some(&open.address())), Err(TransferError::Unauthorized(_))));
    let t0 = Instant::now();
    while b.stats().auth_failures < 1 && t0.elapsed() < T {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(b.stats().auth_failures, 1);
}

fn handshaken(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    tcp::handshake::client(&mut s, None, "raw").unwrap();
    s
}

#[test]
fn a_bad_frame_closes_only_that_connection() {
    let b = engine("srv", &["tcp"]);
    let a = engine("cli", &["tcp"]);
    let p = a.connect("srv", Some(&b.address())).unwrap();
    for garbage in
        [&b"XXXXXXXXXXXXXXXX"[..], &[b'M', b'C', 11, 0, 255, 255, 255, 255], &[b'M', b'C', 10, 0, 3, 0, 0, 0, 1, 2, 3]]
    {
        let mut s = handshaken(&b.address());
        s.write_all(garbage).unwrap();
        let mut buf = [0u8; 16];
        use std::io::Read;
        assert_eq!(s.read(&mut buf).unwrap_or(0), 0, "server closed the bad connection");
    }
    assert_eq!(b.stats().bad_frames, 3);
    roundtrip(&a, &b, &p, 5000);
}

#[test]
fn silent_peer_times_out_and_cancel_ends_requests() {
    // A "peer" that completes the handshake and then never answers.
    let (addr, t) = mute_peer();
    let a = engine("cli", &["tcp"]);
    let p = a.connect("mute", Some(&addr)).unwrap();
    let l = a.allocate(1 << 16, false).unwrap().id;
    let t0 = Instant::now();
    let batch = a.submit(vec![req(Op::Read, l, 0, &p, 1, 0, 100)], Duration::from_millis(300)).unwrap();
    assert_eq!(batch.wait(Some(Duration::from_millis(10)))[0], RequestStatus::Pending);
    let st = batch.wait(None);
    assert_eq!(st[0].error(), Some(&TransferError::Timeout));
    assert!(t0.elapsed() < Duration::from_secs(5));
    let b2 = a.submit(vec![req(Op::Read, l, 0, &p, 1, 0, 100)], T).unwrap();
    b2.cancel();
    assert_eq!(b2.wait(None)[0].error(), Some(&TransferError::Cancelled));
    t.join().unwrap();
    // The mute peer has gone: its connection ends and new batches fail fast.
    let t0 = Instant::now();
    let st = a.submit(vec![req(Op::Read, l, 0, &p, 1, 0, 100)], T).unwrap().wait(None);
    assert_eq!(st[0].error().map(|e| e.code()), Some("connection_lost"));
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn dead_server_fails_batches_fast() {
    let b = engine("srv", &["tcp"]);
    let a = engine("cli", &["tcp"]);
    let p = a.connect("srv", Some(&b.address())).unwrap();
    let rb = b.allocate(64 << 20, false).unwrap().id;
    let l = a.allocate(64 << 20, false).unwrap().id;
    let batch = a.submit((0..16).map(|i| req(Op::Write, l, i << 22, &p, rb, i << 22, 4 << 20)).collect(), T).unwrap();
    b.close();
    let t0 = Instant::now();
    let st = batch.wait(None);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(st.iter().all(|s| s.is_finished()));
    let st = a.submit(vec![req(Op::Write, l, 0, &p, rb, 0, 10)], T).unwrap().wait(None);
    assert!(!st[0].is_ok());
}

fn arb_msg() -> impl Strategy<Value = Msg> {
    let name = "[a-z0-9./_-]{0,40}";
    let status = prop_oneof![
        Just(Ok(())),
        Just(Err(AccessError::NoSuchRegion)),
        Just(Err(AccessError::OutOfBounds)),
        Just(Err(AccessError::ReadOnly)),
        Just(Err(AccessError::TooLarge)),
        Just(Err(AccessError::NoGrant)),
    ];
    prop_oneof![
        (any::<u16>(), any::<[u8; 32]>(), name, any::<u8>())
            .prop_map(|(version, nonce, name, protection)| Msg::Hello { version, nonce, name, protection }),
        (any::<u16>(), any::<bool>(), any::<[u8; 32]>(), any::<[u8; 16]>(), name)
            .prop_map(|(version, auth, nonce, host, name)| Msg::Challenge { version, auth, nonce, host, name }),
        any::<[u8; 32]>().prop_map(|mac| Msg::Proof { mac }),
        any::<[u8; 32]>().prop_map(|mac| Msg::Welcome { mac }),
        name.prop_map(|reason| Msg::Refused { reason }),
        any::<[u64; 4]>().prop_map(|[id, region, offset, len]| Msg::ReadReq { id, region, offset, len }),
        (any::<[u64; 3]>(), 0usize..64).prop_map(|([id, region, offset], data_len)| Msg::WriteReq {
            id,
            region,
            offset,
            data_len
        }),
        any::<[u64; 2]>().prop_map(|[id, region]| Msg::QueryRegion { id, region }),
        (any::<u64>(), status.clone(), 0usize..64).prop_map(|(id, status, n)| Msg::ReadResp {
            id,
            status,
            data_len: if status.is_ok() { n } else { 0 }
        }),
        (any::<u64>(), status.clone()).prop_map(|(id, status)| Msg::WriteResp { id, status }),
        (any::<u64>(), status, any::<u64>(), any::<bool>(), proptest::option::of("[a-z/.]{1,30}"))
            .prop_map(|(id, status, len, readonly, shm)| Msg::RegionInfo { id, status, len, readonly, shm }),
    ]
}

fn payload_len(m: &Msg) -> usize {
    match m {
        Msg::WriteReq { data_len, .. } | Msg::ReadResp { data_len, .. } => *data_len,
        _ => 0,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn frames_roundtrip_and_every_prefix_is_incomplete(m in arb_msg()) {
        let mut buf = encode(&m);
        buf.extend(std::iter::repeat_n(0xAB, payload_len(&m)));
        let (back, payload, used) = decode_frame(&buf).unwrap().unwrap();
        prop_assert_eq!(&back, &m);
        prop_assert_eq!(payload.len(), payload_len(&m));
        prop_assert_eq!(used, buf.len());
        for cut in 0..buf.len() {
            prop_assert!(matches!(decode_frame(&buf[..cut]), Ok(None)));
        }
    }

    #[test]
    fn decoder_survives_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = decode_frame(&bytes);
    }

    #[test]
    fn decoder_survives_mutated_frames(m in arb_msg(), flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6)) {
        let mut buf = encode(&m);
        buf.extend(std::iter::repeat_n(0, payload_len(&m)));
        for (pos, val) in flips {
            let i = pos % buf.len();
            buf[i] = val;
        }
        if let Ok(Some((_, payload, used))) = decode_frame(&buf) {
            prop_assert!(used <= buf.len());
            prop_assert!(payload.len() <= protocol::MAX_DATA);
        }
    }
}

#[test]
fn header_limits() {
    use protocol::{FrameError, Header};
    let big = Header::encode(protocol::Kind::Hello, 5000);
    assert!(matches!(Header::decode(&big), Err(FrameError::TooLong { .. })));
    let big = Header::encode(protocol::Kind::WriteReq, protocol::MAX_DATA + 25);
    assert!(matches!(Header::decode(&big), Err(FrameError::TooLong { .. })));
    let short = Header::encode(protocol::Kind::WriteReq, 3);
    assert_eq!(Header::decode(&short), Err(FrameError::Malformed));
    // the fuzz corpus in the repository decodes without panicking
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/frame");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let _ = decode_frame(&std::fs::read(e.path()).unwrap());
        n += 1;
    }
    assert!(n >= 4, "corpus at {dir:?}");
}

/// A peer that answers every read `delay` late with `fill` bytes.
fn late_peer(delay: Duration, fill: u8) -> (String, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        tcp::handshake::server(&mut s, None, [0; 16], "late").ok().unwrap();
        let mut r = s.try_clone().unwrap();
        while let Ok(Some(h)) = tcp::read_header(&mut r) {
            let Ok(Msg::ReadReq { id, len, .. }) = tcp::read_msg_body(&mut r, h) else { return };
            std::thread::sleep(delay);
            let head = encode(&Msg::ReadResp { id, status: Ok(()), data_len: len as usize });
            if tcp::seal::FrameWriter::new(&s, None).send(&head, &vec![fill; len as usize]).is_err() {
                return;
            }
        }
    });
    (addr, t)
}

// Issue 17 item 2: a reply that comes after the batch timed out used to be received into
// the caller's buffer, which the caller had been told was free again.
#[test]
fn a_late_reply_never_lands_after_the_batch_timed_out() {
    let (addr, t) = late_peer(Duration::from_millis(900), 0xAB);
    let a = engine("cli", &["tcp"]);
    let p = a.connect("late", Some(&addr)).unwrap();
    let l = a.allocate(1 << 16, false).unwrap().id;
    let st = a.submit(vec![req(Op::Read, l, 0, &p, 1, 0, 1 << 16)], Duration::from_millis(300)).unwrap().wait(None);
    assert_eq!(st[0].error(), Some(&TransferError::Timeout));
    std::thread::sleep(Duration::from_millis(1500)); // the answer arrives meanwhile
    assert!(bytes(&a, l).iter().all(|&b| b == 0), "bytes landed after the batch reported timeout");
    assert!(a.stats().late_responses >= 1);
    // The connection is still usable: a batch with room for the delay completes.
    let st = a.submit(vec![req(Op::Read, l, 0, &p, 1, 0, 4096)], T).unwrap().wait(None);
    assert!(st[0].is_ok(), "{st:?}");
    assert!(bytes(&a, l)[..4096].iter().all(|&b| b == 0xAB));
    a.close();
    t.join().unwrap();
}

// Issue 17 item 8: remote_offset + length used to wrap past 2^64 on the TCP path, so a
// refused request had already written its first slices at the region's offset 0; and a
// request that ran past the region's end wrote its in-bounds slices before failing.
#[test]
fn a_refused_request_moves_no_byte_on_any_path() {
    for transports in [&["local"][..], &["tcp"], &["shm", "tcp"]] {
        let reg = EngineRegistry::new();
        let b = Engine::new(cfg("srv", transports), Some(reg.clone())).unwrap();
        let a = Engine::new(cfg("cli", transports), Some(reg)).unwrap();
        let p = if transports == ["local"] {
            a.connect("srv", None).unwrap()
        } else {
            a.connect("srv", Some(&b.address())).unwrap()
        };
        let rb = b.allocate(4 << 20, false).unwrap().id;
        let l = a.allocate(4 << 20, false).unwrap().id;
        fill(&a, l, 7);
        let before = bytes(&b, rb);
        let wrap = u64::MAX - (1 << 20) + 1;
        let bad = vec![
            req(Op::Write, l, 0, &p, rb, wrap, 2 << 20),    // wraps past 2^64
            req(Op::Write, l, 0, &p, rb, 3 << 20, 2 << 20), // runs past the end
            req(Op::Write, l, 0, &p, rb, (4 << 20) + 1, 0), // empty, but out of bounds
        ];
        let st = a.submit(bad, T).unwrap().wait(None);
        for s in &st {
            assert_eq!(s.error().map(|e| e.code()), Some("out_of_bounds"), "{transports:?}: {st:?}");
        }
        assert!(bytes(&b, rb) == before, "{transports:?}: a refused request wrote into the peer's region");
        a.close();
        b.close();
    }
}

#[test]
fn spans_pair_the_offsets_and_move_like_single_requests() {
    let reg = EngineRegistry::new();
    let a = Engine::new(cfg("a", &["local"]), Some(reg.clone())).unwrap();
    let b = Engine::new(cfg("b", &["local"]), Some(reg)).unwrap();
    let (l, r) = (a.allocate(4096, false).unwrap().id, b.allocate(4096, false).unwrap().id);
    let remote = fill(&b, r, 7);
    let p = a.connect("b", None).unwrap();
    let template = req(Op::Read, l, 0, &p, r, 0, 16);
    let reqs = Request::spans(&template, &[0, 100, 32], &[64, 0, 4000]).unwrap();
    assert_eq!(
        reqs.iter().map(|q| (q.local_offset, q.remote_offset, q.length)).collect::<Vec<_>>(),
        vec![(0, 64, 16), (100, 0, 16), (32, 4000, 16)]
    );
    assert!(a.submit(reqs, T).unwrap().wait(None).iter().all(RequestStatus::is_ok));
    let local = bytes(&a, l);
    for (lo, ro) in [(0, 64), (100, 0), (32, 4000)] {
        assert_eq!(local[lo..lo + 16], remote[ro..ro + 16]);
    }
    let e = Request::spans(&template, &[0, 1], &[0]).unwrap_err();
    assert_eq!(e.0, "local_offsets has 2 entries, remote_offsets 1: one each per request");
    assert!(Request::spans(&template, &[], &[]).unwrap().is_empty());
}
