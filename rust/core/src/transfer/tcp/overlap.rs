//! Verifying (and decrypting) a received payload on a helper thread while the connection's receiver reads
//! the next records.
//!
//! A sealed payload is opened record by record ([`seal`](super::seal)). Done on the
//! thread that reads the socket, the receive and the decryption take turns: the socket
//! waits while a record is decrypted. With an [`Overlap`], the receiver reads record
//! k+1 while a helper thread decrypts record k in place, and reports the payload only
//! after every record's tag matched. Used for a sealed read response landing in the
//! initiator's own buffer, whose content is undefined until the request reports `ok`.
//! Integrity-only records are not handed over: their GMAC check is cheaper than the
//! hand-off (BENCHMARKS.md, "k26z: authenticated 512 KiB").

use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

use super::guard::{FrameKey, Guard};

/// Records a job holds: a hand-off (a channel send, maybe a wake-up, and the answer)
/// per 64 KiB record cost more CPU than the overlap saved on a loaded 2-core machine;
/// four records (256 KiB) a job make it a few hand-offs per 1 MiB slice.
pub const GROUP: usize = 4;

/// Up to [`GROUP`] consecutive records of one payload to open in place.
pub(super) struct Job {
    pub ptr: *mut u8,
    pub len: usize,
    /// The number of the first record in its direction.
    pub first_seq: u64,
    /// One tag per record (`record_len` bytes each, the last may be shorter).
    pub tags: [[u8; 16]; GROUP],
    pub record_len: usize,
    /// The frame's head when the first record is the frame's first, else empty.
    pub aad: Vec<u8>,
}

// SAFETY: `ptr..ptr+len` is a record of a payload buffer the submitting receiver keeps
// alive and does not touch until it has collected this job's result (`Overlap::finish`),
// so the helper has exclusive access to those bytes while it holds the job.
unsafe impl Send for Job {}

/// A connection's helper thread and the results it owes.
pub struct Overlap {
    jobs: Option<Sender<Job>>,
    results: Receiver<bool>,
    owed: usize,
    /// A record could not be handed over since the last `finish`.
    lost: bool,
    thread: Option<JoinHandle<()>>,
}

impl Overlap {
    /// Starts the helper for the receiving direction keyed with `key`.
    pub fn start(key: &FrameKey) -> std::io::Result<Overlap> {
        let guard = Guard::new(key);
        let (jobs, todo) = channel::<Job>();
        let (report, results) = channel::<bool>();
        let thread = std::thread::Builder::new().name("mc-tcp-open".into()).spawn(move || {
            for job in todo {
                // SAFETY: see `impl Send for Job`: the bytes are ours until we report.
                let span = unsafe { std::slice::from_raw_parts_mut(job.ptr, job.len) };
                let mut ok = true;
                for (i, record) in span.chunks_mut(job.record_len.max(1)).enumerate() {
                    let aad = if i == 0 { &job.aad[..] } else { &[][..] };
                    let tag = job.tags.get(i).copied().unwrap_or_default();
                    ok &= i < GROUP && guard.open(job.first_seq.wrapping_add(i as u64), aad, record, tag);
                }
                if report.send(ok).is_err() {
                    return;
                }
            }
        })?;
        Ok(Overlap { jobs: Some(jobs), results, owed: 0, lost: false, thread: Some(thread) })
    }

    /// Hands a record to the helper. The caller must call [`finish`](Self::finish)
    /// before it touches or frees the record's memory again.
    pub(super) fn submit(&mut self, job: Job) {
        match self.jobs.as_ref().map(|j| j.send(job)) {
            Some(Ok(())) => self.owed += 1,
            // The helper is gone (it cannot be while we hold its channel): the record
            // came back unopened, and must not be reported verified.
            _ => self.lost = true,
        }
    }

    /// Waits for every record handed over since the last call; true when all matched.
    pub fn finish(&mut self) -> bool {
        let mut all = !std::mem::take(&mut self.lost);
        while self.owed > 0 {
            match self.results.recv() {
                Ok(ok) => all &= ok,
                Err(_) => {
                    // The helper ended: it holds no record any more.
                    self.owed = 0;
                    return false;
                }
            }
            self.owed -= 1;
        }
        all
    }
}

impl Drop for Overlap {
    fn drop(&mut self) {
        // The reader waits for outstanding records (`finish`) on every path; closing the
        // channel and joining keeps the helper from outliving that memory in any case.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
