//! The staged path (issue 26): writes from a same-host peer into a restricted region, and
//! reads from it, go through a staging buffer the region's server handed over as an fd,
//! each chunk checked against the live grants before it moves; the peer never maps the
//! region.

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::Arc;

use hashbrown::HashMap;

use super::auth::{host_id, AuthKey};
use super::config::{Counters, StagedCopy};
use super::fdpass;
use super::inner::PeerKind;
use super::region::RegionTable;
use super::staged::StagedLink;
use super::staged_server::{
    mode_request, StagingServer, CHUNK_ENTRY_LEN, COMMIT_HEAD_LEN, COMMIT_READ, MAX_COMMIT_CHUNKS, REPLY_HEAD_LEN,
    STAGING_LEN,
};
use super::tcp::server::ServeCtx;
use super::tests::{bytes, cfg, fill, req, T};
use super::*;

const TOKEN: &str = "cluster-token";

pub(super) fn engine(name: &str) -> Engine {
    engine_copying(name, StagedCopy::from_env())
}

/// `engine`, whose staging links ask for `copy` (one copy by the server, or two through
/// the staging buffer).
pub(super) fn engine_copying(name: &str, copy: StagedCopy) -> Engine {
    let mut c = cfg(name, &["shm", "tcp"]);
    c.auth_token = Some(TOKEN.into());
    c.staged_copy = copy;
    // No registry: the engines reach each other as same-host peers, not in-process.
    Engine::new(c, None).unwrap()
}

pub(super) fn code(st: &RequestStatus) -> &'static str {
    st.error().map_or("ok", |e| e.code())
}

fn write(a: &Engine, l: RegionId, lo: u64, p: &Arc<Peer>, rb: RegionId, off: u64, len: u64) -> &'static str {
    let st = a.submit(vec![req(Op::Write, l, lo, p, rb, off, len)], T).unwrap().wait(None);
    code(&st[0])
}

pub(super) fn links(p: &Peer) -> Vec<Arc<StagedLink>> {
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

    // Reads of a restricted region are staged too, and checked by the server.
    decode.grant(arena, "prefill-0", 0, 4096, false, None).unwrap();
    let st = prefill.submit(vec![req(Op::Read, l, 0, &p, arena, 0, 4096)], T).unwrap().wait(None);
    assert_eq!(code(&st[0]), "ok");
    assert!(bytes(&prefill, l)[..4096] == bytes(&decode, arena)[..4096]);
    assert_eq!(decode.stats().bytes_staged_read, 4096, "the read did not take the staged path");
    assert_eq!(links(&p).len(), 1, "the read opened a second link");

    // The staging buffers are memfds: nothing in /dev/shm.
    assert_eq!(shm_entries("stage"), 0);
}

/// Connects to `srv` as engine "x" with the token, as a staging link does, checks the
/// length it announces, maps the staging buffer it hands over and asks for the staging
/// mode (two copies).
fn dial(srv: &StagingServer) -> (UnixStream, crate::mem::MappedMemory) {
    let (s, staging) = dial_buffer(srv);
    (&s).write_all(&mode_request(false, 0, &[0u8; 16])).unwrap();
    let mut mode = [9u8; 1];
    (&s).read_exact(&mut mode).unwrap();
    assert_eq!(mode[0], 0, "the server took a staging-mode peer for one-copy");
    (s, staging)
}

