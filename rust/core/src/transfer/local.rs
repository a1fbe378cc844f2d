//! The memcpy path: same engine or another engine of this process, and the copy step of
//! the shm path. Small batches are copied inline by `submit`; large ones go to a small
//! pool of copy threads so `submit` returns at once.

use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use super::batch::Batch;
use super::region::Region;
use crate::mem::MappedMemory;

/// Batches moving at most this many bytes by memcpy are copied inside `submit`.
pub const INLINE_COPY_BYTES: u64 = 1 << 20;
/// Copies are cut into chunks of at most this many bytes for the pool.
pub const COPY_CHUNK: u64 = 4 << 20;

/// Memory kept alive for the duration of a copy.
#[derive(Clone)]
pub enum Keep {
    Region(Arc<Region>),
    Mapping(Arc<MappedMemory>),
}

/// A pointer into memory that `keep` keeps mapped.
#[derive(Clone)]
pub struct Span {
    pub keep: Keep,
    pub ptr: *mut u8,
}

// SAFETY: `ptr` points into memory owned by `keep` (Send + Sync owners); the span only
// moves the pointer between threads, and `keep` keeps it valid.
unsafe impl Send for Span {}

impl Span {
    /// `offset` bytes into `region` (bounds checked by the caller).
    pub fn region(region: &Arc<Region>, offset: u64) -> Span {
        Span { ptr: region.at(offset), keep: Keep::Region(region.clone()) }
    }
}

/// One memcpy of a request (or of one chunk of it).
pub struct CopyJob {
    pub batch: Arc<Batch>,
    pub index: usize,
    pub src: Span,
    pub dst: Span,
    pub len: u64,
}

impl CopyJob {
    pub fn run(self) {
        if !self.batch.begin_io(self.index) {
            return; // the request ended: its buffers are the caller's again
        }
        // SAFETY: both spans were bounds-checked for `len` bytes against memory their
        // `keep` holds mapped; `ptr::copy` tolerates overlap (a copy inside one region).
        unsafe { std::ptr::copy(self.src.ptr as *const u8, self.dst.ptr, self.len as usize) };
        self.batch.end_io(self.index);
        self.batch.slice_done(self.index, self.len);
    }

    /// Cuts a copy into pool-sized chunks.
    pub fn chunks(self) -> Vec<CopyJob> {
        let mut out = Vec::new();
        let mut off = 0u64;
        while off < self.len || (self.len == 0 && off == 0) {
            let n = (self.len - off).min(COPY_CHUNK);
            // SAFETY: off + n <= len, inside the checked range of both spans.
            let (src, dst) = unsafe { (self.src.ptr.add(off as usize), self.dst.ptr.add(off as usize)) };
            out.push(CopyJob {
                batch: self.batch.clone(),
                index: self.index,
                src: Span { keep: self.src.keep.clone(), ptr: src },
                dst: Span { keep: self.dst.keep.clone(), ptr: dst },
                len: n,
            });
            if self.len == 0 {
                break;
            }
            off += n;
        }
        out
    }
}

/// Copy threads fed by a channel; dropped with the engine.
pub struct CopyPool {
    tx: Mutex<Option<mpsc::Sender<CopyJob>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl CopyPool {
    pub fn new(threads: usize) -> CopyPool {
        let (tx, rx) = mpsc::channel::<CopyJob>();
        let rx = Arc::new(Mutex::new(rx));
        let handles = (0..threads.max(1))
            .map(|i| {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("mc-copy-{i}"))
                    .spawn(move || loop {
                        let job = rx.lock().recv();
                        match job {
                            Ok(job) => job.run(),
                            Err(_) => break,
                        }
                    })
                    .ok()
            })
            .collect::<Vec<_>>();
        CopyPool { tx: Mutex::new(Some(tx)), threads: Mutex::new(handles.into_iter().flatten().collect()) }
    }

    /// Queues `job`; runs it on this thread if the pool is closed or has no thread.
    pub fn spawn(&self, job: CopyJob) {
        let guard = self.tx.lock();
        let job = match guard.as_ref() {
            Some(tx) if !self.threads.lock().is_empty() => match tx.send(job) {
                Ok(()) => return,
                Err(mpsc::SendError(job)) => job,
            },
            _ => job,
        };
        drop(guard);
        job.run();
    }

    pub fn shutdown(&self) {
        self.tx.lock().take();
        let handles = std::mem::take(&mut *self.threads.lock());
        for h in handles {
            let _ = h.join();
        }
    }
}

impl Drop for CopyPool {
    fn drop(&mut self) {
        self.shutdown();
    }
}
