//! Completion queue, per-batch timestamps and the engine's byte / busy counters, against
//! a simple reference: the bytes that actually landed and the sum of the requests.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::tests::{bytes, cfg, engine, fill, mute_peer, req, T};
use super::*;

fn pair_tcp(token: Option<&str>) -> (Engine, Engine, Arc<Peer>) {
    let mk = |n: &str| {
        let mut c = cfg(n, &["tcp"]);
        c.auth_token = token.map(str::to_string);
        Engine::new(c, None).unwrap()
    };
    let (a, b) = (mk("a"), mk("b"));
    let p = a.connect("b", Some(&b.address())).unwrap();
    (a, b, p)
}

/// Submits `n` batches of writes and reads of assorted sizes (inline-sent, queued,
/// several slices) to `peer`, collects them through one queue, and checks tags, bytes
/// (against what landed), timestamps and the engine's counters.
fn check_queue_and_counters(a: &Engine, b: &Engine, p: &Arc<Peer>) {
    let len = 8 << 20;
    let la = a.allocate(len, false).unwrap().id;
    let rb = b.allocate(len, false).unwrap().id;
    let va = fill(a, la, 11);
    let vb = fill(b, rb, 12);
    let q = CompletionQueue::new();
    let before = a.stats();
    let sizes: [u64; 6] = [1, 4096, 16 << 10, 100_000, 1 << 20, (2 << 20) + 3];
    let (mut want_w, mut want_r) = (0u64, 0u64);
    let mut want = std::collections::HashMap::new();
    let t_submit = monotonic_ns();
    let mut off = 0u64;
    for (k, &n) in sizes.iter().enumerate() {
        // Writes into b's first half, reads from b's second half into a's second half.
        let half = (len / 2) as u64;
        let reqs = vec![req(Op::Write, la, off, p, rb, off, n), req(Op::Read, la, half + off, p, rb, half + off, n)];
        a.submit_to(reqs, T, &q, 100 + k as u64).unwrap();
        want.insert(100 + k as u64, 2 * n);
        want_w += n;
        want_r += n;
        off += n;
    }
    let mut got = Vec::new();
    let until = Instant::now() + Duration::from_secs(20);
    while got.len() < sizes.len() && Instant::now() < until {
        got.extend(q.wait(Duration::from_secs(1)));
    }
    assert_eq!(got.len(), sizes.len(), "every batch is reported once");
    assert_eq!(q.pending(), 0);
    assert!(q.poll().is_empty(), "nothing is reported twice");
    for c in &got {
        assert!(c.ok(), "{c:?}");
        assert_eq!(c.requests, 2);
        assert_eq!(c.bytes, want[&c.tag], "tag {}", c.tag);
        assert_eq!(c.requested_bytes, want[&c.tag]);
        assert!(c.submitted_ns >= t_submit && c.finished_ns >= c.submitted_ns, "{c:?}");
        assert_eq!(c.batch.finished_ns(), Some(c.finished_ns));
        assert!(c.finished_ns <= monotonic_ns());
    }
    // What landed is what was asked for.
    let (ga, gb) = (bytes(a, la), bytes(b, rb));
    let (h, o) = (len / 2, off as usize);
    assert!(gb[..o] == va[..o], "written bytes differ");
    assert!(ga[h..h + o] == vb[h..h + o], "read bytes differ");
    let after = a.stats();
    assert_eq!(after.bytes_written - before.bytes_written, want_w);
    assert_eq!(after.bytes_read - before.bytes_read, want_r);
    assert_eq!(after.batches - before.batches, sizes.len() as u64);
    assert_eq!(after.batches_done - before.batches_done, sizes.len() as u64);
    assert_eq!(after.batches_in_flight, 0);
    assert_eq!(after.requests_failed, before.requests_failed);
    let span = got.iter().map(|c| c.finished_ns).max().unwrap() - got.iter().map(|c| c.submitted_ns).min().unwrap();
    let busy = after.busy_ns - before.busy_ns;
    assert!(busy > 0 && busy <= span, "busy {busy} ns is within the batches' span {span} ns");
}

#[test]
fn completion_queue_reports_tcp_batches_with_bytes_and_counters() {
    let (a, b, p) = pair_tcp(None);
    check_queue_and_counters(&a, &b, &p);
    let (a, b, p) = pair_tcp(Some("s3cret"));
    check_queue_and_counters(&a, &b, &p);
}

