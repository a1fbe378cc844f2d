//! Interop wire helpers (core `interop`): token ids of KV events decoded without Python
//! ints; medium names.

use std::cell::RefCell;

use mooncake_core::interop::{canonical_medium as core_canonical_medium, decode_u32_array};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::convert::BufferView;
use crate::errors::OrRaise;

thread_local! {
    static SCRATCH: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// The msgpack array of token ids in `raw` (bytes, or a msgspec `Raw`) as packed
/// little-endian u32 bytes (view it with `memoryview(b).cast("I")` to hash it in place).
#[pyfunction]
fn msgpack_tokens<'py>(py: Python<'py>, raw: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let view = BufferView::get_contiguous(raw, "raw")?;
    SCRATCH.with(|s| {
        let mut toks = s.borrow_mut();
        decode_u32_array(view.bytes(), &mut toks).or_raise(py)?;
        PyBytes::new_with(py, toks.len() * 4, |buf| {
            for (dst, t) in buf.chunks_exact_mut(4).zip(toks.iter()) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            Ok(())
        })
    })
}

/// The upper-case medium name (`None`: the engine's device cache, `"GPU"`); aliases of
/// GPU, CPU and DISK to those, other names kept upper-cased.
#[pyfunction]
#[pyo3(signature = (medium))]
fn canonical_medium(medium: Option<&str>) -> String {
    core_canonical_medium(medium)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(msgpack_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(canonical_medium, m)?)
}
