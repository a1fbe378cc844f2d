//! A paged KV cache's blocks gathered into store bytes in one call.
//!
//! An engine's KV cache is `planes` planes (each layer's K, then its V) of `num_pages`
//! pages of `page_bytes`; a block is `pages_per_block` pages, and the store's layout of a
//! block is plane after plane (layer 0 K, layer 0 V, layer 1 K, ...), each plane's pages
//! in order. Saving a request's blocks is then a walk over (block, plane, page) that
//! copies runs of the cache straight into the buffer. Doing the walk here, from the page
//! list itself, spares the caller building two offset arrays per call (at a few blocks
//! that bookkeeping cost several times the copy), and a block's pages that follow one
//! another in the cache move as one run.

use std::ops::Range;

use super::segment_copy::SegmentError;

/// The shape of a paged KV cache in bytes: `planes` planes of `num_pages` pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedLayout {
    pub planes: usize,
    pub num_pages: usize,
    pub page_bytes: usize,
}

impl PagedLayout {
    /// Bytes of the whole cache; an error if that overflows or any dimension is 0.
    pub fn cache_bytes(&self) -> Result<usize, SegmentError> {
        let total = self.planes.checked_mul(self.num_pages).and_then(|n| n.checked_mul(self.page_bytes));
        match total {
            Some(t) if t > 0 => Ok(t),
            _ => Err(SegmentError(format!(
                "a paged cache of {} planes x {} pages x {} bytes is empty or too large",
                self.planes, self.num_pages, self.page_bytes
            ))),
        }
    }

    /// Bytes that [`gather_pages`] writes for `pages` pages of `planes` planes.
    pub fn gathered_bytes(&self, pages: usize, planes: usize) -> usize {
        pages.saturating_mul(planes).saturating_mul(self.page_bytes)
    }
}

/// Copies blocks of `pages_per_block` pages (`pages`, block after block) of the planes
/// `planes` of `cache` into `out`, laid out block by block, each block plane by plane,
/// each plane page by page. `out` must be exactly that many bytes. Nothing moves unless
/// every page id, the planes and both lengths are valid.
pub fn gather_pages(
    cache: &[u8],
    layout: &PagedLayout,
    pages: &[u64],
    pages_per_block: usize,
    planes: Range<usize>,
    out: &mut [u8],
) -> Result<(), SegmentError> {
    let cache_bytes = layout.cache_bytes()?;
    if cache.len() < cache_bytes {
        return Err(SegmentError(format!("the cache holds {} bytes, its layout needs {cache_bytes}", cache.len())));
    }
    if pages_per_block == 0 || pages.is_empty() || !pages.len().is_multiple_of(pages_per_block) {
        return Err(SegmentError(format!("{} pages are not whole blocks of {pages_per_block} pages", pages.len())));
    }
    if planes.start >= planes.end || planes.end > layout.planes {
        return Err(SegmentError(format!(
            "planes {}..{} are not a non-empty range of the cache's {} planes",
            planes.start, planes.end, layout.planes
        )));
    }
    if let Some((i, &p)) = pages.iter().enumerate().find(|(_, &p)| p >= layout.num_pages as u64) {
        return Err(SegmentError(format!("pages[{i}] = {p}: the cache has {} pages", layout.num_pages)));
    }
    let want = layout.gathered_bytes(pages.len(), planes.len());
    if out.len() != want {
        return Err(SegmentError(format!(
            "the buffer holds {} bytes; {} pages of {} planes are {want}",
            out.len(),
            pages.len(),
            planes.len()
        )));
    }
    let pb = layout.page_bytes;
    let plane_bytes = layout.num_pages * pb;
    let mut at = 0;
    for block in pages.chunks_exact(pages_per_block) {
        for plane in planes.clone() {
            let base = plane * plane_bytes;
            let mut i = 0;
            while i < block.len() {
                // a run of pages that follow one another in the cache: one copy
                let mut run = 1;
                while i + run < block.len() && block[i + run] == block[i] + run as u64 {
                    run += 1;
                }
                let from = base + block[i] as usize * pb;
                let len = run * pb;
                out[at..at + len].copy_from_slice(&cache[from..from + len]);
                at += len;
                i += run;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, one page at a time.
    fn reference(cache: &[u8], l: &PagedLayout, pages: &[u64], per: usize, planes: Range<usize>) -> Vec<u8> {
        let mut out = Vec::new();
        for block in pages.chunks(per) {
            for plane in planes.clone() {
                for &p in block {
                    let at = (plane * l.num_pages + p as usize) * l.page_bytes;
                    out.extend_from_slice(&cache[at..at + l.page_bytes]);
                }
            }
        }
        out
    }

    #[test]
    fn gathers_what_the_definition_says() {
        let l = PagedLayout { planes: 6, num_pages: 40, page_bytes: 24 };
        let cache: Vec<u8> = (0..l.cache_bytes().unwrap() as u32).map(|i| (i * 31 + 7) as u8).collect();
        // runs, gaps, reversed and repeated pages; one page a block; a single block
        let cases: [(&[u64], usize); 5] = [
            (&[3, 4, 5, 9, 10, 0], 3),
            (&[7, 6, 5, 4], 2),
            (&[39, 39, 1, 2], 4),
            (&[0, 1, 2, 3, 4, 5, 6, 7], 1),
            (&[12], 1),
        ];
        for (pages, per) in cases {
            for planes in [0..6, 2..4, 5..6] {
                let want = reference(&cache, &l, pages, per, planes.clone());
                let mut out = vec![0u8; want.len()];
                gather_pages(&cache, &l, pages, per, planes.clone(), &mut out).unwrap();
                assert_eq!(out, want, "pages {pages:?} per {per} planes {planes:?}");
            }
        }
    }

    #[test]
    fn refuses_bad_input_before_copying() {
        let l = PagedLayout { planes: 4, num_pages: 8, page_bytes: 16 };
        let cache = vec![1u8; 512];
        let mut out = vec![0u8; 2 * 4 * 16];
        // (cache, pages, pages a block, planes)
        type Case<'a> = (&'a [u8], &'a [u64], usize, Range<usize>);
        let bad: [Case; 7] = [
            (&cache, &[0, 8], 1, 0..4),        // page past the cache
            (&cache, &[0, 1, 2], 2, 0..4),     // not whole blocks
            (&cache, &[0, 1], 0, 0..4),        // zero pages a block
            (&cache, &[0, 1], 1, 2..5),        // planes past the cache
            (&cache, &[0, 1], 1, 2..2),        // no plane
            (&cache, &[0, 1, 2], 1, 0..4),     // out of the wrong size
            (&cache[..500], &[0, 1], 1, 0..4), // cache shorter than its layout
        ];
        for (c, pages, per, planes) in bad {
            assert!(gather_pages(c, &l, pages, per, planes, &mut out).is_err(), "{pages:?} {per}");
        }
        assert!(out.iter().all(|&b| b == 0));
        let empty = PagedLayout { planes: 0, num_pages: 8, page_bytes: 16 };
        assert!(empty.cache_bytes().is_err());
    }
}
