//! Admission of served connections (past the handshake): at most [`MAX_CONNECTIONS`]
//! per server and [`MAX_PER_PEER`] per peer address. A connection at a cap evicts the
//! served connection of that scope that has waited longest for its next request (never
//! one in the middle of a request); only when every one is busy is it refused. So idle
//! connections never lock out a client that comes to move data (issue 26, item 7).

use std::net::{IpAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use hashbrown::HashMap;

use super::super::config::Counters;

/// Most connections served at once (each costs a thread).
pub const MAX_CONNECTIONS: usize = 256;
/// Most connections served at once to one peer address.
pub const MAX_PER_PEER: usize = 64;

/// A served connection as the admission of others sees it.
pub struct Served {
    pub stream: TcpStream,
    pub peer: IpAddr,
    pub activity: Arc<Activity>,
}

/// Whether a served connection waits for a request, and since when.
#[derive(Default)]
pub struct Activity {
    /// Microseconds since `Shared::epoch` at which it began to wait; `u64::MAX` while
    /// it serves a request (never evicted then).
    idle_since: AtomicU64,
}

const BUSY: u64 = u64::MAX;

impl Activity {
    pub fn idle(&self, epoch: Instant) {
        self.idle_since.store(epoch.elapsed().as_micros() as u64, Ordering::Relaxed);
    }

    pub fn busy(&self) {
        self.idle_since.store(BUSY, Ordering::Relaxed);
    }
}

/// Makes room for one more connection from `peer`: `Ok` if there is room (after
/// evicting, at a cap, the connection of that scope that has been idle longest), `Err`
/// with the cap that is full of busy connections.
pub fn make_room(conns: &mut HashMap<u64, Served>, peer: IpAddr, counters: &Counters) -> Result<(), &'static str> {
    let from_peer = conns.values().filter(|c| c.peer == peer).count();
    let scope: Option<(bool, &'static str)> = if from_peer >= MAX_PER_PEER {
        Some((true, "connections from that address"))
    } else if conns.len() >= MAX_CONNECTIONS {
        Some((false, "connections"))
    } else {
        None
    };
    let Some((same_peer, what)) = scope else { return Ok(()) };
    let idlest = conns
        .iter()
        .filter(|(_, c)| !same_peer || c.peer == peer)
        .map(|(id, c)| (c.activity.idle_since.load(Ordering::Relaxed), *id))
        .filter(|(since, _)| *since != BUSY)
        .min();
    match idlest {
        Some((_, id)) => {
            if let Some(c) = conns.remove(&id) {
                let _ = c.stream.shutdown(std::net::Shutdown::Both);
                counters.idle_evicted.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        }
        None => Err(what),
    }
}
