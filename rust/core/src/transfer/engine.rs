//! The public facade of an engine: start, regions and grants, connect, submit, stats,
//! close. The state it shares lives in [`super::inner`]; batches go out through
//! [`super::dispatch`].

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::auth::{self, AuthKey};
use super::batch::Batch;
use super::completion::CompletionQueue;
pub use super::config::{Counters, EngineConfig, EngineStats, Transports, WireProtection};
use super::inner::PeerKind;
use super::local::CopyPool;
use super::region::{Access, Grant, Region, RegionId, RegionTable};
use super::registry::EngineRegistry;
use super::shm::ShmPeer;
use super::tcp::client::{ClientConfig, TcpPeer};
use super::tcp::server::{ServeCtx, Server};
use super::{Request, TransferError};
// `EngineInner` and `Peer` keep their public paths under `engine`.
pub use super::inner::{EngineInner, Peer};
use crate::mem::MappedMemory;

/// A transfer engine. Dropping it closes it.
pub struct Engine {
    inner: Arc<EngineInner>,
    /// The registry this engine joined (it leaves on close); held here, not in the
    /// shared state, because the registry itself holds that state.
    registry: Option<Arc<EngineRegistry>>,
}

fn parse_endpoints(address: &str) -> Result<Vec<SocketAddr>, TransferError> {
    let mut out = Vec::new();
    for part in address.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let mut addrs = part
            .to_socket_addrs()
            .map_err(|e| TransferError::InvalidRequest(format!("bad peer address {part:?} ({e}); use host:port")))?;
        out.extend(addrs.next());
    }
    if out.is_empty() {
        return Err(TransferError::InvalidRequest(format!(
            "peer address {address:?} has no endpoint; use \"host:port[,host:port...]\""
        )));
    }
    Ok(out)
}

