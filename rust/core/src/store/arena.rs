//! The DRAM arena: one [`MappedMemory`] cut into page-aligned fixed-size slots, each
//! with an atomic reference count, and the free list.
//!
//! A slot's count is the number of owners: the table entry of a stored block, each
//! live lease (read view), or the writer that reserved it. The slot returns to the free
//! list when the count drops to zero, so a slot is never reused while anyone can see it.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::mem::{page_align, MappedMemory};

pub struct Arena {
    mem: Arc<MappedMemory>,
    block_bytes: usize,
    stride: usize,
    refs: Box<[AtomicU32]>,
    free: Mutex<Vec<u32>>,
}

impl Arena {
    /// `slots` slots of `block_bytes` each (stride rounded up to the page size).
    pub fn new(block_bytes: usize, slots: usize, shared: bool) -> std::io::Result<Self> {
        let stride = page_align(block_bytes);
        let len = stride * slots;
        let mem = if shared { MappedMemory::shared(len)? } else { MappedMemory::anonymous(len)? };
        let refs = (0..slots).map(|_| AtomicU32::new(0)).collect();
        // Pop order: slot 0 first.
        let free = Mutex::new((0..slots as u32).rev().collect());
        Ok(Arena { mem: Arc::new(mem), block_bytes, stride, refs, free })
    }

    pub fn memory(&self) -> &Arc<MappedMemory> {
        &self.mem
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    pub fn slots(&self) -> usize {
        self.refs.len()
    }

    pub fn offset(&self, slot: u32) -> usize {
        slot as usize * self.stride
    }

    /// Start of slot `slot` (block_bytes long).
    pub fn ptr(&self, slot: u32) -> *mut u8 {
        debug_assert!((slot as usize) < self.slots());
        // SAFETY: slot < slots, so the offset is inside the mapping.
        unsafe { self.mem.as_ptr().add(self.offset(slot)) }
    }

    /// The bytes of a slot the caller holds a reference on and that nobody writes.
    ///
    /// # Safety
    /// The caller holds a reference on `slot` (so it is not reused) and no writer
    /// exists for it (it is committed, or the caller is the only owner).
    pub unsafe fn bytes(&self, slot: u32) -> &[u8] {
        std::slice::from_raw_parts(self.ptr(slot), self.block_bytes)
    }

    /// The bytes of a slot for writing.
    ///
    /// # Safety
    /// The caller is the only owner of `slot` (count 1, not in the table).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, slot: u32) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr(slot), self.block_bytes)
    }

    /// A free slot, now owned by the caller (count 1).
    pub fn pop_free(&self) -> Option<u32> {
        let s = self.free.lock().pop()?;
        self.refs[s as usize].store(1, Ordering::Release);
        Some(s)
    }

    pub fn free_count(&self) -> usize {
        self.free.lock().len()
    }

    /// Adds an owner to a slot that already has one.
    pub fn retain(&self, slot: u32) {
        self.refs[slot as usize].fetch_add(1, Ordering::AcqRel);
    }

    /// Drops one owner; frees the slot when it was the last.
    pub fn release(&self, slot: u32) {
        if self.refs[slot as usize].fetch_sub(1, Ordering::AcqRel) == 1 {
            self.free.lock().push(slot);
        }
    }

    pub fn refs(&self, slot: u32) -> u32 {
        self.refs[slot as usize].load(Ordering::Acquire)
    }
}

/// A read lease on a committed slot: keeps it from being evicted, moved or reused.
pub struct Lease {
    arena: Arc<Arena>,
    slot: u32,
}

impl Lease {
    /// Takes a new reference on `slot` (the caller made sure it is live and committed).
    pub(crate) fn acquire(arena: &Arc<Arena>, slot: u32) -> Self {
        arena.retain(slot);
        Lease { arena: arena.clone(), slot }
    }

    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Byte offset of the leased slot in the arena (what a transfer engine that
    /// registered the arena reads to send this block).
    pub fn offset(&self) -> usize {
        self.arena.offset(self.slot)
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.arena.ptr(self.slot)
    }

    pub fn len(&self) -> usize {
        self.arena.block_bytes()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the lease holds a reference on a committed slot; committed slots are
        // never written again until every reference is gone.
        unsafe { self.arena.bytes(self.slot) }
    }
}

/// Another lease on the same slot (one more reference: the slot stays held until every
/// clone is dropped).
impl Clone for Lease {
    fn clone(&self) -> Self {
        Lease::acquire(&self.arena, self.slot)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.arena.release(self.slot);
    }
}

/// A reserved slot being filled by its single writer; dropped uncommitted, the slot
/// returns to the free list.
pub struct Reservation {
    pub(crate) arena: Arc<Arena>,
    pub(crate) slot: u32,
    pub(crate) key: crate::hash::BlockHash,
    /// Set once the slot was handed to the table (commit).
    pub(crate) done: bool,
}

impl Reservation {
    pub fn key(&self) -> crate::hash::BlockHash {
        self.key
    }

    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Byte offset of the reserved slot in the arena (where a transfer engine that
    /// registered the arena writes this block before `commit`).
    pub fn offset(&self) -> usize {
        self.arena.offset(self.slot)
    }

    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.arena.ptr(self.slot)
    }

    pub fn len(&self) -> usize {
        self.arena.block_bytes()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: a reservation is the only owner of its slot until commit.
        unsafe { self.arena.bytes_mut(self.slot) }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.done {
            self.arena.release(self.slot);
        }
    }
}
