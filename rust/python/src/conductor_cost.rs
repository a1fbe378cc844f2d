//! Cost-model classes of the conductor (`PrefillCostModel`, `TransferCostModel`,
//! `DecodeCostModel`): construct with coefficients, predict, or `fit` from samples.

use mooncake_core::conductor::{ConductorError, DecodeCostModel, PrefillCostModel, TransferCostModel};
use pyo3::prelude::*;

use crate::errors::to_pyerr;

fn err(py: Python<'_>, e: impl Into<ConductorError>) -> PyErr {
    to_pyerr(py, &e.into())
}

#[pyclass(name = "PrefillCostModel", module = "mooncake_rs._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyPrefillCostModel {
    pub inner: PrefillCostModel,
}

#[pymethods]
impl PyPrefillCostModel {
    #[new]
    #[pyo3(signature = (c0 = None, c_new = None, c_new2 = None, c_cross = None))]
    fn new(py: Python<'_>, c0: Option<f64>, c_new: Option<f64>, c_new2: Option<f64>, c_cross: Option<f64>) -> PyResult<Self> {
        let d = PrefillCostModel::default();
        let inner = PrefillCostModel {
            c0: c0.unwrap_or(d.c0),
            c_new: c_new.unwrap_or(d.c_new),
            c_new2: c_new2.unwrap_or(d.c_new2),
            c_cross: c_cross.unwrap_or(d.c_cross),
        };
        inner.validate().map_err(|e| err(py, e))?;
        Ok(PyPrefillCostModel { inner })
    }

    /// Least squares from (prompt tokens, cached prefix tokens, seconds) samples.
    #[staticmethod]
    fn fit(py: Python<'_>, samples: Vec<(usize, usize, f64)>) -> PyResult<Self> {
        Ok(PyPrefillCostModel { inner: PrefillCostModel::fit(&samples).map_err(|e| err(py, e))? })
    }

    /// Seconds to prefill `prompt_tokens` of which `prefix_tokens` are cached.
    fn predict(&self, prompt_tokens: usize, prefix_tokens: usize) -> f64 {
        self.inner.predict(prompt_tokens, prefix_tokens)
    }

    #[getter]
    fn c0(&self) -> f64 {
        self.inner.c0
    }
    #[getter]
    fn c_new(&self) -> f64 {
        self.inner.c_new
    }
    #[getter]
    fn c_new2(&self) -> f64 {
        self.inner.c_new2
    }
    #[getter]
    fn c_cross(&self) -> f64 {
        self.inner.c_cross
    }

    fn __repr__(&self) -> String {
        let m = &self.inner;
        format!("PrefillCostModel(c0={:e}, c_new={:e}, c_new2={:e}, c_cross={:e})", m.c0, m.c_new, m.c_new2, m.c_cross)
    }
}

#[pyclass(name = "TransferCostModel", module = "mooncake_rs._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyTransferCostModel {
    pub inner: TransferCostModel,
}

#[pymethods]
impl PyTransferCostModel {
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
        let d = TransferCostModel::default();
        let inner = TransferCostModel {
            bytes_per_token: bytes_per_token.unwrap_or(d.bytes_per_token),
            network_bandwidth: network_bandwidth.unwrap_or(d.network_bandwidth),
            ssd_bandwidth: ssd_bandwidth.unwrap_or(d.ssd_bandwidth),
            latency_s: latency_s.unwrap_or(d.latency_s),
            dram_bandwidth: dram_bandwidth.unwrap_or(d.dram_bandwidth),
        };
        inner.validate().map_err(|e| err(py, e))?;
        Ok(PyTransferCostModel { inner })
    }

    /// A copy with latency and network bandwidth fitted from (bytes, seconds) samples.
    fn fit(&self, py: Python<'_>, samples: Vec<(f64, f64)>) -> PyResult<Self> {
        Ok(PyTransferCostModel { inner: self.inner.fit(&samples).map_err(|e| err(py, e))? })
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

    #[getter]
    fn bytes_per_token(&self) -> f64 {
        self.inner.bytes_per_token
    }
    #[getter]
    fn network_bandwidth(&self) -> f64 {
        self.inner.network_bandwidth
    }
    #[getter]
    fn ssd_bandwidth(&self) -> f64 {
        self.inner.ssd_bandwidth
    }
    #[getter]
    fn latency_s(&self) -> f64 {
        self.inner.latency_s
    }
    #[getter]
    fn dram_bandwidth(&self) -> f64 {
        self.inner.dram_bandwidth
    }

    fn __repr__(&self) -> String {
        let m = &self.inner;
        format!(
            "TransferCostModel(bytes_per_token={}, network_bandwidth={:e}, ssd_bandwidth={:e}, latency_s={}, \
             dram_bandwidth={:e})",
            m.bytes_per_token, m.network_bandwidth, m.ssd_bandwidth, m.latency_s, m.dram_bandwidth
        )
    }
}

#[pyclass(name = "DecodeCostModel", module = "mooncake_rs._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyDecodeCostModel {
    pub inner: DecodeCostModel,
}

#[pymethods]
impl PyDecodeCostModel {
    #[new]
    #[pyo3(signature = (base_s = None, per_seq_s = None, per_token_s = None))]
    fn new(py: Python<'_>, base_s: Option<f64>, per_seq_s: Option<f64>, per_token_s: Option<f64>) -> PyResult<Self> {
        let d = DecodeCostModel::default();
        let inner = DecodeCostModel {
            base_s: base_s.unwrap_or(d.base_s),
            per_seq_s: per_seq_s.unwrap_or(d.per_seq_s),
            per_token_s: per_token_s.unwrap_or(d.per_token_s),
        };
        inner.validate().map_err(|e| err(py, e))?;
        Ok(PyDecodeCostModel { inner })
    }

    /// Least squares from (batch size, total context tokens, step seconds) samples.
    #[staticmethod]
    fn fit(py: Python<'_>, samples: Vec<(usize, f64, f64)>) -> PyResult<Self> {
        Ok(PyDecodeCostModel { inner: DecodeCostModel::fit(&samples).map_err(|e| err(py, e))? })
    }

    /// Seconds per decode step for `batch` sequences with `context_tokens` in total.
    fn predict(&self, batch: usize, context_tokens: f64) -> f64 {
        self.inner.predict(batch, context_tokens)
    }

    #[getter]
    fn base_s(&self) -> f64 {
        self.inner.base_s
    }
    #[getter]
    fn per_seq_s(&self) -> f64 {
        self.inner.per_seq_s
    }
    #[getter]
    fn per_token_s(&self) -> f64 {
        self.inner.per_token_s
    }

    fn __repr__(&self) -> String {
        let m = &self.inner;
        format!("DecodeCostModel(base_s={}, per_seq_s={:e}, per_token_s={:e})", m.base_s, m.per_seq_s, m.per_token_s)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPrefillCostModel>()?;
    m.add_class::<PyTransferCostModel>()?;
    m.add_class::<PyDecodeCostModel>()?;
    Ok(())
}
