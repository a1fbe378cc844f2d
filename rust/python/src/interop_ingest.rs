//! `EventIngestor`: one engine instance's KV event payloads applied to block indexes in
//! one call per message (core `interop::ingest`). Python keeps the socket and the
//! choice of index per medium (`Ingestor` in `mooncake_rs/interop/ingest.py`).

use std::sync::Arc;

use mooncake_core::interop::{ChainHasher, EventIngestor, KeyRef, Sink, Step, StoredMeta, Tokens};
use mooncake_core::{InstanceId, Tier};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyBytes, PyDict};

use crate::convert::{extras_arg, extras_refs, BufferView, Tokens as PyTokens};
use crate::errors::{invalid, OrRaise};
use crate::gil::{detached_if, detached_infallible, DETACH_EVENT_BYTES};
use crate::hash::PyPrefixHasher;
use crate::hash_xxh3::PyXxh3RollingHasher;
use crate::index::PyBlockIndex;
use crate::interop_map::{engine_hash_arg, engine_hashes_arg, PyEngineHashMap};

#[pyclass(name = "EventIngestor", module = "mooncake_rs._core", frozen)]
pub struct PyEventIngestor {
    inner: Arc<Mutex<EventIngestor>>,
}

fn chain_hasher(obj: &Bound<'_, PyAny>) -> PyResult<ChainHasher> {
    if let Ok(h) = obj.cast::<PyPrefixHasher>() {
        return Ok(ChainHasher::Prefix(h.get().inner.clone()));
    }
    if let Ok(h) = obj.cast::<PyXxh3RollingHasher>() {
        return Ok(ChainHasher::Rfc(h.get().inner));
    }
    let t = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
    Err(invalid(obj.py(), format!("hasher must be a PrefixHasher or an Xxh3RollingHasher, got {t}")))
}

fn step_to_py(step: Step) -> Option<(usize, String)> {
    match step {
        Step::Done => None,
        Step::NeedMedium { event, name } => Some((event, name)),
    }
}

#[pymethods]
impl PyEventIngestor {
    /// `clear`: the indexes an `AllBlocksCleared` drops `slot` from, besides those of the
    /// media registered later.
    #[new]
    #[pyo3(signature = (slot, hasher, map_capacity = 1 << 20, clear = Vec::new()))]
    fn new(
        py: Python<'_>,
        slot: InstanceId,
        hasher: &Bound<'_, PyAny>,
        map_capacity: i128,
        clear: Vec<PyRef<'_, PyBlockIndex>>,
    ) -> PyResult<Self> {
        let hasher = chain_hasher(hasher)?;
        let cap = usize::try_from(map_capacity).unwrap_or(0);
        let clear = clear.iter().map(|i| i.inner.clone()).collect();
        let ing = EventIngestor::new(slot, hasher, cap, clear)
            .map_err(|_| invalid(py, format!("map_capacity must be >= 1 (and at most 2^31), got {map_capacity}")))?;
        Ok(PyEventIngestor { inner: Arc::new(Mutex::new(ing)) })
    }

    #[getter]
    fn slot(&self) -> InstanceId {
        self.inner.lock().slot()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.lock().block_size()
    }

    /// The engine hash map (a view: it changes as events are applied).
    #[getter]
    fn map(&self) -> PyEngineHashMap {
        PyEngineHashMap::of_ingestor(self.inner.clone())
    }

    /// Gives the next media bit to canonical medium `name`: its blocks go to `index`
    /// under the target key `key`, in `tier` (`None`: inserted as `dram`, removed from
    /// every tier).
    #[pyo3(signature = (name, key, index, tier = None))]
    fn add_medium(
        &self,
        py: Python<'_>,
        name: &str,
        key: &str,
        index: PyRef<'_, PyBlockIndex>,
        tier: Option<&str>,
    ) -> PyResult<()> {
        let tier = tier.map(Tier::parse).transpose().or_raise(py)?;
        let sink = Sink { index: index.inner.clone(), tier };
        self.inner.lock().add_medium(name, key, sink).or_raise(py)
    }

    /// The registered media in bit order: `[(canonical name, key), ...]`.
    fn media(&self) -> Vec<(String, String)> {
        self.inner.lock().media()
    }

    /// Applies one message's msgpack payload (an event batch). Returns `None` when
    /// done, or `(event, medium)` when event `event` names a medium not registered yet
    /// (nothing of it applied): `add_medium` it, then call again with `resume=event`.
    /// Raises `MalformedEvent` (nothing applied when the batch does not decode; the
    /// events before a bad `token_ids` stay applied).
    #[pyo3(signature = (payload, resume = None))]
    fn apply_payload(
        &self,
        py: Python<'_>,
        payload: &Bound<'_, PyAny>,
        resume: Option<usize>,
    ) -> PyResult<Option<(usize, String)>> {
        let inner = &self.inner;
        let got = if let Ok(b) = payload.cast::<PyBytes>() {
            let bytes = b.as_bytes(); // immutable: safe to read with the GIL released
            detached_if(py, bytes.len() >= DETACH_EVENT_BYTES, || inner.lock().apply_payload(bytes, resume))
        } else {
            let view = BufferView::get_contiguous(payload, "payload")?;
            inner.lock().apply_payload(view.bytes(), resume)
        };
        got.map(step_to_py).or_raise(py)
    }

