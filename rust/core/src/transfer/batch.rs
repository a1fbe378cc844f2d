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

use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::TransferError;

/// The state of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestStatus {
    Pending,
    Done { bytes: u64 },
    Failed { error: TransferError, bytes: u64 },
}

impl RequestStatus {
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
}

pub struct Batch {
    state: Mutex<State>,
    cv: Condvar,
    deadline: Instant,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock();
        f.debug_struct("Batch").field("requests", &s.slots.len()).field("pending", &s.pending).finish()
    }
}

impl Batch {
    pub(crate) fn new(n: usize, timeout: Duration) -> Batch {
        let now = Instant::now();
        let deadline = now.checked_add(timeout).unwrap_or(now + Duration::from_secs(86400 * 365));
        let slots = (0..n).map(|_| Slot { status: RequestStatus::Pending, slices_left: 1, bytes: 0, io: 0, deferred: None }).collect();
        Batch { state: Mutex::new(State { slots, pending: n }), cv: Condvar::new(), deadline }
    }

    pub fn len(&self) -> usize {
        self.state.lock().slots.len()
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
            Self::finish(&mut s, i, None, &self.cv);
        }
    }

    fn finish(s: &mut State, i: usize, error: Option<TransferError>, cv: &Condvar) {
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
        slot.status = match error {
            None => RequestStatus::Done { bytes: slot.bytes },
            Some(error) => RequestStatus::Failed { error, bytes: slot.bytes },
        };
        s.pending -= 1;
        if s.pending == 0 {
            cv.notify_all();
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
            Self::finish(&mut s, i, None, &self.cv);
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
                Self::finish(&mut s, i, None, &self.cv);
            }
        }
    }

    /// Request `i` failed (the first error wins; a finished request stays as it is).
    pub(crate) fn fail(&self, i: usize, error: TransferError) {
        let mut s = self.state.lock();
        Self::finish(&mut s, i, Some(error), &self.cv);
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
            if let Some(end) = slot.deferred.take() {
                Self::finish(&mut s, i, end, &self.cv);
            }
            self.cv.notify_all();
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
            Self::finish(s, i, Some(error.clone()), &self.cv);
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
