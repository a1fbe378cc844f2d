//! The staged path's pipelining (commits of `FLUSH_BYTES` sent while the next is copied,
//! reads committed from `submit`, streaming stores for long chunks) against simple
//! references: TCP (each slice its own frame and answer) and a plain copy of the bytes.
//! Mixed batches with lengths around every size the path switches at, partial grants,
//! and revoke or a closed server in the middle of a batch of writes. The staged path's
//! own protocol and reads are tested in `tests_staged.rs`.

use std::sync::Arc;

use rand::{Rng, SeedableRng};

use super::batch::Batch;
use super::config::StagedCopy;
use super::staged::{CHUNK, STREAMING_MIN};
use super::tests::{bytes, cfg, fill, req, T};
use super::tests_staged::{assert_mode, assert_ok_slots_hold, code, engine, engine_copying, links, wait_links_idle};
use super::*;

const KIB: u64 = 1 << 10;
/// The worker's commit size (`staged::FLUSH_BYTES`, private there).
const FLUSH: u64 = 512 * KIB;
/// The arena: writes granted in `0..WRITE_END`, reads in `READ_AT..READ_END`, the rest
/// in no grant.
const ARENA: u64 = 16 << 20;
const WRITE_END: u64 = 6 << 20;
const READ_AT: u64 = 8 << 20;
const READ_END: u64 = 14 << 20;

/// A length around one of the sizes the staged path switches at.
fn boundary_len(rng: &mut rand::rngs::StdRng) -> u64 {
    let around = [STREAMING_MIN, FLUSH, CHUNK, 2 * CHUNK, 128 * KIB];
    match rng.gen_range(0..6) {
        0 => rng.gen_range(1..5000),
        k => (around[k - 1] as i64 + rng.gen_range(-2i64..3)) as u64,
    }
}

/// Where the next request goes: each its own bytes of the local region, and of the
/// arena's write or read part, with a small random gap.
struct Cursor {
    local: u64,
    write: u64,
    read: u64,
}

impl Cursor {
    fn next(&mut self, op: Op, n: u64, rng: &mut rand::rngs::StdRng) -> (Op, u64, u64, u64) {
        let remote = if op == Op::Write { &mut self.write } else { &mut self.read };
        let r = (op, self.local, *remote, n);
        self.local += n + rng.gen_range(0..64);
        *remote += n + rng.gen_range(0..64);
        r
    }
}

/// What one run of `mixed_batches` left: each request's (op, local offset, remote
/// offset, length) and code, and the bytes of both regions after.
struct MixedRun {
    reqs: Vec<(Op, u64, u64, u64)>,
    codes: Vec<&'static str>,
    local: Vec<u8>,
    arena: Vec<u8>,
    arena_before: Vec<u8>,
    local_before: Vec<u8>,
    staged: u64,
}

