//! The shared-memory path: a peer on this host whose region is a shared mapping. The
//! initiator asks the peer once for the region's segment name (over the authenticated
//! control connection), maps it, and from then on copies with one memcpy — the peer's
//! CPU is not involved. Regions that are not shared (or cannot be mapped) fall back to
//! TCP. Bounds and read-only are checked against what the peer reported.
//!
//! A restricted region is answered with the peer's staging socket (`"@name"`) instead of
//! a segment: writes into it and reads from it go through a [`StagedLink`] (one per peer
//! server), checked by the peer against its live grants chunk by chunk.

use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::{Condvar, Mutex};

use super::batch::Batch;
use super::config::StagedCopy;
use super::local::{CopyJob, Keep, Span};
use super::region::{Region, RegionId};
use super::staged::StagedLink;
use super::tcp::client::TcpPeer;
use super::{AccessError, Op, TransferError};
use crate::mem::MappedMemory;

/// A peer's region mapped into this process.
pub struct ShmRegion {
    pub id: RegionId,
    pub mem: Arc<MappedMemory>,
    pub readonly: bool,
}

impl ShmRegion {
    pub fn check(&self, offset: u64, len: u64, write: bool) -> Result<(), AccessError> {
        super::region::check_access(offset, len, self.mem.len() as u64, self.readonly, write, None)
    }
}

/// What is known about one remote region.
pub enum Lookup {
    Mapped(Arc<ShmRegion>),
    /// A restricted region: writes and reads go through the peer's staging link.
    Staged(Arc<StagedLink>),
    NotShared,
    Unknown,
}

/// What the cache knows of one region.
enum Entry {
    Mapped(Arc<ShmRegion>),
    Staged(Arc<StagedLink>),
    NotShared,
    /// A resolver is asking the peer / mapping the segment right now.
    Resolving,
}

/// Per-peer cache of mapped regions (region ids are never reused by an engine).
pub struct ShmPeer {
    cache: Mutex<HashMap<RegionId, Entry>>,
    resolved: Condvar,
    /// Staging links by socket name (a peer's restricted regions share one).
    links: Mutex<HashMap<String, Arc<StagedLink>>>,
    /// What the staging links ask their server for.
    staged_copy: StagedCopy,
}

impl ShmPeer {
    pub fn new(staged_copy: StagedCopy) -> ShmPeer {
        ShmPeer {
            cache: Mutex::new(HashMap::new()),
            resolved: Condvar::new(),
            links: Mutex::new(HashMap::new()),
            staged_copy,
        }
    }

    pub fn lookup(&self, id: RegionId) -> Lookup {
        match self.cache.lock().get(&id) {
            Some(Entry::Mapped(r)) => Lookup::Mapped(r.clone()),
            Some(Entry::Staged(l)) if !l.is_dead() => Lookup::Staged(l.clone()),
            Some(Entry::Staged(_)) | Some(Entry::NotShared) => Lookup::NotShared,
            Some(Entry::Resolving) | None => Lookup::Unknown,
        }
    }

    /// Asks the peer and maps the segment (blocking: never called from `submit`).
    /// `NotShared` means "use TCP". Concurrent calls for one region (the first batches to a
    /// new peer, one resolver each) wait for the first one instead of mapping the
    /// segment again: mapping a large arena takes tens of milliseconds.
    pub fn resolve(&self, tcp: &TcpPeer, id: RegionId) -> Lookup {
        {
            let mut c = self.cache.lock();
            loop {
                match c.get(&id) {
                    Some(Entry::Mapped(r)) => return Lookup::Mapped(r.clone()),
                    Some(Entry::Staged(l)) if !l.is_dead() => return Lookup::Staged(l.clone()),
                    Some(Entry::Staged(_)) | Some(Entry::NotShared) => return Lookup::NotShared,
                    // Bounded: the resolver's query has the connection's I/O timeouts.
                    Some(Entry::Resolving) => self.resolved.wait(&mut c),
                    None => break,
                }
            }
            c.insert(id, Entry::Resolving);
        }
        let found = self.query_and_map(tcp, id);
        let mut c = self.cache.lock();
        match &found {
            Lookup::Mapped(m) => {
                c.insert(id, Entry::Mapped(m.clone()));
            }
            Lookup::Staged(l) => {
                c.insert(id, Entry::Staged(l.clone()));
            }
            // A failed query is not cached (the next batch asks again), a plain region is.
            Lookup::NotShared | Lookup::Unknown => {
                if c.get(&id).is_some_and(|e| matches!(e, Entry::Resolving)) {
                    c.remove(&id);
                }
            }
        }
        drop(c);
        self.resolved.notify_all();
        match found {
            Lookup::Unknown => Lookup::NotShared,
            other => other,
        }
    }

