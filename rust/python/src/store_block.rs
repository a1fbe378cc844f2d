//! `Block` (read-only view of a stored block, holding its lease) and `WritableBlock`
//! (a reserved slot to fill in place, then commit). Both export the buffer protocol
//! without a copy; each keeps its slot alive while any exported view exists.

use std::os::raw::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use mooncake_core::store::{BlockRef, Reservation, Store};
use mooncake_core::BlockHash;
use parking_lot::Mutex;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::convert::{hash_to_py, BufferView};
use crate::errors::invalid;
use crate::gil::{detached_if, RawBytes, DETACH_STORE_BYTES};

/// Fills `view` over `len` bytes at `buf`, owned by `owner` (a new reference).
///
/// # Safety
/// `view` is the pointer CPython passed to `__getbuffer__`; `buf..buf+len` stays valid
/// until the matching `__releasebuffer__`.
unsafe fn fill(
    owner: &Bound<'_, PyAny>,
    view: *mut ffi::Py_buffer,
    buf: *mut u8,
    len: usize,
    readonly: bool,
    flags: c_int,
) -> PyResult<()> {
    if view.is_null() {
        return Err(PyBufferError::new_err("null view"));
    }
    let rc =
        ffi::PyBuffer_FillInfo(view, owner.as_ptr(), buf.cast(), len as ffi::Py_ssize_t, c_int::from(readonly), flags);
    if rc != 0 {
        return Err(PyErr::fetch(owner.py()));
    }
    Ok(())
}

/// A read-only view of one block. While it (or any memoryview / array made from it)
/// is alive, the block holds a lease: it is not evicted, moved or overwritten.
#[pyclass(name = "Block", module = "mooncake_rs._core", frozen)]
pub struct PyBlock {
    key: BlockHash,
    tier: &'static str,
    len: usize,
    /// Arena offset of the leased slot (None for a private copy read from SSD).
    offset: Option<usize>,
    data: Mutex<Option<BlockRef>>,
    exports: AtomicUsize,
    /// `release()` was called while views were exported: drop at the last release.
    closing: std::sync::atomic::AtomicBool,
}

impl PyBlock {
    pub fn new(key: BlockHash, data: BlockRef) -> Self {
        let offset = match &data {
            BlockRef::Slot(l) => Some(l.offset()),
            BlockRef::Owned(_) => None,
        };
        PyBlock {
            key,
            tier: data.tier().name(),
            len: data.bytes().len(),
            offset,
            data: Mutex::new(Some(data)),
            exports: AtomicUsize::new(0),
            closing: false.into(),
        }
    }
}

#[pymethods]
impl PyBlock {
    #[getter]
    fn key<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        hash_to_py(py, self.key)
    }

    /// Where the bytes are: "dram" (a leased slot) or "ssd" (a private copy read
    /// directly, without promotion).
    #[getter]
    fn tier(&self) -> &'static str {
        self.tier
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }

    fn __len__(&self) -> usize {
        self.len
    }

    /// Byte offset of the leased slot in the store's arena (`Store.region()`), what a
    /// transfer engine that registered the arena reads to send this block; None for a
    /// private copy read from SSD (`tier == "ssd"`). Valid while the lease is held:
    /// InvalidArgument once released.
    #[getter]
    fn offset(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        if self.released() {
            return Err(invalid(py, "this Block was released; its slot may hold another block now"));
        }
        Ok(self.offset)
    }

    /// True once `release()` (or the `with` block) ended the view.
    #[getter]
    fn released(&self) -> bool {
        self.data.lock().is_none() || self.closing.load(Ordering::Acquire)
    }

    /// Ends the view: the lease goes as soon as no exported memoryview/array remains.
    fn release(&self) {
        self.closing.store(true, Ordering::Release);
        let mut d = self.data.lock();
        if self.exports.load(Ordering::Acquire) == 0 {
            d.take();
        }
    }

    /// A copy of the bytes.
    fn tobytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let copy = self.data.lock().as_ref().map(|b| pyo3::types::PyBytes::new(py, b.bytes()));
        // the error is built after the lock is dropped (see `PyWritableBlock::take`)
        copy.ok_or_else(|| invalid(py, "this Block was released"))
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.release();
        false
    }

    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let me = slf.get();
        let d = me.data.lock();
        let ptr = match d.as_ref() {
            Some(b) if !me.closing.load(Ordering::Acquire) => b.bytes().as_ptr() as *mut u8,
            _ => return Err(PyBufferError::new_err("this Block was released")),
        };
        // SAFETY: the bytes live in `data`, which is kept until the export count falls to
        // zero (release() defers while views exist); PyBuffer_FillInfo refuses writable
        // requests on a read-only export.
        unsafe { fill(slf.as_any(), view, ptr, me.len, true, flags)? };
        me.exports.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        let mut d = self.data.lock();
        if self.exports.fetch_sub(1, Ordering::AcqRel) == 1 && self.closing.load(Ordering::Acquire) {
            d.take();
        }
    }

    fn __repr__(&self) -> String {
        format!("Block(key={:#x}, nbytes={}, tier={:?}, released={})", self.key, self.len, self.tier, self.released())
    }
}

