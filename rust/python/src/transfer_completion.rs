//! `CompletionQueue` and `BatchCompletion`: learning of ended batches without a thread
//! per batch (`TransferEngine.submit(..., queue=q, tag=t)`, then `q.poll()` / `q.wait()`).

use std::sync::Arc;
use std::time::Duration;

use mooncake_core::transfer::{Completion, CompletionQueue};
use pyo3::prelude::*;

use crate::errors::to_pyerr;
use crate::gil::detached_infallible;
use crate::transfer::{dur, PyBatch};

/// One ended batch, as a `CompletionQueue` reports it.
#[pyclass(name = "BatchCompletion", module = "mooncake_rs._core", frozen)]
pub struct PyBatchCompletion {
    c: Completion,
}

#[pymethods]
impl PyBatchCompletion {
    /// The tag given to `submit`.
    #[getter]
    fn tag(&self) -> u64 {
        self.c.tag
    }
    /// Every request ended done.
    #[getter]
    fn ok(&self) -> bool {
        self.c.ok()
    }
    #[getter]
    fn requests(&self) -> usize {
        self.c.requests
    }
    /// Requests that failed.
    #[getter]
    fn failed(&self) -> usize {
        self.c.failed
    }
    /// The first failed request's error message (None if ok).
    #[getter]
    fn error(&self) -> Option<String> {
        self.c.error.as_ref().map(|e| e.to_string())
    }
    /// Its stable code ("timeout", "out_of_bounds", ...).
    #[getter]
    fn code(&self) -> Option<&'static str> {
        self.c.error.as_ref().map(|e| e.code())
    }
    /// Bytes the requests moved.
    #[getter]
    fn bytes(&self) -> u64 {
        self.c.bytes
    }
    #[getter]
    fn requested_bytes(&self) -> u64 {
        self.c.requested_bytes
    }
    /// Monotonic ns (the clock of `time.monotonic_ns()`).
    #[getter]
    fn submitted_ns(&self) -> u64 {
        self.c.submitted_ns
    }
    #[getter]
    fn finished_ns(&self) -> u64 {
        self.c.finished_ns
    }
    /// The batch itself (its per-request statuses).
    #[getter]
    fn batch(&self) -> PyBatch {
        PyBatch { batch: self.c.batch.clone() }
    }
    /// Raises TransferFailed / TransferTimeout for the first failed request, if any.
    fn raise_for_error(&self, py: Python<'_>) -> PyResult<()> {
        match &self.c.error {
            Some(e) => Err(to_pyerr(py, e)),
            None => Ok(()),
        }
    }
    fn __repr__(&self) -> String {
        match &self.c.error {
            Some(e) => {
                format!("BatchCompletion(tag={}, failed {}/{}: {e})", self.c.tag, self.c.failed, self.c.requests)
            }
            None => format!("BatchCompletion(tag={}, ok, bytes={})", self.c.tag, self.c.bytes),
        }
    }
}

/// Reports batches submitted with `queue=` as they end: no thread per batch needed.
#[pyclass(name = "CompletionQueue", module = "mooncake_rs._core", frozen)]
pub struct PyCompletionQueue {
    q: Arc<CompletionQueue>,
}

impl PyCompletionQueue {
    pub(crate) fn queue(&self) -> Arc<CompletionQueue> {
        self.q.clone()
    }
}

#[pymethods]
impl PyCompletionQueue {
    #[new]
    fn new() -> Self {
        PyCompletionQueue { q: CompletionQueue::new() }
    }
    /// The batches that ended since the last call; never blocks. Batches past their
    /// deadline end (as timed out) here.
    fn poll(&self) -> Vec<PyBatchCompletion> {
        self.q.poll().into_iter().map(|c| PyBatchCompletion { c }).collect()
    }
    /// Waits (GIL released) until at least one batch ended or `timeout_s` passed
    /// (None: no limit, but returns at once when no batch is pending); returns the
    /// batches that ended, possibly none.
    #[pyo3(signature = (timeout_s = None))]
    fn wait(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<Vec<PyBatchCompletion>> {
        let t = match timeout_s {
            Some(s) if s <= 0.0 => return Ok(self.poll()),
            Some(s) => dur(py, "timeout_s", s)?,
            // Without a limit and with nothing in flight, nothing could ever end: return.
            None if self.q.pending() == 0 => return Ok(Vec::new()),
            None => Duration::MAX,
        };
        let q = &self.q;
        let out = detached_infallible(py, || q.wait(t));
        Ok(out.into_iter().map(|c| PyBatchCompletion { c }).collect())
    }
    /// Batches submitted to this queue and not handed back yet.
    #[getter]
    fn pending(&self) -> usize {
        self.q.pending()
    }
    fn __len__(&self) -> usize {
        self.q.pending()
    }
    fn __repr__(&self) -> String {
        format!("CompletionQueue(pending={})", self.q.pending())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCompletionQueue>()?;
    m.add_class::<PyBatchCompletion>()?;
    Ok(())
}
