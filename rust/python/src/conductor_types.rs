//! The conductor's configuration and result classes (`ConductorConfig`, `Decision`,
//! `ReplicationHint`, `ConductorSnapshot`, `PrefillLoad`, `DecodeLoad`).

use mooncake_core::conductor::{
    ConductorConfig, Decision, DecodeLoad, LinkLoad, PolicyKind, PrefillLoad, RejectionKind, ReplicationHint, Snapshot,
};
use mooncake_core::InstanceId;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::conductor_cost::{PyDecodeCostModel, PyPrefillCostModel, PyTransferCostModel};
use crate::convert::hashes_to_list;
use crate::errors::OrRaise;

#[pyclass(name = "ConductorConfig", module = "mooncake_rs._core", frozen)]
#[derive(Clone)]
pub struct PyConductorConfig {
    pub inner: ConductorConfig,
}

#[pymethods]
impl PyConductorConfig {
    /// Every argument left out (or None) takes the core's default
    /// (`ConductorConfig::default()` in rust/core/src/conductor/config.rs), the one place
    /// the defaults are written; Python reads them from `ConductorConfig()`.
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (
        block_size = None, ttft_slo_s = None, tbt_slo_s = None, policy = None, balancing_threshold = None,
        rejection = None, seed = None, prefill_model = None, transfer_model = None, decode_model = None,
        default_output_len = None, output_len_ewma = None, hot_min_hits = None, hot_half_life_s = None,
        hot_busy_fraction = None, hot_capacity = None, max_output_len = None, contention_aware = None,
        hot_link_busy_s = None, hot_replica_max_bytes = None,
    ))]
    fn new(
        py: Python<'_>,
        block_size: Option<usize>,
        ttft_slo_s: Option<f64>,
        tbt_slo_s: Option<f64>,
        policy: Option<&str>,
        balancing_threshold: Option<f64>,
        rejection: Option<&str>,
        seed: Option<u64>,
        prefill_model: Option<PyPrefillCostModel>,
        transfer_model: Option<PyTransferCostModel>,
        decode_model: Option<PyDecodeCostModel>,
        default_output_len: Option<usize>,
        output_len_ewma: Option<f64>,
        hot_min_hits: Option<f64>,
        hot_half_life_s: Option<f64>,
        hot_busy_fraction: Option<f64>,
        hot_capacity: Option<usize>,
        max_output_len: Option<usize>,
        contention_aware: Option<bool>,
        hot_link_busy_s: Option<f64>,
        hot_replica_max_bytes: Option<f64>,
    ) -> PyResult<Self> {
        let d = ConductorConfig::default();
        let mut inner = ConductorConfig {
            block_size: block_size.unwrap_or(d.block_size),
            ttft_slo_s: ttft_slo_s.unwrap_or(d.ttft_slo_s),
            tbt_slo_s: tbt_slo_s.unwrap_or(d.tbt_slo_s),
            policy: policy.map(PolicyKind::parse).transpose().or_raise(py)?.unwrap_or(d.policy),
            balancing_threshold: balancing_threshold.unwrap_or(d.balancing_threshold),
            rejection: rejection.map(RejectionKind::parse).transpose().or_raise(py)?.unwrap_or(d.rejection),
            seed: seed.unwrap_or(d.seed),
            default_output_len: default_output_len.unwrap_or(d.default_output_len),
            output_len_ewma: output_len_ewma.unwrap_or(d.output_len_ewma),
            hot_min_hits: hot_min_hits.unwrap_or(d.hot_min_hits),
            hot_half_life_s: hot_half_life_s.unwrap_or(d.hot_half_life_s),
            hot_busy_fraction: hot_busy_fraction.unwrap_or(d.hot_busy_fraction),
            hot_capacity: hot_capacity.unwrap_or(d.hot_capacity),
            max_output_len: max_output_len.unwrap_or(d.max_output_len),
            contention_aware: contention_aware.unwrap_or(d.contention_aware),
            hot_link_busy_s: hot_link_busy_s.unwrap_or(d.hot_link_busy_s),
            hot_replica_max_bytes: hot_replica_max_bytes.unwrap_or(d.hot_replica_max_bytes),
            cost: d.cost,
        };
        if let Some(m) = prefill_model {
            inner.cost.prefill = m.inner;
        }
        if let Some(m) = transfer_model {
            inner.cost.transfer = m.inner;
        }
        if let Some(m) = decode_model {
            inner.cost.decode = m.inner;
        }
        inner.validate().or_raise(py)?;
        Ok(PyConductorConfig { inner })
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size
    }
    #[getter]
    fn ttft_slo_s(&self) -> f64 {
        self.inner.ttft_slo_s
    }
    #[getter]
    fn tbt_slo_s(&self) -> f64 {
        self.inner.tbt_slo_s
    }
    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.policy.name()
    }
    #[getter]
    fn balancing_threshold(&self) -> f64 {
        self.inner.balancing_threshold
    }
    #[getter]
    fn rejection(&self) -> &'static str {
        self.inner.rejection.name()
    }
    #[getter]
    fn seed(&self) -> u64 {
        self.inner.seed
    }
    #[getter]
    fn prefill_model(&self) -> PyPrefillCostModel {
        PyPrefillCostModel { inner: self.inner.cost.prefill }
    }
    #[getter]
    fn transfer_model(&self) -> PyTransferCostModel {
        PyTransferCostModel { inner: self.inner.cost.transfer }
    }
    #[getter]
    fn decode_model(&self) -> PyDecodeCostModel {
        PyDecodeCostModel { inner: self.inner.cost.decode }
    }
    #[getter]
    fn default_output_len(&self) -> usize {
        self.inner.default_output_len
    }
    #[getter]
    fn output_len_ewma(&self) -> f64 {
        self.inner.output_len_ewma
    }
    #[getter]
    fn max_output_len(&self) -> usize {
        self.inner.max_output_len
    }
    #[getter]
    fn hot_min_hits(&self) -> f64 {
        self.inner.hot_min_hits
    }
    #[getter]
    fn hot_half_life_s(&self) -> f64 {
        self.inner.hot_half_life_s
    }
    #[getter]
    fn hot_busy_fraction(&self) -> f64 {
        self.inner.hot_busy_fraction
    }
    #[getter]
    fn contention_aware(&self) -> bool {
        self.inner.contention_aware
    }
    #[getter]
    fn hot_link_busy_s(&self) -> f64 {
        self.inner.hot_link_busy_s
    }
    #[getter]
    fn hot_replica_max_bytes(&self) -> f64 {
        self.inner.hot_replica_max_bytes
    }
    #[getter]
    fn hot_capacity(&self) -> usize {
        self.inner.hot_capacity
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "ConductorConfig(block_size={}, ttft_slo_s={}, tbt_slo_s={}, policy={:?}, balancing_threshold={}, rejection={:?}, seed={})",
            c.block_size, c.ttft_slo_s, c.tbt_slo_s, c.policy.name(), c.balancing_threshold, c.rejection.name(), c.seed
        )
    }
}

