//! The staged path (issue 26): writes from a same-host peer into a restricted region go
//! through a staging buffer the region's server handed over as an fd, each chunk checked
//! against the live grants before it lands; the peer never maps the region.

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::Arc;

use hashbrown::HashMap;

use super::auth::{host_id, AuthKey};
use super::config::Counters;
use super::fdpass;
use super::inner::PeerKind;
use super::region::RegionTable;
use super::staged::StagedLink;
use super::staged_server::{
    StagingServer, CHUNK_ENTRY_LEN, COMMIT_HEAD_LEN, MAX_COMMIT_CHUNKS, REPLY_HEAD_LEN, STAGING_LEN,
};
use super::tcp::server::ServeCtx;
use super::tests::{bytes, cfg, fill, req, T};
use super::*;

const TOKEN: &str = "cluster-token";

fn engine(name: &str) -> Engine {
    let mut c = cfg(name, &["shm", "tcp"]);
    c.auth_token = Some(TOKEN.into());
    // No registry: the engines reach each other as same-host peers, not in-process.
    Engine::new(c, None).unwrap()
}

fn code(st: &RequestStatus) -> &'static str {
    st.error().map_or("ok", |e| e.code())
}

fn write(a: &Engine, l: RegionId, lo: u64, p: &Arc<Peer>, rb: RegionId, off: u64, len: u64) -> &'static str {
    let st = a.submit(vec![req(Op::Write, l, lo, p, rb, off, len)], T).unwrap().wait(None);
    code(&st[0])
}

fn links(p: &Peer) -> Vec<Arc<StagedLink>> {
    match &p.kind {
        PeerKind::Remote { shm: Some(s), .. } => s.links(),
        _ => Vec::new(),
    }
}

fn shm_entries(part: &str) -> usize {
    std::fs::read_dir("/dev/shm")
        .map_or(0, |d| d.flatten().filter(|e| e.file_name().to_string_lossy().contains(part)).count())
}

#[test]
fn restricted_writes_from_a_same_host_peer_are_staged_checked_and_equal() {
    let decode = engine("decode-0");
    let prefill = engine("prefill-0");
    let other = engine("prefill-1");
    let p = prefill.connect("decode-0", Some(&decode.address())).unwrap();
    let q = other.connect("decode-0", Some(&decode.address())).unwrap();
    assert_eq!(p.transport(), "shm");
    let arena_len = 24 << 20;
    let arena = decode.allocate_with(arena_len, Access { restricted: true, ..Access::default() }).unwrap().id;
    let before = fill(&decode, arena, 1);
    let l = prefill.allocate(16 << 20, false).unwrap().id;
    let src = fill(&prefill, l, 2);

    // More than one staging chunk, odd length and offsets: lands whole and exact.
    let (off, len) = (4096u64, (11 << 20) + 12345u64);
    let g = decode.grant(arena, "prefill-0", off, len, true, None).unwrap();
    assert_eq!(write(&prefill, l, 100, &p, arena, off, len), "ok");
    assert_eq!(links(&p).len(), 1, "the write did not take the staged path");
    assert_eq!(decode.stats().bytes_staged, len, "the server did not copy the staged bytes");
    let after = bytes(&decode, arena);
    let (o, n) = (off as usize, len as usize);
    assert!(after[o..o + n] == src[100..100 + n], "staged bytes differ from the source");
    assert!(after[..o] == before[..o] && after[o + n..] == before[o + n..], "bytes outside the write changed");

    // Outside the grant, and after revoke: refused, nothing lands.
    assert_eq!(write(&prefill, l, 0, &p, arena, off + len - 10, 100), "no_grant");
    assert_eq!(decode.revoke(arena, "prefill-0", Some(g)).unwrap(), 1);
    let snapshot = bytes(&decode, arena);
    assert_eq!(write(&prefill, l, 0, &p, arena, off, 1 << 20), "no_grant", "a revoked grant still applied");
    assert!(bytes(&decode, arena) == snapshot, "a refused staged write landed");
    assert!(decode.stats().grant_refusals >= 2);

    // A later grant to another peer: its bytes never reach the first peer's buffer.
    let l2 = other.allocate(1 << 20, false).unwrap().id;
    let src2 = fill(&other, l2, 3);
    decode.grant(arena, "prefill-1", off, 1 << 20, true, None).unwrap();
    assert_eq!(write(&other, l2, 0, &q, arena, off, 1 << 20), "ok");
    assert!(bytes(&decode, arena)[o..o + (1 << 20)] == src2[..], "the second peer's write differs");
    let staging = links(&p)[0].staging_bytes();
    assert!(
        !staging.windows(64).any(|w| w == &src2[4096..4096 + 64]),
        "the first peer's buffer saw a later grant's data"
    );

    // Reads of a restricted region stay on TCP and are checked there.
    decode.grant(arena, "prefill-0", 0, 4096, false, None).unwrap();
    let st = prefill.submit(vec![req(Op::Read, l, 0, &p, arena, 0, 4096)], T).unwrap().wait(None);
    assert_eq!(code(&st[0]), "ok");
    assert!(bytes(&prefill, l)[..4096] == bytes(&decode, arena)[..4096]);

    // The staging buffers are memfds: nothing in /dev/shm.
    assert_eq!(shm_entries("stage"), 0);
}

