//! `submit`: validates the local side of each request, then hands each request to its
//! path — memcpy (local peer or mapped shm region), TCP slices, or (for a same-host
//! region not yet known, or a peer whose connections are all lost) a resolver thread
//! that redials the peer if needed, looks the region up and then picks shm or TCP.
//! Nothing here waits on the network.

use std::sync::Arc;
use std::time::Duration;

use hashbrown::HashMap;

use super::batch::{Batch, Report};
use super::completion::CompletionQueue;
use super::inner::{EngineInner, PeerKind};
use super::local::{CopyJob, Span, INLINE_COPY_BYTES};
use super::region::{Region, RegionId, RegionTable};
use super::shm::{self, Lookup, ShmPeer};
use super::staged::{StagedLink, StagedRequest};
use super::tcp::client::{Slice, TcpPeer};
use super::{AccessError, Op, Request, TransferError};

/// A request whose local side has been checked.
struct Checked {
    index: usize,
    req: Request,
    local: Arc<Region>,
}

/// Region lookups of one submit (batches reuse a few regions many times).
#[derive(Default)]
struct RegionCache {
    entries: Vec<(*const RegionTable, RegionId, Arc<Region>)>,
}

impl RegionCache {
    fn get(&mut self, table: &RegionTable, id: RegionId) -> Option<Arc<Region>> {
        let key = table as *const RegionTable;
        if let Some((_, _, r)) = self.entries.iter().find(|(t, i, _)| *t == key && *i == id) {
            return Some(r.clone());
        }
        let r = table.get(id)?;
        if self.entries.len() < 8 {
            self.entries.push((key, id, r.clone()));
        }
        Some(r)
    }
}

fn check_local(
    inner: &EngineInner,
    cache: &mut RegionCache,
    index: usize,
    req: Request,
) -> Result<Checked, TransferError> {
    let local = cache.get(&inner.regions, req.local).ok_or_else(|| {
        TransferError::InvalidRequest(format!("request {index}: local region {} is not registered here", req.local))
    })?;
    local.check(req.local_offset, req.length, req.op == Op::Read).map_err(|e| {
        TransferError::InvalidRequest(format!(
            "request {index}: local range {}+{} of region {} (length {}): {e}",
            req.local_offset,
            req.length,
            req.local,
            local.len()
        ))
    })?;
    if req.length > usize::MAX as u64 / 2 {
        return Err(TransferError::InvalidRequest(format!("request {index}: length {} too large", req.length)));
    }
    Ok(Checked { index, req, local })
}

fn local_copy(
    batch: &Arc<Batch>,
    cache: &mut RegionCache,
    c: &Checked,
    initiator: &str,
    target: &EngineInner,
) -> Result<CopyJob, TransferError> {
    let r = &c.req;
    let checked = cache
        .get(&target.regions, r.remote_region)
        .ok_or(AccessError::NoSuchRegion)
        // In-process: the initiating engine's own name is its identity.
        .and_then(|reg| reg.check_remote(initiator, r.remote_offset, r.length, r.op == Op::Write).map(|_| reg));
    let remote = checked.map_err(|reason| {
        target.counters.count_refusal(reason);
        TransferError::Refused { side: "peer", region: r.remote_region, reason }
    })?;
    let (l, rm) = (Span::region(&c.local, r.local_offset), Span::region(&remote, r.remote_offset));
    let (src, dst) = match r.op {
        Op::Read => (rm, l),
        Op::Write => (l, rm),
    };
    Ok(CopyJob { batch: batch.clone(), index: c.index, src, dst, len: r.length })
}

fn slices(slice_size: usize, batch: &Arc<Batch>, c: &Checked) -> Vec<Slice> {
    let r = &c.req;
    let step = slice_size as u64;
    let n = r.length.div_ceil(step) as usize;
    batch.set_slices(c.index, n);
    (0..n as u64)
        .map(|k| {
            let off = k * step;
            Slice {
                batch: batch.clone(),
                index: c.index,
                op: r.op,
                local: Span::region(&c.local, r.local_offset + off),
                remote_region: r.remote_region,
                remote_offset: r.remote_offset + off,
                len: (r.length - off).min(step) as usize,
                attempts: 0,
            }
        })
        .collect()
}

fn run_copies(inner: &EngineInner, batch: &Arc<Batch>, jobs: Vec<CopyJob>, inline: bool) {
    if inline {
        let mut done = Vec::with_capacity(jobs.len());
        for j in jobs {
            // SAFETY: as in CopyJob::run: both spans were bounds-checked for `len` bytes
            // and are kept mapped by `j`; the batch is fresh, so nothing ended it yet.
            unsafe { std::ptr::copy(j.src.ptr as *const u8, j.dst.ptr, j.len as usize) };
            done.push((j.index, j.len));
        }
        batch.slices_done(&done);
        return;
    }
    for j in jobs {
        let index = j.index;
        let chunks = j.chunks();
        batch.set_slices(index, chunks.len());
        for c in chunks {
            inner.pool.spawn(c);
        }
    }
}