/// Where a request goes and the estimates behind the choice.
#[pyclass(name = "Decision", module = "mooncake_rs._core", frozen, get_all, eq)]
#[derive(Clone, PartialEq)]
pub struct PyDecision {
    pub prefill: InstanceId,
    pub decode: InstanceId,
    pub reused_blocks: usize,
    pub fetch_blocks: usize,
    pub fetch_from: Option<InstanceId>,
    pub est_queue_s: f64,
    pub est_prefill_s: f64,
    pub est_transfer_s: f64,
    pub est_ttft_s: f64,
    pub est_tbt_s: f64,
    pub retry_after_s: f64,
    pub fetch_abandon_s: f64,
}

impl From<Decision> for PyDecision {
    fn from(d: Decision) -> Self {
        PyDecision {
            prefill: d.prefill,
            decode: d.decode,
            reused_blocks: d.reused_blocks,
            fetch_blocks: d.fetch_blocks,
            fetch_from: d.fetch_from,
            est_queue_s: d.est_queue_s,
            est_prefill_s: d.est_prefill_s,
            est_transfer_s: d.est_transfer_s,
            est_ttft_s: d.est_ttft_s,
            est_tbt_s: d.est_tbt_s,
            retry_after_s: d.retry_after_s,
            fetch_abandon_s: d.fetch_abandon_s,
        }
    }
}

#[pymethods]
impl PyDecision {
    fn __repr__(&self) -> String {
        format!(
            "Decision(prefill={}, decode={}, reused_blocks={}, fetch_blocks={}, fetch_from={:?}, est_ttft_s={:.6}, est_tbt_s={:.6})",
            self.prefill, self.decode, self.reused_blocks, self.fetch_blocks, self.fetch_from, self.est_ttft_s, self.est_tbt_s
        )
    }
}

/// A proposed copy of a hot prefix from a busy holder to a less busy prefill instance.
#[pyclass(name = "ReplicationHint", module = "mooncake_rs._core", frozen)]
pub struct PyReplicationHint {
    pub inner: ReplicationHint,
}

