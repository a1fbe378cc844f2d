//! Initiating side of the staged path (see [`super::staged_server`]): writes into a
//! same-host peer's restricted region through a staging buffer the peer's server handed
//! us (an fd over a unix socket), each chunk committed and checked against the live
//! grants by that server before it copies the chunk in.
//!
//! One link per peer server, one worker thread per link. The buffer is a ring of chunks
//! (at most [`CHUNK`] bytes each): the worker copies a chunk into free space and sends
//! its commit without waiting, up to a full buffer of commits in flight, and reads the
//! answers (which come in order) when it needs the space back or has nothing else to do.
//! So the server copies chunk k out while the worker copies chunk k+1 in, and a batch
//! of many small requests (serving writes one span per layer) costs no round trip per
//! request: a round trip per commit made the first version latency-bound (0.1 GB/s on
//! a loaded host).

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::auth::AuthKey;
use super::batch::Batch;
use super::fdpass;
use super::local::Span;
use super::protocol::status_from_u8;
use super::staged_server::{COMMIT_LEN, REPLY_LEN};
use super::tcp::handshake;
use super::TransferError;
use crate::mem::MappedMemory;

/// One write request (its local side checked) to a restricted region of the peer.
pub struct StagedWrite {
    pub batch: Arc<Batch>,
    pub index: usize,
    pub local: Span,
    pub region: u64,
    pub offset: u64,
    pub len: u64,
}

/// Most bytes one commit moves.
pub const CHUNK: u64 = 1 << 20;
/// Most commits in flight: their 40-byte commits and 9-byte answers stay far below the
/// socket buffers, so neither side can block writing while the other does.
const MAX_IN_FLIGHT: usize = 256;

/// A chunk whose commit is out, waiting for its answer; its bytes `at..at + len` of
/// the staging buffer stay untouched until then.
struct Pending {
    batch: Arc<Batch>,
    index: usize,
    region: u64,
    id: u64,
    at: u64,
    len: u64,
}

/// The worker's state: commits in flight (oldest first) and where the next chunk goes.
#[derive(Default)]
struct Ring {
    pending: VecDeque<Pending>,
    head: u64,
    next_id: u64,
}

impl Ring {
    /// Where `n` bytes can go now without touching a chunk in flight, if anywhere.
    fn place(&self, n: u64, cap: u64) -> Option<u64> {
        if self.pending.is_empty() {
            return Some(0);
        }
        if self.pending.len() >= MAX_IN_FLIGHT {
            return None;
        }
        let at = if self.head + n <= cap { self.head } else { 0 };
        let clear = self.pending.iter().all(|p| at + n <= p.at || p.at + p.len <= at);
        clear.then_some(at)
    }
}

