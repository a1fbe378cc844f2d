//! `TransferEngine`, `Region`, `Peer`, `TransferRequest`, `Batch`, `TransferStatus`,
//! `TransferStats`, `TransferRegistry`: the transfer engine's Python API.

use std::ffi::c_void;
use std::os::raw::c_int;
use std::sync::Arc;
use std::time::Duration;

use mooncake_core::args::{positive_secs, wait_secs};
use mooncake_core::transfer::{
    Access, Batch, Engine, EngineConfig, EngineRegistry, EngineStats, Op, Peer, Region, RegionId, Request,
    RequestStatus, TransferError, Transports, WireProtection,
};
use mooncake_core::{Categorized, ErrorCategory};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::class_macros::inner_getters;
use crate::convert::BufferView;
use crate::errors::{invalid, new_err, to_pyerr, OrRaise};
use crate::gil::{detached, detached_if, detached_infallible, DETACH_TRANSFER_REQUESTS};

/// `secs` (argument `what`) as a positive duration, or `InvalidArgument` (the core's check).
pub(crate) fn dur(py: Python<'_>, what: &str, secs: f64) -> PyResult<Duration> {
    positive_secs(what, secs).or_raise(py)
}

/// A registered region of memory; exports its bytes through the buffer protocol.
#[pyclass(name = "Region", module = "mooncake_rs._core", frozen)]
pub struct PyRegion {
    pub region: Arc<Region>,
    /// Whether Python may write through the exported buffer.
    writable: bool,
}

#[pymethods]
impl PyRegion {
    #[getter]
    fn id(&self) -> RegionId {
        self.region.id
    }
    #[getter]
    fn length(&self) -> usize {
        self.region.len()
    }
    /// Peers may read this region but never write it.
    #[getter]
    fn readonly(&self) -> bool {
        self.region.readonly
    }
    /// Whether same-host peers can reach it through shared memory (never a restricted one).
    #[getter]
    fn shared(&self) -> bool {
        self.region.shm().is_some() && !self.region.restricted
    }
    /// Peers reach it only through live grants (`TransferEngine.grant`), never over shm.
    #[getter]
    fn restricted(&self) -> bool {
        self.region.restricted
    }
    fn __len__(&self) -> usize {
        self.region.len()
    }
    fn __repr__(&self) -> String {
        format!("Region(id={}, length={}, readonly={})", self.region.id, self.region.len(), self.region.readonly)
    }

    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let me = slf.get();
        if !me.writable && (flags & ffi::PyBUF_WRITABLE) != 0 {
            return Err(pyo3::exceptions::PyBufferError::new_err("this region's memory is read-only"));
        }
        // SAFETY: the exported object (slf) holds the Arc<Region> that keeps the memory
        // mapped for as long as the view exists; FillInfo takes its own reference.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                me.region.ptr() as *mut c_void,
                me.region.len() as ffi::Py_ssize_t,
                (!me.writable) as c_int,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }
}

/// A connected peer (from `TransferEngine.connect`).
#[pyclass(name = "Peer", module = "mooncake_rs._core", frozen)]
pub struct PyPeer {
    pub(crate) peer: Arc<Peer>,
}

#[pymethods]
impl PyPeer {
    #[getter]
    fn name(&self) -> &str {
        &self.peer.name
    }
    /// "local", "shm" (same host) or "tcp".
    #[getter]
    fn transport(&self) -> &'static str {
        self.peer.transport()
    }
    /// How a request on the peer's region `region` (a Region or its id) travels now:
    /// "local", "shm", "staged", "tcp" (the peer's server sees a write land), or
    /// "unknown" (not looked up yet: the first request to it asks the peer).
    fn route(&self, region: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        Ok(self.peer.route(region_id(region)?))
    }
    /// TCP connections up.
    #[getter]
    fn connections(&self) -> usize {
        self.peer.connections()
    }
    fn __repr__(&self) -> String {
        format!("Peer(name={:?}, transport={:?})", self.peer.name, self.peer.transport())
    }
}

fn region_id(obj: &Bound<'_, PyAny>) -> PyResult<RegionId> {
    if let Ok(r) = obj.cast::<PyRegion>() {
        return Ok(r.get().region.id);
    }
    obj.extract::<RegionId>().map_err(|_| invalid(obj.py(), "remote_region must be a region id (int) or a Region"))
}

