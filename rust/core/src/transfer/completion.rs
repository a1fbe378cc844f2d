//! Learning of finished batches without a thread per batch.
//!
//! A [`CompletionQueue`] is handed to `submit` with a caller's `tag`; when every request
//! of the batch has ended, the batch puts its id on the queue, and [`CompletionQueue::poll`]
//! (never blocks) or [`CompletionQueue::wait`] (blocks until one batch ended or a
//! timeout) hands back one [`Completion`] per batch: its tag, its first error, the bytes
//! it moved and when it was submitted and finished (monotonic ns, the clock of Python's
//! `time.monotonic_ns()`). The queue keeps the batches it tracks alive, and enforces
//! their deadlines when it is looked at (as `Batch::wait` does), so a timed-out batch
//! shows up like any other.
//!
//! Locks: a batch reports its end while holding its own state lock and then takes the
//! queue's lock; the queue never takes a batch's lock while holding its own (it clones
//! the batches it must look at and looks after releasing it). So the queue lock is a
//! leaf, and there is no lock-order cycle.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::HashMap;
use parking_lot::{Condvar, Mutex};

use super::batch::Batch;
use super::TransferError;

/// Monotonic clock in nanoseconds (`CLOCK_MONOTONIC`, the clock of Python's
/// `time.monotonic_ns()`), so timestamps can be compared across the language boundary.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into the valid, exclusively borrowed `ts`;
    // CLOCK_MONOTONIC is always supported on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(ts.tv_nsec as u64)
}

/// One finished batch, as the queue reports it.
#[derive(Debug, Clone)]
pub struct Completion {
    /// What the caller passed to `submit`.
    pub tag: u64,
    pub requests: usize,
    /// Requests that did not end `Done`.
    pub failed: usize,
    /// The error of the first failed request (in request order).
    pub error: Option<TransferError>,
    /// Bytes the batch's requests moved (failed requests count what they moved before failing).
    pub bytes: u64,
    /// Bytes the batch asked for (sum of request lengths).
    pub requested_bytes: u64,
    pub submitted_ns: u64,
    pub finished_ns: u64,
    pub batch: Arc<Batch>,
}

impl Completion {
    pub fn ok(&self) -> bool {
        self.failed == 0
    }
}

struct Tracked {
    tag: u64,
    batch: Arc<Batch>,
}

#[derive(Default)]
struct QState {
    /// Batches submitted to this queue that it has not handed back yet, by batch id.
    tracked: HashMap<u64, Tracked>,
    /// Ids of tracked batches that ended, in the order they ended.
    done: Vec<u64>,
}

/// A queue of finished batches (see the module docs).
#[derive(Default)]
pub struct CompletionQueue {
    state: Mutex<QState>,
    cv: Condvar,
}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock();
        f.debug_struct("CompletionQueue").field("tracked", &s.tracked.len()).field("done", &s.done.len()).finish()
    }
}

impl CompletionQueue {
    pub fn new() -> Arc<CompletionQueue> {
        Arc::new(CompletionQueue::default())
    }

    /// Starts tracking `batch` (before any of its requests can end). A batch with no
    /// request is done at once.
    pub(crate) fn track(&self, tag: u64, batch: &Arc<Batch>) {
        let mut s = self.state.lock();
        s.tracked.insert(batch.id(), Tracked { tag, batch: batch.clone() });
        if batch.is_empty() {
            s.done.push(batch.id());
            self.cv.notify_all();
        }
    }

    /// Called by a batch when its last request ended (with the batch's lock held: this
    /// lock is a leaf).
    pub(crate) fn finished(&self, batch_id: u64) {
        let mut s = self.state.lock();
        if s.tracked.contains_key(&batch_id) {
            s.done.push(batch_id);
            self.cv.notify_all();
        }
    }

    /// Batches submitted to this queue that have not been handed back yet.
    pub fn pending(&self) -> usize {
        let s = self.state.lock();
        s.tracked.len() - s.done.len()
    }

    /// Ends the tracked batches whose deadline passed (as `Timeout`); they are reported
    /// by the next take. Returns the earliest deadline still ahead, if any.
    fn expire(&self) -> Option<Instant> {
        let now = Instant::now();
        let (late, next): (Vec<Arc<Batch>>, Option<Instant>) = {
            let s = self.state.lock();
            let mut next: Option<Instant> = None;
            let mut late = Vec::new();
            for t in s.tracked.values() {
                let d = t.batch.deadline();
                if d <= now {
                    late.push(t.batch.clone());
                } else {
                    next = Some(next.map_or(d, |n| n.min(d)));
                }
            }
            (late, next)
        };
        // Outside the queue's lock: is_done() takes the batch's lock and, on expiring it,
        // calls back into `finished`.
        for b in late {
            b.is_done();
        }
        next
    }

    fn take(&self) -> Vec<Completion> {
        let done: Vec<Tracked> = {
            let mut s = self.state.lock();
            let ids = std::mem::take(&mut s.done);
            ids.into_iter().filter_map(|id| s.tracked.remove(&id)).collect()
        };
        done.into_iter().map(|t| t.batch.completion(t.tag)).collect()
    }

    /// The batches that ended since the last call, without waiting.
    pub fn poll(&self) -> Vec<Completion> {
        self.expire();
        self.take()
    }

    /// Waits until at least one tracked batch ended (or `timeout` passed); returns the
    /// batches that ended (possibly none).
    pub fn wait(&self, timeout: Duration) -> Vec<Completion> {
        let until = Instant::now().checked_add(timeout);
        loop {
            let next = self.expire();
            let out = self.take();
            if !out.is_empty() {
                return out;
            }
            let now = Instant::now();
            if until.is_some_and(|u| now >= u) {
                return out;
            }
            let wake = match (until, next) {
                (Some(u), Some(n)) => Some(u.min(n)),
                (u, n) => u.or(n),
            };
            let mut s = self.state.lock();
            if s.done.is_empty() {
                match wake {
                    Some(w) => {
                        self.cv.wait_until(&mut s, w);
                    }
                    None => self.cv.wait(&mut s),
                }
            }
        }
    }
}