    /// Decodes a payload without applying it: raises `MalformedEvent` where
    /// `apply_payload` would change nothing.
    #[staticmethod]
    fn check_payload(py: Python<'_>, payload: &Bound<'_, PyAny>) -> PyResult<()> {
        let view = BufferView::get_contiguous(payload, "payload")?;
        EventIngestor::check_payload(view.bytes()).or_raise(py)
    }

    /// Counts a batch applied event by event (`stored` / `removed` / `cleared`) and its
    /// events of unknown types.
    #[pyo3(signature = (unknown = 0, batches = 1))]
    fn count_batch(&self, unknown: u64, batches: u64) {
        self.inner.lock().count_batch(batches, unknown)
    }

    /// One `BlockStored` from Python objects. `raw`: `tokens` is the msgpack bytes of
    /// the token ids (a `msgspec.Raw`); otherwise a list or an integer array. Returns a
    /// medium name to register first (then call again), or `None`. `extras`: the
    /// `extra_keys` entries as msgpack bytes (one `bytes | None` per block); `group_idx`
    /// and `kind` (`kv_cache_spec_kind`): its KV cache group.
    #[pyo3(signature = (hashes, parent, tokens, block_size, medium, raw = false, extras = None, group_idx = None, kind = None))]
    #[allow(clippy::too_many_arguments)]
    fn stored(
        &self,
        py: Python<'_>,
        hashes: &Bound<'_, PyAny>,
        parent: Option<&Bound<'_, PyAny>>,
        tokens: &Bound<'_, PyAny>,
        block_size: i128,
        medium: Option<&str>,
        raw: bool,
        extras: Option<&Bound<'_, PyAny>>,
        group_idx: Option<i128>,
        kind: Option<&str>,
    ) -> PyResult<Option<String>> {
        let keys = engine_hashes_arg(hashes)?;
        if keys.is_empty() {
            return Ok(None);
        }
        let extras = extras_arg(py, extras)?;
        let extras = extras_refs(&extras);
        let meta = StoredMeta { extras: &extras, group_idx, kind };
        let parent = parent.map(engine_hash_arg).transpose()?;
        let refs: Vec<KeyRef<'_>> = keys.iter().map(|k| k.as_key()).collect();
        let parent = parent.as_ref().map(|p| p.as_key());
        let mut ing = self.inner.lock();
        let got = if raw {
            let view = BufferView::get_contiguous(tokens, "token_ids")?;
            ing.stored(&refs, parent, Tokens::Msgpack(view.bytes()), block_size, medium, meta)
        } else {
            match PyTokens::extract(tokens) {
                Ok(t) => t.with_u32(|s| ing.stored(&refs, parent, Tokens::U32(s), block_size, medium, meta)),
                Err(e) => {
                    drop(ing);
                    let len = tokens.len()?;
                    let message = e.value(py).str().map(|s| s.to_string()).unwrap_or_default();
                    self.inner.lock().stored(&refs, parent, Tokens::Invalid { len, message }, block_size, medium, meta)
                }
            }
        };
        got.or_raise(py)
    }

    /// One `BlockRemoved`. Returns a medium name to register first, or `None`.
    #[pyo3(signature = (hashes, medium, group_idx = None))]
    fn removed(
        &self,
        hashes: &Bound<'_, PyAny>,
        medium: Option<&str>,
        group_idx: Option<i128>,
    ) -> PyResult<Option<String>> {
        let keys = engine_hashes_arg(hashes)?;
        let refs: Vec<KeyRef<'_>> = keys.iter().map(|k| k.as_key()).collect();
        Ok(self.inner.lock().removed(&refs, medium, group_idx))
    }

    /// The KV cache groups seen so far: `[(group_idx, full attention), ...]` (nil is 0).
    fn groups(&self) -> Vec<(i128, bool)> {
        self.inner.lock().groups()
    }

    /// `AllBlocksCleared`.
    fn cleared(&self, py: Python<'_>) {
        let inner = &self.inner;
        detached_infallible(py, || inner.lock().cleared())
    }

    /// Forgets the map and counts a reset (the caller drops the index entries).
    fn reset_map(&self) {
        self.inner.lock().reset_map()
    }

    /// The counters, by name (`evicted` is the map's).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let counters = self.inner.lock().counters();
        counters.into_py_dict(py)
    }

    fn __repr__(&self) -> String {
        let ing = self.inner.lock();
        format!("EventIngestor(slot={}, block_size={}, map={})", ing.slot(), ing.block_size(), ing.map().len())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEventIngestor>()?;
    m.add_class::<PyEngineHashMap>()?;
    Ok(())
}
