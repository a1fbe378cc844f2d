//! The one extractor for block keys (128-bit block hashes) at the Python boundary.
//! Every glue entry point that takes several keys (index, conductor, store, block cache)
//! goes through [`keys_from_py`], so each accepts the same forms:
//!
//! - a `BlockHashes` (what `PrefixHasher.hash_blocks` returns, or a slice of it): shared,
//!   no copy and no Python int per key;
//! - a list (or any iterable) of ints, as before;
//! - a C-contiguous buffer of 16-byte little-endian keys: `n * 16` bytes, a 1-D buffer of
//!   16-byte items (numpy `V16` or a structured `(lo, hi)` u64 pair), or a 2-D buffer
//!   whose rows are 16 bytes (`(n, 16)` uint8, `(n, 2)` uint64, `(n, 4)` uint32: what
//!   `numpy.asarray(block_hashes)` and its views give back);
//! - a 1-D buffer of other integer items (an int64 array): one key per item, its value.

use std::ops::Deref;
use std::sync::Arc;

use mooncake_core::block_keys::{holds_raw_keys, keys_from_le_bytes};
use mooncake_core::BlockHash;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::block_hashes::PyBlockHashes;
use crate::convert::{hashes_from_py, BufferView};
use crate::errors::OrRaise;

pub use mooncake_core::block_keys::KEY_BYTES;

/// Keys as a caller passed them: shared with a `BlockHashes`, or converted.
pub enum Keys {
    Shared { data: Arc<Vec<BlockHash>>, start: usize, len: usize },
    Owned(Vec<BlockHash>),
}

impl Deref for Keys {
    type Target = [BlockHash];

    fn deref(&self) -> &[BlockHash] {
        match self {
            Keys::Shared { data, start, len } => &data[*start..*start + *len],
            Keys::Owned(v) => v,
        }
    }
}

impl Keys {
    /// The keys as one shared allocation (no copy when they already are one whole).
    pub fn into_shared(self) -> (Arc<Vec<BlockHash>>, usize, usize) {
        match self {
            Keys::Shared { data, start, len } => (data, start, len),
            Keys::Owned(v) => {
                let len = v.len();
                (Arc::new(v), 0, len)
            }
        }
    }
}

/// Keys from any of the forms in the module docs; `InvalidArgument` saying what to pass
/// otherwise (a negative or too large int, a ragged buffer, a float array).
pub fn keys_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Keys> {
    if let Ok(bh) = obj.cast::<PyBlockHashes>() {
        let b = bh.get();
        return Ok(Keys::Shared { data: b.data.clone(), start: b.start, len: b.len });
    }
    if obj.cast::<PyList>().is_ok() {
        return hashes_from_py(obj).map(Keys::Owned);
    }
    let py = obj.py();
    let flags = ffi::PyBUF_FORMAT | ffi::PyBUF_C_CONTIGUOUS;
    let view = match BufferView::get(obj, flags) {
        Ok(Some(v)) => v,
        // No buffer, or one that cannot be exported C-contiguous with a format (a numpy
        // object array of big ints, a strided view): read it as an iterable of ints, as
        // before key buffers existed (its items' errors say what is wrong).
        Ok(None) | Err(_) => return hashes_from_py(obj).map(Keys::Owned),
    };
    if !holds_raw_keys(&view.shape(), view.itemsize()).or_raise(py)? {
        // An int64 array of keys, say: one key per item, as before key buffers existed.
        drop(view);
        return hashes_from_py(obj).map(Keys::Owned);
    }
    keys_from_le_bytes(view.bytes()).map(Keys::Owned).or_raise(py)
}