    fn query_and_map(&self, tcp: &TcpPeer, id: RegionId) -> Lookup {
        let info = match tcp.query_region(id) {
            Ok(info) => info,
            // Unknown region or lost control connection: let TCP report the verdict.
            Err(_) => return Lookup::NotShared,
        };
        if let Some(socket) = info.shm.as_deref().and_then(|n| n.strip_prefix('@')) {
            return match self.link(tcp, socket) {
                Some(l) => Lookup::Staged(l),
                None => {
                    self.cache.lock().insert(id, Entry::NotShared);
                    Lookup::NotShared
                }
            };
        }
        let mapped = info.shm.as_deref().and_then(|name| match MappedMemory::open_shared(name, info.len as usize) {
            Ok(m) => Some(Arc::new(ShmRegion { id, mem: Arc::new(m), readonly: info.readonly })),
            Err(e) => {
                tracing::debug!(%name, error = %e, "cannot map the peer's segment; using TCP");
                None
            }
        });
        match mapped {
            Some(m) => Lookup::Mapped(m),
            None => {
                self.cache.lock().insert(id, Entry::NotShared);
                Lookup::NotShared
            }
        }
    }

    /// The live staging link to the peer's socket `name`, connected on first use.
    fn link(&self, tcp: &TcpPeer, name: &str) -> Option<Arc<StagedLink>> {
        let mut links = self.links.lock();
        if let Some(l) = links.get(name).filter(|l| !l.is_dead()) {
            return Some(l.clone());
        }
        let (key, me, io_timeout) = tcp.identity();
        match StagedLink::connect(name, key, me, io_timeout, self.staged_copy) {
            Ok(l) => {
                if let Some(old) = links.insert(name.to_string(), l.clone()) {
                    old.close();
                }
                Some(l)
            }
            Err(e) => {
                tracing::debug!(error = %e, "no staging link to the peer; restricted regions go over TCP");
                None
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn links(&self) -> Vec<Arc<StagedLink>> {
        self.links.lock().values().cloned().collect()
    }

    /// Forgets what the peer said of its regions (their mappings, staged or not) and its
    /// dead staging links, after the peer was redialed: a restarted server backs none of
    /// its old segments. A region being resolved keeps its entry (its resolver ends it).
    pub fn forget(&self) {
        self.cache.lock().retain(|_, e| matches!(e, Entry::Resolving));
        let dead: Vec<Arc<StagedLink>> = {
            let mut links = self.links.lock();
            let names: Vec<String> = links.iter().filter(|(_, l)| l.is_dead()).map(|(n, _)| n.clone()).collect();
            names.into_iter().filter_map(|n| links.remove(&n)).collect()
        };
        for l in dead {
            l.close();
        }
    }

    /// Unmaps everything and closes the staging links (peer closed).
    pub fn clear(&self) {
        self.cache.lock().clear();
        let links: Vec<Arc<StagedLink>> = self.links.lock().drain().map(|(_, l)| l).collect();
        for l in links {
            l.close();
        }
    }
}

/// The copy that performs `op` between a local region and a mapped remote one, after
/// checking the remote range against what the peer reported.
#[allow(clippy::too_many_arguments)]
pub fn copy_job(
    batch: &Arc<Batch>,
    index: usize,
    op: Op,
    local: &Arc<Region>,
    local_offset: u64,
    remote: &Arc<ShmRegion>,
    remote_offset: u64,
    len: u64,
) -> Result<CopyJob, TransferError> {
    remote.check(remote_offset, len, op == Op::Write).map_err(|reason| TransferError::Refused {
        side: "peer",
        region: remote.id,
        reason,
    })?;
    // SAFETY: check() bounded remote_offset + len by the mapping's length.
    let rptr = unsafe { remote.mem.as_ptr().add(remote_offset as usize) };
    let rspan = Span { keep: Keep::Mapping(remote.mem.clone()), ptr: rptr };
    let lspan = Span::region(local, local_offset);
    let (src, dst) = match op {
        Op::Read => (rspan, lspan),
        Op::Write => (lspan, rspan),
    };
    Ok(CopyJob { batch: batch.clone(), index, src, dst, len })
}
