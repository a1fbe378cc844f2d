//! Serving side of the staged path: restricted regions to same-host peers at memcpy speed,
//! without ever giving a peer a mapping of the region.
//!
//! A restricted region cannot go over shm (a mapping cannot be revoked; a grant must be).
//! Instead the server listens on an abstract unix socket (no file: nothing to leave behind),
//! named to peers in the authenticated answer to a region query. A peer that connects
//! passes the same handshake as on TCP (so its engine name, which grants are made out
//! to, is proven with a token) from a process of this user (`SO_PEERCRED`), and gets
//! the fd of a staging buffer of its own: a memfd sealed against resizing, passed with
//! `SCM_RIGHTS` (proven by possession, never named). The peer copies a write's bytes into
//! it and commits; the server checks the commit against the live grants exactly as a TCP
//! write (`RegionTable::resolve`) and only then copies the bytes into the region. So
//! revoke and expiry take effect at the next commit, the peer's mapping is of its own
//! staging buffer only (it holds nothing but what that peer wrote), and the buffer goes
//! away with the connection.
//!
//! Reads go the other way through the same buffer: the peer commits the chunks it wants
//! (where in the region, and where in its buffer), the server checks each against the
//! live grants (read access) and only then copies it out of the region into the buffer,
//! and the peer copies it from there once the answer says so. So a read, too, sees the
//! region only through bytes the server copied for a grant that was live at that chunk.
//!
//! One copy instead of two (`staged_direct`, asked for by the peer and granted where the
//! kernel allows): the server copies each checked chunk straight between the region and
//! the peer's own memory, at the address the commit names for it; the staging buffer is
//! then unused.
//!
//! Wire, after the handshake (a local stream between processes of one user; nothing sits
//! in between): the server sends the staging length (u64 LE) with the fd; the peer sends
//! its mode request ([`MODE_LEN`] bytes), answered by one byte; then each
//! commit is a 16-byte head (id u64, chunk count u32, op u32: [`COMMIT_WRITE`] or
//! [`COMMIT_READ`], the same for all its chunks) and that many 32-byte chunks (region,
//! offset, len, staging offset, or in one-copy mode ([`COMMIT_WRITE_DIRECT`],
//! [`COMMIT_READ_DIRECT`]) the address in the peer's memory: u64 LE each), answered by
//! a 12-byte head (id u64, count u32) and one status byte a chunk (as in
//! `protocol::status_to_u8`, or [`STATUS_COPY_FAILED`]), in order. A commit
//! carries all of a batch's chunks that fit (a serving step writes one span per block and
//! layer: eight 128 KiB spans were eight round trips and sixteen wake-ups, now one and
//! two); each chunk is still checked and answered on its own.

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use hashbrown::HashMap;
use parking_lot::Mutex;

use super::fdpass;
use super::protocol::status_to_u8;
use super::staged_direct::{PeerProcess, NONCE_LEN};
use super::tcp::handshake::{self, Refusal};
use super::tcp::server::ServeCtx;
use crate::mem::MappedMemory;

