//! Conversions at the Python boundary: token sequences (lists, or any integer buffer
//! checked and read by the core's `token_array`),
//! 128-bit block hashes (Python ints) and storage tier names.

use std::ffi::CStr;
use std::os::raw::c_int;

use mooncake_core::token_array::{IntArray, IntKind, TokenOutOfRange};
use mooncake_core::{BlockHash, Tier};
use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::errors::{invalid, to_pyerr, OrRaise};

/// A read-only, C-contiguous buffer export, released on drop (with the GIL held: it
/// never leaves the calling thread, so it cannot outlive the attached section).
pub struct BufferView {
    view: ffi::Py_buffer,
}

impl BufferView {
    /// Exports `obj`'s buffer, or `None` if it has no buffer protocol.
    pub fn get(obj: &Bound<'_, PyAny>, flags: c_int) -> PyResult<Option<Self>> {
        // SAFETY: `view` is plain data that PyObject_GetBuffer fills; on failure it is
        // left unexported and we do not release it.
        unsafe {
            if ffi::PyObject_CheckBuffer(obj.as_ptr()) == 0 {
                return Ok(None);
            }
            let mut view: ffi::Py_buffer = std::mem::zeroed();
            if ffi::PyObject_GetBuffer(obj.as_ptr(), &mut view, flags) != 0 {
                return Err(PyErr::fetch(obj.py()));
            }
            Ok(Some(BufferView { view }))
        }
    }

    /// Exports `obj`'s buffer as a writable, C-contiguous byte range; `InvalidArgument`
    /// (saying what to pass) if it has no buffer, is read-only or is not contiguous.
    pub fn get_writable(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Self> {
        let flags = ffi::PyBUF_WRITABLE | ffi::PyBUF_C_CONTIGUOUS;
        match Self::get(obj, flags) {
            Ok(Some(v)) => Ok(v),
            Ok(None) => {
                Err(invalid(obj.py(), format!("{what} must be a writable buffer (e.g. a numpy array or bytearray)")))
            }
            Err(e) => Err(invalid(obj.py(), format!("{what} must be a writable, C-contiguous buffer ({e})"))),
        }
    }

    /// Exports `obj`'s buffer as a C-contiguous byte range (read access); `InvalidArgument`
    /// if it has none or is not contiguous.
    pub fn get_contiguous(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Self> {
        match Self::get(obj, ffi::PyBUF_C_CONTIGUOUS) {
            Ok(Some(v)) => Ok(v),
            Ok(None) => {
                let t = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
                Err(invalid(
                    obj.py(),
                    format!("{what} must support the buffer protocol (bytes, numpy array, ...), got {t}"),
                ))
            }
            Err(e) => Err(invalid(obj.py(), format!("{what} must be a C-contiguous buffer ({e})"))),
        }
    }

    /// Start of the buffer for writing; only meaningful for a view from
    /// [`get_writable`](Self::get_writable) (which refuses read-only exporters).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.view.buf as *mut u8
    }

    pub fn len_bytes(&self) -> usize {
        self.view.len as usize
    }

    pub fn ndim(&self) -> usize {
        self.view.ndim as usize
    }

    /// The dimensions (empty for a 0-D export; `[len / itemsize]` when the exporter
    /// gave no shape).
    pub fn shape(&self) -> Vec<usize> {
        if self.view.shape.is_null() {
            return vec![self.len_bytes() / self.itemsize().max(1)];
        }
        // SAFETY: a non-null shape has `ndim` entries, owned by the exporter while the
        // view is held.
        unsafe { std::slice::from_raw_parts(self.view.shape, self.ndim()) }.iter().map(|&d| d.max(0) as usize).collect()
    }

    pub fn itemsize(&self) -> usize {
        self.view.itemsize as usize
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.view.buf as *const u8
    }

    /// The struct-module format string ("B" when the exporter gave none).
    pub fn format(&self) -> &str {
        if self.view.format.is_null() {
            return "B";
        }
        // SAFETY: a non-null format is a NUL-terminated string owned by the exporter
        // and valid while the view is held.
        unsafe { CStr::from_ptr(self.view.format) }.to_str().unwrap_or("?")
    }

    /// The bytes of the buffer.
    pub fn bytes(&self) -> &[u8] {
        if self.view.len == 0 {
            return &[];
        }
        // SAFETY: the exporter guarantees `len` readable bytes at `buf` while the view is
        // held; the view lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len_bytes()) }
    }
}

// SAFETY: the view is only released in Drop, which attaches to the interpreter first, so
// a BufferView may be kept by an owner on another thread (a transfer region's keep-alive).
// Nothing is mutated through &BufferView.
unsafe impl Send for BufferView {}
// SAFETY: as above.
unsafe impl Sync for BufferView {}

impl Drop for BufferView {
    fn drop(&mut self) {
        // SAFETY: checking whether the interpreter still runs has no preconditions.
        if unsafe { ffi::Py_IsInitialized() } == 0 {
            return; // interpreter gone: nothing left to release into
        }
        // SAFETY: the view was exported by PyObject_GetBuffer and is released once, while
        // attached (cheap when the caller already is; needed when the last owner of a
        // registered region drops it on an engine thread).
        Python::attach(|_| unsafe { ffi::PyBuffer_Release(&mut self.view) });
    }
}

/// Tokens as the caller gave them: borrowed from an integer buffer (checked and
/// converted by the core's `IntArray`), or read from a list or tuple.
pub enum Tokens {
    Buffer { view: BufferView, kind: IntKind },
    Owned(Vec<u32>),
}

fn out_of_range(py: Python<'_>, index: usize, value: i128) -> PyErr {
    to_pyerr(py, &TokenOutOfRange { index, value })
}

impl Tokens {
    pub fn extract(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = obj.py();
        if let Ok(list) = obj.cast::<PyList>() {
            return Self::from_list(list);
        }
        if let Ok(tuple) = obj.cast::<PyTuple>() {
            return Self::from_tuple(tuple);
        }
        let flags = ffi::PyBUF_FORMAT | ffi::PyBUF_C_CONTIGUOUS;
        let view = match BufferView::get(obj, flags) {
            Ok(Some(v)) => v,
            Ok(None) => {
                let type_name = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
                return Err(invalid(
                    py,
                    format!("tokens must be a list of ints or a 1-D integer array, got {type_name}"),
                ));
            }
            Err(e) => return Err(invalid(py, format!("tokens must be a C-contiguous 1-D integer array ({e})"))),
        };
        if view.ndim() != 1 {
            return Err(invalid(py, format!("tokens must be 1-D, got a {}-D array", view.ndim())));
        }
        let Some(kind) = IntKind::parse(view.format(), view.itemsize()) else {
            return Err(invalid(
                py,
                format!("tokens must be integers, got array format {:?} (e.g. a float array)", view.format()),
            ));
        };
        IntArray::new(view.bytes(), kind).check_tokens().or_raise(py)?;
        Ok(Tokens::Buffer { view, kind })
    }

