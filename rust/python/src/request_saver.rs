//! `RequestBlockSaver`: the CPU engine's saves of its requests' full blocks
//! (`Engine.save_blocks`, `save_requests`, `save_blocks_each`), request lookup and checks
//! included, as one Rust call each.
//!
//! At the tiny model's sizes (8 KiB blocks, 32 KiB a request) the copy itself takes about
//! a microsecond, and the Python around it (a dict lookup, three attribute reads and a
//! page-list slice a request, then a list of page ids for `PageGather.save` to read back)
//! cost as much again (BENCHMARKS.md, issue 23). Here the page ids go from each request's
//! own `pages` list straight into one `Vec<u64>`. The engine owns the requests (a dict of
//! request id -> `Request`); this object reads, per request, only `pages` (its page ids,
//! `pages_per_block` a block), `kv_end` and `num_computed` (tokens whose KV is written),
//! and never keeps them.

use std::ops::Range;

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::errors::invalid;
use crate::page_gather::{gather_into, PageGather};
use crate::page_gather_each::gather_each_into;

/// One request's KV, as the checks need it.
struct Held<'py> {
    /// The request's page ids (`Request.pages`).
    pages: Bound<'py, PyAny>,
    /// Tokens whose KV is computed: `max(kv_end, num_computed)`.
    computed: i64,
}

/// Saves full blocks of an engine's requests out of its paged KV cache on CPU.
#[pyclass(module = "mooncake_rs._core", frozen)]
pub struct RequestBlockSaver {
    gather: Py<PageGather>,
    requests: Py<PyDict>,
    block_size: i64,
    pages_per_block: usize,
}

impl RequestBlockSaver {
    /// The request `rid` names (the key as given, else its `str`), holding pages.
    fn lookup<'py>(&self, py: Python<'py>, rid: &Bound<'py, PyAny>) -> PyResult<Held<'py>> {
        let requests = self.requests.bind(py);
        // an unhashable id is simply not there (as with the engine's other lookups)
        let req = match requests.get_item(rid).ok().flatten() {
            Some(r) => Some(r),
            None if rid.is_instance_of::<pyo3::types::PyString>() => None,
            None => requests.get_item(rid.str()?)?,
        };
        let Some(req) = req else { return Err(no_pages(py, rid)) };
        let pages = req.getattr(intern!(py, "pages"))?;
        // its length, not its truth: a numpy array of ids has no truth value
        if pages.len()? == 0 {
            return Err(no_pages(py, rid));
        }
        let kv_end: i64 = req.getattr(intern!(py, "kv_end"))?.extract()?;
        let num_computed: i64 = req.getattr(intern!(py, "num_computed"))?.extract()?;
        Ok(Held { pages, computed: kv_end.max(num_computed) })
    }

    /// Appends the page ids of blocks `first .. first + num` of `held` to `out`.
    fn push_pages(
        &self,
        py: Python<'_>,
        rid: &Bound<'_, PyAny>,
        held: &Held<'_>,
        first: i64,
        num: i64,
        out: &mut Vec<u64>,
    ) -> PyResult<()> {
        let ppb = self.pages_per_block;
        // first >= 0 and num >= 1 were checked, and (first + num) * block_size fits in an
        // i64; pages_per_block <= block_size (checked at construction), so this cannot
        // overflow
        let (start, end) = (first as usize * ppb, (first + num) as usize * ppb);
        let bad = |what: &str| invalid(py, format!("the pages of request {} {what}", repr(rid)));
        let too_few = |have: usize| bad(&format!("are {have} ids; its blocks {first}..{} need {end}", first + num - 1));
        if let Ok(list) = held.pages.cast::<PyList>() {
            if list.len() < end {
                return Err(too_few(list.len()));
            }
            for i in start..end {
                out.push(list.get_item(i)?.extract::<u64>().map_err(|_| bad("must be non-negative ints"))?);
            }
            return Ok(());
        }
        let all = crate::segment_copy::offsets(py, &held.pages, "pages")?;
        let Some(ids) = all.get(start..end) else {
            return Err(too_few(all.len()));
        };
        out.extend_from_slice(ids);
        Ok(())
    }

