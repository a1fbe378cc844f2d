//! A store node's share of a pool batch in one call: the node's answer (per object its
//! region, chunk size and chunk offsets) and the caller's memory (per object its pieces
//! by address) become one transfer batch here, planned by [`crate::object_layout`]. The
//! caller's pieces are found in the regions it registered; memory it never registered
//! is registered for this batch only and unregistered when the [`ObjectBatch`] is
//! released or dropped. Before this, the pool's Python client built one request object
//! per span and looked each piece up itself: 0.7-1.0 ms of a 32 x 512 KiB batch.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::batch::Batch;
use super::engine::{Engine, Peer};
use super::region::{Access, Region, RegionId, RegionTable};
use super::{Op, Request, RequestStatus, TransferError};
use crate::object_layout::{plan_spans, Span};

/// One object of a node's batch.
#[derive(Debug, Clone, Copy)]
pub struct RemoteObject<'a> {
    /// The caller's pieces, in order: their addresses and sizes.
    pub addrs: &'a [u64],
    pub sizes: &'a [u64],
    /// Bytes of the object that move (the first `total` of the pieces).
    pub total: u64,
    /// Where the node keeps it: its region, chunk size and each chunk's offset there.
    pub region: RegionId,
    pub chunk_bytes: u64,
    pub offsets: &'a [u64],
}

/// Regions registered for one batch only; unregistered once (release or drop).
struct TempRegions {
    table: Arc<RegionTable>,
    ids: Mutex<Vec<RegionId>>,
}

impl TempRegions {
    fn release(&self) -> usize {
        let ids = std::mem::take(&mut *self.ids.lock());
        for &id in &ids {
            self.table.unregister(id);
        }
        ids.len()
    }
}

impl Drop for TempRegions {
    fn drop(&mut self) {
        self.release();
    }
}

/// A node's submitted object batch: the transfer batch and which object each request
/// belongs to.
pub struct ObjectBatch {
    /// None when no object had a byte to move.
    batch: Option<Arc<Batch>>,
    owners: Vec<u32>,
    objects: usize,
    temps: TempRegions,
}

impl ObjectBatch {
    pub fn batch(&self) -> Option<&Arc<Batch>> {
        self.batch.as_ref()
    }

    /// Transfer requests submitted (spans of all objects).
    pub fn requests(&self) -> usize {
        self.owners.len()
    }

    /// Per object: every request of it ended done (an object with nothing to move: true).
    pub fn outcome(&self, statuses: &[RequestStatus]) -> Vec<bool> {
        let mut ok = vec![true; self.objects];
        for (&o, st) in self.owners.iter().zip(statuses) {
            if !st.is_ok() {
                ok[o as usize] = false;
            }
        }
        ok
    }

    /// Waits as [`Batch::wait`]; per object whether it moved whole.
    pub fn wait(&self, timeout: Option<Duration>) -> Vec<bool> {
        match &self.batch {
            Some(b) => self.outcome(&b.wait(timeout)),
            None => vec![true; self.objects],
        }
    }

    /// Unregisters the regions registered for this batch (now rather than at drop);
    /// returns how many. Requests in flight keep their memory reachable until they end.
    pub fn release(&self) -> usize {
        self.temps.release()
    }

    /// Regions registered for this batch and not released yet.
    pub fn temporary_regions(&self) -> usize {
        self.temps.ids.lock().len()
    }
}

/// The caller's registered regions sorted by address, to find the one holding a piece.
struct Registered<'a> {
    by_addr: Vec<&'a Arc<Region>>,
}

impl<'a> Registered<'a> {
    fn new(regions: &'a [Arc<Region>]) -> Self {
        let mut by_addr: Vec<&Arc<Region>> = regions.iter().collect();
        by_addr.sort_by_key(|r| r.ptr() as usize);
        Registered { by_addr }
    }

