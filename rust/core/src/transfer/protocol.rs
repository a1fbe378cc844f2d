//! Wire frames of the TCP transport.
//!
//! Every frame is an 8-byte header — magic `"MC"`, kind (u8), flags (u8, must be 0),
//! body length (u32 LE) — and a body. Control frames have small fixed limits; data
//! frames (`WriteReq`, `ReadResp`) carry at most [`MAX_DATA`] payload bytes after their
//! fixed part, so a receiver can stream the payload straight into registered memory.
//! Decoding never trusts a length it has not bounded; any violation is a
//! [`FrameError`], after which the connection is closed (only that one).

use super::AccessError;

pub const MAGIC: [u8; 2] = *b"MC";
/// 3: frames after a keyed handshake are sealed with AES-256-GCM (tcp/seal.rs), not BLAKE3-tagged.
/// 4: a sealed frame's payload is cut into records of at most `seal::RECORD` bytes, each tagged.
/// 5: the hello names the client's wire protection (1 encrypted, 2 integrity-only: BLAKE3
///    tags, payload in clear; 0 no token), and proofs and frame keys cover it.
/// 6: integrity-only records are tagged with GMAC (AES-256-GCM, no plaintext; tcp/guard.rs),
///    not keyed BLAKE3: an engine of version 5 would fail every tag, so it is told why instead.
pub const VERSION: u16 = 6;
pub const HEADER_LEN: usize = 8;
/// Largest payload of one data frame (slices are at most this long).
pub const MAX_DATA: usize = 16 << 20;
/// Largest body of a control frame.
pub const MAX_CONTROL: usize = 1024;
/// Longest name (engine name, shm segment name) on the wire.
pub const MAX_NAME: usize = 255;
pub const NONCE_LEN: usize = 32;
pub const MAC_LEN: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("bad magic")]
    BadMagic,
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("nonzero flags")]
    BadFlags,
    #[error("frame body of {len} bytes exceeds the limit of {limit}")]
    TooLong { len: usize, limit: usize },
    #[error("frame body truncated or malformed")]
    Malformed,
    #[error("bad status code {0}")]
    BadStatus(u8),
    #[error("frame tag does not match (forged, replayed or corrupted frame)")]
    BadTag,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Hello = 1,
    Challenge = 2,
    Proof = 3,
    Welcome = 4,
    Refused = 5,
    ReadReq = 10,
    WriteReq = 11,
    QueryRegion = 12,
    ReadResp = 20,
    WriteResp = 21,
    RegionInfo = 22,
}

impl Kind {
    fn from_u8(b: u8) -> Result<Kind, FrameError> {
        Ok(match b {
            1 => Kind::Hello,
            2 => Kind::Challenge,
            3 => Kind::Proof,
            4 => Kind::Welcome,
            5 => Kind::Refused,
            10 => Kind::ReadReq,
            11 => Kind::WriteReq,
            12 => Kind::QueryRegion,
            20 => Kind::ReadResp,
            21 => Kind::WriteResp,
            22 => Kind::RegionInfo,
            k => return Err(FrameError::UnknownKind(k)),
        })
    }

