//! The one pattern for calling into the core from Python: arguments are already owned
//! Rust values, the GIL is released for the call, and the core's error is mapped to the
//! exception tree. Three helpers, and one table of when releasing pays:
//!
//! - [`detached`]: a fallible call, released, its error mapped;
//! - [`detached_infallible`]: a call that cannot fail (or maps its own error), released;
//! - [`detached_if`]: released only when the call is costly (the table below), since
//!   releasing and re-taking the GIL costs more than a small call itself.
//!
//! [`Lent`] holds a pyclass's per-connection state across such calls.

use mooncake_core::Categorized;
use parking_lot::Mutex;
use pyo3::prelude::*;

/// Keys (block hashes, cache keys, store events) in one call at or above which it runs
/// with the GIL released; below, the call is cheaper than the release.
pub const DETACH_KEYS: usize = 256;
/// Bytes a store call copies at or above which it runs released.
pub const DETACH_STORE_BYTES: usize = 1 << 16;
/// Bytes of one KV-event payload at or above which it is applied released (other
/// subscriber threads ingest meanwhile).
pub const DETACH_EVENT_BYTES: usize = 32 << 10;
/// Transfer requests in one submitted batch above which the submit runs released
/// (checking a large batch's regions takes longer than the release).
pub const DETACH_TRANSFER_REQUESTS: usize = 64;

/// Runs `f` with the GIL released and maps its error.
pub fn detached<T, E, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    F: FnOnce() -> Result<T, E> + Send,
    T: Send,
    E: Categorized + Send,
{
    py.detach(f).map_err(|e| crate::errors::to_pyerr(py, &e))
}

/// Runs `f` with the GIL released (a call that blocks or takes long, with no error of
/// the core to map).
pub fn detached_infallible<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> T {
    py.detach(f)
}

/// Runs `f` with the GIL released when `costly` (a threshold of the table above says
/// so), else with it held.
pub fn detached_if<T: Send>(py: Python<'_>, costly: bool, f: impl FnOnce() -> T + Send) -> T {
    if costly {
        py.detach(f)
    } else {
        f()
    }
}

/// A byte range of the caller's (an exported buffer, a reserved slot) handed to a call
/// that runs with the GIL released. Only the address travels (so it is `Send`); the
/// calling frame keeps the owner alive across the call.
#[derive(Clone, Copy)]
pub struct RawBytes {
    addr: usize,
    len: usize,
}

impl RawBytes {
    pub fn new(ptr: *const u8, len: usize) -> Self {
        RawBytes { addr: ptr as usize, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn as_ptr(self) -> *const u8 {
        self.addr as *const u8
    }

    pub fn as_mut_ptr(self) -> *mut u8 {
        self.addr as *mut u8
    }

    /// # Safety
    /// The range is readable for `'a` (its owner outlives the use).
    pub unsafe fn slice<'a>(self) -> &'a [u8] {
        std::slice::from_raw_parts(self.addr as *const u8, self.len)
    }

    /// # Safety
    /// The range is writable for `'a`, and nothing else reads or writes it meanwhile.
    pub unsafe fn slice_mut<'a>(self) -> &'a mut [u8] {
        std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len)
    }
}

/// State a frozen pyclass lends to calls that run with the GIL released: taken out of its
/// lock for the call and put back after. A `parking_lot` guard cannot be held across
/// `detach`: a second caller that holds the GIL while it waits for the lock would keep the
/// first from taking the GIL back to return. Such a state belongs to one connection end,
/// used by one thread at a time; a second caller meanwhile gets a fresh one.
pub struct Lent<T> {
    slot: Mutex<Option<T>>,
}

impl<T> Lent<T> {
    pub fn new(value: Option<T>) -> Self {
        Lent { slot: Mutex::new(value) }
    }

    /// The state, or `make()` when it is lent out (or was never made).
    pub fn take_or(&self, make: impl FnOnce() -> T) -> T {
        self.slot.lock().take().unwrap_or_else(make)
    }

    pub fn put_back(&self, value: T) {
        *self.slot.lock() = Some(value);
    }

    /// `f` of the state where it is in (None while it is lent out or was never made).
    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        self.slot.lock().as_mut().map(f)
    }
}
