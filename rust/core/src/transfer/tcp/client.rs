//! Initiator side: a peer's connections (one or more per endpoint) pull slices from one
//! shared queue, so large requests spread over every path. Each connection has a sender
//! thread (frames out, at most `window` slices unanswered) and a receiver thread
//! (responses in, payloads straight into local memory). When a connection fails, its
//! unanswered slices go back to the queue for another connection, up to `max_attempts`
//! tries; with no connection left, the peer's requests fail at once, and the next batch
//! to the peer redials it first ([`TcpPeer::redial`], from the dispatcher's resolver
//! thread, never from `submit`).

use std::collections::VecDeque;
use std::io::BufReader;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Rounds of dialing every endpoint that one redial makes before it gives up, and the
/// pause before the second (doubled before each later one): a server restarting at the
/// same address is given a moment, a peer that refuses costs a batch 150 ms. No round
/// starts once `connect_timeout` has passed since the first, and an endpoint's first
/// failed dial ends its round, so a peer that does not answer at all costs about two
/// `connect_timeout`s an endpoint, not one a connection and round.
pub const REDIAL_ROUNDS: u32 = 3;
pub const REDIAL_BACKOFF: Duration = Duration::from_millis(50);

use hashbrown::HashMap;
use parking_lot::{Condvar, Mutex};

use super::super::auth::AuthKey;
use super::super::batch::Batch;
use super::super::config::Counters;
use super::super::local::Span;
use super::super::protocol::{encode, Msg};
use super::super::{AccessError, Op, TransferError};
use super::handshake::{self, ServerHello};
use super::seal::{FrameKeys, FrameReader, FrameWriter};
use super::{read_control, read_header, read_msg_body, ConnError};

#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub connect_timeout: Duration,
    pub io_timeout: Duration,
    pub connections_per_endpoint: usize,
    /// Unanswered slices per connection.
    pub window: usize,
    /// A connection's sender takes the next slice from the peer's queue only while its
    /// unanswered bytes are below this. Without it, the first sender to wake takes every
    /// read slice of a batch (a read request is a few bytes to send), so a batch's reads
    /// all come back over one connection however many there are; with it, each
    /// connection holds a few slices and the rest go to whichever answers first.
    pub window_bytes: usize,
    pub max_attempts: u32,
    /// See `EngineConfig::inline_send_bytes`.
    pub inline_send_bytes: usize,
}

/// A piece of one request, sent as one frame.
#[derive(Clone)]
pub struct Slice {
    pub batch: Arc<Batch>,
    pub index: usize,
    pub op: Op,
    pub local: Span,
    pub remote_region: u64,
    pub remote_offset: u64,
    pub len: usize,
    pub attempts: u32,
}

struct Conn {
    stream: TcpStream,
    /// The sending half. Whoever holds it writes one frame at a time: the connection's
    /// sender thread, or a submitting thread that found the connection idle (see
    /// `TcpPeer::submit`). It is held only for the write of one frame.
    writer: Mutex<FrameWriter<TcpStream>>,
    dead: AtomicBool,
    inflight: Mutex<Inflight>,
    room: Condvar,
    /// Bytes of the slices answered on this connection (tests check how a batch spread).
    answered: AtomicU64,
}

/// A connection's unanswered slices by request id, and their bytes.
#[derive(Default)]
struct Inflight {
    slices: HashMap<u64, Slice>,
    bytes: usize,
}

impl Inflight {
    fn insert(&mut self, id: u64, slice: Slice) {
        self.bytes += slice.len;
        if let Some(old) = self.slices.insert(id, slice) {
            self.bytes -= old.len; // (ids are never reused: not reached)
        }
    }

    fn remove(&mut self, id: &u64) -> Option<Slice> {
        let s = self.slices.remove(id)?;
        self.bytes -= s.len;
        Some(s)
    }

    fn len(&self) -> usize {
        self.slices.len()
    }

    fn is_empty(&self) -> bool {
        self.slices.is_empty()
    }

