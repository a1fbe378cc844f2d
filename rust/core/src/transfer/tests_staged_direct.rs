//! The staged path's one-copy mode (issue 26, `staged_direct`): the region's server copies
//! each granted chunk straight between the region and the peer's own memory. By hand on
//! the staging socket: who may ask for it (a proven process), per-chunk checks and a bad
//! peer address failing only its chunk. With a real peer process (a child running this
//! test binary): its bytes land whole, and a peer that dies in the middle of a batch
//! leaves a server that serves the next peer. Both modes against TCP and a plain copy are
//! in `tests_staged_pipeline.rs`; revoke and a server gone mid-batch in `tests_staged.rs`
//! and there (both run in whichever mode `MOONCAKE_STAGED_COPY` picks, one copy by default).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::config::{Counters, StagedCopy};
use super::region::RegionTable;
use super::staged_server::{mode_request, COMMIT_READ_DIRECT, COMMIT_WRITE, COMMIT_WRITE_DIRECT, STATUS_COPY_FAILED};
use super::tests::{bytes, fill, req, T};
use super::tests_staged::{code, commit_op, dial_buffer, engine_copying, links, read_replies, server};
use super::*;

/// Sends the mode request (one-copy or not, the probe address, the nonce) and reads the
/// answer: whether the server copies directly.
fn ask(s: &UnixStream, want: bool, probe: u64, nonce: &[u8; 16]) -> bool {
    (&*s).write_all(&mode_request(want, probe, nonce)).unwrap();
    let mut a = [9u8; 1];
    (&*s).read_exact(&mut a).unwrap();
    assert!(a[0] <= 1, "mode answer {}", a[0]);
    a[0] == 1
}

fn restricted(regions: &Arc<RegionTable>, len: usize) -> Arc<region::Region> {
    let mem = Arc::new(crate::mem::MappedMemory::shared(len).unwrap());
    regions.register_mapped(mem, Access { restricted: true, ..Access::default() })
}

// One-copy mode only for a process that proves it is the one at the socket's other end
// (the nonce at the address it named), and only when asked; one-copy commits on a
// connection that did not get it, and commits from a peer that sent no mode request (one
// from before it), close the connection before anything moves.
#[test]
fn one_copy_is_granted_only_to_a_proven_process_that_asks() {
    let regions = Arc::new(RegionTable::default());
    let counters = Arc::new(Counters::default());
    let region = restricted(&regions, 1 << 16);
    region.grant(regions.next_grant_id(), "x", 0, 1 << 16, true, None).unwrap();
    let srv = server(&regions, &counters);
    let nonce = Box::new(*b"0123456789abcdef");
    let src = vec![0x5Au8; 4096];

    let (s, _) = dial_buffer(&srv);
    assert!(ask(&s, true, nonce.as_ptr() as u64, &nonce), "a proven same-user process was refused one copy");
    drop(s);
    // Not asked: staging; a wrong nonce, or an address we do not map: staging too.
    let wrong = *b"fedcba9876543210";
    for (want, probe, n) in
        [(false, nonce.as_ptr() as u64, &*nonce), (true, nonce.as_ptr() as u64, &wrong), (true, 8, &*nonce)]
    {
        let (s, _) = dial_buffer(&srv);
        assert!(!ask(&s, want, probe, n), "one copy granted (asked {want}, probe {probe:#x})");
        // A one-copy commit on this connection is malformed: closed, nothing lands.
        commit_op(&s, 1, COMMIT_WRITE_DIRECT, &[(region.id, 0, 4096, src.as_ptr() as u64)]);
        assert!(read_replies(&s, 1).is_err(), "a one-copy commit was served on a staging connection");
    }
    // A peer from before the mode request commits at once: closed, nothing lands.
    let (s, staging) = dial_buffer(&srv);
    // SAFETY: 4096 bytes of our mapping of the staging buffer.
    unsafe { std::ptr::write_bytes(staging.as_ptr(), 0x5A, 4096) };
    commit_op(&s, 1, COMMIT_WRITE, &[(region.id, 0, 4096, 0)]);
    assert!(read_replies(&s, 1).is_err(), "a commit without a mode request was served");
    // SAFETY: 4096 bytes of the 64 KiB region, read after every connection above ended.
    let landed = unsafe { std::slice::from_raw_parts(region.ptr(), 4096) }.to_vec();
    assert!(landed.iter().all(|&b| b == 0), "bytes of a refused commit landed");
    assert_eq!(counters.bad_frames.load(std::sync::atomic::Ordering::Relaxed), 4);
    srv.close();
}

