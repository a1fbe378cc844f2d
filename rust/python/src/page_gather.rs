//! `PageGather`: a paged KV cache's blocks into store bytes, one call a request
//! (`mooncake_core::store::page_gather`). Made once per cache with its shape, so a save
//! passes only the request's page ids and the destination: no offset arrays, no tensor
//! metadata per call.

use mooncake_core::store::page_gather::{gather_pages, PagedLayout};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use crate::convert::BufferView;
use crate::errors::invalid;
use crate::gil::{detached_if, DETACH_STORE_BYTES};
use crate::segment_copy::offsets;

static TORCH_TENSOR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Where `save` writes: an exported buffer, or a CPU torch tensor's memory.
pub(crate) enum Out {
    Buffer(BufferView),
    /// (data pointer, bytes) of a contiguous CPU `torch.Tensor` held by the caller.
    Tensor(usize, usize),
}

impl Out {
    pub(crate) fn raw(&self) -> (usize, usize) {
        match self {
            Out::Buffer(v) => (v.as_mut_ptr() as usize, v.len_bytes()),
            Out::Tensor(p, n) => (*p, *n),
        }
    }
}

/// `torch.Tensor`, when torch is loaded (an object can only be a tensor then).
fn torch_tensor_type(py: Python<'_>) -> PyResult<Option<&Bound<'_, PyType>>> {
    if let Some(t) = TORCH_TENSOR.get(py) {
        return Ok(Some(t.bind(py)));
    }
    let modules = py.import("sys")?.getattr("modules")?;
    let Ok(torch) = modules.get_item("torch") else { return Ok(None) };
    let t = torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind();
    Ok(Some(TORCH_TENSOR.get_or_init(py, || t).bind(py)))
}

/// `out` as writable bytes. A torch tensor is read through its own accessors: its
/// ``.numpy()`` view costs little itself, but making and dropping one per call slowed the
/// copy after it by ~10% (BENCHMARKS.md, issue 23).
pub(crate) fn out_bytes(py: Python<'_>, out: &Bound<'_, PyAny>) -> PyResult<Out> {
    if let Some(view) = BufferView::get(out, pyo3::ffi::PyBUF_WRITABLE | pyo3::ffi::PyBUF_C_CONTIGUOUS)
        .map_err(|e| invalid(py, format!("out must be a writable, C-contiguous buffer ({e})")))?
    {
        return Ok(Out::Buffer(view));
    }
    if let Some(tensor) = torch_tensor_type(py)? {
        // a plain tensor is exactly the type (no isinstance walk); subclasses too
        if out.get_type().is(tensor) || out.is_instance(tensor)? {
            if !out.getattr(intern!(py, "is_cpu"))?.extract::<bool>()? {
                return Err(invalid(py, "out is a tensor outside host memory: save into a CPU tensor or buffer"));
            }
            if !out.call_method0(intern!(py, "is_contiguous"))?.extract::<bool>()? {
                return Err(invalid(py, "out is a non-contiguous tensor: pass a contiguous one"));
            }
            let ptr: usize = out.call_method0(intern!(py, "data_ptr"))?.extract()?;
            let len: usize = out.getattr(intern!(py, "nbytes"))?.extract()?;
            return Ok(Out::Tensor(ptr, len));
        }
    }
    let t = out.get_type().name().map(|n| n.to_string()).unwrap_or_default();
    Err(invalid(py, format!("out must be a writable buffer (numpy array, bytearray) or a CPU tensor, got {t}")))
}

/// The bytes of a paged KV cache (`planes` planes — each layer's K then V — of
/// `num_pages` pages of `page_bytes`), kept with that shape; `save` copies a request's
/// blocks out of it.
#[pyclass(module = "mooncake_rs._core", frozen)]
pub struct PageGather {
    cache: CacheExport,
    pub(crate) layout: PagedLayout,
}

/// The cache's buffer, exported once for the life of its `PageGather`: exporting it
/// again at every save (a numpy export and release) was a tenth of a small save's fixed
/// cost. While exported, its exporter may not move or free the bytes (numpy refuses to
/// resize an exported array), so the address stays valid.
struct CacheExport {
    view: BufferView,
}

// SAFETY: only the export's address and length are read (while attached, or inside a
// call that the attached caller waits for); the export is released once, in
// BufferView's Drop, which attaches to the interpreter first. No Python object is touched
// without the GIL.
unsafe impl Send for CacheExport {}
// SAFETY: as above; reads of the address and length never race with a write (the view is
// written only when exported and when released).
unsafe impl Sync for CacheExport {}

impl PageGather {
    /// (address, bytes) of the cache, valid while `self` lives.
    pub(crate) fn cache_bytes(&self) -> (usize, usize) {
        (self.cache.view.as_mut_ptr() as usize, self.cache.view.len_bytes())
    }
}

#[pymethods]
impl PageGather {
    /// `cache`: a C-contiguous buffer (e.g. the cache tensor's ``.numpy()`` bytes) of at
    /// least `planes * num_pages * page_bytes` bytes; kept alive (and exported) by this
    /// object.
    #[new]
    fn new(
        py: Python<'_>,
        cache: &Bound<'_, PyAny>,
        planes: usize,
        num_pages: usize,
        page_bytes: usize,
    ) -> PyResult<Self> {
        let layout = PagedLayout { planes, num_pages, page_bytes };
        let need = layout.cache_bytes().map_err(|e| invalid(py, e.0))?;
        let view = BufferView::get_contiguous(cache, "cache")?;
        if view.len_bytes() < need {
            return Err(invalid(
                py,
                format!(
                    "cache holds {} bytes; {planes} planes x {num_pages} pages x {page_bytes} bytes need {need}",
                    view.len_bytes()
                ),
            ));
        }
        Ok(PageGather { cache: CacheExport { view }, layout })
    }

    #[getter]
    fn planes(&self) -> usize {
        self.layout.planes
    }

    #[getter]
    fn num_pages(&self) -> usize {
        self.layout.num_pages
    }

    #[getter]
    fn page_bytes(&self) -> usize {
        self.layout.page_bytes
    }

    /// Copies the blocks made of `pages` (`pages_per_block` page ids a block, block after
    /// block; a list of ints or a uint64 buffer) into `out` (a writable buffer or a
    /// contiguous CPU torch tensor of exactly
    /// `len(pages) * num_planes * page_bytes` bytes): each block's planes `first_plane ..
    /// first_plane + num_planes` in order, each plane's pages in order. The GIL is
    /// released while large copies run. `InvalidArgument` before anything moves if a page
    /// id or a plane is outside the cache or `out` has the wrong size.
    fn save(
        &self,
        py: Python<'_>,
        pages: &Bound<'_, PyAny>,
        pages_per_block: usize,
        first_plane: usize,
        num_planes: usize,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let pages = offsets(py, pages, "pages")?;
        gather_into(py, self, &pages, pages_per_block, first_plane..first_plane.saturating_add(num_planes), out)
    }
}

/// `PageGather.save` once its page ids are read: the blocks of `pages` (planes `planes`)
/// into `out`, checked (`InvalidArgument` before anything moves).
pub(crate) fn gather_into(
    py: Python<'_>,
    g: &PageGather,
    pages: &[u64],
    pages_per_block: usize,
    planes: std::ops::Range<usize>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let dst = out_bytes(py, out)?;
    let (cp, cl) = g.cache_bytes();
    let (dp, dl) = dst.raw();
    if cp < dp + dl && dp < cp + cl {
        return Err(invalid(py, "out shares memory with the cache: save into a separate buffer"));
    }
    let layout = g.layout;
    let result = detached_if(py, dl >= DETACH_STORE_BYTES, move || {
        // SAFETY: the cache is exported for the life of `g`, which the caller holds
        // until after the closure returns; `out` is an export held likewise (writable), or a contiguous CPU
        // tensor that the caller's reference keeps alive for the call, whose
        // data_ptr/nbytes torch guarantees (as for its own .numpy() view; resizing it
        // from another thread during the call is the caller's bug, as with that view).
        // `out` does not overlap the cache (checked), so the slices never alias.
        let (c, d) = unsafe {
            (std::slice::from_raw_parts(cp as *const u8, cl), std::slice::from_raw_parts_mut(dp as *mut u8, dl))
        };
        gather_pages(c, &layout, pages, pages_per_block, planes, d)
    });
    drop(dst);
    result.map_err(|e| invalid(py, e.0))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PageGather>()
}
