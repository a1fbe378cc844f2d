//! `LeasedRun`: the longest held prefix of a key sequence, leased as one object
//! (`Store.lookup_prefix_run(keys)`). It holds one lease per block (none is evicted,
//! moved or overwritten until `release()` or the object goes) and exports the blocks'
//! arena offsets as a read-only u64 buffer, so a caller can send them to a peer
//! (`bytes(run)`, `numpy.asarray(run)`) without a Python object per block. `block(i)`
//! gives a `Block` view of one of them when its bytes are needed.

use std::ffi::CStr;
use std::os::raw::c_int;
use std::sync::Arc;

use mooncake_core::store::{BlockRef, Lease};
use mooncake_core::BlockHash;
use parking_lot::Mutex;
use pyo3::exceptions::{PyBufferError, PyIndexError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::block_hashes::PyBlockHashes;
use crate::errors::invalid;
use crate::store_block::PyBlock;

/// struct-module format of one offset: native unsigned 64-bit.
const OFFSET_FORMAT: &CStr = c"Q";

#[pyclass(name = "LeasedRun", module = "mooncake_rs._core", frozen)]
pub struct PyLeasedRun {
    /// The run's keys are `keys[start..start + len]` (shared with the caller's
    /// `BlockHashes` when that is what it passed).
    keys: Arc<Vec<BlockHash>>,
    start: usize,
    offsets: Vec<u64>,
    /// The buffer export's shape and strides (read through pointers into this frozen,
    /// never moved object).
    shape: [ffi::Py_ssize_t; 1],
    strides: [ffi::Py_ssize_t; 1],
    /// Held only for short moves with the GIL held, never across a release.
    leases: Mutex<Option<Vec<Lease>>>,
}

impl PyLeasedRun {
    pub fn new(keys: Arc<Vec<BlockHash>>, start: usize, leases: Vec<Lease>) -> Self {
        let offsets: Vec<u64> = leases.iter().map(|l| l.offset() as u64).collect();
        PyLeasedRun {
            keys,
            start,
            shape: [offsets.len() as ffi::Py_ssize_t],
            strides: [8],
            offsets,
            leases: Mutex::new(Some(leases)),
        }
    }
}

#[pymethods]
impl PyLeasedRun {
    /// Blocks in the run (the longest leading run of the keys that the store holds).
    fn __len__(&self) -> usize {
        self.offsets.len()
    }

    /// The run's keys (a prefix of the keys passed to `lookup_prefix_run`).
    #[getter]
    fn keys(&self) -> PyBlockHashes {
        PyBlockHashes::new(self.keys.clone(), self.start, self.offsets.len())
    }

    /// Arena offsets of the leased slots, as a list of ints (`numpy.asarray(run)` or
    /// `bytes(run)` give them without an int per block).
    #[getter]
    fn offsets(&self) -> Vec<u64> {
        self.offsets.clone()
    }

    /// The offsets as little-endian u64 bytes (8 per block).
    fn offsets_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let raw: Vec<u8> = self.offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
        PyBytes::new(py, &raw)
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        self.offsets_bytes(py)
    }

    /// True once `release()` (or the `with` block) ended the leases.
    #[getter]
    fn released(&self) -> bool {
        self.leases.lock().is_none()
    }

    /// A `Block` view of block `i` of the run, with its own lease (it stays valid after
    /// the run is released). InvalidArgument once the run was released.
    fn block(&self, py: Python<'_>, i: isize) -> PyResult<PyBlock> {
        let n = self.offsets.len() as isize;
        let j = if i < 0 { i + n } else { i };
        if !(0..n).contains(&j) {
            return Err(PyIndexError::new_err(format!("LeasedRun index {i} out of range for {n} blocks")));
        }
        let lease = match self.leases.lock().as_ref() {
            Some(l) => l[j as usize].clone(),
            None => return Err(invalid(py, "this LeasedRun was released; look the keys up again")),
        };
        Ok(PyBlock::new(self.keys[self.start + j as usize], BlockRef::Slot(lease)))
    }

    /// Every block of the run as a `Block` view (each with its own lease).
    fn blocks(&self, py: Python<'_>) -> PyResult<Vec<PyBlock>> {
        (0..self.offsets.len() as isize).map(|i| self.block(py, i)).collect()
    }

    /// Ends the run's leases (blocks handed out by `block()` keep their own).
    fn release(&self) {
        let leases = self.leases.lock().take();
        drop(leases); // outside the lock: dropping leases touches the arena's counters
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.release();
        false
    }

    fn __repr__(&self) -> String {
        format!("LeasedRun(blocks={}, released={})", self.offsets.len(), self.released())
    }

    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("null view"));
        }
        let me = slf.get();
        // SAFETY: `view` is CPython's; the offsets vector is never changed after
        // construction and lives as long as this object, which the view keeps alive
        // (view.obj); readonly = 1 refuses writable requests. Shape, strides and format
        // point into this frozen object / a static string and are only read by CPython.
        unsafe {
            let rc = ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                me.offsets.as_ptr() as *mut std::ffi::c_void,
                (me.offsets.len() * 8) as ffi::Py_ssize_t,
                1,
                flags,
            );
            if rc != 0 {
                return Err(PyErr::fetch(slf.py()));
            }
            // One u64 per block when the consumer asks for a shape and a format; plain
            // bytes otherwise (a consumer without a format must assume 1-byte items).
            let typed = ffi::PyBUF_ND | ffi::PyBUF_FORMAT;
            if flags & typed == typed {
                (*view).itemsize = 8;
                (*view).format = OFFSET_FORMAT.as_ptr() as *mut std::ffi::c_char;
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
