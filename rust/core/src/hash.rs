//! Chained 128-bit hashes of full token blocks.
//!
//! `h_i = H(seed; h_{i-1} ‖ extra_digest ‖ tokens of block i)` where `h_{-1}` is a root
//! derived from the seed, the block size and `extra`. Because each hash covers its whole
//! prefix, a block hash alone identifies "this block after exactly this prefix", so the
//! index and the store need no tree.
//!
//! Tokens are hashed as little-endian `u32`, so the same tokens, seed and extra give the
//! same hashes on every machine, in every process, on every run.
//!
//! Two algorithms:
//! - [`HashAlgorithm::Xxh3`] (default): XXH3-128, tens of GB/s. 128 bits make an
//!   accidental collision practically impossible (birthday bound ~2^64 blocks), but it is
//!   not a cryptographic hash: someone who knows the seed can construct collisions.
//! - [`HashAlgorithm::Blake3`]: keyed BLAKE3 truncated to 128 bits, for deployments that
//!   hash untrusted tenants' prompts into one shared cache; slower, collision-resistant.
//! - [`HashAlgorithm::Xxh3Rfc`]: the 64-bit rolling hash of Mooncake's KV-events/indexer
//!   RFCs ([`crate::hash_xxh3`]), for interop with engines and routers that compute it:
//!   no root, no `extra`, no block-size domain (the value sits in the low 64 bits).

use std::fmt;

use crate::error::{Categorized, ErrorCategory};
use crate::hash_xxh3::Xxh3RollingHasher;

/// A block hash: identifies a full block of tokens together with its whole prefix.
pub type BlockHash = u128;

/// Which hash function chains the blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HashAlgorithm {
    #[default]
    Xxh3,
    Blake3,
    /// The RFC's standard chain; see [`crate::hash_xxh3`].
    Xxh3Rfc,
}

