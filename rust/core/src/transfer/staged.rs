//! Initiating side of the staged path (see [`super::staged_server`]): writes into a
//! same-host peer's restricted region through a staging buffer the peer's server handed
//! us (an fd over a unix socket), each chunk committed and checked against the live
//! grants by that server before it copies the chunk in.
//!
//! One link per peer server, one worker thread per link. The buffer has two halves: the
//! worker copies chunk k into one while the server copies chunk k-1 out of the other
//! (the commit of k goes out before the answer to k-1 is read), so the two memcpys
//! overlap. Answers come in order.

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

/// A chunk whose commit is out, waiting for its answer.
struct Pending {
    batch: Arc<Batch>,
    index: usize,
    region: u64,
    id: u64,
    len: u64,
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

    /// Bytes per chunk: half the staging buffer.
    pub fn chunk(&self) -> u64 {
        (self.staging.len() / 2) as u64
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
        let mut pending: Option<Pending> = None;
        let mut id = 0u64;
        let mut half = 0usize;
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
                    if pending.is_some() {
                        break None; // answer the last commit before sleeping
                    }
                    self.work.wait(&mut q);
                }
            };
            let Some(w) = next else {
                if self.is_dead() {
                    break TransferError::Closed;
                }
                if let Err(e) = self.settle(pending.take()) {
                    break e;
                }
                continue;
            };
            if let Err(e) = self.write_chunks(&w, &mut pending, &mut id, &mut half) {
                w.batch.fail(w.index, e.clone());
                break e;
            }
        };
        self.dead.store(true, Ordering::SeqCst);
        if let Some(p) = pending.take() {
            p.batch.fail(p.index, err.clone());
        }
        let left: Vec<StagedWrite> = self.queue.lock().drain(..).collect();
        for w in left {
            w.batch.fail(w.index, err.clone());
        }
    }

    /// Copies `w` chunk by chunk into alternating halves, committing each; the answer to
    /// the previous commit is read after the next one went out.
    fn write_chunks(&self, w: &StagedWrite, pending: &mut Option<Pending>, id: &mut u64, half: &mut usize) -> Result<(), TransferError> {
        let chunk = self.chunk();
        let mut off = 0u64;
        while off < w.len {
            if w.batch.is_finished(w.index) {
                return Ok(()); // cancelled, timed out or refused: send nothing more of it
            }
            let n = (w.len - off).min(chunk);
            let at = *half as u64 * chunk;
            if !w.batch.begin_io(w.index) {
                return Ok(());
            }
            // SAFETY: the local range was checked at submit and `w.local` keeps it mapped;
            // begin_io keeps the request from ending (and its buffer being reused) while
            // we read it. `at + n` <= 2 * chunk <= the staging mapping's length; the half
            // we write is not the one the server may still be copying (the pending commit).
            unsafe { std::ptr::copy_nonoverlapping(w.local.ptr.add(off as usize) as *const u8, self.staging.as_ptr().add(at as usize), n as usize) };
            w.batch.end_io(w.index);
            *id += 1;
            let mut commit = [0u8; COMMIT_LEN];
            for (i, v) in [*id, w.region, w.offset + off, n, at].into_iter().enumerate() {
                commit[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
            }
            (&self.stream).write_all(&commit).map_err(|e| TransferError::ConnectionLost(format!("staging link: {e}")))?;
            self.settle(pending.take())?;
            *pending = Some(Pending { batch: w.batch.clone(), index: w.index, region: w.region, id: *id, len: n });
            *half ^= 1;
            off += n;
        }
        Ok(())
    }

    /// Reads the answer to `p`'s commit and reports the chunk.
    fn settle(&self, p: Option<Pending>) -> Result<(), TransferError> {
        let Some(p) = p else { return Ok(()) };
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