    /// A list of ints, read with borrowed references while every item is an exact int
    /// or an int subclass (the common case: ~3x fewer cycles per token than the generic
    /// route, which takes a strong reference and goes through `__index__` dispatch);
    /// from the first other item on, the generic route.
    fn from_list(list: &Bound<'_, PyList>) -> PyResult<Self> {
        // SAFETY: `list` is a live list; PyList_GetItem bounds-checks `i`.
        Self::from_borrowed(
            list.as_any(),
            list.len(),
            |i| unsafe { ffi::PyList_GetItem(list.as_ptr(), i) },
            || list.iter(),
        )
    }

    /// [`from_list`](Self::from_list) for a tuple.
    fn from_tuple(tuple: &Bound<'_, PyTuple>) -> PyResult<Self> {
        // SAFETY: `tuple` is a live tuple; PyTuple_GetItem bounds-checks `i`.
        Self::from_borrowed(
            tuple.as_any(),
            tuple.len(),
            |i| unsafe { ffi::PyTuple_GetItem(tuple.as_ptr(), i) },
            || tuple.iter(),
        )
    }

    /// `n` items read through `get` (a borrowed reference to item `i`, or null with an
    /// exception set); from the first item that is not an int in 0..2^32, `iter()`'s
    /// items through the generic route.
    fn from_borrowed<'py, I: Iterator<Item = Bound<'py, PyAny>>>(
        seq: &Bound<'py, PyAny>,
        n: usize,
        get: impl Fn(ffi::Py_ssize_t) -> *mut ffi::PyObject,
        iter: impl FnOnce() -> I,
    ) -> PyResult<Self> {
        let py = seq.py();
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            // SAFETY: the GIL is held and the sequence is alive (`get` bounds-checks and
            // returns null past the end); no Python code runs between taking the borrowed
            // item and reading it (PyLong_AsLongLong on an int or an int subclass calls no
            // `__index__`), so the sequence cannot change and the item stays alive.
            let (v, is_int) = unsafe {
                let item = get(i as ffi::Py_ssize_t);
                if item.is_null() {
                    return Err(PyErr::fetch(py));
                }
                if ffi::PyLong_Check(item) == 0 {
                    (0, false)
                } else {
                    (ffi::PyLong_AsLongLong(item), true)
                }
            };
            if !is_int || (v == -1 && PyErr::take(py).is_some()) || !(0..=u32::MAX as i64).contains(&v) {
                // Not an int, or outside i64 / 0..2^32: the generic route from here on
                // (it accepts `__index__` objects and names a bad item's position).
                out.extend(items_to_u32(py, iter().skip(i), i)?);
                return Ok(Tokens::Owned(out));
            }
            out.push(v as u32);
        }
        Ok(Tokens::Owned(out))
    }