fn server(regions: &Arc<RegionTable>, counters: &Arc<Counters>) -> StagingServer {
    StagingServer::start(ServeCtx {
        name: "srv".into(),
        regions: regions.clone(),
        key: Some(AuthKey::from_token(TOKEN)),
        peer_keys: HashMap::new(),
        host: host_id(),
        counters: counters.clone(),
        io_timeout: T,
        idle_timeout: T,
        share_shm: false,
        staging: None,
    })
    .unwrap()
}

/// A commit of `chunks` (region, offset, len, staging offset), framed by hand.
fn commit_many(s: &UnixStream, id: u64, count: u32, chunks: &[(u64, u64, u64, u64)]) {
    let mut c = Vec::with_capacity(COMMIT_HEAD_LEN + chunks.len() * CHUNK_ENTRY_LEN);
    c.extend_from_slice(&id.to_le_bytes());
    c.extend_from_slice(&count.to_le_bytes());
    c.extend_from_slice(&0u32.to_le_bytes());
    for &(region, offset, len, at) in chunks {
        for v in [region, offset, len, at] {
            c.extend_from_slice(&v.to_le_bytes());
        }
    }
    (&*s).write_all(&c).unwrap();
}

fn commit(s: &UnixStream, id: u64, region: u64, offset: u64, len: u64, at: u64) {
    commit_many(s, id, 1, &[(region, offset, len, at)]);
}

/// The answer to a commit of `n` chunks: its id and one status byte a chunk.
fn read_replies(s: &UnixStream, n: usize) -> std::io::Result<(u64, Vec<u8>)> {
    let mut r = vec![0u8; REPLY_HEAD_LEN + n];
    (&*s).read_exact(&mut r)?;
    assert_eq!(u32::from_le_bytes(r[8..12].try_into().unwrap()) as usize, n);
    Ok((u64::from_le_bytes(r[..8].try_into().unwrap()), r[REPLY_HEAD_LEN..].to_vec()))
}

