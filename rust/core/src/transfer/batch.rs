//! A submitted batch: per-request status, waiting with a deadline, cancellation.
//!
//! Requests are cut into slices by the transports; a request is done when all its
//! slices are, failed at its first failed slice. The batch deadline is enforced by
//! whoever looks (`wait`, `status`): past it, unfinished requests become `Timeout`.
//! Workers skip slices of requests that already ended, so no timer thread is needed.
//!
//! The fence: a transport that touches a request's local memory (a memcpy, a TCP
//! receive into it, a TCP send from it) brackets that with `begin_io` / `end_io`. A
//! request that fails, times out or is cancelled while such an access is running is not
//! reported final until the access ends, and no access begins once it is final. So after
//! a batch reports any final status for a request, no byte lands in (or is read from)
//! that request's buffers: the caller may reuse them at once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::completion::{monotonic_ns, Completion, CompletionQueue};
use super::config::Counters;
use super::{Op, TransferError};

/// The state of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestStatus {
    Pending,
    Done { bytes: u64 },
    Failed { error: TransferError, bytes: u64 },
}

impl RequestStatus {
    /// `"pending"`, `"done"` or `"failed"`: the state's stable name.
    pub fn state(&self) -> &'static str {
        match self {
            RequestStatus::Pending => "pending",
            RequestStatus::Done { .. } => "done",
            RequestStatus::Failed { .. } => "failed",
        }
    }

    pub fn is_ok(&self) -> bool {
        matches!(self, RequestStatus::Done { .. })
    }

    pub fn is_finished(&self) -> bool {
        !matches!(self, RequestStatus::Pending)
    }

    pub fn bytes(&self) -> u64 {
        match self {
            RequestStatus::Pending => 0,
            RequestStatus::Done { bytes } | RequestStatus::Failed { bytes, .. } => *bytes,
        }
    }

    pub fn error(&self) -> Option<&TransferError> {
        match self {
            RequestStatus::Failed { error, .. } => Some(error),
            _ => None,
        }
    }
}

struct Slot {
    status: RequestStatus,
    op: Op,
    slices_left: usize,
    bytes: u64,
    /// Accesses to the request's local memory in progress (`begin_io` .. `end_io`).
    io: u32,
    /// An end (`None`: success, `Some`: the failure) that arrived while `io > 0`:
    /// applied when the last access ends.
    deferred: Option<Option<TransferError>>,
}

struct State {
    slots: Vec<Slot>,
    pending: usize,
    /// When the last request ended (monotonic ns).
    finished_ns: Option<u64>,
}

/// Where a batch reports its end: the engine's counters and, if the caller asked, a
/// completion queue.
#[derive(Default)]
pub(crate) struct Report {
    pub counters: Option<Arc<Counters>>,
    pub queue: Option<Arc<CompletionQueue>>,
}

static NEXT_BATCH: AtomicU64 = AtomicU64::new(1);

pub struct Batch {
    state: Mutex<State>,
    cv: Condvar,
    deadline: Instant,
    id: u64,
    n: usize,
    submitted_ns: u64,
    /// `submitted_ns` + the timeout: a timed-out batch ends here, whenever it is noticed.
    deadline_ns: u64,
    requested_bytes: u64,
    report: Report,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock();
        f.debug_struct("Batch")
            .field("id", &self.id)
            .field("requests", &s.slots.len())
            .field("pending", &s.pending)
            .finish()
    }
}

impl Batch {
    /// A batch of requests given as (op, length), reporting its end to `report`.
    pub(crate) fn with_report(reqs: impl Iterator<Item = (Op, u64)>, timeout: Duration, report: Report) -> Batch {
        let now = Instant::now();
        let submitted_ns = monotonic_ns();
        let deadline = now.checked_add(timeout).unwrap_or(now + Duration::from_secs(86400 * 365));
        let deadline_ns =
            submitted_ns.saturating_add(deadline.duration_since(now).as_nanos().min(u64::MAX as u128) as u64);
        let mut requested_bytes = 0u64;
        let slots: Vec<Slot> = reqs
            .map(|(op, len)| {
                requested_bytes = requested_bytes.saturating_add(len);
                Slot { status: RequestStatus::Pending, op, slices_left: 1, bytes: 0, io: 0, deferred: None }
            })
            .collect();
        let n = slots.len();
        if let Some(c) = &report.counters {
            c.batches.fetch_add(1, Ordering::Relaxed);
            if n == 0 {
                c.batches_done.fetch_add(1, Ordering::Relaxed);
            } else {
                c.busy.lock().begin(submitted_ns);
            }
        }
        Batch {
            state: Mutex::new(State { slots, pending: n, finished_ns: (n == 0).then_some(submitted_ns) }),
            cv: Condvar::new(),
            deadline,
            id: NEXT_BATCH.fetch_add(1, Ordering::Relaxed),
            n,
            submitted_ns,
            deadline_ns,
            requested_bytes,
            report,
        }
    }

