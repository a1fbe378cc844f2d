//! Engine configuration (validated) and counters.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use parking_lot::Mutex;

use super::TransferError;

/// Which paths an engine may use (as initiator) and offer (as server).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transports {
    pub local: bool,
    pub shm: bool,
    pub tcp: bool,
}

impl Default for Transports {
    fn default() -> Self {
        Transports { local: true, shm: true, tcp: true }
    }
}

impl Transports {
    pub fn parse<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Transports, TransferError> {
        let mut t = Transports { local: false, shm: false, tcp: false };
        for n in names {
            match n {
                "local" => t.local = true,
                "shm" => t.shm = true,
                "tcp" => t.tcp = true,
                other => {
                    return Err(TransferError::InvalidRequest(format!(
                        "unknown transport {other:?}; use \"local\", \"shm\" or \"tcp\""
                    )))
                }
            }
        }
        Ok(t)
    }
}

/// How the TCP data path of an authenticated session protects its frames (both ends
/// must say the same: the handshake refuses a mismatch, and binds the choice into its
/// proofs and frame keys, so a relay cannot rewrite it either).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WireProtection {
    /// Every frame encrypted and authenticated (AES-256-GCM): a network observer sees
    /// no KV byte. The default with a token.
    #[default]
    Encrypted,
    /// Every frame authenticated (GMAC tags under the session's per-direction keys, the
    /// record's sequence number as nonce: tcp/guard.rs) but sent in clear: forged,
    /// altered, replayed, reordered or dropped frames are still refused, but KV bytes
    /// (and region ids, offsets) are readable on the wire. It skips the sender's copy
    /// into an encryption buffer and the receiver's decryption pass (BENCHMARKS.md,
    /// "Issue 26, authenticated TCP like for like").
    Integrity,
}

impl WireProtection {
    pub fn parse(s: &str) -> Result<WireProtection, TransferError> {
        match s {
            "encrypted" => Ok(WireProtection::Encrypted),
            "integrity" => Ok(WireProtection::Integrity),
            other => Err(TransferError::InvalidRequest(format!(
                "unknown wire_protection {other:?}; use \"encrypted\" (the default) or \"integrity\""
            ))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            WireProtection::Encrypted => "encrypted",
            WireProtection::Integrity => "integrity",
        }
    }

    /// Its code in the handshake's hello (0 there means: no token).
    pub fn code(self) -> u8 {
        match self {
            WireProtection::Encrypted => 1,
            WireProtection::Integrity => 2,
        }
    }
}

/// How a same-host peer's restricted regions are reached (the staged path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StagedCopy {
    /// One copy, by the region's server, between the region and the initiator's own buffer
    /// (`process_vm_readv` / `process_vm_writev`), where the kernel allows it (else, per
    /// connection, `Staging`).
    Direct,
    /// Two copies through a staging buffer the server hands over.
    Staging,
}

/// The environment variable that picks the default [`StagedCopy`]: `staging` forces the
/// staging buffer; unset (or `direct`) asks for one copy.
pub const STAGED_COPY_ENV: &str = "MOONCAKE_STAGED_COPY";

