//! Frame confidentiality and integrity after an authenticated handshake.
//!
//! The handshake proves that both ends know the token, but by itself it protects
//! nothing that follows: a relay could pass a real handshake through and then read KV or
//! inject frames of its own. So when the engines share a token, every frame after the
//! handshake is sealed with AES-256-GCM under a per-connection, per-direction key
//! ([`AuthKey::frame_keys`](super::super::auth::AuthKey::frame_keys)), its nonce the
//! frame's sequence number (counted per direction from 0, never sent): the frame's
//! header and body (`head`) are authenticated data, its payload (KV bytes) is encrypted,
//! and a [`TAG_LEN`]-byte tag follows. A forged, replayed, reordered or dropped frame
//! fails its tag (or the next one's) and the receiver closes the connection; a relay
//! sees no KV byte. Without a token there is no authentication at all and frames carry
//! no tag. AES-GCM rather than a keyed hash: `ring`'s AES-GCM (AES-NI/VAES and
//! carry-less multiply) encrypts as fast as BLAKE3 hashes on the machines measured
//! (BENCHMARKS.md, "The cost of security"), so confidentiality costs no more than
//! integrity did.
//!
//! A receiver can check a tag only after the frame's last byte. So the server stages a
//! write's payload and copies it into the region only once the tag matched: an
//! unverified byte never lands in served memory. A read response is received straight
//! into the initiator's own buffer and decrypted there, whose content is undefined until
//! the request reports `ok` (a bad tag fails or retries the request, never reports it
//! done).

use std::io::{self, IoSlice, Read, Write};

use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_256_GCM};

use super::super::protocol::{FrameError, MAX_DATA};
use super::ConnError;

pub const TAG_LEN: usize = 16;

/// One end's keys of a connection (`None` everywhere without a token).
#[derive(Clone, Copy, Default)]
pub struct FrameKeys {
    pub send: Option<[u8; 32]>,
    pub recv: Option<[u8; 32]>,
}

/// A direction's cipher and the number of the next frame.
struct Direction {
    key: LessSafeKey,
    seq: u64,
}

impl Direction {
    fn new(key: &[u8; 32]) -> Direction {
        // 32 bytes is AES-256's key length: `new` cannot fail on it.
        let unbound = UnboundKey::new(&AES_256_GCM, key).unwrap_or_else(|_| unreachable!("a 32-byte AES-256 key"));
        Direction { key: LessSafeKey::new(unbound), seq: 0 }
    }

    /// The nonce of the next frame (unique per key: one key per connection and
    /// direction, frames counted from 0; a connection never sends 2^64 frames).
    fn next_nonce(&mut self) -> Nonce {
        let mut n = [0u8; 12];
        n[4..].copy_from_slice(&self.seq.to_be_bytes());
        self.seq = self.seq.wrapping_add(1);
        Nonce::assume_unique_for_key(n)
    }
}

/// The sending half of a connection: frames out, each sealed when keyed.
pub struct FrameWriter<W> {
    inner: W,
    seal: Option<Direction>,
    /// The payload's ciphertext (the caller's bytes are never written to).
    scratch: Vec<u8>,
}

impl<W: Write> FrameWriter<W> {
    pub fn new(inner: W, key: Option<[u8; 32]>) -> Self {
        FrameWriter { inner, seal: key.as_ref().map(Direction::new), scratch: Vec::new() }
    }

    /// Writes one frame (`head`, then `data`, then the tag) with as few syscalls as the
    /// kernel allows.
    pub fn send(&mut self, head: &[u8], data: &[u8]) -> io::Result<()> {
        let Some(dir) = &mut self.seal else {
            return write_all_parts(&mut self.inner, &mut [head, data, &[]]);
        };
        self.scratch.clear();
        self.scratch.extend_from_slice(data);
        let nonce = dir.next_nonce();
        let tag = dir
            .key
            .seal_in_place_separate_tag(nonce, Aad::from(head), &mut self.scratch)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too large to seal"))?;
        let r = write_all_parts(&mut self.inner, &mut [head, &self.scratch, tag.as_ref()]);
        if self.scratch.capacity() > 2 * MAX_DATA {
            self.scratch = Vec::new(); // bound what an idle connection holds
        }
        r
    }

    pub fn get_ref(&self) -> &W {
        &self.inner
    }
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

/// The receiving half. The frame's head is read through [`Read`] (kept as the frame's
/// authenticated data when keyed); a payload through [`read_payload`](Self::read_payload)
/// or [`discard_payload`](Self::discard_payload), which also end the frame; a frame
/// without a payload ends with [`end_frame`](Self::end_frame).
pub struct FrameReader<R> {
    inner: R,
    open: Option<(Direction, Vec<u8>)>,
}

impl<R: Read> FrameReader<R> {
    pub fn new(inner: R, key: Option<[u8; 32]>) -> Self {
        FrameReader { inner, open: key.as_ref().map(|k| (Direction::new(k), Vec::new())) }
    }