    /// The cache planes of `layer` (its K and V), or of every layer.
    fn planes(&self, py: Python<'_>, layer: Option<&Bound<'_, PyAny>>) -> PyResult<Range<usize>> {
        let planes = self.gather.get().layout.planes;
        let Some(layer) = layer.filter(|l| !l.is_none()) else { return Ok(0..planes) };
        let nl = planes / 2;
        match layer.extract::<usize>() {
            Ok(l) if l < nl => Ok(2 * l..2 * l + 2),
            _ => Err(invalid(py, format!("layer {} out of range 0..{}", repr(layer), nl as i64 - 1))),
        }
    }

    /// Checks that blocks `first .. first + num` are all full blocks of computed KV.
    fn check_span(
        &self,
        py: Python<'_>,
        rid: &Bound<'_, PyAny>,
        held: &Held<'_>,
        first: i64,
        num: i64,
    ) -> PyResult<()> {
        let end = first.checked_add(num);
        let fits = end.and_then(|e| e.checked_mul(self.block_size)).is_some_and(|t| t <= held.computed);
        if first < 0 || num < 1 || !fits {
            let last = end.map_or_else(|| "?".to_string(), |e| (e - 1).to_string());
            return Err(invalid(
                py,
                format!(
                    "blocks {first}..{last} of request {} are not all full blocks of computed KV \
                                            ({} tokens computed)",
                    repr(rid),
                    held.computed
                ),
            ));
        }
        Ok(())
    }
}

#[pymethods]
impl RequestBlockSaver {
    /// `gather`: the engine's cache; `requests`: its dict of request id -> request (read
    /// at each call, never copied); `block_size` tokens a block of `pages_per_block` pages.
    #[new]
    fn new(
        py: Python<'_>,
        gather: Py<PageGather>,
        requests: Py<PyDict>,
        block_size: i64,
        pages_per_block: usize,
    ) -> PyResult<Self> {
        // a page holds at least one token, so pages_per_block <= block_size (push_pages'
        // index arithmetic relies on it)
        if block_size < 1 || pages_per_block < 1 || pages_per_block as u64 > block_size as u64 {
            return Err(invalid(
                py,
                format!(
                    "block_size ({block_size}) and pages_per_block ({pages_per_block}) must be \
                                            >= 1, and pages_per_block at most block_size"
                ),
            ));
        }
        Ok(RequestBlockSaver { gather, requests, block_size, pages_per_block })
    }

    /// `Engine.save_blocks` on CPU: full blocks `first_block .. first_block + num_blocks`
    /// of the request (all layers, or layer `layer`) back to back into `out` (a writable
    /// buffer or contiguous CPU tensor of exactly their bytes). `InvalidArgument` before
    /// anything is written.
    #[pyo3(signature = (request_id, first_block, num_blocks, out, layer=None))]
    fn save_blocks(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        first_block: &Bound<'_, PyAny>,
        num_blocks: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        layer: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (first_block, num_blocks) =
            (block_number(py, first_block, "first_block")?, block_number(py, num_blocks, "num_blocks")?);
        let held = self.lookup(py, request_id)?;
        self.check_span(py, request_id, &held, first_block, num_blocks)?;
        let mut pages = Vec::with_capacity(num_blocks as usize * self.pages_per_block);
        self.push_pages(py, request_id, &held, first_block, num_blocks, &mut pages)?;
        let planes = self.planes(py, layer)?;
        gather_into(py, self.gather.get(), &pages, self.pages_per_block, planes, out)
    }

    /// `Engine.save_requests` on CPU: for each `(request_id, first_block, num_blocks)` of
    /// `spans` in order, what `save_blocks` writes, back to back in `out`.
    /// `InvalidArgument` before anything is written.
    #[pyo3(signature = (spans, out, layer=None))]
    fn save_spans(
        &self,
        py: Python<'_>,
        spans: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        layer: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let mut pages: Vec<u64> = Vec::new();
        for span in spans.try_iter()? {
            let span = span?;
            let (rid, first, num) = span_parts(py, &span)?;
            let held = self.lookup(py, &rid)?;
            self.check_span(py, &rid, &held, first, num)?;
            self.push_pages(py, &rid, &held, first, num, &mut pages)?;
        }
        if pages.is_empty() {
            return Err(invalid(py, "spans is empty: name at least one (request_id, first_block, num_blocks)"));
        }
        let planes = self.planes(py, layer)?;
        gather_into(py, self.gather.get(), &pages, self.pages_per_block, planes, out)
    }

