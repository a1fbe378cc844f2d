//! `EngineHashMap`: one instance's engine hash -> our hash map (core `interop::engine_map`),
//! on its own or as the view of an `EventIngestor`'s map (`Ingestor.map`).

use std::sync::Arc;

use mooncake_core::interop::{EngineHash, EngineHashMap, EventIngestor, KeyRef};
use mooncake_core::BlockHash;
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::convert::{hash_from_py, hash_to_py, hashes_to_list};
use crate::errors::invalid;

/// An engine hash from Python: an int in -2^63..2^64 or bytes; `None` for anything else.
pub fn engine_hash_from_py(obj: &Bound<'_, PyAny>) -> Option<EngineHash> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Some(EngineHash::Bytes(b.as_bytes().into()));
    }
    match obj.extract::<i128>() {
        Ok(v) if (-(1i128 << 63)..(1i128 << 64)).contains(&v) => Some(EngineHash::Int(v)),
        _ => None,
    }
}

/// Like [`engine_hash_from_py`], `InvalidArgument` naming the value otherwise.
pub fn engine_hash_arg(obj: &Bound<'_, PyAny>) -> PyResult<EngineHash> {
    engine_hash_from_py(obj).ok_or_else(|| {
        let shown = obj.repr().map(|r| r.to_string()).unwrap_or_default();
        invalid(obj.py(), format!("an engine block hash is an int in -2^63..2^64 or bytes, got {shown}"))
    })
}

/// A list (or any iterable) of engine hashes.
pub fn engine_hashes_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<EngineHash>> {
    if let Ok(list) = obj.cast::<PyList>() {
        return list.iter().map(|x| engine_hash_arg(&x)).collect();
    }
    obj.try_iter()?.map(|x| engine_hash_arg(&x?)).collect()
}

pub fn engine_hash_to_py<'py>(py: Python<'py>, k: KeyRef<'_>) -> PyResult<Bound<'py, PyAny>> {
    match k {
        KeyRef::Int(v) => Ok(v.into_pyobject(py)?.into_any()),
        KeyRef::Bytes(b) => Ok(PyBytes::new(py, b).into_any()),
    }
}

fn pairs_to_list<'py>(py: Python<'py>, pairs: &[(BlockHash, u8)]) -> PyResult<Bound<'py, PyList>> {
    let items = pairs
        .iter()
        .map(|&(o, m)| PyTuple::new(py, [hash_to_py(py, o)?, m.into_pyobject(py)?.into_any()]))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, items)
}

fn bit_arg(py: Python<'_>, what: &str, v: i64) -> PyResult<u8> {
    u8::try_from(v).map_err(|_| invalid(py, format!("{what} must be a media bit mask in 0..255, got {v}")))
}

fn group_arg(py: Python<'_>, v: i64) -> PyResult<u8> {
    u8::try_from(v).ok().filter(|&g| u32::from(g) < mooncake_core::interop::MAX_GROUPS).ok_or_else(|| {
        invalid(py, format!("group must be a group number in 0..{}, got {v}", mooncake_core::interop::MAX_GROUPS))
    })
}

/// Who owns the map.
enum Owner {
    Own(Mutex<EngineHashMap>),
    Ingestor(Arc<Mutex<EventIngestor>>),
}

#[pyclass(name = "EngineHashMap", module = "mooncake_rs._core", frozen)]
pub struct PyEngineHashMap {
    owner: Owner,
}

impl PyEngineHashMap {
    /// The map of an ingestor (what `Ingestor.map` shows).
    pub fn of_ingestor(ing: Arc<Mutex<EventIngestor>>) -> Self {
        PyEngineHashMap { owner: Owner::Ingestor(ing) }
    }

    fn with<R>(&self, f: impl FnOnce(&mut EngineHashMap) -> R) -> R {
        match &self.owner {
            Owner::Own(m) => f(&mut m.lock()),
            Owner::Ingestor(i) => f(i.lock().map_mut()),
        }
    }
}

#[pymethods]
impl PyEngineHashMap {
    #[new]
    #[pyo3(signature = (capacity = 1 << 20))]
    fn new(py: Python<'_>, capacity: i128) -> PyResult<Self> {
        let cap = usize::try_from(capacity).unwrap_or(0);
        let m = EngineHashMap::new(cap).map_err(|_| {
            invalid(py, format!("EngineHashMap capacity must be >= 1 (and at most 2^31), got {capacity}"))
        })?;
        Ok(PyEngineHashMap { owner: Owner::Own(Mutex::new(m)) })
    }

    #[getter]
    fn capacity(&self) -> usize {
        self.with(|m| m.capacity())
    }

    /// Entries dropped because the map was full.
    #[getter]
    fn evicted(&self) -> u64 {
        self.with(|m| m.evicted())
    }

    fn __len__(&self) -> usize {
        self.with(|m| m.len())
    }

    fn __contains__(&self, h: &Bound<'_, PyAny>) -> bool {
        match engine_hash_from_py(h) {
            Some(k) => self.with(|m| m.get(k.as_key()).is_some()),
            None => false,
        }
    }

