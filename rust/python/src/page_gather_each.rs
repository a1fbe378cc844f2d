//! `page_gather_each`: a request's blocks out of a paged KV cache, each into its own
//! buffer (a store slot), in one call. `PageGather.save` writes blocks back to back into
//! one buffer; a serving instance's blocks go to separate slots of its store, which it
//! filled one `save_block` (a torch gather) at a time.

use mooncake_core::store::page_gather::gather_pages;
use pyo3::prelude::*;

use crate::errors::invalid;
use crate::gil::{detached_if, DETACH_STORE_BYTES};
use crate::page_gather::{out_bytes, Out, PageGather};
use crate::segment_copy::offsets;

/// Copies block `i` of `pages` (`pages_per_block` page ids a block, block after block)
/// into `outs[i]` at byte `offset`: its planes `first_plane .. first_plane + num_planes`
/// in order, each plane's pages in order (what `PageGather.save` writes for one block).
/// `outs`: one writable buffer or contiguous CPU tensor a block, each at least `offset +
/// pages_per_block * num_planes * page_bytes` bytes. `InvalidArgument` before anything
/// moves if a page id or a plane is outside the cache, the counts differ, or a buffer is
/// too small, read-only or shares memory with the cache. The GIL is released while large
/// copies run.
#[pyfunction]
#[pyo3(signature = (gather, pages, pages_per_block, first_plane, num_planes, outs, offset=0))]
#[allow(clippy::too_many_arguments)]
pub fn page_gather_each(
    py: Python<'_>,
    gather: &Bound<'_, PageGather>,
    pages: &Bound<'_, PyAny>,
    pages_per_block: usize,
    first_plane: usize,
    num_planes: usize,
    outs: Vec<Bound<'_, PyAny>>,
    offset: usize,
) -> PyResult<()> {
    let pages = offsets(py, pages, "pages")?;
    gather_each_into(py, gather.get(), &pages, pages_per_block, first_plane, num_planes, &outs, offset)
}

/// `page_gather_each` once its page ids are read: block `i` of `pages` into `outs[i]` at
/// byte `offset`, checked (`InvalidArgument` before anything moves).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gather_each_into(
    py: Python<'_>,
    g: &PageGather,
    pages: &[u64],
    pages_per_block: usize,
    first_plane: usize,
    num_planes: usize,
    outs: &[Bound<'_, PyAny>],
    offset: usize,
) -> PyResult<()> {
    let layout = g.layout;
    if pages_per_block == 0 || pages.len() != outs.len().saturating_mul(pages_per_block) {
        return Err(invalid(
            py,
            format!("{} pages are not {} blocks of {pages_per_block} pages (one a buffer)", pages.len(), outs.len()),
        ));
    }
    let planes = first_plane..first_plane.saturating_add(num_planes);
    if num_planes == 0 || planes.end > layout.planes {
        return Err(invalid(
            py,
            format!(
                "planes {first_plane}..{} are not a non-empty range of the cache's {} planes",
                planes.end, layout.planes
            ),
        ));
    }
    if let Some((i, p)) = pages.iter().enumerate().find(|(_, &p)| p >= layout.num_pages as u64) {
        return Err(invalid(py, format!("pages[{i}] = {p}: the cache has {} pages", layout.num_pages)));
    }
    let (cp, cl) = g.cache_bytes();
    let per = layout.gathered_bytes(pages_per_block, num_planes);
    let need = offset.checked_add(per).ok_or_else(|| invalid(py, "offset is too large"))?;
    let mut held: Vec<Out> = Vec::with_capacity(outs.len());
    let mut raw: Vec<usize> = Vec::with_capacity(outs.len());
    for (i, out) in outs.iter().enumerate() {
        let o = out_bytes(py, out)?;
        let (dp, dl) = o.raw();
        if dl < need {
            return Err(invalid(py, format!("outs[{i}] holds {dl} bytes; a block at offset {offset} needs {need}")));
        }
        if cp < dp + dl && dp < cp + cl {
            return Err(invalid(py, format!("outs[{i}] shares memory with the cache: save into a separate buffer")));
        }
        raw.push(dp + offset);
        held.push(o);
    }
    let result = detached_if(py, per.saturating_mul(outs.len()) >= DETACH_STORE_BYTES, move || {
        // SAFETY: the cache is exported for the life of `g`, held by the caller until after
        // the closure returns; each destination is an export held in `held` (writable) or
        // a contiguous CPU tensor the caller's list keeps alive for the call (as in
        // `PageGather.save`), at least `offset + per` bytes (checked), outside the cache
        // (checked). One destination slice exists at a time, so two buffers that overlap
        // each other never give two live `&mut` to the same bytes.
        let c = unsafe { std::slice::from_raw_parts(cp as *const u8, cl) };
        for (i, &dp) in raw.iter().enumerate() {
            let d = unsafe { std::slice::from_raw_parts_mut(dp as *mut u8, per) };
            gather_pages(
                c,
                &layout,
                &pages[i * pages_per_block..(i + 1) * pages_per_block],
                pages_per_block,
                planes.clone(),
                d,
            )?;
        }
        Ok::<(), mooncake_core::store::segment_copy::SegmentError>(())
    });
    drop(held);
    result.map_err(|e| invalid(py, e.0))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(page_gather_each, m)?)
}