/// Two fresh engines on `transports`; a small mixed batch (at most 1 MiB: committed by
/// `submit` on the staged path) and a large one (reads committed by `submit`, the rest
/// by the worker, ops alternating in runs), each request into its own bytes of both
/// regions, some crossing a grant's end.
fn mixed_batches(transports: &[&str], seed: u64, copy: StagedCopy) -> MixedRun {
    let engine_on = |name: &str| {
        let mut c = cfg(name, transports);
        c.auth_token = Some("cluster-token".into());
        c.staged_copy = copy;
        Engine::new(c, None).unwrap()
    };
    let (decode, prefill) = (engine_on("decode-0"), engine_on("prefill-0"));
    let p = prefill.connect("decode-0", Some(&decode.address())).unwrap();
    let arena = decode.allocate_with(ARENA as usize, Access { restricted: true, ..Access::default() }).unwrap().id;
    let arena_before = fill(&decode, arena, 1);
    decode.grant(arena, "prefill-0", 0, WRITE_END, true, None).unwrap();
    decode.grant(arena, "prefill-0", READ_AT, READ_END - READ_AT, false, None).unwrap();
    let l = prefill.allocate(64 << 20, false).unwrap().id;
    let local_before = fill(&prefill, l, 5);

    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut at = Cursor { local: 0, write: 0, read: READ_AT };
    // Small: eight 100 KiB-ish requests, ops alternating, then one past the write grant.
    let mut small: Vec<_> = (0..8)
        .map(|i| at.next(if i % 3 == 2 { Op::Read } else { Op::Write }, 100 * KIB + rng.gen_range(0..999), &mut rng))
        .collect();
    small.push((Op::Write, at.local, WRITE_END - 100, 4096));
    at.local += 4096;
    // Large: runs of one op, lengths around the switch sizes.
    let mut large = Vec::new();
    while large.len() < 40 {
        let op = if rng.gen_bool(0.5) { Op::Read } else { Op::Write };
        for _ in 0..rng.gen_range(1..5) {
            let n = boundary_len(&mut rng);
            if (op == Op::Write && at.write + n > WRITE_END - 64) || (op == Op::Read && at.read + n > READ_END - 64) {
                continue;
            }
            large.push(at.next(op, n, &mut rng));
        }
    }
    let lo = at.local;
    large.push((Op::Write, lo, WRITE_END - CHUNK, CHUNK + 5)); // two chunks, the second refused
    large.push((Op::Read, lo + 2 * CHUNK, READ_END - 10, 20)); // past the read grant
    large.push((Op::Read, lo + 3 * CHUNK, WRITE_END + KIB, 300 * KIB)); // in no grant
    assert!(lo + 4 * CHUNK < 64 << 20);

    let run = |batch: &[(Op, u64, u64, u64)]| {
        let reqs = batch.iter().map(|&(op, lo, ro, n)| req(op, l, lo, &p, arena, ro, n)).collect();
        prefill.submit(reqs, T).unwrap().wait(None).iter().map(code).collect::<Vec<_>>()
    };
    // Open the path first, so both batches find the link up and idle.
    let opening = [(Op::Read, 63 << 20, READ_AT, 4096)];
    let mut codes = run(&opening);
    wait_links_idle(&p);
    codes.extend(run(&small));
    codes.extend(run(&large));
    let direct = links(&p).iter().map(|k| k.is_direct()).collect::<Vec<_>>();
    assert!(direct.iter().all(|&d| d == (copy == StagedCopy::Direct)), "{copy:?} asked, links direct: {direct:?}");
    MixedRun {
        reqs: [&opening[..], &small, &large].concat(),
        codes,
        local: bytes(&prefill, l),
        arena: bytes(&decode, arena),
        arena_before,
        local_before,
        staged: decode.stats().bytes_staged + decode.stats().bytes_staged_read,
    }
}

// Mixed reads and writes around every size the staged path switches at (streaming
// stores, commit size, chunk size, the server's two-thread split), in a small and a large
// batch, in one-copy mode and through the staging buffer: the same codes as TCP, and both
// regions equal to a plain copy of what the ok requests move (a refused request of several
// chunks may have moved its earlier chunks, on either path: its bytes are masked).
#[test]
fn mixed_batches_around_the_switch_sizes_match_tcp_and_a_plain_copy() {
    for (seed, copy) in [
        (1u64, StagedCopy::Direct),
        (2, StagedCopy::Direct),
        (3, StagedCopy::Direct),
        (1, StagedCopy::Staging),
        (2, StagedCopy::Staging),
        (3, StagedCopy::Staging),
    ] {
        let staged = mixed_batches(&["shm", "tcp"], seed, copy);
        let tcp = mixed_batches(&["tcp"], seed, copy);
        assert!(staged.staged > 0 && tcp.staged == 0, "seed {seed}: staged {} over TCP {}", staged.staged, tcp.staged);
        assert_eq!(staged.reqs, tcp.reqs);
        assert_eq!(staged.codes, tcp.codes, "seed {seed}");
        let ok = staged.codes.iter().filter(|c| **c == "ok").count();
        assert!(ok >= 40 && staged.codes.contains(&"no_grant"), "seed {seed}: {:?}", staged.codes);
        for (what, run) in [("staged", &staged), ("tcp", &tcp)] {
            let (mut want_local, mut want_arena) = (run.local_before.clone(), run.arena_before.clone());
            let (mut got_local, mut got_arena) = (run.local.clone(), run.arena.clone());
            for (&(op, lo, ro, n), c) in run.reqs.iter().zip(&run.codes) {
                let (lo, ro, n) = (lo as usize, ro as usize, n as usize);
                let (src, dst, want, got, at) = match op {
                    Op::Write => (&run.local_before[lo..lo + n], ro, &mut want_arena, &mut got_arena, ro),
                    Op::Read => (&run.arena_before[ro..ro + n], lo, &mut want_local, &mut got_local, lo),
                };
                if *c == "ok" {
                    want[dst..dst + n].copy_from_slice(src);
                } else {
                    let end = (at + n).min(want.len());
                    want[at..end].fill(0);
                    got[at..end].fill(0);
                }
            }
            for (side, got, want) in [("local", &got_local, &want_local), ("arena", &got_arena, &want_arena)] {
                let first_diff = got.iter().zip(want.iter()).position(|(a, b)| a != b);
                assert!(
                    first_diff.is_none(),
                    "seed {seed} {copy:?}: {what}: the {side} region differs at byte {first_diff:?}"
                );
            }
        }
    }
}

