//! The state an engine shares with its dispatch paths and the in-process registry:
//! regions, counters, copy pool, server, peers. It sits below the public facade
//! ([`super::engine::Engine`]), [`super::dispatch`] and [`super::registry`], and imports
//! none of them, so those three depend on it and never on each other in a circle.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::auth::AuthKey;
use super::config::{Counters, EngineConfig};
use super::local::CopyPool;
use super::region::{RegionId, RegionTable};
use super::shm::{Lookup, ShmPeer};
use super::tcp::client::TcpPeer;
use super::tcp::server::Server;

/// A peer as seen by the initiator.
pub struct Peer {
    pub name: String,
    pub(crate) kind: PeerKind,
}

pub(crate) enum PeerKind {
    /// This engine or another engine of this process: memcpy.
    Local(Weak<EngineInner>),
    Remote {
        tcp: Arc<TcpPeer>,
        shm: Option<ShmPeer>,
    },
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer").field("name", &self.name).field("transport", &self.transport()).finish()
    }
}

impl Peer {
    /// "local", "shm" (same host; shm used where the region allows) or "tcp".
    pub fn transport(&self) -> &'static str {
        match &self.kind {
            PeerKind::Local(_) => "local",
            PeerKind::Remote { shm: Some(_), .. } => "shm",
            PeerKind::Remote { shm: None, .. } => "tcp",
        }
    }

    /// How a request on the peer's region `region` travels now: "local", "shm" (a mapping
    /// of its segment), "staged" (the same-host staging link), "tcp" (the peer's server
    /// reads or writes it, and tells the region's owner of a landed write: landing.rs), or
    /// "unknown" (not looked up yet: the first request asks the peer).
    pub fn route(&self, region: RegionId) -> &'static str {
        match &self.kind {
            PeerKind::Local(_) => "local",
            PeerKind::Remote { shm: None, .. } => "tcp",
            PeerKind::Remote { shm: Some(s), .. } => match s.lookup(region) {
                Lookup::Mapped(_) => "shm",
                Lookup::Staged(_) => "staged",
                Lookup::NotShared => "tcp",
                Lookup::Unknown => "unknown",
            },
        }
    }

    /// TCP connections up (0 for a local peer).
    pub fn connections(&self) -> usize {
        match &self.kind {
            PeerKind::Local(_) => 0,
            PeerKind::Remote { tcp, .. } => tcp.alive(),
        }
    }

    pub(crate) fn close(&self) {
        if let PeerKind::Remote { tcp, shm } = &self.kind {
            tcp.close();
            if let Some(s) = shm {
                s.clear();
            }
        }
    }
}

/// The state of one engine, shared by its facade, its dispatch paths, the registry, and
/// other engines of this process (a local peer holds a `Weak` to it and copies into it).
pub struct EngineInner {
    pub(crate) name: String,
    pub(crate) cfg: EngineConfig,
    pub(crate) regions: Arc<RegionTable>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) pool: CopyPool,
    pub(super) server: Mutex<Option<Server>>,
    pub(super) addresses: Vec<SocketAddr>,
    pub(super) peers: Mutex<Vec<Arc<Peer>>>,
    pub(super) key: Option<AuthKey>,
    pub(super) host: [u8; 16],
    pub(super) closed: AtomicBool,
    pub(super) me: Weak<EngineInner>,
}

impl EngineInner {
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    pub(crate) fn address(&self) -> String {
        self.addresses.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(",")
    }

    /// `connect` to a peer we already reach at the same endpoints returns that peer, so
    /// calling it again (the documented recovery, or just a habit) never piles up
    /// connections on the peer. A peer of that name with no connection left is closed
    /// and forgotten, so the caller gets fresh connections.
    pub(super) fn reuse_peer(&self, name: &str, endpoints: &[SocketAddr]) -> Option<Arc<Peer>> {
        let mut dead = Vec::new();
        let found = {
            let mut peers = self.peers.lock();
            let mut found = None;
            peers.retain(|p| {
                let PeerKind::Remote { tcp, .. } = &p.kind else { return true };
                if p.name != name {
                    return true;
                }
                if tcp.alive() == 0 {
                    dead.push(p.clone());
                    return false;
                }
                if found.is_none() && tcp.endpoints() == endpoints {
                    found = Some(p.clone());
                }
                true
            });
            found
        };
        for p in dead {
            p.close();
        }
        found
    }
}
