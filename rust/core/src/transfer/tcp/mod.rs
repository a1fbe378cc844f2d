//! The TCP transport: framed requests over one or more connections per peer.
//!
//! [`server`] serves this engine's regions (every request checked, payloads streamed
//! straight into or out of registered memory); [`client`] sends slices of requests to a
//! peer over several endpoints, retrying a failed connection's slices on another.
//! Both sides use blocking sockets with timeouts, one thread per direction.

mod admission;
mod answers;
pub mod client;
mod gmac_parts;
mod guard;
pub mod handshake;
mod overlap;
pub mod seal;
pub mod server;

use std::io::{self, Read};

use super::protocol::{self, FrameError, Header, Msg, HEADER_LEN, MAX_CONTROL};

/// What went wrong on a connection.
#[derive(Debug)]
pub enum ConnError {
    Io(io::Error),
    Frame(FrameError),
    /// The peer closed the connection cleanly between frames.
    Eof,
}

impl From<io::Error> for ConnError {
    fn from(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            ConnError::Eof
        } else {
            ConnError::Io(e)
        }
    }
}

impl From<FrameError> for ConnError {
    fn from(e: FrameError) -> Self {
        ConnError::Frame(e)
    }
}

impl std::fmt::Display for ConnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnError::Io(e) => write!(f, "{e}"),
            ConnError::Frame(e) => write!(f, "bad frame: {e}"),
            ConnError::Eof => f.write_str("connection closed by peer"),
        }
    }
}

/// Reads a header; `Ok(None)` when the read timed out before its first byte (idle).
pub fn read_header(r: &mut impl Read) -> Result<Option<Header>, ConnError> {
    let mut b = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut b[got..]) {
            Ok(0) if got == 0 => return Err(ConnError::Eof),
            Ok(0) => return Err(ConnError::Io(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if got == 0 && matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return Ok(None)
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Some(Header::decode(&b)?))
}

/// Reads the decodable part of a frame after its header (the whole body of a control
/// frame, the fixed part of a data frame).
pub fn read_msg_body(r: &mut impl Read, h: Header) -> Result<Msg, ConnError> {
    let n = protocol::decode_len(h);
    let mut buf = [0u8; MAX_CONTROL];
    let body = buf.get_mut(..n).ok_or(FrameError::Malformed)?;
    r.read_exact(body)?;
    Ok(protocol::decode_body(h, body)?)
}

/// Reads one control frame (blocking; a timeout is an error here).
pub fn read_control(r: &mut impl Read) -> Result<Msg, ConnError> {
    match read_header(r)? {
        Some(h) if h.kind.fixed_len().is_none() => read_msg_body(r, h),
        Some(_) => Err(ConnError::Frame(FrameError::Malformed)),
        None => Err(ConnError::Io(io::ErrorKind::TimedOut.into())),
    }
}
