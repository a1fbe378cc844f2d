//! `Xxh3RollingHasher`: the RFC standard rolling XXH3-64 sequence hash (core `hash_xxh3`).

use mooncake_core::Xxh3RollingHasher;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::convert::Tokens;
use crate::errors::{invalid, OrRaise};
use crate::hash::{hash_sequences, hash_tokens_arg};

#[pyclass(name = "Xxh3RollingHasher", module = "mooncake_rs._core", frozen)]
pub struct PyXxh3RollingHasher {
    pub inner: Xxh3RollingHasher,
}

fn parent_from_py(py: Python<'_>, parent: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    parent
        .map(|p| {
            p.extract::<u64>().map_err(|_| {
                invalid(
                    py,
                    format!(
                        "parent must be a sequence hash in 0..2^64-1, got {}",
                        p.repr().map(|r| r.to_string()).unwrap_or_default()
                    ),
                )
            })
        })
        .transpose()
}

#[pymethods]
impl PyXxh3RollingHasher {
    #[new]
    #[pyo3(signature = (block_size, seed = 0))]
    fn new(py: Python<'_>, block_size: i64, seed: u64) -> PyResult<Self> {
        if block_size < 1 {
            return Err(invalid(py, format!("block_size must be >= 1, got {block_size}")));
        }
        let inner = Xxh3RollingHasher::new(block_size as usize, seed).or_raise(py)?;
        Ok(PyXxh3RollingHasher { inner })
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[getter]
    fn seed(&self) -> u64 {
        self.inner.seed()
    }

    /// Rolling sequence hashes of every full block; `parent` continues a chain;
    /// `extras`: one `bytes | None` per full block, folded into the chain (our extension).
    #[pyo3(signature = (tokens, parent = None, extras = None))]
    fn hash<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        parent: Option<&Bound<'py, PyAny>>,
        extras: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let parent = parent_from_py(py, parent)?;
        let hashes = hash_tokens_arg(
            py,
            tokens,
            extras,
            |t| self.inner.hash_tokens(t, parent),
            |t, refs| self.inner.hash_tokens_with_extras(t, parent, refs),
        )?;
        PyList::new(py, hashes)
    }

    /// Per-block local hashes (no chaining).
    fn local_hashes<'py>(&self, py: Python<'py>, tokens: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let tokens = Tokens::extract(tokens)?;
        let hashes = tokens.with_u32(|t| self.inner.local_hashes(t));
        PyList::new(py, hashes)
    }

    /// `hash` of every sequence, in one call with the GIL released.
    fn hash_many<'py>(&self, py: Python<'py>, sequences: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyList>>> {
        let hasher = self.inner;
        let all = hash_sequences(py, sequences, move |t| hasher.hash_tokens(t, None))?;
        all.into_iter().map(|h| PyList::new(py, h)).collect()
    }

    fn __repr__(&self) -> String {
        format!("Xxh3RollingHasher(block_size={}, seed={})", self.inner.block_size(), self.inner.seed())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyXxh3RollingHasher>()
}
