//! `Store`: the tiered block store; `StoreRegion` (what a transfer engine registers),
//! `StoreEvent`, `StoreStats`. The views (`Block`, `WritableBlock`) are in
//! `store_block.rs`.

use std::sync::Arc;

use mooncake_core::mem::MappedMemory;
use mooncake_core::store::{
    AddressedChunk, AddressedObject, BlockRef, Store, StoreConfig, StoreError, StoreEvent, StoreStats,
};
use mooncake_core::BlockHash;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::convert::{hash_from_py, hash_to_py, BufferView};
use crate::errors::{invalid, OrRaise};
use crate::gil::{detached_if, detached_infallible, RawBytes, DETACH_STORE_BYTES};
use crate::keys::keys_from_py;
use crate::store_block::{PyBlock, PyWritableBlock};
use crate::store_events::PyStoreEvents;
use crate::store_object::PyReservedObject;
use crate::store_run::PyLeasedRun;

/// The tiered block store (DRAM slots, optional SSD tier).
#[pyclass(name = "Store", module = "mooncake_rs._core", frozen)]
pub struct PyStore {
    /// Shared with the views it hands out (a `WritableBlock` commits through it).
    pub inner: Arc<Store>,
}

/// The store's DRAM arena, for registering with a transfer engine. Keeps it mapped.
#[pyclass(name = "StoreRegion", module = "mooncake_rs._core", frozen)]
pub struct PyStoreRegion {
    /// Bytes of the arena.
    #[pyo3(get)]
    length: usize,
    /// POSIX shm name (another process maps it with it), or None for private memory.
    #[pyo3(get)]
    shm_name: Option<String>,
    #[pyo3(get)]
    block_bytes: usize,
    #[pyo3(get)]
    slots: usize,
    /// Bytes between the starts of two slots (block_bytes rounded up to a page).
    #[pyo3(get)]
    slot_stride: usize,
    memory: Arc<MappedMemory>,
}

impl PyStoreRegion {
    /// The mapping behind this region (what the transfer engine registers).
    pub fn memory(&self) -> Arc<MappedMemory> {
        self.memory.clone()
    }
}

#[pymethods]
impl PyStoreRegion {
    fn __repr__(&self) -> String {
        format!(
            "StoreRegion(length={}, shm_name={:?}, block_bytes={}, slots={})",
            self.length, self.shm_name, self.block_bytes, self.slots
        )
    }
}

/// One store event, for the conductor's index.
#[pyclass(name = "StoreEvent", module = "mooncake_rs._core", frozen, eq)]
#[derive(PartialEq)]
pub struct PyStoreEvent {
    pub(crate) inner: StoreEvent,
}

#[pymethods]
impl PyStoreEvent {
    /// "stored", "evicted", "demoted", "promoted" or "removed".
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.kind.name()
    }

    #[getter]
    fn key<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        hash_to_py(py, self.inner.key)
    }

    /// "dram" or "ssd": the tier the event happened in.
    #[getter]
    fn tier(&self) -> &'static str {
        self.inner.tier.name()
    }

    fn __repr__(&self) -> String {
        format!("StoreEvent(kind={:?}, key={:#x}, tier={:?})", self.kind(), self.inner.key, self.tier())
    }
}

impl From<StoreEvent> for PyStoreEvent {
    fn from(inner: StoreEvent) -> Self {
        PyStoreEvent { inner }
    }
}

macro_rules! stats_class {
    ($($field:ident),* $(,)?) => {
        /// Counters and occupancy of a store (see docs/store.md for each field).
        #[pyclass(name = "StoreStats", module = "mooncake_rs._core", frozen, get_all)]
        pub struct PyStoreStats { $($field: u64,)* }

        impl From<StoreStats> for PyStoreStats {
            fn from(s: StoreStats) -> Self {
                PyStoreStats { $($field: s.$field,)* }
            }
        }

        #[pymethods]
        impl PyStoreStats {
            /// The fields as a dict.
            fn as_dict(&self) -> std::collections::BTreeMap<&'static str, u64> {
                [$((stringify!($field), self.$field),)*].into_iter().collect()
            }

            fn __repr__(&self) -> String {
                let parts: Vec<String> = vec![$(format!("{}={}", stringify!($field), self.$field),)*];
                format!("StoreStats({})", parts.join(", "))
            }
        }
    };
}

