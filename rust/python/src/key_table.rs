//! Whole-list questions about string keys, answered in one call instead of a Python
//! step per key: what a store node asks of its object table (a dict of key -> object)
//! for a `batch_is_exist`, and the client's check that every key is a non-empty str.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

/// 1 for each key of `keys` that `table` holds, else 0 (a node's batch_is_exist): the
/// same answers as `[1 if k in table else 0 for k in keys]`, without a Python step a key.
#[pyfunction]
fn present_flags<'py>(
    py: Python<'py>,
    table: &Bound<'py, PyDict>,
    keys: &Bound<'py, PyList>,
) -> PyResult<Bound<'py, PyList>> {
    let flags = keys.iter().map(|k| table.contains(k).map(u8::from)).collect::<PyResult<Vec<u8>>>()?;
    PyList::new(py, flags)
}

/// True when every item of `keys` is a non-empty str (the caller then skips its per-key
/// check; on False it runs that check to raise the error that names the bad key).
#[pyfunction]
fn all_nonempty_str(keys: &Bound<'_, PyList>) -> bool {
    keys.iter().all(|k| k.is_instance_of::<PyString>() && k.len().is_ok_and(|n| n > 0))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(present_flags, m)?)?;
    m.add_function(wrap_pyfunction!(all_nonempty_str, m)?)?;
    Ok(())
}
