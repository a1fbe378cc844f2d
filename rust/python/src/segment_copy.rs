//! `copy_segments` and `crc32`: the core's segment gather/scatter with its checksum in the
//! same pass (`mooncake_core::store::segment_copy`), on any two buffers (a KV cache's
//! storage, a store's arena mapped in this process). One call moves a layer's blocks;
//! the GIL is released while bytes move.

use mooncake_core::store::crc32::crc32 as core_crc32;
use mooncake_core::store::segment_copy::{copy_segments as core_copy_segments, Stores};
use pyo3::prelude::*;

use crate::convert::BufferView;
use crate::errors::invalid;
use crate::gil::{detached_if, DETACH_STORE_BYTES};

pub(crate) fn offsets(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    // a list first: trying the buffer protocol on one raises (and drops) a TypeError,
    // which costs more than a short list's whole conversion
    if obj.is_instance_of::<pyo3::types::PyList>() {
        return obj
            .extract::<Vec<u64>>()
            .map_err(|_| invalid(py, format!("{what} must be a sequence of non-negative ints or a uint64 buffer")));
    }
    if let Ok(buf) = pyo3::buffer::PyBuffer::<u64>::get(obj) {
        return buf.to_vec(py);
    }
    obj.extract::<Vec<u64>>()
        .map_err(|_| invalid(py, format!("{what} must be a sequence of non-negative ints or a uint64 buffer")))
}

fn overlaps(a: &BufferView, b: &BufferView) -> bool {
    let (a0, b0) = (a.as_mut_ptr() as usize, b.as_mut_ptr() as usize);
    a0 < b0 + b.len_bytes() && b0 < a0 + a.len_bytes()
}

/// Copies `length` bytes from `src[src_offsets[i]:]` to `dst[dst_offsets[i]:]` for every
/// `i`, in one call with the GIL released; with `crcs` (a writable uint32 buffer of one
/// entry per `group` segments) each entry is continued with the CRC-32 (zlib's) of its
/// segments, taken in the same pass. `dst=None`: checksums only. `streaming=True` writes
/// `dst` with non-temporal stores (bypassing the cache; fenced before returning): for a
/// destination not read soon, such as a store slot. `InvalidArgument` before
/// anything moves if an offset is out of range, the lists differ in length, `crcs` has the
/// wrong size, or `src` and `dst` share memory.
#[pyfunction]
#[pyo3(signature = (src, src_offsets, dst, dst_offsets, length, crcs=None, group=1, streaming=false))]
#[allow(clippy::too_many_arguments)]
fn copy_segments(
    py: Python<'_>,
    src: &Bound<'_, PyAny>,
    src_offsets: &Bound<'_, PyAny>,
    dst: Option<&Bound<'_, PyAny>>,
    dst_offsets: &Bound<'_, PyAny>,
    length: usize,
    crcs: Option<&Bound<'_, PyAny>>,
    group: usize,
    streaming: bool,
) -> PyResult<()> {
    let src_view = BufferView::get_contiguous(src, "src")?;
    let dst_view = dst.map(|d| BufferView::get_writable(d, "dst")).transpose()?;
    let crc_view = crcs.map(|c| BufferView::get_writable(c, "crcs")).transpose()?;
    let so = offsets(py, src_offsets, "src_offsets")?;
    let to = if dst.is_some() { offsets(py, dst_offsets, "dst_offsets")? } else { Vec::new() };
    if let Some(d) = &dst_view {
        if overlaps(&src_view, d) {
            return Err(invalid(py, "src and dst share memory: copy_segments copies between two distinct buffers"));
        }
    }
    if let Some(c) = &crc_view {
        if !c.len_bytes().is_multiple_of(4) || !(c.as_mut_ptr() as usize).is_multiple_of(4) {
            return Err(invalid(py, "crcs must be an aligned uint32 buffer (e.g. numpy.zeros(n, numpy.uint32))"));
        }
        if dst_view.as_ref().is_some_and(|d| overlaps(c, d)) || overlaps(c, &src_view) {
            return Err(invalid(py, "crcs must not share memory with src or dst"));
        }
    }
    let total = so.len().saturating_mul(length);
    let (sp, sl) = (src_view.as_mut_ptr() as usize, src_view.len_bytes());
    let dst_raw = dst_view.as_ref().map(|d| (d.as_mut_ptr() as usize, d.len_bytes()));
    let crc_raw = crc_view.as_ref().map(|c| (c.as_mut_ptr() as usize, c.len_bytes() / 4));
    let result = detached_if(py, total >= DETACH_STORE_BYTES, move || {
        // SAFETY: each (ptr, len) is a buffer exported above and held (the views live
        // until this function returns, after the closure); `dst` and `crcs` were exported
        // writable; the three were checked not to overlap, so the shared and the
        // exclusive slices never alias. `crcs` is 4-aligned and a whole number of u32.
        let (s, d, c) = unsafe {
            (
                std::slice::from_raw_parts(sp as *const u8, sl),
                dst_raw.map(|(p, n)| std::slice::from_raw_parts_mut(p as *mut u8, n)),
                crc_raw.map(|(p, n)| std::slice::from_raw_parts_mut(p as *mut u32, n)),
            )
        };
        let stores = if streaming { Stores::Streaming } else { Stores::Cached };
        core_copy_segments(s, &so, d, &to, length, c, group, stores)
    });
    drop((src_view, dst_view, crc_view));
    result.map_err(|e| invalid(py, e.0))
}

/// CRC-32 of `data` (any C-contiguous buffer) continued from `value`: equal to
/// `zlib.crc32(data, value)`, faster (carry-less multiplication where the CPU has it).
#[pyfunction]
#[pyo3(signature = (data, value=0))]
fn crc32(py: Python<'_>, data: &Bound<'_, PyAny>, value: u32) -> PyResult<u32> {
    let view = BufferView::get_contiguous(data, "data")?;
    let (p, n) = (view.as_mut_ptr() as usize, view.len_bytes());
    // SAFETY: the exported buffer stays held by `view` until after the closure returns.
    let crc = detached_if(py, n >= DETACH_STORE_BYTES, move || {
        core_crc32(value, unsafe { std::slice::from_raw_parts(p as *const u8, n) })
    });
    drop(view);
    Ok(crc)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(copy_segments, m)?)?;
    m.add_function(wrap_pyfunction!(crc32, m)?)?;
    Ok(())
}
