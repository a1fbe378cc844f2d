//! Core errors → the Python exception tree defined in `mooncake_rs/errors.py`.
//!
//! The classes live in Python (so `InvalidArgument` can also subclass `ValueError`);
//! the glue looks each one up by its category name once and caches it.

use mooncake_core::{Categorized, ErrorCategory};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

static ERRORS_MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn errors_module(py: Python<'_>) -> PyResult<&Py<PyModule>> {
    ERRORS_MODULE.get_or_try_init(py, || -> PyResult<_> { Ok(py.import("mooncake_rs.errors")?.unbind()) })
}

/// Looks the exception classes up while `_core` is being imported, when no lock of ours
/// is held. A `PyOnceLock` releases the GIL while its first initialisation runs; done
/// lazily, that would happen at the first error of the process, possibly inside a lock
/// (a thread that then takes the GIL and waits for that lock deadlocks both). Glue code
/// still builds errors only after dropping its locks; this keeps the rule from hinging
/// on that alone. A failure here is not fatal: `class` retries at the first error.
pub fn init(py: Python<'_>) {
    let _ = errors_module(py);
}

fn class(py: Python<'_>, category: ErrorCategory) -> PyResult<Bound<'_, PyType>> {
    Ok(errors_module(py)?.bind(py).getattr(category.name())?.cast_into::<PyType>()?)
}

/// A Python exception of the class that matches `category`, with `message`.
pub fn new_err(py: Python<'_>, category: ErrorCategory, message: impl Into<String>) -> PyErr {
    let message = message.into();
    match class(py, category) {
        Ok(cls) => PyErr::from_type(cls, message),
        // The errors module failed to import: still raise, with the category in the text.
        Err(_) => PyRuntimeError::new_err(format!("{category}: {message}")),
    }
}

/// Converts any core error.
pub fn to_pyerr<E: Categorized + ?Sized>(py: Python<'_>, e: &E) -> PyErr {
    new_err(py, e.category(), e.to_string())
}

/// How a core error becomes a Python exception. Every core error type is one of the
/// exception classes of its category with its message (the list below); the
/// conductor's `Overloaded` also carries its reason and estimates (`conductor.rs`
/// implements this trait for `ConductorError`).
pub trait IntoPyErr {
    fn into_pyerr(self, py: Python<'_>) -> PyErr;
}

macro_rules! by_category {
    ($($t:ty),* $(,)?) => {$(
        impl IntoPyErr for $t {
            fn into_pyerr(self, py: Python<'_>) -> PyErr {
                to_pyerr(py, &self)
            }
        }
    )*};
}

by_category!(
    mooncake_core::args::ArgumentError,
    mooncake_core::token_array::TokenOutOfRange,
    mooncake_core::interop::EventError,
    mooncake_core::interop::IngestError,
    mooncake_core::interop::WireError,
    mooncake_core::interop::MapError,
    mooncake_core::store::StoreError,
    mooncake_core::index::IndexError,
    mooncake_core::transfer::TransferError,
    mooncake_core::seal::SealError,
    mooncake_core::hash::HashError,
);

/// The one conversion of a core call's result: `r.or_raise(py)?` raises the exception
/// [`IntoPyErr`] makes of the error.
pub trait OrRaise<T> {
    fn or_raise(self, py: Python<'_>) -> PyResult<T>;
}

impl<T, E: IntoPyErr> OrRaise<T> for Result<T, E> {
    fn or_raise(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| e.into_pyerr(py))
    }
}

/// Shorthand for the most common case.
pub fn invalid(py: Python<'_>, message: impl Into<String>) -> PyErr {
    new_err(py, ErrorCategory::InvalidArgument, message)
}
