//! `BlockCache`: the store's eviction policies over keys only (for the simulator).

use mooncake_core::store::BlockCache;
use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::convert::{hash_from_py, hashes_to_list};
use crate::errors::OrRaise;
use crate::gil::{detached_if, DETACH_KEYS};
use crate::keys::keys_from_py;

#[pyclass(name = "BlockCache", module = "mooncake_rs._core", frozen)]
pub struct PyBlockCache {
    inner: Mutex<BlockCache>,
}

#[pymethods]
impl PyBlockCache {
    #[new]
    #[pyo3(signature = (capacity_blocks, eviction = "lru"))]
    fn new(py: Python<'_>, capacity_blocks: usize, eviction: &str) -> PyResult<Self> {
        let c = BlockCache::new(capacity_blocks, eviction).or_raise(py)?;
        Ok(PyBlockCache { inner: Mutex::new(c) })
    }

    #[getter]
    fn capacity(&self) -> usize {
        self.inner.lock().capacity()
    }

    #[getter]
    fn eviction(&self) -> &'static str {
        self.inner.lock().policy_name()
    }

    /// Length of the leading run of `keys` already cached; touches them as one access.
    fn lookup_prefix(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = keys_from_py(keys)?;
        let inner = &self.inner;
        Ok(detached_if(py, keys.len() >= DETACH_KEYS, || inner.lock().lookup_prefix(&keys)))
    }

    /// Stores every key (a chain: position = index), touching those present, in order;
    /// returns the evicted keys.
    fn insert<'py>(&self, py: Python<'py>, keys: &Bound<'py, PyAny>) -> PyResult<Bound<'py, pyo3::types::PyList>> {
        let keys = keys_from_py(keys)?;
        let inner = &self.inner;
        let evicted = detached_if(py, keys.len() >= DETACH_KEYS, || inner.lock().insert(&keys));
        hashes_to_list(py, &evicted)
    }

    /// Records an access to `key`; False if it is not cached.
    fn touch(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let k = hash_from_py(key)?;
        Ok(self.inner.lock().touch(k))
    }

    fn remove(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let k = hash_from_py(key)?;
        Ok(self.inner.lock().remove(k))
    }

    fn contains(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let k = hash_from_py(key)?;
        Ok(self.inner.lock().contains(k))
    }

    fn __contains__(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.contains(key)
    }

    fn __len__(&self) -> usize {
        self.inner.lock().len()
    }

    /// Evictions so far.
    #[getter]
    fn evictions(&self) -> u64 {
        self.inner.lock().evictions()
    }

    fn __repr__(&self) -> String {
        let c = self.inner.lock();
        format!("BlockCache(capacity_blocks={}, eviction={:?}, len={})", c.capacity(), c.policy_name(), c.len())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBlockCache>()
}