#[test]
fn completion_queue_reports_local_and_shm_batches() {
    let reg = EngineRegistry::new();
    let a = Engine::new(cfg("a", &["local"]), Some(reg.clone())).unwrap();
    let b = Engine::new(cfg("b", &["local"]), Some(reg.clone())).unwrap();
    let p = a.connect("b", None).unwrap();
    check_queue_and_counters(&a, &b, &p);
    let a = engine("sa", &["shm", "tcp"]);
    let b = engine("sb", &["shm", "tcp"]);
    let p = a.connect("sb", Some(&b.address())).unwrap();
    assert_eq!(p.transport(), "shm");
    check_queue_and_counters(&a, &b, &p);
}

#[test]
fn completion_queue_reports_failures_and_timeouts_on_their_tags() {
    let (a, b, p) = pair_tcp(None);
    let la = a.allocate(1 << 16, false).unwrap().id;
    let rb = b.allocate(1 << 16, false).unwrap().id;
    let q = CompletionQueue::new();
    // Tag 1: one good request and one out of bounds; tag 2: no such region; tag 3: empty.
    a.submit_to(
        vec![req(Op::Write, la, 0, &p, rb, 0, 100), req(Op::Write, la, 0, &p, rb, (1 << 16) - 10, 100)],
        T,
        &q,
        1,
    )
    .unwrap();
    a.submit_to(vec![req(Op::Read, la, 0, &p, 999, 0, 100)], T, &q, 2).unwrap();
    a.submit_to(vec![], T, &q, 3).unwrap();
    let mut got = Vec::new();
    let until = Instant::now() + Duration::from_secs(10);
    while got.len() < 3 && Instant::now() < until {
        got.extend(q.wait(Duration::from_millis(500)));
    }
    got.sort_by_key(|c| c.tag);
    assert_eq!(got.iter().map(|c| c.tag).collect::<Vec<_>>(), vec![1, 2, 3]);
    assert_eq!((got[0].failed, got[0].bytes), (1, 100));
    assert_eq!(got[0].error.as_ref().map(|e| e.code()), Some("out_of_bounds"));
    assert_eq!(got[1].error.as_ref().map(|e| e.code()), Some("no_such_region"));
    assert!(got[2].ok() && got[2].requests == 0);
    let s = a.stats();
    assert_eq!((s.requests_failed, s.bytes_written, s.bytes_read), (2, 100, 0));

    // A peer that never answers: the queue itself enforces the deadline.
    let (addr, t) = mute_peer();
    let m = a.connect("mute", Some(&addr)).unwrap();
    let t0 = Instant::now();
    let batch = a.submit_to(vec![req(Op::Read, la, 0, &m, 1, 0, 100)], Duration::from_millis(300), &q, 7).unwrap();
    assert!(q.poll().is_empty());
    assert_eq!(q.pending(), 1);
    let mut got = Vec::new();
    while got.is_empty() && t0.elapsed() < Duration::from_secs(5) {
        got = q.wait(Duration::from_secs(5));
    }
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].tag, 7);
    assert_eq!(got[0].error, Some(TransferError::Timeout));
    let took = got[0].finished_ns - got[0].submitted_ns;
    assert!(took >= 300_000_000, "ended at the deadline, not before ({took} ns)");
    assert_eq!(batch.finished_ns(), Some(got[0].finished_ns));
    // Cancelled batches end on their tag too.
    let b2 = a.submit_to(vec![req(Op::Read, la, 0, &m, 1, 0, 100)], T, &q, 8).unwrap();
    b2.cancel();
    let got = q.poll();
    assert_eq!((got.len(), got[0].tag, got[0].error.clone()), (1, 8, Some(TransferError::Cancelled)));
    assert_eq!(a.stats().batches_in_flight, 0);
    t.join().unwrap();
}

#[test]
fn busy_time_is_the_union_of_in_flight_intervals() {
    let mut b = config::Busy::default();
    b.begin(100);
    b.begin(150);
    b.end(200);
    assert_eq!(b.read(210), (110, 1), "an open interval counts up to now");
    b.end(300);
    b.begin(1000);
    b.end(1050);
    assert_eq!(b.read(5000), (250, 0));
}