pub(crate) fn submit(
    inner: &EngineInner,
    requests: Vec<Request>,
    timeout: Duration,
    queue: Option<(Arc<CompletionQueue>, u64)>,
) -> Result<Arc<Batch>, TransferError> {
    let mut cache = RegionCache::default();
    let checked = requests
        .into_iter()
        .enumerate()
        .map(|(i, r)| check_local(inner, &mut cache, i, r))
        .collect::<Result<Vec<_>, _>>()?;
    let report = Report { counters: Some(inner.counters.clone()), queue: queue.as_ref().map(|(q, _)| q.clone()) };
    let batch = Arc::new(Batch::with_report(checked.iter().map(|c| (c.req.op, c.req.length)), timeout, report));
    if let Some((q, tag)) = &queue {
        // Before any request can end, so its end is never missed.
        q.track(*tag, &batch);
    }
    let mut copies = Vec::new();
    let mut copy_bytes = 0u64;
    let mut tcp: HashMap<*const TcpPeer, (Arc<TcpPeer>, Vec<Slice>)> = HashMap::new();
    let mut deferred: Vec<Checked> = Vec::new();
    let mut staged: HashMap<*const StagedLink, (Arc<StagedLink>, Vec<StagedRequest>)> = HashMap::new();
    let mut last_target: Option<(*const std::sync::Weak<EngineInner>, Arc<EngineInner>)> = None;
    for c in checked {
        // The whole remote range must be addressable before anything moves: no path
        // computes `remote_offset + k` on a request that wraps past 2^64.
        if c.req.remote_offset.checked_add(c.req.length).is_none() {
            batch.fail(c.index, refused(&c.req, AccessError::OutOfBounds));
            continue;
        }
        match &c.req.peer.kind {
            PeerKind::Local(w) => {
                let target = match &last_target {
                    Some((p, t)) if std::ptr::eq(*p, w) => Some(t.clone()),
                    _ => w.upgrade().filter(|t| !t.is_closed()),
                };
                let Some(target) = target else {
                    batch.fail(c.index, TransferError::Closed);
                    continue;
                };
                last_target = Some((w as *const _, target.clone()));
                match local_copy(&batch, &mut cache, &c, &inner.name, &target) {
                    Ok(j) => {
                        copy_bytes += j.len;
                        copies.push(j);
                    }
                    Err(e) => batch.fail(c.index, e),
                }
            }
            PeerKind::Remote { tcp: t, shm } => {
                if t.needs_redial() {
                    // Redialing blocks: the resolver thread does it, then sends.
                    deferred.push(c);
                    continue;
                }
                let lookup = shm.as_ref().map(|s| s.lookup(c.req.remote_region)).unwrap_or(Lookup::NotShared);
                match lookup {
                    Lookup::Mapped(m) => {
                        let r = &c.req;
                        match shm::copy_job(
                            &batch,
                            c.index,
                            r.op,
                            &c.local,
                            r.local_offset,
                            &m,
                            r.remote_offset,
                            r.length,
                        ) {
                            Ok(j) => {
                                copy_bytes += j.len;
                                copies.push(j);
                            }
                            Err(e) => batch.fail(c.index, e),
                        }
                    }
                    Lookup::Staged(link) if use_staging(&c.req) => {
                        if let Some(w) = staged_request(&batch, &c, &link, t) {
                            staged.entry(Arc::as_ptr(&link)).or_insert_with(|| (link.clone(), Vec::new())).1.push(w);
                        }
                    }
                    Lookup::Staged(_) | Lookup::NotShared => match tcp_plan(t, inner.cfg.slice_size, &c.req) {
                        TcpPlan::Send => {
                            let s = slices(inner.cfg.slice_size, &batch, &c);
                            tcp.entry(Arc::as_ptr(t)).or_insert_with(|| (t.clone(), Vec::new())).1.extend(s);
                        }
                        TcpPlan::Refuse(e) => batch.fail(c.index, e),
                        TcpPlan::Resolve => deferred.push(c),
                    },
                    Lookup::Unknown => deferred.push(c),
                }
            }
        }
    }
    for (_, (peer, s)) in tcp {
        peer.submit(s);
    }
    // All of a batch's requests to one peer at once: its link commits them together, here
    // and now when they are no more than what the memcpy paths copy inside `submit`.
    for (_, (link, ws)) in staged {
        let inline = ws.iter().map(|w| w.len).sum::<u64>() <= INLINE_COPY_BYTES;
        link.submit_many(ws, inline);
    }
    run_copies(inner, &batch, copies, copy_bytes <= INLINE_COPY_BYTES);
    if !deferred.is_empty() {
        spawn_resolver(inner, batch.clone(), deferred);
    }
    Ok(batch)
}

/// Writes into and reads from a same-host peer's restricted region go through its
/// staging link; empty requests (which only check) stay on TCP.
fn use_staging(r: &Request) -> bool {
    r.length > 0
}

