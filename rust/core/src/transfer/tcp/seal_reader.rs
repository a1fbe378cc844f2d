//! The receiving half of a protected connection (the layout and the rules: [`seal`](super)).

use std::io::{self, IoSliceMut, Read};

use super::super::super::protocol::FrameError;
use super::super::overlap::{Job, Overlap, GROUP};
use super::super::ConnError;
use super::{Direction, FrameKey, HEAD_ROOM, MAX_HEAD, RECORD, TAG_LEN};
use crate::mem::stream_copy;

/// The receiving half. The frame's head is read through [`Read`] (kept as the first
/// record's authenticated data when keyed); a payload through
/// [`read_payload`](Self::read_payload), [`read_payload_verified`](Self::read_payload_verified)
/// or [`discard_payload`](Self::discard_payload), which also end the frame; a frame
/// without a payload ends with [`end_frame`](Self::end_frame).
pub struct FrameReader<R> {
    inner: R,
    open: Option<Opener>,
}

struct Opener {
    dir: Direction,
    /// The direction's key, for the helper that opens large payloads (started on the
    /// first one; see [`Overlap`]).
    key: FrameKey,
    overlap: Option<Overlap>,
    /// The frame's head as read so far (the first record's authenticated data).
    head: Vec<u8>,
    /// One record, where a payload that must not land unverified is checked first.
    stage: Vec<u8>,
}

impl<R: Read> FrameReader<R> {
    pub fn new(inner: R, key: Option<FrameKey>) -> Self {
        let open = key.as_ref().map(|k| Opener {
            dir: Direction::new(k),
            key: *k,
            overlap: None,
            head: Vec::new(),
            stage: Vec::new(),
        });
        FrameReader { inner, open }
    }

    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    /// Whether frames are protected (then payloads must be verified before use).
    pub fn keyed(&self) -> bool {
        self.open.is_some()
    }

    /// Reads the frame's payload into `buf`, verifying (and decrypting) it in place record
    /// by record when keyed: `Err` (the connection must close) if a tag does not match,
    /// and then `buf` holds garbage the caller must not use. For the caller's own memory
    /// only; memory others read uses [`read_payload_verified`](Self::read_payload_verified).
    pub fn read_payload(&mut self, buf: &mut [u8]) -> Result<(), ConnError> {
        let Some(op) = &mut self.open else {
            self.inner.read_exact(buf)?;
            return Ok(());
        };
        // Only sealed records go to the helper: a GMAC check runs at 20-30 GB/s, so a
        // hand-off (two wake-ups per job) cost more CPU than the check it moved
        // (BENCHMARKS.md, "k26z: authenticated 512 KiB"); checked here, the record is
        // still in this core's cache.
        if buf.len() > RECORD && op.overlap.is_none() && !op.dir.guard.in_clear() {
            op.overlap = Overlap::start(&op.key).ok(); // without a helper: opened here
        }
        let Some(overlap) = &mut op.overlap else {
            let mut records = buf.chunks_mut(RECORD);
            let first = records.next().unwrap_or_default();
            op.receive(&mut self.inner, first)?;
            for record in records {
                op.receive(&mut self.inner, record)?;
            }
            return Ok(());
        };
        // Receive the next records while the helper opens the ones before (GROUP a
        // job); collect every verdict before returning, on every path, since the
        // helper writes into `buf`.
        let mut received = Ok(());
        'spans: for span in buf.chunks_mut(GROUP * RECORD) {
            let first_seq = op.dir.seq;
            let mut tags = [[0u8; TAG_LEN]; GROUP];
            for (record, tag) in span.chunks_mut(RECORD).zip(tags.iter_mut()) {
                if let Err(e) = read_record_and_tag(&mut self.inner, record, tag) {
                    received = Err(ConnError::from(e));
                    break 'spans;
                }
                op.dir.seq = op.dir.seq.wrapping_add(1);
            }
            let (ptr, len) = (span.as_mut_ptr(), span.len());
            overlap.submit(Job { ptr, len, first_seq, tags, record_len: RECORD, aad: std::mem::take(&mut op.head) });
        }
        let verified = overlap.finish();
        received?;
        if verified {
            Ok(())
        } else {
            Err(ConnError::Frame(FrameError::BadTag))
        }
    }

    /// Reads the frame's payload into `dst` such that no byte lands before its record's
    /// tag matched (each record is staged, verified, then copied with streaming stores,
    /// fenced before this returns). On `Err`, the verified records before the bad one
    /// have landed, nothing after.
    pub fn read_payload_verified(&mut self, dst: &mut [u8]) -> Result<(), ConnError> {
        let Some(op) = &mut self.open else {
            self.inner.read_exact(dst)?;
            return Ok(());
        };
        op.stage.resize(dst.len().min(RECORD) + HEAD_ROOM, 0);
        let mut stage = std::mem::take(&mut op.stage);
        let r = op.each_record(&mut self.inner, dst.len(), &mut stage, |at, plain| {
            let to = &mut dst[at..at + plain.len()];
            // SAFETY: `plain` (the stage) and `to` (the caller's region) are distinct
            // slices of the same length.
            unsafe { stream_copy::copy(plain.as_ptr(), to.as_mut_ptr(), plain.len()) }
        });
        // The landed bytes are ordered before anything this thread does next (the
        // write's response).
        stream_copy::fence();
        op.stage = stage;
        r
    }

    /// Reads and drops a payload of `n` bytes, verifying it when keyed.
    pub fn discard_payload(&mut self, n: usize) -> Result<(), ConnError> {
        let Some(op) = &mut self.open else {
            let copied = io::copy(&mut (&mut self.inner).take(n as u64), &mut io::sink())?;
            return if copied as usize == n {
                Ok(())
            } else {
                Err(io::Error::from(io::ErrorKind::UnexpectedEof).into())
            };
        };
        op.stage.resize(n.min(RECORD) + HEAD_ROOM, 0);
        let mut stage = std::mem::take(&mut op.stage);
        let r = op.each_record(&mut self.inner, n, &mut stage, |_, _| {});
        op.stage = stage;
        r
    }

    /// Ends a frame that has no payload: reads its tag and checks it. A no-op without a key.
    pub fn end_frame(&mut self) -> Result<(), ConnError> {
        match &mut self.open {
            Some(op) => op.receive(&mut self.inner, &mut []),
            None => Ok(()),
        }
    }
}

