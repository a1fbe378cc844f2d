//! One direction's frame protection, per record: AES-256-GCM (encrypted and
//! authenticated) or GMAC (authenticated only, the record left in clear: AES-256-GCM with
//! no plaintext and the record as associated data, NIST SP 800-38D), both through
//! `aws-lc-rs` (its VAES/VPCLMULQDQ AES-GCM sealed 1.2-1.7x `ring`'s per core here:
//! BENCHMARKS.md, "Issue 26, authenticated TCP like for like").
//!
//! Why GMAC through `aws-lc-rs` for integrity-only: measured per core on the development
//! host (BENCHMARKS.md, "Issue 26, authenticated TCP like for like"), AWS-LC hashes
//! associated data with its wide VPCLMULQDQ/AVX-512 GHASH (10-26 GB/s), 2-4x keyed BLAKE3
//! (2.2-8 GB/s, the tag before) and ring's AES-GCM (which takes associated data one block
//! at a time: GMAC through ring is 0.5-2.7 GB/s). The tag reads the record where it is: no
//! copy into an encryption buffer on the sender and no write pass (decryption) on the
//! receiver, but for a frame's first record (below).
//!
//! A tag is GMAC under the direction's key (one per connection and direction, derived in
//! the handshake, different per protection) with the record's sequence number as the
//! nonce ([`nonce_bytes`]: `seq` counts a direction's records from 0 and is never sent,
//! so a nonce is never used twice under a key, and a replayed, reordered, dropped or moved
//! record fails its tag). Its associated data is the record alone for a frame's later
//! records, and `record | head | len(head) (u64 LE)` for its first (the head is the
//! frame's header and body): the length is parsed from the end, so no two (record, head)
//! pairs give the same input. `aws-lc-rs` takes one contiguous input, so a first record
//! is hashed in parts through AWS-LC's `EVP_CIPHER` interface instead
//! ([`GmacParts`](super::gmac_parts): record, head and length where they are, the same
//! tag), or, where that context is missing, copied with its head into a per-thread
//! buffer (the reference path the tests compare with); the server's staged receive lays
//! the head out in room after the record ([`Guard::open_with_room`]); later records are
//! tagged in place.

use std::cell::RefCell;

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};

use super::super::config::WireProtection;
use super::gmac_parts::{same_tag, GmacParts};

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

/// The nonce bytes of record `seq` (AES-GCM and GMAC; unique per key: records counted from 0).
pub fn nonce_bytes(seq: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&seq.to_be_bytes());
    n
}

/// One direction's protection, ready to use.
pub enum Guard {
    Sealed(Box<LessSafeKey>),
    /// The key, and the same key's context for first records in parts ([`GmacParts`];
    /// `None` if AWS-LC could not make one: then first records are copied).
    Tagged(Box<LessSafeKey>, RefCell<Option<GmacParts>>),
}

impl Guard {
    pub fn new(k: &FrameKey) -> Guard {
        // Both protections are AES-256-GCM under the direction's key (GMAC is AES-GCM with
        // no plaintext); 32 bytes is AES-256's key length, so `new` cannot fail on it.
        let unbound = UnboundKey::new(&AES_256_GCM, &k.key).unwrap_or_else(|_| unreachable!("a 32-byte AES-256 key"));
        let key = Box::new(LessSafeKey::new(unbound));
        match k.protection {
            WireProtection::Encrypted => Guard::Sealed(key),
            WireProtection::Integrity => Guard::Tagged(key, RefCell::new(GmacParts::new(&k.key))),
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
            Guard::Tagged(k, parts) => mac(k, parts, seq, aad, record),
        }
    }

    /// Whether records travel in clear (integrity-only), tagged by [`tag_in_clear`](Self::tag_in_clear).
    pub fn in_clear(&self) -> bool {
        matches!(self, Guard::Tagged(..))
    }

