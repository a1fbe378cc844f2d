//! `BlockIndex`: which instance holds which block, in which tier.

use std::collections::BTreeMap;
use std::sync::Arc;

use mooncake_core::{BlockIndex, ErrorCategory, InstanceId, PrefixMatch};
use pyo3::prelude::*;

use crate::class_macros::inner_getters;
use crate::convert::{hash_from_py, parse_tier};
use crate::errors::{new_err, OrRaise};
use crate::gil::{detached, detached_if, detached_infallible, DETACH_KEYS};
use crate::keys::keys_from_py;

#[pyclass(name = "BlockIndex", module = "mooncake_rs._core", frozen)]
pub struct PyBlockIndex {
    /// Shared with a `Conductor` built over this index.
    pub inner: Arc<BlockIndex>,
}

/// Per-tier split of one instance's prefix match.
#[pyclass(name = "PrefixMatch", module = "mooncake_rs._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyPrefixMatch {
    pub inner: PrefixMatch,
}

inner_getters!(PyPrefixMatch {
        instance: InstanceId, dram: usize, ssd: usize,
        /// Blocks in the engine's own device cache (a block in several tiers counts in the fastest).
        gpu: usize,
    }
    /// gpu + dram + ssd.
    #[getter]
    fn total(&self) -> usize {
        self.inner.total()
    }

    fn __repr__(&self) -> String {
        let m = &self.inner;
        format!("PrefixMatch(instance={}, dram={}, ssd={}, gpu={})", m.instance, m.dram, m.ssd, m.gpu)
    }
);

#[pyclass(name = "IndexStats", module = "mooncake_rs._core", frozen, get_all)]
pub struct PyIndexStats {
    /// Distinct blocks.
    blocks: usize,
    /// (block, holder) pairs.
    entries: usize,
    instances: usize,
    memory_bytes: usize,
    /// instance → (dram entries, ssd entries).
    per_instance: BTreeMap<InstanceId, (usize, usize)>,
    /// instance → gpu entries (instances with any).
    per_instance_gpu: BTreeMap<InstanceId, usize>,
}

#[pymethods]
impl PyIndexStats {
    /// Heap bytes per (block, holder) entry.
    #[getter]
    fn bytes_per_entry(&self) -> f64 {
        self.memory_bytes as f64 / self.entries.max(1) as f64
    }

    fn __repr__(&self) -> String {
        format!(
            "IndexStats(blocks={}, entries={}, instances={}, memory_bytes={})",
            self.blocks, self.entries, self.instances, self.memory_bytes
        )
    }
}

#[pymethods]
impl PyBlockIndex {
    #[new]
    fn new() -> Self {
        PyBlockIndex { inner: Arc::new(BlockIndex::new()) }
    }

    /// Records that `instance` holds `hashes` in `tier`; returns how many entries are new.
    #[pyo3(signature = (instance, hashes, tier = "dram"))]
    fn insert(&self, py: Python<'_>, instance: InstanceId, hashes: &Bound<'_, PyAny>, tier: &str) -> PyResult<usize> {
        let tier = parse_tier(py, tier)?;
        let hashes = keys_from_py(hashes)?;
        let inner = &self.inner;
        if hashes.len() >= DETACH_KEYS {
            detached(py, || inner.insert(instance, &hashes, tier))
        } else {
            inner.insert(instance, &hashes, tier).or_raise(py)
        }
    }

    /// Forgets `hashes` on `instance` (in `tier`, or every tier); returns how many entries.
    #[pyo3(signature = (instance, hashes, tier = None))]
    fn remove(
        &self,
        py: Python<'_>,
        instance: InstanceId,
        hashes: &Bound<'_, PyAny>,
        tier: Option<&str>,
    ) -> PyResult<usize> {
        let tier = tier.map(|t| parse_tier(py, t)).transpose()?;
        let hashes = keys_from_py(hashes)?;
        let inner = &self.inner;
        Ok(detached_if(py, hashes.len() >= DETACH_KEYS, || inner.remove(instance, &hashes, tier)))
    }

    /// Drops every entry of `instance`; returns how many.
    fn remove_instance(&self, py: Python<'_>, instance: InstanceId) -> usize {
        let inner = &self.inner;
        detached_infallible(py, || inner.remove_instance(instance))
    }

    /// [(instance, tier), ...] holding `hash`, sorted.
    fn holders(&self, hash: &Bound<'_, PyAny>) -> PyResult<Vec<(InstanceId, &'static str)>> {
        let h = hash_from_py(hash)?;
        Ok(self.inner.holders(h).into_iter().map(|(i, t)| (i, t.name())).collect())
    }

    /// {instance: leading blocks of `hashes` it holds without a gap} for every instance
    /// holding at least the first block.
    fn match_prefix(&self, py: Python<'_>, hashes: &Bound<'_, PyAny>) -> PyResult<BTreeMap<InstanceId, usize>> {
        let hashes = keys_from_py(hashes)?;
        let inner = &self.inner;
        let m = detached_if(py, hashes.len() >= DETACH_KEYS, || inner.match_prefix(&hashes));
        Ok(m.into_iter().map(|x| (x.instance, x.total())).collect())
    }

    /// Like `match_prefix`, split into GPU, DRAM and SSD counts per instance.
    fn match_prefix_tiers(
        &self,
        py: Python<'_>,
        hashes: &Bound<'_, PyAny>,
    ) -> PyResult<BTreeMap<InstanceId, PyPrefixMatch>> {
        let hashes = keys_from_py(hashes)?;
        let inner = &self.inner;
        let m = detached_if(py, hashes.len() >= DETACH_KEYS, || inner.match_prefix(&hashes));
        Ok(m.into_iter().map(|x| (x.instance, PyPrefixMatch { inner: x })).collect())
    }

    /// (instance, matched blocks) of the longest match, or None.
    fn best_prefix(&self, py: Python<'_>, hashes: &Bound<'_, PyAny>) -> PyResult<Option<(InstanceId, usize)>> {
        let hashes = keys_from_py(hashes)?;
        let inner = &self.inner;
        let best = detached_if(py, hashes.len() >= DETACH_KEYS, || inner.best_prefix(&hashes));
        Ok(best.map(|m| (m.instance, m.total())))
    }

    /// Known instance ids, sorted.
    fn instances(&self) -> Vec<InstanceId> {
        self.inner.instances()
    }

    fn stats(&self, py: Python<'_>) -> PyIndexStats {
        let inner = &self.inner;
        let s = detached_infallible(py, || inner.stats());
        PyIndexStats {
            blocks: s.blocks,
            entries: s.entries,
            instances: s.instances,
            memory_bytes: s.memory_bytes,
            per_instance: s.per_instance.into_iter().map(|(i, d, s)| (i, (d, s))).collect(),
            per_instance_gpu: s.per_instance_gpu.into_iter().collect(),
        }
    }

    /// Raises `InternalError` if an internal invariant is broken (for tests).
    fn check_integrity(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        detached_infallible(py, || inner.check_integrity()).map_err(|msg| new_err(py, ErrorCategory::Internal, msg))
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __contains__(&self, hash: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(!self.inner.holders(hash_from_py(hash)?).is_empty())
    }

    fn __repr__(&self) -> String {
        format!("BlockIndex(blocks={}, instances={})", self.inner.len(), self.inner.instances().len())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBlockIndex>()?;
    m.add_class::<PyPrefixMatch>()?;
    m.add_class::<PyIndexStats>()?;
    Ok(())
}
