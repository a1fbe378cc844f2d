//! How one object (a value of any length) lies in fixed-size chunks, and which byte
//! ranges a transfer of it moves when its chunks sit at given offsets of a remote
//! region. The one owner of this layout: the store's local object batches
//! (`store::object_batch`) and the pool's remote object batches (`transfer::objects`)
//! both cut objects here.
//!
//! Chunk `j` of an object of `size` bytes in chunks of `chunk_bytes` covers bytes
//! `[j * chunk_bytes, min((j + 1) * chunk_bytes, size))`; an empty object is one empty
//! chunk (it still takes a slot, so that it exists).

/// A layout that cannot be planned (the node's answer and the caller's pieces disagree).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LayoutError(pub String);

/// How many chunks hold an object of `size` bytes (at least one). `chunk_bytes` > 0.
pub fn chunk_count(size: u64, chunk_bytes: u64) -> u64 {
    size.div_ceil(chunk_bytes).max(1)
}

/// Chunk `j`'s first byte in the object and its length.
pub fn chunk_range(size: u64, chunk_bytes: u64, j: u64) -> (u64, u64) {
    let start = j * chunk_bytes;
    (start, chunk_bytes.min(size.saturating_sub(start)))
}

/// One transfer request of an object: `len` bytes at `piece_offset` of the caller's
/// piece `piece`, at `remote_offset` of the node's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub piece: usize,
    pub piece_offset: u64,
    pub remote_offset: u64,
    pub len: u64,
}