// By hand, one-copy commits: each chunk checked against the grants; a peer address the
// kernel cannot reach (unmapped, or running into an unmapped page) fails that chunk only,
// with its own status, and the connection goes on serving; reads land in our memory
// exactly; a staging-buffer commit on the same connection still works.
#[test]
fn a_bad_peer_address_fails_only_its_chunk() {
    let regions = Arc::new(RegionTable::default());
    let counters = Arc::new(Counters::default());
    let region = restricted(&regions, 1 << 16);
    // SAFETY: the whole 64 KiB region, before any peer touches it.
    unsafe { std::ptr::write_bytes(region.ptr(), 0xEE, 1 << 16) };
    region.grant(regions.next_grant_id(), "x", 0, 40960, true, None).unwrap();
    let srv = server(&regions, &counters);
    let (s, staging) = dial_buffer(&srv);
    let nonce = Box::new(*b"noncenoncenonce!");
    assert!(ask(&s, true, nonce.as_ptr() as u64, &nonce));

    let src: Vec<u8> = (0..16384u32).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
    // Two pages whose second is unmapped: a chunk starting 100 bytes before its end.
    let edge = super::staged_direct::page_before_a_hole();
    let at = |k: usize| src[k * 4096..].as_ptr() as u64;
    commit_op(
        &s,
        1,
        COMMIT_WRITE_DIRECT,
        &[
            (region.id, 0, 4096, at(0)),
            (region.id, 4096, 4096, 8), // unmapped page 0
            (region.id, 8192, 4096, at(2)),
            (region.id, 12288, 200, edge + 4000), // runs into the unmapped page
            (region.id, 40960, 4096, at(3)),      // in no grant
            (region.id, 16384, 4096, at(3)),
        ],
    );
    let (id, st) = read_replies(&s, 6).unwrap();
    assert_eq!(id, 1);
    assert_eq!(st[0], 0);
    assert_eq!(st[1], STATUS_COPY_FAILED, "an unmapped peer address was not reported");
    assert_eq!(st[2], 0, "a bad neighbour failed a good chunk");
    assert_eq!(st[3], STATUS_COPY_FAILED, "a short copy was not reported");
    assert!(st[4] != 0 && st[4] != STATUS_COPY_FAILED, "a chunk in no grant: {}", st[4]);
    assert_eq!(st[5], 0);
    // SAFETY: the 64 KiB region, read between commits (the server is idle).
    let reg = || unsafe { std::slice::from_raw_parts(region.ptr(), 1 << 16) }.to_vec();
    let r = reg();
    assert!(r[..4096] == src[..4096] && r[8192..12288] == src[8192..12288] && r[16384..20480] == src[12288..16384]);
    assert!(r[4096..8192].iter().all(|&b| b == 0xEE), "a failed chunk wrote the region");
    assert!(r[40960..45056].iter().all(|&b| b == 0xEE), "a refused chunk wrote the region");

    // Reads: into our memory, a bad address failing only its chunk.
    let mut dst = vec![0u8; 8192];
    commit_op(
        &s,
        2,
        COMMIT_READ_DIRECT,
        &[
            (region.id, 0, 4096, dst.as_mut_ptr() as u64),
            (region.id, 0, 4096, 16),
            (region.id, 16384, 4096, dst[4096..].as_mut_ptr() as u64),
        ],
    );
    let (_, st) = read_replies(&s, 3).unwrap();
    assert_eq!(st, vec![0, STATUS_COPY_FAILED, 0]);
    assert!(dst[..4096] == src[..4096] && dst[4096..] == src[12288..16384], "one-copy reads differ");

    // The staging buffer still works on this connection.
    // SAFETY: 100 bytes of our mapping of the staging buffer.
    unsafe { std::ptr::write_bytes(staging.as_ptr(), 0x77, 100) };
    commit_op(&s, 3, COMMIT_WRITE, &[(region.id, 30000, 100, 0)]);
    assert_eq!(read_replies(&s, 1).unwrap().1, vec![0]);
    assert!(reg()[30000..30100].iter().all(|&b| b == 0x77));
    // SAFETY: the mapped first page of `edge`.
    unsafe { libc::munmap(edge as *mut libc::c_void, 4096) };
    srv.close();
}

/// Environment of a child peer: the decode engine's address, the arena, and what to do.
const CHILD_ADDR: &str = "MOONCAKE_TEST_DIRECT_PEER_ADDR";
const CHILD_ARENA: &str = "MOONCAKE_TEST_DIRECT_PEER_ARENA";
const CHILD_MODE: &str = "MOONCAKE_TEST_DIRECT_PEER_MODE";
/// Bytes a child peer writes (from offset 333 of its region, to offset 4096 of the arena).
const CHILD_LEN: u64 = (5 << 20) + 4321;
const CHILD_TOKEN: &str = "cluster-token";

