//! `Conductor`: the global scheduler (policies, admission, replica hints).
//!
//! `schedule` and the progress events are a few microseconds of work, so they run with
//! the GIL held (releasing it would cost more than the call); bulk cache events and
//! `remove_instance` release it.

use std::sync::Arc;

use mooncake_core::conductor::{Conductor, ConductorError, DecodeSpec, PrefillSpec, RoleSpec, ScheduleRequest};
use mooncake_core::{ErrorCategory, InstanceId};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::conductor_types::{PyConductorConfig, PyDecision, PyLinkLoad, PyReplicationHint, PySnapshot};
use crate::convert::{hash_from_py, parse_tier};
use crate::errors::{new_err, to_pyerr, IntoPyErr, OrRaise};
use crate::gil::{detached_if, detached_infallible, DETACH_KEYS};
use crate::index::PyBlockIndex;
use crate::keys::keys_from_py;
use crate::store_events::{events_from_py, PyAppliedEvents};

#[pyclass(name = "Conductor", module = "mooncake_rs._core", frozen)]
pub struct PyConductor {
    inner: Arc<Conductor>,
}

/// `Overloaded(message, reason=..., estimates=Decision | None)`; other errors as usual.
/// `Overloaded` carries its reason and the estimates that refused the request; every
/// other conductor error is its category's exception.
impl IntoPyErr for ConductorError {
    fn into_pyerr(self, py: Python<'_>) -> PyErr {
        let ConductorError::Overloaded { reason, estimates, .. } = &self else {
            return to_pyerr(py, &self);
        };
        let build = || -> PyResult<PyErr> {
            let cls = py.import("mooncake_rs.errors")?.getattr("Overloaded")?;
            let kwargs = PyDict::new(py);
            kwargs.set_item("reason", reason.name())?;
            kwargs.set_item("estimates", estimates.as_ref().map(|d| PyDecision { inner: **d }))?;
            Ok(PyErr::from_value(cls.call((self.to_string(),), Some(&kwargs))?))
        };
        build().unwrap_or_else(|_| to_pyerr(py, &self))
    }
}

/// A core decision (or rejection) as Python sees it.
fn decide(py: Python<'_>, d: Result<mooncake_core::conductor::Decision, ConductorError>) -> PyResult<PyDecision> {
    d.map(|inner| PyDecision { inner }).or_raise(py)
}

#[pymethods]
impl PyConductor {
    #[new]
    #[pyo3(signature = (config = None, index = None))]
    fn new(py: Python<'_>, config: Option<&PyConductorConfig>, index: Option<&PyBlockIndex>) -> PyResult<Self> {
        let cfg = config.map(|c| c.inner.clone()).unwrap_or_default();
        let c = match index {
            Some(ix) => Conductor::with_index(cfg, ix.inner.clone()),
            None => Conductor::new(cfg),
        };
        Ok(PyConductor { inner: Arc::new(c.or_raise(py)?) })
    }

    #[getter]
    fn config(&self) -> PyConductorConfig {
        PyConductorConfig { inner: self.inner.config().clone() }
    }

    /// The block index the conductor reads (shared with whoever passed it in).
    #[getter]
    fn index(&self) -> PyBlockIndex {
        PyBlockIndex { inner: self.inner.index().clone() }
    }

    #[pyo3(signature = (id, speed = 1.0))]
    fn add_prefill(&self, py: Python<'_>, id: InstanceId, speed: f64) -> PyResult<()> {
        self.inner.add_prefill(id, PrefillSpec { speed }).or_raise(py)
    }

    #[pyo3(signature = (id, max_batch = 256, kv_capacity_tokens = 1_000_000))]
    fn add_decode(&self, py: Python<'_>, id: InstanceId, max_batch: usize, kv_capacity_tokens: usize) -> PyResult<()> {
        self.inner.add_decode(id, DecodeSpec { max_batch, kv_capacity_tokens }).or_raise(py)
    }

