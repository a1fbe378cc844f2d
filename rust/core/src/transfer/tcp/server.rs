//! Serving side: accepts connections, authenticates them, and answers requests against
//! the engine's region table. Each request is checked (region id, bounds, read-only)
//! before any byte moves; a refused write's payload is read and discarded, so memory
//! stays untouched and the connection stays usable. A bad frame (or, with a token, a bad
//! frame tag: see [`seal`](super::seal)) closes that connection.
//!
//! Unauthenticated peers cannot crowd out authenticated ones: a connection in its
//! handshake holds one of [`MAX_HANDSHAKES`] slots, separate from the
//! [`MAX_CONNECTIONS`] slots of authenticated connections, and must finish the whole
//! handshake within a deadline from accept (not per read, so a peer that trickles a
//! byte at a time gains nothing). When every handshake slot is taken, a new connection
//! evicts the oldest handshake: an honest client's handshake takes one round trip, an
//! idle or trickling one is the oldest and goes first.
//!
//! Served connections of sessions without a token are bounded the same way: at most
//! [`MAX_CONNECTIONS`] in all and [`MAX_PER_PEER`] from one peer address (an
//! authenticated session is a token holder's, never evicted for others' load). A connection at a cap evicts the served
//! connection of the same scope that has waited longest for its next request (never one
//! in the middle of a request); only when none is idle is it refused. Without a token
//! (anyone may complete the handshake) a served connection that waits `idle_timeout`
//! for its next request is closed too. So idle connections, handshaken or not, never
//! lock out a client that comes to move data; a client whose idle connection was closed
//! connects again when it needs it (client.rs retries).