    /// The tag of a record that travels in clear, computed where the record is.
    /// Only for [`Guard::Tagged`] (a sealed record must be encrypted: [`protect`](Self::protect)).
    pub fn tag_in_clear(&self, seq: u64, aad: &[u8], record: &[u8]) -> Option<[u8; TAG_LEN]> {
        match self {
            Guard::Tagged(k, parts) => Some(mac(k, parts, seq, aad, record)),
            Guard::Sealed(_) => None,
        }
    }

    /// Checks a received record against `tag` (decrypting it in place when sealed).
    /// On `false` the record's content is garbage and the connection must close.
    pub fn open(&self, seq: u64, aad: &[u8], record: &mut [u8], tag: [u8; TAG_LEN]) -> bool {
        match self {
            Guard::Sealed(c) => {
                let nonce = Nonce::assume_unique_for_key(nonce_bytes(seq));
                c.open_in_place_separate_tag(nonce, Aad::from(aad), &tag, record).is_ok()
            }
            Guard::Tagged(k, parts) => match first_record_tag(parts, seq, aad, record) {
                Some(want) => same_tag(&want, &tag),
                None => with_tagged_input(aad, record, |input| check(k, seq, input, tag)),
            },
        }
    }

    /// As [`open`](Self::open), for a record received into the first `len` bytes of
    /// `buf`, whose rest is the caller's scratch room: a tagged first record's input
    /// (`record | head | len(head)`) is laid out in that room instead of copied whole into
    /// the per-thread buffer. Without room for the head (or sealed) it is [`open`](Self::open).
    /// The bytes after `len` are overwritten either way.
    pub fn open_with_room(&self, seq: u64, aad: &[u8], buf: &mut [u8], len: usize, tag: [u8; TAG_LEN]) -> bool {
        let input_len = len + aad.len() + 8;
        match self {
            Guard::Tagged(k, _) if !aad.is_empty() && buf.len() >= input_len => {
                write_head_after_record(&mut buf[len..input_len], aad);
                check(k, seq, &buf[..input_len], tag)
            }
            _ => self.open(seq, aad, &mut buf[..len], tag),
        }
    }
}

/// Whether `tag` is the GMAC tag of a tagged record's `input` (in constant time).
fn check(key: &LessSafeKey, seq: u64, input: &[u8], tag: [u8; TAG_LEN]) -> bool {
    let nonce = Nonce::assume_unique_for_key(nonce_bytes(seq));
    // No plaintext: this only checks the tag over `input`.
    key.open_in_place_separate_tag(nonce, Aad::from(input), &tag, &mut []).is_ok()
}

/// A first record's tag (`record | head | len(head)`) hashed in parts, where the record
/// is (no copy: [`GmacParts`]). `None` for a later record (no head: the one-slice call
/// reads it in place already) or if AWS-LC refused: then the caller copies.
fn first_record_tag(parts: &RefCell<Option<GmacParts>>, seq: u64, aad: &[u8], record: &[u8]) -> Option<[u8; TAG_LEN]> {
    if aad.is_empty() {
        return None;
    }
    let len = (aad.len() as u64).to_le_bytes();
    parts.borrow_mut().as_mut()?.tag(&nonce_bytes(seq), &[record, aad, &len])
}

/// The GMAC tag of a record that travels in clear (module docs: what it covers).
fn mac(key: &LessSafeKey, parts: &RefCell<Option<GmacParts>>, seq: u64, aad: &[u8], record: &[u8]) -> [u8; TAG_LEN] {
    if let Some(tag) = first_record_tag(parts, seq, aad, record) {
        return tag;
    }
    with_tagged_input(aad, record, |input| {
        let nonce = Nonce::assume_unique_for_key(nonce_bytes(seq));
        // No plaintext, and a record is at most 64 KiB (+ its head): sealing cannot fail.
        let tag = key
            .seal_in_place_separate_tag(nonce, Aad::from(input), &mut [])
            .unwrap_or_else(|_| unreachable!("associated data within AES-GCM's length limit"));
        let mut out = [0u8; TAG_LEN];
        out.copy_from_slice(tag.as_ref());
        out
    })
}