/// `dial` up to the mode request.
pub(super) fn dial_buffer(srv: &StagingServer) -> (UnixStream, crate::mem::MappedMemory) {
    let addr = SocketAddr::from_abstract_name(srv.name().as_bytes()).unwrap();
    let mut s = UnixStream::connect_addr(&addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    super::tcp::handshake::client(&mut s, Some(&AuthKey::from_token(TOKEN)), "x").unwrap();
    let mut len = [0u8; 8];
    let fd = fdpass::recv_with_fd(&s, &mut len).unwrap();
    assert_eq!(u64::from_le_bytes(len) as usize, STAGING_LEN, "the buffer's length the server sent");
    let staging = crate::mem::MappedMemory::map_fd(std::os::fd::AsFd::as_fd(&fd), STAGING_LEN).unwrap();
    (s, staging)
}

pub(super) fn server(regions: &Arc<RegionTable>, counters: &Arc<Counters>) -> StagingServer {
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
pub(super) fn read_replies(s: &UnixStream, n: usize) -> std::io::Result<(u64, Vec<u8>)> {
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
    let wrong = StagedLink::connect(srv.name(), Some(&AuthKey::from_token("wrong")), "x", T, StagedCopy::Direct);
    assert!(matches!(wrong, Err(TransferError::Unauthorized(_))), "{:?}", wrong.err());

    // By hand: the right token, then commits.
    let (s, staging) = dial(&srv);
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
        let (s, staging) = dial(&srv);
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

/// Two fresh engines on `transports` with the token, the prefill connected to the decode,
/// and a 12 MiB restricted arena on the decode (filled with pattern 1) that the prefill
/// may reach in two grants (`write` or read-only): `0..4 MiB` and `6 MiB..12 MiB - 1000`.
pub(super) struct GrantedPair {
    pub(super) decode: Engine,
    pub(super) prefill: Engine,
    pub(super) p: Arc<Peer>,
    pub(super) arena: u64,
    pub(super) len: u64,
    pub(super) arena_bytes: Vec<u8>,
}

pub(super) fn granted_pair(transports: &[&str], write: bool) -> GrantedPair {
    let engine_on = |name: &str| {
        let mut c = cfg(name, transports);
        c.auth_token = Some(TOKEN.into());
        Engine::new(c, None).unwrap()
    };
    let (decode, prefill) = (engine_on("decode-0"), engine_on("prefill-0"));
    let p = prefill.connect("decode-0", Some(&decode.address())).unwrap();
    let len = 12u64 << 20;
    let arena = decode.allocate_with(len as usize, Access { restricted: true, ..Access::default() }).unwrap().id;
    let arena_bytes = fill(&decode, arena, 1);
    decode.grant(arena, "prefill-0", 0, 4 << 20, write, None).unwrap();
    decode.grant(arena, "prefill-0", 6 << 20, (6 << 20) - 1000, write, None).unwrap();
    GrantedPair { decode, prefill, p, arena, len, arena_bytes }
}

/// Waits (bounded) until every staging link of `p` has let go of its ring, so that the
/// next small batch is committed from `submit` rather than queued for the worker.
pub(super) fn wait_links_idle(p: &Arc<Peer>) {
    let until = std::time::Instant::now() + T;
    while !links(p).iter().all(|l| l.is_idle()) && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Two batches of restricted writes (in the grants, past one, in none, several chunks
/// long), a small one (which the staged path commits inside `submit`) and a large one
/// (which its worker sends), between two fresh engines on `transports`: each request's
/// code, the arena's bytes after, the bytes the server took through staging buffers,
/// and the commits sent from `submit`.
fn grant_batch(transports: &[&str]) -> (Vec<&'static str>, Vec<u8>, u64, u64) {
    let GrantedPair { decode, prefill, p, arena, len, .. } = granted_pair(transports, true);
    let l = prefill.allocate(len as usize, false).unwrap().id;
    fill(&prefill, l, 5);
    // The first write finds the region (and opens the link); the batch then goes out whole.
    assert_eq!(write(&prefill, l, 0, &p, arena, 0, 4096), "ok");
    // Its answer ends the batch just before the worker lets go of the ring: wait for that,
    // or the small batch below may (rightly) be queued for the worker instead.
    wait_links_idle(&p);
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

/// What `read_batch` saw: each request's (local offset, remote offset, length) and code,
/// the local region after (every failed request's destination masked to 0: a failed read
/// may have landed part of its bytes, on either path), the reference the reads must
/// leave (each ok request's bytes copied from the arena into the region as filled, failed
/// destinations masked), the bytes the server copied out through staging buffers, and
/// the commits sent from `submit`.
struct ReadRun {
    reqs: Vec<(u64, u64, u64)>,
    codes: Vec<&'static str>,
    got: Vec<u8>,
    want: Vec<u8>,
    staged_read: u64,
    inline: u64,
}

/// Reads of a restricted region between two fresh engines on `transports`: one that
/// opens the path, a small batch (committed inside `submit` on the staged path) and a
/// batch of random offsets and lengths around the chunk size, partly outside the grants,
/// one past the region.
fn read_batch(transports: &[&str], seed: u64) -> ReadRun {
    use rand::{Rng, SeedableRng};
    let GrantedPair { decode, prefill, p, arena, len, arena_bytes } = granted_pair(transports, false);
    let local_len = 64usize << 20;
    let l = prefill.allocate(local_len, false).unwrap().id;
    let mut want = fill(&prefill, l, 5);
    let mut all = vec![(0u64, 0u64, 4096u64)];
    // The first read finds the region (and opens the link); then wait until the worker
    // lets go of the ring, so the small batch below is committed from `submit`.
    let st = prefill.submit(vec![req(Op::Read, l, 0, &p, arena, 0, 4096)], T).unwrap().wait(None);
    let mut codes = vec![code(&st[0])];
    wait_links_idle(&p);
    let k = 128u64 << 10;
    let mut small: Vec<(u64, u64, u64)> = (0..6).map(|i| (4096 + i * k, i * k + 3, k)).collect();
    small.push((1 << 20, (4 << 20) - 100, 4096)); // past the first grant
    small.push(((1 << 20) + 8192, (5 << 20) + 8192, 4096)); // in no grant

    // Random reads, each into its own part of the local region (from 2 MiB on).
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let chunk = 1u64 << 20;
    let mut large = Vec::new();
    let mut lo = 2u64 << 20;
    for i in 0..40 {
        let n = match i % 4 {
            0 => rng.gen_range(1..3 * chunk),
            1 => chunk * rng.gen_range(1..3u64) + rng.gen_range(0..3) - 1, // around a chunk boundary
            2 => rng.gen_range(1..8192),
            _ => rng.gen_range(chunk / 2..chunk + chunk / 2),
        };
        large.push((lo, rng.gen_range(0..len - n), n));
        lo += n + rng.gen_range(0..100);
    }
    large.push((lo, 6 << 20, (3 << 20) + 7)); // four chunks, granted
    large.push((lo + (4 << 20), len - 10, 100)); // past the region
    assert!(lo + (4 << 20) + 100 <= local_len as u64);
    for batch in [small, large] {
        let reqs = batch.iter().map(|&(lo, ro, n)| req(Op::Read, l, lo, &p, arena, ro, n)).collect();
        codes.extend(prefill.submit(reqs, T).unwrap().wait(None).iter().map(code));
        all.extend(batch);
    }
    let mut got = bytes(&prefill, l);
    for (&(lo, ro, n), c) in all.iter().zip(&codes) {
        let (lo, ro, n) = (lo as usize, ro as usize, n as usize);
        if *c == "ok" {
            want[lo..lo + n].copy_from_slice(&arena_bytes[ro..ro + n]);
        } else {
            got[lo..lo + n].fill(0);
            want[lo..lo + n].fill(0);
        }
    }
    let inline = links(&p).iter().map(|l| l.inline_commits()).sum();
    ReadRun { reqs: all, codes, got, want, staged_read: decode.stats().bytes_staged_read, inline }
}

// Staged reads (commits of many chunks, sent from `submit` or by the link's worker)
// against TCP and against a plain copy: same codes, the arena's bytes in every ok
// request's destination, nothing else touched.
#[test]
fn staged_reads_match_tcp_and_a_plain_copy() {
    for seed in [1u64, 2] {
        let staged = read_batch(&["shm", "tcp"], seed);
        let tcp = read_batch(&["tcp"], seed);
        assert!(
            staged.staged_read > 0 && tcp.staged_read == 0,
            "staged {} over TCP {}",
            staged.staged_read,
            tcp.staged_read
        );
        assert!(staged.inline >= 1, "the small batch was not committed inside submit");
        assert_eq!(staged.reqs, tcp.reqs);
        assert_eq!(staged.codes, tcp.codes, "seed {seed}");
        let ok = staged.codes.iter().filter(|c| **c == "ok").count();
        assert!(ok >= 8 && ok < staged.codes.len(), "seed {seed}: {:?}", staged.codes);
        assert!(staged.codes.contains(&"no_grant") && staged.codes.contains(&"out_of_bounds"), "{:?}", staged.codes);
        for (what, run) in [("staged", &staged), ("tcp", &tcp)] {
            let first_diff = run.got.iter().zip(&run.want).position(|(a, b)| a != b);
            assert!(first_diff.is_none(), "seed {seed}: {what} reads differ from a plain copy at byte {first_diff:?}");
        }
    }
}

/// A commit of `chunks` with op `op` in its head (framed by hand, as `commit_many`).
pub(super) fn commit_op(s: &UnixStream, id: u64, op: u32, chunks: &[(u64, u64, u64, u64)]) {
    let mut c = Vec::with_capacity(COMMIT_HEAD_LEN + chunks.len() * CHUNK_ENTRY_LEN);
    c.extend_from_slice(&id.to_le_bytes());
    c.extend_from_slice(&(chunks.len() as u32).to_le_bytes());
    c.extend_from_slice(&op.to_le_bytes());
    for &(region, offset, len, at) in chunks {
        for v in [region, offset, len, at] {
            c.extend_from_slice(&v.to_le_bytes());
        }
    }
    (&*s).write_all(&c).unwrap();
}

// A read commit, by hand: each chunk is checked against the live read grants before the
// server copies it out; a refused chunk (outside the grant, straddling its end, after
// revoke) puts nothing of the region in the buffer; a write grant does not cover reads
// of another range; an unknown op closes the connection.
#[test]
fn a_read_commit_is_checked_chunk_by_chunk_and_copies_only_granted_bytes() {
    let regions = Arc::new(RegionTable::default());
    let counters = Arc::new(Counters::default());
    let mem = Arc::new(crate::mem::MappedMemory::shared(1 << 16).unwrap());
    let region = regions.register_mapped(mem, Access { restricted: true, ..Access::default() });
    for (k, b) in [(0usize, 0x11u8), (1, 0x22), (2, 0x33), (3, 0x44)] {
        // SAFETY: 4096 bytes at k * 4096 inside the 64 KiB region, before any peer reads.
        unsafe { std::ptr::write_bytes(region.ptr().add(k * 4096), b, 4096) };
    }
    let g = regions.next_grant_id();
    region.grant(g, "x", 0, 6000, false, None).unwrap();
    let srv = server(&regions, &counters);
    let (s, staging) = dial(&srv);
    // SAFETY: the first 64 KiB of our mapping of the staging buffer, read between commits.
    let buf = || unsafe { std::slice::from_raw_parts(staging.as_ptr(), 1 << 16) }.to_vec();
    // Inside the grant, straddling its end, in no grant.
    commit_op(
        &s,
        1,
        COMMIT_READ,
        &[(region.id, 0, 4096, 0), (region.id, 4096, 4096, 8192), (region.id, 12288, 10, 16384)],
    );
    let (id, st) = read_replies(&s, 3).unwrap();
    assert_eq!(id, 1);
    assert_eq!(st[0], 0);
    assert_ne!(st[1], 0, "a read past its grant was accepted");
    assert_ne!(st[2], 0, "a read outside every grant was accepted");
    let b = buf();
    assert!(b[..4096].iter().all(|&x| x == 0x11), "the granted chunk was not copied out");
    assert!(b[4096..].iter().all(|&x| x == 0), "a refused chunk put region bytes in the buffer");
    assert_eq!(counters.bytes_staged_read.load(std::sync::atomic::Ordering::Relaxed), 4096);
    // Revoked: the next chunk is refused.
    assert_eq!(region.revoke("x", Some(g)), 1);
    commit_op(&s, 2, COMMIT_READ, &[(region.id, 0, 100, 20000)]);
    assert_ne!(read_replies(&s, 1).unwrap().1[0], 0, "a read after revoke was accepted");
    assert!(buf()[20000..20100].iter().all(|&x| x == 0));
    // A grant with write access covers reads too.
    region.grant(regions.next_grant_id(), "x", 8192, 4096, true, None).unwrap();
    commit_op(&s, 3, COMMIT_READ, &[(region.id, 8192, 4096, 24576)]);
    assert_eq!(read_replies(&s, 1).unwrap().1[0], 0);
    assert!(buf()[24576..28672].iter().all(|&x| x == 0x33));
    assert_eq!(counters.bytes_staged.load(std::sync::atomic::Ordering::Relaxed), 0, "a read counted as a write");
    // An op that is neither: closed, unanswered.
    commit_op(&s, 4, 7, &[(region.id, 8192, 10, 0)]);
    assert!(read_replies(&s, 1).is_err(), "a commit of an unknown op was answered");
    assert_eq!(counters.bad_frames.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(counters.grant_refusals.load(std::sync::atomic::Ordering::Relaxed), 3);
    srv.close();
}

/// Two same-host engines with a token, the reader's links asking for `copy`, and a
/// restricted arena of `len` bytes filled (seed 1) and granted whole to "prefill-0" for
/// reads; the reading engine's region of `len` bytes.
fn read_pair(len: usize, copy: StagedCopy) -> (Engine, Engine, Arc<Peer>, RegionId, Vec<u8>, RegionId) {
    let decode = engine("decode-0");
    let prefill = engine_copying("prefill-0", copy);
    let p = prefill.connect("decode-0", Some(&decode.address())).unwrap();
    let arena = decode.allocate_with(len, Access { restricted: true, ..Access::default() }).unwrap().id;
    let arena_bytes = fill(&decode, arena, 1);
    decode.grant(arena, "prefill-0", 0, len as u64, false, None).unwrap();
    let l = prefill.allocate(len, false).unwrap().id;
    (decode, prefill, p, arena, arena_bytes, l)
}

/// A batch that reads the arena `rounds` times over in 512 KiB requests (each round into
/// the same local bytes, so equal bytes whatever round landed last).
fn read_rounds(p: &Arc<Peer>, l: RegionId, arena: RegionId, len: u64, rounds: u64) -> Vec<Request> {
    let k = 512u64 << 10;
    (0..rounds * len / k).map(|i| req(Op::Read, l, (i * k) % len, p, arena, (i * k) % len, k)).collect()
}

/// Opens the staging link with one small read (so what the caller does next races the
/// batch, not the lookup), then submits 16 rounds of 512 KiB reads over the region and
/// returns once the server has copied out some of them (or the batch ended).
fn reads_under_way(
    decode: &Engine,
    prefill: &Engine,
    p: &Arc<Peer>,
    l: RegionId,
    arena: RegionId,
    len: u64,
) -> Arc<Batch> {
    let st = prefill.submit(vec![req(Op::Read, l, 0, p, arena, 0, 4096)], T).unwrap().wait(None);
    assert_eq!(code(&st[0]), "ok");
    assert_mode(p, prefill.config().staged_copy);
    let before = decode.stats().bytes_staged_read;
    let batch = prefill.submit(read_rounds(p, l, arena, len, 16), T).unwrap();
    while decode.stats().bytes_staged_read == before && !batch.is_done() {
        std::thread::yield_now();
    }
    batch
}

/// The staging links of `p` (at least one) copy as `copy` asked (this host allows one copy).
pub(super) fn assert_mode(p: &Arc<Peer>, copy: StagedCopy) {
    let direct: Vec<bool> = links(p).iter().map(|k| k.is_direct()).collect();
    assert!(!direct.is_empty() && direct.iter().all(|&d| d == (copy == StagedCopy::Direct)), "{copy:?}: {direct:?}");
}

// A grant revoked while a batch of staged reads is in flight, in one-copy mode and
// through the staging buffer: every request ends, ok ones hold the arena's bytes, the
// others are `no_grant`; the next batch is refused whole. (Whether a batch straddles the
// revoke is up to the scheduler: a few tries.)
#[test]
fn a_grant_revoked_mid_batch_refuses_the_following_staged_reads() {
    for copy in [StagedCopy::Direct, StagedCopy::Staging] {
        revoke_mid_read_batch(copy);
    }
}

fn revoke_mid_read_batch(copy: StagedCopy) {
    let len = 16usize << 20;
    let mut straddled = false;
    for _ in 0..5 {
        let (decode, prefill, p, arena, arena_bytes, l) = read_pair(len, copy);
        let batch = reads_under_way(&decode, &prefill, &p, l, arena, len as u64);
        decode.revoke(arena, "prefill-0", None).unwrap();
        let st = batch.wait(None);
        let codes: Vec<_> = st.iter().map(code).collect();
        assert!(codes.iter().all(|c| *c == "ok" || *c == "no_grant"), "{codes:?}");
        // Each 512 KiB slot of the local region that only ok reads wrote holds the arena's bytes.
        let k = 512usize << 10;
        assert_ok_slots_hold(&codes, &bytes(&prefill, l), &arena_bytes, k, |i| (i * k) % len / k);
        let after = prefill.submit(vec![req(Op::Read, l, 0, &p, arena, 0, 4096)], T).unwrap().wait(None);
        assert_eq!(code(&after[0]), "no_grant", "a read after revoke was not refused");
        if codes.contains(&"ok") && codes.contains(&"no_grant") {
            straddled = true;
            break;
        }
    }
    assert!(straddled, "{copy:?}: no batch of staged reads straddled the revoke in five tries");
}

/// Each `slot_len` slot of `got` into which every request was ok (`slot_of(i)`: the slot
/// request `i` wrote) holds `want`'s bytes there; a slot that a refused request also
/// wrote is not checked (a refused request may have landed part of its bytes).
pub(super) fn assert_ok_slots_hold(
    codes: &[&str],
    got: &[u8],
    want: &[u8],
    slot_len: usize,
    slot_of: impl Fn(usize) -> usize,
) {
    for slot in 0..got.len() / slot_len {
        let all_ok = codes.iter().enumerate().filter(|(i, _)| slot_of(*i) == slot).all(|(_, c)| *c == "ok");
        if all_ok {
            let r = slot * slot_len..(slot + 1) * slot_len;
            assert!(got[r.clone()] == want[r], "slot {slot} differs");
        }
    }
}

// The server engine goes away while staged reads are in flight (one copy, and through
// the staging buffer): every request ends (ok with the arena's bytes, or
// `connection_lost`/`closed`), none hangs, and a read after that fails rather than waiting.
#[test]
fn staged_reads_end_when_the_server_goes_away() {
    for copy in [StagedCopy::Direct, StagedCopy::Staging] {
        server_gone_mid_read_batch(copy);
    }
}

fn server_gone_mid_read_batch(copy: StagedCopy) {
    let len = 16usize << 20;
    let (decode, prefill, p, arena, arena_bytes, l) = read_pair(len, copy);
    let batch = reads_under_way(&decode, &prefill, &p, l, arena, len as u64);
    decode.close();
    let t0 = std::time::Instant::now();
    let st = batch.wait(None);
    assert!(t0.elapsed() < T, "the batch ended only by its timeout");
    let codes: Vec<_> = st.iter().map(code).collect();
    assert!(codes.iter().all(|c| matches!(*c, "ok" | "connection_lost" | "closed")), "{codes:?}");
    if codes.iter().all(|c| *c == "ok") {
        assert!(bytes(&prefill, l) == arena_bytes);
    }
    let after = prefill.submit(vec![req(Op::Read, l, 0, &p, arena, 0, 4096)], T).unwrap().wait(Some(T));
    assert!(after[0].error().is_some(), "a read from a closed server succeeded");
    assert_ne!(code(&after[0]), "timeout");
}