    fn take(&mut self) -> HashMap<u64, Slice> {
        self.bytes = 0;
        std::mem::take(&mut self.slices)
    }
}

/// What a region query answers (for the shm path).
#[derive(Debug, Clone)]
pub struct RemoteRegionInfo {
    pub len: u64,
    pub readonly: bool,
    pub shm: Option<String>,
}

impl RemoteRegionInfo {
    /// The same check the peer makes, on the whole request.
    pub fn check(&self, offset: u64, len: u64, write: bool) -> Result<(), AccessError> {
        super::super::region::check_access(offset, len, self.len, self.readonly, write, None)
    }
}

type Reader = FrameReader<BufReader<TcpStream>>;

pub struct TcpPeer {
    pub hello: ServerHello,
    endpoints: Vec<SocketAddr>,
    local_name: String,
    key: Option<AuthKey>,
    cfg: ClientConfig,
    counters: Arc<Counters>,
    queue: Mutex<VecDeque<Slice>>,
    work: Condvar,
    conns: Mutex<Vec<Arc<Conn>>>,
    alive: AtomicUsize,
    closed: AtomicBool,
    next_id: AtomicU64,
    threads: Mutex<Vec<JoinHandle<()>>>,
    control: Mutex<Option<(Reader, FrameWriter<TcpStream>)>>,
    /// What `query_region` learned (region ids are never reused by an engine), so a
    /// request of several slices is checked whole before its first slice is sent.
    regions: Mutex<HashMap<u64, RemoteRegionInfo>>,
    /// Held by a redial (one at a time) and by `close` (so a redial never adds
    /// connections to a closed peer).
    redial_lock: Mutex<()>,
    /// When the last redial failed, and why: callers that waited for it fail the same way
    /// instead of dialing again one after another.
    last_redial_failure: Mutex<Option<(Instant, TransferError)>>,
}

fn open(
    addr: SocketAddr,
    key: Option<&AuthKey>,
    name: &str,
    cfg: &ClientConfig,
) -> Result<(TcpStream, ServerHello, FrameKeys), TransferError> {
    let mut s = TcpStream::connect_timeout(&addr, cfg.connect_timeout)
        .map_err(|e| TransferError::Connect(format!("{addr}: {e}")))?;
    let _ = s.set_nodelay(true);
    s.set_read_timeout(Some(cfg.io_timeout)).map_err(TransferError::io)?;
    s.set_write_timeout(Some(cfg.io_timeout)).map_err(TransferError::io)?;
    let (hello, keys) = handshake::client(&mut s, key, name)?;
    Ok((s, hello, keys))
}

impl TcpPeer {
    /// Connects to every endpoint (`connections_per_endpoint` each). Succeeds if at
    /// least one connection is up; a refused token fails at once.
    pub fn connect(
        local_name: &str,
        endpoints: Vec<SocketAddr>,
        key: Option<AuthKey>,
        cfg: ClientConfig,
        counters: Arc<Counters>,
    ) -> Result<Arc<TcpPeer>, TransferError> {
        let mut streams = Vec::new();
        let mut hello = None;
        let mut last_err = None;
        for &addr in &endpoints {
            for _ in 0..cfg.connections_per_endpoint.max(1) {
                match open(addr, key.as_ref(), local_name, &cfg) {
                    Ok((s, h, keys)) => {
                        hello.get_or_insert(h);
                        streams.push((s, keys));
                    }
                    Err(e @ TransferError::Unauthorized(_)) => return Err(e),
                    Err(e) => last_err = Some(e),
                }
            }
        }
        let Some(hello) = hello else {
            return Err(last_err.unwrap_or_else(|| TransferError::Connect("no endpoint given".into())));
        };
        let peer = Arc::new(TcpPeer {
            hello,
            endpoints,
            local_name: local_name.to_string(),
            key,
            cfg,
            counters,
            queue: Mutex::new(VecDeque::new()),
            work: Condvar::new(),
            conns: Mutex::new(Vec::new()),
            alive: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            threads: Mutex::new(Vec::new()),
            control: Mutex::new(None),
            regions: Mutex::new(HashMap::new()),
            redial_lock: Mutex::new(()),
            last_redial_failure: Mutex::new(None),
        });
        for (s, keys) in streams {
            peer.start_conn(s, keys)?;
        }
        Ok(peer)
    }

