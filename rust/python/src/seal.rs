//! `RecordSealer` / `RecordOpener`: one direction each of a sealed session (core `seal`),
//! used by `mooncake_rs.net.sealed` for the control, client and relay links.

use mooncake_core::seal::{Opener, SealError, Sealer, HEADER_LEN};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::to_pyerr;
use crate::gil::detached;

/// Records larger than this are sealed and opened with the GIL released.
const DETACH_BYTES: usize = 64 * 1024;

#[pyclass(name = "RecordSealer", module = "mooncake_rs._core", frozen)]
pub struct PyRecordSealer {
    inner: Mutex<Sealer>,
}

#[pymethods]
impl PyRecordSealer {
    #[new]
    fn new(py: Python<'_>, key: &[u8]) -> PyResult<Self> {
        Ok(PyRecordSealer { inner: Mutex::new(Sealer::new(key).map_err(|e| to_pyerr(py, &e))?) })
    }

    /// One record (length header, ciphertext, tag) carrying `data` (at most 1 MiB).
    fn seal<'py>(&self, py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        let rec = if data.len() >= DETACH_BYTES {
            let owned = data.to_vec();
            detached(py, || self.inner.lock().seal(&owned))?
        } else {
            self.inner.lock().seal(data).map_err(|e| to_pyerr(py, &e))?
        };
        Ok(PyBytes::new(py, &rec))
    }
}

fn header_of(py: Python<'_>, header: &[u8]) -> PyResult<[u8; HEADER_LEN]> {
    header.try_into().map_err(|_| to_pyerr(py, &SealError::BadLength(header.len())))
}

#[pyclass(name = "RecordOpener", module = "mooncake_rs._core", frozen)]
pub struct PyRecordOpener {
    inner: Mutex<Opener>,
}

#[pymethods]
impl PyRecordOpener {
    #[new]
    fn new(py: Python<'_>, key: &[u8]) -> PyResult<Self> {
        Ok(PyRecordOpener { inner: Mutex::new(Opener::new(key).map_err(|e| to_pyerr(py, &e))?) })
    }

    /// How many bytes follow `header` (4 bytes); `Unauthorized` when out of bounds.
    #[staticmethod]
    fn body_length(py: Python<'_>, header: &[u8]) -> PyResult<usize> {
        Opener::body_length(&header_of(py, header)?).map_err(|e| to_pyerr(py, &e))
    }

    /// The plaintext of the next record; `Unauthorized` if it is not the next record the
    /// peer sealed in this session (the session is broken then: close it).
    fn open<'py>(&self, py: Python<'py>, header: &[u8], body: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        let h = header_of(py, header)?;
        let out = if body.len() >= DETACH_BYTES {
            let owned = body.to_vec();
            detached(py, || self.inner.lock().open(&h, &owned))?
        } else {
            self.inner.lock().open(&h, body).map_err(|e| to_pyerr(py, &e))?
        };
        Ok(PyBytes::new(py, &out))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRecordSealer>()?;
    m.add_class::<PyRecordOpener>()?;
    Ok(())
}
