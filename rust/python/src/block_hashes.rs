//! `BlockHashes`: an immutable buffer of 16-byte block keys (u128, little-endian).
//!
//! What `PrefixHasher.hash_blocks` returns and what the index, the conductor and the
//! store take, so a request's block hashes go from the hasher to the scheduler and the
//! store without one Python int being built per block. For debugging it behaves like a
//! read-only sequence of ints (`len`, indexing, iteration, `tolist()`); slicing shares
//! the buffer. It exports the buffer protocol as a read-only `(n, 16)` uint8 array, so
//! `numpy.asarray(h)`, `numpy.frombuffer(h, "V16")` or `numpy.frombuffer(h, "<u8")
//! .reshape(-1, 2)` (low, high halves) view it without a copy, and `bytes(h)` is its
//! 16·n-byte wire form (`BlockHashes(data)` reads it back).

use std::hash::{Hash, Hasher};
use std::os::raw::c_int;
use std::sync::Arc;

use mooncake_core::BlockHash;
use pyo3::exceptions::{PyBufferError, PyIndexError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PySlice};

use crate::convert::{hash_to_py, hashes_to_list};
use crate::keys::{keys_from_py, KEY_BYTES};

// The buffer export hands out the u128s' memory as little-endian key bytes.
const _: () = assert!(cfg!(target_endian = "little"), "BlockHashes exports u128 memory as little-endian keys");

#[pyclass(name = "BlockHashes", module = "mooncake_rs._core", frozen, eq)]
pub struct PyBlockHashes {
    /// Shared by every slice of one hash call.
    pub data: Arc<Vec<BlockHash>>,
    pub start: usize,
    pub len: usize,
    /// The export's shape and strides, `(len, 16)` bytes, C order; read by the buffer
    /// consumer through pointers into this (immutable, never moved) object.
    shape: [ffi::Py_ssize_t; 2],
    strides: [ffi::Py_ssize_t; 2],
}

/// Equal to another `BlockHashes` with the same hashes in the same order (Python's
/// `==`; compare with a list through `tolist()`).
impl PartialEq for PyBlockHashes {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl PyBlockHashes {
    pub fn new(data: Arc<Vec<BlockHash>>, start: usize, len: usize) -> Self {
        debug_assert!(start + len <= data.len());
        PyBlockHashes {
            data,
            start,
            len,
            shape: [len as ffi::Py_ssize_t, KEY_BYTES as ffi::Py_ssize_t],
            strides: [KEY_BYTES as ffi::Py_ssize_t, 1],
        }
    }

    pub fn from_vec(v: Vec<BlockHash>) -> Self {
        let len = v.len();
        Self::new(Arc::new(v), 0, len)
    }

    pub fn as_slice(&self) -> &[BlockHash] {
        &self.data[self.start..self.start + self.len]
    }

    fn as_bytes(&self) -> &[u8] {
        let s = self.as_slice();
        // SAFETY: u128 has no padding and every byte of it is initialised; the bytes are
        // read-only and live as long as `self` (the Arc). On this (little-endian, see the
        // assert above) target a u128's memory is its little-endian encoding.
        unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
    }

    fn index(&self, i: isize) -> PyResult<usize> {
        let n = self.len as isize;
        let j = if i < 0 { i + n } else { i };
        if !(0..n).contains(&j) {
            return Err(PyIndexError::new_err(format!("BlockHashes index {i} out of range for {n} hashes")));
        }
        Ok(j as usize)
    }
}

#[pymethods]
impl PyBlockHashes {
    /// From a list of ints, a `BlockHashes`, or a buffer of 16-byte little-endian keys
    /// (`bytes(h)`, a `(n, 16)` uint8 array, a `V16` array); `InvalidArgument` otherwise.
    #[new]
    #[pyo3(signature = (keys = None))]
    fn py_new(keys: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let Some(keys) = keys else { return Ok(Self::from_vec(Vec::new())) };
        let (data, start, len) = keys_from_py(keys)?.into_shared();
        Ok(Self::new(data, start, len))
    }

    fn __len__(&self) -> usize {
        self.len
    }

    /// `h[i]` is the i-th hash as an int; `h[a:b]` a `BlockHashes` sharing this buffer
    /// (a stepped slice is a copy).
    fn __getitem__<'py>(&self, py: Python<'py>, idx: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        if let Ok(slice) = idx.cast::<PySlice>() {
            let ind = slice.indices(self.len as isize)?;
            let (start, step, n) = (ind.start, ind.step, ind.slicelength);
            let out = if n == 0 {
                Self::from_vec(Vec::new())
            } else if step == 1 {
                Self::new(self.data.clone(), self.start + start as usize, n)
            } else {
                let s = self.as_slice();
                Self::from_vec((0..n).map(|k| s[(start + k as isize * step) as usize]).collect())
            };
            return Ok(Bound::new(py, out)?.into_any());
        }
        let i: isize = idx
            .extract()
            .map_err(|_| pyo3::exceptions::PyTypeError::new_err("BlockHashes indices must be integers or slices"))?;
        let j = self.index(i)?;
        hash_to_py(py, self.as_slice()[j])
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.tolist(py)?.try_iter()?.into_any())
    }

    fn __contains__(&self, key: &Bound<'_, PyAny>) -> bool {
        crate::convert::hash_from_py(key).is_ok_and(|k| self.as_slice().contains(&k))
    }

    /// The hashes as a list of ints (one Python int each: for debugging and old callers).
    fn tolist<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        hashes_to_list(py, self.as_slice())
    }

    /// The 16·n little-endian key bytes (`BlockHashes(data)` reads them back).
    fn tobytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.as_bytes())
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        self.tobytes(py)
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.len * KEY_BYTES
    }

    fn __hash__(&self) -> isize {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.as_slice().hash(&mut h);
        h.finish() as isize
    }

    fn __repr__(&self) -> String {
        let s = self.as_slice();
        let shown: Vec<String> = s.iter().take(4).map(|h| format!("{h:#034x}")).collect();
        let more = if s.len() > 4 { ", ..." } else { "" };
        format!("BlockHashes(n={}, [{}{}])", s.len(), shown.join(", "), more)
    }

    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("null view"));
        }
        let me = slf.get();
        let bytes = me.as_bytes();
        // SAFETY: `view` is CPython's; the bytes belong to the Arc held by this object,
        // which the view keeps alive (view.obj) and which is immutable; readonly = 1
        // makes PyBuffer_FillInfo refuse a writable request.
        unsafe {
            let rc = ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                bytes.as_ptr() as *mut std::ffi::c_void,
                bytes.len() as ffi::Py_ssize_t,
                1,
                flags,
            );
            if rc != 0 {
                return Err(PyErr::fetch(slf.py()));
            }
            // Rows of 16 bytes when the consumer asks for a shape; a flat byte range
            // otherwise (shape and strides must be NULL then). The arrays live in this
            // frozen object, which outlives the export; CPython never writes to them.
            if flags & ffi::PyBUF_ND == ffi::PyBUF_ND {
                (*view).ndim = 2;
                (*view).shape = me.shape.as_ptr() as *mut ffi::Py_ssize_t;
                if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
                    (*view).strides = me.strides.as_ptr() as *mut ffi::Py_ssize_t;
                }
            }
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBlockHashes>()
}