    /// Removes the instance and its cache entries; returns the ids of the in-flight
    /// requests that used it (dropped from the conductor; retry them).
    fn remove_instance(&self, py: Python<'_>, id: InstanceId) -> PyResult<Vec<u64>> {
        let inner = &self.inner;
        detached_infallible(py, || inner.remove_instance(id)).or_raise(py)
    }

    /// Stops `schedule` from picking the instance; what it holds finishes normally.
    /// Returns how many requests it still holds. Draining twice is allowed.
    fn drain_instance(&self, py: Python<'_>, id: InstanceId) -> PyResult<usize> {
        self.inner.drain_instance(id).or_raise(py)
    }

    /// Turns the online calibration of the admission estimates on or off: the measured
    /// TTFT and TBT of finished stages, over what was predicted, scale later estimates.
    fn set_online_calibration(&self, enabled: bool) {
        self.inner.set_online_calibration(enabled)
    }

    /// (prefill work scale, TBT scale) the admission applies now (1.0 each when off):
    /// the TTFT estimate is `calibration_floor + work scale x (queue + own work)`.
    fn calibration_scales(&self, now: f64) -> (f64, f64) {
        self.inner.calibration_scales(now)
    }

    /// Seconds every TTFT estimate carries besides its queue and own work: what a first
    /// token takes on this cluster beyond them (0.0 when off).
    fn calibration_floor(&self, now: f64) -> f64 {
        self.inner.calibration_floor(now)
    }

    /// Ends a drain; returns how many requests the instance holds.
    fn undrain_instance(&self, py: Python<'_>, id: InstanceId) -> PyResult<usize> {
        self.inner.undrain_instance(id).or_raise(py)
    }

    /// Requests that still need the instance in its current role.
    fn held_requests(&self, py: Python<'_>, id: InstanceId) -> PyResult<usize> {
        self.inner.held_requests(id).or_raise(py)
    }

    fn is_draining(&self, py: Python<'_>, id: InstanceId) -> PyResult<bool> {
        self.inner.is_draining(id).or_raise(py)
    }

    /// Draining and holding nothing: ready for `switch_role`.
    fn is_drained(&self, py: Python<'_>, id: InstanceId) -> PyResult<bool> {
        self.inner.is_drained(id).or_raise(py)
    }

    /// Moves a drained instance to the `role` ("prefill" or "decode") pool with the
    /// given spec (`speed` for prefill; `max_batch`, `kv_capacity_tokens` for decode).
    #[pyo3(signature = (id, role, speed = 1.0, max_batch = 256, kv_capacity_tokens = 1_000_000))]
    fn switch_role(
        &self,
        py: Python<'_>,
        id: InstanceId,
        role: &str,
        speed: f64,
        max_batch: usize,
        kv_capacity_tokens: usize,
    ) -> PyResult<()> {
        let spec = match role {
            "prefill" => RoleSpec::Prefill(PrefillSpec { speed }),
            "decode" => RoleSpec::Decode(DecodeSpec { max_batch, kv_capacity_tokens }),
            other => {
                let e =
                    ConductorError::InvalidArgument(format!("role must be \"prefill\" or \"decode\", got {other:?}"));
                return Err(e.into_pyerr(py));
            }
        };
        self.inner.switch_role(id, spec).or_raise(py)
    }

    #[pyo3(signature = (request_id, block_hashes, prompt_len, now, expected_output_len = None))]
    fn schedule(
        &self,
        py: Python<'_>,
        request_id: u64,
        block_hashes: &Bound<'_, PyAny>,
        prompt_len: usize,
        now: f64,
        expected_output_len: Option<usize>,
    ) -> PyResult<PyDecision> {
        let hashes = keys_from_py(block_hashes)?;
        let r = ScheduleRequest { request_id, block_hashes: &hashes, prompt_len, now, expected_output_len };
        // a long prompt's match over every instance is worth releasing the GIL for
        let inner = &self.inner;
        decide(py, detached_if(py, hashes.len() >= DETACH_KEYS, || inner.schedule(&r)))
    }