/// One transfer: `op` "read" pulls remote bytes into `local`, "write" pushes them.
#[pyclass(name = "TransferRequest", module = "mooncake_rs._core", frozen)]
pub struct PyTransferRequest {
    /// The core request (its regions by id, the peer's connection).
    inner: Request,
    local: Py<PyRegion>,
    peer: Py<PyPeer>,
}

inner_getters!(PyTransferRequest { local_offset: u64, remote_region: RegionId, remote_offset: u64, length: u64 }
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        op: &str,
        local: Py<PyRegion>,
        local_offset: u64,
        peer: Py<PyPeer>,
        remote_region: &Bound<'_, PyAny>,
        remote_offset: u64,
        length: u64,
    ) -> PyResult<Self> {
        let op = Op::parse(op).or_raise(py)?;
        let (local_id, remote_region, peer_conn) = (local.get().region.id, region_id(remote_region)?, peer.get().peer.clone());
        let inner = Request { op, local: local_id, local_offset, peer: peer_conn, remote_region, remote_offset, length };
        Ok(PyTransferRequest { inner, local, peer })
    }
    #[getter]
    fn op(&self) -> &'static str {
        self.inner.op.name()
    }
    #[getter]
    fn local(&self, py: Python<'_>) -> Py<PyRegion> {
        self.local.clone_ref(py)
    }
    #[getter]
    fn peer(&self, py: Python<'_>) -> Py<PyPeer> {
        self.peer.clone_ref(py)
    }
    fn __repr__(&self) -> String {
        let r = &self.inner;
        format!(
            "TransferRequest(op={:?}, local_offset={}, remote_region={}, remote_offset={}, length={})",
            r.op.name(), r.local_offset, r.remote_region, r.remote_offset, r.length
        )
    }
);

/// The outcome of one request.
#[pyclass(name = "TransferStatus", module = "mooncake_rs._core", frozen)]
pub struct PyTransferStatus {
    inner: RequestStatus,
}

#[pymethods]
impl PyTransferStatus {
    /// "pending", "done" or "failed".
    #[getter]
    fn state(&self) -> &'static str {
        self.inner.state()
    }
    #[getter]
    fn ok(&self) -> bool {
        self.inner.is_ok()
    }
    /// What went wrong (None unless failed).
    #[getter]
    fn error(&self) -> Option<String> {
        self.inner.error().map(|e| e.to_string())
    }
    /// Stable error code: "out_of_bounds", "no_such_region", "read_only", "timeout", ...
    #[getter]
    fn code(&self) -> Option<&'static str> {
        self.inner.error().map(TransferError::code)
    }
    #[getter]
    fn bytes(&self) -> u64 {
        self.inner.bytes()
    }
    /// The exception class `raise_for_error` raises ("TransferFailed", "TransferTimeout").
    #[getter]
    fn category(&self) -> Option<&'static str> {
        self.inner.error().map(|e| e.category().name())
    }
    /// Raises the matching `TransferFailed` / `TransferTimeout` if this request failed.
    fn raise_for_error(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.error().map_or(Ok(()), |e| Err(to_pyerr(py, e)))
    }
    fn __repr__(&self) -> String {
        match self.inner.error() {
            Some(e) => format!("TransferStatus(failed: {e}, bytes={})", self.inner.bytes()),
            None => format!("TransferStatus({}, bytes={})", self.inner.state(), self.inner.bytes()),
        }
    }
}