#[pymethods]
#[allow(clippy::wrong_self_convention)] // Python getter names
impl PyReplicationHint {
    #[getter]
    fn blocks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        hashes_to_list(py, &self.inner.blocks)
    }
    #[getter]
    fn from_instance(&self) -> InstanceId {
        self.inner.from_instance
    }
    #[getter]
    fn to_instance(&self) -> InstanceId {
        self.inner.to_instance
    }
    #[getter]
    fn hits(&self) -> f64 {
        self.inner.hits
    }
    #[getter]
    fn from_queue_s(&self) -> f64 {
        self.inner.from_queue_s
    }
    #[getter]
    fn to_queue_s(&self) -> f64 {
        self.inner.to_queue_s
    }
    fn __repr__(&self) -> String {
        let h = &self.inner;
        format!(
            "ReplicationHint(blocks=<{}>, from_instance={}, to_instance={}, hits={:.2})",
            h.blocks.len(), h.from_instance, h.to_instance, h.hits
        )
    }
}

#[pyclass(name = "PrefillLoad", module = "mooncake_rs._core", frozen, get_all)]
pub struct PyPrefillLoad {
    pub id: InstanceId,
    pub speed: f64,
    pub queued: usize,
    pub running: usize,
    pub queue_s: f64,
    pub draining: bool,
}

#[pyclass(name = "DecodeLoad", module = "mooncake_rs._core", frozen, get_all)]
pub struct PyDecodeLoad {
    pub id: InstanceId,
    pub max_batch: usize,
    pub kv_capacity_tokens: usize,
    pub batch: usize,
    pub decoding: usize,
    pub kv_reserved_tokens: usize,
    pub est_tbt_s: f64,
    pub draining: bool,
}

/// Read-only per-instance loads at one time.
#[pyclass(name = "ConductorSnapshot", module = "mooncake_rs._core", frozen, get_all)]
pub struct PySnapshot {
    pub now: f64,
    pub prefill: Vec<Py<PyPrefillLoad>>,
    pub decode: Vec<Py<PyDecodeLoad>>,
    pub requests: usize,
}

impl PySnapshot {
    pub fn build(py: Python<'_>, s: Snapshot) -> PyResult<Self> {
        let p = |l: &PrefillLoad| {
            Py::new(py, PyPrefillLoad { id: l.id, speed: l.speed, queued: l.queued, running: l.running, queue_s: l.queue_s, draining: l.draining })
        };
        let d = |l: &DecodeLoad| {
            Py::new(
                py,
                PyDecodeLoad {
                    id: l.id,
                    max_batch: l.max_batch,
                    kv_capacity_tokens: l.kv_capacity_tokens,
                    batch: l.batch,
                    decoding: l.decoding,
                    kv_reserved_tokens: l.kv_reserved_tokens,
                    est_tbt_s: l.est_tbt_s,
                    draining: l.draining,
                },
            )
        };
        Ok(PySnapshot {
            now: s.now,
            prefill: s.prefill.iter().map(p).collect::<PyResult<_>>()?,
            decode: s.decode.iter().map(d).collect::<PyResult<_>>()?,
            requests: s.requests,
        })
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyConductorConfig>()?;
    m.add_class::<PyDecision>()?;
    m.add_class::<PyReplicationHint>()?;
    m.add_class::<PyLinkLoad>()?;
    m.add_class::<PyPrefillLoad>()?;
    m.add_class::<PyDecodeLoad>()?;
    m.add_class::<PySnapshot>()?;
    Ok(())
}

/// One instance's links as the conductor sees them: bytes queued or in flight on its
/// NIC out, NIC in and storage link, and their capacities (bytes/s).
#[pyclass(name = "LinkLoad", module = "mooncake_rs._core", frozen, get_all, eq)]
#[derive(Clone, PartialEq)]
pub struct PyLinkLoad {
    pub instance: InstanceId,
    pub nic_out_bytes: f64,
    pub nic_in_bytes: f64,
    pub storage_bytes: f64,
    pub nic_bps: f64,
    pub storage_bps: f64,
}

impl From<LinkLoad> for PyLinkLoad {
    fn from(l: LinkLoad) -> Self {
        PyLinkLoad {
            instance: l.instance,
            nic_out_bytes: l.nic_out_bytes,
            nic_in_bytes: l.nic_in_bytes,
            storage_bytes: l.storage_bytes,
            nic_bps: l.nic_bps,
            storage_bps: l.storage_bps,
        }
    }
}

#[pymethods]
impl PyLinkLoad {
    fn __repr__(&self) -> String {
        format!(
            "LinkLoad(instance={}, nic_out_bytes={:.0}, nic_in_bytes={:.0}, storage_bytes={:.0})",
            self.instance, self.nic_out_bytes, self.nic_in_bytes, self.storage_bytes
        )
    }
}