#[test]
fn busy_time_counts_no_stretch_twice_when_stamps_arrive_out_of_order() {
    // A batch stamped at 150 takes the lock after one that ended at 200: [100, 300] is 200 ns.
    let mut b = config::Busy::default();
    b.begin(100);
    b.end(200);
    b.begin(150);
    b.end(300);
    assert_eq!(b.read(400), (200, 0));
    // Ends in the other order: the interval closes at the latest end (250), not the last seen.
    let mut b = config::Busy::default();
    b.begin(100);
    b.begin(110);
    b.end(250);
    b.end(240);
    assert_eq!(b.read(400), (150, 0));
}

#[test]
fn small_tcp_writes_sent_inline_and_queued_interleave_correctly() {
    // Many small batches from several threads at once: some go inline, some through the
    // sender thread; every byte lands where it should and frames stay in order (with a
    // token, any out-of-order frame would fail its tag and close the connection).
    let (a, b, p) = pair_tcp(Some("tok"));
    let la = a.allocate(1 << 20, false).unwrap().id;
    let rb = b.allocate(1 << 20, false).unwrap().id;
    let va = fill(&a, la, 5);
    let a = Arc::new(a);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (a, p) = (a.clone(), p.clone());
            std::thread::spawn(move || {
                for i in 0..64u64 {
                    let off = (t * 64 + i) * 4096;
                    let st = a.submit(vec![req(Op::Write, la, off, &p, rb, off, 4096)], T).unwrap().wait(None);
                    assert!(st[0].is_ok(), "{st:?}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(bytes(&b, rb) == va, "every 4 KiB write landed");
    assert_eq!(b.stats().bad_frames, 0);
    assert_eq!(a.stats().bytes_written, 1 << 20);
}

/// A batch driven the way the transports drive it (`begin_io` / `slice_done` /
/// `end_io` from other threads, in any order) against a simple reference: `wait`
/// returns once every request ended, each `Done` with the bytes its slices moved.
#[test]
fn wait_returns_when_the_last_slice_ends() {
    let sizes: Vec<u64> = (1..=32).map(|i| i * 1000).collect();
    let batch = Arc::new(Batch::with_report(
        sizes.iter().map(|&n| (Op::Write, n)),
        Duration::from_secs(30),
        Default::default(),
    ));
    for i in 0..sizes.len() {
        batch.set_slices(i, 2);
    }
    let workers: Vec<_> = (0..2)
        .map(|w| {
            let (batch, sizes) = (batch.clone(), sizes.clone());
            std::thread::spawn(move || {
                for i in (0..sizes.len()).rev() {
                    assert!(batch.begin_io(i));
                    batch.slice_done(i, sizes[i] / 2 + (sizes[i] % 2) * w);
                    batch.end_io(i);
                }
            })
        })
        .collect();
    let got = batch.wait(None);
    for w in workers {
        w.join().unwrap();
    }
    let want: Vec<RequestStatus> = sizes.iter().map(|&n| RequestStatus::Done { bytes: n }).collect();
    assert_eq!(got, want);
}

/// A request that fails while its memory is being accessed is reported only when the
/// access ends, and a waiter sees that failure (typed) then, not a `Pending`.
#[test]
fn a_failure_during_an_access_is_reported_when_it_ends() {
    let batch = Arc::new(Batch::with_report([(Op::Read, 64u64), (Op::Read, 64)].into_iter(), T, Default::default()));
    batch.slice_done(1, 64);
    assert!(batch.begin_io(0));
    batch.fail(0, TransferError::Cancelled);
    assert_eq!(batch.status()[0], RequestStatus::Pending, "the access is still running");
    let ender = {
        let batch = batch.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            batch.end_io(0);
        })
    };
    let got = batch.wait(None);
    ender.join().unwrap();
    assert!(matches!(got[0], RequestStatus::Failed { error: TransferError::Cancelled, .. }), "{got:?}");
    assert_eq!(got[1], RequestStatus::Done { bytes: 64 });
    assert!(!batch.begin_io(0), "no access begins once the request is final");
}

/// Past the deadline, a request whose memory is being accessed ends (timed out) when
/// that access ends, and a waiter returns with it.
#[test]
fn past_the_deadline_a_waiter_returns_when_the_access_ends() {
    let batch =
        Arc::new(Batch::with_report([(Op::Write, 64u64)].into_iter(), Duration::from_millis(30), Default::default()));
    assert!(batch.begin_io(0));
    let ender = {
        let batch = batch.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(120));
            batch.end_io(0);
        })
    };
    let got = batch.wait(None);
    ender.join().unwrap();
    assert!(matches!(got[0], RequestStatus::Failed { error: TransferError::Timeout, .. }), "{got:?}");
}