/// Runs `child_peer` in a child process (this test binary) and waits for it, bounded.
fn run_child(addr: &str, arena: RegionId, mode: &str) -> std::process::ExitStatus {
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "transfer::tests_staged_direct::child_peer", "--ignored", "--test-threads=1", "--nocapture"])
        .env(CHILD_ADDR, addr)
        .env(CHILD_ARENA, arena.to_string())
        .env(CHILD_MODE, mode)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(st) = c.try_wait().unwrap() {
            return st;
        }
        if Instant::now() > until {
            let _ = c.kill();
            panic!("the child peer did not finish in 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The peer side, in a child process (run by `run_child`; does nothing without it).
/// "write": writes CHILD_LEN bytes of pattern 11 into the arena over a one-copy link, reads
/// them back and checks them. "die": submits a large write batch and exits at once.
#[test]
#[ignore = "run by a_peer_in_another_process_is_served_in_one_copy in a child process"]
fn child_peer() {
    let (Ok(addr), Ok(arena), Ok(mode)) =
        (std::env::var(CHILD_ADDR), std::env::var(CHILD_ARENA), std::env::var(CHILD_MODE))
    else {
        return;
    };
    let arena: RegionId = arena.parse().unwrap();
    let mut c = super::tests::cfg("child-0", &["shm", "tcp"]);
    c.auth_token = Some(CHILD_TOKEN.into());
    c.staged_copy = StagedCopy::Direct;
    let e = Engine::new(c, None).unwrap();
    let p = e.connect("decode-0", Some(&addr)).unwrap();
    let l = e.allocate(16 << 20, false).unwrap().id;
    let src = fill(&e, l, 11);
    if mode == "die" {
        let reqs = (0..12u64).map(|i| req(Op::Write, l, i << 20, &p, arena, i << 20, 1 << 20)).collect();
        let _batch = e.submit(reqs, T).unwrap();
        std::thread::sleep(Duration::from_millis(1));
        std::process::exit(0);
    }
    let st = e.submit(vec![req(Op::Write, l, 333, &p, arena, 4096, CHILD_LEN)], T).unwrap().wait(None);
    assert_eq!(code(&st[0]), "ok");
    assert!(links(&p).iter().all(|k| k.is_direct()) && !links(&p).is_empty(), "the child's link is not one-copy");
    let back = 8 << 20;
    let st = e.submit(vec![req(Op::Read, l, back, &p, arena, 4096, CHILD_LEN)], T).unwrap().wait(None);
    assert_eq!(code(&st[0]), "ok");
    let got = bytes(&e, l);
    let n = CHILD_LEN as usize;
    assert!(got[back as usize..back as usize + n] == src[333..333 + n], "the child read back other bytes");
}

// A peer in another process (the pid that matters is not ours): its one-copy writes land
// whole and its reads come back exact; a peer that exits in the middle of a large batch
// does not take the server down, and the next peer is served.
#[test]
fn a_peer_in_another_process_is_served_in_one_copy() {
    let mut c = super::tests::cfg("decode-0", &["shm", "tcp"]);
    c.auth_token = Some(CHILD_TOKEN.into());
    let decode = Engine::new(c, None).unwrap();
    let len = 16usize << 20;
    let arena = decode.allocate_with(len, Access { restricted: true, ..Access::default() }).unwrap().id;
    decode.grant(arena, "child-0", 0, len as u64, true, None).unwrap();
    let before = fill(&decode, arena, 1);

    // The child's pattern, as `fill` makes it in the child.
    let pattern = {
        let probe = engine_copying("pattern", StagedCopy::Staging);
        let l = probe.allocate(16 << 20, false).unwrap().id;
        fill(&probe, l, 11)
    };
    assert!(run_child(&decode.address(), arena, "write").success(), "the child peer failed");
    let after = bytes(&decode, arena);
    let n = CHILD_LEN as usize;
    assert!(after[4096..4096 + n] == pattern[333..333 + n], "the child's one-copy write differs");
    assert!(after[..4096] == before[..4096] && after[4096 + n..] == before[4096 + n..], "bytes outside it changed");
    assert!(decode.stats().bytes_staged >= CHILD_LEN, "the server did not copy the child's bytes");

    // A child that exits mid-batch, then a good one again.
    assert!(run_child(&decode.address(), arena, "die").success());
    assert!(run_child(&decode.address(), arena, "write").success(), "a peer after one that died was not served");
    assert!(bytes(&decode, arena)[4096..4096 + n] == pattern[333..333 + n]);
}