/// A request for the staging link, after checking it whole against what the peer said of
/// the region (the peer checks each chunk against its live grants before it moves);
/// `None` when refused here.
fn staged_request(batch: &Arc<Batch>, c: &Checked, link: &StagedLink, tcp: &TcpPeer) -> Option<StagedRequest> {
    let r = &c.req;
    let write = r.op == Op::Write;
    if let Some(Err(e)) = tcp.known_region(r.remote_region).map(|info| info.check(r.remote_offset, r.length, write)) {
        batch.fail(c.index, refused(r, e));
        return None;
    }
    batch.set_slices(c.index, r.length.div_ceil(link.chunk()) as usize);
    Some(StagedRequest {
        op: r.op,
        batch: batch.clone(),
        index: c.index,
        local: Span::region(&c.local, r.local_offset),
        region: r.remote_region,
        offset: r.remote_offset,
        len: r.length,
    })
}

fn refused(r: &Request, reason: AccessError) -> TransferError {
    TransferError::Refused { side: "peer", region: r.remote_region, reason }
}

/// How a TCP request goes out. The peer checks each slice before it moves a byte, so a
/// request of one slice is all-or-nothing there; a longer (or empty) one is checked
/// whole here first, against what the peer said of the region, so that a request that
/// runs past the end is refused before any of its slices is written.
enum TcpPlan {
    Send,
    Refuse(TransferError),
    /// The region's size is not known yet: ask the peer off the submitting thread.
    Resolve,
}

fn tcp_plan(peer: &TcpPeer, slice_size: usize, r: &Request) -> TcpPlan {
    if r.length > 0 && r.length <= slice_size as u64 {
        return TcpPlan::Send;
    }
    match peer.known_region(r.remote_region) {
        Some(info) => match info.check(r.remote_offset, r.length, r.op == Op::Write) {
            Ok(()) => TcpPlan::Send,
            Err(e) => TcpPlan::Refuse(refused(r, e)),
        },
        None => TcpPlan::Resolve,
    }
}

/// Looks up not-yet-known remote regions of same-host peers off the submitting thread,
/// then copies (shm) or sends (TCP).
fn spawn_resolver(inner: &EngineInner, batch: Arc<Batch>, deferred: Vec<Checked>) {
    let slice_size = inner.cfg.slice_size;
    let mut ctx = Resolver { slice_size, failed_redials: Vec::new() };
    let b2 = batch.clone();
    let spawned = std::thread::Builder::new().name("mc-shm-resolve".into()).spawn(move || {
        for c in deferred {
            ctx.resolve_one(&b2, c);
        }
    });
    if spawned.is_err() {
        for i in 0..batch.len() {
            if !batch.is_finished(i) {
                batch.fail(i, TransferError::Io("cannot start a resolver thread".into()));
            }
        }
    }
}

struct Resolver {
    slice_size: usize,
    /// Peers this batch failed to redial, and why: their other requests fail the same
    /// way without dialing again.
    failed_redials: Vec<(Arc<TcpPeer>, TransferError)>,
}

impl Resolver {
    fn resolve_one(&mut self, batch: &Arc<Batch>, c: Checked) {
        if batch.is_finished(c.index) {
            return;
        }
        let PeerKind::Remote { tcp, shm } = &c.req.peer.kind else { return };
        let r = &c.req;
        if let Some((_, e)) = self.failed_redials.iter().find(|(p, _)| Arc::ptr_eq(p, tcp)) {
            batch.fail(c.index, e.clone());
            return;
        }
        if tcp.needs_redial() {
            // Requests that were in flight on the lost connections have failed already
            // (a write may have landed: never resent); this one goes out on new ones.
            if let Err(e) = tcp.redial(|| shm.iter().for_each(|s| s.forget())) {
                self.failed_redials.push((tcp.clone(), e.clone()));
                batch.fail(c.index, e);
                return;
            }
        }
        if let Some(shm) = shm {
            let shm: &ShmPeer = shm;
            match shm.resolve(tcp, r.remote_region) {
                Lookup::Mapped(m) => {
                    match shm::copy_job(batch, c.index, r.op, &c.local, r.local_offset, &m, r.remote_offset, r.length) {
                        Ok(j) => j.run(),
                        Err(e) => batch.fail(c.index, e),
                    }
                    return;
                }
                Lookup::Staged(link) if use_staging(r) => {
                    if let Some(w) = staged_request(batch, &c, &link, tcp) {
                        link.submit(w);
                    }
                    return;
                }
                _ => {}
            }
        }
        let plan = match tcp_plan(tcp, self.slice_size, r) {
            TcpPlan::Resolve => match tcp.query_region(r.remote_region) {
                Ok(info) => match info.check(r.remote_offset, r.length, r.op == Op::Write) {
                    Ok(()) => TcpPlan::Send,
                    Err(e) => TcpPlan::Refuse(refused(r, e)),
                },
                Err(e) => TcpPlan::Refuse(e),
            },
            plan => plan,
        };
        match plan {
            TcpPlan::Send => {
                let s = slices(self.slice_size, batch, &c);
                tcp.submit(s);
            }
            TcpPlan::Refuse(e) => batch.fail(c.index, e),
            TcpPlan::Resolve => {
                batch.fail(c.index, TransferError::Protocol("the peer's region size is still unknown".into()))
            }
        }
    }
}