/// Appends to `out` the spans moving the first `total` bytes of the caller's pieces
/// (`piece_sizes[p]` bytes each, back to back) to or from the object's chunks, chunk `c`
/// at `offsets[c]` of the remote region. Where a chunk's slot follows the previous one's
/// and the piece runs on, the two become one span (fewer requests: the node hands an
/// object's slots out in ascending order, so a whole object is usually one span per
/// piece). Pieces past `total` are not touched; pieces shorter than `total` leave the
/// rest unmoved.
pub fn plan_spans(
    piece_sizes: &[u64],
    total: u64,
    chunk_bytes: u64,
    offsets: &[u64],
    out: &mut Vec<Span>,
) -> Result<(), LayoutError> {
    if chunk_bytes == 0 {
        return Err(LayoutError("chunk_bytes is 0: a node answers a chunk size > 0 for every object".into()));
    }
    let covered = piece_sizes.iter().fold(0u64, |a, &n| a.saturating_add(n)).min(total);
    let needed = covered.div_ceil(chunk_bytes);
    if (offsets.len() as u64) < needed {
        return Err(LayoutError(format!(
            "{} chunk offsets for {covered} bytes in chunks of {chunk_bytes}: the node's answer needs {needed}",
            offsets.len()
        )));
    }
    let first = out.len();
    let mut pos = 0u64; // where the current piece starts in the object
    for (piece, &size) in piece_sizes.iter().enumerate() {
        let n = size.min(total.saturating_sub(pos));
        if n == 0 {
            if pos >= total {
                break;
            }
            continue; // an empty piece before the end: nothing of it moves
        }
        let (mut s, e) = (pos, pos + n);
        while s < e {
            let (c, within) = (s / chunk_bytes, s % chunk_bytes);
            let take = (e - s).min(chunk_bytes - within);
            let remote = offsets[c as usize];
            if remote.checked_add(within + take).is_none() {
                return Err(LayoutError(format!("chunk {c} at offset {remote} of the region overflows its end")));
            }
            let remote = remote + within;
            let piece_offset = s - pos;
            let runs_on = out.len() > first
                && out.last().is_some_and(|l| {
                    l.piece == piece && l.piece_offset + l.len == piece_offset && l.remote_offset + l.len == remote
                });
            match out.last_mut() {
                Some(last) if runs_on => last.len += take,
                _ => out.push(Span { piece, piece_offset, remote_offset: remote, len: take }),
            }
            s += take;
        }
        pos = e;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: one span per (piece, chunk) overlap, nothing merged, walked byte
    /// range by byte range in the most direct way.
    fn per_chunk(sizes: &[u64], total: u64, chunk: u64, offsets: &[u64]) -> Vec<Span> {
        let mut out = Vec::new();
        let mut pos = 0;
        for (p, &n) in sizes.iter().enumerate() {
            let end = (pos + n).min(total);
            for c in 0..chunk_count(total, chunk) {
                let (cs, cl) = chunk_range(total, chunk, c);
                let (lo, hi) = (cs.max(pos), (cs + cl).min(end));
                if lo < hi {
                    out.push(Span {
                        piece: p,
                        piece_offset: lo - pos,
                        remote_offset: offsets[c as usize] + lo - cs,
                        len: hi - lo,
                    });
                }
            }
            pos += n;
        }
        out
    }

    /// Every byte as (piece, offset in piece) -> remote offset, checking none moves twice.
    fn bytes_of(spans: &[Span]) -> std::collections::BTreeMap<(usize, u64), u64> {
        let mut m = std::collections::BTreeMap::new();
        for s in spans {
            for k in 0..s.len {
                assert!(m.insert((s.piece, s.piece_offset + k), s.remote_offset + k).is_none(), "a byte moved twice");
            }
        }
        m
    }

    fn plan(sizes: &[u64], total: u64, chunk: u64, offsets: &[u64]) -> Vec<Span> {
        let mut out = Vec::new();
        plan_spans(sizes, total, chunk, offsets, &mut out).unwrap();
        out
    }

    #[test]
    fn spans_move_the_bytes_of_a_per_chunk_plan_merged_as_far_as_they_run_on() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut rnd = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..3000 {
            let chunk = [1, 3, 8, 16][rnd(4) as usize];
            let total = 1 + rnd(90);
            let n = chunk_count(total, chunk);
            // slots: contiguous from a base, or scattered (distinct, any order)
            let slots: Vec<u64> = if rnd(2) == 0 {
                let base = rnd(5);
                (base..base + n).collect()
            } else {
                let mut pool: Vec<u64> = (0..n + 6).collect();
                (0..n).map(|_| pool.swap_remove(rnd(pool.len() as u64) as usize)).collect()
            };
            let offsets: Vec<u64> = slots.iter().map(|s| s * chunk).collect();
            // pieces: cuts anywhere, possibly past `total` and possibly empty
            let mut edges = vec![0];
            for _ in 0..rnd(4) {
                edges.push(rnd(total + 5));
            }
            edges.push(total + rnd(6));
            edges.sort();
            let sizes: Vec<u64> = edges.windows(2).map(|w| w[1] - w[0]).collect();
            let fast = plan(&sizes, total, chunk, &offsets);
            let slow = per_chunk(&sizes, total, chunk, &offsets);
            assert_eq!(bytes_of(&fast), bytes_of(&slow), "{sizes:?} {total} {chunk} {offsets:?}");
            assert!(fast.iter().all(|s| s.len > 0));
            // merged as far as possible: no two neighbours continue each other
            for w in fast.windows(2) {
                let (a, b) = (w[0], w[1]);
                assert!(
                    !(a.piece == b.piece
                        && a.piece_offset + a.len == b.piece_offset
                        && a.remote_offset + a.len == b.remote_offset)
                );
            }
            if slots.windows(2).all(|w| w[1] == w[0] + 1) {
                let touched = slow.iter().map(|s| s.piece).collect::<std::collections::BTreeSet<_>>().len();
                assert_eq!(fast.len(), touched, "contiguous slots: one span per piece");
            }
        }
    }

    #[test]
    fn a_contiguous_object_is_one_span_and_a_reversed_one_a_span_per_chunk() {
        let s = |piece, piece_offset, remote_offset, len| Span { piece, piece_offset, remote_offset, len };
        assert_eq!(plan(&[1000], 1000, 256, &[0, 256, 512, 768]), vec![s(0, 0, 0, 1000)]);
        assert_eq!(
            plan(&[1000], 1000, 256, &[768, 512, 256, 0]),
            vec![s(0, 0, 768, 256), s(0, 256, 512, 256), s(0, 512, 256, 256), s(0, 768, 0, 232)]
        );
        // only the first `total` bytes; a later piece starts a new span
        assert_eq!(plan(&[600, 600], 700, 256, &[0, 256, 512]), vec![s(0, 0, 0, 600), s(1, 0, 600, 100)]);
        // an empty object moves nothing (its one chunk is empty)
        assert_eq!(plan(&[0], 0, 256, &[4096]), vec![]);
    }

    #[test]
    fn too_few_offsets_a_zero_chunk_and_an_overflowing_offset_are_refused() {
        let mut out = Vec::new();
        assert!(plan_spans(&[1000], 1000, 256, &[0, 256, 512], &mut out).is_err());
        assert!(plan_spans(&[10], 10, 0, &[0], &mut out).is_err());
        assert!(plan_spans(&[10], 10, 8, &[0, u64::MAX - 1], &mut out).is_err());
        // pieces shorter than total need offsets only for what they cover
        assert!(plan_spans(&[100], 1000, 256, &[0], &mut out).is_ok());
    }

    #[test]
    fn chunk_ranges_tile_the_object() {
        for size in [0u64, 1, 255, 256, 257, 1000] {
            let n = chunk_count(size, 256);
            let ranges: Vec<_> = (0..n).map(|j| chunk_range(size, 256, j)).collect();
            assert_eq!(ranges.iter().map(|r| r.1).sum::<u64>(), size);
            assert!(ranges.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
        }
    }
}