/// Statuses as a list. Statuses are immutable values, so equal "done" statuses in a row
/// share one object (a batch of equal-sized requests builds one, not one per request).
fn statuses(py: Python<'_>, v: Vec<RequestStatus>) -> PyResult<Bound<'_, PyList>> {
    let mut items: Vec<Bound<'_, PyAny>> = Vec::with_capacity(v.len());
    let mut last: Option<(u64, Bound<'_, PyAny>)> = None;
    for s in &v {
        if let RequestStatus::Done { bytes } = s {
            if let Some((b, obj)) = &last {
                if b == bytes {
                    items.push(obj.clone());
                    continue;
                }
            }
            let obj = Bound::new(py, PyTransferStatus { inner: s.clone() })?.into_any();
            last = Some((*bytes, obj.clone()));
            items.push(obj);
        } else {
            items.push(Bound::new(py, PyTransferStatus { inner: s.clone() })?.into_any());
        }
    }
    PyList::new(py, items)
}

/// A submitted batch.
#[pyclass(name = "Batch", module = "mooncake_rs._core", frozen)]
pub struct PyBatch {
    pub(crate) batch: Arc<Batch>,
}

#[pymethods]
impl PyBatch {
    /// Waits until every request ended (or the batch deadline, or `timeout_s`).
    #[pyo3(signature = (timeout_s = None))]
    fn wait<'py>(&self, py: Python<'py>, timeout_s: Option<f64>) -> PyResult<Bound<'py, PyList>> {
        let t = timeout_s.map(|s| wait_secs("timeout_s", s)).transpose().or_raise(py)?;
        let b = &self.batch;
        let v = if b.is_done() { b.status() } else { detached_infallible(py, || b.wait(t)) };
        statuses(py, v)
    }
    /// Current statuses, without waiting.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        statuses(py, self.batch.status())
    }
    /// Ends every unfinished request as cancelled.
    fn cancel(&self) {
        self.batch.cancel()
    }
    #[getter]
    fn done(&self) -> bool {
        self.batch.is_done()
    }
    /// When it was submitted (monotonic ns: the clock of `time.monotonic_ns()`).
    #[getter]
    fn submitted_ns(&self) -> u64 {
        self.batch.submitted_ns()
    }
    /// When its last request ended (monotonic ns), None while any is pending.
    #[getter]
    fn finished_ns(&self) -> Option<u64> {
        self.batch.finished_ns()
    }
    /// Bytes moved so far by all its requests.
    #[getter]
    fn bytes(&self) -> u64 {
        self.batch.bytes()
    }
    /// The sum of its requests' lengths.
    #[getter]
    fn requested_bytes(&self) -> u64 {
        self.batch.requested_bytes()
    }
    fn __len__(&self) -> usize {
        self.batch.len()
    }
    /// `await batch`: waits in the event loop's default executor.
    fn __await__(slf: Bound<'_, Self>) -> PyResult<Bound<'_, PyAny>> {
        let py = slf.py();
        let lp = py.import("asyncio")?.call_method0("get_running_loop")?;
        let fut = lp.call_method1("run_in_executor", (py.None(), slf.getattr("wait")?))?;
        fut.call_method0("__await__")
    }
}

/// Counters of one engine.
#[pyclass(name = "TransferStats", module = "mooncake_rs._core", frozen)]
pub struct PyTransferStats {
    inner: EngineStats,
}

inner_getters!(PyTransferStats {
        auth_failures: u64, bad_frames: u64, refused: u64,
        /// Refusals (also in `refused`) because no live grant covered the access.
        grant_refusals: u64,
        connections: u64, bytes_served: u64,
        /// Of `bytes_served`: committed by same-host peers through their staging buffers
        /// into restricted regions.
        bytes_staged: u64,
        /// Of `bytes_served`: copied out of restricted regions into same-host peers'
        /// staging buffers (their reads).
        bytes_staged_read: u64,
        /// Peers this engine redialed after every connection to them was lost.
        reconnects: u64,
        retries: u64, late_responses: u64, handshakes_evicted: u64,
        /// Served connections closed to make room (oldest idle first), or idle past
        /// `idle_timeout_s` on a server without a token.
        idle_evicted: u64,
        regions: u64,
        /// Batches submitted / ended / in flight now.
        batches: u64,
        batches_done: u64, batches_in_flight: u64,
        /// Bytes moved by write / read requests of this engine that ended ok.
        bytes_written: u64,
        bytes_read: u64, requests_failed: u64,
    }
    /// Seconds with at least one batch of this engine in flight.
    #[getter]
    fn busy_s(&self) -> f64 {
        self.inner.busy_ns as f64 * 1e-9
    }
);

/// Engines of one process that can find each other by name.
#[pyclass(name = "TransferRegistry", module = "mooncake_rs._core", frozen)]
pub struct PyTransferRegistry {
    inner: Arc<EngineRegistry>,
}