    /// What `schedule` would decide now, admitting nothing.
    #[pyo3(signature = (request_id, block_hashes, prompt_len, now, expected_output_len = None))]
    fn preview(
        &self,
        py: Python<'_>,
        request_id: u64,
        block_hashes: &Bound<'_, PyAny>,
        prompt_len: usize,
        now: f64,
        expected_output_len: Option<usize>,
    ) -> PyResult<PyDecision> {
        let hashes = keys_from_py(block_hashes)?;
        let r = ScheduleRequest { request_id, block_hashes: &hashes, prompt_len, now, expected_output_len };
        decide(py, self.inner.preview(&r))
    }

    #[pyo3(signature = (request_id, now = None))]
    fn on_prefill_started(&self, py: Python<'_>, request_id: u64, now: Option<f64>) -> PyResult<()> {
        self.inner.on_prefill_started(request_id, now).or_raise(py)
    }

    #[pyo3(signature = (request_id, now = None))]
    fn on_prefill_finished(&self, py: Python<'_>, request_id: u64, now: Option<f64>) -> PyResult<()> {
        self.inner.on_prefill_finished(request_id, now).or_raise(py)
    }

    /// The prefill instance's engine spent `busy_s` seconds on the request (its report):
    /// a sample of the real service cost for the online calibration; before
    /// `on_decode_started`.
    fn on_prefill_served(&self, py: Python<'_>, request_id: u64, busy_s: f64) -> PyResult<()> {
        self.inner.on_prefill_served(request_id, busy_s).or_raise(py)
    }

    #[pyo3(signature = (request_id, now = None))]
    fn on_decode_started(&self, py: Python<'_>, request_id: u64, now: Option<f64>) -> PyResult<()> {
        self.inner.on_decode_started(request_id, now).or_raise(py)
    }

    #[pyo3(signature = (request_id, output_len, now = None))]
    fn on_decode_finished(&self, py: Python<'_>, request_id: u64, output_len: usize, now: Option<f64>) -> PyResult<()> {
        self.inner.on_decode_finished(request_id, output_len, now).or_raise(py)
    }

    /// Drops an in-flight request without recording its output length.
    fn cancel(&self, py: Python<'_>, request_id: u64) -> PyResult<()> {
        self.inner.cancel(request_id).or_raise(py)
    }

    #[pyo3(signature = (instance, hashes, tier = "dram"))]
    fn on_blocks_stored(
        &self,
        py: Python<'_>,
        instance: InstanceId,
        hashes: &Bound<'_, PyAny>,
        tier: &str,
    ) -> PyResult<usize> {
        let tier = parse_tier(py, tier)?;
        let hashes = keys_from_py(hashes)?;
        let inner = &self.inner;
        detached_if(py, hashes.len() >= DETACH_KEYS, || inner.on_blocks_stored(instance, &hashes, tier)).or_raise(py)
    }

    #[pyo3(signature = (instance, hashes, tier = None))]
    fn on_blocks_evicted(
        &self,
        py: Python<'_>,
        instance: InstanceId,
        hashes: &Bound<'_, PyAny>,
        tier: Option<&str>,
    ) -> PyResult<usize> {
        let tier = tier.map(|t| parse_tier(py, t)).transpose()?;
        let hashes = keys_from_py(hashes)?;
        let inner = &self.inner;
        detached_if(py, hashes.len() >= DETACH_KEYS, || inner.on_blocks_evicted(instance, &hashes, tier)).or_raise(py)
    }

