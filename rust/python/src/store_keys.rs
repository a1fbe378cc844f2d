//! Block keys for the store's batch calls: a list of Python ints, or any buffer of
//! 16-byte little-endian keys (a `(n, 16)` uint8 numpy array, `n * 16` bytes, or a
//! `BlockHashes` buffer), read without building a Python int per key. A buffer of other
//! items (an int64 array) is read as int values, one key each.

use mooncake_core::BlockHash;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::convert::{hashes_from_py, BufferView};
use crate::errors::invalid;

/// Bytes of one key in a key buffer.
pub const KEY_BYTES: usize = 16;

/// Keys from a list/iterable of ints or from a buffer of 16-byte little-endian keys.
pub fn keys_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Vec<BlockHash>> {
    if obj.cast::<PyList>().is_ok() {
        return hashes_from_py(obj);
    }
    let flags = ffi::PyBUF_FORMAT | ffi::PyBUF_C_CONTIGUOUS;
    let view = match BufferView::get(obj, flags) {
        Ok(Some(v)) => v,
        Ok(None) => return hashes_from_py(obj),
        Err(e) => return Err(invalid(obj.py(), format!("keys must be a list of ints or a C-contiguous buffer of 16-byte keys ({e})"))),
    };
    // Bytes (itemsize 1) or one 16-byte item per key are raw keys. Any other item size
    // (an int64 array of keys, say) is a sequence of int values, as before key buffers.
    let item = view.itemsize();
    if item != 1 && item != KEY_BYTES {
        drop(view);
        return hashes_from_py(obj);
    }
    let bytes = view.bytes();
    if bytes.len() % KEY_BYTES != 0 {
        return Err(invalid(obj.py(), format!("a key buffer of {} bytes is not a whole number of 16-byte keys", bytes.len())));
    }
    Ok(bytes
        .chunks_exact(KEY_BYTES)
        .map(|c| {
            let mut a = [0u8; KEY_BYTES];
            a.copy_from_slice(c);
            u128::from_le_bytes(a)
        })
        .collect())
}