impl Engine {
    /// Starts an engine; it joins `registry` (if any) under its name.
    pub fn new(cfg: EngineConfig, registry: Option<Arc<EngineRegistry>>) -> Result<Engine, TransferError> {
        cfg.validate()?;
        let regions = Arc::new(RegionTable::default());
        let counters = Arc::new(Counters::default());
        let protection = cfg.wire_protection.unwrap_or_default();
        let key = cfg.auth_token.as_deref().map(|t| AuthKey::from_token(t).with_protection(protection));
        let host = auth::host_id();
        let server = if cfg.transports.tcp && !cfg.listen.is_empty() {
            let ctx = ServeCtx {
                name: cfg.name.clone(),
                regions: regions.clone(),
                key: key.clone(),
                peer_keys: cfg
                    .peer_tokens
                    .iter()
                    .map(|(n, t)| (n.clone(), AuthKey::from_token(t).with_protection(protection)))
                    .collect(),
                host,
                counters: counters.clone(),
                io_timeout: cfg.io_timeout,
                idle_timeout: cfg.idle_timeout,
                share_shm: cfg.transports.shm,
                staging: None,
            };
            Some(Server::bind(&cfg.listen, ctx)?)
        } else {
            None
        };
        let addresses = server.as_ref().map(|s| s.addresses()).unwrap_or_default();
        if server.is_some() && key.is_none() {
            tracing::warn!(
                engine = %cfg.name,
                address = ?addresses,
                "transfer engine listening with no auth_token: any process that can reach {addresses:?} can read \
                 and write its registered regions; pass auth_token, or listen=\"\" when no other process needs it"
            );
        }
        let inner = Arc::new_cyclic(|me| EngineInner {
            name: cfg.name.clone(),
            pool: CopyPool::new(cfg.copy_threads),
            cfg,
            regions,
            counters,
            server: Mutex::new(server),
            addresses,
            peers: Mutex::new(Vec::new()),
            key,
            host,
            closed: AtomicBool::new(false),
            me: me.clone(),
        });
        if let Some(r) = &registry {
            if let Err(e) = r.insert(&inner.name, Arc::downgrade(&inner)) {
                Engine { inner, registry: registry.clone() }.close();
                return Err(e);
            }
        }
        Ok(Engine { inner, registry })
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Comma-separated TCP endpoints ("" without the tcp transport).
    pub fn address(&self) -> String {
        self.inner.address()
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.cfg
    }

    fn check_open(&self) -> Result<(), TransferError> {
        if self.inner.is_closed() {
            Err(TransferError::Closed)
        } else {
            Ok(())
        }
    }

    /// Registers a mapping (store arena, shared memory). Shared mappings can be reached
    /// by same-host peers through the shm path.
    /// `remote_readonly`: peers may only read it (this engine may still write it).
    pub fn register_mapped(
        &self,
        mem: Arc<MappedMemory>,
        readonly: bool,
        remote_readonly: bool,
    ) -> Result<RegionId, TransferError> {
        self.register_mapped_with(mem, Access { readonly, remote_readonly, restricted: false })
    }

    /// `register_mapped` with every access option (e.g. `restricted`: peers need grants).
    pub fn register_mapped_with(&self, mem: Arc<MappedMemory>, access: Access) -> Result<RegionId, TransferError> {
        self.check_open()?;
        Ok(self.inner.regions.register_mapped(mem, access).id)
    }

    /// Registers caller memory kept alive by `owner`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid (and writable unless `readonly`) while `owner` lives.
    pub unsafe fn register_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        readonly: bool,
        remote_readonly: bool,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<RegionId, TransferError> {
        // SAFETY: forwarded contract.
        unsafe { self.register_raw_with(ptr, len, Access { readonly, remote_readonly, restricted: false }, owner) }
    }

    /// `register_raw` with every access option.
    ///
    /// # Safety
    /// As [`register_raw`](Engine::register_raw), with `access.readonly` for `readonly`.
    pub unsafe fn register_raw_with(
        &self,
        ptr: *mut u8,
        len: usize,
        access: Access,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<RegionId, TransferError> {
        self.check_open()?;
        // SAFETY: forwarded contract.
        Ok(unsafe { self.inner.regions.register_raw(ptr, len, access, owner) }?.id)
    }

    /// A new registered region of zero-filled shared memory.
    pub fn allocate(&self, len: usize, readonly: bool) -> Result<Arc<Region>, TransferError> {
        self.allocate_with(len, Access { readonly, ..Access::default() })
    }

    /// `allocate` with every access option (a restricted one is never offered over shm).
    pub fn allocate_with(&self, len: usize, access: Access) -> Result<Arc<Region>, TransferError> {
        self.check_open()?;
        if len == 0 {
            return Err(TransferError::InvalidRequest("allocate() needs a length > 0".into()));
        }
        let mem = MappedMemory::shared(len).map_err(TransferError::io)?;
        Ok(self.inner.regions.register_mapped(Arc::new(mem), access))
    }

    fn restricted_region(&self, id: RegionId, what: &str) -> Result<Arc<Region>, TransferError> {
        self.check_open()?;
        self.inner
            .regions
            .get(id)
            .ok_or_else(|| TransferError::InvalidRequest(format!("{what}: region {id} is not registered here")))
    }

    /// Lets peer `peer` (the engine name it connects with; its handshake proof covers
    /// the name when the engines share an `auth_token`) read `offset..offset+len` of the
    /// restricted region `id`, and write it too when `write`, until `expires` from now
    /// if given. Returns the grant's id.
    pub fn grant(
        &self,
        id: RegionId,
        peer: &str,
        offset: u64,
        len: u64,
        write: bool,
        expires: Option<Duration>,
    ) -> Result<u64, TransferError> {
        let region = self.restricted_region(id, "grant()")?;
        let until = match expires {
            Some(d) => Some(std::time::Instant::now().checked_add(d).ok_or_else(|| {
                TransferError::InvalidRequest("grant() expiry is too far in the future; pass None for no expiry".into())
            })?),
            None => None,
        };
        let gid = self.inner.regions.next_grant_id();
        region.grant(gid, peer, offset, len, write, until)?;
        Ok(gid)
    }

    /// Removes the grants of `peer` on region `id` (only grant `grant_id` when given);
    /// returns how many. Requests checked after this returns are refused.
    pub fn revoke(&self, id: RegionId, peer: &str, grant_id: Option<u64>) -> Result<usize, TransferError> {
        Ok(self.restricted_region(id, "revoke()")?.revoke(peer, grant_id))
    }

    /// The live grants of region `id`.
    pub fn grants(&self, id: RegionId) -> Result<Vec<Grant>, TransferError> {
        Ok(self.restricted_region(id, "grants()")?.grants())
    }

    /// Tells `w` of every peer write that this engine's TCP server lands in region `id`,
    /// before the write is answered (landing.rs). Once per region.
    pub fn watch_writes(&self, id: RegionId, w: Arc<dyn super::landing::WriteLanded>) -> Result<(), TransferError> {
        let region = self.inner.regions.get(id).ok_or_else(|| {
            TransferError::InvalidRequest(format!("watch_writes(): region {id} is not registered here"))
        })?;
        if !region.set_landing(w) {
            return Err(TransferError::InvalidRequest(format!(
                "watch_writes(): region {id} is watched already (one watcher a region)"
            )));
        }
        Ok(())
    }

    pub fn region(&self, id: RegionId) -> Option<Arc<Region>> {
        self.inner.regions.get(id)
    }

    /// The table itself (an object batch unregisters its temporary regions there, after
    /// the batch's own calls into the engine have ended).
    pub(crate) fn region_table(&self) -> &Arc<RegionTable> {
        &self.inner.regions
    }

    /// Removes a region; transfers in flight keep its memory alive until they end.
    pub fn unregister(&self, id: RegionId) -> bool {
        self.inner.regions.unregister(id)
    }

    /// Connects to a peer: this engine or an engine of this process (by name, through
    /// the registry) goes the local path; anything else is reached at `address`.
    pub fn connect(&self, peer_name: &str, address: Option<&str>) -> Result<Arc<Peer>, TransferError> {
        self.check_open()?;
        let inner = &self.inner;
        let t = inner.cfg.transports;
        let local_target = if peer_name == inner.name {
            Some(inner.me.clone())
        } else {
            self.registry
                .as_ref()
                .and_then(|r| r.get(peer_name))
                .filter(|e| address.is_none_or(|a| a.is_empty() || a == e.address()))
                .map(|e| Arc::downgrade(&e))
        };
        let peer = match local_target {
            Some(w) if t.local => Peer { name: peer_name.into(), kind: PeerKind::Local(w) },
            _ => {
                if !t.tcp {
                    return Err(TransferError::InvalidRequest(format!(
                        "peer {peer_name:?} is not in this process and the tcp transport is disabled"
                    )));
                }
                let address = match address {
                    Some(a) if !a.is_empty() => a.to_string(),
                    _ => self.registry.as_ref().and_then(|r| r.address_of(peer_name)).ok_or_else(|| {
                        TransferError::InvalidRequest(format!("no address known for peer {peer_name:?}; pass one"))
                    })?,
                };
                let endpoints = parse_endpoints(&address)?;
                if let Some(p) = inner.reuse_peer(peer_name, &endpoints) {
                    return Ok(p);
                }
                let cfg = ClientConfig {
                    connect_timeout: inner.cfg.connect_timeout,
                    io_timeout: inner.cfg.io_timeout,
                    connections_per_endpoint: inner.cfg.connections(),
                    window: inner.cfg.window,
                    window_bytes: inner.cfg.window_bytes,
                    max_attempts: inner.cfg.max_attempts,
                    inline_send_bytes: inner.cfg.inline_send_bytes,
                };
                let tcp = TcpPeer::connect(&inner.name, endpoints, inner.key.clone(), cfg, inner.counters.clone())?;
                let same_host = tcp.hello.host == inner.host && inner.host != [0u8; 16];
                let shm = (t.shm && same_host).then(|| ShmPeer::new(inner.cfg.staged_copy));
                Peer { name: peer_name.into(), kind: PeerKind::Remote { tcp, shm } }
            }
        };
        let peer = Arc::new(peer);
        inner.peers.lock().push(peer.clone());
        Ok(peer)
    }

    /// Submits a batch and returns at once (copies of small local batches are done
    /// inline). A malformed request (unknown local region, local range out of bounds,
    /// read into a read-only local region, a peer of another engine) fails the whole
    /// call; everything the remote decides is a per-request status.
    pub fn submit(&self, requests: Vec<Request>, timeout: Duration) -> Result<Arc<Batch>, TransferError> {
        self.check_open()?;
        super::dispatch::submit(&self.inner, requests, timeout, None)
    }

    /// `submit`, and when the batch has ended it is reported (with `tag`) by `queue`.
    pub fn submit_to(
        &self,
        requests: Vec<Request>,
        timeout: Duration,
        queue: &Arc<CompletionQueue>,
        tag: u64,
    ) -> Result<Arc<Batch>, TransferError> {
        self.check_open()?;
        super::dispatch::submit(&self.inner, requests, timeout, Some((queue.clone(), tag)))
    }

    pub fn stats(&self) -> EngineStats {
        let c = &self.inner.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (busy_ns, batches_in_flight) = c.busy.lock().read(super::completion::monotonic_ns());
        EngineStats {
            auth_failures: l(&c.auth_failures),
            bad_frames: l(&c.bad_frames),
            refused: l(&c.refused),
            grant_refusals: l(&c.grant_refusals),
            connections: l(&c.connections),
            bytes_served: l(&c.bytes_served),
            bytes_staged: l(&c.bytes_staged),
            bytes_staged_read: l(&c.bytes_staged_read),
            reconnects: l(&c.reconnects),
            retries: l(&c.retries),
            late_responses: l(&c.late_responses),
            handshakes_evicted: l(&c.handshakes_evicted),
            idle_evicted: l(&c.idle_evicted),
            regions: self.inner.regions.len() as u64,
            batches: l(&c.batches),
            batches_done: l(&c.batches_done),
            batches_in_flight,
            bytes_written: l(&c.bytes_written),
            bytes_read: l(&c.bytes_read),
            requests_failed: l(&c.requests_failed),
            busy_ns,
        }
    }

    pub fn is_closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// Stops serving, closes peers (their pending requests fail as `Closed`) and drops
    /// the region table. Idempotent.
    pub fn close(&self) {
        let inner = &self.inner;
        if inner.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(s) = inner.server.lock().take() {
            s.close();
        }
        let peers = std::mem::take(&mut *inner.peers.lock());
        for p in peers {
            p.close();
        }
        inner.pool.shutdown();
        inner.regions.clear();
        if let Some(r) = &self.registry {
            r.remove(&inner.name, &inner.me);
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.close();
    }
}
