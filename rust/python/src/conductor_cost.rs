//! Cost-model classes of the conductor (`PrefillCostModel`, `TransferCostModel`,
//! `DecodeCostModel`): construct with coefficients, predict, or `fit` from samples.

use mooncake_core::conductor::{ConductorError, DecodeCostModel, PrefillCostModel, TransferCostModel};
use pyo3::prelude::*;

use crate::class_macros::{inner_getters, with_overrides};
use crate::errors::OrRaise;

/// A cost model's constructor and fit report the core's `CostModelError` as a
/// conductor error (the category the conductor's other errors have).
fn checked<T>(py: Python<'_>, r: Result<T, impl Into<ConductorError>>) -> PyResult<T> {
    r.map_err(Into::into).or_raise(py)
}

#[pyclass(name = "PrefillCostModel", module = "mooncake_rs._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyPrefillCostModel {
    pub inner: PrefillCostModel,
}

inner_getters!(PyPrefillCostModel { c0: f64, c_new: f64, c_new2: f64, c_cross: f64 }
    #[new]
    #[pyo3(signature = (c0 = None, c_new = None, c_new2 = None, c_cross = None))]
    fn new(py: Python<'_>, c0: Option<f64>, c_new: Option<f64>, c_new2: Option<f64>, c_cross: Option<f64>) -> PyResult<Self> {
        let inner = with_overrides!(PrefillCostModel::default(); c0, c_new, c_new2, c_cross);
        checked(py, inner.validate())?;
        Ok(PyPrefillCostModel { inner })
    }

    /// Least squares from (prompt tokens, cached prefix tokens, seconds) samples.
    #[staticmethod]
    fn fit(py: Python<'_>, samples: Vec<(usize, usize, f64)>) -> PyResult<Self> {
        Ok(PyPrefillCostModel { inner: checked(py, PrefillCostModel::fit(&samples))? })
    }

    /// Seconds to prefill `prompt_tokens` of which `prefix_tokens` are cached.
    fn predict(&self, prompt_tokens: usize, prefix_tokens: usize) -> f64 {
        self.inner.predict(prompt_tokens, prefix_tokens)
    }

    fn __repr__(&self) -> String {
        let m = &self.inner;
        format!("PrefillCostModel(c0={:e}, c_new={:e}, c_new2={:e}, c_cross={:e})", m.c0, m.c_new, m.c_new2, m.c_cross)
    }
);

#[pyclass(name = "TransferCostModel", module = "mooncake_rs._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyTransferCostModel {
    pub inner: TransferCostModel,
}

inner_getters!(PyTransferCostModel {
        bytes_per_token: f64, network_bandwidth: f64, ssd_bandwidth: f64, latency_s: f64, dram_bandwidth: f64,
    }
    #[new]
    #[pyo3(signature = (bytes_per_token = None, network_bandwidth = None, ssd_bandwidth = None, latency_s = None,
                        dram_bandwidth = None))]
    fn new(
        py: Python<'_>,
        bytes_per_token: Option<f64>,
        network_bandwidth: Option<f64>,
        ssd_bandwidth: Option<f64>,
        latency_s: Option<f64>,
        dram_bandwidth: Option<f64>,
    ) -> PyResult<Self> {
        let inner = with_overrides!(TransferCostModel::default();
            bytes_per_token, network_bandwidth, ssd_bandwidth, latency_s, dram_bandwidth);
        checked(py, inner.validate())?;
        Ok(PyTransferCostModel { inner })
    }

    /// A copy with latency and network bandwidth fitted from (bytes, seconds) samples.
    fn fit(&self, py: Python<'_>, samples: Vec<(f64, f64)>) -> PyResult<Self> {
        Ok(PyTransferCostModel { inner: checked(py, self.inner.fit(&samples))? })
    }

    /// Seconds to fetch `tokens` from another instance, `ssd_fraction` of them from its SSD.
    #[pyo3(signature = (tokens, ssd_fraction = 0.0))]
    fn fetch(&self, tokens: usize, ssd_fraction: f64) -> f64 {
        self.inner.fetch(tokens, ssd_fraction.clamp(0.0, 1.0))
    }

    /// Seconds to load `tokens` from the local SSD.
    fn local_ssd(&self, tokens: usize) -> f64 {
        self.inner.local_ssd(tokens)
    }

    /// Seconds to copy `tokens` from the local DRAM to the device (0 with an infinite
    /// `dram_bandwidth`, the default).
    fn local_dram(&self, tokens: usize) -> f64 {
        self.inner.local_dram(tokens)
    }

    fn __repr__(&self) -> String {
        let m = &self.inner;
        format!(
            "TransferCostModel(bytes_per_token={}, network_bandwidth={:e}, ssd_bandwidth={:e}, latency_s={}, \
             dram_bandwidth={:e})",
            m.bytes_per_token, m.network_bandwidth, m.ssd_bandwidth, m.latency_s, m.dram_bandwidth
        )
    }
);

#[pyclass(name = "DecodeCostModel", module = "mooncake_rs._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyDecodeCostModel {
    pub inner: DecodeCostModel,
}

inner_getters!(PyDecodeCostModel { base_s: f64, per_seq_s: f64, per_token_s: f64 }
    #[new]
    #[pyo3(signature = (base_s = None, per_seq_s = None, per_token_s = None))]
    fn new(py: Python<'_>, base_s: Option<f64>, per_seq_s: Option<f64>, per_token_s: Option<f64>) -> PyResult<Self> {
        let inner = with_overrides!(DecodeCostModel::default(); base_s, per_seq_s, per_token_s);
        checked(py, inner.validate())?;
        Ok(PyDecodeCostModel { inner })
    }

    /// Least squares from (batch size, total context tokens, step seconds) samples.
    #[staticmethod]
    fn fit(py: Python<'_>, samples: Vec<(usize, f64, f64)>) -> PyResult<Self> {
        Ok(PyDecodeCostModel { inner: checked(py, DecodeCostModel::fit(&samples))? })
    }

    /// Seconds per decode step for `batch` sequences with `context_tokens` in total.
    fn predict(&self, batch: usize, context_tokens: f64) -> f64 {
        self.inner.predict(batch, context_tokens)
    }

    fn __repr__(&self) -> String {
        let m = &self.inner;
        format!("DecodeCostModel(base_s={}, per_seq_s={:e}, per_token_s={:e})", m.base_s, m.per_seq_s, m.per_token_s)
    }
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPrefillCostModel>()?;
    m.add_class::<PyTransferCostModel>()?;
    m.add_class::<PyDecodeCostModel>()?;
    Ok(())
}