// A read batch larger than what `submit` copies (16 x 128 KiB) is committed from
// `submit` itself, in several commits (reads cost it no copy), and lands exactly. (Through
// the staging buffer: a one-copy link commits everything from `submit` in one commit.)
#[test]
fn a_large_read_batch_is_committed_from_submit_in_several_commits() {
    let decode = engine("decode-0");
    let prefill = engine_copying("prefill-0", StagedCopy::Staging);
    let p = prefill.connect("decode-0", Some(&decode.address())).unwrap();
    let len = 4usize << 20;
    let arena = decode.allocate_with(len, Access { restricted: true, ..Access::default() }).unwrap().id;
    let arena_bytes = fill(&decode, arena, 3);
    decode.grant(arena, "prefill-0", 0, len as u64, false, None).unwrap();
    let l = prefill.allocate(len, false).unwrap().id;
    fill(&prefill, l, 4);
    let st = prefill.submit(vec![req(Op::Read, l, 0, &p, arena, 0, 4096)], T).unwrap().wait(None);
    assert_eq!(code(&st[0]), "ok");
    wait_links_idle(&p);
    let before: u64 = links(&p).iter().map(|k| k.inline_commits()).sum();
    let k = 128 * KIB;
    // Local and remote offsets differ, so a read landing in the wrong place shows.
    let reqs = (0..16).map(|i| req(Op::Read, l, (i * k + 77) % (2 << 20), &p, arena, (2 << 20) + i * k, k)).collect();
    let st = prefill.submit(reqs, T).unwrap().wait(None);
    assert!(st.iter().all(|s| code(s) == "ok"), "{:?}", st.iter().map(code).collect::<Vec<_>>());
    let after: u64 = links(&p).iter().map(|k| k.inline_commits()).sum();
    assert!(after - before >= (16 * k / FLUSH), "{} commits from submit for a 2 MiB read batch", after - before);
    let got = bytes(&prefill, l);
    for i in 0..16usize {
        let lo = (i * k as usize + 77) % (2 << 20);
        let ro = (2 << 20) + i * k as usize;
        assert!(got[lo..lo + k as usize] == arena_bytes[ro..ro + k as usize], "request {i} differs");
    }
}

/// Opens the staging link with one small write, then submits 16 rounds of 512 KiB
/// writes of the same local bytes over the arena, and returns once the server has
/// copied some in (or the batch ended).
fn writes_under_way(decode: &Engine, prefill: &Engine, p: &Arc<Peer>, l: RegionId, arena: RegionId) -> Arc<Batch> {
    let st = prefill.submit(vec![req(Op::Write, l, 0, p, arena, 0, 4096)], T).unwrap().wait(None);
    assert_eq!(code(&st[0]), "ok");
    assert_mode(p, prefill.config().staged_copy);
    let before = decode.stats().bytes_staged;
    let k = FLUSH;
    let reqs = (0..16 * ARENA / k).map(|i| req(Op::Write, l, (i * k) % ARENA, p, arena, (i * k) % ARENA, k)).collect();
    let batch = prefill.submit(reqs, T).unwrap();
    while decode.stats().bytes_staged == before && !batch.is_done() {
        std::thread::yield_now();
    }
    batch
}