    fn start_conn(self: &Arc<Self>, stream: TcpStream, keys: FrameKeys) -> Result<(), TransferError> {
        let read_half = stream.try_clone().map_err(TransferError::io)?;
        let write_half = stream.try_clone().map_err(TransferError::io)?;
        // Ticks of half the I/O timeout let the receiver notice a silent peer.
        let _ = read_half.set_read_timeout(Some(self.cfg.io_timeout / 2));
        let conn = Arc::new(Conn {
            stream,
            writer: Mutex::new(FrameWriter::new(write_half, keys.send)),
            dead: AtomicBool::new(false),
            inflight: Mutex::new(Inflight::default()),
            room: Condvar::new(),
            answered: AtomicU64::new(0),
        });
        self.conns.lock().push(conn.clone());
        self.alive.fetch_add(1, Ordering::SeqCst);
        let (p1, c1, p2, c2) = (self.clone(), conn.clone(), self.clone(), conn);
        let mut threads = self.threads.lock();
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| std::thread::Builder::new().name(name.into()).spawn(f);
        let reader = FrameReader::new(BufReader::with_capacity(8 << 10, read_half), keys.recv);
        threads.push(spawn("mc-tcp-send", Box::new(move || p1.sender(&c1))).map_err(TransferError::io)?);
        threads.push(spawn("mc-tcp-recv", Box::new(move || p2.receiver(&c2, reader))).map_err(TransferError::io)?);
        Ok(())
    }

    /// Who this side is to the peer (key, engine name) and its I/O timeout: what the
    /// staged path's own connection to the peer authenticates with.
    pub fn identity(&self) -> (Option<&AuthKey>, &str, Duration) {
        (self.key.as_ref(), &self.local_name, self.cfg.io_timeout)
    }

    pub fn endpoints(&self) -> &[SocketAddr] {
        &self.endpoints
    }

    /// Bytes answered on each connection opened so far (live ones).
    pub fn answered_per_connection(&self) -> Vec<u64> {
        self.conns.lock().iter().map(|c| c.answered.load(Ordering::Relaxed)).collect()
    }

    /// Connections still up.
    pub fn alive(&self) -> usize {
        self.alive.load(Ordering::SeqCst)
    }

    /// Every connection is gone but the peer was not closed: the next request to it
    /// should `redial` first.
    pub fn needs_redial(&self) -> bool {
        self.alive() == 0 && !self.closed.load(Ordering::SeqCst)
    }