/// A reserved slot for `key`, writable in place; `commit()` publishes it. Dropped (or
/// `abort()`ed, or left by a `with` block) uncommitted, the slot is freed.
#[pyclass(name = "WritableBlock", module = "mooncake_rs._core", frozen)]
pub struct PyWritableBlock {
    store: Arc<Store>,
    key: BlockHash,
    len: usize,
    /// Held only for short checks with the GIL held, never across a GIL release.
    res: Mutex<Option<Reservation>>,
    /// Exported buffers; changed and checked under `res`.
    exports: AtomicUsize,
    /// `write()` copies in flight with the GIL released; changed and checked under `res`.
    /// While one runs, commit/abort are refused and the reservation stays put.
    writes: AtomicUsize,
}

impl PyWritableBlock {
    pub fn new(store: Arc<Store>, r: Reservation) -> Self {
        PyWritableBlock {
            key: r.key(),
            len: r.len(),
            store,
            res: Mutex::new(Some(r)),
            exports: AtomicUsize::new(0),
            writes: AtomicUsize::new(0),
        }
    }

    /// Takes the reservation if no view and no write is outstanding (checked under the
    /// lock that `__getbuffer__` and `write()` take to add one, so none can slip in).
    ///
    /// The refusal is turned into a Python exception only after the lock is dropped:
    /// building one may release the GIL (the first error of the process imports the
    /// exception classes through a `PyOnceLock`, which detaches while it waits), and a
    /// `write()` on another thread that then takes the GIL and waits for this lock would
    /// never give the GIL back. The same rule holds for every error in this file.
    fn take(&self, py: Python<'_>, what: &str) -> PyResult<Option<Reservation>> {
        let taken = {
            let mut r = self.res.lock();
            if self.exports.load(Ordering::Acquire) > 0 {
                Err(Busy::Exported)
            } else if self.writes.load(Ordering::Acquire) > 0 {
                Err(Busy::Writing)
            } else {
                Ok(r.take())
            }
        };
        taken.map_err(|busy| match busy {
            Busy::Exported => {
                invalid(py, format!("release every memoryview/array of this WritableBlock before {what}"))
            }
            Busy::Writing => {
                invalid(py, format!("a write() to this WritableBlock is running on another thread; {what} after it"))
            }
        })
    }
}

/// Why `take()` refused.
enum Busy {
    Exported,
    Writing,
}

