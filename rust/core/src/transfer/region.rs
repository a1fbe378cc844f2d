//! Registered memory regions and the access checks every remote request goes through.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use hashbrown::HashMap;
use parking_lot::{Mutex, RwLock};

use super::landing::WriteLanded;
use super::{AccessError, TransferError};
use crate::mem::MappedMemory;

/// The one bounds-and-rights rule of every path: `offset..offset+len` (checked, so it
/// cannot wrap) inside `region_len`, no write to a read-only region, and, for a
/// restricted region (`grants` is `Some`), a live grant of the asking peer covering the
/// whole range (a write needs a write grant). Initiators that check against what a peer
/// reported pass `None`: the grant part is the serving side's to decide.
pub fn check_access(
    offset: u64,
    len: u64,
    region_len: u64,
    readonly: bool,
    write: bool,
    grants: Option<GrantCheck<'_>>,
) -> Result<(), AccessError> {
    let end = offset.checked_add(len).ok_or(AccessError::OutOfBounds)?;
    if end > region_len {
        return Err(AccessError::OutOfBounds);
    }
    if write && readonly {
        return Err(AccessError::ReadOnly);
    }
    if let Some(g) = grants {
        let covered = g.grants.iter().any(|gr| {
            gr.peer == g.peer
                && gr.offset <= offset
                && end <= gr.offset.saturating_add(gr.len)
                && (gr.write || !write)
                && gr.expires.is_none_or(|t| g.now < t)
        });
        if !covered {
            return Err(AccessError::NoGrant);
        }
    }
    Ok(())
}

/// The grant part of one check: the region's grants, who asks, and when.
#[derive(Clone, Copy)]
pub struct GrantCheck<'a> {
    pub grants: &'a [Grant],
    pub peer: &'a str,
    pub now: Instant,
}

/// A right of one peer (by its authenticated engine name) to `offset..offset+len` of a
/// restricted region: read, and write too when `write`; until `expires` if set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub id: u64,
    pub peer: String,
    pub offset: u64,
    pub len: u64,
    pub write: bool,
    pub expires: Option<Instant>,
}

