//! Receiver-side notice of a peer's write. A region's owner may attach a [`WriteLanded`]
//! to the region: the TCP server calls it on the serving thread after a peer's write has
//! landed in the region's memory and before the write is answered, so whatever the owner
//! does there (the pool's store node publishes an object whose last byte arrived,
//! `LandingTable`) is done by the time the writer sees its write succeed. That is what
//! lets a remote put skip its separate commit round trip.
//!
//! Only writes that reach the owner's server are seen: a same-host peer that writes a
//! shared mapping directly (shm) or through the staging link is not. A writer relies on
//! the notice only where it knows its writes go over TCP.

use super::{AccessError, RegionId};

/// What a region's owner is told of each peer write into the region.
pub trait WriteLanded: Send + Sync {
    /// `len` bytes at `offset` of region `region` were written by a peer. Runs on the
    /// serving thread before the write is answered; an error is the write's answer (the
    /// bytes stay written: the owner decides what they mean).
    fn landed(&self, region: RegionId, offset: u64, len: u64) -> Result<(), AccessError>;
}
