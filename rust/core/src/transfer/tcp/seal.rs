//! Frame protection after an authenticated handshake.
//!
//! The handshake proves that both ends know the token, but by itself it protects
//! nothing that follows: a relay could pass a real handshake through and then read KV or
//! inject frames of its own. So when the engines share a token, every frame after the
//! handshake is protected under a per-connection, per-direction key
//! ([`AuthKey::frame_keys`](super::super::auth::AuthKey::frame_keys)), bound to the
//! frame's sequence number (counted per direction from 0, never sent): the frame's
//! header and body (`head`) are authenticated data, its payload (KV bytes) is either
//! encrypted (AES-256-GCM, [`WireProtection::Encrypted`], the default) or left in clear
//! and tagged (GMAC, [`WireProtection::Integrity`]; see [`guard`](super::guard)
//! for why GMAC and which crate), and a [`TAG_LEN`]-byte tag follows. A forged, replayed, reordered
//! or dropped frame fails its tag (or the next one's) and the receiver closes the
//! connection; with encryption a relay sees no KV byte. Without a token there is no
//! authentication at all and frames carry no tag.
//!
//! A frame's payload is protected in records of at most [`RECORD`] bytes, each with its
//! own tag and sequence number (the first record's authenticated data is the head; a
//! frame without a payload is one empty record). Bounded records keep the work in
//! cache: an encrypting sender copies a record into a buffer it reuses, seals it there
//! and hands it to the kernel while it is still hot ([`SEALED_GROUP`]); an integrity-only sender tags a slice's records where they are and the
//! socket write reads the caller's bytes directly (no copy). A receiver reads a record
//! and its tag together and verifies the record right after receiving it,
//! instead of a second pass over a whole slice (1 MiB) from memory. A record dropped,
//! repeated, reordered or moved into another frame fails its sequence number.
//!
//! A receiver can check a tag only after the record's last byte. So the server stages a
//! write's payload record by record and copies a record into the region only once its
//! tag matched: an unverified byte never lands in served memory (a write cut short
//! after some records leaves those verified bytes and fails the request, as a write
//! without a token cut short does). The copy out of the stage uses streaming stores
//! (the region is not read back by this thread; an ordinary copy first reads each
//! destination line from memory), fenced before the write's response. A read response
//! is received straight into the initiator's own buffer and verified (and decrypted)
//! there, whose content is undefined until the request reports `ok` (a bad tag fails or
//! retries the request, never reports it done); sealed records of a response of more
//! than one record are decrypted on a helper thread while the next record arrives
//! ([`Overlap`]), tagged ones are checked as they arrive.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};

use super::super::config::WireProtection;
use super::super::protocol::FrameError;
use super::guard::Guard;
pub use super::guard::{FrameKey, TAG_LEN};
use super::overlap::{Job, Overlap, GROUP};
use super::ConnError;
use crate::mem::stream_copy;

/// Most payload bytes of one protected record (a frame's payload is one or more records).
pub const RECORD: usize = 64 << 10;

/// Most bytes of a frame's head (a header and a small body, `MAX_CONTROL`): more is not a frame.
const MAX_HEAD: usize = 4096;

/// Room after a staged record for its head and the head's length, where a tagged first
/// record's input is laid out ([`Guard::open_with_room`]).
const HEAD_ROOM: usize = MAX_HEAD + 8;

/// One end's keys of a connection (`None` everywhere without a token).
#[derive(Clone, Copy, Default, Debug)]
pub struct FrameKeys {
    pub send: Option<FrameKey>,
    pub recv: Option<FrameKey>,
}

impl FrameKeys {
    pub fn keyed(send: [u8; 32], recv: [u8; 32], protection: WireProtection) -> FrameKeys {
        FrameKeys { send: Some(FrameKey { key: send, protection }), recv: Some(FrameKey { key: recv, protection }) }
    }
}

/// A direction's protection and the number of its next record.
struct Direction {
    guard: Guard,
    seq: u64,
}

impl Direction {
    fn new(key: &FrameKey) -> Direction {
        Direction { guard: Guard::new(key), seq: 0 }
    }

    /// The number of the next record (a connection never sends 2^64 records).
    fn next_seq(&mut self) -> u64 {
        let n = self.seq;
        self.seq = self.seq.wrapping_add(1);
        n
    }
}

/// The sending half of a connection: frames out, each sealed when keyed.
pub struct FrameWriter<W> {
    inner: W,
    seal: Option<Direction>,
    /// A group of records' ciphertext when encrypting (the caller's bytes are never
    /// written to); at most [`SEALED_GROUP`] records, allocated once per connection,
    /// unused integrity-only.
    scratch: Vec<u8>,
}

