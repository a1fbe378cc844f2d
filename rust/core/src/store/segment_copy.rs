//! Gather/scatter of equal-length segments between two memories in one call, each
//! group of segments (a block) checksummed in the same pass.
//!
//! A KV block of one layer is a few contiguous segments of a cache tensor (K and V, or
//! pages), and a store slot holds them back to back: moving a layer's blocks is a list
//! of `(src offset, dst offset)` pairs of one length. Doing that list in Rust, with the
//! CRC-32 folded into the copy ([`super::crc32::copy_crc32`]), costs one memory pass per
//! byte, where a Python loop (or a torch gather then a copy, then a checksum) costs a call
//! per block and two or three passes.
//!
//! [`Stores::Streaming`] writes the destination with non-temporal stores: for a copy into
//! a store slot (written now, read by another request later) it skips reading each
//! destination line before writing it, which on a destination not in cache is one of the
//! two memory passes of the copy (BENCHMARKS.md, issue 23: 6.7 -> 12 GB/s into cold
//! slots), and it leaves the caller's cache to the caller.

use super::crc32::{copy_crc32, copy_crc32_streaming, crc32, store_fence};

/// How the destination is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stores {
    /// Ordinary stores: the copied bytes stay in cache (a destination read soon, such as
    /// an inference engine's KV cache that the next forward reads).
    Cached,
    /// Non-temporal stores, fenced before returning (a destination not read soon).
    Streaming,
}

/// What a segment list asks, checked before a byte moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentError(pub String);

impl std::fmt::Display for SegmentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SegmentError {}

fn check(what: &str, offsets: &[u64], length: usize, len: usize) -> Result<(), SegmentError> {
    for (i, &o) in offsets.iter().enumerate() {
        let end = o.checked_add(length as u64);
        if end.is_none_or(|e| e > len as u64) {
            return Err(SegmentError(format!(
                "{what}[{i}] = {o}: a segment of {length} bytes there ends past the buffer's {len} bytes"
            )));
        }
    }
    Ok(())
}

