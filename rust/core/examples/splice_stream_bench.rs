//! Two questions of issue 26 (512 KiB authenticated TCP) on bare loopback sockets, with no
//! transfer engine around them: does splicing a sender's pages into the socket cost fewer
//! CPU-seconds per byte than writing them, and what does the cheapest integrity-only
//! stream (a tag per record made by the sender and checked by the receiver) reach against
//! the plain stream?
//!
//! A plain socket stream over loopback pays two copies: the sender's `write` copies user
//! bytes into socket buffers, the receiver's `read` copies them out. `vmsplice(2)` of
//! the sender's pages into a pipe and `splice(2)` from the pipe into the socket hands
//! the socket page references instead (kernels >= 6.5 add them to the skb with
//! MSG_SPLICE_PAGES), so on loopback only the receiver copies.
//!
//!   cargo run --release -p mooncake-core --example splice_stream_bench -- [rounds] [calls] [chunk_kib]
//!
//! Each call streams `32 x chunk` bytes (default 32 x 512 KiB = 16 MiB) from a walking
//! offset of a 256 MiB source to the same offset of a 256 MiB destination (as
//! `benches/transfer_bench.py` walks), the receiver acknowledging each call with one
//! byte. Per round, every mode runs `calls` calls on their own connection, interleaved
//! (write, splice, write, splice, ...), and each thread measures its own CPU time
//! (`getrusage(RUSAGE_THREAD)`: user + system, the kernel's copies included).
//! `SPLICE_BENCH_MODES` (default `write,splice`) lists the modes, the first the reference:
//! `write`, `splice`, and with a GMAC tag per 64 KiB record as an integrity-only sender
//! computes (so the bytes are in its cache when the socket takes them) `tag-write`,
//! `tag-splice`, or `write-tag` (the tag after the write: the socket's copy reads memory
//! first). A single mode is for `perf record`. `SPLICE_BENCH_FIXED=1`: every call at
//! offset 0 instead of walking.
//!
//! Modes that also check the tags at the receiver (what any integrity-only TCP path must
//! do at both ends, with nothing else: no requests, no answers, no threads between):
//! `tag-check` (the sender tags each record, then hands a chunk's records and their tags
//! to the socket in one vectored write; the receiver reads each record and its tag
//! straight into the destination and checks it there, still hot), and `frames` /
//! `frames-none` (the transfer engine's own framing layer, `FrameWriter` and
//! `FrameReader::read_payload_verified`, integrity-only and without a token, over the
//! same bare socket: one frame a chunk). `stream` is `write` with the receiver reading
//! each chunk whole, as `transfer_bench.py`'s socket reference does. Run
//! `SPLICE_BENCH_MODES=stream,tag-check,frames,frames-none` for the integrity question
//! (BENCHMARKS.md, "k26w"). `SPLICE_BENCH_SPLIT=1` pins the sender to CPU 0 and the
//! receiver to CPU 1. `tag-helper` is `tag-check` with the tags computed off the send
//! path: a tagger thread tags the chunks in the sender's order, up to
//! `SPLICE_BENCH_AHEAD` (default 2) chunks ahead, and the sender thread only writes (its
//! CPU is reported apart, in `tagger_cpu_s/GB`, and counted in the total).
//!
//! When the modes include one without a MAC (`stream`, `write`, `frames-none`), each round
//! ends with the ceiling of any integrity-only stream on this host, as a ratio to the first
//! mode: such a stream must move the bytes (at least the cheapest no-MAC mode's CPU per
//! byte that round) and pass a MAC over every byte at both ends (GMAC with the bytes in
//! cache, timed on this thread that round), and the host has
//! `available_parallelism` CPU-seconds a second (BENCHMARKS.md, "k26x").
//!
//! Result on the development host (BENCHMARKS.md, "k26z: authenticated 512 KiB"): the
//! splice removes most of the sender's CPU, but the receiver's copy out of spliced pages
//! costs 2-3x its copy out of written ones, 1.4-1.7x the CPU per byte in all; so the
//! transfer engine does not splice.

use std::io::{self, Read, Write};
use std::io::{IoSlice, IoSliceMut};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::mpsc::Receiver;
use std::thread::JoinHandle;
use std::time::Instant;

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use mooncake_core::transfer::tcp::seal::{FrameKey, FrameReader, FrameWriter, TAG_LEN};
use mooncake_core::transfer::WireProtection;