impl<W: Write> FrameWriter<W> {
    pub fn new(inner: W, key: Option<FrameKey>) -> Self {
        FrameWriter { inner, seal: key.as_ref().map(Direction::new), scratch: Vec::new() }
    }

    /// Writes one frame (`head`, then `data`, protected record by record when keyed),
    /// a group of records per vectored write (see [`TAGGED_GROUP`], [`SEALED_GROUP`]),
    /// and no allocation after the first frame.
    pub fn send(&mut self, head: &[u8], data: &[u8]) -> io::Result<()> {
        let FrameWriter { inner, seal, scratch } = self;
        let Some(dir) = seal else {
            return write_all_parts(inner, &mut [head, data, &[]]);
        };
        let in_clear = dir.guard.in_clear();
        let group = if in_clear { TAGGED_GROUP } else { SEALED_GROUP };
        let empty: &[u8] = &[];
        // Records `from..to` of the payload, as a byte range of `data`.
        let span = |from: usize, to: usize| (from * RECORD).min(data.len())..(to * RECORD).min(data.len());
        // A frame without payload is one empty record (it carries the head's tag).
        let records = data.len().div_ceil(RECORD).max(1);
        let mut i = 0;
        while i < records {
            let k = (records - i).min(group);
            let base = span(i, i).start;
            let mut tags = [[0u8; TAG_LEN]; TAGGED_GROUP];
            if !in_clear {
                // The caller's bytes are never written to: the group is sealed in `scratch`.
                scratch.clear();
                scratch.extend_from_slice(&data[span(i, i + k)]);
            }
            for (j, tag) in tags[..k].iter_mut().enumerate() {
                let aad = if i + j == 0 { head } else { empty };
                let r = span(i + j, i + j + 1);
                let seq = dir.next_seq();
                *tag = if in_clear {
                    // Integrity-only: tagged where the caller keeps it; there is always a tag.
                    dir.guard.tag_in_clear(seq, aad, &data[r]).unwrap_or_default()
                } else {
                    dir.guard.protect(seq, aad, &mut scratch[r.start - base..r.end - base])
                };
            }
            let source: &[u8] = if in_clear { &data[base..] } else { &scratch[..] };
            let mut slices = [IoSlice::new(empty); 2 * TAGGED_GROUP + 1];
            let mut used = 0;
            if i == 0 {
                slices[0] = IoSlice::new(head);
                used = 1;
            }
            for (j, tag) in tags[..k].iter().enumerate() {
                let r = span(i + j, i + j + 1);
                slices[used] = IoSlice::new(&source[r.start - base..r.end - base]);
                slices[used + 1] = IoSlice::new(tag);
                used += 2;
            }
            write_all_slices(inner, &mut slices[..used])?;
            i += k;
        }
        Ok(())
    }

    pub fn get_ref(&self) -> &W {
        &self.inner
    }

    pub fn get_mut(&mut self) -> &mut W {
        &mut self.inner
    }
}

/// Records of an integrity-only frame handed to the socket in one vectored write (up to
/// 1 MiB: a whole slice), so a 512 KiB request is one system call, not eight. The tags of
/// a group are computed first, the records where the caller keeps them; the socket then
/// reads head, records and tags from there. (The caller's bytes must not change until
/// `send` returns, as without a token; if they do, the receiver sees a bad tag and closes
/// the connection, never accepts other bytes.)
const TAGGED_GROUP: usize = 16;

/// Records of an encrypted frame sealed into the writer's buffer and then written
/// together: one. Four (256 KiB, a 512 KiB request in two system calls instead of eight)
/// measured slower on a quiet host (BENCHMARKS.md, "Issue 26, authenticated TCP like for
/// like": encrypted 512 KiB 0.28-0.30x of the socket stream against main's 0.43-0.54x):
/// with one record a write, the receiver opens record n while the sender seals n + 1.
const SEALED_GROUP: usize = 1;

/// `write_all` over several slices (std's `write_all_vectored` is not stable).
fn write_all_slices(w: &mut impl Write, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match w.write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_all_parts(w: &mut impl Write, parts: &mut [&[u8]; 3]) -> io::Result<()> {
    let mut first = 0;
    while first < parts.len() {
        if parts[first].is_empty() {
            first += 1;
            continue;
        }
        // No allocation per frame: at most three slices, on the stack.
        let slices = [IoSlice::new(parts[0]), IoSlice::new(parts[1]), IoSlice::new(parts[2])];
        let mut n = match w.write_vectored(&slices[first..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        while n > 0 {
            let p = &mut parts[first];
            let k = n.min(p.len());
            *p = &p[k..];
            n -= k;
            if p.is_empty() {
                first += 1;
            }
        }
    }
    Ok(())
}

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

#[cfg(test)]
#[path = "seal_tests.rs"]
mod tests;