pub struct StagedLink {
    stream: UnixStream,
    staging: MappedMemory,
    queue: Mutex<VecDeque<StagedWrite>>,
    work: Condvar,
    dead: AtomicBool,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl StagedLink {
    /// Connects to the peer's staging socket `name`, passes the handshake as `local_name`
    /// and maps the staging buffer it hands over.
    pub fn connect(name: &str, key: Option<&AuthKey>, local_name: &str, io_timeout: Duration) -> Result<Arc<StagedLink>, TransferError> {
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(TransferError::io)?;
        let mut s = UnixStream::connect_addr(&addr).map_err(|e| TransferError::Connect(format!("staging socket: {e}")))?;
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
        let link = Arc::new(StagedLink {
            stream: s,
            staging,
            queue: Mutex::new(VecDeque::new()),
            work: Condvar::new(),
            dead: AtomicBool::new(false),
            worker: Mutex::new(None),
        });
        let l2 = link.clone();
        let h = std::thread::Builder::new().name("mc-stage-send".into()).spawn(move || l2.run()).map_err(TransferError::io)?;
        *link.worker.lock() = Some(h);
        Ok(link)
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Bytes per commit: [`CHUNK`], or a quarter of a smaller staging buffer.
    pub fn chunk(&self) -> u64 {
        CHUNK.min((self.staging.len() / 4).max(1) as u64)
    }

    /// Queues a write; its request must have `ceil(len / chunk())` slices set.
    pub fn submit(&self, w: StagedWrite) {
        if self.is_dead() {
            w.batch.fail(w.index, TransferError::ConnectionLost("the staging link is closed".into()));
            return;
        }
        self.queue.lock().push_back(w);
        self.work.notify_one();
    }

    /// Stops the worker; queued and pending writes fail as closed.
    pub fn close(&self) {
        self.dead.store(true, Ordering::SeqCst);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        drop(self.queue.lock());
        self.work.notify_all();
        let h = self.worker.lock().take();
        if let Some(h) = h {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn staging_bytes(&self) -> Vec<u8> {
        // SAFETY: the mapping is staging.len() bytes; a test reads it after the writes ended.
        unsafe { std::slice::from_raw_parts(self.staging.as_ptr(), self.staging.len()) }.to_vec()
    }

    fn run(&self) {
        let mut ring = Ring::default();
        let err = loop {
            let next = {
                let mut q = self.queue.lock();
                loop {
                    if self.is_dead() {
                        break None;
                    }
                    if let Some(w) = q.pop_front() {
                        break Some(w);
                    }
                    if !ring.pending.is_empty() {
                        break None; // collect an answer, then look again
                    }
                    self.work.wait(&mut q);
                }
            };
            let Some(w) = next else {
                if self.is_dead() {
                    break TransferError::Closed;
                }
                if let Err(e) = self.settle(&mut ring) {
                    break e;
                }
                continue;
            };
            if let Err(e) = self.write_chunks(&w, &mut ring) {
                w.batch.fail(w.index, e.clone());
                break e;
            }
        };
        self.dead.store(true, Ordering::SeqCst);
        for p in ring.pending.drain(..) {
            p.batch.fail(p.index, err.clone());
        }
        let left: Vec<StagedWrite> = self.queue.lock().drain(..).collect();
        for w in left {
            w.batch.fail(w.index, err.clone());
        }
    }

    /// Copies `w` chunk by chunk into free space of the buffer and commits each chunk
    /// without waiting; answers are read only when their space is needed.
    fn write_chunks(&self, w: &StagedWrite, ring: &mut Ring) -> Result<(), TransferError> {
        let (chunk, cap) = (self.chunk(), self.staging.len() as u64);
        let mut off = 0u64;
        while off < w.len {
            if w.batch.is_finished(w.index) {
                return Ok(()); // cancelled, timed out or refused: send nothing more of it
            }
            let n = (w.len - off).min(chunk);
            let at = loop {
                match ring.place(n, cap) {
                    Some(at) => break at,
                    None => self.settle(ring)?,
                }
            };
            if !w.batch.begin_io(w.index) {
                return Ok(());
            }
            // SAFETY: the local range was checked at submit and `w.local` keeps it mapped;
            // begin_io keeps the request from ending (and its buffer being reused) while
            // we read it. `at + n` <= the staging mapping's length (place), and no
            // commit in flight covers those bytes, so the server is not reading them.
            unsafe { std::ptr::copy_nonoverlapping(w.local.ptr.add(off as usize) as *const u8, self.staging.as_ptr().add(at as usize), n as usize) };
            w.batch.end_io(w.index);
            ring.next_id += 1;
            let id = ring.next_id;
            let mut commit = [0u8; COMMIT_LEN];
            for (i, v) in [id, w.region, w.offset + off, n, at].into_iter().enumerate() {
                commit[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
            }
            (&self.stream).write_all(&commit).map_err(|e| TransferError::ConnectionLost(format!("staging link: {e}")))?;
            ring.pending.push_back(Pending { batch: w.batch.clone(), index: w.index, region: w.region, id, at, len: n });
            ring.head = at + n;
            off += n;
        }
        Ok(())
    }

    /// Reads the answer to the oldest commit in flight and reports its chunk.
    fn settle(&self, ring: &mut Ring) -> Result<(), TransferError> {
        let Some(p) = ring.pending.pop_front() else { return Ok(()) };
        let mut reply = [0u8; REPLY_LEN];
        if let Err(e) = (&self.stream).read_exact(&mut reply) {
            let e = TransferError::ConnectionLost(format!("staging link: {e}"));
            p.batch.fail(p.index, e.clone());
            return Err(e);
        }
        let rid = u64::from_le_bytes(reply[..8].try_into().unwrap_or_default());
        let status = match status_from_u8(reply[8]) {
            Ok(s) if rid == p.id => s,
            _ => {
                let e = TransferError::Protocol("bad answer on the staging link".into());
                p.batch.fail(p.index, e.clone());
                return Err(e);
            }
        };
        match status {
            Ok(()) => p.batch.slice_done(p.index, p.len),
            Err(reason) => p.batch.fail(p.index, TransferError::Refused { side: "peer", region: p.region, reason }),
        }
        Ok(())
    }
}

impl Drop for StagedLink {
    fn drop(&mut self) {
        self.dead.store(true, Ordering::SeqCst);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}