const WS: usize = 256 << 20;
const PER_CALL: usize = 32;
/// Bytes a tag covers (the transfer engine's record).
const RECORD: usize = 64 << 10;
/// The modes that move the bytes without a MAC (what the ceiling's "moving the bytes" is
/// measured on).
const NO_MAC_MODES: [&str; 3] = ["stream", "write", "frames-none"];
/// The head of a `frames` frame (a request header's size).
const HEAD: [u8; 24] = [3u8; 24];

/// The GMAC key and nonces both ends of the tagging modes use.
fn gmac_key() -> io::Result<LessSafeKey> {
    Ok(LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &[7u8; 32]).map_err(|_| io::Error::other("key"))?))
}

/// The GMAC tag of record `seq` (the record as associated data, nothing encrypted).
fn gmac(key: &LessSafeKey, seq: u64, rec: &[u8]) -> io::Result<[u8; TAG_LEN]> {
    let mut n = [0u8; 12];
    n[..8].copy_from_slice(&seq.to_le_bytes());
    let t = key
        .seal_in_place_separate_tag(Nonce::assume_unique_for_key(n), Aad::from(rec), &mut [])
        .map_err(|_| io::Error::other("gmac"))?;
    let mut out = [0u8; TAG_LEN];
    out.copy_from_slice(t.as_ref());
    Ok(out)
}

/// The key of the `frames` modes (`None`: `frames-none`, no token).
fn frame_key(mode: &str) -> Option<FrameKey> {
    (mode == "frames").then_some(FrameKey { key: [5u8; 32], protection: WireProtection::Integrity })
}

/// The tags of `bytes`' records, as an integrity-only sender computes them (numbered on
/// from `seq`).
fn record_tags(key: &LessSafeKey, seq: &mut u64, bytes: &[u8]) -> io::Result<Vec<[u8; TAG_LEN]>> {
    bytes
        .chunks(RECORD)
        .map(|rec| {
            *seq += 1;
            gmac(key, *seq, rec)
        })
        .collect()
}

/// `tag-check`'s sender: a chunk's records tagged, then the records and tags in one
/// vectored write. (Written out here rather than through `FrameWriter`, which does the
/// same: this mode is the reference the framing layer is measured against, so it shares
/// none of its code.)
fn tag_check_send(s: &mut TcpStream, key: &LessSafeKey, seq: &mut u64, bytes: &[u8]) -> io::Result<()> {
    let tags = record_tags(key, seq, bytes)?;
    write_records_and_tags(s, bytes, &tags)
}

/// A chunk's records, each followed by its tag, in one vectored write. (The loop is the
/// shape of `seal_writer`'s private `write_all_slices`, kept apart for the reason above.)
fn write_records_and_tags(s: &mut TcpStream, bytes: &[u8], tags: &[[u8; TAG_LEN]]) -> io::Result<()> {
    let mut slices: Vec<IoSlice> =
        bytes.chunks(RECORD).zip(tags).flat_map(|(r, t)| [IoSlice::new(r), IoSlice::new(t)]).collect();
    let mut slices = &mut slices[..];
    while !slices.is_empty() {
        match s.write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `tag-check`'s receiver of one chunk: each record and its tag read into `dst` and a
/// tag buffer (one system call for both where the socket holds them), then checked.
fn tag_check_recv(c: &mut TcpStream, key: &LessSafeKey, seq: &mut u64, dst: &mut [u8]) -> io::Result<usize> {
    let mut reads = 0;
    for rec in dst.chunks_mut(RECORD) {
        let mut tag = [0u8; TAG_LEN];
        let (mut r, mut t) = (0, 0);
        while r < rec.len() || t < TAG_LEN {
            let n = c.read_vectored(&mut [IoSliceMut::new(&mut rec[r..]), IoSliceMut::new(&mut tag[t..])])?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            reads += 1;
            let into_rec = n.min(rec.len() - r);
            r += into_rec;
            t += n - into_rec;
        }
        *seq += 1;
        if gmac(key, *seq, rec)? != tag {
            return Err(io::Error::other("bad tag"));
        }
    }
    Ok(reads)
}

/// Offset of call `k`: walking through the 256 MiB, or with `SPLICE_BENCH_FIXED=1` always
/// 0 (a window that stays in cache, to see the paths without memory's cost).
fn call_base(k: usize, total: usize) -> usize {
    static FIXED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *FIXED.get_or_init(|| std::env::var_os("SPLICE_BENCH_FIXED").is_some_and(|v| !v.is_empty())) {
        0
    } else {
        (k * total) % (WS - total + 1)
    }
}

/// The `PER_CALL` chunks call `k` sends, in order.
fn call_chunks(src: &[u8], k: usize, chunk: usize) -> std::slice::Chunks<'_, u8> {
    let total = PER_CALL * chunk;
    let base = call_base(k, total);
    src[base..base + total].chunks(chunk)
}

/// With `SPLICE_BENCH_SPLIT=1` the calling thread runs on CPU `cpu` only (the sender on
/// 0, the receiver on 1: the placement of the plain stream's fast mode on 2 cores).
fn pin(cpu: usize) {
    if std::env::var_os("SPLICE_BENCH_SPLIT").is_some_and(|v| !v.is_empty()) {
        // SAFETY: a zeroed cpu_set_t is empty; CPU_SET writes inside it; the call reads it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
}

fn thread_cpu_s() -> f64 {
    // SAFETY: rusage is plain integers (all-zero is a valid value), and getrusage writes
    // one into the struct we own.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_THREAD, &mut ru);
        ru
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// A pipe sized as large as the system allows (the splice path's staging of page refs).
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 fills the two-element array we own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just returned by pipe2 and are owned by nobody else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let max: i32 = std::fs::read_to_string("/proc/sys/fs/pipe-max-size")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(1 << 20);
    // SAFETY: fcntl on a pipe fd we own.
    unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, max) };
    Ok((r, w))
}

