//! The one pattern for calling into the core from Python: arguments are already owned
//! Rust values, the GIL is released for the call, and the core's error is mapped to the
//! exception tree. Every call that can block or take long goes through here.

use mooncake_core::Categorized;
use pyo3::prelude::*;

/// Runs `f` with the GIL released and maps its error.
pub fn detached<T, E, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    F: FnOnce() -> Result<T, E> + Send,
    T: Send,
    E: Categorized + Send,
{
    py.detach(f).map_err(|e| crate::errors::to_pyerr(py, &e))
}

/// Calls below this many items are cheaper to run with the GIL held than to release it.
pub const DETACH_THRESHOLD: usize = 256;