#[pymethods]
impl PyTransferRegistry {
    #[new]
    fn new() -> Self {
        PyTransferRegistry { inner: EngineRegistry::new() }
    }
    /// The process-wide registry engines join by default.
    #[staticmethod]
    fn default() -> Self {
        PyTransferRegistry { inner: EngineRegistry::global() }
    }
    fn names(&self) -> Vec<String> {
        self.inner.names()
    }
    fn address_of(&self, name: &str) -> Option<String> {
        self.inner.address_of(name)
    }
}

#[pyclass(name = "TransferEngine", module = "mooncake_rs._core", frozen)]
pub struct PyTransferEngine {
    engine: Engine,
}

impl PyTransferEngine {
    /// The one submit behind `submit` and `submit_spans`: to `queue` (with `tag`) when
    /// given, with the GIL released for a batch large enough for that to pay.
    fn submit_requests(
        &self,
        py: Python<'_>,
        reqs: Vec<Request>,
        timeout: Duration,
        queue: Option<PyRef<'_, crate::transfer_completion::PyCompletionQueue>>,
        tag: u64,
    ) -> PyResult<PyBatch> {
        let costly = reqs.len() > DETACH_TRANSFER_REQUESTS;
        let e = &self.engine;
        let q = queue.map(|q| q.queue());
        let go = move || match &q {
            Some(q) => e.submit_to(reqs, timeout, q, tag),
            None => e.submit(reqs, timeout),
        };
        let batch = detached_if(py, costly, go).map_err(|x| to_pyerr(py, &x))?;
        Ok(PyBatch { batch })
    }
}