thread_local! {
    /// A frame's first record and its head, laid out as one input (at most a record and a
    /// head: allocated once per thread).
    static FIRST_RECORD: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Calls `f` with a record's tagged input: the record itself, or `record | aad | len(aad)`
/// when it has associated data (a frame's first record).
fn with_tagged_input<T>(aad: &[u8], record: &[u8], f: impl FnOnce(&[u8]) -> T) -> T {
    if aad.is_empty() {
        return f(record);
    }
    FIRST_RECORD.with(|buf| {
        let mut buf = buf.borrow_mut();
        buf.clear();
        buf.extend_from_slice(record);
        buf.resize(record.len() + aad.len() + 8, 0);
        write_head_after_record(&mut buf[record.len()..], aad);
        f(&buf)
    })
}

/// Writes what follows a first record in its tagged input: the head, then its length
/// (u64 LE). `dst` is exactly `aad.len() + 8` bytes. The one place that lays it out.
fn write_head_after_record(dst: &mut [u8], aad: &[u8]) {
    let (head, len) = dst.split_at_mut(aad.len());
    head.copy_from_slice(aad);
    len.copy_from_slice(&(aad.len() as u64).to_le_bytes());
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

    /// The reference: RustCrypto's `aes-gcm` (an independent implementation), sealing no
    /// plaintext with the tagged input as associated data, i.e. GMAC by its definition.
    fn reference_gmac(key: &[u8; 32], seq: u64, input: &[u8]) -> [u8; TAG_LEN] {
        use aes_gcm::aead::{AeadInPlace, KeyInit};
        let c = aes_gcm::Aes256Gcm::new_from_slice(key).unwrap();
        let tag = c.encrypt_in_place_detached(&nonce_bytes(seq).into(), input, &mut []).unwrap();
        tag.into()
    }

    #[test]
    fn integrity_tags_are_gmac_of_the_record_and_its_head() {
        let k = key(WireProtection::Integrity);
        let g = Guard::new(&k);
        for len in [0usize, 1, 15, 16, 17, 255, 4096, 65536] {
            let rec: Vec<u8> = (0..len).map(|i| (i * 13 % 256) as u8).collect();
            for seq in [0u64, 1, 77, u64::MAX] {
                // A later record of a frame: the record alone.
                assert_eq!(g.tag_in_clear(seq, b"", &rec), Some(reference_gmac(&k.key, seq, &rec)), "len {len}");
                // A first record: record | head | len(head).
                let head = b"MC\x01\x00head-and-body";
                let input = [&rec[..], head, &(head.len() as u64).to_le_bytes()].concat();
                let tag = g.tag_in_clear(seq, head, &rec).unwrap();
                assert_eq!(tag, reference_gmac(&k.key, seq, &input), "len {len} seq {seq}");
                assert!(g.open(seq, head, &mut rec.clone(), tag));
            }
        }
    }

    /// First records hashed in parts (no copy) against the copying path, the reference:
    /// the same tags, and `open` takes and refuses the same records, heads and sequences.
    #[test]
    fn first_records_in_parts_tag_and_open_as_the_copying_path() {
        let k = key(WireProtection::Integrity);
        let parts = Guard::new(&k);
        assert!(matches!(&parts, Guard::Tagged(_, p) if p.borrow().is_some()), "AWS-LC made the context");
        let copying = match Guard::new(&k) {
            Guard::Tagged(c, _) => Guard::Tagged(c, RefCell::new(None)),
            Guard::Sealed(_) => unreachable!(),
        };
        for len in [0usize, 1, 16, 17, 4097, 65536] {
            let rec: Vec<u8> = (0..len).map(|i| (i * 11 % 256) as u8).collect();
            for head in [&b""[..], b"MC\x01\x00h", b"MC\x01\x00head-and-body"] {
                for seq in [0u64, 3, u64::MAX] {
                    let tag = parts.tag_in_clear(seq, head, &rec).unwrap();
                    assert_eq!(Some(tag), copying.tag_in_clear(seq, head, &rec), "len {len} seq {seq}");
                    for g in [&parts, &copying] {
                        assert!(g.open(seq, head, &mut rec.clone(), tag));
                        assert!(!g.open(seq.wrapping_add(1), head, &mut rec.clone(), tag));
                        assert!(!g.open(seq, b"MC\x01\x00other", &mut rec.clone(), tag));
                        if len > 0 {
                            let mut flipped = rec.clone();
                            flipped[len - 1] ^= 1;
                            assert!(!g.open(seq, head, &mut flipped, tag));
                        }
                    }
                }
            }
        }
    }

    /// Sealed records are AES-256-GCM by its definition: ciphertext and tag equal those of
    /// an independent implementation (RustCrypto's `aes-gcm`) for the same key, nonce and
    /// associated data, so peers built on another conforming AES-GCM read them.
    #[test]
    fn sealed_records_are_standard_aes_gcm() {
        use aes_gcm::aead::{AeadInPlace, KeyInit};
        let k = key(WireProtection::Encrypted);
        let g = Guard::new(&k);
        let reference = aes_gcm::Aes256Gcm::new_from_slice(&k.key).unwrap();
        for len in [0usize, 1, 16, 17, 4096, 65536] {
            let plain: Vec<u8> = (0..len).map(|i| (i * 7 % 256) as u8).collect();
            for (seq, aad) in [(0u64, &b""[..]), (5, b"MC\x01\x00head"), (u64::MAX, b"h")] {
                let mut ours = plain.clone();
                let tag = g.protect(seq, aad, &mut ours);
                let mut theirs = plain.clone();
                let want = reference.encrypt_in_place_detached(&nonce_bytes(seq).into(), aad, &mut theirs).unwrap();
                assert_eq!(ours, theirs, "ciphertext, len {len} seq {seq}");
                assert_eq!(tag, <[u8; TAG_LEN]>::from(want), "tag, len {len} seq {seq}");
                assert!(g.open(seq, aad, &mut ours, tag));
                assert_eq!(ours, plain);
            }
        }
    }

    /// The staged receive's check (the head laid out after the record, in the stage)
    /// against `open`, the reference: the same verdict for the right tag and for a
    /// wrong record, head, sequence or tag, with and without room, under both protections.
    #[test]
    fn a_check_with_room_after_the_record_equals_open() {
        for p in [WireProtection::Integrity, WireProtection::Encrypted] {
            let g = Guard::new(&key(p));
            for len in [0usize, 1, 17, 4096, 65536] {
                let plain: Vec<u8> = (0..len).map(|i| (i * 29 % 256) as u8).collect();
                for head in [&b""[..], b"MC\x01\x00head-and-body"] {
                    let mut wire = plain.clone();
                    let tag = g.protect(3, head, &mut wire);
                    for room in [0usize, head.len() + 7, head.len() + 8, 4096 + 8] {
                        let staged = |seq: u64, head: &[u8], flip: Option<usize>, tag: [u8; TAG_LEN]| {
                            let mut buf = [&wire[..], &vec![0xAB; room]].concat();
                            if let Some(i) = flip {
                                buf[i] ^= 1;
                            }
                            let mut reference = buf[..len].to_vec();
                            let want = g.open(seq, head, &mut reference, tag);
                            let got = g.open_with_room(seq, head, &mut buf, len, tag);
                            assert_eq!(got, want, "{p:?} len {len} head {} room {room}", head.len());
                            assert!(!want || buf[..len] == reference[..], "the record as open leaves it");
                            got
                        };
                        assert!(staged(3, head, None, tag), "{p:?} len {len} room {room}");
                        assert!(!staged(4, head, None, tag));
                        assert!(!staged(3, b"other head", None, tag));
                        let mut bad_tag = tag;
                        bad_tag[0] ^= 1;
                        assert!(!staged(3, head, None, bad_tag));
                        if len > 0 {
                            assert!(!staged(3, head, Some(len / 2), tag));
                        }
                    }
                }
            }
        }
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