/// How a region may be accessed (fixed at registration).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Access {
    /// Nobody (neither this engine nor a peer) may write it.
    pub readonly: bool,
    /// Peers may only read it; this engine may still write.
    pub remote_readonly: bool,
    /// Peers reach it only through live [`Grant`]s, and never over shm (a mapping
    /// cannot be revoked, a grant must be).
    pub restricted: bool,
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
    /// Peers need a live grant (see [`Access::restricted`]).
    pub restricted: bool,
    /// The grants of a restricted region (empty otherwise). Held only to check or edit,
    /// never across I/O.
    grants: Mutex<Vec<Grant>>,
    /// Told of each peer write the TCP server lands here (landing.rs); set once.
    landing: OnceLock<Arc<dyn WriteLanded>>,
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

    /// Attaches the region's [`WriteLanded`]; false if it has one already (it stays).
    pub fn set_landing(&self, w: Arc<dyn WriteLanded>) -> bool {
        self.landing.set(w).is_ok()
    }

    /// What is told of the peer writes the TCP server lands here, if anything.
    pub fn landing(&self) -> Option<&Arc<dyn WriteLanded>> {
        self.landing.get()
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
        check_access(offset, len, self.len as u64, self.readonly, write, None)
    }

    /// The check of an access by peer `peer` (its authenticated engine name): the remote
    /// side of any request, on every path.
    pub fn check_remote(&self, peer: &str, offset: u64, len: u64, write: bool) -> Result<(), AccessError> {
        if !self.restricted {
            return check_access(offset, len, self.len as u64, self.readonly_to_peers(), write, None);
        }
        let grants = self.grants.lock();
        let g = GrantCheck { grants: &grants, peer, now: Instant::now() };
        check_access(offset, len, self.len as u64, self.readonly_to_peers(), write, Some(g))
    }

    /// Adds grant `id` (from [`RegionTable::next_grant_id`]) to a restricted region.
    /// Expired grants are dropped here, so a region granted over and over does not grow
    /// without bound.
    pub fn grant(
        &self,
        id: u64,
        peer: &str,
        offset: u64,
        len: u64,
        write: bool,
        expires: Option<Instant>,
    ) -> Result<(), TransferError> {
        if !self.restricted {
            return Err(TransferError::InvalidRequest(format!(
                "region {} is not restricted, so every authenticated peer may already access it; register it with \
                 restricted=True to use grants",
                self.id
            )));
        }
        if peer.is_empty() || peer.len() > super::protocol::MAX_NAME {
            return Err(TransferError::InvalidRequest(format!(
                "grant() needs the peer's engine name (1..={} bytes), got {} bytes",
                super::protocol::MAX_NAME,
                peer.len()
            )));
        }
        check_access(offset, len, self.len as u64, false, false, None).map_err(|_| {
            TransferError::InvalidRequest(format!(
                "grant range {offset}+{len} is outside region {} (length {})",
                self.id, self.len
            ))
        })?;
        if write && self.readonly_to_peers() {
            return Err(TransferError::InvalidRequest(format!(
                "region {} is read-only to peers; a write grant would never apply",
                self.id
            )));
        }
        let now = Instant::now();
        let mut g = self.grants.lock();
        g.retain(|gr| gr.expires.is_none_or(|t| now < t));
        g.push(Grant { id, peer: peer.to_string(), offset, len, write, expires });
        Ok(())
    }

    /// Removes the grants of `peer` (only grant `grant_id` when given); returns how many.
    /// Takes effect for every request checked after it returns (a request already
    /// checked finishes: the check is per request, before any byte moves).
    pub fn revoke(&self, peer: &str, grant_id: Option<u64>) -> usize {
        let mut g = self.grants.lock();
        let before = g.len();
        g.retain(|gr| !(gr.peer == peer && grant_id.is_none_or(|id| gr.id == id)));
        before - g.len()
    }

    /// The live grants (expired ones left out).
    pub fn grants(&self) -> Vec<Grant> {
        let now = Instant::now();
        self.grants.lock().iter().filter(|gr| gr.expires.is_none_or(|t| now < t)).cloned().collect()
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
            .field("restricted", &self.restricted)
            .finish()
    }
}

/// The regions of one engine, by id.
#[derive(Default)]
pub struct RegionTable {
    next: AtomicU64,
    next_grant: AtomicU64,
    regions: RwLock<HashMap<RegionId, Arc<Region>>>,
}

impl RegionTable {
    fn insert(&self, ptr: *mut u8, len: usize, a: Access, owner: RegionOwner) -> Arc<Region> {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let region = Arc::new(Region {
            id,
            ptr,
            len,
            readonly: a.readonly,
            remote_readonly: a.remote_readonly,
            restricted: a.restricted,
            grants: Mutex::new(Vec::new()),
            landing: OnceLock::new(),
            owner,
        });
        self.regions.write().insert(id, region.clone());
        region
    }

    pub fn register_mapped(&self, mem: Arc<MappedMemory>, a: Access) -> Arc<Region> {
        let (ptr, len) = (mem.as_ptr(), mem.len());
        self.insert(ptr, len, a, RegionOwner::Mapped(mem))
    }

    /// A fresh grant id (engine-unique).
    pub fn next_grant_id(&self) -> u64 {
        self.next_grant.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Registers caller memory.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid (and writable unless `readonly`) while `owner` lives.
    pub unsafe fn register_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        a: Access,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<Arc<Region>, TransferError> {
        if ptr.is_null() && len > 0 {
            return Err(TransferError::InvalidRequest("null pointer for a non-empty region".into()));
        }
        Ok(self.insert(ptr, len, a, RegionOwner::Foreign(owner)))
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

    /// The serving-side check of one remote access by peer `peer`.
    pub fn resolve(
        &self,
        id: RegionId,
        peer: &str,
        offset: u64,
        len: u64,
        write: bool,
    ) -> Result<Arc<Region>, AccessError> {
        let region = self.get(id).ok_or(AccessError::NoSuchRegion)?;
        region.check_remote(peer, offset, len, write)?;
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
