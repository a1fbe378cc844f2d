//! A plain memory copy with non-temporal (streaming) stores, for batch copies whose
//! destination is not read soon (store slots; a get batch larger than a core's cache;
//! a verified record landing in a region a TCP write targets, `transfer/tcp/seal_reader.rs`).
//!
//! An ordinary store first reads the destination line into cache ("read for ownership"),
//! so a cached copy of a destination not in cache moves each byte three times through
//! the memory system; a streaming store writes the line whole. glibc's `memcpy` streams
//! only above a threshold derived from the L3 size, which a virtual machine that reports
//! a large L3 pushes past any batch (here: 480 MiB reported, so never).
//!
//! The stores are weakly ordered: the thread that made them calls [`fence`] before it
//! tells anyone the bytes are there.

/// Below this many bytes a copy is an ordinary `memcpy`: aligning and fencing would cost
/// more than the cache traffic saved.
const MIN_STREAM_BYTES: usize = 1024;

/// Copies `len` bytes from `src` to `dst`, the aligned middle with streaming stores.
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes; the two ranges do not overlap.
pub(crate) unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if len >= MIN_STREAM_BYTES {
            // SAFETY: the caller's contract, passed on unchanged.
            unsafe { x86::copy(src, dst, len) };
            return;
        }
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// Orders this thread's streaming stores before its later stores (a no-op off x86-64,
/// where [`copy`] makes none).
pub(crate) fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` is SSE, part of the x86-64 baseline; it has no operands.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    fn has_avx2() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx2"))
    }

    /// # Safety
    /// As [`super::copy`], with `len >= 64`.
    pub(super) unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
        // the head up to the first 64-byte boundary of `dst`, then whole 64-byte lines
        // streamed, then the tail: both ends with ordinary stores
        let head = (64 - (dst as usize) % 64) % 64;
        let body = (len - head) / 64 * 64;
        // SAFETY: `head + body <= len`, so every range below lies inside the caller's;
        // `dst + head` is 64-aligned, as the streaming kernels need.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            let (s, d) = (src.add(head), dst.add(head));
            if has_avx2() {
                lines_avx2(s, d, body / 64);
            } else {
                lines_sse2(s, d, body / 64);
            }
            let done = head + body;
            std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done);
        }
    }

    /// # Safety
    /// `lines * 64` bytes readable at `src` and writable at `dst` (64-aligned); AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn lines_avx2(src: *const u8, dst: *mut u8, lines: usize) {
        for i in 0..lines {
            // SAFETY: line `i` lies inside both ranges (the contract); unaligned loads,
            // aligned streaming stores.
            unsafe {
                let (s, d) = (src.add(i * 64), dst.add(i * 64));
                let a = _mm256_loadu_si256(s as *const __m256i);
                let b = _mm256_loadu_si256(s.add(32) as *const __m256i);
                _mm256_stream_si256(d as *mut __m256i, a);
                _mm256_stream_si256(d.add(32) as *mut __m256i, b);
            }
        }
    }

    /// # Safety
    /// `lines * 64` bytes readable at `src` and writable at `dst` (64-aligned); SSE2 is
    /// part of the x86-64 baseline.
    unsafe fn lines_sse2(src: *const u8, dst: *mut u8, lines: usize) {
        for i in 0..lines {
            // SAFETY: as above, 16 bytes at a time.
            unsafe {
                let (s, d) = (src.add(i * 64), dst.add(i * 64));
                for k in 0..4 {
                    let v = _mm_loadu_si128(s.add(16 * k) as *const __m128i);
                    _mm_stream_si128(d.add(16 * k) as *mut __m128i, v);
                }
            }
        }
    }

    #[cfg(test)]
    pub(super) fn sse2_only(src: &[u8], dst: &mut [u8]) {
        assert!(src.len() == dst.len() && (dst.as_ptr() as usize).is_multiple_of(64) && src.len().is_multiple_of(64));
        // SAFETY: two distinct slices of equal length, a whole number of 64-aligned lines.
        unsafe { lines_sse2(src.as_ptr(), dst.as_mut_ptr(), src.len() / 64) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed ^ (i >> 8) as u8)).collect()
    }

    /// The reference is `copy_from_slice`: every length around the thresholds and line
    /// size, at every source and destination misalignment within a line, writes exactly
    /// the bytes asked and nothing either side.
    #[test]
    fn streaming_copies_equal_plain_copies_at_any_alignment_and_length() {
        let src = pattern(70_000, 5);
        let lens = [0, 1, 63, 64, 65, 1023, 1024, 1025, 4096, 4097, 65_536 + 17];
        for &len in &lens {
            for so in [0usize, 1, 7, 32, 63] {
                for doff in [0usize, 1, 15, 33, 63] {
                    let mut got = vec![0xEEu8; len + 256];
                    // the copy starts `doff` bytes past a 64-byte boundary inside `got`
                    let base = (64 - got.as_ptr() as usize % 64) % 64;
                    let at = base + doff;
                    // SAFETY: `len` bytes at `src[so..]` and at `got[at..]` (both in bounds).
                    unsafe { copy(src[so..].as_ptr(), got[at..].as_mut_ptr(), len) };
                    fence();
                    assert_eq!(&got[at..at + len], &src[so..so + len], "len {len} src+{so} dst+{doff}");
                    assert!(got[..at].iter().all(|&b| b == 0xEE));
                    assert!(got[at + len..].iter().all(|&b| b == 0xEE));
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_sse2_kernel_equals_a_plain_copy_too() {
        let src = pattern(64 * 100, 9);
        let mut buf = vec![0u8; 64 * 101];
        let base = (64 - buf.as_ptr() as usize % 64) % 64;
        x86::sse2_only(&src, &mut buf[base..base + 64 * 100]);
        fence();
        assert_eq!(&buf[base..base + 64 * 100], &src[..]);
    }
}