#[test]
fn the_staging_socket_checks_token_grant_and_buffer_bounds() {
    let regions = Arc::new(RegionTable::default());
    let counters = Arc::new(Counters::default());
    let mem = Arc::new(crate::mem::MappedMemory::shared(1 << 16).unwrap());
    let region = regions.register_mapped(mem, Access { restricted: true, ..Access::default() });
    let srv = server(&regions, &counters);

    // A wrong token gets no buffer.
    let wrong = StagedLink::connect(srv.name(), Some(&AuthKey::from_token("wrong")), "x", T);
    assert!(matches!(wrong, Err(TransferError::Unauthorized(_))), "{:?}", wrong.err());

    // By hand: the right token, then commits.
    let addr = SocketAddr::from_abstract_name(srv.name().as_bytes()).unwrap();
    let mut s = UnixStream::connect_addr(&addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    super::tcp::handshake::client(&mut s, Some(&AuthKey::from_token(TOKEN)), "x").unwrap();
    let mut len = [0u8; 8];
    let fd = fdpass::recv_with_fd(&s, &mut len).unwrap();
    assert_eq!(u64::from_le_bytes(len) as usize, STAGING_LEN);
    let staging = crate::mem::MappedMemory::map_fd(std::os::fd::AsFd::as_fd(&fd), STAGING_LEN).unwrap();
    // SAFETY: 100 bytes inside our mapping of the staging buffer.
    unsafe { std::ptr::write_bytes(staging.as_ptr(), 0xAB, 100) };
    let read_reply = |s: &UnixStream| read_replies(s, 1).map(|(_, st)| st[0]);
    // No grant yet: refused, nothing lands.
    commit(&s, 1, region.id, 0, 100, 0);
    assert_ne!(read_reply(&s).unwrap(), 0);
    // SAFETY: reading 100 bytes of the 64 KiB region.
    let landed = || unsafe { std::slice::from_raw_parts(region.ptr(), 100) }.to_vec();
    assert!(landed().iter().all(|&b| b == 0));
    region.grant(regions.next_grant_id(), "x", 0, 100, true, None).unwrap();
    commit(&s, 2, region.id, 0, 100, 0);
    assert_eq!(read_reply(&s).unwrap(), 0);
    assert!(landed().iter().all(|&b| b == 0xAB));
    // A commit reaching past the staging buffer closes the connection, lands nothing.
    region.grant(regions.next_grant_id(), "x", 0, 1 << 16, true, None).unwrap();
    commit(&s, 3, region.id, 0, 200, STAGING_LEN as u64 - 100);
    assert!(read_reply(&s).is_err(), "the server answered a commit outside the buffer");
    assert_eq!(counters.bad_frames.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(counters.grant_refusals.load(std::sync::atomic::Ordering::Relaxed), 1);
    srv.close();
}

// Many small writes in one batch (serving writes a span per layer): more commits than
// may be in flight at once, chunks wrapping around the staging ring, mixed with large
// ones; every byte lands where it should.
#[test]
fn a_batch_of_many_small_and_large_staged_writes_lands_exactly() {
    let decode = engine("decode-0");
    let prefill = engine("prefill-0");
    let p = prefill.connect("decode-0", Some(&decode.address())).unwrap();
    let len = 40 << 20;
    let arena = decode.allocate_with(len, Access { restricted: true, ..Access::default() }).unwrap().id;
    decode.grant(arena, "prefill-0", 0, len as u64, true, None).unwrap();
    let l = prefill.allocate(len, false).unwrap().id;
    let src = fill(&prefill, l, 7);
    let mut reqs = Vec::new();
    let mut at = 0u64;
    let mut k = 0u64;
    while at < len as u64 {
        // 600 writes of 4 KiB + 77 B, then a few of 3 MiB + 1, and so on.
        let n = if k % 601 < 600 { 4096 + 77 } else { (3 << 20) + 1 };
        let n = n.min(len as u64 - at);
        reqs.push(req(Op::Write, l, at, &p, arena, at, n));
        at += n;
        k += 1;
    }
    assert!(reqs.len() > 600);
    let st = prefill.submit(reqs, T).unwrap().wait(None);
    assert!(st.iter().all(|s| s.is_ok()), "{:?}", st.iter().find(|s| !s.is_ok()));
    assert_eq!(decode.stats().bytes_staged, len as u64);
    assert!(bytes(&decode, arena) == src, "staged bytes differ");
}

// One commit carries many chunks (a serving step's spans): each chunk is checked and
// answered on its own, a refused one lands nothing while its neighbours land; a malformed
// commit (no chunks, too many, a chunk past the buffer) closes the connection before any
// of its chunks lands.
#[test]
fn a_commit_of_many_chunks_is_checked_and_answered_chunk_by_chunk() {
    let regions = Arc::new(RegionTable::default());
    let counters = Arc::new(Counters::default());
    let mem = Arc::new(crate::mem::MappedMemory::shared(1 << 16).unwrap());
    let region = regions.register_mapped(mem, Access { restricted: true, ..Access::default() });
    region.grant(regions.next_grant_id(), "x", 0, 3000, true, None).unwrap();
    region.grant(regions.next_grant_id(), "x", 8000, 1000, true, None).unwrap();
    let srv = server(&regions, &counters);
    let open = || {
        let addr = SocketAddr::from_abstract_name(srv.name().as_bytes()).unwrap();
        let mut s = UnixStream::connect_addr(&addr).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        super::tcp::handshake::client(&mut s, Some(&AuthKey::from_token(TOKEN)), "x").unwrap();
        let mut len = [0u8; 8];
        let fd = fdpass::recv_with_fd(&s, &mut len).unwrap();
        let staging = crate::mem::MappedMemory::map_fd(std::os::fd::AsFd::as_fd(&fd), STAGING_LEN).unwrap();
        for k in 0..4u8 {
            // SAFETY: 1000 bytes at k * 1000 inside our mapping of the staging buffer.
            unsafe { std::ptr::write_bytes(staging.as_ptr().add(k as usize * 1000), 0xA0 + k, 1000) };
        }
        (s, staging)
    };
    // SAFETY: reading the 64 KiB region after the answers came.
    let landed = || unsafe { std::slice::from_raw_parts(region.ptr(), 1 << 16) }.to_vec();
    let (s, _staging) = open();
    // Inside, straddling the first grant's end, inside the second, in no grant.
    let chunks = [
        (region.id, 0, 1000, 0),
        (region.id, 2500, 1000, 1000),
        (region.id, 8000, 1000, 2000),
        (region.id, 5000, 1000, 3000),
    ];
    commit_many(&s, 7, 4, &chunks);
    let (id, st) = read_replies(&s, 4).unwrap();
    assert_eq!(id, 7);
    assert_eq!(st[0], 0);
    assert_ne!(st[1], 0, "a chunk past its grant was accepted");
    assert_eq!(st[2], 0);
    assert_ne!(st[3], 0, "a chunk outside every grant was accepted");
    let after = landed();
    assert!(after[..1000].iter().all(|&b| b == 0xA0));
    assert!(after[1000..8000].iter().all(|&b| b == 0), "a refused chunk landed");
    assert!(after[8000..9000].iter().all(|&b| b == 0xA2));
    assert_eq!(counters.grant_refusals.load(std::sync::atomic::Ordering::Relaxed), 2);

    // A chunk past the buffer among good ones: closed, none of the commit lands.
    let before = landed();
    let (s, _staging) = open();
    commit_many(&s, 1, 2, &[(region.id, 0, 1000, 1000), (region.id, 0, 200, STAGING_LEN as u64 - 100)]);
    assert!(read_replies(&s, 2).is_err(), "the server answered a commit with a chunk outside the buffer");
    assert!(landed() == before, "a chunk of a commit outside the buffer landed");
    // No chunks, and more than a commit may carry: closed.
    for count in [0u32, MAX_COMMIT_CHUNKS as u32 + 1] {
        let (s, _staging) = open();
        commit_many(&s, 1, count, &[]);
        let mut r = [0u8; 1];
        assert!(!matches!((&s).read(&mut r), Ok(1)), "a commit of {count} chunks was answered");
    }
    assert_eq!(counters.bad_frames.load(std::sync::atomic::Ordering::Relaxed), 3);
    srv.close();
}

/// Two batches of restricted writes (in the grants, past one, in none, several chunks
/// long), a small one (which the staged path commits inside `submit`) and a large one
/// (which its worker sends), between two fresh engines on `transports`: each request's
/// code, the arena's bytes after, the bytes the server took through staging buffers,
/// and the commits sent from `submit`.
fn grant_batch(transports: &[&str]) -> (Vec<&'static str>, Vec<u8>, u64, u64) {
    let engine_on = |name: &str| {
        let mut c = cfg(name, transports);
        c.auth_token = Some(TOKEN.into());
        Engine::new(c, None).unwrap()
    };
    let (decode, prefill) = (engine_on("decode-0"), engine_on("prefill-0"));
    let p = prefill.connect("decode-0", Some(&decode.address())).unwrap();
    let len = 12u64 << 20;
    let arena = decode.allocate_with(len as usize, Access { restricted: true, ..Access::default() }).unwrap().id;
    fill(&decode, arena, 1);
    decode.grant(arena, "prefill-0", 0, 4 << 20, true, None).unwrap();
    decode.grant(arena, "prefill-0", 6 << 20, (6 << 20) - 1000, true, None).unwrap();
    let l = prefill.allocate(len as usize, false).unwrap().id;
    fill(&prefill, l, 5);
    // The first write finds the region (and opens the link); the batch then goes out whole.
    assert_eq!(write(&prefill, l, 0, &p, arena, 0, 4096), "ok");
    // Its answer ends the batch just before the worker lets go of the ring: wait for that,
    // or the small batch below may (rightly) be queued for the worker instead.
    let until = std::time::Instant::now() + T;
    while !links(&p).iter().all(|l| l.is_idle()) && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let k = 128u64 << 10;
    let mut small: Vec<Request> =
        (0..6).map(|i| req(Op::Write, l, (7 << 20) + i * k, &p, arena, (11 << 18) + i * k, k)).collect();
    small.push(req(Op::Write, l, 0, &p, arena, (4 << 20) - 100, 4096)); // past the first grant
    small.push(req(Op::Write, l, 0, &p, arena, (5 << 20) + 8192, 4096)); // in no grant
    let mut codes: Vec<&'static str> = prefill.submit(small, T).unwrap().wait(None).iter().map(code).collect();
    let mut reqs: Vec<Request> = (0..20).map(|i| req(Op::Write, l, i * 3 * k, &p, arena, i * k + 7, k)).collect();
    reqs.push(req(Op::Write, l, 0, &p, arena, (4 << 20) - 4096, k)); // past the first grant
    reqs.push(req(Op::Write, l, 0, &p, arena, 5 << 20, 4096)); // in no grant
    reqs.push(req(Op::Write, l, 999, &p, arena, 6 << 20, (3 << 20) + 7)); // four chunks
    reqs.push(req(Op::Write, l, 0, &p, arena, len - 2000, 1500)); // past the second grant
    reqs.push(req(Op::Write, l, 0, &p, arena, len - 10, 100)); // past the region
    reqs.extend((0..8).map(|i| req(Op::Write, l, (i + 1) * k, &p, arena, (10 << 20) + i * k, k)));
    codes.extend(prefill.submit(reqs, T).unwrap().wait(None).iter().map(code));
    let inline = links(&p).iter().map(|l| l.inline_commits()).sum();
    (codes, bytes(&decode, arena), decode.stats().bytes_staged, inline)
}

// Commits of many chunks (the staged path), sent from `submit` or by the link's worker,
// against the simple path for restricted writes, TCP (each slice its own frame and
// answer): same codes, same bytes.
#[test]
fn batched_staged_commits_match_tcp_in_bytes_and_refusals() {
    let (staged_codes, staged_bytes, staged, inline) = grant_batch(&["shm", "tcp"]);
    let (tcp_codes, tcp_bytes, over_tcp, _) = grant_batch(&["tcp"]);
    assert!(staged > 0 && over_tcp == 0, "staged {staged} bytes, over TCP {over_tcp}");
    assert!(inline >= 1, "the small batch was not committed inside submit");
    assert_eq!(staged_codes, tcp_codes);
    assert!(staged_codes.iter().filter(|c| **c == "ok").count() == 35, "{staged_codes:?}");
    assert!(staged_codes.contains(&"no_grant") && staged_codes.contains(&"out_of_bounds"), "{staged_codes:?}");
    let first_diff = staged_bytes.iter().zip(&tcp_bytes).position(|(a, b)| a != b);
    assert!(first_diff.is_none(), "the arena differs between the staged path and TCP from byte {first_diff:?}");
}