/// Ends a `write()` in flight, also when the copy panics.
struct WriteGuard<'a>(&'a AtomicUsize);

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[pymethods]
impl PyWritableBlock {
    #[getter]
    fn key<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        hash_to_py(py, self.key)
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }

    fn __len__(&self) -> usize {
        self.len
    }

    /// Byte offset of this slot in the store's arena (`Store.region()`), for a
    /// transfer that fills it in place before `commit()`.
    #[getter]
    fn offset(&self, py: Python<'_>) -> PyResult<usize> {
        let offset = self.res.lock().as_ref().map(Reservation::offset);
        offset.ok_or_else(|| invalid(py, "this WritableBlock was already committed or aborted"))
    }

    /// True once committed or aborted.
    #[getter]
    fn done(&self) -> bool {
        self.res.lock().is_none()
    }

    /// Copies `data` into the slot at byte `offset` (e.g. one layer of the block).
    #[pyo3(signature = (data, offset = 0))]
    fn write(&self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: usize) -> PyResult<()> {
        let src = BufferView::get_contiguous(data, "data")?;
        let n = src.len_bytes();
        if offset.checked_add(n).is_none_or(|end| end > self.len) {
            return Err(invalid(py, format!("{n} bytes at offset {offset} do not fit a {}-byte block", self.len)));
        }
        // The lock covers only finding the slot and counting this write; the copy runs
        // without it (and, when large, without the GIL), so another thread touching this
        // block never waits on a lock whose holder waits for the GIL.
        let dst = {
            let r = self.res.lock();
            r.as_ref().map(|r| {
                self.writes.fetch_add(1, Ordering::AcqRel);
                // SAFETY: offset + n <= len, inside the reserved slot.
                unsafe { r.as_mut_ptr().add(offset) }
            })
        };
        let Some(dst) = dst else {
            return Err(invalid(py, "this WritableBlock was already committed or aborted"));
        };
        let _guard = WriteGuard(&self.writes);
        let (dst, from) = (RawBytes::new(dst, n), RawBytes::new(src.as_ptr(), n));
        // SAFETY: while `writes` > 0 the reservation is neither committed nor aborted
        // (take() refuses), so the slot stays this writer's; the source export is held
        // by `src`. `copy` (memmove) because `data` may be a view of this very slot.
        let copy = move || unsafe { std::ptr::copy(from.as_ptr(), dst.as_mut_ptr(), n) };
        detached_if(py, n >= DETACH_STORE_BYTES, copy);
        Ok(())
    }

    /// Publishes the block and returns it as a leased, read-only `Block` (its `.offset`
    /// is this slot's), without a second lookup by key; None if the key was stored
    /// meanwhile (the slot is freed; `Store.get(key)` returns the stored one). Every
    /// memoryview/array of this WritableBlock must be released first.
    fn commit(&self, py: Python<'_>) -> PyResult<Option<PyBlock>> {
        match self.take(py, "commit()")? {
            Some(r) => {
                let key = r.key();
                Ok(self.store.commit_leased(r, 0).map(|l| PyBlock::new(key, BlockRef::Slot(l))))
            }
            None => Err(invalid(py, "this WritableBlock was already committed or aborted")),
        }
    }

    /// Frees the slot without publishing (every exported view must be released first).
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        self.take(py, "abort()")?;
        Ok(())
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// Leaving a `with` block aborts what was not committed.
    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        // With views still exported (or a write running) the slot stays reserved; it is
        // freed when the object goes (its views hold references to it).
        let mut r = self.res.lock();
        if self.exports.load(Ordering::Acquire) == 0 && self.writes.load(Ordering::Acquire) == 0 {
            r.take();
        }
        false
    }

    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let me = slf.get();
        let r = me.res.lock();
        let Some(res) = r.as_ref() else {
            return Err(PyBufferError::new_err("this WritableBlock was already committed or aborted"));
        };
        // SAFETY: the reservation stays in `res` while exports > 0 (commit refuses, abort
        // through __exit__ waits), so the slot is valid and only this writer's.
        unsafe { fill(slf.as_any(), view, res.as_mut_ptr(), me.len, false, flags)? };
        me.exports.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.exports.fetch_sub(1, Ordering::AcqRel);
    }

    fn __repr__(&self) -> String {
        format!("WritableBlock(key={:#x}, nbytes={}, done={})", self.key, self.len, self.done())
    }
}
