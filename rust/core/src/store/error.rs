//! Errors of the store and the block cache.

use crate::error::{Categorized, ErrorCategory};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{0}")]
    Invalid(String),
    #[error("store full: all {slots} slots are leased, pinned or being written")]
    Full { slots: usize },
    #[error("block {0:#x} is not in the store")]
    NotFound(u128),
    #[error("SSD tier I/O failed: {0}")]
    Io(String),
    /// The SSD tier file is held by another open store.
    #[error("SSD tier file locked: {0}")]
    Locked(String),
    /// The SSD tier file's header failed its checksum.
    #[error("SSD tier file corrupt: {0}")]
    Corrupt(String),
}

impl StoreError {
    pub(crate) fn io(what: &str, e: std::io::Error) -> Self {
        StoreError::Io(format!("{what}: {e}"))
    }
}

impl Categorized for StoreError {
    fn category(&self) -> ErrorCategory {
        match self {
            StoreError::Invalid(_) => ErrorCategory::InvalidArgument,
            StoreError::Full { .. } => ErrorCategory::StoreFull,
            StoreError::NotFound(_) => ErrorCategory::BlockNotFound,
            StoreError::Io(_) | StoreError::Locked(_) | StoreError::Corrupt(_) => ErrorCategory::StoreIo,
        }
    }
}