use std::collections::BTreeMap;
use std::io::{self, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hashbrown::HashMap;
use parking_lot::Mutex;

use super::super::auth::AuthKey;
use super::super::config::Counters;
use super::super::protocol::{encode, Header, Msg, MAX_DATA};
use super::super::region::RegionTable;
use super::super::staged_server::StagingServer;
use super::super::{AccessError, TransferError};
use super::admission::{make_room, Activity, Served};
pub use super::admission::{MAX_CONNECTIONS, MAX_PER_PEER};
use super::answers::Answers;
use super::handshake::{self, Refusal};
use super::seal::{FrameReader, FrameWriter};
use super::{read_header, read_msg_body, ConnError};

/// Most connections in their handshake at once (each costs a thread).
pub const MAX_HANDSHAKES: usize = 64;
/// The longest a handshake may take from accept (the I/O timeout, if shorter).
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(3);

/// What a served connection is checked against (shared with the staging server).
#[derive(Clone)]
pub struct ServeCtx {
    pub name: String,
    pub regions: Arc<RegionTable>,
    pub key: Option<AuthKey>,
    /// Per-peer keys: a client of one of these names proves this key, not `key`.
    pub peer_keys: HashMap<String, AuthKey>,
    pub host: [u8; 16],
    pub counters: Arc<Counters>,
    pub io_timeout: Duration,
    /// Without a key: how long a served connection may wait for its next request.
    pub idle_timeout: Duration,
    /// Whether peers may learn shm names (the engine allows the shm transport).
    pub share_shm: bool,
    /// The staging socket offered for restricted regions (set by [`Server::bind`]).
    pub staging: Option<String>,
}

struct Shared {
    ctx: ServeCtx,
    closed: AtomicBool,
    next_conn: AtomicU64,
    /// Served connections (to shut them down on close, or evict the idlest at a cap).
    conns: Mutex<HashMap<u64, Served>>,
    /// The clock of `Activity::idle_since`.
    epoch: Instant,
    /// Connections in their handshake, by accept order (the first is the oldest).
    handshaking: Mutex<BTreeMap<u64, TcpStream>>,
}

/// A bound endpoint and its accept thread.
type Listener = (SocketAddr, TcpListener, Option<JoinHandle<()>>);

/// The listeners of one engine.
pub struct Server {
    shared: Arc<Shared>,
    listeners: Mutex<Vec<Listener>>,
    /// Same-host writes into restricted regions (`staged_server`), with the shm transport.
    staging: Option<StagingServer>,
}

impl Server {
    /// Binds every address in `listen` (each a `host:port`).
    pub fn bind(listen: &[String], mut ctx: ServeCtx) -> Result<Server, TransferError> {
        let staging = if ctx.share_shm { start_staging(&ctx) } else { None };
        ctx.staging = staging.as_ref().map(|s| s.name().to_string());
        let shared = Arc::new(Shared {
            ctx,
            closed: AtomicBool::new(false),
            next_conn: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
            epoch: Instant::now(),
            handshaking: Mutex::new(BTreeMap::new()),
        });
        let mut listeners = Vec::new();
        for addr in listen {
            let l = TcpListener::bind(addr.as_str())
                .map_err(|e| TransferError::InvalidRequest(format!("cannot listen on {addr:?}: {e}")))?;
            let local = l.local_addr().map_err(TransferError::io)?;
            let clone = l.try_clone().map_err(TransferError::io)?;
            let sh = shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("mc-accept-{}", local.port()))
                .spawn(move || accept_loop(clone, sh))
                .map_err(TransferError::io)?;
            listeners.push((local, l, Some(h)));
        }
        Ok(Server { shared, listeners: Mutex::new(listeners), staging })
    }

    pub fn addresses(&self) -> Vec<SocketAddr> {
        self.listeners.lock().iter().map(|(a, _, _)| *a).collect()
    }

    /// Stops accepting, closes every served connection and joins the accept threads.
    pub fn close(&self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        if let Some(s) = &self.staging {
            s.close();
        }
        let mut ls = self.listeners.lock();
        for (_, l, _) in ls.iter() {
            // SAFETY: shutting down our own listening socket wakes its blocked accept().
            unsafe { libc::shutdown(l.as_raw_fd(), libc::SHUT_RDWR) };
        }
        for (_, _, h) in ls.iter_mut() {
            if let Some(h) = h.take() {
                let _ = h.join();
            }
        }
        for (_, c) in self.shared.conns.lock().drain() {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
        for (_, s) in std::mem::take(&mut *self.shared.handshaking.lock()) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.close();
    }
}

fn start_staging(ctx: &ServeCtx) -> Option<StagingServer> {
    // the staging server checks commits with the same context (its own copy)
    match StagingServer::start(ctx.clone()) {
        Ok(s) => Some(s),
        Err(e) => {
            // Restricted regions then go over TCP only, as before.
            tracing::debug!(engine = %ctx.name, error = %e, "no staging socket");
            None
        }
    }
}

fn accept_loop(l: TcpListener, sh: Arc<Shared>) {
    for stream in l.incoming() {
        if sh.closed.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = stream else { continue };
        let id = sh.next_conn.fetch_add(1, Ordering::Relaxed);
        let Ok(clone) = stream.try_clone() else { continue };
        {
            let mut hs = sh.handshaking.lock();
            if hs.len() >= MAX_HANDSHAKES {
                if let Some((_, oldest)) = hs.pop_first() {
                    sh.ctx.counters.handshakes_evicted.fetch_add(1, Ordering::Relaxed);
                    let _ = oldest.shutdown(std::net::Shutdown::Both);
                }
            }
            hs.insert(id, clone);
        }
        let sh2 = sh.clone();
        let spawned = std::thread::Builder::new().name("mc-serve".into()).spawn(move || serve(stream, id, &sh2));
        if spawned.is_err() {
            sh.handshaking.lock().remove(&id);
        }
    }
}

/// A stream whose every read and write must end by `until` (the handshake deadline).
struct Deadline<'a> {
    s: &'a TcpStream,
    until: Instant,
}

impl Deadline<'_> {
    fn left(&self) -> io::Result<Duration> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(io::Error::new(io::ErrorKind::TimedOut, "handshake deadline passed"))
        } else {
            Ok(left)
        }
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.s.set_read_timeout(Some(self.left()?))?;
        (&mut &*self.s).read(buf)
    }
}

