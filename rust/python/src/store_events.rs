//! `StoreEvents`: one drained batch of a store's events, as an immutable object the
//! conductor applies directly (`Conductor.apply_store_events(instance, events)`), with
//! a bytes form (`to_bytes()` / `StoreEvents.from_bytes(b)`) for sending a worker's batch
//! to the conductor's process inside a msgpack frame. No per-event Python object is
//! built unless the caller iterates it.

use std::sync::Arc;

use mooncake_core::store::{decode_events, encode_events, StoreEvent};
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::convert::BufferView;
use crate::errors::{invalid, OrRaise};
use crate::store::PyStoreEvent;

/// Equal (Python's `==`) to another batch with the same events in the same order.
#[pyclass(name = "StoreEvents", module = "mooncake_rs._core", frozen, eq)]
#[derive(PartialEq)]
pub struct PyStoreEvents {
    pub events: Arc<Vec<StoreEvent>>,
}

/// Events from a `StoreEvents`, a list of `StoreEvent` (what `Store.drain_events()`
/// returns), or the bytes of `StoreEvents.to_bytes()`; `InvalidArgument` otherwise.
pub fn events_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Arc<Vec<StoreEvent>>> {
    let py = obj.py();
    if let Ok(b) = obj.cast::<PyStoreEvents>() {
        return Ok(b.get().events.clone());
    }
    if let Ok(list) = obj.cast::<PyList>() {
        let mut out = Vec::with_capacity(list.len());
        for (i, item) in list.iter().enumerate() {
            let Ok(e) = item.cast::<PyStoreEvent>() else {
                let t = item.get_type().name().map(|n| n.to_string()).unwrap_or_default();
                return Err(invalid(py, format!("events[{i}] is a {t}, not a StoreEvent (pass Store.drain_events() or Store.drain_events_batch())")));
            };
            out.push(e.get().inner);
        }
        return Ok(Arc::new(out));
    }
    match BufferView::get(obj, pyo3::ffi::PyBUF_C_CONTIGUOUS) {
        Ok(Some(v)) => Ok(Arc::new(decode_events(v.bytes()).or_raise(py)?)),
        _ => {
            let t = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
            Err(invalid(
                py,
                format!("events must be a StoreEvents, a list of StoreEvent or StoreEvents.to_bytes() output, got {t}"),
            ))
        }
    }
}

#[pymethods]
impl PyStoreEvents {
    /// From a list of `StoreEvent` or the bytes of `to_bytes()`.
    #[new]
    fn py_new(events: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(PyStoreEvents { events: events_from_py(events)? })
    }

    /// Reads `to_bytes()` output back; `InvalidArgument` on anything else.
    #[staticmethod]
    fn from_bytes(data: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = data.py();
        let v = BufferView::get_contiguous(data, "data")?;
        Ok(PyStoreEvents { events: Arc::new(decode_events(v.bytes()).or_raise(py)?) })
    }

    /// The wire form: `b"MCE1"` then 18 bytes per event (kind, tier, 16-byte LE key).
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &encode_events(&self.events))
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        self.to_bytes(py)
    }

    fn __len__(&self) -> usize {
        self.events.len()
    }

    fn __bool__(&self) -> bool {
        !self.events.is_empty()
    }

    fn __getitem__(&self, i: isize) -> PyResult<PyStoreEvent> {
        let n = self.events.len() as isize;
        let j = if i < 0 { i + n } else { i };
        if !(0..n).contains(&j) {
            return Err(PyIndexError::new_err(format!("StoreEvents index {i} out of range for {n} events")));
        }
        Ok(self.events[j as usize].into())
    }

    /// The events as `StoreEvent` objects (for inspection).
    fn tolist(&self) -> Vec<PyStoreEvent> {
        self.events.iter().map(|&e| e.into()).collect()
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(PyList::new(py, self.tolist())?.try_iter()?.into_any())
    }

    fn __repr__(&self) -> String {
        format!("StoreEvents(n={})", self.events.len())
    }
}

/// What `Conductor.apply_store_events` changed in the index.
#[pyclass(name = "AppliedEvents", module = "mooncake_rs._core", frozen, get_all, eq)]
#[derive(PartialEq)]
pub struct PyAppliedEvents {
    /// (block, tier) entries that were new.
    pub inserted: usize,
    /// (block, tier) entries that were dropped.
    pub removed: usize,
}

#[pymethods]
impl PyAppliedEvents {
    fn __repr__(&self) -> String {
        format!("AppliedEvents(inserted={}, removed={})", self.inserted, self.removed)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStoreEvents>()?;
    m.add_class::<PyAppliedEvents>()?;
    Ok(())
}
