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
use super::staged_server::{StagingServer, COMMIT_LEN, REPLY_LEN, STAGING_LEN};
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
    std::fs::read_dir("/dev/shm").map_or(0, |d| d.flatten().filter(|e| e.file_name().to_string_lossy().contains(part)).count())
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
    assert!(!staging.windows(64).any(|w| w == &src2[4096..4096 + 64]), "the first peer's buffer saw a later grant's data");

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

fn commit(s: &UnixStream, id: u64, region: u64, offset: u64, len: u64, at: u64) {
    let mut c = [0u8; COMMIT_LEN];
    for (i, v) in [id, region, offset, len, at].into_iter().enumerate() {
        c[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    (&*s).write_all(&c).unwrap();
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
    let read_reply = |s: &UnixStream| {
        let mut r = [0u8; REPLY_LEN];
        (&*s).read_exact(&mut r).map(|()| r[8])
    };
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