impl Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.s.set_write_timeout(Some(self.left()?))?;
        (&mut &*self.s).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn serve(stream: TcpStream, id: u64, sh: &Shared) {
    let ctx = &sh.ctx;
    let _ = stream.set_nodelay(true);
    let until = Instant::now() + HANDSHAKE_DEADLINE.min(ctx.io_timeout);
    let shook = handshake::server_with(
        &mut Deadline { s: &stream, until },
        ctx.key.as_ref(),
        &ctx.peer_keys,
        ctx.host,
        &ctx.name,
    );
    if sh.handshaking.lock().remove(&id).is_none() {
        return; // evicted (or the server closed) meanwhile
    }
    let (peer, keys) = match shook {
        Ok(ok) => ok,
        Err(Refusal::BadToken) => {
            ctx.counters.auth_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(engine = %ctx.name, "refused a connection: wrong auth token");
            return;
        }
        Err(Refusal::Other(why)) => {
            ctx.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(engine = %ctx.name, %why, "handshake failed");
            return;
        }
        Err(Refusal::Mismatch(why)) => {
            tracing::warn!(engine = %ctx.name, %why, "refused a connection");
            return;
        }
    };
    let Ok(addr) = stream.peer_addr() else { return };
    let activity = Arc::new(Activity::default());
    activity.idle(sh.epoch);
    {
        let mut conns = sh.conns.lock();
        if sh.closed.load(Ordering::SeqCst) {
            return;
        }
        // The caps are for sessions anyone may open (no token): an authenticated client
        // holds the cluster token, and evicting its idle connection under a flood of
        // others from its address would lock it out, which the caps are there to prevent.
        let capped = keys.recv.is_none();
        if let Err(what) = if capped { make_room(&mut conns, addr.ip(), &ctx.counters) } else { Ok(()) } {
            tracing::warn!(engine = %ctx.name, peer = %addr, "refused a connection: every one of the {what} \
                           served is in the middle of a request");
            return;
        }
        match stream.try_clone() {
            Ok(c) => conns.insert(id, Served { stream: c, peer: addr.ip(), activity: activity.clone() }),
            Err(_) => return,
        };
    }
    ctx.counters.connections.fetch_add(1, Ordering::Relaxed);
    serve_frames(stream, &peer, keys, ctx, sh, &activity);
    sh.conns.lock().remove(&id);
}

/// The authenticated part of a connection: one request at a time, in order.
/// `peer`: the client's engine name, what grants of restricted regions are checked against.
fn serve_frames(
    stream: TcpStream,
    peer: &str,
    keys: super::seal::FrameKeys,
    ctx: &ServeCtx,
    sh: &Shared,
    activity: &Activity,
) {
    let closed = &sh.closed;
    // After an authenticated handshake a connection may sit idle (until evicted for
    // room); without a token, only for `idle_timeout`.
    let idle_limit = if keys.recv.is_none() { Some(ctx.idle_timeout) } else { None };
    let _ = stream.set_read_timeout(idle_limit);
    let _ = stream.set_write_timeout(Some(ctx.io_timeout));
    let Ok(read_half) = stream.try_clone() else { return };
    let mut r = FrameReader::new(BufReader::with_capacity(8 << 10, read_half), keys.recv);
    // Answers are held while the next request is already queued (answers.rs); dropping
    // `w` on any way out writes those still held.
    let mut w = FrameWriter::new(Answers::new(stream), keys.send);
    loop {
        if closed.load(Ordering::SeqCst) {
            return;
        }
        activity.idle(sh.epoch);
        let result = read_header(&mut r).and_then(|h| match h {
            Some(h) => {
                activity.busy();
                let bytes = handle(h, peer, &mut r, &mut w, ctx)?;
                w.get_mut().answered(r.get_mut(), bytes).map_err(ConnError::from)
            }
            // (no request within the read timeout: only set without a token)
            None => Err(ConnError::Io(io::ErrorKind::TimedOut.into())),
        });
        match result {
            Ok(()) => {}
            Err(ConnError::Eof) => return,
            Err(ConnError::Frame(e)) => {
                ctx.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(engine = %ctx.name, error = %e, "closing a connection after a bad frame");
                return;
            }
            Err(ConnError::Io(e)) => {
                if idle_limit.is_some() && matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
                    ctx.counters.idle_evicted.fetch_add(1, Ordering::Relaxed);
                }
                tracing::debug!(engine = %ctx.name, error = %e, "connection ended");
                return;
            }
        }
    }
}