    /// Length of the fixed part that precedes a payload (data frames only).
    pub fn fixed_len(self) -> Option<usize> {
        match self {
            Kind::WriteReq => Some(24),
            Kind::ReadResp => Some(9),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub body_len: usize,
}

impl Header {
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, FrameError> {
        if b[0..2] != MAGIC {
            return Err(FrameError::BadMagic);
        }
        let kind = Kind::from_u8(b[2])?;
        if b[3] != 0 {
            return Err(FrameError::BadFlags);
        }
        let body_len = u32::from_le_bytes([b[4], b[5], b[6], b[7]]) as usize;
        let limit = match kind.fixed_len() {
            Some(fixed) => fixed + MAX_DATA,
            None => MAX_CONTROL,
        };
        if body_len > limit {
            return Err(FrameError::TooLong { len: body_len, limit });
        }
        if let Some(fixed) = kind.fixed_len() {
            if body_len < fixed {
                return Err(FrameError::Malformed);
            }
        }
        Ok(Header { kind, body_len })
    }

    pub fn encode(kind: Kind, body_len: usize) -> [u8; HEADER_LEN] {
        let l = (body_len as u32).to_le_bytes();
        [MAGIC[0], MAGIC[1], kind as u8, 0, l[0], l[1], l[2], l[3]]
    }
}

/// Outcome code carried by responses.
pub fn status_to_u8(s: Result<(), AccessError>) -> u8 {
    match s {
        Ok(()) => 0,
        Err(AccessError::NoSuchRegion) => 1,
        Err(AccessError::OutOfBounds) => 2,
        Err(AccessError::ReadOnly) => 3,
        Err(AccessError::TooLarge) => 4,
        Err(AccessError::NoGrant) => 5,
        Err(AccessError::OwnerRefused) => 6,
    }
}

pub fn status_from_u8(b: u8) -> Result<Result<(), AccessError>, FrameError> {
    Ok(match b {
        0 => Ok(()),
        1 => Err(AccessError::NoSuchRegion),
        2 => Err(AccessError::OutOfBounds),
        3 => Err(AccessError::ReadOnly),
        4 => Err(AccessError::TooLarge),
        5 => Err(AccessError::NoGrant),
        6 => Err(AccessError::OwnerRefused),
        b => return Err(FrameError::BadStatus(b)),
    })
}

/// A decoded frame. Data frames carry their payload length; the payload itself follows
/// the fixed part on the stream (or in `decode_frame`'s buffer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// `protection`: the client's [`WireProtection::code`](super::config::WireProtection::code),
    /// 0 without a token (absent on the wire from older versions: read as 0, so their
    /// hello still reaches the version check).
    Hello {
        version: u16,
        nonce: [u8; NONCE_LEN],
        name: String,
        protection: u8,
    },
    Challenge {
        version: u16,
        auth: bool,
        nonce: [u8; NONCE_LEN],
        host: [u8; 16],
        name: String,
    },
    Proof {
        mac: [u8; MAC_LEN],
    },
    Welcome {
        mac: [u8; MAC_LEN],
    },
    Refused {
        reason: String,
    },
    ReadReq {
        id: u64,
        region: u64,
        offset: u64,
        len: u64,
    },
    WriteReq {
        id: u64,
        region: u64,
        offset: u64,
        data_len: usize,
    },
    QueryRegion {
        id: u64,
        region: u64,
    },
    ReadResp {
        id: u64,
        status: Result<(), AccessError>,
        data_len: usize,
    },
    WriteResp {
        id: u64,
        status: Result<(), AccessError>,
    },
    RegionInfo {
        id: u64,
        status: Result<(), AccessError>,
        len: u64,
        readonly: bool,
        shm: Option<String>,
    },
}

struct Rd<'a>(&'a [u8]);

impl<'a> Rd<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if self.0.len() < n {
            return Err(FrameError::Malformed);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, FrameError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], FrameError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn bool(&mut self) -> Result<bool, FrameError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(FrameError::Malformed),
        }
    }
    fn name(&mut self) -> Result<String, FrameError> {
        let n = self.u8()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| FrameError::Malformed)
    }
    fn end(&self) -> Result<(), FrameError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(FrameError::Malformed)
        }
    }
}

/// Decodes a control frame body, or the fixed part of a data frame (`body` is then the
/// fixed part only; the payload length is `header.body_len - fixed`).
pub fn decode_body(h: Header, body: &[u8]) -> Result<Msg, FrameError> {
    let mut r = Rd(body);
    let payload = h.kind.fixed_len().map(|f| h.body_len - f).unwrap_or(0);
    let msg = match h.kind {
        Kind::Hello => Msg::Hello {
            version: r.u16()?,
            nonce: r.arr()?,
            name: r.name()?,
            protection: if r.0.is_empty() { 0 } else { r.u8()? },
        },
        Kind::Challenge => {
            Msg::Challenge { version: r.u16()?, auth: r.bool()?, nonce: r.arr()?, host: r.arr()?, name: r.name()? }
        }
        Kind::Proof => Msg::Proof { mac: r.arr()? },
        Kind::Welcome => Msg::Welcome { mac: r.arr()? },
        Kind::Refused => Msg::Refused { reason: r.name()? },
        Kind::ReadReq => Msg::ReadReq { id: r.u64()?, region: r.u64()?, offset: r.u64()?, len: r.u64()? },
        Kind::WriteReq => Msg::WriteReq { id: r.u64()?, region: r.u64()?, offset: r.u64()?, data_len: payload },
        Kind::QueryRegion => Msg::QueryRegion { id: r.u64()?, region: r.u64()? },
        Kind::ReadResp => {
            let id = r.u64()?;
            let status = status_from_u8(r.u8()?)?;
            if status.is_err() && payload != 0 {
                return Err(FrameError::Malformed);
            }
            Msg::ReadResp { id, status, data_len: payload }
        }
        Kind::WriteResp => Msg::WriteResp { id: r.u64()?, status: status_from_u8(r.u8()?)? },
        Kind::RegionInfo => {
            let id = r.u64()?;
            let status = status_from_u8(r.u8()?)?;
            let len = r.u64()?;
            let readonly = r.bool()?;
            let shm = match r.name()? {
                n if n.is_empty() => None,
                n => Some(n),
            };
            Msg::RegionInfo { id, status, len, readonly, shm }
        }
    };
    r.end()?;
    Ok(msg)
}

