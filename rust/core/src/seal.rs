//! Sealed records: confidentiality and integrity for one direction of an authenticated
//! session (the control, client and relay links of a deployment).
//!
//! A mutual handshake over a shared token proves who is at each end, but binds nothing
//! that follows: a relay can pass a real handshake through and then read or rewrite every
//! frame. So after the handshake both ends derive one key per direction from the token
//! and the handshake's fresh nonces (the caller does that), and every byte of the stream
//! travels inside records sealed with AES-256-GCM under that key:
//!
//! ```text
//! length (u32, big endian) | ciphertext | tag (16)
//! ```
//!
//! The nonce is the record's sequence number in that direction (never sent: both ends
//! count), so a replayed, reordered, dropped or reflected record fails its tag; the
//! length header is authenticated data, so it cannot be rewritten either. A relay that
//! lacks the token cannot derive the keys: it sees ciphertext and can only cut the
//! connection. AES-GCM because x86-64 and Arm servers do it in hardware;
//! `aws-lc-rs`'s assembly (AES-NI/VAES and carry-less multiply, picked at run time) seals
//! several times faster than RustCrypto's AES-GCM and ChaCha20-Poly1305 here, and
//! 1.2-1.7x `ring`'s (BENCHMARKS.md); the data plane's frames use the same crate.

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_256_GCM};

use crate::error::{Categorized, ErrorCategory};

/// Bytes of the length header in front of every record.
pub const HEADER_LEN: usize = 4;
/// Bytes of the tag at the end of every record.
pub const TAG_LEN: usize = 16;
/// The most plaintext one record carries (a longer write is cut into several records).
pub const MAX_PLAINTEXT: usize = 1 << 20;
/// Bytes of a session key.
pub const KEY_LEN: usize = 32;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SealError {
    #[error("a session key is {KEY_LEN} bytes, got {0}")]
    KeyLength(usize),
    #[error("a sealed record carries at most {max} bytes, got {0}", max = MAX_PLAINTEXT)]
    TooLarge(usize),
    #[error("a record header announces {0} bytes, outside 16..={max} (not a sealed session, or corrupted)",
            max = MAX_PLAINTEXT + TAG_LEN)]
    BadLength(usize),
    #[error("a record failed its integrity check (tampered with, replayed, reordered, or from another session)")]
    Forged,
    #[error("the session sealed 2^64 records; open a new one")]
    Exhausted,
}

impl Categorized for SealError {
    fn category(&self) -> ErrorCategory {
        match self {
            SealError::KeyLength(_) | SealError::TooLarge(_) => ErrorCategory::InvalidArgument,
            SealError::BadLength(_) | SealError::Forged | SealError::Exhausted => ErrorCategory::Unauthorized,
        }
    }
}

fn cipher(key: &[u8]) -> Result<LessSafeKey, SealError> {
    if key.len() != KEY_LEN {
        return Err(SealError::KeyLength(key.len()));
    }
    Ok(LessSafeKey::new(UnboundKey::new(&AES_256_GCM, key).map_err(|_| SealError::KeyLength(key.len()))?))
}

