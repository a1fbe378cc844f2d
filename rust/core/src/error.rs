//! Error categories shared by every module.
//!
//! Each core module has its own error enum (`HashError`, `IndexError`, ...). Each enum
//! implements [`Categorized`], which names the category the Python glue maps to an
//! exception class (`InvalidArgument`, `StoreFull`, ...). Keeping the mapping to one
//! small enum means the glue has a single `match` for all modules.

use std::fmt;

/// The kind of failure, independent of the module that raised it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCategory {
    /// The caller passed something malformed or out of range; nothing changed.
    InvalidArgument,
    /// A store has no slot it may use (every slot leased or pinned).
    StoreFull,
    /// A requested block is not present.
    BlockNotFound,
    /// Disk I/O failed (SSD tier).
    StoreIo,
    /// A transfer failed (peer refused, bounds, connection lost, ...).
    TransferFailed,
    /// A transfer did not finish within its deadline.
    TransferTimeout,
    /// The conductor rejected a request because an SLO cannot be met.
    Overloaded,
    /// An invariant was broken: a bug in mooncake_rs, never the caller's fault.
    Internal,
    /// A KV event payload (vLLM/SGLang wire format) that does not decode; a kind of
    /// `InvalidArgument` (the Python class subclasses it).
    MalformedEvent,
    /// A peer failed authentication, or a sealed record failed its integrity check
    /// (tampered, replayed, reordered, or from another session).
    Unauthorized,
}

impl ErrorCategory {
    /// Stable name, used in messages and by the glue.
    pub fn name(self) -> &'static str {
        match self {
            ErrorCategory::InvalidArgument => "InvalidArgument",
            ErrorCategory::StoreFull => "StoreFull",
            ErrorCategory::BlockNotFound => "BlockNotFound",
            ErrorCategory::StoreIo => "StoreIOError",
            ErrorCategory::TransferFailed => "TransferFailed",
            ErrorCategory::TransferTimeout => "TransferTimeout",
            ErrorCategory::Overloaded => "Overloaded",
            ErrorCategory::Internal => "InternalError",
            ErrorCategory::MalformedEvent => "MalformedEvent",
            ErrorCategory::Unauthorized => "Unauthorized",
        }
    }
}

impl fmt::Display for ErrorCategory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Implemented by every module's error enum.
pub trait Categorized: std::error::Error {
    fn category(&self) -> ErrorCategory;
}