    /// Our hash for an engine hash of `group` seen in a `BlockStored` (held or not).
    #[pyo3(signature = (h, group = 0))]
    fn ours<'py>(&self, py: Python<'py>, h: &Bound<'py, PyAny>, group: i64) -> PyResult<Option<Bound<'py, PyAny>>> {
        let group = group_arg(py, group)?;
        let Some(k) = engine_hash_from_py(h) else { return Ok(None) };
        self.with(|m| m.ours_in(k.as_key(), group)).map(|o| hash_to_py(py, o)).transpose()
    }

    /// The media bit mask that holds the block now (0: none or unknown).
    #[pyo3(signature = (h, group = 0))]
    fn media(&self, py: Python<'_>, h: &Bound<'_, PyAny>, group: i64) -> PyResult<u8> {
        let group = group_arg(py, group)?;
        Ok(match engine_hash_from_py(h) {
            Some(k) => self.with(|m| m.media_in(k.as_key(), group)),
            None => 0,
        })
    }

    /// Whether our block `ours` is held on a medium of `mask` by every group of the
    /// mask `deciding` (some entry of each maps to it and holds one of those media).
    #[pyo3(signature = (ours, mask, deciding = 1))]
    fn held(&self, ours: &Bound<'_, PyAny>, mask: i64, deciding: u64) -> PyResult<bool> {
        let mask = bit_arg(ours.py(), "mask", mask)?;
        let o = hash_from_py(ours)?;
        Ok(self.with(|m| m.held(o, mask, deciding)))
    }

    /// Records that `engine[i]` (= our `ours[i]`) of `group` is now held in medium
    /// `bit`; returns `(our old hash, media mask)` of entries whose engine hash now names
    /// other tokens (the caller checks `held` before dropping them).
    #[pyo3(signature = (engine, ours, bit, group = 0))]
    fn store<'py>(
        &self,
        py: Python<'py>,
        engine: &Bound<'py, PyAny>,
        ours: &Bound<'py, PyAny>,
        bit: i64,
        group: i64,
    ) -> PyResult<Bound<'py, PyList>> {
        let bit = bit_arg(py, "bit", bit)?;
        let group = group_arg(py, group)?;
        let keys = engine_hashes_arg(engine)?;
        let ours: Vec<BlockHash> = ours.try_iter()?.map(|x| hash_from_py(&x?)).collect::<PyResult<_>>()?;
        let refs: Vec<KeyRef<'_>> = keys.iter().map(|k| k.as_key()).collect();
        let mut replaced = Vec::new();
        self.with(|m| m.store(&refs, &ours, bit, group, &mut replaced));
        pairs_to_list(py, &replaced)
    }

    /// Clears medium `bit` for these engine hashes of `group`; returns our hashes whose
    /// index entry must go (no longer held on a medium of `same_key` by every group of
    /// `deciding`) and how many were unknown.
    #[pyo3(signature = (engine, bit, same_key, group = 0, deciding = 1))]
    fn remove<'py>(
        &self,
        py: Python<'py>,
        engine: &Bound<'py, PyAny>,
        bit: i64,
        same_key: i64,
        group: i64,
        deciding: u64,
    ) -> PyResult<(Bound<'py, PyList>, usize)> {
        let (bit, same) = (bit_arg(py, "bit", bit)?, bit_arg(py, "same_key", same_key)?);
        let group = group_arg(py, group)?;
        let mut out = Vec::new();
        let mut unknown = 0;
        // Hashes of no valid form are unknown, as a dict lookup would find nothing.
        let mut keys = Vec::new();
        for x in engine.try_iter()? {
            match engine_hash_from_py(&x?) {
                Some(k) => keys.push(k),
                None => unknown += 1,
            }
        }
        let refs: Vec<KeyRef<'_>> = keys.iter().map(|k| k.as_key()).collect();
        unknown += self.with(|m| m.remove(&refs, bit, same, group, deciding, &mut out));
        Ok((hashes_to_list(py, &out)?, unknown))
    }

    /// Drops the oldest entries beyond capacity; returns `(our hash, media mask)` of those still held.
    fn evict_overflow<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let mut out = Vec::new();
        self.with(|m| m.evict_overflow(&mut out));
        pairs_to_list(py, &out)
    }

    fn clear(&self) {
        self.with(|m| m.clear())
    }

    /// `(engine hash, our hash, media mask)` of every entry, oldest first.
    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let all: Vec<(EngineHash, BlockHash, u8)> =
            self.with(|m| m.iter().map(|(k, o, b)| (k.to_owned_hash(), o, b)).collect());
        let items = all
            .iter()
            .map(|(k, o, b)| {
                PyTuple::new(
                    py,
                    [engine_hash_to_py(py, k.as_key())?, hash_to_py(py, *o)?, b.into_pyobject(py)?.into_any()],
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(PyList::new(py, items)?.try_iter()?.into_any())
    }

    /// Heap bytes held.
    fn memory_bytes(&self) -> usize {
        self.with(|m| m.heap_bytes())
    }

    /// Raises `InternalError` if an internal invariant is broken (for tests).
    fn check_integrity(&self, py: Python<'_>) -> PyResult<()> {
        self.with(|m| m.check_integrity())
            .map_err(|msg| crate::errors::new_err(py, mooncake_core::ErrorCategory::Internal, msg))
    }

    fn __repr__(&self) -> String {
        self.with(|m| format!("EngineHashMap(len={}, capacity={}, evicted={})", m.len(), m.capacity(), m.evicted()))
    }
}