    /// Applies a drained batch of `instance`'s store events to the index (commit,
    /// demotion, promotion: held in the event's tier; eviction, removal: dropped there),
    /// in order. `events`: what `Store.drain_events_batch()` or `Store.drain_events()`
    /// returned, or `StoreEvents.to_bytes()` output from another process.
    fn apply_store_events(
        &self,
        py: Python<'_>,
        instance: InstanceId,
        events: &Bound<'_, PyAny>,
    ) -> PyResult<PyAppliedEvents> {
        let events = events_from_py(events)?;
        let inner = &self.inner;
        let r = detached_if(py, events.len() >= DETACH_KEYS, || inner.apply_store_events(instance, &events))
            .or_raise(py)?;
        Ok(PyAppliedEvents { inserted: r.inserted, removed: r.removed })
    }

    /// Replicas worth making now, hottest first.
    #[pyo3(signature = (now = None))]
    fn replication_hints(&self, py: Python<'_>, now: Option<f64>) -> PyResult<Vec<PyReplicationHint>> {
        let inner = &self.inner;
        let hints = detached_infallible(py, || inner.replication_hints(now)).or_raise(py)?;
        Ok(hints.into_iter().map(|inner| PyReplicationHint { inner }).collect())
    }

    /// Capacities of an instance's links, bytes/s (NIC each way; storage link);
    /// `float("inf")`: never a bottleneck. Default: the transfer model's bandwidths.
    fn set_link_bandwidth(&self, py: Python<'_>, instance: InstanceId, nic_bps: f64, storage_bps: f64) -> PyResult<()> {
        self.inner.set_link_bandwidth(instance, nic_bps, storage_bps).or_raise(py)
    }

    /// An instance's link counters measured at `at`: bytes queued or in flight on its
    /// NIC out, NIC in and storage link. Returns False when ignored (older than the
    /// last report, or the conductor is not contention-aware).
    #[pyo3(signature = (instance, at, nic_out_bytes, nic_in_bytes = 0.0, storage_bytes = 0.0))]
    fn report_link_load(
        &self,
        py: Python<'_>,
        instance: InstanceId,
        at: f64,
        nic_out_bytes: f64,
        nic_in_bytes: f64,
        storage_bytes: f64,
    ) -> PyResult<bool> {
        self.inner.report_link_load(instance, at, nic_out_bytes, nic_in_bytes, storage_bytes).or_raise(py)
    }

    /// Every instance's link backlog at `now` (default: latest time seen), by id.
    #[pyo3(signature = (now = None))]
    fn link_loads(&self, py: Python<'_>, now: Option<f64>) -> PyResult<Vec<PyLinkLoad>> {
        let l = self.inner.link_loads(now).or_raise(py)?;
        Ok(l.into_iter().map(|inner| PyLinkLoad { inner }).collect())
    }

    /// Read-only per-instance queue and load estimates at `now` (default: latest time seen).
    #[pyo3(signature = (now = None))]
    fn snapshot(&self, py: Python<'_>, now: Option<f64>) -> PyResult<PySnapshot> {
        let s = self.inner.snapshot(now).or_raise(py)?;
        PySnapshot::build(py, s)
    }

    /// Output length assumed for a prompt whose first block hash is `first_block`.
    #[pyo3(signature = (first_block = None))]
    fn predicted_output_len(&self, first_block: Option<&Bound<'_, PyAny>>) -> PyResult<f64> {
        let key = first_block.map(hash_from_py).transpose()?;
        Ok(self.inner.predicted_output_len(key))
    }

    /// Raises `InternalError` if an invariant is broken (for tests).
    fn check_integrity(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        detached_infallible(py, || inner.check_integrity()).map_err(|msg| new_err(py, ErrorCategory::Internal, msg))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let s = self.inner.snapshot(None).or_raise(py)?;
        Ok(format!(
            "Conductor(policy={:?}, prefill={}, decode={}, requests={})",
            self.inner.config().policy.name(),
            s.prefill.len(),
            s.decode.len(),
            s.requests
        ))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyConductor>()?;
    crate::conductor_types::register(m)?;
    crate::conductor_cost::register(m)?;
    Ok(())
}