#[pymethods]
impl PyTransferEngine {
    #[new]
    #[pyo3(signature = (name, listen = "127.0.0.1:0", auth_token = None, transports = None, *, registry = None,
        slice_size = 1_048_576, io_timeout_s = 10.0, idle_timeout_s = 60.0, connect_timeout_s = 5.0, connections_per_endpoint = None, copy_threads = 2,
        inline_send_bytes = 16384, peer_tokens = None, wire_protection = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: &str,
        listen: &str,
        auth_token: Option<String>,
        transports: Option<Vec<String>>,
        registry: Option<PyRef<'_, PyTransferRegistry>>,
        slice_size: usize,
        io_timeout_s: f64,
        idle_timeout_s: f64,
        connect_timeout_s: f64,
        connections_per_endpoint: Option<usize>,
        copy_threads: usize,
        inline_send_bytes: usize,
        peer_tokens: Option<std::collections::BTreeMap<String, String>>,
        wire_protection: Option<&str>,
    ) -> PyResult<Self> {
        let transports = match &transports {
            Some(t) => Transports::parse(t.iter().map(String::as_str)).or_raise(py)?,
            None => Transports::default(),
        };
        if connections_per_endpoint == Some(0) {
            return Err(crate::errors::invalid(
                py,
                "connections_per_endpoint must be 1..=64, or None for automatic (1 without a token, more with one)",
            ));
        }
        let cfg = EngineConfig {
            name: name.to_string(),
            listen: listen.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect(),
            auth_token,
            transports,
            slice_size,
            connect_timeout: dur(py, "connect_timeout_s", connect_timeout_s)?,
            io_timeout: dur(py, "io_timeout_s", io_timeout_s)?,
            idle_timeout: dur(py, "idle_timeout_s", idle_timeout_s)?,
            connections_per_endpoint: connections_per_endpoint.unwrap_or(0),
            copy_threads,
            inline_send_bytes,
            peer_tokens: peer_tokens.unwrap_or_default().into_iter().collect(),
            wire_protection: wire_protection.map(WireProtection::parse).transpose().or_raise(py)?,
            ..EngineConfig::default()
        };
        let reg = registry.map(|r| r.inner.clone()).unwrap_or_else(EngineRegistry::global);
        let engine = detached(py, || Engine::new(cfg, Some(reg)))?;
        Ok(PyTransferEngine { engine })
    }

    #[getter]
    fn name(&self) -> &str {
        self.engine.name()
    }
    /// What a peer passes to `connect` ("host:port[,host:port...]"; "" without tcp).
    #[getter]
    fn address(&self) -> String {
        self.engine.address()
    }
    #[getter]
    fn closed(&self) -> bool {
        self.engine.is_closed()
    }

    fn stats(&self) -> PyTransferStats {
        PyTransferStats { inner: self.engine.stats() }
    }

    /// Registers any buffer-protocol object (kept alive while registered) or a Region.
    /// `readonly`: nobody writes it; `remote_readonly`: peers may only read it;
    /// `restricted`: peers reach it only inside live grants (see `grant`), never over shm.
    #[pyo3(signature = (buffer, readonly = false, *, remote_readonly = false, restricted = false))]
    fn register(
        &self,
        py: Python<'_>,
        buffer: &Bound<'_, PyAny>,
        readonly: bool,
        remote_readonly: bool,
        restricted: bool,
    ) -> PyResult<PyRegion> {
        let e = &self.engine;
        let access = |readonly| Access { readonly, remote_readonly, restricted };
        let err = |x: TransferError| to_pyerr(py, &x);
        // A store's arena (or its `region()`): registered as the mapping itself, so a
        // shared-memory arena is eligible for the shm path.
        let arena = if let Ok(s) = buffer.cast::<crate::store::PyStore>() {
            Some(s.get().inner.arena())
        } else if let Ok(r) = buffer.cast::<crate::store::PyStoreRegion>() {
            Some(r.get().memory())
        } else {
            None
        };
        if let Some(arena) = arena {
            let id = e.register_mapped_with(arena, access(readonly)).map_err(err)?;
            // Python sees the arena read-only through this Region: slots are written
            // through the store (reserve/commit), which owns the lease discipline.
            return self.wrap(py, id, false);
        }
        if let Ok(r) = buffer.cast::<PyRegion>() {
            let r = r.get();
            let id = match r.region.mapping() {
                Some(m) => e.register_mapped_with(m.clone(), access(readonly)).map_err(err)?,
                // SAFETY: the region's memory stays valid while the Arc<Region> owner lives.
                None => unsafe {
                    e.register_raw_with(
                        r.region.ptr(),
                        r.region.len(),
                        access(readonly || !r.writable),
                        Box::new(r.region.clone()),
                    )
                }
                .map_err(err)?,
            };
            return self.wrap(py, id, r.writable);
        }
        let t = buffer.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        let no_buffer =
            || invalid(py, format!("register() needs a buffer (bytearray, numpy array, ...) or a Region, got {t}"));
        let (view, writable) = match BufferView::get(buffer, ffi::PyBUF_C_CONTIGUOUS | ffi::PyBUF_WRITABLE) {
            Ok(Some(v)) => (v, true),
            Ok(None) => return Err(no_buffer()),
            Err(first) if !readonly => {
                return Err(invalid(
                    py,
                    format!(
                    "register() needs a writable C-contiguous buffer ({first}); pass readonly=True for read-only memory"
                ),
                ))
            }
            Err(_) => match BufferView::get(buffer, ffi::PyBUF_C_CONTIGUOUS) {
                Ok(Some(v)) => (v, false),
                Ok(None) => return Err(no_buffer()),
                Err(e) => return Err(invalid(py, format!("register() needs a C-contiguous buffer ({e})"))),
            },
        };
        let (ptr, len) = (view.as_mut_ptr(), view.len_bytes());
        let held = view;
        // SAFETY: the exported buffer stays valid (and writable if `writable`) until `held`
        // releases it; the region's owner is `held`; a non-writable buffer is registered
        // read-only and is never a destination of a local read.
        let id =
            unsafe { e.register_raw_with(ptr, len, access(readonly || !writable), Box::new(held)) }.map_err(err)?;
        self.wrap(py, id, writable)
    }

    /// A new region of zero-filled shared memory (reachable by same-host peers via shm).
    #[pyo3(signature = (length, readonly = false, *, restricted = false))]
    fn allocate(&self, py: Python<'_>, length: usize, readonly: bool, restricted: bool) -> PyResult<PyRegion> {
        let e = &self.engine;
        let access = Access { readonly, restricted, ..Access::default() };
        let region = detached(py, || e.allocate_with(length, access))?;
        Ok(PyRegion { region, writable: true })
    }

    /// Lets peer `peer` (the engine name it connects with) read
    /// `offset..offset+length` of the restricted `region`, and write it too when
    /// `write`, for `expires_s` seconds (None: until revoked). Returns the grant id.
    #[pyo3(signature = (region, peer, offset, length, write = true, expires_s = None))]
    #[allow(clippy::too_many_arguments)]
    fn grant(
        &self,
        py: Python<'_>,
        region: &Bound<'_, PyAny>,
        peer: &str,
        offset: u64,
        length: u64,
        write: bool,
        expires_s: Option<f64>,
    ) -> PyResult<u64> {
        crate::transfer_rights::grant(py, &self.engine, region_id(region)?, peer, offset, length, write, expires_s)
    }

    /// Removes `peer`'s grants on `region` (only `grant_id` when given); returns how
    /// many. Requests checked after it returns are refused.
    #[pyo3(signature = (region, peer, grant_id = None))]
    fn revoke(&self, py: Python<'_>, region: &Bound<'_, PyAny>, peer: &str, grant_id: Option<u64>) -> PyResult<usize> {
        crate::transfer_rights::revoke(py, &self.engine, region_id(region)?, peer, grant_id)
    }

    /// The live grants of `region`.
    fn grants(
        &self,
        py: Python<'_>,
        region: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<crate::transfer_rights::PyTransferGrant>> {
        crate::transfer_rights::grants(py, &self.engine, region_id(region)?)
    }

    /// Runs `watch`'s callback for the objects it waits for in `region` (slots of
    /// `chunk_bytes`) when a peer's write over TCP completes one, before that write is
    /// answered (LandingWatch). One watch a region.
    fn watch_writes(
        &self,
        py: Python<'_>,
        region: &Bound<'_, PyAny>,
        watch: PyRef<'_, crate::transfer_landing::PyLandingWatch>,
        chunk_bytes: u64,
    ) -> PyResult<()> {
        crate::transfer_landing::watch(py, &self.engine, region_id(region)?, &watch, chunk_bytes)
    }

    /// Unregisters a region (a Region or its id); returns whether it was registered.
    fn unregister(&self, region: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.engine.unregister(region_id(region)?))
    }

    /// Connects to a peer by name (an engine of this process) or at `address`.
    #[pyo3(signature = (peer_name, address = None))]
    fn connect(&self, py: Python<'_>, peer_name: &str, address: Option<&str>) -> PyResult<PyPeer> {
        let e = &self.engine;
        let peer = detached(py, || e.connect(peer_name, address))?;
        Ok(PyPeer { peer })
    }

    /// Submits a batch of TransferRequests; returns at once. With `queue`, the batch is
    /// reported by that CompletionQueue (with `tag`) when it has ended.
    #[pyo3(signature = (requests, timeout_s = 30.0, *, queue = None, tag = 0))]
    fn submit(
        &self,
        py: Python<'_>,
        requests: &Bound<'_, PyAny>,
        timeout_s: f64,
        queue: Option<PyRef<'_, crate::transfer_completion::PyCompletionQueue>>,
        tag: u64,
    ) -> PyResult<PyBatch> {
        let timeout = dur(py, "timeout_s", timeout_s)?;
        let mut reqs = Vec::new();
        let mut push = |item: &Bound<'_, PyAny>| -> PyResult<()> {
            let r = item
                .cast::<PyTransferRequest>()
                .map_err(|_| invalid(py, "submit() takes a list of TransferRequest"))?;
            reqs.push(r.get().inner.clone());
            Ok(())
        };
        if let Ok(list) = requests.cast::<PyList>() {
            for item in list.iter() {
                push(&item)?;
            }
        } else if let Ok(t) = requests.cast::<PyTuple>() {
            for item in t.iter() {
                push(&item)?;
            }
        } else {
            for item in requests.try_iter()? {
                push(&item?)?;
            }
        }
        self.submit_requests(py, reqs, timeout, queue, tag)
    }

    /// One batch of equal-length requests between one local region and one remote region,
    /// request `i` moving `length` bytes between `local_offsets[i]` and `remote_offsets[i]`:
    /// what a KV connector submits per layer, without a Python object per request.
    /// Offsets: a sequence of ints or a buffer of u64 (a numpy uint64 array).
    #[pyo3(signature = (op, local, local_offsets, peer, remote_region, remote_offsets, length, timeout_s = 30.0, *,
                        queue = None, tag = 0))]
    #[allow(clippy::too_many_arguments)]
    fn submit_spans(
        &self,
        py: Python<'_>,
        op: &str,
        local: PyRef<'_, PyRegion>,
        local_offsets: &Bound<'_, PyAny>,
        peer: PyRef<'_, PyPeer>,
        remote_region: &Bound<'_, PyAny>,
        remote_offsets: &Bound<'_, PyAny>,
        length: u64,
        timeout_s: f64,
        queue: Option<PyRef<'_, crate::transfer_completion::PyCompletionQueue>>,
        tag: u64,
    ) -> PyResult<PyBatch> {
        let op = Op::parse(op).or_raise(py)?;
        let timeout = dur(py, "timeout_s", timeout_s)?;
        let lo = offsets(py, local_offsets, "local_offsets")?;
        let ro = offsets(py, remote_offsets, "remote_offsets")?;
        let template = Request {
            op,
            local: local.region.id,
            local_offset: 0,
            peer: peer.peer.clone(),
            remote_region: region_id(remote_region)?,
            remote_offset: 0,
            length,
        };
        let reqs = Request::spans(&template, &lo, &ro).or_raise(py)?;
        self.submit_requests(py, reqs, timeout, queue, tag)
    }

    /// One store node's share of a pool batch, planned and submitted as one batch: per
    /// object the caller's pieces (`ptrs[o]`, `sizes[o]`), the bytes that move
    /// (`totals[o]`), and where the node keeps it (`regions[o]`, `chunk_bytes[o]`, the
    /// chunks' `offsets[o]`). Pieces are found in `registered` (this engine's regions),
    /// else registered until the `ObjectBatch` is released. "write" puts, "read" gets.
    #[pyo3(signature = (op, peer, ptrs, sizes, totals, regions, chunk_bytes, offsets, registered = Vec::new(),
                        timeout_s = 30.0))]
    #[allow(clippy::too_many_arguments)]
    fn submit_objects(
        &self,
        py: Python<'_>,
        op: &str,
        peer: PyRef<'_, PyPeer>,
        ptrs: &Bound<'_, PyAny>,
        sizes: &Bound<'_, PyAny>,
        totals: &Bound<'_, PyAny>,
        regions: &Bound<'_, PyAny>,
        chunk_bytes: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        registered: Vec<PyRef<'_, PyRegion>>,
        timeout_s: f64,
    ) -> PyResult<crate::transfer_objects::PyObjectBatch> {
        let registered = registered.iter().map(|r| r.region.clone()).collect();
        crate::transfer_objects::submit(
            py,
            &self.engine,
            op,
            &peer.peer,
            ptrs,
            sizes,
            totals,
            regions,
            chunk_bytes,
            offsets,
            registered,
            timeout_s,
        )
    }

    /// Stops serving and closes peers; pending requests fail. Idempotent.
    fn close(&self, py: Python<'_>) {
        let e = &self.engine;
        detached_infallible(py, || e.close())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!("TransferEngine(name={:?}, address={:?})", self.engine.name(), self.engine.address())
    }
}

impl PyTransferEngine {
    fn wrap(&self, py: Python<'_>, id: RegionId, writable: bool) -> PyResult<PyRegion> {
        let region = self.engine.region(id).ok_or_else(|| new_err(py, ErrorCategory::Internal, "region vanished"))?;
        Ok(PyRegion { region, writable })
    }
}

/// A list of offsets: a u64 buffer read at once, else any sequence of ints.
fn offsets(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    if let Ok(buf) = pyo3::buffer::PyBuffer::<u64>::get(obj) {
        return buf.to_vec(py);
    }
    obj.extract::<Vec<u64>>()
        .map_err(|_| invalid(py, format!("{what} must be a sequence of non-negative ints or a uint64 buffer")))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTransferEngine>()?;
    m.add_class::<PyRegion>()?;
    m.add_class::<PyPeer>()?;
    m.add_class::<PyTransferRequest>()?;
    m.add_class::<PyBatch>()?;
    m.add_class::<PyTransferStatus>()?;
    m.add_class::<PyTransferStats>()?;
    m.add_class::<PyTransferRegistry>()?;
    crate::transfer_completion::register(m)?;
    crate::transfer_objects::register(m)?;
    Ok(())
}