/// Bytes of one peer's staging buffer: two halves, so the peer fills one while the
/// server copies the other out.
pub const STAGING_LEN: usize = 8 << 20;
/// Most staging connections served at once (each holds a thread and a buffer).
pub const MAX_STAGED: usize = 64;
pub const COMMIT_HEAD_LEN: usize = 16;
pub const CHUNK_ENTRY_LEN: usize = 32;
pub const REPLY_HEAD_LEN: usize = 12;
/// A commit's op (its head's last u32): the chunks are in the buffer, copy them in.
pub const COMMIT_WRITE: u32 = 0;
/// A commit's op: copy the chunks out of the region into the buffer.
pub const COMMIT_READ: u32 = 1;
/// A commit's op: the peer's bytes at each chunk's address (its last field, in the peer's
/// own memory, not the buffer) go into the region, copied by the server itself.
pub const COMMIT_WRITE_DIRECT: u32 = 2;
/// A commit's op: each chunk of the region is copied by the server straight to the
/// peer's address.
pub const COMMIT_READ_DIRECT: u32 = 3;
/// The peer's mode request after it got the buffer ([`mode_request`]): [`MODE_MAGIC`], the
/// address of a nonce in its memory (u64), whether it wants one-copy mode (u64, 0 or 1)
/// and the nonce; answered by one byte, 1 if the server copies directly from now on
/// ([`COMMIT_WRITE_DIRECT`], [`COMMIT_READ_DIRECT`] allowed), 0 if the connection keeps to
/// the staging buffer. The magic tells a peer from before this request (whose first bytes
/// are a commit's id) from one that makes it; with the address next, an older server
/// reads the request as a commit head whose op is the address's high half, which is no
/// op, and closes the connection (that peer's restricted regions then go over TCP).
pub const MODE_LEN: usize = 24 + NONCE_LEN;
pub const MODE_MAGIC: u64 = u64::from_le_bytes(*b"mc1copy\0");
/// A one-copy commit of at least this many bytes is copied by two threads (the second one
/// kept for the connection): from 16 x 1 MiB on that took 0.41-0.46x of shm to
/// 0.66-0.72x; a 16 x 128 KiB commit (2 MiB) gained nothing while each split started a
/// thread, and measured no slower split since the thread is kept (BENCHMARKS.md, "k26t").
pub const SPLIT_MIN: u64 = 2 << 20;
/// A chunk's answer (beside `protocol::status_to_u8`'s): granted, but the server's copy
/// to or from the peer's address failed (`EFAULT`, a short copy); only that chunk fails.
pub const STATUS_COPY_FAILED: u8 = 0x80;
/// Most chunks in one commit, and in flight on one connection: their entries and
/// answers stay far below the socket buffers, so neither side can block writing while
/// the other does.
pub const MAX_COMMIT_CHUNKS: usize = 256;

struct Shared {
    ctx: ServeCtx,
    closed: AtomicBool,
    next: AtomicU64,
    conns: Mutex<HashMap<u64, UnixStream>>,
}

pub struct StagingServer {
    name: String,
    listener: UnixListener,
    shared: Arc<Shared>,
    accept: Mutex<Option<JoinHandle<()>>>,
}

impl StagingServer {
    /// Binds a fresh abstract socket and starts accepting.
    pub fn start(ctx: ServeCtx) -> std::io::Result<StagingServer> {
        let rnd = super::auth::nonce()?;
        let tail = u64::from_le_bytes(rnd[..8].try_into().unwrap_or_default());
        let name = format!("mooncake_rs.stage.{}.{tail:016x}", std::process::id());
        let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
        let shared = Arc::new(Shared {
            ctx,
            closed: AtomicBool::new(false),
            next: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
        });
        let (l, sh) = (listener.try_clone()?, shared.clone());
        let accept = std::thread::Builder::new().name("mc-stage-accept".into()).spawn(move || accept_loop(l, sh))?;
        Ok(StagingServer { name, listener, shared, accept: Mutex::new(Some(accept)) })
    }