/// Length of the part of the body that [`decode_body`] needs.
pub fn decode_len(h: Header) -> usize {
    h.kind.fixed_len().unwrap_or(h.body_len)
}

fn put_name(out: &mut Vec<u8>, s: &str) {
    let b = s.as_bytes();
    let n = b.len().min(MAX_NAME);
    out.push(n as u8);
    out.extend_from_slice(&b[..n]);
}

/// Encodes a frame: header + body (for data frames, header + fixed part; the caller
/// sends the `data_len` payload bytes right after).
pub fn encode(msg: &Msg) -> Vec<u8> {
    let mut b = Vec::with_capacity(64);
    let (kind, payload) = match msg {
        Msg::Hello { version, nonce, name, protection } => {
            b.extend_from_slice(&version.to_le_bytes());
            b.extend_from_slice(nonce);
            put_name(&mut b, name);
            b.push(*protection);
            (Kind::Hello, 0)
        }
        Msg::Challenge { version, auth, nonce, host, name } => {
            b.extend_from_slice(&version.to_le_bytes());
            b.push(*auth as u8);
            b.extend_from_slice(nonce);
            b.extend_from_slice(host);
            put_name(&mut b, name);
            (Kind::Challenge, 0)
        }
        Msg::Proof { mac } => {
            b.extend_from_slice(mac);
            (Kind::Proof, 0)
        }
        Msg::Welcome { mac } => {
            b.extend_from_slice(mac);
            (Kind::Welcome, 0)
        }
        Msg::Refused { reason } => {
            put_name(&mut b, reason);
            (Kind::Refused, 0)
        }
        Msg::ReadReq { id, region, offset, len } => {
            for v in [id, region, offset, len] {
                b.extend_from_slice(&v.to_le_bytes());
            }
            (Kind::ReadReq, 0)
        }
        Msg::WriteReq { id, region, offset, data_len } => {
            for v in [id, region, offset] {
                b.extend_from_slice(&v.to_le_bytes());
            }
            (Kind::WriteReq, *data_len)
        }
        Msg::QueryRegion { id, region } => {
            b.extend_from_slice(&id.to_le_bytes());
            b.extend_from_slice(&region.to_le_bytes());
            (Kind::QueryRegion, 0)
        }
        Msg::ReadResp { id, status, data_len } => {
            b.extend_from_slice(&id.to_le_bytes());
            b.push(status_to_u8(*status));
            (Kind::ReadResp, *data_len)
        }
        Msg::WriteResp { id, status } => {
            b.extend_from_slice(&id.to_le_bytes());
            b.push(status_to_u8(*status));
            (Kind::WriteResp, 0)
        }
        Msg::RegionInfo { id, status, len, readonly, shm } => {
            b.extend_from_slice(&id.to_le_bytes());
            b.push(status_to_u8(*status));
            b.extend_from_slice(&len.to_le_bytes());
            b.push(*readonly as u8);
            put_name(&mut b, shm.as_deref().unwrap_or(""));
            (Kind::RegionInfo, 0)
        }
    };
    let mut out = Vec::with_capacity(HEADER_LEN + b.len());
    out.extend_from_slice(&Header::encode(kind, b.len() + payload));
    out.extend_from_slice(&b);
    out
}

/// Decodes one whole frame from the front of `buf`: the message, its payload (data
/// frames) and the bytes consumed. `Ok(None)` when `buf` holds only part of a frame.
/// A whole decoded frame: the message, its payload, and the bytes it took.
pub type Decoded<'a> = (Msg, &'a [u8], usize);

pub fn decode_frame(buf: &[u8]) -> Result<Option<Decoded<'_>>, FrameError> {
    let Some(hb) = buf.get(..HEADER_LEN) else { return Ok(None) };
    let mut arr = [0u8; HEADER_LEN];
    arr.copy_from_slice(hb);
    let h = Header::decode(&arr)?;
    let total = HEADER_LEN + h.body_len;
    let Some(body) = buf.get(HEADER_LEN..total) else { return Ok(None) };
    let fixed = decode_len(h);
    let msg = decode_body(h, &body[..fixed])?;
    Ok(Some((msg, &body[fixed..], total)))
}