stats_class!(
    puts,
    hits_dram,
    hits_ssd,
    misses,
    evictions_dram,
    evictions_ssd,
    demotions,
    demotions_dropped,
    demotion_failures,
    promotions,
    corrupt_dropped,
    recovered,
    events_dropped,
    blocks_dram,
    blocks_ssd,
    bytes_dram,
    bytes_ssd,
    slots_dram,
    slots_ssd,
    pinned,
    demotion_queue,
);

impl PyStore {
    fn block(&self, key: BlockHash, b: Option<BlockRef>) -> Option<PyBlock> {
        b.map(|b| PyBlock::new(key, b))
    }

    fn run<T: Send>(&self, py: Python<'_>, bytes: usize, f: impl FnOnce(&Store) -> T + Send) -> T {
        let s = &*self.inner;
        detached_if(py, bytes >= DETACH_STORE_BYTES, || f(s))
    }
}

#[pymethods]
impl PyStore {
    #[new]
    #[pyo3(signature = (block_bytes, dram_bytes, ssd_path = None, ssd_bytes = 0, eviction = "lru",
                        shared_memory = false, demotion_queue = 64))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        block_bytes: usize,
        dram_bytes: usize,
        ssd_path: Option<std::path::PathBuf>,
        ssd_bytes: u64,
        eviction: &str,
        shared_memory: bool,
        demotion_queue: usize,
    ) -> PyResult<Self> {
        let cfg = StoreConfig {
            block_bytes,
            dram_bytes,
            ssd_path,
            ssd_bytes,
            eviction: eviction.to_string(),
            shared_memory,
            demotion_queue,
            ..Default::default()
        };
        let store = detached_infallible(py, || Store::open(cfg)).or_raise(py)?;
        Ok(PyStore { inner: Arc::new(store) })
    }

    #[getter]
    fn block_bytes(&self) -> usize {
        self.inner.block_bytes()
    }

    /// DRAM slots.
    #[getter]
    fn slots(&self) -> usize {
        self.inner.slots()
    }

    #[getter]
    fn eviction(&self) -> String {
        self.inner.config().eviction.clone()
    }

    /// Stores a copy of `data` (exactly block_bytes); False if `key` exists already.
    fn put(&self, py: Python<'_>, key: &Bound<'_, PyAny>, data: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = hash_from_py(key)?;
        let view = BufferView::get_contiguous(data, "data")?;
        let p = RawBytes::new(view.as_ptr(), view.len_bytes());
        // SAFETY: `view` keeps the export alive across the call.
        self.run(py, p.len(), move |s| s.put(key, unsafe { p.slice() })).or_raise(py)
    }

    /// Stores a copy of `data` (1..=block_bytes bytes) at the front of a zeroed block;
    /// False if `key` exists already. (A small value needs no padded copy in Python.)
    fn put_padded(&self, py: Python<'_>, key: &Bound<'_, PyAny>, data: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = hash_from_py(key)?;
        let view = BufferView::get_contiguous(data, "data")?;
        let p = RawBytes::new(view.as_ptr(), view.len_bytes());
        // SAFETY: `view` keeps the export alive across the call.
        self.run(py, p.len(), move |s| s.put_padded(key, unsafe { p.slice() })).or_raise(py)
    }

    /// Stores a chain of blocks (chain positions 0..n). `datas` is a sequence of
    /// buffers, or one buffer of len(keys) * block_bytes bytes.
    fn put_many(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, datas: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let keys = keys_from_py(keys)?;
        if let Ok(Some(one)) = BufferView::get(datas, pyo3::ffi::PyBUF_C_CONTIGUOUS) {
            let p = RawBytes::new(one.as_ptr(), one.len_bytes());
            // SAFETY: `one` keeps the export alive across the call.
            return self.run(py, p.len(), move |s| s.put_many_packed(&keys, unsafe { p.slice() })).or_raise(py);
        }
        let items: Vec<Bound<'_, PyAny>> = datas
            .try_iter()
            .map_err(|_| invalid(py, "datas must be a sequence of buffers or one buffer"))?
            .collect::<PyResult<_>>()?;
        if items.len() != keys.len() {
            return Err(invalid(py, format!("{} keys but {} datas", keys.len(), items.len())));
        }
        let views = items.iter().map(|it| BufferView::get_contiguous(it, "each data")).collect::<PyResult<Vec<_>>>()?;
        let ranges: Vec<RawBytes> = views.iter().map(|v| RawBytes::new(v.as_ptr(), v.len_bytes())).collect();
        self.run(py, ranges.iter().map(RawBytes::len).sum(), move |s| {
            // SAFETY: every range belongs to an export held in `views` for the call.
            let items: Vec<(BlockHash, &[u8])> =
                keys.iter().zip(ranges).map(|(k, p)| (*k, unsafe { p.slice() })).collect();
            s.put_many(&items)
        })
        .or_raise(py)
    }

    /// Writes the DRAM blocks of `keys` into the SSD tier now (write-through, so they
    /// survive this process); per key, whether it is on disk afterwards.
    fn persist(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let keys = keys_from_py(keys)?;
        let s = &*self.inner;
        detached_infallible(py, || s.persist(&keys)).or_raise(py)
    }

    /// Stores `data` (exactly block_bytes) in the SSD tier only, written now; False if
    /// `key` exists already or the write failed.
    fn put_ssd(&self, py: Python<'_>, key: &Bound<'_, PyAny>, data: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = hash_from_py(key)?;
        let view = BufferView::get_contiguous(data, "data")?;
        let p = RawBytes::new(view.as_ptr(), view.len_bytes());
        let s = &*self.inner;
        // SAFETY: `view` keeps the export alive across the call.
        detached_infallible(py, move || s.put_ssd(key, unsafe { p.slice() })).or_raise(py)
    }

    /// Stores one chunk per key, copied from memory given by address: `addrs[i]`,
    /// `lens[i]` bytes (at most block_bytes; the slot's rest is zero-filled). One call
    /// for a whole batch, without the GIL, large batches copied by several threads.
    /// Per key: True if stored now, False if stored already. StoreFull (nothing stored)
    /// when the whole batch does not fit. The caller vouches for the addresses.
    fn put_from_addresses(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        addrs: Vec<usize>,
        lens: Vec<usize>,
    ) -> PyResult<Vec<bool>> {
        let chunks = AddressedChunk::zip(&keys_from_py(keys)?, &addrs, &lens).or_raise(py)?;
        let s = &*self.inner;
        // SAFETY: the addresses are the caller's readable memory (this method's contract,
        // as for a transfer engine's registered buffers).
        detached_infallible(py, || unsafe { s.put_from_addresses(&chunks) }).or_raise(py)
    }

    /// Copies the first `lens[i]` bytes of each key's block to `addrs[i]` (disjoint,
    /// writable ranges), one call for the batch; per key, whether it was found.
    #[pyo3(signature = (keys, addrs, lens, promote = true))]
    fn get_into_addresses(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        addrs: Vec<usize>,
        lens: Vec<usize>,
        promote: bool,
    ) -> PyResult<Vec<bool>> {
        let chunks = AddressedChunk::zip(&keys_from_py(keys)?, &addrs, &lens).or_raise(py)?;
        let s = &*self.inner;
        // SAFETY: the addresses are the caller's writable, disjoint memory (the contract).
        detached_infallible(py, || unsafe { s.get_into_addresses(&chunks, promote) }).or_raise(py)
    }

    /// `put_from_addresses` of whole objects: object `i` is `sizes[i]` bytes at
    /// `addrs[i]`, stored as chunks of block_bytes keyed `oids[i] | j` (the low bits of an
    /// id must be zero). Per object: True if every chunk was stored now.
    fn put_objects_from(
        &self,
        py: Python<'_>,
        oids: &Bound<'_, PyAny>,
        addrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Vec<bool>> {
        let objects = AddressedObject::zip(&keys_from_py(oids)?, &addrs, &sizes).or_raise(py)?;
        let s = &*self.inner;
        // SAFETY: the addresses are the caller's readable memory (the contract).
        detached_infallible(py, || unsafe { s.put_objects_from(&objects) }).or_raise(py)
    }

    /// `get_into_addresses` of whole objects, chunked as `put_objects_from`; per object,
    /// whether every chunk was found.
    #[pyo3(signature = (oids, addrs, sizes, promote = true))]
    fn get_objects_into(
        &self,
        py: Python<'_>,
        oids: &Bound<'_, PyAny>,
        addrs: Vec<usize>,
        sizes: Vec<usize>,
        promote: bool,
    ) -> PyResult<Vec<bool>> {
        let objects = AddressedObject::zip(&keys_from_py(oids)?, &addrs, &sizes).or_raise(py)?;
        let s = &*self.inner;
        // SAFETY: the addresses are the caller's writable, disjoint memory (the contract).
        detached_infallible(py, || unsafe { s.get_objects_into(&objects, promote) }).or_raise(py)
    }

    /// Slots for whole objects, one call a batch: object `i` is `nchunks[i]` chunks keyed
    /// `oids[i] | j` (the low bits of an id must be zero). Per object a `ReservedObject`,
    /// or None when its chunks do not all fit beside what is leased, pinned or reserved
    /// (then none of its slots is kept).
    fn reserve_objects(
        &self,
        py: Python<'_>,
        oids: &Bound<'_, PyAny>,
        nchunks: Vec<usize>,
    ) -> PyResult<Vec<Option<PyReservedObject>>> {
        let oids = keys_from_py(oids)?;
        if oids.len() != nchunks.len() {
            return Err(invalid(
                py,
                format!("{} object ids and {} chunk counts: give one count per object", oids.len(), nchunks.len()),
            ));
        }
        let mut out = Vec::with_capacity(oids.len());
        for (&oid, &n) in oids.iter().zip(&nchunks) {
            match self.inner.reserve_object(oid, n) {
                Ok(obj) => out.push(Some(PyReservedObject::new(self.inner.clone(), obj))),
                Err(StoreError::Full { .. }) => out.push(None),
                Err(e) => return Err(e).or_raise(py),
            }
        }
        Ok(out)
    }

    /// Leases on whole objects, one call a batch (chunks keyed as `reserve_objects`): per
    /// object a `LeasedRun` of all its `nchunks[i]` chunks, or None (nothing held) when
    /// any is missing. From SSD promoted into DRAM unless `promote=False`.
    #[pyo3(signature = (oids, nchunks, promote = true))]
    fn lease_objects(
        &self,
        py: Python<'_>,
        oids: &Bound<'_, PyAny>,
        nchunks: Vec<usize>,
        promote: bool,
    ) -> PyResult<Vec<Option<PyLeasedRun>>> {
        let oids = keys_from_py(oids)?;
        if oids.len() != nchunks.len() {
            return Err(invalid(
                py,
                format!("{} object ids and {} chunk counts: give one count per object", oids.len(), nchunks.len()),
            ));
        }
        let s = &*self.inner;
        // (detached: a chunk on SSD is read back into DRAM here)
        let found = detached_infallible(py, || {
            oids.iter().zip(&nchunks).map(|(&oid, &n)| s.lease_object(oid, n, promote)).collect::<Result<Vec<_>, _>>()
        })
        .or_raise(py)?;
        Ok(oids
            .iter()
            .zip(&nchunks)
            .zip(found)
            .map(|((&oid, &n), leases)| {
                leases.map(|l| {
                    let keys: Vec<BlockHash> = (0..n).map(|j| oid | j as BlockHash).collect();
                    PyLeasedRun::new(Arc::new(keys), 0, l)
                })
            })
            .collect())
    }

    /// A writable slot for `key` to fill in place; publish it with `.commit()`.
    fn reserve(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<PyWritableBlock> {
        let key = hash_from_py(key)?;
        let r = self.inner.reserve(key).or_raise(py)?;
        Ok(PyWritableBlock::new(self.inner.clone(), r))
    }

    /// A read-only view of `key`, or None. From SSD it is promoted into DRAM unless
    /// `promote=False` (a direct read into a private copy).
    #[pyo3(signature = (key, promote = true))]
    fn get(&self, py: Python<'_>, key: &Bound<'_, PyAny>, promote: bool) -> PyResult<Option<PyBlock>> {
        let key = hash_from_py(key)?;
        let s = &*self.inner;
        // A DRAM hit copies nothing; with an SSD tier a miss may read the disk.
        let r = detached_if(py, s.config().ssd_path.is_some(), || s.get(key, promote));
        Ok(self.block(key, r.or_raise(py)?))
    }

    /// The first `n` bytes (at most block_bytes) of `key`'s block as one bytes object,
    /// or None: a small value read without a Block view, a memoryview and a slice.
    #[pyo3(signature = (key, n, promote = true))]
    fn get_head<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        n: usize,
        promote: bool,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let key = hash_from_py(key)?;
        let s = &*self.inner;
        if n > s.block_bytes() {
            return Err(invalid(py, format!("get_head: n={n} exceeds block_bytes={}", s.block_bytes())));
        }
        let r = detached_if(py, s.config().ssd_path.is_some(), || s.get(key, promote));
        // (the block's lease ends when `b` drops, after the copy)
        Ok(r.or_raise(py)?.map(|b| PyBytes::new(py, &b.bytes()[..n])))
    }

    /// `get` for many keys (one policy access for the DRAM hits).
    #[pyo3(signature = (keys, promote = true))]
    fn get_many<'py>(&self, py: Python<'py>, keys: &Bound<'py, PyAny>, promote: bool) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_from_py(keys)?;
        let s = &*self.inner;
        let got = if s.config().ssd_path.is_some() {
            detached_infallible(py, || s.get_batch(&keys, promote))
        } else {
            s.get_batch(&keys, promote)
        };
        let got = got.or_raise(py)?;
        let items: Vec<Option<PyBlock>> = keys.iter().zip(got).map(|(k, b)| self.block(*k, b)).collect();
        let objs = items
            .into_iter()
            .map(|b| match b {
                Some(b) => Ok(Bound::new(py, b)?.into_any()),
                None => Ok(py.None().into_bound(py)),
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, objs)
    }

    /// Copies `key` into the writable buffer `out` (block_bytes); False if absent.
    #[pyo3(signature = (key, out, promote = true))]
    fn get_into(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        promote: bool,
    ) -> PyResult<bool> {
        let key = hash_from_py(key)?;
        let view = BufferView::get_writable(out, "out")?;
        let p = RawBytes::new(view.as_mut_ptr(), view.len_bytes());
        // SAFETY: `view` keeps the writable export alive across the call.
        self.run(py, p.len(), move |s| s.get_into(key, unsafe { p.slice_mut() }, promote)).or_raise(py)
    }

    /// Copies each key's block into row i of `out` (len(keys) * block_bytes bytes);
    /// returns which were found (rows of missing keys are left as they were).
    #[pyo3(signature = (keys, out, promote = true))]
    fn get_many_into(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        promote: bool,
    ) -> PyResult<Vec<bool>> {
        let keys = keys_from_py(keys)?;
        let view = BufferView::get_writable(out, "out")?;
        let p = RawBytes::new(view.as_mut_ptr(), view.len_bytes());
        // SAFETY: `view` keeps the writable export alive across the call.
        self.run(py, p.len(), move |s| s.get_many_into(&keys, unsafe { p.slice_mut() }, promote)).or_raise(py)
    }

    /// In DRAM or on SSD.
    fn contains(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.inner.contains(hash_from_py(key)?))
    }

    fn __contains__(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.contains(key)
    }

    /// "dram", "ssd" or None.
    fn tier_of(&self, key: &Bound<'_, PyAny>) -> PyResult<Option<&'static str>> {
        Ok(self.inner.tier_of(hash_from_py(key)?).map(|t| t.name()))
    }

    /// Forgets `key` in every tier, for good (live views keep their bytes); False if
    /// absent. InvalidArgument if it is pinned.
    fn remove(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = hash_from_py(key)?;
        let s = &*self.inner;
        // With an SSD tier a removal clears the slot header on disk.
        let r = detached_if(py, s.config().ssd_path.is_some(), || s.remove(key));
        r.or_raise(py)
    }

    /// Leased views of the longest leading run of `keys` held (list of ints, or a buffer
    /// of 16-byte little-endian keys), each with its arena `.offset`. SSD blocks are
    /// promoted into DRAM (the run ends at one that cannot be); `promote=False`: DRAM only.
    #[pyo3(signature = (keys, promote = true))]
    fn lookup_prefix<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        promote: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_from_py(keys)?;
        let s = &*self.inner;
        let leases = detached_infallible(py, || s.lookup_prefix(&keys, promote)).or_raise(py)?;
        let objs = keys
            .iter()
            .zip(leases)
            .map(|(k, l)| Ok(Bound::new(py, PyBlock::new(*k, BlockRef::Slot(l)))?.into_any()))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, objs)
    }

    /// `lookup_prefix` as one `LeasedRun`: the run's length, its keys, its leases, and
    /// its blocks' arena offsets as a u64 buffer, without a Python object per block.
    #[pyo3(signature = (keys, promote = true))]
    fn lookup_prefix_run(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, promote: bool) -> PyResult<PyLeasedRun> {
        let keys = keys_from_py(keys)?;
        let s = &*self.inner;
        let leases = detached_infallible(py, || s.lookup_prefix(&keys, promote)).or_raise(py)?;
        let (data, start, _) = keys.into_shared();
        Ok(PyLeasedRun::new(data, start, leases))
    }

    /// Pins `key` in DRAM (never evicted); returns its pin count.
    fn pin(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<u32> {
        let key = hash_from_py(key)?;
        let s = &*self.inner;
        // Pinning an SSD block promotes it: a disk read, so without the GIL.
        let r = detached_if(py, s.config().ssd_path.is_some(), || s.pin(key));
        r.or_raise(py)
    }

    /// Drops one pin; returns the pins left.
    fn unpin(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<u32> {
        let key = hash_from_py(key)?;
        self.inner.unpin(key).or_raise(py)
    }

    /// The DRAM arena, for a transfer engine to register.
    fn region(&self) -> PyStoreRegion {
        let mem = self.inner.arena();
        PyStoreRegion {
            length: mem.len(),
            shm_name: mem.shm_name().map(str::to_string),
            block_bytes: self.inner.block_bytes(),
            slots: self.inner.slots(),
            slot_stride: mooncake_core::mem::page_align(self.inner.block_bytes()),
            memory: mem,
        }
    }

    /// Byte offset of `key`'s slot in `region()`, or None if it is not in DRAM.
    fn slot_offset(&self, key: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        Ok(self.inner.slot_offset(hash_from_py(key)?))
    }

    fn drain_events(&self) -> Vec<PyStoreEvent> {
        self.inner.drain_events().into_iter().map(PyStoreEvent::from).collect()
    }

    /// Drains the events as one `StoreEvents` batch (no Python object per event), for
    /// `Conductor.apply_store_events(instance, batch)`; `batch.to_bytes()` carries it to
    /// another process.
    fn drain_events_batch(&self) -> PyStoreEvents {
        PyStoreEvents { events: Arc::new(self.inner.drain_events()) }
    }

    /// How many events wait to be drained (cheaper than draining none).
    fn pending_events(&self) -> usize {
        self.inner.pending_events()
    }

    /// How many of them are evictions or removals (a table kept from the events is
    /// current while this is 0: `stored` events only add).
    fn pending_losses(&self) -> usize {
        self.inner.pending_losses()
    }

    /// What the store holds now, as a `StoreEvents` batch of `stored` events (one per
    /// block and tier): tells an index that was not fed this store's events from the
    /// start (a new conductor, a new pool) everything at once. Drains nothing.
    fn held_events(&self, py: Python<'_>) -> PyStoreEvents {
        let s = &*self.inner;
        PyStoreEvents { events: Arc::new(detached_infallible(py, || s.held_events())) }
    }

    fn stats(&self) -> PyStoreStats {
        self.inner.stats().into()
    }

    /// Waits until queued demotions are on disk; StoreIOError if a write failed.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let s = &*self.inner;
        detached_infallible(py, || s.flush()).or_raise(py)
    }

    /// Raises InternalError if an invariant is broken (call when no other thread works).
    fn check_integrity(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.check_integrity().map_err(|m| crate::errors::new_err(py, mooncake_core::ErrorCategory::Internal, m))
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "Store(block_bytes={}, slots={}, eviction={:?}, ssd_path={:?})",
            c.block_bytes,
            self.inner.slots(),
            c.eviction,
            c.ssd_path
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStore>()?;
    m.add_class::<PyBlock>()?;
    m.add_class::<PyWritableBlock>()?;
    m.add_class::<PyReservedObject>()?;
    m.add_class::<PyStoreRegion>()?;
    m.add_class::<PyStoreEvent>()?;
    m.add_class::<PyStoreStats>()?;
    crate::store_events::register(m)?;
    m.add_class::<PyLeasedRun>()?;
    Ok(())
}
