//! A `batch_is_exist`'s frames without the interpreter on either end
//! (mooncake_core::exists_frames says why):
//! - `ExistsResponder`: a store node connection's reader that answers `Exists` requests
//!   itself, with the GIL released: the read, the answer from the node's `HeldKeys` and
//!   the write in one call. Whatever else comes is handed back, in order, for the node's
//!   Python handlers.
//! - `exists_flags`: a client's read of the node's 1/0 answer into a list, in one call
//!   (msgspec's decoder of the `Answer` union took ~1 us for 100 flags; its encoder of the
//!   request is faster than a limited-API walk of the key list, and is kept).

use std::sync::Arc;
use std::time::Duration;

use mooncake_core::exists_frames::{answer_leading, frame_len, parse_flags_answer, ExistsReader, Served, HDR};
use mooncake_core::spin_read::SpinRead;
use mooncake_core::store::Store;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::gil::Lent;
use crate::key_table::PyHeldKeys;
use crate::store::PyStore;

/// What one read asks for (a pool frame reader asks the same).
const READ_BYTES: usize = 64 << 10;

#[pyclass(name = "ExistsResponder", module = "mooncake_rs._core", frozen)]
struct PyExistsResponder {
    held: Py<PyHeldKeys>,
    /// the stores whose eviction and removal events the node's key set must have taken in
    /// before it answers (their events are drained in Python, which updates the set)
    stores: Vec<Arc<Store>>,
    spin: Duration,
    reader: Lent<ExistsReader>,
}

#[pymethods]
impl PyExistsResponder {
    /// `held`: the node's keys; `stores`: its segment's stores (each size class's, and the
    /// SSD tier's); `spin_s`: how long a read polls before it sleeps (net/spin_wait.py).
    #[new]
    fn new(held: Py<PyHeldKeys>, stores: Vec<PyRef<'_, PyStore>>, spin_s: f64) -> PyResult<Self> {
        if !(0.0..=10.0).contains(&spin_s) {
            return Err(PyValueError::new_err(format!("spin_s is seconds in 0..10, got {spin_s}")));
        }
        let spin = Duration::from_secs_f64(spin_s);
        Ok(Self { held, stores: stores.iter().map(|s| Arc::clone(&s.inner)).collect(), spin, reader: Lent::new(None) })
    }

    /// One read of `fd` (a plain blocking socket); the `Exists` frames at its front are
    /// answered on `fd`, unless an eviction or removal event is waiting to be taken into
    /// the key set (then nothing is: the handler reaps them first). Returns the bytes left
    /// for the caller's frame decoder (b"": all answered), or None when the peer closed
    /// the stream. BlockingIOError when the socket's receive timeout expired; OSError
    /// otherwise.
    fn serve<'py>(&self, py: Python<'py>, fd: i32) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let mut reader = self.reader.take_or(|| ExistsReader::new(SpinRead::new(self.spin), READ_BYTES));
        let held = self.held.get();
        let stores = &self.stores;
        let served = py.detach(|| {
            reader.serve(fd, |buf, out| {
                if stores.iter().any(|s| s.pending_losses() > 0) {
                    return 0; // (a key may have left: the Python handler drains the events first)
                }
                answer_leading(buf, &held.inner.lock(), out)
            })
        });
        let out = match served {
            Ok(Served::End) => Ok(None),
            Ok(Served::Rest(range)) => Ok(Some(PyBytes::new(py, reader.bytes(range)))),
            Err(e) => Err(e.into()),
        };
        self.reader.put_back(reader);
        out
    }
}

/// `(rid, flags)` when `data` is exactly one whole answer frame (length prefix included)
/// to an `Exists`, laid out as a node writes it; None otherwise (a `Failure`, another
/// frame, several, a part of one: the caller's frame decoder reads those).
#[pyfunction]
fn exists_flags<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Option<(u64, Bound<'py, PyList>)>> {
    let (Some(len), Some(body)) = (frame_len(data), data.get(HDR..)) else { return Ok(None) };
    if len != body.len() {
        return Ok(None);
    }
    let Some((rid, flags)) = parse_flags_answer(body) else { return Ok(None) };
    Ok(Some((rid, PyList::new(py, flags)?)))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyExistsResponder>()?;
    m.add_function(wrap_pyfunction!(exists_flags, m)?)?;
    Ok(())
}