impl HashAlgorithm {
    pub fn parse(name: &str) -> Result<Self, HashError> {
        match name {
            "xxh3" => Ok(HashAlgorithm::Xxh3),
            "blake3" => Ok(HashAlgorithm::Blake3),
            "xxh3-64-rfc" => Ok(HashAlgorithm::Xxh3Rfc),
            other => Err(HashError::UnknownAlgorithm(other.to_string())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            HashAlgorithm::Xxh3 => "xxh3",
            HashAlgorithm::Blake3 => "blake3",
            HashAlgorithm::Xxh3Rfc => "xxh3-64-rfc",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HashError {
    #[error("block_size must be >= 1, got {0}")]
    InvalidBlockSize(i128),
    #[error("token at position {index} is {value}, outside 0..2^32-1")]
    TokenOutOfRange { index: usize, value: i128 },
    #[error("unknown hash algorithm {0:?}; expected \"xxh3\", \"blake3\" or \"xxh3-64-rfc\"")]
    UnknownAlgorithm(String),
    #[error("the xxh3-64-rfc chain has no extra key (it is the engines' standard hash); pass none")]
    ExtraNotSupported,
    #[error("parent {0:#x} is not an xxh3-64-rfc hash (those are below 2^64)")]
    ParentOutOfRange(u128),
    #[error("extras has {extras} entries but the tokens make {blocks} full blocks; pass at most one per full block")]
    TooManyExtras { extras: usize, blocks: usize },
}

impl Categorized for HashError {
    fn category(&self) -> ErrorCategory {
        ErrorCategory::InvalidArgument
    }
}

/// Hashes token sequences into chained per-block hashes. Cheap to clone, `Send + Sync`.
#[derive(Clone)]
pub struct PrefixHasher {
    block_size: usize,
    seed: u64,
    algorithm: HashAlgorithm,
    /// Digest of the `extra` key (model, LoRA, tenant), mixed into every block.
    extra_digest: [u8; 16],
    /// Parent of the first block.
    root: BlockHash,
    /// BLAKE3 key derived from the seed (unused for XXH3).
    blake3_key: [u8; 32],
    /// The RFC chain's hasher (`Xxh3Rfc` only).
    rfc: Option<Xxh3RollingHasher>,
}

/// Bytes that precede the tokens in every block's hash input: parent ‖ extra digest.
const HEADER_BYTES: usize = 32;

impl PrefixHasher {
    pub fn new(
        block_size: usize,
        seed: u64,
        extra: Option<&[u8]>,
        algorithm: HashAlgorithm,
    ) -> Result<Self, HashError> {
        if block_size == 0 {
            return Err(HashError::InvalidBlockSize(0));
        }
        let extra = extra.unwrap_or(&[]);
        if algorithm == HashAlgorithm::Xxh3Rfc && !extra.is_empty() {
            return Err(HashError::ExtraNotSupported);
        }
        let blake3_key = blake3::derive_key("mooncake_rs prefix block hash v1", &seed.to_le_bytes());
        let mut h = PrefixHasher { block_size, seed, algorithm, extra_digest: [0; 16], root: 0, blake3_key, rfc: None };
        if algorithm == HashAlgorithm::Xxh3Rfc {
            h.rfc = Some(Xxh3RollingHasher::new(block_size, seed)?);
            return Ok(h); // no root, no extra digest: the RFC chain has neither
        }
        // Domain-separated digests: the root also binds the block size, so hashers with
        // different block sizes never produce comparable chains.
        let mut extra_input = b"mooncake_rs/extra/v1".to_vec();
        extra_input.extend_from_slice(extra);
        h.extra_digest = h.digest(&extra_input).to_le_bytes();
        let mut root_input = b"mooncake_rs/root/v1".to_vec();
        root_input.extend_from_slice(&(block_size as u64).to_le_bytes());
        root_input.extend_from_slice(&h.extra_digest);
        h.root = h.digest(&root_input);
        Ok(h)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn algorithm(&self) -> HashAlgorithm {
        self.algorithm
    }

    /// The implicit parent of a chain's first block (0 for `Xxh3Rfc`, whose first block's
    /// hash is its local hash: there is no root).
    pub fn root(&self) -> BlockHash {
        self.root
    }

    /// Refuses a `parent` this hasher's chains cannot contain (only `Xxh3Rfc` has such:
    /// its hashes are 64-bit). Callers taking a parent from outside check it first; the
    /// hashing functions below then never see one out of range.
    pub fn check_parent(&self, parent: Option<BlockHash>) -> Result<(), HashError> {
        match parent {
            Some(p) if self.algorithm == HashAlgorithm::Xxh3Rfc && p > u128::from(u64::MAX) => {
                Err(HashError::ParentOutOfRange(p))
            }
            _ => Ok(()),
        }
    }

    /// The RFC chain, widened to `BlockHash`. A parent above 2^64 (refused by
    /// `check_parent`) would keep only its low 64 bits.
    fn rfc_chain(rfc: &Xxh3RollingHasher, tokens: &[u32], parent: Option<BlockHash>) -> Vec<BlockHash> {
        rfc.hash_tokens(tokens, parent.map(|p| p as u64)).into_iter().map(BlockHash::from).collect()
    }

    fn digest(&self, bytes: &[u8]) -> BlockHash {
        match self.algorithm {
            HashAlgorithm::Xxh3 => xxhash_rust::xxh3::xxh3_128_with_seed(bytes, self.seed),
            // the RFC chain never digests here (it returns before): kept total for the match
            HashAlgorithm::Xxh3Rfc => BlockHash::from(xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.seed)),
            HashAlgorithm::Blake3 => {
                let out = blake3::keyed_hash(&self.blake3_key, bytes);
                let mut first = [0u8; 16];
                first.copy_from_slice(&out.as_bytes()[..16]);
                u128::from_le_bytes(first)
            }
        }
    }

    /// `mix(parent, extra)`: what block `i` is chained from when it carries per-block
    /// extra keys `extra` (the msgpack bytes of an engine's `extra_keys` entry: a cache
    /// salt, a LoRA name, multimodal identifiers), so that blocks with different extras
    /// never share a hash, while blocks without any hash exactly as before.
    /// `parent` `None`: the root (for `Xxh3Rfc`, 0: see [`Xxh3RollingHasher::mix_extra`]).
    pub fn mix_extra(&self, parent: Option<BlockHash>, extra: &[u8]) -> BlockHash {
        if let Some(rfc) = &self.rfc {
            return BlockHash::from(rfc.mix_extra(parent.map(|p| p as u64), extra));
        }
        let mut input = Vec::with_capacity(EXTRA_KEYS_TAG.len() + 16 + extra.len());
        input.extend_from_slice(EXTRA_KEYS_TAG);
        input.extend_from_slice(&parent.unwrap_or(self.root).to_le_bytes());
        input.extend_from_slice(extra);
        self.digest(&input)
    }

    /// [`hash_tokens`](Self::hash_tokens) with per-block extra keys: `extras[i]` (if
    /// any) is folded into block `i`'s parent with [`mix_extra`](Self::mix_extra).
    /// Fewer entries than full blocks: the rest have none; more: an error.
    pub fn hash_tokens_with_extras(
        &self,
        tokens: &[u32],
        parent: Option<BlockHash>,
        extras: &[Option<&[u8]>],
    ) -> Result<Vec<BlockHash>, HashError> {
        fold_extras(
            self.block_size,
            tokens,
            parent,
            extras,
            |t, p, out| out.extend(self.hash_tokens(t, p)),
            |p, e| self.mix_extra(p, e),
        )
    }

    /// One hash per full block of `tokens`; a trailing partial block gets none.
    ///
    /// The hot path of every request (1,024 blocks for a 16k-token prompt at block 16):
    /// each block's tokens go into the scratch input with one copy (their memory already
    /// is their little-endian encoding on this target), not element by element.
    pub fn hash_tokens(&self, tokens: &[u32], parent: Option<BlockHash>) -> Vec<BlockHash> {
        if let Some(rfc) = &self.rfc {
            return Self::rfc_chain(rfc, tokens, parent);
        }
        let bs = self.block_size;
        let mut hashes = Vec::with_capacity(tokens.len() / bs);
        let mut input = vec![0u8; HEADER_BYTES + 4 * bs];
        input[16..HEADER_BYTES].copy_from_slice(&self.extra_digest);
        let mut prev = parent.unwrap_or(self.root);
        for block in tokens.chunks_exact(bs) {
            input[..16].copy_from_slice(&prev.to_le_bytes());
            write_le(&mut input[HEADER_BYTES..], block);
            prev = self.digest(&input);
            hashes.push(prev);
        }
        hashes
    }

    /// The general form: `fill(i, out)` writes block `i`'s tokens into `out` (length
    /// `block_size`). Lets callers convert other integer widths block by block, without
    /// materialising a whole `u32` copy of the prompt.
    pub fn hash_blocks_with<E>(
        &self,
        n_blocks: usize,
        parent: Option<BlockHash>,
        mut fill: impl FnMut(usize, &mut [u32]) -> Result<(), E>,
    ) -> Result<Vec<BlockHash>, E> {
        let bs = self.block_size;
        let mut hashes = Vec::with_capacity(n_blocks);
        let mut block = vec![0u32; bs];
        if let Some(rfc) = &self.rfc {
            let mut scratch = Vec::with_capacity(4 * bs);
            let mut prev = parent.map(|p| p as u64);
            for i in 0..n_blocks {
                fill(i, &mut block)?;
                let local = rfc.local_hash(&block, &mut scratch);
                let seq = prev.map_or(local, |p| rfc.roll(p, local));
                hashes.push(BlockHash::from(seq));
                prev = Some(seq);
            }
            return Ok(hashes);
        }
        // Scratch: parent ‖ extra digest ‖ tokens as little-endian bytes.
        let mut input = vec![0u8; HEADER_BYTES + 4 * bs];
        input[16..HEADER_BYTES].copy_from_slice(&self.extra_digest);
        let mut prev = parent.unwrap_or(self.root);
        for i in 0..n_blocks {
            fill(i, &mut block)?;
            input[..16].copy_from_slice(&prev.to_le_bytes());
            write_le(&mut input[HEADER_BYTES..], &block);
            prev = self.digest(&input);
            hashes.push(prev);
        }
        Ok(hashes)
    }
}

/// Domain tag of [`PrefixHasher::mix_extra`] (and the RFC chain's).
pub(crate) const EXTRA_KEYS_TAG: &[u8] = b"mooncake_rs/extra-keys/v1";

/// Hashes `tokens`' full blocks in runs: a run of blocks without extras in one `run`
/// call (the fast path, as without extras), and each block with an extra chained from
/// `mix(its parent, extra)`. Shared by both hashers.
pub(crate) fn fold_extras<H: Copy>(
    block_size: usize,
    tokens: &[u32],
    parent: Option<H>,
    extras: &[Option<&[u8]>],
    mut run: impl FnMut(&[u32], Option<H>, &mut Vec<H>),
    mut mix: impl FnMut(Option<H>, &[u8]) -> H,
) -> Result<Vec<H>, HashError> {
    let blocks = tokens.len() / block_size;
    if extras.len() > blocks {
        return Err(HashError::TooManyExtras { extras: extras.len(), blocks });
    }
    let mut out = Vec::with_capacity(blocks);
    let mut prev = parent;
    let mut start = 0;
    for (i, extra) in extras.iter().enumerate() {
        let Some(extra) = extra else { continue };
        run(&tokens[start * block_size..i * block_size], prev, &mut out);
        prev = out.last().copied().or(prev);
        let mixed = mix(prev, extra);
        run(&tokens[i * block_size..(i + 1) * block_size], Some(mixed), &mut out);
        prev = out.last().copied();
        start = i + 1;
    }
    run(&tokens[start * block_size..blocks * block_size], prev, &mut out);
    Ok(out)
}

/// `src` as little-endian bytes into `dst` (`4 * src.len()` bytes).
#[inline]
fn write_le(dst: &mut [u8], src: &[u32]) {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: u32 has no padding and any initialised u32 is 4 initialised bytes; the
        // byte view covers exactly `src` and is only read here.
        let bytes = unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), std::mem::size_of_val(src)) };
        dst.copy_from_slice(bytes);
    }
    #[cfg(not(target_endian = "little"))]
    for (d, t) in dst.chunks_exact_mut(4).zip(src) {
        d.copy_from_slice(&t.to_le_bytes());
    }
}

