//! Block keys for the store's batch calls: a list of Python ints, or any buffer of
//! 16-byte little-endian keys (a `(n, 16)` uint8 numpy array, `n * 16` bytes, or a
//! `BlockHashes` buffer), read without building a Python int per key.

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
    // Bytes (itemsize 1) or one 16-byte item per key; an int64 array of small keys
    // would silently read as half as many wrong keys, so it is refused.
    let item = view.itemsize();
    if item != 1 && item != KEY_BYTES {
        return Err(invalid(
            obj.py(),
            format!(
                "a key buffer holds 16-byte little-endian keys (uint8 of shape (n, 16), or bytes); got items of \
                 {item} bytes (format {:?}): pass a list of ints instead",
                view.format()
            ),
        ));
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