    /// Whether frames are sealed (then payloads must be verified before use).
    pub fn keyed(&self) -> bool {
        self.open.is_some()
    }

    /// Reads the frame's payload into `buf` and, when keyed, its tag, and decrypts `buf`
    /// in place: `Err` (the connection must close) if the tag does not match, and then
    /// `buf` holds garbage the caller must not use.
    pub fn read_payload(&mut self, buf: &mut [u8]) -> Result<(), ConnError> {
        self.inner.read_exact(buf)?;
        self.verify(buf)
    }

    /// Reads and drops a payload of `n` bytes, verifying the frame when keyed.
    pub fn discard_payload(&mut self, n: usize) -> Result<(), ConnError> {
        if self.open.is_none() {
            let copied = io::copy(&mut (&mut self.inner).take(n as u64), &mut io::sink())?;
            return if copied as usize == n { Ok(()) } else { Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()) };
        }
        if n > MAX_DATA {
            return Err(ConnError::Frame(FrameError::Malformed));
        }
        let mut buf = vec![0u8; n];
        self.read_payload(&mut buf)
    }

    /// Ends a frame that has no payload: reads its tag and checks it. A no-op without a key.
    pub fn end_frame(&mut self) -> Result<(), ConnError> {
        self.verify(&mut [])
    }

    fn verify(&mut self, payload: &mut [u8]) -> Result<(), ConnError> {
        let Some((dir, head)) = &mut self.open else { return Ok(()) };
        let mut tag = [0u8; TAG_LEN];
        self.inner.read_exact(&mut tag)?;
        let nonce = dir.next_nonce();
        let ok = dir
            .key
            .open_in_place_separate_tag(nonce, Aad::from(&head[..]), Tag::from(tag), payload, 0..)
            .is_ok();
        head.clear();
        if ok {
            Ok(())
        } else {
            Err(ConnError::Frame(FrameError::BadTag))
        }
    }
}

impl<R: Read> Read for FrameReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some((_, head)) = &mut self.open {
            if head.len() + n > 4096 {
                // A head is a header and a small body (MAX_CONTROL); more is not a frame.
                return Err(io::Error::new(io::ErrorKind::InvalidData, "frame head too long"));
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(key: Option<[u8; 32]>) -> Vec<u8> {
        let mut w = FrameWriter::new(Vec::new(), key);
        w.send(b"head-1", b"payload").unwrap();
        w.send(b"head-2", b"").unwrap();
        w.inner
    }

    fn read_two(wire: &[u8], key: Option<[u8; 32]>) -> Result<Vec<u8>, ConnError> {
        let mut r = FrameReader::new(wire, key);
        let mut a = [0u8; 6];
        r.read_exact(&mut a).map_err(ConnError::from)?;
        let mut payload = [0u8; 7];
        r.read_payload(&mut payload)?;
        let mut b = [0u8; 6];
        r.read_exact(&mut b).map_err(ConnError::from)?;
        r.end_frame()?;
        Ok(payload.to_vec())
    }

    #[test]
    fn frames_are_sealed_and_any_change_fails() {
        let k = [7u8; 32];
        let wire = frames(Some(k));
        assert_eq!(wire.len(), 13 + 6 + 2 * TAG_LEN);
        assert_eq!(read_two(&wire, Some(k)).unwrap(), b"payload");
        assert!(!wire.windows(7).any(|w| w == b"payload"), "the payload crossed in clear");
        assert!(read_two(&wire, Some([8u8; 32])).is_err(), "another key");
        for i in [0, 5, 6, 12, 13 + 1, 13 + TAG_LEN + 2, wire.len() - 1] {
            let mut bad = wire.clone();
            bad[i] ^= 1;
            assert!(read_two(&bad, Some(k)).is_err(), "flipped byte {i} went unnoticed");
        }
        // Reordered frames (a replay of frame 0 as frame 1 included) fail the sequence.
        let (f0, f1) = wire.split_at(13 + TAG_LEN);
        let swapped = [f1, f0].concat();
        let mut r = FrameReader::new(&swapped[..], Some(k));
        let mut b = [0u8; 6];
        r.read_exact(&mut b).unwrap();
        assert!(r.end_frame().is_err());
        // A payload dropped unread is still verified.
        let mut r = FrameReader::new(&wire[..], Some(k));
        r.read_exact(&mut b).unwrap();
        assert!(r.discard_payload(7).is_ok());
        let mut bad = wire.clone();
        bad[8] ^= 1;
        let mut r = FrameReader::new(&bad[..], Some(k));
        r.read_exact(&mut b).unwrap();
        assert!(r.discard_payload(7).is_err());
    }

    #[test]
    fn without_a_key_frames_are_bare() {
        assert_eq!(frames(None), b"head-1payloadhead-2".to_vec());
        assert_eq!(read_two(&frames(None), None).unwrap(), b"payload");
    }
}
