//! Whole objects held for a transfer engine that moves their bytes without the store:
//! slots reserved for a remote writer ([`ReservedObject`], published with
//! [`Store::commit_object`]) and chunks leased for a remote reader
//! ([`Store::lease_object`]). Chunk `j` of object `oid` is the block keyed `oid | j`, as in
//! [`super::object_batch`] (the pool's object segment, python/mooncake_rs/pool/chunks.py).
//!
//! A store node answered a batch's `Reserve` / `Commit` / `Lookup` with one store call
//! per chunk from Python (two Python-to-Rust calls and a Python object per chunk); these
//! take one call per object, and the glue one per batch.

use super::arena::{Lease, Reservation};
use super::error::StoreError;
use super::tiered::Store;
use crate::hash::BlockHash;

/// The reserved slots of one object's chunks, in chunk order. Dropped uncommitted, its
/// slots are freed, last chunk first (freed slots are reused last-in first-out, so the
/// next object gets them back in ascending order and its chunks follow each other in the
/// arena: a remote transfer then moves each run of them as one request).
pub struct ReservedObject {
    oid: BlockHash,
    chunks: Vec<Reservation>,
}

impl ReservedObject {
    pub fn oid(&self) -> BlockHash {
        self.oid
    }

    /// How many chunks (slots) it holds.
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Chunk `j`'s slot, to fill in place (None past the last chunk).
    pub fn chunk_mut(&mut self, j: usize) -> Option<&mut [u8]> {
        self.chunks.get_mut(j).map(|r| r.bytes_mut())
    }

    /// Each chunk's byte offset in the store's arena (where a writer puts its bytes).
    pub fn offsets(&self) -> Vec<u64> {
        self.chunks.iter().map(|r| r.offset() as u64).collect()
    }
}

impl std::fmt::Debug for ReservedObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReservedObject({:#x}, {} chunks)", self.oid, self.chunks.len())
    }
}

impl Drop for ReservedObject {
    fn drop(&mut self) {
        while let Some(r) = self.chunks.pop() {
            drop(r);
        }
    }
}

/// `oid` must leave the low bits of `nchunks` chunk numbers zero, and an object has at
/// least one chunk.
fn check_object(oid: BlockHash, nchunks: usize) -> Result<(), StoreError> {
    if nchunks == 0 {
        return Err(StoreError::Invalid(format!("object {oid:#x}: an object has at least one chunk, got 0")));
    }
    let numbers = (nchunks.next_power_of_two() - 1) as BlockHash;
    if oid & numbers != 0 {
        return Err(StoreError::Invalid(format!(
            "object id {oid:#x} has bits set where its {nchunks} chunk numbers go: ids for objects must end in zero bits"
        )));
    }
    Ok(())
}

impl Store {
    /// Slots for the `nchunks` chunks of object `oid`, evicting as a single `reserve`
    /// does. `Full` when they do not all fit beside what is leased, pinned or reserved;
    /// then none is kept.
    pub fn reserve_object(&self, oid: BlockHash, nchunks: usize) -> Result<ReservedObject, StoreError> {
        check_object(oid, nchunks)?;
        let mut obj = ReservedObject { oid, chunks: Vec::with_capacity(nchunks) };
        for j in 0..nchunks {
            // on an error `obj` is dropped: its slots freed, last first
            obj.chunks.push(self.reserve(oid | j as BlockHash)?);
        }
        Ok(obj)
    }

    /// Publishes every chunk of `obj` (written in place by then) and, with `pin`, pins
    /// each. False if one could not be published (its key was stored meanwhile) or was
    /// evicted before its pin: then every chunk of the object is taken out again (nothing
    /// of it stays stored or pinned), so the caller never holds half an object.
    pub fn commit_object(&self, mut obj: ReservedObject, pin: bool) -> bool {
        let oid = obj.oid;
        // which chunks this call published: only those are taken out again on a failure
        let published: Vec<bool> = obj.chunks.drain(..).map(|r| self.commit(r, 0)).collect();
        let mut whole = published.iter().all(|&p| p);
        let mut pinned = 0;
        if whole && pin {
            for j in 0..published.len() {
                if self.pin(oid | j as BlockHash).is_err() {
                    whole = false;
                    break;
                }
                pinned += 1;
            }
        }
        if !whole {
            for (j, _) in published.iter().enumerate().rev().filter(|(_, &p)| p) {
                let key = oid | j as BlockHash;
                if j < pinned {
                    let _ = self.unpin(key);
                }
                // (one evicted meanwhile is simply not there any more)
                let _ = self.remove(key);
            }
        }
        whole
    }

    /// Leases on all `nchunks` chunks of object `oid` (from SSD promoted into DRAM unless
    /// `promote` is false), or `None` with nothing held when any chunk is missing.
    pub fn lease_object(
        &self,
        oid: BlockHash,
        nchunks: usize,
        promote: bool,
    ) -> Result<Option<Vec<Lease>>, StoreError> {
        check_object(oid, nchunks)?;
        let keys: Vec<BlockHash> = (0..nchunks).map(|j| oid | j as BlockHash).collect();
        let leases = self.lookup_prefix(&keys, promote)?;
        Ok((leases.len() == nchunks).then_some(leases))
    }
}
