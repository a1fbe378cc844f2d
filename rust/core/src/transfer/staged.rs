//! Initiating side of the staged path (see [`super::staged_server`]): writes into and
//! reads from a same-host peer's restricted region through a staging buffer the peer's
//! server handed us (an fd over a unix socket), each chunk committed and checked against
//! the live grants by that server before it copies the chunk in (a write) or out into the
//! buffer (a read, which we then copy from the buffer into its destination when the
//! answer says it was allowed).
//!
//! One link per peer server, one worker thread per link. The buffer is a ring of chunks
//! (at most [`CHUNK`] bytes each): the worker takes every write queued (a batch's writes
//! to this peer arrive together), copies them chunk by chunk into free space and sends
//! the chunks in commits of up to [`FLUSH_BYTES`] without waiting, up to a full buffer
//! (or `MAX_COMMIT_CHUNKS` chunks) in flight, and reads the answers (in order, one per
//! commit) when it needs the space back or has nothing else to do. So the server copies
//! commit k out while the worker copies commit k+1 in, and a batch of many small
//! requests (serving writes one span per block and layer) costs one round trip, not one
//! a chunk: a round trip per chunk made a serving step's eight 128 KiB spans sixteen
//! wake-ups, each a scheduling delay on a busy host. A small batch is committed by
//! `submit_many` itself (below), and then the answer is its only wake-up here; so are
//! a larger batch's leading reads (they cost `submit` no copy, only frames).
//!
//! A read's chunks take the same ring: space is reserved (nothing copied in), the commit
//! (all reads) goes out, and `apply` copies each chunk from the buffer into the request's
//! destination when its answer says the server checked and copied it; so a read commit
//! k+1 is filled by the server while the worker copies commit k out. A commit carries
//! one op, so an open commit is sent when the next chunk's op differs.
//!
//! In one-copy mode (`staged_direct`; the server said yes to it at connect) no chunk goes
//! through the buffer: each names the address of its bytes in the request's own memory,
//! which the server copies to or from itself, and the request is held (`begin_io`) until
//! the answer. Nothing is copied here, so `submit_many` commits a whole batch at once.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};

use super::auth::AuthKey;
use super::batch::Batch;
use super::config::StagedCopy;
use super::fdpass;
use super::local::Span;
use super::protocol::status_from_u8;
use super::staged_ring::{seal_commit, Chunk, Ring};
use super::staged_server::{mode_request, MAX_COMMIT_CHUNKS, REPLY_HEAD_LEN, STATUS_COPY_FAILED};
use super::tcp::handshake;
use super::Op;
use super::TransferError;
use crate::mem::MappedMemory;

/// One request (its local side checked) to a restricted region of the peer.
pub struct StagedRequest {
    pub op: Op,
    pub batch: Arc<Batch>,
    pub index: usize,
    pub local: Span,
    pub region: u64,
    pub offset: u64,
    pub len: u64,
}

/// Most bytes one chunk moves.
pub const CHUNK: u64 = 1 << 20;
/// Bytes after which the worker sends an open commit even if more requests are queued,
/// so the two copies overlap: the server copies commit k into the region while the
/// worker copies commit k+1 into the buffer (a read: the worker copies commit k out
/// while the server fills k+1). Measured against 2 MiB (one commit for a 16 x 128 KiB
/// batch, the copies in series) and 128/256 KiB (more commits, no faster): BENCHMARKS.md,
/// "k26s". A batch `submit_many` commits itself (at most 1 MiB) stays one commit.
const FLUSH_BYTES: u64 = 512 << 10;
pub use super::stream_copy::STREAMING_MIN;

