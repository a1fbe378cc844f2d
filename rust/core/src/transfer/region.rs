//! Registered memory regions and the access checks every remote request goes through.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::RwLock;

use super::{AccessError, TransferError};
use crate::mem::MappedMemory;

/// The one bounds-and-rights rule of every path: `offset..offset+len` (checked, so it
/// cannot wrap) inside `region_len`, and no write to a read-only region.
pub fn check_access(offset: u64, len: u64, region_len: u64, readonly: bool, write: bool) -> Result<(), AccessError> {
    let end = offset.checked_add(len).ok_or(AccessError::OutOfBounds)?;
    if end > region_len {
        return Err(AccessError::OutOfBounds);
    }
    if write && readonly {
        return Err(AccessError::ReadOnly);
    }
    Ok(())
}

/// Engine-unique id of a registered region (never reused by that engine).
pub type RegionId = u64;

/// What keeps a region's memory alive.
pub enum RegionOwner {
    /// A mapping (store arena, `allocate()`); shared mappings are eligible for shm.
    Mapped(Arc<MappedMemory>),
    /// Caller memory (e.g. a Python buffer export) kept alive by this object.
    Foreign(Box<dyn Any + Send + Sync>),
}

/// A registered range of memory. In-flight transfers hold an `Arc<Region>`, so the
/// memory outlives `unregister` until they end.
pub struct Region {
    pub id: RegionId,
    ptr: *mut u8,
    len: usize,
    /// Nobody (neither this engine nor a peer) may write it.
    pub readonly: bool,
    /// Peers may only read it; this engine may still write (a region that peers only
    /// fetch from, like a prefill instance's arena).
    pub remote_readonly: bool,
    owner: RegionOwner,
}

// SAFETY: the pointer stays valid while `owner` lives (it lives as long as the Region);
// the region only hands out raw pointers, whose users follow the engine's discipline
// (bounds checked, concurrent access to the bytes is the application's business).
unsafe impl Send for Region {}
// SAFETY: as above; no interior state is mutated through &self.
unsafe impl Sync for Region {}

impl Region {
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The shm segment name and its mapped length, for a shared mapping.
    pub fn shm(&self) -> Option<(&str, usize)> {
        match &self.owner {
            RegionOwner::Mapped(m) => m.shm_name().map(|n| (n, m.len())),
            RegionOwner::Foreign(_) => None,
        }
    }

    pub fn mapping(&self) -> Option<&Arc<MappedMemory>> {
        match &self.owner {
            RegionOwner::Mapped(m) => Some(m),
            RegionOwner::Foreign(_) => None,
        }
    }

    /// Checks `offset..offset+len` against the bounds (and `write` against read-only).
    pub fn check(&self, offset: u64, len: u64, write: bool) -> Result<(), AccessError> {
        check_access(offset, len, self.len as u64, self.readonly, write)
    }

    /// The check of an access by a peer (the remote side of any request, on every path).
    pub fn check_remote(&self, offset: u64, len: u64, write: bool) -> Result<(), AccessError> {
        check_access(offset, len, self.len as u64, self.readonly_to_peers(), write)
    }

    /// Whether peers see it read-only.
    pub fn readonly_to_peers(&self) -> bool {
        self.readonly || self.remote_readonly
    }

    /// Pointer to `offset` (call [`check`](Region::check) first).
    pub fn at(&self, offset: u64) -> *mut u8 {
        debug_assert!(offset as usize <= self.len);
        // SAFETY: callers checked offset <= len, so the result stays inside the mapping.
        unsafe { self.ptr.add(offset as usize) }
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.id)
            .field("len", &self.len)
            .field("readonly", &self.readonly)
            .field("remote_readonly", &self.remote_readonly)
            .finish()
    }
}

/// The regions of one engine, by id.
#[derive(Default)]
pub struct RegionTable {
    next: AtomicU64,
    regions: RwLock<HashMap<RegionId, Arc<Region>>>,
}

impl RegionTable {
    fn insert(&self, ptr: *mut u8, len: usize, readonly: bool, remote_readonly: bool, owner: RegionOwner) -> Arc<Region> {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let region = Arc::new(Region { id, ptr, len, readonly, remote_readonly, owner });
        self.regions.write().insert(id, region.clone());
        region
    }

    pub fn register_mapped(&self, mem: Arc<MappedMemory>, readonly: bool, remote_readonly: bool) -> Arc<Region> {
        let (ptr, len) = (mem.as_ptr(), mem.len());
        self.insert(ptr, len, readonly, remote_readonly, RegionOwner::Mapped(mem))
    }

    /// Registers caller memory.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid (and writable unless `readonly`) while `owner` lives.
    pub unsafe fn register_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        readonly: bool,
        remote_readonly: bool,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<Arc<Region>, TransferError> {
        if ptr.is_null() && len > 0 {
            return Err(TransferError::InvalidRequest("null pointer for a non-empty region".into()));
        }
        Ok(self.insert(ptr, len, readonly, remote_readonly, RegionOwner::Foreign(owner)))
    }

    pub fn unregister(&self, id: RegionId) -> bool {
        // Take the region out under the lock but drop it after the guard is
        // gone: the last reference may own a Python buffer whose release
        // needs the GIL, and a thread holding the GIL may be waiting on this
        // lock (`get` from an attached call) -- dropping inside would deadlock.
        let removed = self.regions.write().remove(&id);
        removed.is_some()
    }

    pub fn get(&self, id: RegionId) -> Option<Arc<Region>> {
        self.regions.read().get(&id).cloned()
    }

    /// The serving-side check of one remote access.
    pub fn resolve(&self, id: RegionId, offset: u64, len: u64, write: bool) -> Result<Arc<Region>, AccessError> {
        let region = self.get(id).ok_or(AccessError::NoSuchRegion)?;
        region.check_remote(offset, len, write)?;
        Ok(region)
    }

    pub fn len(&self) -> usize {
        self.regions.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn clear(&self) {
        // Same reason as `unregister`: release the buffers outside the lock.
        let drained: Vec<Arc<Region>> = self.regions.write().drain().map(|(_, r)| r).collect();
        drop(drained);
    }
}