    /// Dials the peer's endpoints again (the same key and name, `connections_per_endpoint`
    /// each), up to [`REDIAL_ROUNDS`] rounds with a doubling pause from
    /// [`REDIAL_BACKOFF`], when every connection is gone; blocking, so never from
    /// `submit`. The server must still be the engine first connected to (name and host):
    /// another engine at the address is an error, not a peer to send this one's requests
    /// to. Before the new connections take any request, what was learned from the old
    /// server is forgotten (region sizes, the control connection) and `forget` runs (the
    /// caller's own cache of the peer: its shm mappings, which a restarted server no
    /// longer backs). Concurrent callers wait for one redial; `Ok` when the peer has a
    /// connection again, `ConnectionLost` saying why when not.
    pub fn redial(self: &Arc<Self>, forget: impl FnOnce()) -> Result<(), TransferError> {
        let asked = Instant::now();
        let _one = self.redial_lock.lock();
        if self.closed.load(Ordering::SeqCst) {
            return Err(TransferError::Closed);
        }
        if self.alive() > 0 {
            return Ok(()); // another caller redialed meanwhile
        }
        if let Some((at, e)) = &*self.last_redial_failure.lock() {
            if *at > asked {
                return Err(e.clone()); // another caller's redial failed while we waited
            }
        }
        let e = match self.dial_again(forget) {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        *self.last_redial_failure.lock() = Some((Instant::now(), e.clone()));
        Err(e)
    }

    /// The rounds of `redial` (its lock held).
    fn dial_again(self: &Arc<Self>, forget: impl FnOnce()) -> Result<(), TransferError> {
        let name = &self.hello.name;
        let mut last = String::from("no endpoint");
        let began = Instant::now();
        for round in 0..REDIAL_ROUNDS {
            if round > 0 {
                if began.elapsed() >= self.cfg.connect_timeout {
                    break;
                }
                std::thread::sleep(REDIAL_BACKOFF * (1 << (round - 1)));
            }
            let mut streams = Vec::new();
            for &addr in &self.endpoints {
                for _ in 0..self.cfg.connections_per_endpoint.max(1) {
                    match open(addr, self.key.as_ref(), &self.local_name, &self.cfg) {
                        Ok((_, hello, _)) if hello.name != *name || hello.host != self.hello.host => {
                            return Err(TransferError::ConnectionLost(format!(
                                "no connection left to peer {name:?}, and {addr} now serves engine {:?}: call \
                                 connect() with that engine's name",
                                hello.name
                            )));
                        }
                        Ok((s, _, keys)) => streams.push((s, keys)),
                        Err(e) => {
                            last = format!("{addr}: {e}");
                            break; // the endpoint's other dials would fail the same way
                        }
                    }
                }
            }
            if streams.is_empty() {
                continue;
            }
            self.regions.lock().clear();
            if let Some((_, s)) = self.control.lock().take() {
                let _ = s.get_ref().shutdown(Shutdown::Both);
            }
            forget();
            self.conns.lock().retain(|c| !c.dead.load(Ordering::SeqCst));
            // Threads of dead connections have ended or are ending: let them go.
            self.threads.lock().retain(|t| !t.is_finished());
            for (s, keys) in streams {
                self.start_conn(s, keys)?;
            }
            self.counters.reconnects.fetch_add(1, Ordering::Relaxed);
            tracing::info!(peer = %name, "redialed the peer after every connection to it was lost");
            return Ok(());
        }
        Err(TransferError::ConnectionLost(format!(
            "no connection left to peer {name:?}, and redialing it failed (last: {last})"
        )))
    }

    /// Queues slices for the sender threads. A small batch to a peer with an idle
    /// connection is sent right here instead (`inline_send_bytes`): that saves
    /// the hand-off to the sender thread, a futex wake-up that costs as much as the
    /// round trip itself for a 4 KiB write.
    pub fn submit(&self, slices: Vec<Slice>) {
        if self.alive() == 0 || self.closed.load(Ordering::SeqCst) {
            for s in slices {
                s.batch.fail(s.index, self.gone());
            }
            return;
        }
        let Some(slices) = self.try_inline(slices) else { return };
        self.queue.lock().extend(slices);
        self.work.notify_all();
        if self.alive() == 0 {
            self.drain_fail();
        }
    }

    fn gone(&self) -> TransferError {
        if self.closed.load(Ordering::SeqCst) {
            TransferError::Closed
        } else {
            TransferError::ConnectionLost(format!("no connection left to peer {:?}", self.hello.name))
        }
    }

    fn drain_fail(&self) {
        let drained: Vec<Slice> = self.queue.lock().drain(..).collect();
        for s in drained {
            s.batch.fail(s.index, self.gone());
        }
    }

    fn retry_or_fail(&self, mut s: Slice, why: &str) {
        let retry = !self.closed.load(Ordering::SeqCst)
            && s.attempts + 1 < self.cfg.max_attempts
            && self.alive() > 0
            && !s.batch.is_finished(s.index);
        if !retry {
            let e = if self.closed.load(Ordering::SeqCst) {
                TransferError::Closed
            } else {
                TransferError::ConnectionLost(why.to_string())
            };
            s.batch.fail(s.index, e);
            return;
        }
        s.attempts += 1;
        self.counters.retries.fetch_add(1, Ordering::Relaxed);
        self.queue.lock().push_front(s);
        self.work.notify_all();
        if self.alive() == 0 {
            self.drain_fail();
        }
    }

    fn kill(&self, conn: &Conn, why: &str) {
        let taken = {
            let mut inf = conn.inflight.lock();
            if conn.dead.swap(true, Ordering::SeqCst) {
                return;
            }
            inf.take()
        };
        conn.room.notify_all();
        let _ = conn.stream.shutdown(Shutdown::Both);
        self.alive.fetch_sub(1, Ordering::SeqCst);
        if !self.closed.load(Ordering::SeqCst) {
            tracing::warn!(peer = %self.hello.name, %why, "a connection to the peer failed");
        }
        drop(self.queue.lock());
        self.work.notify_all();
        for (_, s) in taken {
            self.retry_or_fail(s, why);
        }
        if self.alive() == 0 {
            self.drain_fail();
        }
    }

    /// Sends `slices` on an idle connection from the calling thread, if they are few and
    /// small, nothing is queued and some connection has nothing in flight (then its send
    /// buffer is drained, so a write this small does not wait on the peer). Hands the
    /// slices back when they must go through the queue.
    fn try_inline(&self, slices: Vec<Slice>) -> Option<Vec<Slice>> {
        let bytes: usize = slices.iter().map(|s| s.len).sum();
        let small = bytes > 0 && bytes <= self.cfg.inline_send_bytes && slices.len() <= self.cfg.window.max(1);
        if !small || !self.queue.lock().is_empty() {
            return Some(slices);
        }
        let conns: Vec<Arc<Conn>> =
            self.conns.lock().iter().filter(|c| !c.dead.load(Ordering::SeqCst)).cloned().collect();
        for conn in conns {
            if !conn.inflight.lock().is_empty() {
                continue;
            }
            // Never wait for the writer here: if the sender thread has it, queue instead.
            let Some(mut w) = conn.writer.try_lock() else { continue };
            if conn.dead.load(Ordering::SeqCst) {
                continue;
            }
            let mut rest = slices.into_iter();
            while let Some(slice) = rest.next() {
                if slice.batch.is_finished(slice.index) {
                    continue;
                }
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                conn.inflight.lock().insert(id, slice.clone());
                if let Err(e) = self.send_slice(conn.as_ref(), &mut w, id, &slice) {
                    drop(w);
                    self.kill(&conn, &format!("send failed: {e}"));
                    let left: Vec<Slice> = rest.collect();
                    return (!left.is_empty()).then_some(left);
                }
            }
            return None;
        }
        Some(slices)
    }

    /// Writes the frame of one slice (already in `conn`'s in-flight table as `id`).
    fn send_slice(&self, conn: &Conn, w: &mut FrameWriter<TcpStream>, id: u64, slice: &Slice) -> std::io::Result<()> {
        let (region, offset, len) = (slice.remote_region, slice.remote_offset, slice.len);
        match slice.op {
            Op::Read => w.send(&encode(&Msg::ReadReq { id, region, offset, len: len as u64 }), &[]),
            Op::Write => {
                if !slice.batch.begin_io(slice.index) {
                    // Ended while queued: its buffer is the caller's again, send nothing.
                    conn.inflight.lock().remove(&id);
                    conn.room.notify_one();
                    return Ok(());
                }
                let head = encode(&Msg::WriteReq { id, region, offset, data_len: len });
                // SAFETY: the request's local range was bounds-checked at submit and the
                // span keeps the region mapped; begin_io keeps the request from being
                // reported final (and its buffer reused) while we read it.
                let data = unsafe { std::slice::from_raw_parts(slice.local.ptr as *const u8, len) };
                let r = w.send(&head, data);
                slice.batch.end_io(slice.index);
                r
            }
        }
    }

    fn sender(&self, conn: &Conn) {
        loop {
            // Room first (bytes and slices), then a slice: a connection that is full
            // leaves the queue to the others.
            {
                let mut inf = conn.inflight.lock();
                while !conn.dead.load(Ordering::SeqCst)
                    && (inf.bytes >= self.cfg.window_bytes.max(1) || inf.len() >= self.cfg.window.max(1))
                {
                    conn.room.wait(&mut inf);
                }
            }
            let slice = {
                let mut q = self.queue.lock();
                loop {
                    if conn.dead.load(Ordering::SeqCst) || self.closed.load(Ordering::SeqCst) {
                        return;
                    }
                    if let Some(s) = q.pop_front() {
                        break s;
                    }
                    self.work.wait(&mut q);
                }
            };
            if slice.batch.is_finished(slice.index) {
                continue;
            }
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            {
                let mut inf = conn.inflight.lock();
                while !conn.dead.load(Ordering::SeqCst) && inf.len() >= self.cfg.window.max(1) {
                    conn.room.wait(&mut inf);
                }
                if conn.dead.load(Ordering::SeqCst) {
                    drop(inf);
                    self.retry_or_fail(slice, "connection closed");
                    return;
                }
                inf.insert(id, slice.clone());
            }
            // Waits at most for one inline frame (a few KiB) another thread is writing.
            let sent = self.send_slice(conn, &mut conn.writer.lock(), id, &slice);
            if let Err(e) = sent {
                self.kill(conn, &format!("send failed: {e}"));
                return;
            }
        }
    }

    fn receiver(&self, conn: &Conn, mut r: Reader) {
        let mut stalled = 0u32;
        loop {
            if conn.dead.load(Ordering::SeqCst) {
                return;
            }
            let h = match read_header(&mut r) {
                Ok(Some(h)) => h,
                Ok(None) => {
                    if conn.inflight.lock().is_empty() {
                        stalled = 0;
                        continue;
                    }
                    stalled += 1;
                    if stalled >= 2 {
                        self.kill(conn, &format!("peer sent nothing for {:?}", self.cfg.io_timeout));
                        return;
                    }
                    continue;
                }
                Err(e) => {
                    self.kill(conn, &e.to_string());
                    return;
                }
            };
            stalled = 0;
            if let Err(e) = self.on_frame(conn, &mut r, h) {
                self.kill(conn, &e);
                return;
            }
        }
    }

    /// Handles one response. Nothing is acted on before the frame's tag verified (with
    /// a token); a read's payload lands in the request's buffer first and the request
    /// is reported done only after the tag matched.
    fn on_frame(&self, conn: &Conn, r: &mut Reader, h: super::super::protocol::Header) -> Result<(), String> {
        let msg = read_msg_body(r, h).map_err(|e| e.to_string())?;
        let (id, status, data_len) = match msg {
            Msg::ReadResp { id, status, data_len } => (id, status, Some(data_len)),
            Msg::WriteResp { id, status } => (id, status, None),
            other => return Err(format!("unexpected frame {other:?}")),
        };
        // A frame with a payload is verified after it (below), any other one now.
        let payload = matches!((&status, data_len), (Ok(()), Some(n)) if n > 0);
        if !payload {
            r.end_frame().map_err(|e| e.to_string())?;
        }
        let slice = conn.inflight.lock().remove(&id).ok_or_else(|| format!("response to unknown request {id}"))?;
        conn.room.notify_one();
        let refused =
            |reason: AccessError| TransferError::Refused { side: "peer", region: slice.remote_region, reason };
        match (status, data_len) {
            (Err(reason), _) => slice.batch.fail(slice.index, refused(reason)),
            (Ok(()), Some(n)) => {
                if n != slice.len || slice.op != Op::Read {
                    let why = format!("read response of {n} bytes for a {}-byte slice", slice.len);
                    self.retry_or_fail(slice, &why);
                    return Err(why);
                }
                if !slice.batch.begin_io(slice.index) {
                    // A late answer: the request already ended (timeout, cancel, another
                    // slice failed) and its buffer may be in use again. Drop the payload.
                    self.counters.late_responses.fetch_add(1, Ordering::Relaxed);
                    return r.discard_payload(n).map_err(|e| e.to_string());
                }
                // SAFETY: the local range was bounds-checked at submit (and checked
                // writable); the span keeps the memory mapped while we receive into it,
                // and begin_io keeps the request from being reported final meanwhile.
                let dst = unsafe { std::slice::from_raw_parts_mut(slice.local.ptr, n) };
                let got = r.read_payload(dst);
                slice.batch.end_io(slice.index);
                if let Err(e) = got {
                    let why = e.to_string();
                    self.retry_or_fail(slice, &why);
                    return Err(why);
                }
                conn.answered.fetch_add(n as u64, Ordering::Relaxed);
                slice.batch.slice_done(slice.index, n as u64);
            }
            (Ok(()), None) => {
                conn.answered.fetch_add(slice.len as u64, Ordering::Relaxed);
                slice.batch.slice_done(slice.index, slice.len as u64)
            }
        }
        Ok(())
    }

    /// What an earlier `query_region` learned about `region`, if anything.
    pub fn known_region(&self, region: u64) -> Option<RemoteRegionInfo> {
        self.regions.lock().get(&region).cloned()
    }

    /// Asks the peer about one region (synchronously, on a separate control connection).
    pub fn query_region(&self, region: u64) -> Result<RemoteRegionInfo, TransferError> {
        let mut guard = self.control.lock();
        if guard.is_none() {
            let mut last = TransferError::Connect("no endpoint".into());
            for &addr in &self.endpoints {
                match open(addr, self.key.as_ref(), &self.local_name, &self.cfg) {
                    Ok((s, _, keys)) => {
                        let r = FrameReader::new(BufReader::new(s.try_clone().map_err(TransferError::io)?), keys.recv);
                        *guard = Some((r, FrameWriter::new(s, keys.send)));
                        break;
                    }
                    Err(e) => last = e,
                }
            }
            if guard.is_none() {
                return Err(last);
            }
        }
        let Some((r, s)) = guard.as_mut() else { return Err(TransferError::Closed) };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let res = s
            .send(&encode(&Msg::QueryRegion { id, region }), &[])
            .map_err(ConnError::from)
            .and_then(|_| read_control(r))
            .and_then(|m| r.end_frame().map(|()| m));
        match res {
            Ok(Msg::RegionInfo { id: rid, status, len, readonly, shm }) if rid == id => match status {
                Ok(()) => {
                    let info = RemoteRegionInfo { len, readonly, shm };
                    self.regions.lock().insert(region, info.clone());
                    Ok(info)
                }
                Err(reason) => Err(TransferError::Refused { side: "peer", region, reason }),
            },
            Ok(other) => {
                *guard = None;
                Err(TransferError::Protocol(format!("unexpected reply {other:?}")))
            }
            Err(e) => {
                *guard = None;
                Err(TransferError::ConnectionLost(e.to_string()))
            }
        }
    }

    /// Closes every connection and joins the threads; queued requests fail as `Closed`.
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        // A redial under way finishes (bounded by its timeouts) before the connections
        // are taken; any later one sees `closed`.
        let _no_redial = self.redial_lock.lock();
        let conns: Vec<Arc<Conn>> = self.conns.lock().drain(..).collect();
        for c in &conns {
            self.kill(c, "closed");
        }
        self.drain_fail();
        self.work.notify_all();
        if let Some((_, s)) = self.control.lock().take() {
            let _ = s.get_ref().shutdown(Shutdown::Both);
        }
        let threads = std::mem::take(&mut *self.threads.lock());
        let me = std::thread::current().id();
        for t in threads {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}
