//! Frame integrity after an authenticated handshake.
//!
//! The handshake proves that both ends know the token, but by itself it protects
//! nothing that follows: a relay could pass a real handshake through and then inject
//! frames of its own. So when the engines share a token, every frame after the
//! handshake ends with a [`TAG_LEN`]-byte tag: BLAKE3 keyed with a per-connection,
//! per-direction key ([`AuthKey::frame_keys`](super::super::auth::AuthKey::frame_keys)),
//! over the frame's sequence number (counted per direction from 0), its header, body
//! and payload. A forged, replayed, reordered or dropped frame fails its tag (or the
//! next one's) and the receiver closes the connection. Without a token there is no
//! authentication at all and frames carry no tag.
//!
//! A receiver can check a tag only after the frame's last byte. So the server stages a
//! write's payload and copies it into the region only once the tag matched: an
//! unverified byte never lands in served memory. A read response is received straight
//! into the initiator's own buffer, whose content is undefined until the request
//! reports `ok` (a bad tag fails or retries the request, never reports it done).

use std::io::{self, IoSlice, Read, Write};

use super::super::auth::mac_eq;
use super::super::protocol::FrameError;
use super::ConnError;

pub const TAG_LEN: usize = 32;

/// One end's keys of a connection (`None` everywhere without a token).
#[derive(Clone, Copy, Default)]
pub struct FrameKeys {
    pub send: Option<[u8; 32]>,
    pub recv: Option<[u8; 32]>,
}

fn hasher(key: &[u8; 32], seq: u64) -> blake3::Hasher {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(&seq.to_le_bytes());
    h
}

/// The sending half of a connection: frames out, each tagged when keyed.
pub struct FrameWriter<W> {
    inner: W,
    key: Option<([u8; 32], u64)>,
}

impl<W: Write> FrameWriter<W> {
    pub fn new(inner: W, key: Option<[u8; 32]>) -> Self {
        FrameWriter { inner, key: key.map(|k| (k, 0)) }
    }

    /// Writes one frame (`head`, then `data`, then the tag) with as few syscalls as the
    /// kernel allows.
    pub fn send(&mut self, head: &[u8], data: &[u8]) -> io::Result<()> {
        let tag = match &mut self.key {
            Some((key, seq)) => {
                let mut h = hasher(key, *seq);
                h.update(head);
                h.update(data);
                *seq += 1;
                Some(*h.finalize().as_bytes())
            }
            None => None,
        };
        let tag: &[u8] = tag.as_ref().map_or(&[], |t| t.as_slice());
        write_all_parts(&mut self.inner, &mut [head, data, tag])
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

/// The receiving half: hashes every byte read through it; [`end_frame`](Self::end_frame)
/// checks the tag after each frame.
pub struct FrameReader<R> {
    inner: R,
    verify: Option<Verify>,
}

struct Verify {
    key: [u8; 32],
    seq: u64,
    hasher: blake3::Hasher,
}

impl<R: Read> FrameReader<R> {
    pub fn new(inner: R, key: Option<[u8; 32]>) -> Self {
        FrameReader { inner, verify: key.map(|key| Verify { key, seq: 0, hasher: hasher(&key, 0) }) }
    }

    /// Whether frames carry tags (then payloads must be verified before use).
    pub fn keyed(&self) -> bool {
        self.verify.is_some()
    }

    /// Reads a frame's payload into `buf`, then hashes it in one call: BLAKE3 hashes the
    /// whole chunks of one update on every SIMD lane at once (16 with AVX-512), where
    /// hashing each socket read as it comes (a few KiB each) leaves most lanes idle and
    /// ends every read on a partial chunk. The caller must not use `buf` before
    /// [`end_frame`](Self::end_frame) says the tag matched.
    pub fn read_payload(&mut self, buf: &mut [u8]) -> io::Result<()> {
        self.inner.read_exact(buf)?;
        if let Some(v) = &mut self.verify {
            v.hasher.update(buf);
        }
        Ok(())
    }

    /// Reads the tag that follows the frame just read and checks it; `Err` (the
    /// connection must close) on a mismatch. A no-op without a key.
    pub fn end_frame(&mut self) -> Result<(), ConnError> {
        let Some(v) = &mut self.verify else { return Ok(()) };
        let mut tag = [0u8; TAG_LEN];
        self.inner.read_exact(&mut tag)?;
        let want = *v.hasher.finalize().as_bytes();
        v.seq += 1;
        v.hasher = hasher(&v.key, v.seq);
        if mac_eq(&want, &tag) {
            Ok(())
        } else {
            Err(ConnError::Frame(FrameError::BadTag))
        }
    }
}

impl<R: Read> Read for FrameReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(v) = &mut self.verify {
            v.hasher.update(&buf[..n]);
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

    fn read_two(wire: &[u8], key: Option<[u8; 32]>) -> Result<(), ConnError> {
        let mut r = FrameReader::new(wire, key);
        let mut a = [0u8; 6];
        r.read_exact(&mut a).map_err(ConnError::from)?;
        let mut payload = [0u8; 7]; // (read whole, then hashed: the same tag)
        r.read_payload(&mut payload).map_err(ConnError::from)?;
        r.end_frame()?;
        let mut b = [0u8; 6];
        r.read_exact(&mut b).map_err(ConnError::from)?;
        r.end_frame()
    }

    #[test]
    fn tags_verify_and_any_change_fails() {
        let k = [7u8; 32];
        let wire = frames(Some(k));
        assert_eq!(wire.len(), 13 + 6 + 2 * TAG_LEN);
        assert!(read_two(&wire, Some(k)).is_ok());
        assert!(read_two(&wire, Some([8u8; 32])).is_err(), "another key");
        for i in [0, 8, 12, 13 + 1, 13 + TAG_LEN + 2, wire.len() - 1] {
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
    }

    #[test]
    fn without_a_key_frames_are_bare() {
        assert_eq!(frames(None), b"head-1payloadhead-2".to_vec());
        assert!(read_two(&frames(None), None).is_ok());
    }
}