    /// The tokens as u32: in place when the buffer holds aligned 4-byte integers,
    /// converted otherwise (values are already checked to fit).
    pub fn with_u32<R>(&self, f: impl FnOnce(&[u32]) -> R) -> R {
        match self {
            Tokens::Owned(v) => f(v),
            Tokens::Buffer { view, kind } => IntArray::new(view.bytes(), *kind).with_u32(f),
        }
    }

    /// An owned copy (for work done with the GIL released).
    pub fn to_vec(&self) -> Vec<u32> {
        self.with_u32(|s| s.to_vec())
    }
}

/// Items (any int or `__index__` object) as u32 tokens; `first` is the position of the
/// first item, for the error message.
fn items_to_u32<'py>(
    py: Python<'py>,
    items: impl Iterator<Item = Bound<'py, PyAny>>,
    first: usize,
) -> PyResult<Vec<u32>> {
    let mut out = Vec::with_capacity(items.size_hint().0);
    for (j, item) in items.enumerate() {
        let i = first + j;
        match item.extract::<i64>() {
            Ok(v) if (0..=u32::MAX as i64).contains(&v) => out.push(v as u32),
            Ok(v) => return Err(out_of_range(py, i, v as i128)),
            Err(_) => {
                let shown = item.repr().map(|r| r.to_string()).unwrap_or_default();
                return Err(invalid(py, format!("token at position {i} is {shown}, not an int in 0..2^32-1")));
            }
        }
    }
    Ok(out)
}

/// A block hash → Python int.
pub fn hash_to_py(py: Python<'_>, h: BlockHash) -> PyResult<Bound<'_, PyAny>> {
    crate::pyint::u128_to_py(py, h)
}

/// A list of block hashes → a Python list of ints.
pub fn hashes_to_list<'py>(py: Python<'py>, hs: &[BlockHash]) -> PyResult<Bound<'py, PyList>> {
    let items = hs.iter().map(|&h| hash_to_py(py, h)).collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, items)
}

/// A Python int → block hash; anything outside 0..2^128 is `InvalidArgument`.
pub fn hash_from_py(obj: &Bound<'_, PyAny>) -> PyResult<BlockHash> {
    crate::pyint::u128_from_py(obj).map_err(|e| {
        let shown = obj.repr().map(|r| r.to_string()).unwrap_or_default();
        let why = if e.is_instance_of::<PyTypeError>(obj.py()) { "not an int" } else { "outside 0..2^128" };
        invalid(obj.py(), format!("block hash {shown} is {why}"))
    })
}

/// A sequence of Python ints → block hashes.
pub fn hashes_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Vec<BlockHash>> {
    if let Ok(list) = obj.cast::<PyList>() {
        return list.iter().map(|x| hash_from_py(&x)).collect();
    }
    let mut out = Vec::new();
    let iter = obj.try_iter().map_err(|_| invalid(obj.py(), "block hashes must be a list of ints"))?;
    for x in iter {
        out.push(hash_from_py(&x?)?);
    }
    Ok(out)
}

/// `extras` of `hash(..., extras=...)`: one `bytes | None` per full block (the msgpack
/// bytes of an engine's per-block `extra_keys` entry). `None`: no extras.
pub fn extras_arg(py: Python<'_>, extras: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<Option<Vec<u8>>>> {
    let Some(extras) = extras else { return Ok(Vec::new()) };
    if extras.is_instance_of::<pyo3::types::PyBytes>() || extras.is_instance_of::<pyo3::types::PyString>() {
        return Err(invalid(py, "extras must be a sequence with one bytes | None per full block, not a single value"));
    }
    let items =
        extras.try_iter().map_err(|_| invalid(py, "extras must be a sequence with one bytes | None per full block"))?;
    items
        .enumerate()
        .map(|(i, item)| {
            let item = item?;
            if item.is_none() {
                return Ok(None);
            }
            match item.cast::<pyo3::types::PyBytes>() {
                Ok(b) => Ok(Some(b.as_bytes().to_vec())),
                Err(_) => {
                    let t = item.get_type().name().map(|n| n.to_string()).unwrap_or_default();
                    Err(invalid(py, format!("extras[{i}] must be bytes or None, got {t}")))
                }
            }
        })
        .collect()
}

/// Borrowed views of [`extras_arg`]'s result, as the core hashers take them.
pub fn extras_refs(extras: &[Option<Vec<u8>>]) -> Vec<Option<&[u8]>> {
    extras.iter().map(|e| e.as_deref()).collect()
}

/// A tier name (`"dram"`, `"ssd"`) → `Tier`; an unknown name is an `InvalidArgument`
/// that lists the known ones (the core's own error).
pub fn parse_tier(py: Python<'_>, tier: &str) -> PyResult<Tier> {
    Tier::parse(tier).or_raise(py)
}
