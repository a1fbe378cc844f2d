//! Transfer engine: batch transfers between registered memory of engines.
//!
//! An [`Engine`] owns a table of registered [`Region`]s and serves them to peers. A
//! batch of [`Request`]s (read = pull remote bytes into local memory, write = push local
//! bytes to the remote) is submitted at once and completes request by request; each
//! request ends with a [`RequestStatus`]. Paths, picked per peer:
//! - [`local`]: the peer is this engine or another engine of this process (memcpy);
//! - [`shm`]: the peer is on this host and the remote region is shared memory (the
//!   initiator maps the peer's segment by name and copies once);
//! - [`tcp`]: anything else; several endpoints per peer, requests cut into slices.
//!
//! Every remote request is checked by the serving side ([`region::RegionTable`]);
//! frames ([`protocol`]) have size limits; peers authenticate ([`auth`]).

pub mod auth;
pub mod batch;
pub mod completion;
pub mod config;
mod dispatch;
pub mod engine;
pub mod fdpass;
mod inner;
pub mod landing;
pub mod landing_table;
pub mod local;
pub mod objects;
pub mod protocol;
pub mod region;
pub mod registry;
pub mod shm;
pub mod staged;
mod staged_direct;
mod staged_ring;
pub mod staged_server;
pub mod stream_copy;
pub mod tcp;

use std::fmt;

use crate::args::{same_len, ArgumentError};
use crate::error::{Categorized, ErrorCategory};

pub use batch::{Batch, RequestStatus};
pub use completion::{monotonic_ns, Completion, CompletionQueue};
pub use engine::{Engine, EngineConfig, EngineStats, Peer, Transports, WireProtection};
pub use objects::{ObjectBatch, RemoteObject};
pub use region::{Access, Grant, Region, RegionId, RegionOwner};
pub use registry::EngineRegistry;

/// Direction of one request, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Pull remote bytes into local memory.
    Read,
    /// Push local bytes to the remote.
    Write,
}

impl Op {
    pub fn parse(s: &str) -> Result<Op, TransferError> {
        match s {
            "read" => Ok(Op::Read),
            "write" => Ok(Op::Write),
            other => Err(TransferError::InvalidRequest(format!("op must be \"read\" or \"write\", got {other:?}"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
        }
    }
}

/// One transfer of a batch.
#[derive(Debug, Clone)]
pub struct Request {
    pub op: Op,
    /// A region of the initiating engine.
    pub local: RegionId,
    pub local_offset: u64,
    pub peer: std::sync::Arc<Peer>,
    /// A region id of the peer (as the peer named it).
    pub remote_region: RegionId,
    pub remote_offset: u64,
    pub length: u64,
}

impl Request {
    /// One request per pair of `local_offsets[i]` and `remote_offsets[i]`, each a copy of
    /// `template` (op, regions, peer, length) at those offsets: a KV connector's
    /// per-layer batch between one local and one remote region. The two lists must
    /// have one entry each per request.
    pub fn spans(
        template: &Request,
        local_offsets: &[u64],
        remote_offsets: &[u64],
    ) -> Result<Vec<Request>, ArgumentError> {
        same_len("local_offsets", local_offsets.len(), "remote_offsets", remote_offsets.len())?;
        let at =
            |(&local_offset, &remote_offset): (&u64, &u64)| Request { local_offset, remote_offset, ..template.clone() };
        Ok(local_offsets.iter().zip(remote_offsets).map(at).collect())
    }
}

/// Why a remote region access was refused (the serving side's verdict, also on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessError {
    NoSuchRegion,
    OutOfBounds,
    ReadOnly,
    TooLarge,
    /// The region is restricted and no live grant of the asking peer covers the access.
    NoGrant,
    /// The write landed, and the region's owner refused what it completed (`landing.rs`).
    OwnerRefused,
}

impl AccessError {
    pub fn code(self) -> &'static str {
        match self {
            AccessError::NoSuchRegion => "no_such_region",
            AccessError::OutOfBounds => "out_of_bounds",
            AccessError::ReadOnly => "read_only",
            AccessError::TooLarge => "too_large",
            AccessError::NoGrant => "no_grant",
            AccessError::OwnerRefused => "refused_by_owner",
        }
    }
}

impl fmt::Display for AccessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AccessError::NoSuchRegion => "no such region",
            AccessError::OutOfBounds => "range outside the region",
            AccessError::ReadOnly => "region is read-only",
            AccessError::TooLarge => "request larger than the frame limit",
            AccessError::NoGrant => {
                "no live grant covers this access: the region is restricted, so its owner must first call \
                 grant(region, peer=<the initiating engine's name>, offset, length, write=...) for this range \
                 (or the grant was revoked or expired)"
            }
            AccessError::OwnerRefused => {
                "the write landed, but the region's owner refused what it completed (for a store node: the \
                 reservation it was written for had ended, or the object could not be published)"
            }
        })
    }
}

/// Errors of the transfer engine: request statuses and API failures.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum TransferError {
    /// Malformed request or argument (caller's fault; nothing was moved).
    #[error("invalid transfer request: {0}")]
    InvalidRequest(String),
    /// The serving side (or the local table) refused the access.
    #[error("refused by {side}: region {region}: {reason}")]
    Refused { side: &'static str, region: RegionId, reason: AccessError },
    /// Authentication failed (wrong or missing token).
    #[error("authentication failed: {0}")]
    Unauthorized(String),
    /// The connection to the peer failed on every path.
    #[error("connection to peer lost: {0}")]
    ConnectionLost(String),
    /// Could not reach the peer.
    #[error("cannot connect to {0}")]
    Connect(String),
    /// The peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The batch deadline passed before the request finished.
    #[error("transfer timed out")]
    Timeout,
    /// The batch was cancelled before the request finished.
    #[error("transfer cancelled")]
    Cancelled,
    /// The engine was closed.
    #[error("engine closed")]
    Closed,
    /// Local resources (memory mapping, sockets) failed.
    #[error("I/O error: {0}")]
    Io(String),
}

impl TransferError {
    /// A short stable code for statuses (`"out_of_bounds"`, `"timeout"`, ...).
    pub fn code(&self) -> &'static str {
        match self {
            TransferError::InvalidRequest(_) => "invalid_request",
            TransferError::Refused { reason, .. } => reason.code(),
            TransferError::Unauthorized(_) => "unauthorized",
            TransferError::ConnectionLost(_) => "connection_lost",
            TransferError::Connect(_) => "connect_failed",
            TransferError::Protocol(_) => "protocol",
            TransferError::Timeout => "timeout",
            TransferError::Cancelled => "cancelled",
            TransferError::Closed => "closed",
            TransferError::Io(_) => "io",
        }
    }

    pub(crate) fn io(e: std::io::Error) -> Self {
        TransferError::Io(e.to_string())
    }
}

impl Categorized for TransferError {
    fn category(&self) -> ErrorCategory {
        match self {
            TransferError::InvalidRequest(_) => ErrorCategory::InvalidArgument,
            TransferError::Timeout => ErrorCategory::TransferTimeout,
            _ => ErrorCategory::TransferFailed,
        }
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_adversarial;
#[cfg(test)]
mod tests_completion;
#[cfg(test)]
mod tests_integrity;
#[cfg(test)]
mod tests_landing;
#[cfg(test)]
mod tests_objects;
#[cfg(test)]
mod tests_redial;
#[cfg(test)]
mod tests_rights;
#[cfg(test)]
mod tests_sealed;
#[cfg(test)]
mod tests_staged;
#[cfg(test)]
mod tests_staged_direct;
#[cfg(test)]
mod tests_staged_pipeline;