impl Opener {
    /// Reads the `n`-byte payload record by record into `stage` (a record and
    /// [`HEAD_ROOM`]), verifies each and hands its plaintext, with its offset in the
    /// payload, to `land`.
    fn each_record(
        &mut self,
        r: &mut impl Read,
        n: usize,
        stage: &mut [u8],
        mut land: impl FnMut(usize, &[u8]),
    ) -> Result<(), ConnError> {
        let mut at = 0;
        loop {
            let k = (n - at).min(RECORD);
            let mut tag = [0u8; TAG_LEN];
            read_record_and_tag(r, &mut stage[..k], &mut tag)?;
            let seq = self.dir.next_seq();
            // The frame's first record is checked with its head laid out after it in
            // the stage (no copy of the record: `Guard::open_with_room`).
            let ok = self.dir.guard.open_with_room(seq, &self.head, stage, k, tag);
            self.head.clear();
            if !ok {
                return Err(ConnError::Frame(FrameError::BadTag));
            }
            land(at, &stage[..k]);
            at += k;
            if at == n {
                return Ok(());
            }
        }
    }

    /// Reads `record` and the tag that follows it, and checks (and decrypts) the record in place.
    fn receive(&mut self, r: &mut impl Read, record: &mut [u8]) -> Result<(), ConnError> {
        let mut tag = [0u8; TAG_LEN];
        read_record_and_tag(r, record, &mut tag)?;
        let seq = self.dir.next_seq();
        let ok = self.dir.guard.open(seq, &self.head, record, tag);
        self.head.clear();
        if ok {
            Ok(())
        } else {
            Err(ConnError::Frame(FrameError::BadTag))
        }
    }
}

/// Reads a record and its tag with vectored reads: one system call for both where the
/// socket holds them (a tag read on its own was a second call per record, plus a copy of
/// the next record's start through the connection's read buffer).
fn read_record_and_tag(r: &mut impl Read, mut record: &mut [u8], tag: &mut [u8]) -> io::Result<()> {
    while !record.is_empty() {
        let n = match r.read_vectored(&mut [IoSliceMut::new(record), IoSliceMut::new(tag)]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if n >= record.len() {
            let into_tag = n - record.len();
            return r.read_exact(&mut tag[into_tag..]);
        }
        record = &mut std::mem::take(&mut record)[n..];
    }
    r.read_exact(tag)
}

impl<R: Read> Read for FrameReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(op) = &mut self.open {
            if op.head.len() + n > MAX_HEAD {
                // A head is a header and a small body (MAX_CONTROL); more is not a frame.
                return Err(io::Error::new(io::ErrorKind::InvalidData, "frame head too long"));
            }
            op.head.extend_from_slice(&buf[..n]);
        }
        Ok(n)
    }
}