impl StagedCopy {
    /// The default: [`STAGED_COPY_ENV`], else `Direct`. An unknown value is said (once per
    /// engine config) and read as `Direct`.
    pub fn from_env() -> StagedCopy {
        match std::env::var(STAGED_COPY_ENV).as_deref() {
            Ok("staging") => StagedCopy::Staging,
            Ok("direct") | Ok("") | Err(_) => StagedCopy::Direct,
            Ok(other) => {
                tracing::warn!(value = other, "{STAGED_COPY_ENV} takes \"direct\" or \"staging\"; using direct");
                StagedCopy::Direct
            }
        }
    }
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub name: String,
    /// Addresses to listen on (`host:port`, port 0 = any); one endpoint each.
    pub listen: Vec<String>,
    pub auth_token: Option<String>,
    /// Per-peer tokens (engine name -> token) this engine's server accepts: a client
    /// announcing one of these names must prove that name's token, not `auth_token`, so
    /// a holder of the shared token cannot pass for it (and claim its grants). Names not
    /// listed authenticate with `auth_token`. Needs `auth_token`.
    pub peer_tokens: Vec<(String, String)>,
    /// How frames of token sessions are protected on the TCP data path (`None`:
    /// [`WireProtection::Encrypted`]). Needs `auth_token`.
    pub wire_protection: Option<WireProtection>,
    pub transports: Transports,
    /// TCP requests are cut into slices of at most this many bytes.
    pub slice_size: usize,
    pub connect_timeout: Duration,
    /// A peer that neither reads nor answers for this long is declared dead.
    pub io_timeout: Duration,
    /// Without a token, a served connection that waits this long for its next request is
    /// closed (its client reconnects when it needs it again): idle connections of peers
    /// nobody authenticated must not pile up. Authenticated ones may idle; both kinds are
    /// evicted oldest-idle-first when the server or one peer address is at its cap.
    pub idle_timeout: Duration,
    /// TCP connections to each endpoint of a peer; 0 (the default): automatic, see
    /// [`EngineConfig::connections`].
    pub connections_per_endpoint: usize,
    /// Slices a connection may have unanswered. 64 (it was 16): a batch of 32 or 64
    /// slices then goes out without the sender waiting for room, one wake-up per
    /// response less; for 64 KiB reads that halved the context switches per GB
    /// (BENCHMARKS.md, issue 26). The peer's socket buffers bound what is really in flight.
    pub window: usize,
    /// Unanswered bytes per connection before its sender leaves the next slice to
    /// another connection of the peer (see `ClientConfig::window_bytes`). 4 MiB: a few
    /// slices in flight on each connection keep the peer's socket buffers full.
    pub window_bytes: usize,
    pub max_attempts: u32,
    pub copy_threads: usize,
    /// A TCP batch of at most this many bytes is sent by the submitting thread itself
    /// when a connection to the peer is idle (0: always through the sender threads).
    pub inline_send_bytes: usize,
    /// How restricted regions of same-host peers are reached (default: [`STAGED_COPY_ENV`]).
    pub staged_copy: StagedCopy,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            name: String::new(),
            listen: vec!["127.0.0.1:0".into()],
            auth_token: None,
            peer_tokens: Vec::new(),
            wire_protection: None,
            transports: Transports::default(),
            slice_size: 1 << 20,
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            connections_per_endpoint: 0,
            window: 64,
            window_bytes: 4 << 20,
            max_attempts: 3,
            copy_threads: 2,
            inline_send_bytes: 16 << 10,
            staged_copy: StagedCopy::from_env(),
        }
    }
}

impl EngineConfig {
    /// The connections opened to each endpoint of a peer: `connections_per_endpoint`, or
    /// when it is 0, [`plain_connections`] without a token and [`sealed_connections`]
    /// with one.
    pub fn connections(&self) -> usize {
        match self.connections_per_endpoint {
            0 if self.auth_token.is_some() => sealed_connections(available_cores()),
            0 => plain_connections(available_cores()),
            n => n,
        }
    }