    /// The region holding `[addr, addr+len)` and the offset there (the last one starting
    /// at or before `addr`, as the Python client's lookup did).
    fn find(&self, addr: u64, len: u64) -> Option<(RegionId, u64)> {
        let at = self.by_addr.partition_point(|r| r.ptr() as u64 <= addr);
        let r = self.by_addr.get(at.checked_sub(1)?)?;
        let off = addr - r.ptr() as u64;
        (off.checked_add(len)? <= r.len() as u64).then_some((r.id, off))
    }
}

impl Engine {
    /// Plans and submits one node's objects as one batch (see the module). `registered`:
    /// the caller's regions of this engine, where pieces are looked up first (a read into
    /// a read-only one is refused by `submit`, as any request's). `op` Read moves the
    /// node's bytes into the pieces, Write the pieces' bytes to the node.
    ///
    /// # Safety
    /// Every piece's first bytes that move (`addr .. addr + size`, clipped to the
    /// object's `total`) are valid memory, writable for `Read`, until the batch has ended.
    pub unsafe fn submit_objects(
        &self,
        op: Op,
        peer: &Arc<Peer>,
        objects: &[RemoteObject<'_>],
        registered: &[Arc<Region>],
        timeout: Duration,
    ) -> Result<ObjectBatch, TransferError> {
        let invalid = |o: usize, e: String| TransferError::InvalidRequest(format!("object {o}: {e}"));
        let lookup = Registered::new(registered);
        let temps = TempRegions { table: self.region_table().clone(), ids: Mutex::new(Vec::new()) };
        let mut reqs = Vec::with_capacity(objects.len());
        let mut owners = Vec::with_capacity(objects.len());
        let mut spans: Vec<Span> = Vec::new();
        let mut local: Vec<Option<(RegionId, u64)>> = Vec::new();
        for (o, obj) in objects.iter().enumerate() {
            if obj.addrs.len() != obj.sizes.len() {
                return Err(invalid(
                    o,
                    format!("{} addresses and {} sizes of pieces", obj.addrs.len(), obj.sizes.len()),
                ));
            }
            spans.clear();
            plan_spans(obj.sizes, obj.total, obj.chunk_bytes, obj.offsets, &mut spans).map_err(|e| invalid(o, e.0))?;
            // each touched piece's bytes are [0, end of its last span): spans of a piece ascend
            local.clear();
            local.resize(obj.addrs.len(), None);
            for (k, s) in spans.iter().enumerate() {
                if spans.get(k + 1).is_some_and(|n| n.piece == s.piece) {
                    continue;
                }
                let (addr, used) = (obj.addrs[s.piece], s.piece_offset + s.len);
                if addr.checked_add(used).is_none_or(|end| end > usize::MAX as u64) {
                    return Err(invalid(
                        o,
                        format!("piece {} at {addr:#x} of {used} bytes wraps the address space", s.piece),
                    ));
                }
                local[s.piece] = Some(match lookup.find(addr, used) {
                    Some(found) => found,
                    None => {
                        let access = Access { readonly: op == Op::Write, remote_readonly: true, restricted: false };
                        // SAFETY: the caller's contract: the piece's moving bytes are valid
                        // (writable for Read) until the batch ends; the region is
                        // unregistered by `temps` no earlier than the caller releases it.
                        let id = unsafe {
                            self.register_raw_with(addr as usize as *mut u8, used as usize, access, Box::new(()))
                        }
                        .map_err(|e| invalid(o, format!("piece {} at {addr:#x}: {e}", s.piece)))?;
                        temps.ids.lock().push(id);
                        (id, 0)
                    }
                });
            }
            for s in &spans {
                let (id, base) = local[s.piece].expect("every spanned piece was resolved above");
                reqs.push(Request {
                    op,
                    local: id,
                    local_offset: base + s.piece_offset,
                    peer: peer.clone(),
                    remote_region: obj.region,
                    remote_offset: s.remote_offset,
                    length: s.len,
                });
                owners.push(o as u32);
            }
        }
        let batch = if reqs.is_empty() { None } else { Some(self.submit(reqs, timeout)?) };
        Ok(ObjectBatch { batch, owners, objects: objects.len(), temps })
    }
}
