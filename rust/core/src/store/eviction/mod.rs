//! Eviction policies, one file each, behind one trait.
//!
//! A policy only orders keys; it never decides on its own that a key may go. When the
//! store needs room it calls [`EvictionPolicy::evict`] with a judge that inspects each
//! candidate (leased? pinned? already gone?) and answers with a [`Verdict`]. The same
//! policy code runs under the byte-carrying [`Store`](super::Store) and the metadata-only
//! [`BlockCache`](super::BlockCache).
//!
//! - `"lru"`: least recently used (the paper's policy).
//! - `"s3fifo"`: S3-FIFO (small probationary FIFO, main FIFO with reinsertion, ghost
//!   FIFO): one-hit blocks from a scan leave through the small queue without pushing out
//!   the working set.
//! - `"prefix"`: prefix-aware. Every access is an *access batch* (one request's chain of
//!   blocks); a key remembers the batch it was last touched in and its position in its
//!   chain. The victim is the block of the oldest batch with the highest position: the
//!   tail of a cold chain goes before its head, since a block is useless without its
//!   prefix.

mod list;
mod lru;
mod prefix;
mod s3fifo;

use crate::hash::BlockHash;

pub use lru::Lru;
pub use prefix::PrefixAware;
pub use s3fifo::S3Fifo;

/// The judge's answer about one eviction candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The judge removed the block: the policy forgets the key and `evict` returns it.
    Evicted,
    /// The key no longer exists (removed concurrently): forget it and keep looking.
    Gone,
    /// The block may not go now (leased, pinned): keep it and look further.
    Keep,
}

/// An ordering of keys for eviction. Implementations are not thread-safe on their own;
/// the store keeps each policy behind one mutex.
pub trait EvictionPolicy: Send {
    /// The name it is selected by.
    fn name(&self) -> &'static str;
    /// Starts a new access batch (one request / one batch call). Only the prefix-aware
    /// policy uses it; the default does nothing.
    fn begin_access(&mut self) {}
    /// Adds a new key; `position` is its index in the chain it was stored with (0 for a
    /// lone block).
    fn insert(&mut self, key: BlockHash, position: u32);
    /// Records an access to `key`; returns false if the policy does not track it.
    fn touch(&mut self, key: BlockHash) -> bool;
    /// Forgets `key`; returns whether it was tracked.
    fn remove(&mut self, key: BlockHash) -> bool;
    fn contains(&self, key: BlockHash) -> bool;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Offers candidates to `judge` in eviction order until one is [`Verdict::Evicted`];
    /// returns that key, or `None` when every tracked key was kept.
    fn evict(&mut self, judge: &mut dyn FnMut(BlockHash) -> Verdict) -> Option<BlockHash>;
}

/// The names accepted by [`policy_by_name`].
pub const POLICY_NAMES: [&str; 3] = ["lru", "s3fifo", "prefix"];

/// A policy for a cache of `capacity` blocks, or `None` for an unknown name.
pub fn policy_by_name(name: &str, capacity: usize) -> Option<Box<dyn EvictionPolicy>> {
    match name {
        "lru" => Some(Box::new(Lru::new())),
        "s3fifo" | "s3-fifo" => Some(Box::new(S3Fifo::new(capacity))),
        "prefix" | "prefix-aware" => Some(Box::new(PrefixAware::new())),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