/// Copies segment `i` (`length` bytes) from `src[src_offsets[i]..]` to
/// `dst[dst_offsets[i]..]` for every `i` (with `dst` `None`, nothing is copied and only
/// the checksums are taken). With `crcs`, `crcs[g]` is continued with the CRC-32 of
/// segments `g*group .. (g+1)*group`, in order: start it at 0 for a fresh checksum, or
/// at a previous call's value to extend it (one layer after another of one block).
/// Nothing moves unless every offset is inside its buffer. With [`Stores::Streaming`] the
/// stores are fenced before this returns, so the bytes are ordered before whatever the
/// caller does next (a commit that makes them visible to another process).
#[allow(clippy::too_many_arguments)]
pub fn copy_segments(
    src: &[u8],
    src_offsets: &[u64],
    dst: Option<&mut [u8]>,
    dst_offsets: &[u64],
    length: usize,
    crcs: Option<&mut [u32]>,
    group: usize,
    stores: Stores,
) -> Result<(), SegmentError> {
    check("src_offsets", src_offsets, length, src.len())?;
    if let Some(d) = &dst {
        if dst_offsets.len() != src_offsets.len() {
            return Err(SegmentError(format!(
                "{} source offsets and {} destination offsets: one each per segment",
                src_offsets.len(),
                dst_offsets.len()
            )));
        }
        check("dst_offsets", dst_offsets, length, d.len())?;
    }
    let n = src_offsets.len();
    if let Some(c) = &crcs {
        if group == 0 || !n.is_multiple_of(group) || c.len() != n / group {
            return Err(SegmentError(format!(
                "{n} segments in groups of {group} need {} checksums, got {}",
                n.checked_div(group).unwrap_or(0),
                c.len()
            )));
        }
    }
    let streaming = stores == Stores::Streaming;
    match (dst, crcs) {
        (Some(d), Some(c)) => {
            for (i, (&s, &t)) in src_offsets.iter().zip(dst_offsets).enumerate() {
                let from = &src[s as usize..s as usize + length];
                let to = &mut d[t as usize..t as usize + length];
                // SAFETY: `from` and `to` are `length` bytes of two distinct borrows
                // (`src` shared, `dst` exclusive), so they cannot overlap.
                c[i / group] = unsafe {
                    if streaming {
                        copy_crc32_streaming(c[i / group], from.as_ptr(), to.as_mut_ptr(), length)
                    } else {
                        copy_crc32(c[i / group], from.as_ptr(), to.as_mut_ptr(), length)
                    }
                };
            }
        }
        (Some(d), None) if streaming => {
            // the checksum's folding is hidden behind the stores' memory traffic: one
            // streaming kernel serves both, its checksum dropped here
            for (&s, &t) in src_offsets.iter().zip(dst_offsets) {
                let from = &src[s as usize..s as usize + length];
                let to = &mut d[t as usize..t as usize + length];
                // SAFETY: as above, two distinct borrows of `length` bytes each.
                unsafe { copy_crc32_streaming(0, from.as_ptr(), to.as_mut_ptr(), length) };
            }
        }
        (Some(d), None) => {
            for (&s, &t) in src_offsets.iter().zip(dst_offsets) {
                d[t as usize..t as usize + length].copy_from_slice(&src[s as usize..s as usize + length]);
            }
        }
        (None, Some(c)) => {
            for (i, &s) in src_offsets.iter().enumerate() {
                c[i / group] = crc32(c[i / group], &src[s as usize..s as usize + length]);
            }
        }
        (None, None) => {}
    }
    if streaming {
        store_fence();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::crc32::crc32_tables;

    #[test]
    fn gathers_scatters_and_checksums_each_group() {
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; 4096];
        let (so, to) = ([1000u64, 0, 3000, 200], [0u64, 300, 600, 900]);
        let mut crcs = [0u32; 2];
        copy_segments(&src, &so, Some(&mut dst), &to, 300, Some(&mut crcs), 2, Stores::Cached).unwrap();
        let mut want = vec![0u8; 4096];
        for (&s, &t) in so.iter().zip(&to) {
            want[t as usize..t as usize + 300].copy_from_slice(&src[s as usize..s as usize + 300]);
        }
        assert_eq!(dst, want);
        assert_eq!(crcs[0], crc32_tables(0, &want[0..600]));
        assert_eq!(crcs[1], crc32_tables(0, &want[600..1200]));
        // checksums only, continued from the first values
        let mut more = crcs;
        copy_segments(&src, &so, None, &[], 300, Some(&mut more), 2, Stores::Cached).unwrap();
        assert_eq!(more[0], crc32_tables(crcs[0], &want[0..600]));
    }

    #[test]
    fn streaming_stores_write_what_cached_ones_do() {
        // odd lengths and offsets (unaligned heads, tails under 16 bytes, segments under
        // the folding's 128 bytes), with and without checksums
        let src: Vec<u8> = (0..70_000u32).map(|i| (i * 13 + 5) as u8).collect();
        for length in [1usize, 100, 127, 128, 129, 4096 + 3, 20_000] {
            let so: Vec<u64> = (0..3u64).map(|i| i * length as u64 + 7 * i + 1).collect();
            let to: Vec<u64> = (0..3u64).map(|i| i * (length as u64 + 5) + 3).collect();
            let (mut want, mut want_crcs) = (vec![0u8; 70_000], [0u32; 3]);
            copy_segments(&src, &so, Some(&mut want), &to, length, Some(&mut want_crcs), 1, Stores::Cached).unwrap();
            let (mut got, mut got_crcs) = (vec![0u8; 70_000], [0u32; 3]);
            copy_segments(&src, &so, Some(&mut got), &to, length, Some(&mut got_crcs), 1, Stores::Streaming).unwrap();
            assert_eq!(got, want, "length {length}");
            assert_eq!(got_crcs, want_crcs, "length {length}");
            for (k, &s) in so.iter().enumerate() {
                assert_eq!(got_crcs[k], crc32_tables(0, &src[s as usize..s as usize + length]));
            }
            let mut plain = vec![0u8; 70_000];
            copy_segments(&src, &so, Some(&mut plain), &to, length, None, 1, Stores::Streaming).unwrap();
            assert_eq!(plain, want, "length {length}, no checksums");
        }
    }

    #[test]
    fn refuses_out_of_bounds_and_mismatched_lists_before_copying() {
        let src = vec![1u8; 100];
        let mut dst = vec![0u8; 100];
        assert!(copy_segments(&src, &[0, 90], Some(&mut dst), &[0, 10], 20, None, 1, Stores::Streaming).is_err());
        assert!(copy_segments(&src, &[0], Some(&mut dst), &[0, 10], 20, None, 1, Stores::Streaming).is_err());
        assert!(copy_segments(&src, &[0], Some(&mut dst), &[u64::MAX], 20, None, 1, Stores::Streaming).is_err());
        assert!(copy_segments(
            &src,
            &[0, 20, 40],
            Some(&mut dst),
            &[0, 20, 40],
            20,
            Some(&mut [0; 2]),
            2,
            Stores::Streaming
        )
        .is_err());
        assert!(copy_segments(&src, &[0], Some(&mut dst), &[0], 20, Some(&mut [0; 1]), 0, Stores::Streaming).is_err());
        assert_eq!(dst, vec![0u8; 100]);
    }
}
