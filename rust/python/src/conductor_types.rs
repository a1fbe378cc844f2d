//! The conductor's configuration and result classes (`ConductorConfig`, `Decision`,
//! `ReplicationHint`, `ConductorSnapshot`, `PrefillLoad`, `DecodeLoad`).

use mooncake_core::conductor::{
    ConductorConfig, Decision, DecodeLoad, LinkLoad, PolicyKind, PrefillLoad, RejectionKind, ReplicationHint, Snapshot,
};
use mooncake_core::InstanceId;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::class_macros::{inner_getters, with_overrides};
use crate::conductor_cost::{PyDecodeCostModel, PyPrefillCostModel, PyTransferCostModel};
use crate::convert::hashes_to_list;
use crate::errors::OrRaise;

#[pyclass(name = "ConductorConfig", module = "mooncake_rs._core", frozen)]
#[derive(Clone)]
pub struct PyConductorConfig {
    pub inner: ConductorConfig,
}

inner_getters!(PyConductorConfig {
        block_size: usize, ttft_slo_s: f64, tbt_slo_s: f64, balancing_threshold: f64, seed: u64,
        default_output_len: usize, output_len_ewma: f64, max_output_len: usize, hot_min_hits: f64,
        hot_half_life_s: f64, hot_busy_fraction: f64, contention_aware: bool, hot_link_busy_s: f64,
        hot_replica_max_bytes: f64, hot_capacity: usize, prefetch_staging_bytes: f64,
    }
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
        hot_link_busy_s = None, hot_replica_max_bytes = None, prefetch_staging_bytes = None,
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
        prefetch_staging_bytes: Option<f64>,
    ) -> PyResult<Self> {
        let policy = policy.map(PolicyKind::parse).transpose().or_raise(py)?;
        let rejection = rejection.map(RejectionKind::parse).transpose().or_raise(py)?;
        let mut inner = with_overrides!(ConductorConfig::default();
            block_size, ttft_slo_s, tbt_slo_s, policy, balancing_threshold, rejection, seed, default_output_len,
            output_len_ewma, hot_min_hits, hot_half_life_s, hot_busy_fraction, hot_capacity, max_output_len,
            contention_aware, hot_link_busy_s, hot_replica_max_bytes, prefetch_staging_bytes);
        let cost = &mut inner.cost;
        let (prefill, transfer, decode) = (prefill_model.map(|m| m.inner), transfer_model.map(|m| m.inner), decode_model.map(|m| m.inner));
        *cost = with_overrides!(*cost; prefill, transfer, decode);
        inner.validate().or_raise(py)?;
        Ok(PyConductorConfig { inner })
    }

    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.policy.name()
    }
    #[getter]
    fn rejection(&self) -> &'static str {
        self.inner.rejection.name()
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

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "ConductorConfig(block_size={}, ttft_slo_s={}, tbt_slo_s={}, policy={:?}, balancing_threshold={}, rejection={:?}, seed={})",
            c.block_size, c.ttft_slo_s, c.tbt_slo_s, c.policy.name(), c.balancing_threshold, c.rejection.name(), c.seed
        )
    }
);

/// Where a request goes and the estimates behind the choice.
#[pyclass(name = "Decision", module = "mooncake_rs._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyDecision {
    pub inner: Decision,
}

inner_getters!(PyDecision {
        prefill: InstanceId, decode: InstanceId, reused_blocks: usize, fetch_blocks: usize,
        fetch_from: Option<InstanceId>, est_queue_s: f64, est_prefill_s: f64, est_transfer_s: f64, est_ttft_s: f64,
        est_tbt_s: f64, retry_after_s: f64, fetch_abandon_s: f64, prefetch: bool,
    }
    fn __repr__(&self) -> String {
        let d = &self.inner;
        format!(
            "Decision(prefill={}, decode={}, reused_blocks={}, fetch_blocks={}, fetch_from={:?}, est_ttft_s={:.6}, est_tbt_s={:.6})",
            d.prefill, d.decode, d.reused_blocks, d.fetch_blocks, d.fetch_from, d.est_ttft_s, d.est_tbt_s
        )
    }
);

/// A proposed copy of a hot prefix from a busy holder to a less busy prefill instance.
#[pyclass(name = "ReplicationHint", module = "mooncake_rs._core", frozen)]
pub struct PyReplicationHint {
    pub inner: ReplicationHint,
}

inner_getters!(PyReplicationHint {
        from_instance: InstanceId, to_instance: InstanceId, hits: f64, from_queue_s: f64, to_queue_s: f64,
    }
    #[getter]
    fn blocks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        hashes_to_list(py, &self.inner.blocks)
    }
    fn __repr__(&self) -> String {
        let h = &self.inner;
        format!(
            "ReplicationHint(blocks=<{}>, from_instance={}, to_instance={}, hits={:.2})",
            h.blocks.len(), h.from_instance, h.to_instance, h.hits
        )
    }
);

#[pyclass(name = "PrefillLoad", module = "mooncake_rs._core", frozen)]
pub struct PyPrefillLoad {
    inner: PrefillLoad,
}

inner_getters!(PyPrefillLoad {
    id: InstanceId,
    speed: f64,
    queued: usize,
    running: usize,
    queue_s: f64,
    draining: bool
});

#[pyclass(name = "DecodeLoad", module = "mooncake_rs._core", frozen)]
pub struct PyDecodeLoad {
    inner: DecodeLoad,
}

inner_getters!(PyDecodeLoad {
    id: InstanceId,
    max_batch: usize,
    kv_capacity_tokens: usize,
    batch: usize,
    decoding: usize,
    kv_reserved_tokens: usize,
    est_tbt_s: f64,
    draining: bool,
});

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
        Ok(PySnapshot {
            now: s.now,
            prefill: s
                .prefill
                .into_iter()
                .map(|inner| Py::new(py, PyPrefillLoad { inner }))
                .collect::<PyResult<_>>()?,
            decode: s.decode.into_iter().map(|inner| Py::new(py, PyDecodeLoad { inner })).collect::<PyResult<_>>()?,
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
#[pyclass(name = "LinkLoad", module = "mooncake_rs._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyLinkLoad {
    pub inner: LinkLoad,
}

inner_getters!(PyLinkLoad {
        instance: InstanceId, nic_out_bytes: f64, nic_in_bytes: f64, storage_bytes: f64, nic_bps: f64, storage_bps: f64,
    }
    fn __repr__(&self) -> String {
        let l = &self.inner;
        format!(
            "LinkLoad(instance={}, nic_out_bytes={:.0}, nic_in_bytes={:.0}, storage_bytes={:.0})",
            l.instance, l.nic_out_bytes, l.nic_in_bytes, l.storage_bytes
        )
    }
);
