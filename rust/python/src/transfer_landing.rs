//! `LandingWatch`: the objects a store node waits to land in its regions (the core's
//! `landing_table.rs`), and the Python callable that publishes a put's objects when the
//! last byte of the last of them has arrived. `TransferEngine.watch_writes` attaches the
//! watch to a region; the engine's TCP server then runs the callable on its serving
//! thread, with the GIL, before it answers the write that completed the group
//! (landing.rs).

use std::sync::Arc;

use mooncake_core::transfer::landing_table::{Expected, LandingTable};
use mooncake_core::transfer::{AccessError, Engine, RegionId};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};

use crate::errors::{invalid, to_pyerr};

type Table = LandingTable<Py<PyAny>>;

/// Groups of objects waited for in watched regions. `callback(put_ids, token) -> int`
/// runs once per group, when a peer's write over TCP covered the last missing byte of
/// its last object; 0 lets that write succeed, anything else (or an exception, reported
/// as unraisable) fails it with `refused_by_owner`.
#[pyclass(name = "LandingWatch", module = "mooncake_rs._core", frozen)]
pub struct PyLandingWatch {
    table: Arc<Table>,
    /// The callable, shared with the table's completion (which runs without the watch);
    /// visible to the garbage collector, because it usually holds the watch's owner (a
    /// store node's bound method), which holds the watch.
    callback: Arc<Mutex<Option<Py<PyAny>>>>,
}

#[pymethods]
impl PyLandingWatch {
    #[new]
    fn new(py: Python<'_>, callback: Py<PyAny>) -> PyResult<Self> {
        if !callback.bind(py).is_callable() {
            return Err(invalid(py, "LandingWatch(callback): callback must be callable as callback(put_ids, token)"));
        }
        let callback = Arc::new(Mutex::new(Some(callback)));
        let slot = callback.clone();
        let complete = move |ids: Vec<u64>, token: Py<PyAny>| -> Result<(), AccessError> {
            // (None: the interpreter is shutting down; nothing can be published)
            Python::try_attach(|py| {
                let Some(cb) = slot.lock().as_ref().map(|c| c.clone_ref(py)) else {
                    return Err(AccessError::OwnerRefused); // (cleared: its owner is gone)
                };
                match cb.call1(py, (ids, token)) {
                    Ok(v) if v.extract::<i64>(py).is_ok_and(|st| st == 0) => Ok(()),
                    Ok(_) => Err(AccessError::OwnerRefused),
                    Err(err) => {
                        err.write_unraisable(py, Some(cb.bind(py)));
                        Err(AccessError::OwnerRefused)
                    }
                }
            })
            .unwrap_or(Err(AccessError::OwnerRefused))
        };
        Ok(PyLandingWatch { table: Arc::new(LandingTable::new(Box::new(complete))), callback })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(cb) = self.callback.lock().as_ref() {
            visit.call(cb)?;
        }
        Ok(())
    }

    fn __clear__(&self) {
        let cb = self.callback.lock().take();
        drop(cb);
    }

    /// Waits for one group: object `put_ids[i]` of `sizes[i]` bytes (at least one) in
    /// the slots at `offsets[i]` (one per chunk, at slot boundaries) of watched region
    /// `regions[i]`; `token` is handed to the callback with the group's ids. All or
    /// nothing: a bad object refuses the group.
    fn expect(
        &self,
        py: Python<'_>,
        put_ids: Vec<u64>,
        regions: Vec<RegionId>,
        offsets: Vec<Vec<u64>>,
        sizes: Vec<u64>,
        token: Py<PyAny>,
    ) -> PyResult<()> {
        let group = objects(py, "expect", &put_ids, &regions, &offsets, &sizes)?;
        self.table.expect(&group, token).map_err(|e| invalid(py, format!("expect(): {e}")))
    }

    /// Counts the writes landing in these objects' slots (as `expect` takes them) without
    /// completing anything: they are spare slots whose contents the owner learns later,
    /// by `arm`. All or nothing.
    fn expect_unbound(
        &self,
        py: Python<'_>,
        put_ids: Vec<u64>,
        regions: Vec<RegionId>,
        offsets: Vec<Vec<u64>>,
        sizes: Vec<u64>,
    ) -> PyResult<()> {
        let group = objects(py, "expect_unbound", &put_ids, &regions, &offsets, &sizes)?;
        self.table.expect_unbound(&group).map_err(|e| invalid(py, format!("expect_unbound(): {e}")))
    }

    /// Makes unbound objects `put_ids` one group whose completion calls the callback with
    /// `token`. True: all their bytes had landed already, so no write will complete them
    /// and the caller must (they are no longer waited for); False: the write of their last
    /// missing byte does. `InvalidArgument`, changing nothing, when an id is not an unbound
    /// object of this watch.
    fn arm(&self, py: Python<'_>, put_ids: Vec<u64>, token: Py<PyAny>) -> PyResult<bool> {
        self.table.arm(&put_ids, token).map_err(|e| invalid(py, format!("arm(): {e}")))
    }

    /// Stops waiting for `put_id`'s group (its reservation ended, so the group cannot
    /// complete); whether it was waited for.
    fn forget(&self, put_id: u64) -> bool {
        self.table.forget(put_id)
    }

    /// `forget` of each id under one lock (the reservations of a batch that ended); how
    /// many were waited for.
    fn forget_many(&self, put_ids: Vec<u64>) -> usize {
        self.table.forget_many(&put_ids)
    }

    /// How many objects are waited for.
    #[getter]
    fn pending(&self) -> usize {
        self.table.pending()
    }

    fn __repr__(&self) -> String {
        format!("LandingWatch(pending={})", self.table.pending())
    }
}

/// The objects of an `expect` call, checked for equal lengths.
fn objects<'a>(
    py: Python<'_>,
    call: &str,
    put_ids: &[u64],
    regions: &[RegionId],
    offsets: &'a [Vec<u64>],
    sizes: &[u64],
) -> PyResult<Vec<Expected<'a>>> {
    let n = put_ids.len();
    if regions.len() != n || offsets.len() != n || sizes.len() != n {
        return Err(invalid(py, format!("{call}(): put_ids, regions, offsets and sizes differ in length")));
    }
    Ok((0..n).map(|i| Expected { id: put_ids[i], region: regions[i], offsets: &offsets[i], size: sizes[i] }).collect())
}

/// `TransferEngine.watch_writes`: `w` told of the writes landed in `region`, whose slots
/// have `chunk_bytes` bytes.
pub(crate) fn watch(
    py: Python<'_>,
    e: &Engine,
    region: RegionId,
    w: &PyLandingWatch,
    chunk_bytes: u64,
) -> PyResult<()> {
    if chunk_bytes == 0 {
        return Err(invalid(py, "watch_writes(): chunk_bytes must be > 0"));
    }
    e.watch_writes(region, w.table.clone()).map_err(|x| to_pyerr(py, &x))?;
    w.table.add_region(region, chunk_bytes).map_err(|m| invalid(py, format!("watch_writes(): {m}")))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyLandingWatch>()
}