    pub fn validate(&self) -> Result<(), TransferError> {
        let bad = |m: String| Err(TransferError::InvalidRequest(m));
        if self.name.is_empty() || self.name.len() > super::protocol::MAX_NAME {
            return bad(format!("engine name must be 1..=255 bytes, got {:?}", self.name));
        }
        if self.slice_size == 0 || self.slice_size > super::protocol::MAX_DATA {
            return bad(format!("slice_size must be in 1..={}, got {}", super::protocol::MAX_DATA, self.slice_size));
        }
        if self.io_timeout.is_zero() || self.connect_timeout.is_zero() || self.idle_timeout.is_zero() {
            return bad("timeouts must be positive".into());
        }
        if self.connections_per_endpoint > 64 || self.window == 0 || self.window_bytes == 0 || self.max_attempts == 0 {
            return bad(
                "connections_per_endpoint must be 1..=64 (0: automatic), window, window_bytes and max_attempts \
                        >= 1"
                    .into(),
            );
        }
        if self.inline_send_bytes > 1 << 20 {
            return bad(format!("inline_send_bytes must be at most 1 MiB, got {}", self.inline_send_bytes));
        }
        if self.auth_token.as_deref() == Some("") {
            return bad("auth_token must not be empty (use None for no authentication)".into());
        }
        if !self.peer_tokens.is_empty() && self.auth_token.is_none() {
            return bad(
                "peer_tokens needs auth_token too (otherwise peers not listed would be served unauthenticated)".into(),
            );
        }
        if let (Some(p), None) = (self.wire_protection, &self.auth_token) {
            return bad(format!(
                "wire_protection={:?} protects the frames of token sessions: set auth_token too (without one, frames carry no protection)",
                p.as_str()
            ));
        }
        for (n, t) in &self.peer_tokens {
            if n.is_empty() || t.is_empty() {
                return bad(format!("peer_tokens: name and token must not be empty (got {n:?})"));
            }
        }
        Ok(())
    }
}

/// Connections per endpoint for sealed (token) sessions on a host with `cores` cores.
///
/// A sealed connection's throughput is bound by one thread per side: the server's
/// thread opens each record of a write and seals each record of a read response, the
/// client's sender seals, and each of them also does the socket copy. Measured at 512 KiB
/// requests that is ~0.4 CPU-s per GB per side (AES-256-GCM plus the copies: ~2.5 GB/s a
/// connection), while a plain socket stream moves 6 GB/s and more on loopback
/// (BENCHMARKS.md, "The cost of security, third pass"). Several connections put that
/// work on several threads on both sides, with the same frames (no new code path to
/// trust). Each sealed connection keeps about two cores busy at full speed (its sender
/// and the server's thread), so: half the cores, at most 4 (beyond that, the loopback
/// copies and the memory bandwidth bound the stream anyway), at least 1. Without a token
/// a connection is not CPU-bound that way; see [`plain_connections`].
pub fn sealed_connections(cores: usize) -> usize {
    (cores / 2).clamp(1, 4)
}

/// Connections per endpoint without a token on a host with `cores` cores: two where
/// there are two cores or more.
///
/// One plaintext connection is not bound by its CPU but by its own flow: with the
/// kernel's paced congestion control (BBR, the default of many distributions and of the
/// hosts measured here) a single TCP flow that sends batches with pauses between them
/// runs at its pacing rate, not at the copy rate. Measured between two network-namespace
/// hosts (BENCHMARKS.md, "k24v: remote 512 KiB"): a plain socket stream of 32 x 512 KiB
/// ran 1.8-2.0x faster with `cubic` (unpaced) than with `bbr`, and a median 1.6-1.7x
/// faster over two `bbr` connections than over one; this engine's 32 x 512 KiB batches
/// 1.38x (writes) and 1.64x (reads). Two connections also put a batch's socket copies on
/// two threads per side. Four were measured and not kept (BENCHMARKS.md).
pub fn plain_connections(cores: usize) -> usize {
    cores.clamp(1, 2)
}