impl fmt::Debug for PrefixHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefixHasher")
            .field("block_size", &self.block_size)
            .field("seed", &self.seed)
            .field("algorithm", &self.algorithm)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hasher(bs: usize) -> PrefixHasher {
        PrefixHasher::new(bs, 0, None, HashAlgorithm::Xxh3).unwrap()
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        let h = hasher(4);
        assert_eq!(h.hash_tokens(&[1, 2, 3], None).len(), 0);
        assert_eq!(h.hash_tokens(&[1, 2, 3, 4, 5], None).len(), 1);
        assert_eq!(h.hash_tokens(&[0; 8], None).len(), 2);
    }

    #[test]
    fn zero_block_size_is_rejected() {
        assert_eq!(PrefixHasher::new(0, 0, None, HashAlgorithm::Xxh3).unwrap_err(), HashError::InvalidBlockSize(0));
    }

    #[test]
    fn known_answer_is_stable_across_releases() {
        // Pinned values: a change here invalidates every persisted SSD tier and breaks
        // mixed-version clusters, so it must be deliberate (bump the domain tags).
        let toks = [1, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(
            hasher(4).hash_tokens(&toks, None),
            vec![0x1b83325eb6a11c3ac5a1c780ef9b7b8c, 0x0195d8bd8c921590b48c0ef73161423b]
        );
        let blake = PrefixHasher::new(4, 0, None, HashAlgorithm::Blake3).unwrap();
        assert_eq!(
            blake.hash_tokens(&toks, None),
            vec![0x1145c0dc8cc5ae630e36b0d3fa3b6657, 0xb867e762d566ef663d3287ee6f09d459]
        );
    }

    #[test]
    fn seed_extra_block_size_and_algorithm_separate_chains() {
        let toks: Vec<u32> = (0..16).collect();
        let base = hasher(4).hash_tokens(&toks, None);
        let seeded = PrefixHasher::new(4, 1, None, HashAlgorithm::Xxh3).unwrap();
        let extra = PrefixHasher::new(4, 0, Some(b"lora-1"), HashAlgorithm::Xxh3).unwrap();
        let blake = PrefixHasher::new(4, 0, None, HashAlgorithm::Blake3).unwrap();
        for other in [&seeded, &extra, &blake] {
            let v = other.hash_tokens(&toks, None);
            assert!(v.iter().all(|x| !base.contains(x)), "{other:?}");
        }
        // Same tokens in blocks of 8 hash differently from two blocks of 4.
        let eight = hasher(8).hash_tokens(&toks, None);
        assert!(eight.iter().all(|x| !base.contains(x)));
    }

    #[test]
    fn same_block_after_different_prefix_differs() {
        let h = hasher(2);
        let a = h.hash_tokens(&[1, 2, 9, 9], None);
        let b = h.hash_tokens(&[3, 4, 9, 9], None);
        assert_ne!(a[1], b[1]);
    }

    proptest! {
        #[test]
        fn parent_continues_the_chain(
            bs in 1usize..9,
            a_blocks in 0usize..6,
            b in proptest::collection::vec(any::<u32>(), 0..60),
            seed in any::<u64>(),
            blake in any::<bool>(),
        ) {
            let alg = if blake { HashAlgorithm::Blake3 } else { HashAlgorithm::Xxh3 };
            let h = PrefixHasher::new(bs, seed, Some(b"x"), alg).unwrap();
            let a: Vec<u32> = (0..(a_blocks * bs) as u32).map(|t| t.wrapping_mul(2654435761)).collect();
            let mut ab = a.clone();
            ab.extend_from_slice(&b);
            let ha = h.hash_tokens(&a, None);
            let parent = ha.last().copied();
            let mut joined = ha.clone();
            joined.extend(h.hash_tokens(&b, parent));
            prop_assert_eq!(h.hash_tokens(&ab, None), joined);
        }

        #[test]
        fn fill_form_equals_slice_form(bs in 1usize..9, toks in proptest::collection::vec(any::<u32>(), 0..80)) {
            let h = hasher(bs);
            let via_fill: Result<Vec<_>, ()> = h.hash_blocks_with(toks.len() / bs, None, |i, out| {
                out.copy_from_slice(&toks[i * bs..(i + 1) * bs]);
                Ok(())
            });
            prop_assert_eq!(via_fill.unwrap(), h.hash_tokens(&toks, None));
        }
    }

    #[test]
    fn extras_fold_into_the_chain_and_none_changes_nothing() {
        let toks: Vec<u32> = (0..24).map(|i| i * 31 + 1).collect();
        for alg in [HashAlgorithm::Xxh3, HashAlgorithm::Blake3, HashAlgorithm::Xxh3Rfc] {
            let h = PrefixHasher::new(4, 5, None, alg).unwrap();
            let plain = h.hash_tokens(&toks, None);
            // no extras, or only `None`s: exactly the plain chain
            assert_eq!(h.hash_tokens_with_extras(&toks, None, &[]).unwrap(), plain);
            assert_eq!(h.hash_tokens_with_extras(&toks, None, &[None; 6]).unwrap(), plain);
            // a salt on block 0 changes every block (each covers its prefix)
            let salted = h.hash_tokens_with_extras(&toks, None, &[Some(b"\x91\xa1a")]).unwrap();
            assert!(salted.iter().zip(&plain).all(|(a, b)| a != b), "{alg:?}");
            let other = h.hash_tokens_with_extras(&toks, None, &[Some(b"\x91\xa1b")]).unwrap();
            assert!(salted.iter().zip(&other).all(|(a, b)| a != b));
            // an extra on block 2 leaves blocks 0-1 and changes 2..
            let mid = h.hash_tokens_with_extras(&toks, None, &[None, None, Some(b"x")]).unwrap();
            assert_eq!(mid[..2], plain[..2]);
            assert!(mid[2..].iter().zip(&plain[2..]).all(|(a, b)| a != b));
            // by definition: block 2 is chained from mix(block 1, extra)
            assert_eq!(mid[2..], h.hash_tokens(&toks[8..], Some(h.mix_extra(Some(plain[1]), b"x")))[..]);
            assert_eq!(salted[0], h.hash_tokens(&toks[..4], Some(h.mix_extra(None, b"\x91\xa1a")))[0]);
            // continuing a chain from a parent agrees with hashing the whole
            let every: Vec<Option<&[u8]>> = vec![Some(b"l"); 6];
            let all = h.hash_tokens_with_extras(&toks, None, &every).unwrap();
            let tail = h.hash_tokens_with_extras(&toks[8..], Some(all[1]), &every[2..]).unwrap();
            assert_eq!(all[2..], tail[..]);
            assert_eq!(
                h.hash_tokens_with_extras(&toks, None, &[None; 7]),
                Err(HashError::TooManyExtras { extras: 7, blocks: 6 })
            );
        }
    }

    #[test]
    fn the_rfc_algorithm_is_the_rolling_hasher_widened() {
        let toks: Vec<u32> = (0..100).map(|i| i * 7 + 3).collect();
        let rfc = crate::hash_xxh3::Xxh3RollingHasher::new(16, 9).unwrap();
        let h = PrefixHasher::new(16, 9, None, HashAlgorithm::Xxh3Rfc).unwrap();
        let want: Vec<BlockHash> = rfc.hash_tokens(&toks, None).into_iter().map(BlockHash::from).collect();
        assert_eq!(h.hash_tokens(&toks, None), want);
        assert_eq!(h.root(), 0);
        // continuing a chain from its last hash equals hashing the whole
        let (a, b) = toks.split_at(48);
        let first = h.hash_tokens(a, None);
        let mut joined = first.clone();
        joined.extend(h.hash_tokens(b, first.last().copied()));
        assert_eq!(joined, want);
        // the fill form agrees
        let via_fill: Result<Vec<_>, ()> = h.hash_blocks_with(toks.len() / 16, None, |i, out| {
            out.copy_from_slice(&toks[i * 16..(i + 1) * 16]);
            Ok(())
        });
        assert_eq!(via_fill.unwrap(), want);
        assert_eq!(HashAlgorithm::parse("xxh3-64-rfc").unwrap().name(), "xxh3-64-rfc");
        assert_eq!(
            PrefixHasher::new(16, 9, Some(b"model"), HashAlgorithm::Xxh3Rfc).err(),
            Some(HashError::ExtraNotSupported)
        );
        assert!(h.check_parent(Some(u128::from(u64::MAX))).is_ok());
        assert_eq!(h.check_parent(Some(1u128 << 64)), Err(HashError::ParentOutOfRange(1u128 << 64)));
    }
}