    /// The abstract socket's name (without the leading NUL).
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn close(&self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        // SAFETY: shutting down our own listening socket wakes its blocked accept().
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(h) = self.accept.lock().take() {
            let _ = h.join();
        }
        for (_, s) in self.shared.conns.lock().drain() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for StagingServer {
    fn drop(&mut self) {
        self.close();
    }
}

fn accept_loop(l: UnixListener, sh: Arc<Shared>) {
    // SAFETY: getuid has no preconditions.
    let me = unsafe { libc::getuid() };
    for s in l.incoming() {
        if sh.closed.load(Ordering::SeqCst) {
            return;
        }
        let Ok(s) = s else { continue };
        // Another user's process (abstract sockets have no file permissions) is refused.
        if fdpass::peer_uid(&s).ok() != Some(me) {
            continue;
        }
        let id = sh.next.fetch_add(1, Ordering::Relaxed);
        {
            let mut conns = sh.conns.lock();
            if conns.len() >= MAX_STAGED {
                continue; // dropped: the peer falls back to TCP
            }
            let Ok(c) = s.try_clone() else { continue };
            conns.insert(id, c);
        }
        let sh2 = sh.clone();
        let spawned = std::thread::Builder::new().name("mc-stage".into()).spawn(move || {
            serve(&s, &sh2.ctx);
            sh2.conns.lock().remove(&id);
        });
        if spawned.is_err() {
            sh.conns.lock().remove(&id);
        }
    }
}

fn serve(s: &UnixStream, ctx: &ServeCtx) {
    let _ = s.set_read_timeout(Some(super::tcp::server::HANDSHAKE_DEADLINE.min(ctx.io_timeout)));
    let _ = s.set_write_timeout(Some(ctx.io_timeout));
    let peer = match handshake::server_with(&mut &*s, ctx.key.as_ref(), &ctx.peer_keys, ctx.host, &ctx.name) {
        Ok((peer, _)) => peer,
        Err(Refusal::BadToken) => {
            ctx.counters.auth_failures.fetch_add(1, Ordering::Relaxed);
            return;
        }
        Err(Refusal::Other(why)) => {
            tracing::debug!(engine = %ctx.name, %why, "staging handshake failed");
            return;
        }
        Err(Refusal::Mismatch(why)) => {
            tracing::warn!(engine = %ctx.name, %why, "refused a staging connection");
            return;
        }
    };
    let staging = match fdpass::sealed_memfd("mooncake_rs.stage", STAGING_LEN) {
        Ok(fd) => match MappedMemory::map_fd(fd.as_fd(), STAGING_LEN) {
            Ok(m) => (fd, m),
            Err(_) => return,
        },
        Err(_) => return,
    };
    if fdpass::send_with_fd(s, &(STAGING_LEN as u64).to_le_bytes(), staging.0.as_fd()).is_err() {
        return;
    }
    drop(staging.0); // the mapping and the peer's fd keep the buffer
    let mem = staging.1;
    let Ok(direct) = agree_mode(s, ctx, &peer) else { return };
    // An authenticated peer may idle; without a token, only for idle_timeout.
    let _ = s.set_read_timeout(if ctx.key.is_some() { None } else { Some(ctx.idle_timeout) });
    ctx.counters.connections.fetch_add(1, Ordering::Relaxed);
    std::thread::scope(|sc| serve_commits(sc, s, ctx, &peer, &mem, direct.as_ref()));
}

/// Reads, checks and serves commits until the connection ends. A large one-copy commit is
/// split with a helper thread (in `sc`) that lives as long as the connection, started at
/// the first such commit: each later split costs a wake-up, not a thread's start.
fn serve_commits<'scope, 'env>(
    sc: &'scope std::thread::Scope<'scope, 'env>,
    s: &'env UnixStream,
    ctx: &'env ServeCtx,
    peer: &'env str,
    mem: &'env MappedMemory,
    direct: Option<&'env PeerProcess>,
) {
    let mut helper: Option<Option<Helper>> = None;
    let mut head = [0u8; COMMIT_HEAD_LEN];
    let mut entries = Vec::with_capacity(MAX_COMMIT_CHUNKS * CHUNK_ENTRY_LEN);
    let mut reply = Vec::with_capacity(REPLY_HEAD_LEN + MAX_COMMIT_CHUNKS);
    loop {
        if (&*s).read_exact(&mut head).is_err() {
            return;
        }
        let id = u64::from_le_bytes(head[..8].try_into().unwrap_or_default());
        let count = u32::from_le_bytes(head[8..12].try_into().unwrap_or_default()) as usize;
        let op = u32::from_le_bytes(head[12..16].try_into().unwrap_or_default());
        let direct_op = op == COMMIT_WRITE_DIRECT || op == COMMIT_READ_DIRECT;
        if count == 0 || count > MAX_COMMIT_CHUNKS || op > COMMIT_READ_DIRECT || (direct_op && direct.is_none()) {
            ctx.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(engine = %ctx.name, %peer, count, "closing a staging connection after a malformed commit");
            return;
        }
        entries.resize(count * CHUNK_ENTRY_LEN, 0);
        if (&*s).read_exact(&mut entries).is_err() {
            return;
        }
        let chunk = |k: usize| {
            let f = |i: usize| {
                u64::from_le_bytes(entries[k * CHUNK_ENTRY_LEN + i * 8..][..8].try_into().unwrap_or_default())
            };
            (f(0), f(1), f(2), f(3))
        };
        // A chunk outside the staging buffer is no request of ours: close the connection
        // before any chunk of that commit lands.
        if !direct_op
            && (0..count).any(|k| {
                let (_, _, len, at) = chunk(k);
                at.checked_add(len).is_none_or(|end| end > mem.len() as u64)
            })
        {
            ctx.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(engine = %ctx.name, %peer, "closing a staging connection after a commit outside its buffer");
            return;
        }
        // One-copy commits are served only to the process that attached, while it lives
        // (its pid not reused) and keeps its end open (it has not taken its buffers back).
        if direct_op && !direct.as_ref().is_some_and(|p| p.still_there(s)) {
            return;
        }
        reply.clear();
        reply.extend_from_slice(&id.to_le_bytes());
        reply.extend_from_slice(&(count as u32).to_le_bytes());
        let serve_one = |k: usize| serve_chunk(ctx, peer, op, chunk(k), mem, direct);
        // (only a one-copy commit is ever split: the others' sizes need not be summed)
        let bytes: u64 = if direct_op { (0..count).map(|k| chunk(k).2).sum() } else { 0 };
        let split = direct_op && count >= 2 && bytes >= SPLIT_MIN;
        let helper =
            if split { helper.get_or_insert_with(|| Helper::start(sc, ctx, peer, mem, direct)).as_ref() } else { None };
        if let Some(helper) = helper {
            // One thread's kernel copies are about a core's worth: a large one-copy commit
            // is served by two, each checking every chunk of its half just before it moves
            // it (so a revoke still refuses each side's next chunk).
            let mut half = 0;
            let mut first = 0u64;
            while half < count - 1 && 2 * (first + chunk(half).2) <= bytes {
                first += chunk(half).2;
                half += 1;
            }
            let half = half.max(1);
            let given = helper.jobs.send((op, (half..count).map(chunk).collect())).is_ok();
            reply.extend((0..half).map(serve_one));
            // A helper that is gone (a bug of ours) leaves its chunks failed.
            match given.then(|| helper.done.recv().ok()).flatten() {
                Some(theirs) => reply.extend_from_slice(&theirs),
                None => reply.extend(std::iter::repeat_n(STATUS_COPY_FAILED, count - half)),
            }
        } else {
            reply.extend((0..count).map(serve_one));
        }
        if (&*s).write_all(&reply).is_err() {
            return;
        }
    }
}

/// A commit's chunks as the wire has them: (region, offset, len, staging offset or address).
type ChunkEntry = (u64, u64, u64, u64);

/// The second thread of a connection's large one-copy commits: takes (op, chunks) and
/// answers each chunk's status, in order.
struct Helper {
    jobs: std::sync::mpsc::Sender<(u32, Vec<ChunkEntry>)>,
    done: std::sync::mpsc::Receiver<Vec<u8>>,
}

impl Helper {
    /// `None` when no thread could be started (the commits are then served by one).
    fn start<'scope, 'env>(
        sc: &'scope std::thread::Scope<'scope, 'env>,
        ctx: &'env ServeCtx,
        peer: &'env str,
        mem: &'env MappedMemory,
        direct: Option<&'env PeerProcess>,
    ) -> Option<Helper> {
        let (jobs, job_rx) = std::sync::mpsc::channel::<(u32, Vec<ChunkEntry>)>();
        let (done_tx, done) = std::sync::mpsc::channel();
        // Ends when the connection's loop drops `jobs`; the scope then joins it.
        std::thread::Builder::new()
            .name("mc-stage-copy".into())
            .spawn_scoped(sc, move || {
                for (op, chunks) in job_rx {
                    let answers = chunks.into_iter().map(|c| serve_chunk(ctx, peer, op, c, mem, direct)).collect();
                    if done_tx.send(answers).is_err() {
                        return;
                    }
                }
            })
            .ok()?;
        Some(Helper { jobs, done })
    }
}

/// Reads the peer's mode request and answers it: the attached peer process when the
/// server will copy to and from its memory directly, `None` when the connection keeps to
/// the staging buffer (asked for, or direct copies are not possible: said once, here).
/// An error: the connection is broken.
fn agree_mode(s: &UnixStream, ctx: &ServeCtx, peer: &str) -> std::io::Result<Option<PeerProcess>> {
    let mut m = [0u8; MODE_LEN];
    (&*s).read_exact(&mut m)?;
    let field = |i: usize| u64::from_le_bytes(m[i * 8..i * 8 + 8].try_into().unwrap_or_default());
    if field(0) != MODE_MAGIC {
        ctx.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(engine = %ctx.name, %peer, "closing a staging connection without a mode request (a peer from before one-copy mode?)");
        return Err(std::io::ErrorKind::InvalidData.into());
    }
    let (probe, want) = (field(1), field(2) == 1);
    let nonce: [u8; NONCE_LEN] = m[24..].try_into().unwrap_or_default();
    let direct = if want {
        match PeerProcess::attach(s, probe, &nonce) {
            Ok(p) => {
                tracing::debug!(engine = %ctx.name, %peer, "one-copy staged transfers for this peer");
                Some(p)
            }
            Err(e) => {
                tracing::info!(engine = %ctx.name, %peer, error = %e, "one-copy staged transfers unavailable for this peer; using the staging buffer");
                None
            }
        }
    } else {
        None
    };
    (&*s).write_all(&[u8::from(direct.is_some())])?;
    Ok(direct)
}

/// Checks one chunk (region, offset, len, and where: a staging offset, or the peer's
/// address in one-copy mode) against the live grants and, if allowed, copies it; its
/// answer byte. A commit outside the buffer was refused before.
fn serve_chunk(
    ctx: &ServeCtx,
    peer: &str,
    op: u32,
    (region, offset, len, at): ChunkEntry,
    mem: &MappedMemory,
    direct: Option<&PeerProcess>,
) -> u8 {
    let write = op == COMMIT_WRITE || op == COMMIT_WRITE_DIRECT;
    let reg = match ctx.regions.resolve(region, peer, offset, len, write) {
        Ok(reg) => reg,
        Err(e) => {
            ctx.counters.count_refusal(e);
            return status_to_u8(Err(e));
        }
    };
    if op == COMMIT_WRITE_DIRECT || op == COMMIT_READ_DIRECT {
        let Some(process) = direct else { return STATUS_COPY_FAILED };
        // `at` is an address in the peer's memory: the kernel checks it (EFAULT), we never
        // dereference it. `reg.at(offset)` is `len` bytes of the region (resolve checked
        // them), which `reg` keeps mapped.
        let copied = if write {
            process.read_into(reg.at(offset), at, len as usize)
        } else {
            process.write_from(reg.at(offset) as *const u8, at, len as usize)
        };
        if let Err(e) = copied {
            tracing::debug!(engine = %ctx.name, %peer, error = %e, "a one-copy staged chunk failed");
            return STATUS_COPY_FAILED;
        }
    } else {
        // SAFETY: resolve() checked offset+len against the region (which `reg` keeps
        // mapped) and that this peer may write (or read) it now; at+len is inside the
        // staging mapping (checked by the caller), whose size is sealed. The peer may touch
        // its buffer meanwhile: then the bytes land torn, in its own grant or its own
        // buffer only.
        unsafe {
            let staged = mem.as_ptr().add(at as usize);
            if write {
                super::stream_copy::copy_last_leg(reg.at(offset), staged as *const u8, len as usize)
            } else {
                std::ptr::copy_nonoverlapping(reg.at(offset) as *const u8, staged, len as usize)
            }
        };
    }
    ctx.counters.bytes_served.fetch_add(len, Ordering::Relaxed);
    let moved = if write { &ctx.counters.bytes_staged } else { &ctx.counters.bytes_staged_read };
    moved.fetch_add(len, Ordering::Relaxed);
    status_to_u8(Ok(()))
}

/// The mode request a peer sends after it got the buffer (see [`MODE_LEN`]).
pub fn mode_request(want_direct: bool, probe: u64, nonce: &[u8; NONCE_LEN]) -> [u8; MODE_LEN] {
    let mut m = [0u8; MODE_LEN];
    m[..8].copy_from_slice(&MODE_MAGIC.to_le_bytes());
    m[8..16].copy_from_slice(&probe.to_le_bytes());
    m[16..24].copy_from_slice(&u64::from(want_direct).to_le_bytes());
    m[24..].copy_from_slice(nonce);
    m
}
