//! One direction's frame protection, per record: AES-256-GCM (encrypted and
//! authenticated) or a keyed BLAKE3 tag (authenticated only, the record left in clear).
//!
//! Why BLAKE3 for integrity-only rather than GMAC (AES-GCM with the record as associated
//! data only): measured per core on the development host (`cargo run --release -p
//! mooncake-core --example frame_mac_bench`, BENCHMARKS.md "Integrity-only frames"),
//! `ring` hashes associated data one 16-byte block at a time (2.7 GB/s), while its bulk
//! AES-GCM runs at 7-9 GB/s and keyed BLAKE3 (AVX-512) at 7-8 GB/s. A BLAKE3 tag reads
//! the record where it is: no copy into an encryption buffer on the sender and no write
//! pass (decryption) on the receiver. Measured through the framing layer, that saving
//! and BLAKE3's slightly lower speed than VAES AES-GCM cancel out on that host: both
//! cost ~0.22-0.29 CPU-s/GB per side against ~0.11-0.13 without a token (the same
//! example); integrity-only pays where AES-GCM is slower than BLAKE3.
//!
//! A tag covers `record | aad | len(aad) (u64 LE) | seq (u64 LE)` under the direction's
//! key (one per connection and direction, derived in the handshake, different per
//! protection), truncated to 16 bytes: the record first, so the hash starts on a chunk
//! boundary and keeps its SIMD width; the suffix is parsed from the end, so no two
//! (record, aad, seq) triples hash the same input. `seq` is the record's number in its
//! direction (never sent: both ends count), so a replayed, reordered, dropped or moved
//! record fails its tag.

use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_256_GCM};

use super::super::config::WireProtection;

pub const TAG_LEN: usize = 16;

/// A direction's key and how it protects frames.
#[derive(Clone, Copy)]
pub struct FrameKey {
    pub key: [u8; 32],
    pub protection: WireProtection,
}

impl std::fmt::Debug for FrameKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FrameKey({:?})", self.protection)
    }
}

/// The nonce bytes of record `seq` (AES-GCM; unique per key: records counted from 0).
pub fn nonce_bytes(seq: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&seq.to_be_bytes());
    n
}

/// One direction's protection, ready to use.
pub enum Guard {
    Sealed(Box<LessSafeKey>),
    Tagged([u8; 32]),
}

impl Guard {
    pub fn new(k: &FrameKey) -> Guard {
        match k.protection {
            WireProtection::Encrypted => {
                // 32 bytes is AES-256's key length: `new` cannot fail on it.
                let unbound =
                    UnboundKey::new(&AES_256_GCM, &k.key).unwrap_or_else(|_| unreachable!("a 32-byte AES-256 key"));
                Guard::Sealed(Box::new(LessSafeKey::new(unbound)))
            }
            WireProtection::Integrity => Guard::Tagged(k.key),
        }
    }

    /// Encrypts `record` in place (sealed) or leaves it (tagged), and returns its tag.
    pub fn protect(&self, seq: u64, aad: &[u8], record: &mut [u8]) -> [u8; TAG_LEN] {
        match self {
            Guard::Sealed(c) => {
                let nonce = Nonce::assume_unique_for_key(nonce_bytes(seq));
                // A record is at most 64 KiB, far below AES-GCM's limit: sealing cannot fail.
                let tag = c
                    .seal_in_place_separate_tag(nonce, Aad::from(aad), record)
                    .unwrap_or_else(|_| unreachable!("a record within AES-GCM's length limit"));
                let mut out = [0u8; TAG_LEN];
                out.copy_from_slice(tag.as_ref());
                out
            }
            Guard::Tagged(k) => mac(k, seq, aad, record),
        }
    }

    /// The tag of a record that travels in clear, computed where the record is.
    /// Only for [`Guard::Tagged`] (a sealed record must be encrypted: [`protect`](Self::protect)).
    pub fn tag_in_clear(&self, seq: u64, aad: &[u8], record: &[u8]) -> Option<[u8; TAG_LEN]> {
        match self {
            Guard::Tagged(k) => Some(mac(k, seq, aad, record)),
            Guard::Sealed(_) => None,
        }
    }

    /// Checks a received record against `tag` (decrypting it in place when sealed).
    /// On `false` the record's content is garbage and the connection must close.
    pub fn open(&self, seq: u64, aad: &[u8], record: &mut [u8], tag: [u8; TAG_LEN]) -> bool {
        match self {
            Guard::Sealed(c) => {
                let nonce = Nonce::assume_unique_for_key(nonce_bytes(seq));
                c.open_in_place_separate_tag(nonce, Aad::from(aad), Tag::from(tag), record, 0..).is_ok()
            }
            Guard::Tagged(k) => equal_in_constant_time(&mac(k, seq, aad, record), &tag),
        }
    }
}

fn mac(key: &[u8; 32], seq: u64, aad: &[u8], record: &[u8]) -> [u8; TAG_LEN] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(record);
    h.update(aad);
    h.update(&(aad.len() as u64).to_le_bytes());
    h.update(&seq.to_le_bytes());
    let mut out = [0u8; TAG_LEN];
    out.copy_from_slice(&h.finalize().as_bytes()[..TAG_LEN]);
    out
}

/// Tag comparison whose time does not depend on where the tags differ.
fn equal_in_constant_time(a: &[u8; TAG_LEN], b: &[u8; TAG_LEN]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(protection: WireProtection) -> FrameKey {
        FrameKey { key: [9u8; 32], protection }
    }

    #[test]
    fn a_tag_in_clear_binds_record_head_and_sequence() {
        let g = Guard::new(&key(WireProtection::Integrity));
        let mut rec = b"kv bytes of one record".to_vec();
        let tag = g.protect(4, b"head", &mut rec);
        assert_eq!(rec, b"kv bytes of one record", "integrity-only leaves the record as it is");
        assert_eq!(g.tag_in_clear(4, b"head", &rec), Some(tag));
        assert!(g.open(4, b"head", &mut rec.clone(), tag));
        assert!(!g.open(5, b"head", &mut rec.clone(), tag), "another sequence number (replay, reorder)");
        assert!(!g.open(4, b"heae", &mut rec.clone(), tag), "another head");
        // Bytes moved between the head and the record do not hash the same.
        assert!(!g.open(4, b"headk", &mut rec[1..].to_vec(), g.protect(4, b"head", &mut rec.clone())));
        let mut flipped = rec.clone();
        flipped[3] ^= 0x10;
        assert!(!g.open(4, b"head", &mut flipped, tag));
        let other = Guard::new(&FrameKey { key: [8u8; 32], protection: WireProtection::Integrity });
        assert!(!other.open(4, b"head", &mut rec.clone(), tag), "another key");
    }

    #[test]
    fn the_two_protections_do_not_accept_each_others_records() {
        let (e, i) = (Guard::new(&key(WireProtection::Encrypted)), Guard::new(&key(WireProtection::Integrity)));
        assert!(e.tag_in_clear(0, b"", b"x").is_none(), "an encrypted record is never sent in clear");
        let plain = b"same bytes".to_vec();
        let mut sealed = plain.clone();
        let tag = e.protect(0, b"h", &mut sealed);
        assert_ne!(sealed, plain);
        assert!(!i.open(0, b"h", &mut sealed.clone(), tag));
        let tag = i.protect(0, b"h", &mut plain.clone());
        assert!(!e.open(0, b"h", &mut plain.clone(), tag));
        let mut back = sealed.clone();
        assert!(e.open(0, b"h", &mut back, e.protect(0, b"h", &mut plain.clone())) && back == plain);
    }
}