fn refuse(ctx: &ServeCtx, e: AccessError) -> Result<(), AccessError> {
    ctx.counters.count_refusal(e);
    Err(e)
}

type Reader = FrameReader<BufReader<TcpStream>>;

/// Serves one frame and returns the bytes the request moved (what counts against the
/// client's window while it is unanswered). Nothing is acted on before the frame's tag
/// verified (with a token), so a forged request reads, writes and answers nothing.
fn handle(
    h: Header,
    peer: &str,
    r: &mut Reader,
    w: &mut FrameWriter<Answers>,
    ctx: &ServeCtx,
) -> Result<usize, ConnError> {
    let moved = match read_msg_body(r, h)? {
        Msg::ReadReq { id, region, offset, len } => {
            r.end_frame()?;
            let checked = if len > MAX_DATA as u64 {
                Err(AccessError::TooLarge)
            } else {
                ctx.regions.resolve(region, peer, offset, len, false)
            };
            match checked {
                Ok(reg) => {
                    let head = encode(&Msg::ReadResp { id, status: Ok(()), data_len: len as usize });
                    // SAFETY: resolve() checked offset+len against the region, which `reg`
                    // keeps mapped while we send.
                    let data = unsafe { std::slice::from_raw_parts(reg.at(offset), len as usize) };
                    // Counted before sending, so a peer that saw the data sees the count.
                    ctx.counters.bytes_served.fetch_add(len, Ordering::Relaxed);
                    w.send(&head, data)?;
                    len as usize
                }
                Err(e) => {
                    let _ = refuse(ctx, e);
                    w.send(&encode(&Msg::ReadResp { id, status: Err(e), data_len: 0 }), &[])?;
                    0
                }
            }
        }
        Msg::WriteReq { id, region, offset, data_len } => {
            let status = match ctx.regions.resolve(region, peer, offset, data_len as u64, true) {
                Ok(reg) => {
                    // SAFETY: resolve() checked the range and that the region is writable;
                    // `reg` keeps it mapped while we receive into it.
                    let dst = unsafe { std::slice::from_raw_parts_mut(reg.at(offset), data_len) };
                    // With a token each record is staged and verified before it lands:
                    // an unverified byte never reaches `dst`.
                    r.read_payload_verified(dst)?;
                    ctx.counters.bytes_served.fetch_add(data_len as u64, Ordering::Relaxed);
                    // The owner hears of it before the writer does (landing.rs).
                    match reg.landing() {
                        Some(l) => l.landed(region, offset, data_len as u64).or_else(|e| refuse(ctx, e)),
                        None => Ok(()),
                    }
                }
                Err(e) => {
                    r.discard_payload(data_len)?;
                    refuse(ctx, e)
                }
            };
            w.send(&encode(&Msg::WriteResp { id, status }), &[])?;
            data_len
        }
        Msg::QueryRegion { id, region } => {
            r.end_frame()?;
            let reply = match ctx.regions.get(region) {
                Some(reg) => Msg::RegionInfo {
                    id,
                    status: Ok(()),
                    len: reg.len() as u64,
                    readonly: reg.readonly_to_peers(),
                    // A restricted region is never offered over shm: a mapping cannot
                    // be revoked, a grant must be. Same-host peers get the staging
                    // socket instead ("@name": staged_server.rs), where every commit is
                    // checked against the live grants; others stay on TCP.
                    shm: match (ctx.share_shm, reg.restricted) {
                        (true, false) => reg.shm().map(|(n, _)| n.to_string()),
                        (true, true) => ctx.staging.as_ref().map(|n| format!("@{n}")),
                        (false, _) => None,
                    },
                },
                None => {
                    Msg::RegionInfo { id, status: Err(AccessError::NoSuchRegion), len: 0, readonly: false, shm: None }
                }
            };
            w.send(&encode(&reply), &[])?;
            0
        }
        _ => return Err(ConnError::Frame(super::super::protocol::FrameError::Malformed)),
    };
    Ok(moved)
}