    /// `Engine.save_blocks_each` on CPU: full block `block_indices[i]` of the request into
    /// `outs[i]` (a whole block each; a single layer goes to its span).
    /// `InvalidArgument` before anything is written.
    #[pyo3(signature = (request_id, block_indices, outs, layer=None))]
    fn save_each(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        block_indices: &Bound<'_, PyAny>,
        outs: Vec<Bound<'_, PyAny>>,
        layer: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let held = self.lookup(py, request_id)?;
        let mut idx: Vec<i64> = Vec::with_capacity(outs.len());
        for i in block_indices.try_iter()? {
            idx.push(block_number(py, &i?, "block_indices")?);
        }
        if idx.len() != outs.len() {
            return Err(invalid(py, format!("{} blocks but {} buffers: one buffer a block", idx.len(), outs.len())));
        }
        if idx.is_empty() {
            return Ok(());
        }
        let mut pages = Vec::with_capacity(idx.len() * self.pages_per_block);
        for &i in &idx {
            if i < 0 || i.checked_add(1).and_then(|e| e.checked_mul(self.block_size)).is_none_or(|t| t > held.computed)
            {
                return Err(invalid(
                    py,
                    format!(
                        "block {i} of request {} is not a full block of computed KV \
                                                ({} tokens computed)",
                        repr(request_id),
                        held.computed
                    ),
                ));
            }
            self.push_pages(py, request_id, &held, i, 1, &mut pages)?;
        }
        let planes = self.planes(py, layer)?;
        // a layer goes to its span of the whole block: the planes before it
        let g = self.gather.get();
        let offset = g.layout.gathered_bytes(self.pages_per_block, planes.start);
        gather_each_into(py, g, &pages, self.pages_per_block, planes.start, planes.len(), &outs, offset)
    }
}

/// `(request_id, first_block, num_blocks)` of one span (a tuple, or any 3-item iterable).
fn span_parts<'py>(py: Python<'py>, span: &Bound<'py, PyAny>) -> PyResult<(Bound<'py, PyAny>, i64, i64)> {
    let bad = || {
        invalid(
            py,
            format!(
                "spans must hold (request_id, first_block, num_blocks) triples of a request id and two \
                             ints of at most 64 bits, got {}",
                repr(span)
            ),
        )
    };
    if let Ok(t) = span.cast::<PyTuple>() {
        if t.len() != 3 {
            return Err(bad());
        }
        let (first, num) = (t.get_item(1)?.extract().map_err(|_| bad())?, t.get_item(2)?.extract().map_err(|_| bad())?);
        return Ok((t.get_item(0)?, first, num));
    }
    let items: Vec<Bound<'py, PyAny>> = span.try_iter().map_err(|_| bad())?.collect::<PyResult<_>>()?;
    let [rid, first, num] = <[Bound<'py, PyAny>; 3]>::try_from(items).map_err(|_| bad())?;
    Ok((rid, first.extract().map_err(|_| bad())?, num.extract().map_err(|_| bad())?))
}

/// A block number given from Python (an int, or anything with `__index__`).
fn block_number(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<i64> {
    obj.extract().map_err(|_| invalid(py, format!("{what} must hold ints of at most 64 bits, got {}", repr(obj))))
}

fn no_pages(py: Python<'_>, rid: &Bound<'_, PyAny>) -> PyErr {
    invalid(py, format!("request {} holds no KV pages", repr(rid)))
}

/// Python's `repr` of `obj` (for messages).
fn repr(obj: &Bound<'_, PyAny>) -> String {
    obj.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".to_string())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RequestBlockSaver>()
}