    /// Unique in this process.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// When the batch was submitted (monotonic ns, as Python's `time.monotonic_ns()`).
    pub fn submitted_ns(&self) -> u64 {
        self.submitted_ns
    }

    /// When its last request ended (`None` while any is pending).
    pub fn finished_ns(&self) -> Option<u64> {
        let mut s = self.state.lock();
        self.snapshot(&mut s);
        s.finished_ns
    }

    /// The sum of the requests' lengths.
    pub fn requested_bytes(&self) -> u64 {
        self.requested_bytes
    }

    /// Bytes moved so far by all requests.
    pub fn bytes(&self) -> u64 {
        self.state.lock().slots.iter().map(|x| x.bytes).sum()
    }

    /// What a completion queue reports of this (ended) batch.
    pub(crate) fn completion(self: &Arc<Self>, tag: u64) -> Completion {
        let s = self.state.lock();
        let mut failed = 0;
        let mut error = None;
        let mut bytes = 0;
        for x in &s.slots {
            bytes += x.status.bytes();
            if let RequestStatus::Failed { error: e, .. } = &x.status {
                failed += 1;
                error.get_or_insert_with(|| e.clone());
            }
        }
        Completion {
            tag,
            requests: s.slots.len(),
            failed,
            error,
            bytes,
            requested_bytes: self.requested_bytes,
            submitted_ns: self.submitted_ns,
            finished_ns: s.finished_ns.unwrap_or(self.submitted_ns),
            batch: self.clone(),
        }
    }

    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Sets how many slices request `i` was cut into (before any is dispatched).
    pub(crate) fn set_slices(&self, i: usize, n: usize) {
        let mut s = self.state.lock();
        if let Some(slot) = s.slots.get_mut(i) {
            slot.slices_left = n;
        }
        if n == 0 {
            self.finish(&mut s, i, None);
        }
    }

    fn finish(&self, s: &mut State, i: usize, error: Option<TransferError>) {
        let Some(slot) = s.slots.get_mut(i) else { return };
        if slot.status.is_finished() {
            return;
        }
        if slot.io > 0 {
            // Memory of this request is being accessed right now: report the end only
            // once that access has ended (see the fence in the module docs). The first
            // end wins, as below.
            slot.deferred.get_or_insert(error);
            return;
        }
        let timed_out = matches!(error, Some(TransferError::Timeout));
        let c = self.report.counters.as_deref();
        slot.status = match error {
            None => {
                if let Some(c) = c {
                    let to = if slot.op == Op::Write { &c.bytes_written } else { &c.bytes_read };
                    to.fetch_add(slot.bytes, Ordering::Relaxed);
                }
                RequestStatus::Done { bytes: slot.bytes }
            }
            Some(error) => {
                if let Some(c) = c {
                    c.requests_failed.fetch_add(1, Ordering::Relaxed);
                }
                RequestStatus::Failed { error, bytes: slot.bytes }
            }
        };
        s.pending -= 1;
        if s.pending == 0 {
            // A batch that timed out ended at its deadline, however late it is noticed.
            let now = monotonic_ns();
            let end = if timed_out { now.min(self.deadline_ns) } else { now };
            s.finished_ns = Some(end);
            if let Some(c) = c {
                c.batches_done.fetch_add(1, Ordering::Relaxed);
                c.busy.lock().end(end);
            }
            if let Some(q) = &self.report.queue {
                q.finished(self.id);
            }
            self.cv.notify_all();
        }
    }

    /// One slice of request `i` moved `bytes`.
    pub(crate) fn slice_done(&self, i: usize, bytes: u64) {
        let mut s = self.state.lock();
        let Some(slot) = s.slots.get_mut(i) else { return };
        if slot.status.is_finished() {
            return;
        }
        slot.bytes += bytes;
        slot.slices_left = slot.slices_left.saturating_sub(1);
        if slot.slices_left == 0 {
            self.finish(&mut s, i, None);
        }
    }

    /// Several slices done at once (one lock for a whole inline-copied batch).
    pub(crate) fn slices_done(&self, done: &[(usize, u64)]) {
        let mut s = self.state.lock();
        for &(i, bytes) in done {
            let Some(slot) = s.slots.get_mut(i) else { continue };
            if slot.status.is_finished() {
                continue;
            }
            slot.bytes += bytes;
            slot.slices_left = slot.slices_left.saturating_sub(1);
            if slot.slices_left == 0 {
                self.finish(&mut s, i, None);
            }
        }
    }

