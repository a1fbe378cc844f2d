//! The initiator's bookkeeping of a staging link (see [`super::staged`]): which bytes of
//! the staging buffer hold chunks whose commits are open or in flight, where the next
//! chunk may go, and the commit frame (the wire is described in [`super::staged_server`]).

use std::collections::VecDeque;
use std::sync::Arc;

use super::batch::Batch;
use super::local::Span;
use super::staged_server::{
    CHUNK_ENTRY_LEN, COMMIT_HEAD_LEN, COMMIT_READ, COMMIT_READ_DIRECT, COMMIT_WRITE, COMMIT_WRITE_DIRECT,
    MAX_COMMIT_CHUNKS,
};

/// One chunk of a request at `at..at + len` of the staging buffer: a write's bytes,
/// copied in, or the space a read's bytes are copied into by the server; those bytes
/// stay untouched by us until the answer to its commit. In one-copy mode `at` is the
/// address of the chunk's bytes in the request's own memory, which `held` keeps.
pub(super) struct Chunk {
    pub(super) batch: Arc<Batch>,
    pub(super) index: usize,
    pub(super) region: u64,
    pub(super) offset: u64,
    pub(super) at: u64,
    pub(super) len: u64,
    /// A read's destination (`len` bytes of the request's local range); `None` for a write.
    pub(super) read_into: Option<Span>,
    /// A one-copy chunk's own memory: kept mapped, and its request kept from ending
    /// (`Batch::begin_io`, taken when the chunk was made), until the answer.
    pub(super) held: Option<Span>,
}

impl Chunk {
    /// The answer came or never will: a one-copy chunk lets go of its request's memory.
    pub(super) fn release(&self) {
        if self.held.is_some() {
            self.batch.end_io(self.index);
        }
    }
}

/// A commit that is out (its chunks in order), waiting for its answer.
pub(super) struct Pending {
    pub(super) id: u64,
    pub(super) chunks: Vec<Chunk>,
}

/// A link's state: commits in flight (oldest first), the commit being filled, and
/// where the next chunk goes.
#[derive(Default)]
pub(super) struct Ring {
    pub(super) pending: VecDeque<Pending>,
    pub(super) in_flight: usize,
    pub(super) open: Vec<Chunk>,
    /// Whether the open commit's chunks are reads (a commit is all reads or all writes).
    pub(super) open_read: bool,
    pub(super) open_bytes: u64,
    pub(super) head: u64,
    pub(super) next_id: u64,
    /// Set while `submit_many` commits a small batch: its chunks stay one commit (one
    /// answer, one wake-up) instead of being sent every `FLUSH_BYTES`.
    pub(super) one_commit: bool,
}

impl Ring {
    /// Where `n` bytes can go now without touching a chunk in flight or in the open
    /// commit, if anywhere.
    pub(super) fn place(&self, n: u64, cap: u64) -> Option<u64> {
        if self.pending.is_empty() && self.open.is_empty() {
            return Some(0);
        }
        if self.in_flight + self.open.len() >= MAX_COMMIT_CHUNKS {
            return None;
        }
        let at = if self.head + n <= cap { self.head } else { 0 };
        let clear = self
            .pending
            .iter()
            .flat_map(|p| p.chunks.iter())
            .chain(self.open.iter())
            .all(|c| at + n <= c.at || c.at + c.len <= at);
        clear.then_some(at)
    }
}

/// Moves the open commit into the ring's commits in flight; its frame, to be sent next
/// (`direct`: a one-copy commit, whose chunks name addresses of ours, not the buffer).
pub(super) fn seal_commit(ring: &mut Ring, direct: bool) -> Vec<u8> {
    let chunks = std::mem::take(&mut ring.open);
    ring.open_bytes = 0;
    ring.next_id += 1;
    let id = ring.next_id;
    let mut frame = Vec::with_capacity(COMMIT_HEAD_LEN + chunks.len() * CHUNK_ENTRY_LEN);
    frame.extend_from_slice(&id.to_le_bytes());
    frame.extend_from_slice(&(chunks.len() as u32).to_le_bytes());
    let op = match (ring.open_read, direct) {
        (false, false) => COMMIT_WRITE,
        (true, false) => COMMIT_READ,
        (false, true) => COMMIT_WRITE_DIRECT,
        (true, true) => COMMIT_READ_DIRECT,
    };
    frame.extend_from_slice(&op.to_le_bytes());
    for c in &chunks {
        for v in [c.region, c.offset, c.len, c.at] {
            frame.extend_from_slice(&v.to_le_bytes());
        }
    }
    ring.in_flight += chunks.len();
    ring.pending.push_back(Pending { id, chunks });
    frame
}
