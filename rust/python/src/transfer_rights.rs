//! `TransferEngine.grant` / `revoke` / `grants` and `TransferGrant`: per-peer rights on
//! restricted regions (the rule itself lives in the core's `region::check_access`).

use std::time::Instant;

use mooncake_core::transfer::{Engine, Grant, RegionId, TransferError};
use pyo3::prelude::*;

use crate::errors::to_pyerr;
use crate::transfer::dur;

/// One live grant of a restricted region.
#[pyclass(name = "TransferGrant", module = "mooncake_rs._core", frozen, get_all)]
pub struct PyTransferGrant {
    id: u64,
    /// The engine name of the peer it is made out to.
    peer: String,
    offset: u64,
    length: u64,
    /// Whether it allows writes (a grant always allows reads of its range).
    write: bool,
    /// Seconds until it expires (None: until revoked).
    expires_in_s: Option<f64>,
}

#[pymethods]
impl PyTransferGrant {
    fn __repr__(&self) -> String {
        format!(
            "TransferGrant(id={}, peer={:?}, offset={}, length={}, write={}, expires_in_s={:?})",
            self.id, self.peer, self.offset, self.length, self.write, self.expires_in_s
        )
    }
}

fn to_py(g: Grant, now: Instant) -> PyTransferGrant {
    PyTransferGrant {
        id: g.id,
        peer: g.peer,
        offset: g.offset,
        length: g.len,
        write: g.write,
        expires_in_s: g.expires.map(|t| t.saturating_duration_since(now).as_secs_f64()),
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn grant(
    py: Python<'_>,
    e: &Engine,
    region: RegionId,
    peer: &str,
    offset: u64,
    length: u64,
    write: bool,
    expires_s: Option<f64>,
) -> PyResult<u64> {
    let expires = expires_s.map(|s| dur(py, "expires_s", s)).transpose()?;
    // A huge expiry (1e300) is "never" rather than an error.
    let expires = expires.filter(|d| Instant::now().checked_add(*d).is_some());
    e.grant(region, peer, offset, length, write, expires).map_err(|x: TransferError| to_pyerr(py, &x))
}

pub(crate) fn revoke(
    py: Python<'_>,
    e: &Engine,
    region: RegionId,
    peer: &str,
    grant_id: Option<u64>,
) -> PyResult<usize> {
    e.revoke(region, peer, grant_id).map_err(|x| to_pyerr(py, &x))
}

pub(crate) fn grants(py: Python<'_>, e: &Engine, region: RegionId) -> PyResult<Vec<PyTransferGrant>> {
    let now = Instant::now();
    Ok(e.grants(region).map_err(|x| to_pyerr(py, &x))?.into_iter().map(|g| to_py(g, now)).collect())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTransferGrant>()
}
