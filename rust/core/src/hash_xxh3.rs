//! The standard rolling block hash of Mooncake's KV Events / Indexer RFCs (#1403, #1527).
//!
//! - local hash of block `i`: `XXH3-64(tokens of block i as little-endian u32, seed S)`;
//! - sequence hash: `seq[0] = local[0]`, `seq[i] = XXH3-64(seq[i-1] LE ‖ local[i] LE, S)`.
//!
//! A sequence hash names a block together with its whole prefix, like ours
//! ([`crate::hash`]), but in 64 bits and without a block-size or salt domain: it exists
//! so that our index can be queried with hashes that other engines and routers computed
//! (`/query_by_hash`), and index blocks that engines publish already hashed this way.
//! Our own caches keep the 128-bit [`crate::PrefixHasher`] (collisions at 64 bits are
//! rare but possible at fleet scale: birthday bound ~2^32 blocks per namespace).

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::hash::{fold_extras, HashError, EXTRA_KEYS_TAG};

/// A standard (RFC) sequence hash.
pub type SeqHash = u64;

/// Computes RFC rolling sequence hashes of full token blocks. Cheap to clone, `Send + Sync`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Xxh3RollingHasher {
    block_size: usize,
    seed: u64,
}

impl Xxh3RollingHasher {
    pub fn new(block_size: usize, seed: u64) -> Result<Self, HashError> {
        if block_size == 0 {
            return Err(HashError::InvalidBlockSize(0));
        }
        Ok(Xxh3RollingHasher { block_size, seed })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// `XXH3-64(block LE, S)` of one block of any length.
    pub fn local_hash(&self, block: &[u32], scratch: &mut Vec<u8>) -> SeqHash {
        scratch.clear();
        scratch.reserve(block.len() * 4);
        for t in block {
            scratch.extend_from_slice(&t.to_le_bytes());
        }
        xxh3_64_with_seed(scratch, self.seed)
    }

    /// `XXH3-64(parent LE ‖ local LE, S)`.
    pub fn roll(&self, parent: SeqHash, local: SeqHash) -> SeqHash {
        let mut buf = [0u8; 16];
        buf[..8].copy_from_slice(&parent.to_le_bytes());
        buf[8..].copy_from_slice(&local.to_le_bytes());
        xxh3_64_with_seed(&buf, self.seed)
    }

    /// `mix(parent, extra)`, the parent a block with extra keys is rolled from:
    /// `XXH3-64(tag ‖ parent LE ‖ extra, S)`, `parent` `None` as 0 (so the first block of
    /// a salted chain is `roll(mix(0, salt), local)`, never its bare local hash). Our
    /// extension of the RFC chain (which has no extra keys): see [`crate::hash`].
    pub fn mix_extra(&self, parent: Option<SeqHash>, extra: &[u8]) -> SeqHash {
        let mut input = Vec::with_capacity(EXTRA_KEYS_TAG.len() + 8 + extra.len());
        input.extend_from_slice(EXTRA_KEYS_TAG);
        input.extend_from_slice(&parent.unwrap_or(0).to_le_bytes());
        input.extend_from_slice(extra);
        xxh3_64_with_seed(&input, self.seed)
    }

    /// [`hash_tokens`](Self::hash_tokens) with per-block extra keys (see
    /// [`crate::PrefixHasher::hash_tokens_with_extras`]).
    pub fn hash_tokens_with_extras(
        &self,
        tokens: &[u32],
        parent: Option<SeqHash>,
        extras: &[Option<&[u8]>],
    ) -> Result<Vec<SeqHash>, HashError> {
        fold_extras(
            self.block_size,
            tokens,
            parent,
            extras,
            |t, p, out| out.extend(self.hash_tokens(t, p)),
            |p, e| self.mix_extra(p, e),
        )
    }

    /// Local hashes of every full block; a trailing partial block gets none.
    pub fn local_hashes(&self, tokens: &[u32]) -> Vec<SeqHash> {
        let mut scratch = Vec::with_capacity(self.block_size * 4);
        tokens.chunks_exact(self.block_size).map(|b| self.local_hash(b, &mut scratch)).collect()
    }

    /// Sequence hashes of every full block. `parent` is the sequence hash of the block
    /// before `tokens` (`None`: `tokens` starts the sequence).
    pub fn hash_tokens(&self, tokens: &[u32], parent: Option<SeqHash>) -> Vec<SeqHash> {
        let mut scratch = Vec::with_capacity(self.block_size * 4);
        let mut prev = parent;
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        for block in tokens.chunks_exact(self.block_size) {
            let local = self.local_hash(block, &mut scratch);
            let seq = match prev {
                None => local,
                Some(p) => self.roll(p, local),
            };
            out.push(seq);
            prev = Some(seq);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Expected values computed independently with the `xxhash` Python package
    // (xxh3_64_intdigest over struct.pack("<nI", ...) and struct.pack("<QQ", ...)).
    #[test]
    fn known_answers() {
        let t: Vec<u32> = (1..=12).collect();
        let h = Xxh3RollingHasher::new(4, 0).unwrap();
        assert_eq!(h.hash_tokens(&t, None), vec![0x6fc1ebd4f4d6ea31, 0x3a14937fd5340c7a, 0x829711b6d52f08eb]);
        assert_eq!(h.local_hashes(&t[..4]), vec![0x6fc1ebd4f4d6ea31]);
        let h = Xxh3RollingHasher::new(4, 42).unwrap();
        assert_eq!(h.hash_tokens(&t, None), vec![0xcabc6cf291a3ba46, 0x1c4cb0b75e1705ce, 0xe7249e43e2bd2637]);
        let t: Vec<u32> = (0..128).collect();
        let h = Xxh3RollingHasher::new(64, 0).unwrap();
        assert_eq!(h.hash_tokens(&t, None), vec![0xa6dcffc376d6710f, 0x913780eb4bb7784f]);
    }

    #[test]
    fn chains_continue_from_a_parent_and_ignore_partial_blocks() {
        let t: Vec<u32> = (0..40).map(|x| x * 7919).collect();
        let h = Xxh3RollingHasher::new(8, 3).unwrap();
        let all = h.hash_tokens(&t[..39], None);
        assert_eq!(all.len(), 4);
        let tail = h.hash_tokens(&t[16..32], Some(all[1]));
        assert_eq!(tail, all[2..4].to_vec());
        assert!(h.hash_tokens(&t[..7], None).is_empty());
        let locals = h.local_hashes(&t[..32]);
        assert_eq!(h.roll(all[0], locals[1]), all[1]);
        assert!(Xxh3RollingHasher::new(0, 0).is_err());
    }

    #[test]
    fn extras_roll_from_the_mix() {
        let t: Vec<u32> = (0..12).collect();
        let h = Xxh3RollingHasher::new(4, 3).unwrap();
        let plain = h.hash_tokens(&t, None);
        let locals = h.local_hashes(&t);
        let got = h.hash_tokens_with_extras(&t, None, &[Some(b"s"), None, Some(b"l")]).unwrap();
        let m0 = h.mix_extra(None, b"s");
        assert_eq!(m0, h.mix_extra(Some(0), b"s"));
        assert_eq!(got[0], h.roll(m0, locals[0]));
        assert_eq!(got[1], h.roll(got[0], locals[1]));
        assert_eq!(got[2], h.roll(h.mix_extra(Some(got[1]), b"l"), locals[2]));
        assert_ne!(got[0], plain[0]);
        assert_eq!(h.hash_tokens_with_extras(&t, None, &[None, None]).unwrap(), plain);
    }
}