pub struct StagedLink {
    stream: UnixStream,
    staging: MappedMemory,
    /// Commits in flight, the open commit and where the next chunk goes. Whoever holds it
    /// may copy into the buffer and send commits: the worker, or `submit_many` (which only
    /// tries it, never waits for it). Nobody holds it while blocked reading an answer
    /// unless the buffer is full. Lock order: the ring, then the send lock or the queue.
    ring: Mutex<Ring>,
    /// Held while a commit's frame is written (taken while holding the ring, which may
    /// then be let go), so frames go out in the ring's order.
    send_lock: Mutex<()>,
    queue: Mutex<VecDeque<StagedRequest>>,
    /// An eventfd rung when writes are queued; the idle worker waits on it and on the
    /// socket together, so an answer to a commit sent from `submit_many` wakes it with no
    /// second wake-up to tell it a commit went out.
    bell: OwnedFd,
    dead: AtomicBool,
    /// The server copies each chunk itself between the region and our request's own
    /// memory (one copy; see `staged_direct`): no chunk touches the staging buffer.
    direct: bool,
    inline_commits: AtomicU64,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl StagedLink {
    /// Connects to the peer's staging socket `name`, passes the handshake as `local_name`,
    /// maps the staging buffer it hands over and asks for one-copy mode when `copy` is
    /// [`StagedCopy::Direct`] (the server says whether it can).
    pub fn connect(
        name: &str,
        key: Option<&AuthKey>,
        local_name: &str,
        io_timeout: Duration,
        copy: StagedCopy,
    ) -> Result<Arc<StagedLink>, TransferError> {
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(TransferError::io)?;
        let mut s =
            UnixStream::connect_addr(&addr).map_err(|e| TransferError::Connect(format!("staging socket: {e}")))?;
        s.set_read_timeout(Some(io_timeout)).map_err(TransferError::io)?;
        s.set_write_timeout(Some(io_timeout)).map_err(TransferError::io)?;
        handshake::client(&mut s, key, local_name)?;
        let mut len = [0u8; 8];
        let fd = fdpass::recv_with_fd(&s, &mut len).map_err(TransferError::io)?;
        let len = u64::from_le_bytes(len) as usize;
        // The buffer must not be able to shrink under our copies, and must be what it says.
        let size = fdpass::sealed_len(fd.as_fd()).map_err(TransferError::io)?;
        if len < 2 || size < len {
            return Err(TransferError::Protocol(format!("staging buffer of {size} bytes announced as {len}")));
        }
        let staging = MappedMemory::map_fd(fd.as_fd(), len).map_err(TransferError::io)?;
        let direct = ask_mode(&s, copy)?;
        let link = Arc::new(StagedLink {
            stream: s,
            staging,
            ring: Mutex::new(Ring::default()),
            send_lock: Mutex::new(()),
            queue: Mutex::new(VecDeque::new()),
            bell: new_bell().map_err(TransferError::io)?,
            dead: AtomicBool::new(false),
            direct,
            inline_commits: AtomicU64::new(0),
            worker: Mutex::new(None),
        });
        let l2 = link.clone();
        let h = std::thread::Builder::new()
            .name("mc-stage-send".into())
            .spawn(move || l2.run())
            .map_err(TransferError::io)?;
        *link.worker.lock() = Some(h);
        Ok(link)
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Whether the server copies chunks directly to and from our memory (one copy).
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Bytes per commit: [`CHUNK`], or a quarter of a smaller staging buffer.
    pub fn chunk(&self) -> u64 {
        CHUNK.min((self.staging.len() / 4).max(1) as u64)
    }

    /// Commits `submit_many` sent from the submitting thread (for tests and stats).
    pub fn inline_commits(&self) -> u64 {
        self.inline_commits.load(Ordering::Relaxed)
    }

    /// Queues a write; its request must have `ceil(len / chunk())` slices set.
    pub fn submit(&self, w: StagedRequest) {
        self.submit_many(vec![w], false);
    }

    /// Sends a batch's writes to this peer (each request with `ceil(len / chunk())`
    /// slices set). With `inline` (the caller keeps it to what shm copies inside
    /// `submit`), when nothing is queued and the ring is free, the writes that fit
    /// without waiting for an answer, each whole, are copied and committed here, in one
    /// commit: the caller's thread is running now, while the worker's wake-up is a
    /// scheduling delay, milliseconds on a busy host (it was most of a serving batch's
    /// time in flight). Without `inline`, the leading reads that fit are committed here
    /// the same way (in commits of [`FLUSH_BYTES`]; a read costs no copy here). The rest
    /// is queued; the worker sends it and reads every answer.
    pub fn submit_many(&self, ws: Vec<StagedRequest>, inline: bool) {
        if self.is_dead() {
            for w in ws {
                w.batch.fail(w.index, TransferError::ConnectionLost("the staging link is closed".into()));
            }
            return;
        }
        let mut ws = VecDeque::from(ws);
        // A small batch is copied and committed here; a larger one's leading reads are
        // committed here (no copy), so the server starts on them without waiting for the
        // worker's wake-up.
        // One-copy mode costs `submit` no copy at all: everything that fits is committed here.
        let inline = inline || self.direct;
        if inline || ws.front().is_some_and(|w| w.op == Op::Read) {
            if let Some(ring) = self.ring.try_lock() {
                // Behind queued writes, commits would overtake them: only with none queued.
                // (A `let`, so the queue's guard ends here, not after the commit is written.)
                let none_queued = self.queue.lock().is_empty();
                if none_queued && self.commit_fitting(&mut ws, ring, inline).is_err() {
                    // Every chunk copied here is in the ring, and the rest is queued below:
                    // the worker sees the link dead and fails them all.
                    self.dead.store(true, Ordering::SeqCst);
                    let _ = self.stream.shutdown(std::net::Shutdown::Both);
                }
            }
        }
        // The worker sees the answer to what was committed here on the socket; the rest it
        // is rung for (it also fails everything if the link died meanwhile).
        if !ws.is_empty() || self.is_dead() {
            self.queue.lock().extend(ws);
            self.ring_bell();
        }
    }

    fn ring_bell(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd; a full counter
        // (EAGAIN) already wakes the worker.
        unsafe { libc::write(self.bell.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Waits until writes are queued or the socket has something to read (an answer, or
    /// its end); whether the socket was the reason.
    fn wait_idle(&self) -> bool {
        let mut fds = [
            libc::pollfd { fd: self.bell.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: self.stream.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        loop {
            // SAFETY: two valid pollfds in a live array, their fds owned by self.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
            if n >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                break;
            }
        }
        if fds[0].revents != 0 {
            let mut buf = [0u8; 8];
            // SAFETY: reads 8 bytes into a live buffer from our nonblocking eventfd.
            unsafe { libc::read(self.bell.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
        }
        fds[1].revents != 0
    }

    /// Copies and commits the leading requests of `ws` whose chunks all fit now; stops
    /// at the first that does not, leaving it and the rest in `ws`. With `whole` (a small
    /// batch) everything goes in one commit; without it only reads are taken (they cost
    /// `submit` no copy, only a frame), in commits of [`FLUSH_BYTES`], so the server
    /// starts filling the first while the rest are sent.
    /// The ring is let go before the commit is written: writing wakes the server, which
    /// may take this CPU from us for milliseconds on a busy host, and the worker must not
    /// wait that long for the ring to report the answer.
    fn commit_fitting(
        &self,
        ws: &mut VecDeque<StagedRequest>,
        mut ring: MutexGuard<'_, Ring>,
        whole: bool,
    ) -> Result<(), TransferError> {
        let (chunk, cap) = (self.chunk(), self.staging.len() as u64);
        ring.one_commit = whole;
        let first_id = ring.next_id;
        let mut copied = Ok(());
        while let Some(w) = ws.front() {
            // Whole requests only (the worker takes the rest from the start of one), and
            // of the open commit's op.
            let other_op = !ring.open.is_empty() && ring.open_read != (w.op == Op::Read);
            let not_taken = !whole && w.op != Op::Read;
            let fits = if self.direct {
                ring.in_flight + ring.open.len() + w.len.div_ceil(chunk) as usize <= MAX_COMMIT_CHUNKS
            } else {
                w.len <= chunk && ring.place(w.len, cap).is_some()
            };
            if !fits || other_op || not_taken {
                break;
            }
            let Some(w) = ws.pop_front() else { break };
            copied = self.copy_write(&w, &mut ring, chunk, cap);
            if copied.is_err() {
                break;
            }
        }
        ring.one_commit = false;
        // Commits `copy_write` sent on the way (a large batch's reads), and the last one.
        let sent_on_the_way = ring.next_id - first_id;
        self.inline_commits.fetch_add(sent_on_the_way + u64::from(!ring.open.is_empty()), Ordering::Relaxed);
        copied?;
        if ring.open.is_empty() {
            return Ok(());
        }
        let frame = seal_commit(&mut ring, self.direct);
        // Frames go out in the order their commits entered the ring.
        let sending = self.send_lock.lock();
        drop(ring);
        let sent = (&self.stream).write_all(&frame);
        drop(sending);
        sent.map_err(|e| TransferError::ConnectionLost(format!("staging link: {e}")))
    }

    /// Stops the worker; queued and pending writes fail as closed.
    pub fn close(&self) {
        self.dead.store(true, Ordering::SeqCst);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        self.ring_bell();
        let h = self.worker.lock().take();
        if let Some(h) = h {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }

    /// Nothing in flight and the worker not holding the ring (so `submit_many` may commit).
    #[cfg(test)]
    pub(crate) fn is_idle(&self) -> bool {
        self.ring.try_lock().is_some_and(|r| r.pending.is_empty())
    }

    #[cfg(test)]
    pub(crate) fn staging_bytes(&self) -> Vec<u8> {
        // SAFETY: the mapping is staging.len() bytes; a test reads it after the writes ended.
        unsafe { std::slice::from_raw_parts(self.staging.as_ptr(), self.staging.len()) }.to_vec()
    }

    fn run(&self) {
        let mut writes: VecDeque<StagedRequest> = VecDeque::new();
        let mut readable = false;
        let err = loop {
            let mut ring = self.ring.lock();
            {
                let mut q = self.queue.lock();
                if q.is_empty() && ring.pending.is_empty() && !self.is_dead() {
                    if readable {
                        // Bytes or the end with no commit out: the server closed (or broke) the link.
                        break TransferError::ConnectionLost("the staging server closed the link".into());
                    }
                    // Idle: free the ring for `submit_many` before sleeping. Both wake-ups are
                    // levels (an answer waiting, the bell's count), so a commit or a queued
                    // write made meanwhile is never missed.
                    drop(q);
                    drop(ring);
                    readable = self.wait_idle();
                    continue;
                }
                readable = false;
                // Everything queued now goes out in as few commits as the buffer allows.
                writes.extend(q.drain(..));
            }
            if self.is_dead() {
                break TransferError::Closed;
            }
            if !writes.is_empty() {
                if let Err(e) = self.write_chunks(&mut writes, &mut ring) {
                    break e;
                }
                continue;
            }
            // Only answers to wait for: read the oldest without holding the ring, so
            // `submit_many` can commit meanwhile. Only this thread takes answers off.
            let expect = ring.pending.front().map(|p| (p.id, p.chunks.len()));
            drop(ring);
            let Some((id, count)) = expect else { continue };
            let reply = self.read_answer(count);
            let mut ring = self.ring.lock();
            if let Err(e) = ring
                .pending
                .front()
                .filter(|p| p.id == id)
                .ok_or(TransferError::Closed)
                .and(reply)
                .and_then(|r| self.apply(&mut ring, id, &r))
            {
                break e;
            }
        };
        self.dead.store(true, Ordering::SeqCst);
        let mut ring = self.ring.lock();
        let chunks = ring
            .pending
            .drain(..)
            .flat_map(|p| p.chunks)
            .collect::<Vec<_>>()
            .into_iter()
            .chain(ring.open.drain(..).collect::<Vec<_>>());
        for c in chunks {
            c.release();
            c.batch.fail(c.index, err.clone());
        }
        let left = self.queue.lock().drain(..).collect::<Vec<_>>();
        for w in writes.drain(..).chain(left) {
            w.batch.fail(w.index, err.clone());
        }
    }

    /// Copies the queued writes chunk by chunk into free space of the buffer, gathering
    /// the chunks into commits (one per [`FLUSH_BYTES`], or whenever the buffer is full,
    /// and one at the end) sent without waiting; answers are read only when their space
    /// is needed. A write that fails here stays at the front of `writes`.
    fn write_chunks(&self, writes: &mut VecDeque<StagedRequest>, ring: &mut Ring) -> Result<(), TransferError> {
        let (chunk, cap) = (self.chunk(), self.staging.len() as u64);
        while let Some(w) = writes.front() {
            self.copy_write(w, ring, chunk, cap)?;
            writes.pop_front();
        }
        if !ring.open.is_empty() {
            self.send(ring)?;
        }
        Ok(())
    }

    /// Puts one request chunk by chunk into the open commit, sending it every
    /// [`FLUSH_BYTES`] (or when the next chunk's op differs: a commit is all writes or
    /// all reads) and making space (sending, then reading answers) when needed. A write's
    /// chunk is copied into its space now; a read's space is only reserved, for the
    /// server to fill and `apply` to copy out.
    fn copy_write(&self, w: &StagedRequest, ring: &mut Ring, chunk: u64, cap: u64) -> Result<(), TransferError> {
        let read = w.op == Op::Read;
        let mut off = 0u64;
        while off < w.len {
            if w.batch.is_finished(w.index) {
                return Ok(()); // cancelled, timed out or refused: send nothing more of it
            }
            if !ring.open.is_empty() && ring.open_read != read {
                self.send(ring)?;
            }
            let n = (w.len - off).min(chunk);
            // SAFETY: `off + n <= len`, checked against the local region at submit, which
            // `w.local` keeps mapped: the pointer stays inside it.
            let local_ptr = unsafe { w.local.ptr.add(off as usize) };
            let span = || Span { keep: w.local.keep.clone(), ptr: local_ptr };
            // Where the chunk's bytes are for the server: the request's own memory (one
            // copy), or space in the buffer; and what the chunk holds of the request.
            let (at, read_into, held) = if self.direct {
                // Only the count of chunks in flight bounds a one-copy commit.
                while ring.in_flight + ring.open.len() >= MAX_COMMIT_CHUNKS {
                    if ring.open.is_empty() {
                        self.settle(ring)?
                    } else {
                        self.send(ring)?
                    }
                }
                // The server reads (a write) or fills (a read) these bytes until it answers:
                // the request must not end, nor its memory go back to the caller, before.
                // The answer (or the link's end) lets go of it.
                if !w.batch.begin_io(w.index) {
                    return Ok(());
                }
                (local_ptr as u64, None, Some(span()))
            } else {
                let at = loop {
                    match ring.place(n, cap) {
                        Some(at) => break at,
                        None if !ring.open.is_empty() => self.send(ring)?,
                        None => self.settle(ring)?,
                    }
                };
                if !read {
                    if !w.batch.begin_io(w.index) {
                        return Ok(());
                    }
                    // SAFETY: the local range was checked at submit and `w.local` keeps it
                    // mapped; begin_io keeps the request from ending (and its buffer being
                    // reused) while we read it. `at + n` <= the staging mapping's length
                    // (place), and no commit in flight or open covers those bytes, so the
                    // server is not reading them.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            local_ptr as *const u8,
                            self.staging.as_ptr().add(at as usize),
                            n as usize,
                        )
                    };
                    w.batch.end_io(w.index);
                }
                // Only a read keeps (a clone of) its destination's span.
                (at, read.then(span), None)
            };
            ring.open_read = read;
            ring.open.push(Chunk {
                batch: w.batch.clone(),
                index: w.index,
                region: w.region,
                offset: w.offset + off,
                at,
                len: n,
                read_into,
                held,
            });
            ring.open_bytes += n;
            off += n;
            if self.direct {
                continue; // (no buffer space taken; commits are bounded by their chunk count)
            }
            ring.head = at + n;
            if ring.open_bytes >= FLUSH_BYTES && !ring.one_commit {
                self.send(ring)?;
            }
        }
        Ok(())
    }

    /// Sends the open commit: one frame for all its chunks.
    fn send(&self, ring: &mut Ring) -> Result<(), TransferError> {
        let frame = seal_commit(ring, self.direct);
        let _sending = self.send_lock.lock();
        (&self.stream).write_all(&frame).map_err(|e| TransferError::ConnectionLost(format!("staging link: {e}")))
    }

    /// Reads the answer to the oldest commit in flight (holding the ring: the buffer is
    /// full) and reports its chunks.
    fn settle(&self, ring: &mut Ring) -> Result<(), TransferError> {
        let Some((id, count)) = ring.pending.front().map(|p| (p.id, p.chunks.len())) else { return Ok(()) };
        let reply = self.read_answer(count)?;
        self.apply(ring, id, &reply)
    }

    /// The answer to a commit of `count` chunks, its id checked later by `apply`.
    fn read_answer(&self, count: usize) -> Result<Vec<u8>, TransferError> {
        let mut reply = vec![0u8; REPLY_HEAD_LEN + count];
        (&self.stream)
            .read_exact(&mut reply)
            .map_err(|e| TransferError::ConnectionLost(format!("staging link: {e}")))?;
        Ok(reply)
    }

    /// Takes the oldest commit (`id`) off the ring and reports each chunk's status from
    /// `reply`; a reply that does not match fails the commit's chunks and the link.
    fn apply(&self, ring: &mut Ring, id: u64, reply: &[u8]) -> Result<(), TransferError> {
        let Some(p) = ring.pending.pop_front() else { return Err(TransferError::Closed) };
        ring.in_flight -= p.chunks.len();
        let rid = u64::from_le_bytes(reply[..8].try_into().unwrap_or_default());
        let count = u32::from_le_bytes(reply[8..12].try_into().unwrap_or_default());
        // A one-copy chunk's copy that failed (a bad address of ours) is `None` here.
        let statuses: Result<Vec<_>, _> = reply[REPLY_HEAD_LEN..]
            .iter()
            .map(|&b| if b == STATUS_COPY_FAILED && self.direct { Ok(None) } else { status_from_u8(b).map(Some) })
            .collect();
        let statuses = match statuses {
            Ok(s) if rid == id && p.id == id && count as usize == p.chunks.len() => s,
            _ => {
                let e = TransferError::Protocol("bad answer on the staging link".into());
                for c in &p.chunks {
                    c.release();
                    c.batch.fail(c.index, e.clone());
                }
                return Err(e);
            }
        };
        for (c, status) in p.chunks.iter().zip(statuses) {
            // The server is done with a one-copy chunk's memory once it answered.
            c.release();
            match status {
                None => c.batch.fail(
                    c.index,
                    TransferError::Io(format!(
                        "the peer's server could not copy {} bytes to or from this process's memory",
                        c.len
                    )),
                ),
                Some(Ok(())) => {
                    if let Some(dst) = &c.read_into {
                        if !c.batch.begin_io(c.index) {
                            continue; // ended meanwhile: its buffer is the caller's again
                        }
                        // SAFETY: the server filled `at..at + len` of the staging buffer
                        // (inside its mapping: `place`) before answering, and nothing
                        // else is placed there until this commit leaves the ring (we hold
                        // it). `dst` is `len` bytes of the request's checked, writable
                        // local range, kept mapped by its span; begin_io keeps the request
                        // from ending while we write it.
                        unsafe {
                            let staged = self.staging.as_ptr().add(c.at as usize) as *const u8;
                            super::stream_copy::copy_last_leg(dst.ptr, staged, c.len as usize)
                        };
                        c.batch.end_io(c.index);
                    }
                    c.batch.slice_done(c.index, c.len)
                }
                Some(Err(reason)) => {
                    c.batch.fail(c.index, TransferError::Refused { side: "peer", region: c.region, reason })
                }
            }
        }
        Ok(())
    }
}

/// Sends the mode request that follows the staging buffer (see `staged_server::MODE_LEN`)
/// and reads the answer: whether the server copies directly from now on. For one-copy
/// mode the server reads a fresh nonce at an address we name, so it knows it reached
/// this process (the pid it took from the socket).
fn ask_mode(s: &UnixStream, copy: StagedCopy) -> Result<bool, TransferError> {
    let random = super::auth::nonce().map_err(TransferError::io)?;
    let mut nonce = Box::new([0u8; super::staged_direct::NONCE_LEN]);
    let n = nonce.len().min(random.len());
    nonce[..n].copy_from_slice(&random[..n]);
    let m = mode_request(copy == StagedCopy::Direct, nonce.as_ptr() as u64, &nonce);
    let mut answer = [0u8; 1];
    let lost = |e: std::io::Error| TransferError::ConnectionLost(format!("staging link: {e}"));
    (&*s).write_all(&m).map_err(lost)?;
    // The nonce must stay where we said until the server answered.
    (&*s).read_exact(&mut answer).map_err(lost)?;
    drop(nonce);
    match answer[0] {
        0 => Ok(false),
        1 if copy == StagedCopy::Direct => Ok(true),
        b => Err(TransferError::Protocol(format!("staging mode answer {b}"))),
    }
}

/// A nonblocking eventfd.
fn new_bell() -> std::io::Result<OwnedFd> {
    // SAFETY: eventfd has no memory preconditions; a valid fd is owned from here on.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Drop for StagedLink {
    fn drop(&mut self) {
        self.dead.store(true, Ordering::SeqCst);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}