    /// Request `i` failed (the first error wins; a finished request stays as it is).
    pub(crate) fn fail(&self, i: usize, error: TransferError) {
        let mut s = self.state.lock();
        self.finish(&mut s, i, Some(error));
    }

    /// A transport is about to access request `i`'s local memory. `false`: the request
    /// ended (or its deadline passed, or a failure is pending): touch nothing.
    pub(crate) fn begin_io(&self, i: usize) -> bool {
        if Instant::now() >= self.deadline {
            return false;
        }
        let mut s = self.state.lock();
        match s.slots.get_mut(i) {
            Some(slot) if !slot.status.is_finished() && slot.deferred.is_none() => {
                slot.io += 1;
                true
            }
            _ => false,
        }
    }

    /// The access that `begin_io` allowed has ended; a failure that came meanwhile
    /// is reported now.
    pub(crate) fn end_io(&self, i: usize) {
        let mut s = self.state.lock();
        let Some(slot) = s.slots.get_mut(i) else { return };
        slot.io = slot.io.saturating_sub(1);
        if slot.io == 0 {
            // Waiters are woken only when something they wait for changed: a deferred
            // end became final (`finish` itself wakes them when the batch ends). Waking
            // them after every slice's I/O (as before) woke a thread blocked in `wait`
            // once per request: at 64 KiB requests 12-15 futex wake-ups per MB moved,
            // each preempting a transport thread on a 2-core host (BENCHMARKS.md, "k26q").
            if let Some(end) = slot.deferred.take() {
                self.finish(&mut s, i, end);
                self.cv.notify_all();
            }
        }
    }

    /// Whether request `i` already ended (workers skip its remaining slices). Also true
    /// past the deadline.
    pub(crate) fn is_finished(&self, i: usize) -> bool {
        if Instant::now() >= self.deadline {
            return true;
        }
        self.state.lock().slots.get(i).is_none_or(|s| s.status.is_finished())
    }

    fn expire_locked(&self, s: &mut State, error: TransferError) {
        for i in 0..s.slots.len() {
            self.finish(s, i, Some(error.clone()));
        }
    }

    fn snapshot(&self, s: &mut State) -> Vec<RequestStatus> {
        if s.pending > 0 && Instant::now() >= self.deadline {
            self.expire_locked(s, TransferError::Timeout);
        }
        s.slots.iter().map(|x| x.status.clone()).collect()
    }

    /// Current statuses (pending requests past the deadline become `Timeout`).
    pub fn status(&self) -> Vec<RequestStatus> {
        let mut s = self.state.lock();
        self.snapshot(&mut s)
    }

    /// Whether every request ended.
    pub fn is_done(&self) -> bool {
        let mut s = self.state.lock();
        self.snapshot(&mut s);
        s.pending == 0
    }

    /// Waits until every request ended, the batch deadline passed, or `timeout` (if
    /// given and sooner) passed; returns the statuses then.
    pub fn wait(&self, timeout: Option<Duration>) -> Vec<RequestStatus> {
        let until = match timeout.and_then(|t| Instant::now().checked_add(t)) {
            Some(t) if t < self.deadline => t,
            _ => self.deadline,
        };
        let mut s = self.state.lock();
        while s.pending > 0 && Instant::now() < until {
            self.cv.wait_until(&mut s, until);
        }
        let mut out = self.snapshot(&mut s);
        // At the deadline, a request whose memory is still being accessed becomes final
        // as soon as that access ends (one slice: bounded by the connection's I/O timeout).
        while Instant::now() >= self.deadline && s.slots.iter().any(|x| x.deferred.is_some()) {
            self.cv.wait_for(&mut s, Duration::from_millis(20));
            out = self.snapshot(&mut s);
        }
        out
    }

    /// Ends every unfinished request as `Cancelled`. Slices already on the wire finish
    /// into memory the batch keeps alive; the rest are never sent.
    pub fn cancel(&self) {
        let mut s = self.state.lock();
        self.expire_locked(&mut s, TransferError::Cancelled);
    }
}

impl Drop for Batch {
    /// A batch nobody holds any more with requests still pending (possible only past its
    /// deadline: every path ends a request it drops) ends as timed out, so the engine's
    /// in-flight accounting closes.
    fn drop(&mut self) {
        if self.report.counters.is_some() {
            let s = &mut *self.state.lock();
            if s.pending > 0 {
                self.expire_locked(s, TransferError::Timeout);
            }
        }
    }
}
