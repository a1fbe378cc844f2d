//! `TransferEngine.submit_objects` and `ObjectBatch`: a store node's share of a pool
//! batch planned and submitted in one call (the core's `transfer::objects`), and
//! `plan_object_spans`, the planner on its own (what the pool's tests check it with).

use std::sync::Arc;

use mooncake_core::args::wait_secs;
use mooncake_core::object_layout::plan_spans;
use mooncake_core::transfer::{Engine, ObjectBatch, Op, Peer, Region, RegionId, RemoteObject};
use pyo3::prelude::*;

use crate::errors::{invalid, to_pyerr, OrRaise};
use crate::gil::{detached_if, detached_infallible, DETACH_TRANSFER_REQUESTS};
use crate::transfer::{dur, PyBatch};

/// A node's submitted objects (from `TransferEngine.submit_objects`). Regions it
/// registered for unregistered memory are unregistered by `release()`, or when it is
/// garbage collected.
#[pyclass(name = "ObjectBatch", module = "mooncake_rs._core", frozen)]
pub struct PyObjectBatch {
    inner: ObjectBatch,
}

#[pymethods]
impl PyObjectBatch {
    /// Waits (GIL released) until every request ended, or the batch deadline, or
    /// `timeout_s`; per object whether all of its bytes moved.
    #[pyo3(signature = (timeout_s = None))]
    fn wait(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<Vec<bool>> {
        let t = timeout_s.map(|s| wait_secs("timeout_s", s)).transpose().or_raise(py)?;
        let me = &self.inner;
        Ok(match me.batch() {
            Some(b) if b.is_done() => me.outcome(&b.status()),
            Some(_) => detached_infallible(py, || me.wait(t)),
            None => me.wait(None),
        })
    }
    /// Unregisters the regions registered for this batch now; returns how many.
    fn release(&self) -> usize {
        self.inner.release()
    }
    /// Transfer requests submitted (a run of chunks whose slots follow each other is one).
    #[getter]
    fn requests(&self) -> usize {
        self.inner.requests()
    }
    /// Regions registered for unregistered memory, not released yet.
    #[getter]
    fn temporary_regions(&self) -> usize {
        self.inner.temporary_regions()
    }
    /// The transfer batch (None when no object had a byte to move).
    #[getter]
    fn batch(&self) -> Option<PyBatch> {
        self.inner.batch().map(|b| PyBatch { batch: b.clone() })
    }
    fn __repr__(&self) -> String {
        format!("ObjectBatch(requests={}, temporary_regions={})", self.inner.requests(), self.inner.temporary_regions())
    }
}

fn lists(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<Vec<u64>>> {
    obj.extract().map_err(|_| invalid(py, format!("{what} must be a list (one per object) of lists of ints >= 0")))
}

fn ints(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    obj.extract().map_err(|_| invalid(py, format!("{what} must be a list of ints >= 0, one per object")))
}

/// What `TransferEngine.submit_objects` does with its arguments.
#[allow(clippy::too_many_arguments)]
pub(crate) fn submit(
    py: Python<'_>,
    engine: &Engine,
    op: &str,
    peer: &Arc<Peer>,
    ptrs: &Bound<'_, PyAny>,
    sizes: &Bound<'_, PyAny>,
    totals: &Bound<'_, PyAny>,
    regions: &Bound<'_, PyAny>,
    chunk_bytes: &Bound<'_, PyAny>,
    offsets: &Bound<'_, PyAny>,
    registered: Vec<Arc<Region>>,
    timeout_s: f64,
) -> PyResult<PyObjectBatch> {
    let op = Op::parse(op).or_raise(py)?;
    let timeout = dur(py, "timeout_s", timeout_s)?;
    let (ptrs, sizes, offsets) = (lists(py, ptrs, "ptrs")?, lists(py, sizes, "sizes")?, lists(py, offsets, "offsets")?);
    let (totals, chunk_bytes) = (ints(py, totals, "totals")?, ints(py, chunk_bytes, "chunk_bytes")?);
    let regions: Vec<RegionId> = ints(py, regions, "regions")?;
    let n = ptrs.len();
    for (what, len) in [
        ("sizes", sizes.len()),
        ("totals", totals.len()),
        ("regions", regions.len()),
        ("chunk_bytes", chunk_bytes.len()),
        ("offsets", offsets.len()),
    ] {
        if len != n {
            return Err(invalid(py, format!("{n} objects in ptrs but {len} in {what}: give one entry per object")));
        }
    }
    let objects: Vec<RemoteObject<'_>> = (0..n)
        .map(|o| RemoteObject {
            addrs: &ptrs[o],
            sizes: &sizes[o],
            total: totals[o],
            region: regions[o],
            chunk_bytes: chunk_bytes[o],
            offsets: &offsets[o],
        })
        .collect();
    let go = || {
        // SAFETY: the Python API's contract (as for every call taking addresses): the
        // caller's pieces stay valid, and writable for a read, until the batch ended.
        unsafe { engine.submit_objects(op, peer, &objects, &registered, timeout) }
    };
    let inner = detached_if(py, n > DETACH_TRANSFER_REQUESTS, go).map_err(|e| to_pyerr(py, &e))?;
    Ok(PyObjectBatch { inner })
}

/// The transfer spans of one object (`object_layout::plan_spans`):
/// `(piece, offset in the piece, offset in the node's region, length)` moving the first
/// `total` bytes of the pieces to or from chunk `c` at `offsets[c]`.
#[pyfunction]
fn plan_object_spans(
    py: Python<'_>,
    sizes: Vec<u64>,
    total: u64,
    chunk_bytes: u64,
    offsets: Vec<u64>,
) -> PyResult<Vec<(usize, u64, u64, u64)>> {
    let mut out = Vec::new();
    plan_spans(&sizes, total, chunk_bytes, &offsets, &mut out).map_err(|e| invalid(py, e.0))?;
    Ok(out.into_iter().map(|s| (s.piece, s.piece_offset, s.remote_offset, s.len)).collect())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyObjectBatch>()?;
    m.add_function(wrap_pyfunction!(plan_object_spans, m)?)?;
    Ok(())
}
