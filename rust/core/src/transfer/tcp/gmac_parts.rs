//! GMAC of an input given in parts (a frame's first record, its head, the head's
//! length), without laying the parts out in one buffer first.
//!
//! `aws-lc-rs` takes a GMAC input (AES-256-GCM's associated data) as one slice, so a
//! tagged frame's first record used to be copied with its head into a per-thread buffer
//! before it was tagged: 64 KiB a frame, every record of a 64 KiB request. AWS-LC's
//! `EVP_CIPHER` interface takes associated data in pieces (`EVP_EncryptUpdate` with no
//! output, before any plaintext) and hashes them with the same GHASH as the `aws-lc-rs`
//! call, so the record is read where it is. The tag is the same bytes (GMAC of the
//! concatenation, NIST SP 800-38D); the tests check it against the copying path and an
//! independent implementation.

use std::ffi::{c_int, c_void};
use std::ptr::{null, null_mut};

use aws_lc_sys as sys;

use super::guard::TAG_LEN;

/// One direction's GMAC context (the AES-256 key schedule, kept; a nonce per tag).
pub struct GmacParts {
    ctx: *mut sys::EVP_CIPHER_CTX,
}

// SAFETY: the context is owned by this value alone and used through `&mut self` only;
// AWS-LC contexts may move between threads (they hold no thread-local state).
unsafe impl Send for GmacParts {}

impl GmacParts {
    /// `None` when AWS-LC could not allocate or key the context (then callers copy).
    pub fn new(key: &[u8; 32]) -> Option<GmacParts> {
        // SAFETY: a fresh context is keyed with a 32-byte key for AES-256-GCM (the cipher
        // reads exactly 32 bytes); it is freed by Drop, or here when keying fails.
        unsafe {
            let ctx = sys::EVP_CIPHER_CTX_new();
            if ctx.is_null() {
                return None;
            }
            let me = GmacParts { ctx };
            let ok = sys::EVP_EncryptInit_ex(ctx, sys::EVP_aes_256_gcm(), null_mut(), key.as_ptr(), null()) == 1;
            ok.then_some(me)
        }
    }

    /// The GMAC tag under `nonce` of the concatenation of `parts` (`None`: AWS-LC
    /// refused, e.g. a part over 2 GiB; callers then take the copying path).
    pub fn tag(&mut self, nonce: &[u8; 12], parts: &[&[u8]]) -> Option<[u8; TAG_LEN]> {
        // SAFETY: `ctx` was keyed for AES-256-GCM in `new`, whose default nonce length is
        // 12 bytes (`nonce` is 12); each update reads `p.len()` bytes of `p` and writes
        // nothing (no output: associated data); the final call writes no bytes for GCM
        // with no plaintext (`sink` has room for a block anyway) and the control call
        // writes exactly TAG_LEN bytes into `out`.
        unsafe {
            if sys::EVP_EncryptInit_ex(self.ctx, null(), null_mut(), null(), nonce.as_ptr()) != 1 {
                return None;
            }
            for p in parts.iter().filter(|p| !p.is_empty()) {
                let len = c_int::try_from(p.len()).ok()?;
                let mut outl: c_int = 0;
                if sys::EVP_EncryptUpdate(self.ctx, null_mut(), &mut outl, p.as_ptr(), len) != 1 {
                    return None;
                }
            }
            let mut sink = [0u8; 16];
            let mut outl: c_int = 0;
            if sys::EVP_EncryptFinal_ex(self.ctx, sink.as_mut_ptr(), &mut outl) != 1 {
                return None;
            }
            let mut out = [0u8; TAG_LEN];
            let get_tag = sys::EVP_CTRL_GCM_GET_TAG as c_int;
            if sys::EVP_CIPHER_CTX_ctrl(self.ctx, get_tag, TAG_LEN as c_int, out.as_mut_ptr() as *mut c_void) != 1 {
                return None;
            }
            Some(out)
        }
    }
}

impl Drop for GmacParts {
    fn drop(&mut self) {
        // SAFETY: `ctx` came from EVP_CIPHER_CTX_new and is freed once, here.
        unsafe { sys::EVP_CIPHER_CTX_free(self.ctx) }
    }
}

/// Constant-time equality of two tags.
pub fn same_tag(a: &[u8; TAG_LEN], b: &[u8; TAG_LEN]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::tcp::guard::nonce_bytes;
    use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};

    /// The reference: `aws-lc-rs`'s one-slice GMAC of the concatenated input (the path
    /// that copies a first record before tagging it).
    fn one_slice(key: &[u8; 32], seq: u64, input: &[u8]) -> [u8; TAG_LEN] {
        let k = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, key).unwrap());
        let nonce = Nonce::assume_unique_for_key(nonce_bytes(seq));
        let tag = k.seal_in_place_separate_tag(nonce, Aad::from(input), &mut []).unwrap();
        tag.as_ref().try_into().unwrap()
    }

    /// Parts that do not end on a 16-byte block (GHASH's unit) hash as their
    /// concatenation: every split point of a short input, and record-sized inputs
    /// split as a first record is (record, head, length), tag after tag on one context.
    #[test]
    fn a_tag_in_parts_is_the_tag_of_the_concatenation() {
        let key = [5u8; 32];
        let mut g = GmacParts::new(&key).unwrap();
        let input: Vec<u8> = (0..77u32).map(|i| (i * 31 % 251) as u8).collect();
        for a in 0..=input.len() {
            for b in [a, (a + 1).min(input.len()), (a + 16).min(input.len()), input.len()] {
                let parts = [&input[..a], &input[a..b], &input[b..]];
                assert_eq!(g.tag(&nonce_bytes(9), &parts), Some(one_slice(&key, 9, &input)), "split {a} {b}");
            }
        }
        for len in [0usize, 1, 15, 16, 17, 4095, 65535, 65536] {
            let record: Vec<u8> = (0..len).map(|i| (i * 7 % 256) as u8).collect();
            for head in [&b"h"[..], b"MC\x02\x00head-and-body.....", &[3u8; 4096]] {
                let hl = (head.len() as u64).to_le_bytes();
                let whole = [&record[..], head, &hl].concat();
                for seq in [0u64, 1, u64::MAX] {
                    let got = g.tag(&nonce_bytes(seq), &[&record, head, &hl]);
                    assert_eq!(got, Some(one_slice(&key, seq, &whole)), "len {len} head {} seq {seq}", head.len());
                }
            }
        }
    }

    #[test]
    fn tags_compare_in_full() {
        let a = [7u8; TAG_LEN];
        assert!(same_tag(&a, &a));
        for i in 0..TAG_LEN {
            let mut b = a;
            b[i] ^= 0x80;
            assert!(!same_tag(&a, &b), "byte {i}");
        }
    }
}
