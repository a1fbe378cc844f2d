//! `ReservedObject`: the slots of one whole object reserved for a remote writer
//! (`Store.reserve_objects`), published with `commit()` or given back with `abort()`.

use std::sync::Arc;

use mooncake_core::store::{ReservedObject, Store};
use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::errors::invalid;

/// One object's reserved chunk slots (a transfer engine writes them in place), in chunk
/// order. Dropped (or `abort()`ed) uncommitted, the slots are freed.
#[pyclass(name = "ReservedObject", module = "mooncake_rs._core", frozen)]
pub struct PyReservedObject {
    store: Arc<Store>,
    offsets: Vec<u64>,
    /// Held only for a take with the GIL held.
    obj: Mutex<Option<ReservedObject>>,
}

impl PyReservedObject {
    pub fn new(store: Arc<Store>, obj: ReservedObject) -> Self {
        PyReservedObject { store, offsets: obj.offsets(), obj: Mutex::new(Some(obj)) }
    }
}

#[pymethods]
impl PyReservedObject {
    /// Each chunk's byte offset in the store's arena (`Store.region()`).
    #[getter]
    fn offsets(&self) -> Vec<u64> {
        self.offsets.clone()
    }

    fn __len__(&self) -> usize {
        self.offsets.len()
    }

    /// Publishes every chunk (and pins each with `pin`). False if the object could not
    /// be published whole (a chunk evicted before its pin): then nothing of it stays.
    #[pyo3(signature = (pin = false))]
    fn commit(&self, py: Python<'_>, pin: bool) -> PyResult<bool> {
        let taken = self.obj.lock().take();
        match taken {
            Some(obj) => Ok(self.store.commit_object(obj, pin)),
            None => Err(invalid(py, "this ReservedObject was already committed or aborted")),
        }
    }

    /// `commit` of a batch in one call (`pins[i]` for `objects[i]`): per object whether it
    /// was published whole. Every object must be open (none committed or aborted yet);
    /// one that is not refuses the batch before anything is published.
    #[staticmethod]
    fn commit_many(py: Python<'_>, objects: Vec<PyRef<'_, PyReservedObject>>, pins: Vec<bool>) -> PyResult<Vec<bool>> {
        if objects.len() != pins.len() {
            return Err(invalid(
                py,
                format!("{} objects and {} pins: give one pin per object", objects.len(), pins.len()),
            ));
        }
        if objects.iter().any(|o| o.obj.lock().is_none()) {
            return Err(invalid(py, "a ReservedObject of the batch was already committed or aborted"));
        }
        Ok(objects
            .iter()
            .zip(pins)
            .map(|(o, pin)| {
                let taken = o.obj.lock().take();
                taken.is_some_and(|obj| o.store.commit_object(obj, pin))
            })
            .collect())
    }

    /// Frees the slots without publishing; nothing if already committed or aborted.
    fn abort(&self) {
        let taken = self.obj.lock().take();
        drop(taken);
    }

    fn __repr__(&self) -> String {
        format!("ReservedObject(chunks={}, open={})", self.offsets.len(), self.obj.lock().is_some())
    }
}