fn available_cores() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// Counters of one engine (serving and initiating sides).
#[derive(Debug, Default)]
pub struct Counters {
    pub auth_failures: AtomicU64,
    pub bad_frames: AtomicU64,
    pub refused: AtomicU64,
    /// Refusals (also counted in `refused`) because no live grant covered the access.
    pub grant_refusals: AtomicU64,
    pub connections: AtomicU64,
    pub bytes_served: AtomicU64,
    /// Of `bytes_served`: bytes a same-host peer committed through its staging buffer
    /// into a restricted region (`staged_server`).
    pub bytes_staged: AtomicU64,
    /// Of `bytes_served`: bytes copied out of a restricted region into a same-host peer's
    /// staging buffer for its read (`staged_server`).
    pub bytes_staged_read: AtomicU64,
    /// Initiator side: peers redialed by the engine after every connection to them was
    /// lost (`TcpPeer::redial`).
    pub reconnects: AtomicU64,
    pub retries: AtomicU64,
    /// Answers that arrived after their request had ended (payload dropped, unread).
    pub late_responses: AtomicU64,
    /// Handshakes cut short to make room for a new connection (all slots were taken).
    pub handshakes_evicted: AtomicU64,
    /// Served connections closed to make room (oldest idle first) or after idling past
    /// `idle_timeout` without a token.
    pub idle_evicted: AtomicU64,
    // Initiator side, counted by the batches themselves as they end.
    /// Batches submitted / batches whose every request ended.
    pub batches: AtomicU64,
    pub batches_done: AtomicU64,
    /// Bytes moved by write / read requests that ended `Done`.
    pub bytes_written: AtomicU64,
    pub bytes_read: AtomicU64,
    /// Requests that ended failed (any cause: refused, lost, timeout, cancelled, closed).
    pub requests_failed: AtomicU64,
    /// Wall time with at least one batch of this engine in flight.
    pub busy: Mutex<Busy>,
}

impl Counters {
    /// Counts one refused remote access (and, apart, the ones no grant covered).
    pub fn count_refusal(&self, e: super::AccessError) {
        self.refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if e == super::AccessError::NoGrant {
            self.grant_refusals.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// The union of the in-flight intervals of an engine's batches, kept incrementally: a
/// batch opens an interval when none is open, the last one to end closes it. Times are
/// taken before the lock, so they can arrive out of order (a batch stamped at its submit
/// may take the lock after another batch ended later): an interval never starts before
/// the latest end already counted, and closes at the latest end seen, so no stretch of
/// time is counted twice (a CI run read more busy time than the batches' span).
#[derive(Debug, Default)]
pub struct Busy {
    inflight: u64,
    since_ns: u64,
    busy_ns: u64,
    latest_end_ns: u64,
}

impl Busy {
    pub fn begin(&mut self, now_ns: u64) {
        if self.inflight == 0 {
            self.since_ns = now_ns.max(self.latest_end_ns);
        }
        self.inflight += 1;
    }

    pub fn end(&mut self, end_ns: u64) {
        self.latest_end_ns = self.latest_end_ns.max(end_ns);
        self.inflight = self.inflight.saturating_sub(1);
        if self.inflight == 0 {
            self.busy_ns += self.latest_end_ns.saturating_sub(self.since_ns);
        }
    }

    /// Busy nanoseconds so far (an open interval counts up to `now_ns`) and batches in flight.
    pub fn read(&self, now_ns: u64) -> (u64, u64) {
        let open = if self.inflight > 0 { now_ns.saturating_sub(self.since_ns) } else { 0 };
        (self.busy_ns + open, self.inflight)
    }
}

/// A snapshot of [`Counters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineStats {
    pub auth_failures: u64,
    pub bad_frames: u64,
    pub refused: u64,
    pub grant_refusals: u64,
    pub connections: u64,
    pub bytes_served: u64,
    pub bytes_staged: u64,
    pub bytes_staged_read: u64,
    pub reconnects: u64,
    pub retries: u64,
    pub late_responses: u64,
    pub handshakes_evicted: u64,
    pub idle_evicted: u64,
    pub regions: u64,
    pub batches: u64,
    pub batches_done: u64,
    pub batches_in_flight: u64,
    pub bytes_written: u64,
    pub bytes_read: u64,
    pub requests_failed: u64,
    /// Wall time with at least one batch in flight (ns).
    pub busy_ns: u64,
}