/// The nonce of record `seq`: unique per key because each direction has its own key
/// and counts its records from 0 (and never wraps: `Exhausted`).
fn nonce(seq: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&seq.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

/// The sending direction of a session: plaintext in, records out.
pub struct Sealer {
    cipher: LessSafeKey,
    seq: u64,
}

impl Sealer {
    pub fn new(key: &[u8]) -> Result<Sealer, SealError> {
        Ok(Sealer { cipher: cipher(key)?, seq: 0 })
    }

    /// One record (header, ciphertext, tag) carrying `plaintext`.
    pub fn seal(&mut self, plaintext: &[u8]) -> Result<Vec<u8>, SealError> {
        if plaintext.len() > MAX_PLAINTEXT {
            return Err(SealError::TooLarge(plaintext.len()));
        }
        let seq = self.seq;
        self.seq = seq.checked_add(1).ok_or(SealError::Exhausted)?;
        let body = plaintext.len() + TAG_LEN;
        let mut out = Vec::with_capacity(HEADER_LEN + body);
        out.extend_from_slice(&(body as u32).to_be_bytes());
        out.extend_from_slice(plaintext);
        let (header, text) = out.split_at_mut(HEADER_LEN);
        let tag: Tag = self
            .cipher
            .seal_in_place_separate_tag(nonce(seq), Aad::from(&*header), text)
            .map_err(|_| SealError::TooLarge(plaintext.len()))?;
        out.extend_from_slice(tag.as_ref());
        Ok(out)
    }

    /// Records sealed so far.
    pub fn sealed(&self) -> u64 {
        self.seq
    }
}

/// The receiving direction: records in (header first, to know how much to read), plaintext out.
pub struct Opener {
    cipher: LessSafeKey,
    seq: u64,
}

impl Opener {
    pub fn new(key: &[u8]) -> Result<Opener, SealError> {
        Ok(Opener { cipher: cipher(key)?, seq: 0 })
    }

    /// The body length (ciphertext and tag) a record header announces, checked against
    /// the bound before the caller reads (and buffers) that much.
    pub fn body_length(header: &[u8; HEADER_LEN]) -> Result<usize, SealError> {
        let n = u32::from_be_bytes(*header) as usize;
        if !(TAG_LEN..=MAX_PLAINTEXT + TAG_LEN).contains(&n) {
            return Err(SealError::BadLength(n));
        }
        Ok(n)
    }

    /// The plaintext of the next record; `Forged` if it is not the next record this
    /// session's peer sealed. After an error the session is broken: close it.
    pub fn open(&mut self, header: &[u8; HEADER_LEN], body: &[u8]) -> Result<Vec<u8>, SealError> {
        let n = Self::body_length(header)?;
        if body.len() != n {
            return Err(SealError::BadLength(body.len()));
        }
        let mut out = body.to_vec();
        let seq = self.seq;
        let len = self
            .cipher
            .open_in_place(nonce(seq), Aad::from(&header[..]), &mut out)
            .map_err(|_| SealError::Forged)?
            .len();
        out.truncate(len);
        self.seq = seq.checked_add(1).ok_or(SealError::Exhausted)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(rec: &[u8]) -> ([u8; HEADER_LEN], &[u8]) {
        (rec[..HEADER_LEN].try_into().unwrap(), &rec[HEADER_LEN..])
    }

    #[test]
    fn records_round_trip_in_order_and_hide_their_text() {
        let key = [7u8; 32];
        let (mut s, mut o) = (Sealer::new(&key).unwrap(), Opener::new(&key).unwrap());
        for msg in [&b"prompt tokens 1 2 3"[..], b"", &vec![0xAB; MAX_PLAINTEXT]] {
            let rec = s.seal(msg).unwrap();
            assert_eq!(rec.len(), HEADER_LEN + msg.len() + TAG_LEN);
            if msg.len() > 8 {
                assert!(!rec.windows(8).any(|w| w == &msg[..8]), "plaintext visible in the record");
            }
            let (h, b) = split(&rec);
            assert_eq!(o.open(&h, b).unwrap(), msg);
        }
    }

    #[test]
    fn tampered_replayed_reordered_and_foreign_records_fail() {
        let key = [1u8; 32];
        let mut s = Sealer::new(&key).unwrap();
        let r0 = s.seal(b"first").unwrap();
        let r1 = s.seal(b"second").unwrap();
        // reordered
        let mut o = Opener::new(&key).unwrap();
        let (h, b) = split(&r1);
        assert_eq!(o.open(&h, b), Err(SealError::Forged));
        // a flipped bit in the body, then in the header (same length: still caught)
        for i in 0..r0.len() {
            let mut bad = r0.clone();
            bad[i] ^= 1;
            let mut o = Opener::new(&key).unwrap();
            let (h, b) = split(&bad);
            assert!(o.open(&h, b).is_err(), "byte {i}");
        }
        // replayed
        let mut o = Opener::new(&key).unwrap();
        let (h, b) = split(&r0);
        o.open(&h, b).unwrap();
        assert_eq!(o.open(&h, b), Err(SealError::Forged));
        // another key (another session or direction)
        let mut o = Opener::new(&[2u8; 32]).unwrap();
        assert_eq!(o.open(&h, b), Err(SealError::Forged));
    }

    #[test]
    fn bounds_are_checked_before_anything_is_read() {
        assert_eq!(Sealer::new(&[0u8; 31]).err(), Some(SealError::KeyLength(31)));
        assert_eq!(Opener::body_length(&[0, 0, 0, 3]), Err(SealError::BadLength(3)));
        assert_eq!(Opener::body_length(&[0xFF; 4]), Err(SealError::BadLength(u32::MAX as usize)));
        let mut s = Sealer::new(&[0u8; 32]).unwrap();
        assert_eq!(s.seal(&vec![0; MAX_PLAINTEXT + 1]), Err(SealError::TooLarge(MAX_PLAINTEXT + 1)));
        assert_eq!(SealError::Forged.category(), ErrorCategory::Unauthorized);
    }
}