fn write_mode(s: &mut TcpStream, bytes: &[u8]) -> io::Result<()> {
    s.write_all(bytes)
}

fn splice_mode(s: &TcpStream, pr: &OwnedFd, pw: &OwnedFd, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        let iov = libc::iovec { iov_base: bytes.as_ptr() as *mut _, iov_len: bytes.len() };
        // SAFETY: the iovec points into `bytes`, alive for the call; vmsplice only reads.
        let n = unsafe { libc::vmsplice(pw.as_raw_fd(), &iov, 1, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut left = n as usize;
        while left > 0 {
            // SAFETY: plain fds, null offsets (pipe and socket have none).
            let m = unsafe {
                libc::splice(
                    pr.as_raw_fd(),
                    std::ptr::null_mut(),
                    s.as_raw_fd(),
                    std::ptr::null_mut(),
                    left,
                    libc::SPLICE_F_MOVE | libc::SPLICE_F_MORE,
                )
            };
            if m < 0 {
                return Err(io::Error::last_os_error());
            }
            left -= m as usize;
        }
        bytes = &bytes[n as usize..];
    }
    Ok(())
}

/// Receives `calls` calls of `PER_CALL x chunk` bytes at walking offsets; returns its
/// CPU-s and how many reads that took.
fn receiver(mut c: TcpStream, mode: &str, calls: usize, chunk: usize, first: usize) -> io::Result<(f64, usize)> {
    let mut dst = vec![0u8; WS];
    dst.iter_mut().step_by(4096).for_each(|b| *b = 1); // fault the pages in up front
    let total = PER_CALL * chunk;
    let key = gmac_key()?;
    let mut seq = 0u64;
    let framed = mode.starts_with("frames");
    let mut frames = FrameReader::new(c.try_clone()?, frame_key(mode));
    // Ready: the sender's clock starts after the destination's pages are in.
    c.write_all(b"r")?;
    let cpu0 = thread_cpu_s();
    let mut reads = 0usize;
    for k in first..first + calls {
        let base = call_base(k, total);
        if mode == "stream" {
            for i in 0..PER_CALL {
                let at = base + i * chunk;
                c.read_exact(&mut dst[at..at + chunk])?;
                reads += 1;
            }
        } else if mode == "tag-check" || mode == "tag-helper" {
            for i in 0..PER_CALL {
                let at = base + i * chunk;
                reads += tag_check_recv(&mut c, &key, &mut seq, &mut dst[at..at + chunk])?;
            }
        } else if framed {
            for i in 0..PER_CALL {
                let at = base + i * chunk;
                let mut head = [0u8; HEAD.len()];
                frames.read_exact(&mut head)?;
                frames
                    .read_payload_verified(&mut dst[at..at + chunk])
                    .map_err(|e| io::Error::other(format!("{e:?}")))?;
                reads += 1;
            }
        } else {
            let mut got = 0;
            while got < total {
                match c.read(&mut dst[base + got..base + total])? {
                    0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                    n => got += n,
                }
                reads += 1;
            }
        }
        c.write_all(b"a")?;
    }
    Ok((thread_cpu_s() - cpu0, reads))
}

struct Row {
    secs: f64,
    send_cpu: f64,
    /// `tag-helper`'s tagger thread (0 in the other modes).
    helper_cpu: f64,
    recv_cpu: f64,
    reads: usize,
    bytes: usize,
}

fn run(mode: &str, src: &'static [u8], calls: usize, chunk: usize, first: usize) -> io::Result<Row> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let recv_mode = mode.to_string();
    let rx = std::thread::Builder::new().name(format!("recv-{mode}")).spawn(move || -> io::Result<(f64, usize)> {
        pin(1);
        let (c, _) = l.accept()?;
        c.set_nodelay(true)?;
        receiver(c, &recv_mode, calls, chunk, first)
    })?;
    pin(0);
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let (pr, pw) = pipe()?;
    let total = PER_CALL * chunk;
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack)?; // the receiver is ready
    let cpu0 = thread_cpu_s();
    let t0 = Instant::now();
    let key = gmac_key()?;
    let mut frames = FrameWriter::new(s.try_clone()?, frame_key(mode));
    // Records tagged so far (one mode a connection).
    let mut seq = 0u64;
    // The tag-only modes compute the tags and drop them (black_box keeps the work).
    let tag = |seq: &mut u64, b: &[u8]| -> io::Result<()> {
        std::hint::black_box(record_tags(&key, seq, b)?);
        Ok(())
    };
    // `tag-helper`: the tags come from a tagger thread, so this thread only writes.
    let (helper_tags, tagger) = if mode == "tag-helper" {
        let (tags, tagger) = spawn_tagger(gmac_key()?, src, first..first + calls, chunk);
        (Some(tags), Some(tagger))
    } else {
        (None, None)
    };
    for k in first..first + calls {
        for b in call_chunks(src, k, chunk) {
            match mode {
                "write" | "stream" => write_mode(&mut s, b)?,
                "splice" => splice_mode(&s, &pr, &pw, b)?,
                "tag-write" => {
                    tag(&mut seq, b)?;
                    write_mode(&mut s, b)?
                }
                "write-tag" => {
                    write_mode(&mut s, b)?;
                    tag(&mut seq, b)?
                }
                "tag-splice" => {
                    tag(&mut seq, b)?;
                    splice_mode(&s, &pr, &pw, b)?
                }
                "tag-check" => tag_check_send(&mut s, &key, &mut seq, b)?,
                "tag-helper" => {
                    let tags = helper_tags
                        .as_ref()
                        .and_then(|h| h.recv().ok())
                        .ok_or_else(|| io::Error::other("tagger ended"))??;
                    write_records_and_tags(&mut s, b, &tags)?
                }
                "frames" | "frames-none" => frames.send(&HEAD, b)?,
                _ => return Err(io::Error::other(format!("unknown mode {mode}"))),
            }
        }
        s.read_exact(&mut ack)?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let send_cpu = thread_cpu_s() - cpu0;
    let helper_cpu = tagger.map_or(0.0, |t| t.join().unwrap_or(f64::NAN));
    let (recv_cpu, reads) = rx.join().map_err(|_| io::Error::other("receiver panicked"))??;
    Ok(Row { secs, send_cpu, helper_cpu, recv_cpu, reads, bytes: calls * total })
}

/// One chunk's record tags, as the tagger hands them to the sender.
type ChunkTags = io::Result<Vec<[u8; TAG_LEN]>>;

/// `tag-helper`'s tagger: tags the chunks of `calls` in the order the sender writes them,
/// up to [`tagger_ahead`] chunks ahead; returns the tags' channel and the thread, which
/// reports its CPU-s and ends early when the sender drops the channel.
fn spawn_tagger(
    key: LessSafeKey,
    src: &'static [u8],
    calls: std::ops::Range<usize>,
    chunk: usize,
) -> (Receiver<ChunkTags>, JoinHandle<f64>) {
    let (tx, rx) = std::sync::mpsc::sync_channel(tagger_ahead());
    let tagger = std::thread::spawn(move || {
        let cpu0 = thread_cpu_s();
        let mut seq = 0u64;
        for b in calls.flat_map(|k| call_chunks(src, k, chunk)) {
            if tx.send(record_tags(&key, &mut seq, b)).is_err() {
                break;
            }
        }
        thread_cpu_s() - cpu0
    });
    (rx, tagger)
}

/// CPU-seconds per GB of GMAC on this thread with the bytes in cache (the cheapest a MAC
/// pass can be here): `bytes` tagged record by record for ~0.1 s.
fn gmac_cpu_s_per_gb(bytes: &[u8]) -> io::Result<f64> {
    let key = gmac_key()?;
    let mut seq = 0u64;
    std::hint::black_box(record_tags(&key, &mut seq, bytes)?); // warm
    let (cpu0, mut done) = (thread_cpu_s(), 0usize);
    while thread_cpu_s() - cpu0 < 0.1 {
        std::hint::black_box(record_tags(&key, &mut seq, bytes)?);
        done += bytes.len();
    }
    Ok((thread_cpu_s() - cpu0) / (done as f64 / 1e9))
}

/// Chunks the `tag-helper` tagger may run ahead (`SPLICE_BENCH_AHEAD`, default 2).
fn tagger_ahead() -> usize {
    std::env::var("SPLICE_BENCH_AHEAD").ok().and_then(|v| v.parse().ok()).unwrap_or(2)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() -> io::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let rounds = args.first().copied().unwrap_or(5);
    let calls = args.get(1).copied().unwrap_or(16);
    let chunk = args.get(2).copied().unwrap_or(512) << 10;
    let modes: Vec<String> = std::env::var("SPLICE_BENCH_MODES")
        .unwrap_or_else(|_| "write,splice".into())
        .split(',')
        .map(str::to_string)
        .collect();
    // Leaked: `tag-helper`'s tagger thread reads it too.
    let src: &'static mut [u8] = Vec::leak(vec![0u8; WS]);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for w in src.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
    }
    println!("{} x {} KiB a call, {} calls a mode a round, {} rounds", PER_CALL, chunk >> 10, calls, rounds);
    println!("round mode        GB/s  send_cpu_s/GB tagger_cpu_s/GB recv_cpu_s/GB total_cpu_s/GB reads/MiB");
    // per mode after the first: (throughput, CPU per byte) relative to the first, per round
    let mut rel: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); modes.len()];
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    for r in 0..rounds {
        let mut first: Option<(f64, f64)> = None;
        // The cheapest CPU per byte of a mode without a MAC this round, and the first
        // mode's GB/s: what the ceiling below is computed from.
        let (mut plain_cpu, mut ref_gbs) = (f64::INFINITY, f64::NAN);
        for (m, mode) in modes.iter().enumerate() {
            let row = run(mode, src, calls, chunk, r * calls)?;
            let gb = row.bytes as f64 / 1e9;
            let cpu = (row.send_cpu + row.helper_cpu + row.recv_cpu) / gb;
            if m == 0 {
                ref_gbs = gb / row.secs;
            }
            if NO_MAC_MODES.contains(&mode.as_str()) {
                plain_cpu = plain_cpu.min(cpu);
            }
            println!(
                "{r:5} {mode:10} {:6.2} {:13.3} {:15.3} {:13.3} {:14.3} {:9.1}",
                gb / row.secs,
                row.send_cpu / gb,
                row.helper_cpu / gb,
                row.recv_cpu / gb,
                cpu,
                row.reads as f64 / (row.bytes as f64 / (1 << 20) as f64)
            );
            let (secs0, cpu0) = *first.get_or_insert((row.secs, cpu));
            rel[m].0.push(secs0 / row.secs);
            rel[m].1.push(cpu / cpu0);
        }
        if plain_cpu.is_finite() {
            // Any integrity-only stream tags every byte at the sender and checks it at the
            // receiver: at least two MAC passes on top of moving the bytes, and the host
            // has `cpus` CPU-seconds a second.
            let mac = gmac_cpu_s_per_gb(&src[..chunk])?;
            let ceiling = cpus / ((plain_cpu + 2.0 * mac) * ref_gbs);
            println!(
                "{r:5} ceiling of any integrity stream: {ceiling:.2}x of {} ({cpus} CPUs; moving the bytes {plain_cpu:.3} + 2 x GMAC {mac:.3} CPU-s/GB)",
                modes[0]
            );
        }
    }
    for (mode, (speed, cpu)) in modes.iter().zip(rel).skip(1) {
        println!(
            "{mode} / {}: throughput median {:.2}x, CPU per byte median {:.2}x (per-round ratios)",
            modes[0],
            median(speed),
            median(cpu)
        );
    }
    Ok(())
}