/// Two same-host engines, the writer's links asking for `copy`, a restricted arena
/// (pattern 1) granted whole to the writer for writes, and the writer's region (pattern 2).
fn write_pair(copy: StagedCopy) -> (Engine, Engine, Arc<Peer>, RegionId, Vec<u8>, RegionId, Vec<u8>) {
    let decode = engine("decode-0");
    let prefill = engine_copying("prefill-0", copy);
    let p = prefill.connect("decode-0", Some(&decode.address())).unwrap();
    let arena = decode.allocate_with(ARENA as usize, Access { restricted: true, ..Access::default() }).unwrap().id;
    let arena_bytes = fill(&decode, arena, 1);
    decode.grant(arena, "prefill-0", 0, ARENA, true, None).unwrap();
    let l = prefill.allocate(ARENA as usize, false).unwrap().id;
    let local_bytes = fill(&prefill, l, 2);
    (decode, prefill, p, arena, arena_bytes, l, local_bytes)
}

// A grant revoked while a batch of staged writes is in flight (one copy, and through the
// staging buffer): every request ends ok or `no_grant`; each 512 KiB slot of the arena
// holds either its old bytes or the written ones wherever every write into it was ok;
// the next write is refused. (Whether a batch straddles the revoke is up to the
// scheduler: a few tries.)
#[test]
fn a_grant_revoked_mid_batch_refuses_the_following_staged_writes() {
    for copy in [StagedCopy::Direct, StagedCopy::Staging] {
        revoke_mid_write_batch(copy);
    }
}

fn revoke_mid_write_batch(copy: StagedCopy) {
    let mut straddled = false;
    for _ in 0..5 {
        let (decode, prefill, p, arena, _, l, local_bytes) = write_pair(copy);
        let batch = writes_under_way(&decode, &prefill, &p, l, arena);
        decode.revoke(arena, "prefill-0", None).unwrap();
        let codes: Vec<_> = batch.wait(None).iter().map(code).collect();
        assert!(codes.iter().all(|c| *c == "ok" || *c == "no_grant"), "{codes:?}");
        let slots = (ARENA / FLUSH) as usize;
        assert_ok_slots_hold(&codes, &bytes(&decode, arena), &local_bytes, FLUSH as usize, |i| i % slots);
        let after = prefill.submit(vec![req(Op::Write, l, 0, &p, arena, 0, 4096)], T).unwrap().wait(None);
        assert_eq!(code(&after[0]), "no_grant", "a write after revoke was not refused");
        if codes.contains(&"ok") && codes.contains(&"no_grant") {
            straddled = true;
            break;
        }
    }
    assert!(straddled, "{copy:?}: no batch of staged writes straddled the revoke in five tries");
}

// The server engine goes away while staged writes are in flight (one copy, and through
// the staging buffer): every request ends (ok, `connection_lost` or `closed`) well
// before the batch's timeout, and a write after that fails rather than waiting.
#[test]
fn staged_writes_end_when_the_server_goes_away() {
    for copy in [StagedCopy::Direct, StagedCopy::Staging] {
        server_gone_mid_write_batch(copy);
    }
}

fn server_gone_mid_write_batch(copy: StagedCopy) {
    let (decode, prefill, p, arena, _, l, _) = write_pair(copy);
    let batch = writes_under_way(&decode, &prefill, &p, l, arena);
    decode.close();
    let t0 = std::time::Instant::now();
    let st = batch.wait(None);
    assert!(t0.elapsed() < T, "the batch ended only by its timeout");
    let codes: Vec<_> = st.iter().map(code).collect();
    assert!(codes.iter().all(|c| matches!(*c, "ok" | "connection_lost" | "closed")), "{codes:?}");
    let after = prefill.submit(vec![req(Op::Write, l, 0, &p, arena, 0, 4096)], T).unwrap().wait(Some(T));
    assert!(after[0].error().is_some(), "a write to a closed server succeeded");
    assert_ne!(code(&after[0]), "timeout");
}
