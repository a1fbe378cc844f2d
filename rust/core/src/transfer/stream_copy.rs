//! Copies whose destination is not read again soon (the staged path's last leg: a
//! restricted region written by the server, a read's destination written by the
//! initiator), with non-temporal stores: the destination's lines are not read in first
//! and do not evict the staging buffer, which the other side of the link is about to
//! reuse. The source is read normally (it is the staging buffer, which is cache-hot).

/// Chunks at least this long are copied to their last place (the region, for a staged
/// write on the server; the destination, for a staged read on the initiator) with
/// streaming stores; below it an ordinary copy measured as fast (BENCHMARKS.md, "k26s").
pub const STREAMING_MIN: u64 = 256 << 10;

/// A staged chunk's last copy: [`copy_streaming`] from [`STREAMING_MIN`] bytes on, an
/// ordinary copy below.
///
/// # Safety
/// As [`copy_streaming`].
pub unsafe fn copy_last_leg(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: the caller's contract, passed on.
    unsafe {
        if len as u64 >= STREAMING_MIN {
            copy_streaming(dst, src, len)
        } else {
            std::ptr::copy_nonoverlapping(src, dst, len)
        }
    }
}

/// Copies `len` bytes from `src` to `dst` with streaming stores where the target has
/// them (x86_64: SSE2, part of its baseline), else with an ordinary copy.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`: `src` readable and `dst` writable for `len`
/// bytes, the two ranges not overlapping.
pub unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        // Streaming stores need 16-byte aligned destinations: copy up to the first
        // aligned byte normally, then whole 64-byte lines, then the tail.
        let head = dst.align_offset(16).min(len);
        // SAFETY: head <= len, inside both ranges (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let mut off = head;
        while off + 64 <= len {
            // SAFETY: off + 64 <= len keeps each 16-byte load and store inside the
            // caller's ranges; dst + off is 16-byte aligned (head above, steps of 16).
            // SSE2 is part of the x86_64 baseline.
            unsafe {
                let s = src.add(off) as *const __m128i;
                let d = dst.add(off) as *mut __m128i;
                let (a, b, c, e) = (
                    _mm_loadu_si128(s),
                    _mm_loadu_si128(s.add(1)),
                    _mm_loadu_si128(s.add(2)),
                    _mm_loadu_si128(s.add(3)),
                );
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
            }
            off += 64;
        }
        // SAFETY: off <= len; the rest of both ranges. The fence orders the streaming
        // stores before whatever this thread does next (an answer, a status), as the
        // ordinary stores of a copy would be.
        unsafe {
            std::ptr::copy_nonoverlapping(src.add(off), dst.add(off), len - off);
            _mm_sfence();
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
    }
}

#[cfg(test)]
mod tests {
    use super::copy_streaming;

    #[test]
    fn copies_every_alignment_and_length_like_a_plain_copy() {
        let src: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
        for s_off in [0usize, 1, 7, 16, 33] {
            for d_off in [0usize, 1, 8, 15, 16, 63] {
                for len in [0usize, 1, 15, 16, 63, 64, 65, 127, 128, 200, 1000, 4000 - 64] {
                    let mut got = vec![0xAAu8; 4096 + 64];
                    let mut want = got.clone();
                    // SAFETY: s_off + len <= 4096 and d_off + len <= 4160 for every case.
                    unsafe { copy_streaming(got.as_mut_ptr().add(d_off), src.as_ptr().add(s_off), len) };
                    want[d_off..d_off + len].copy_from_slice(&src[s_off..s_off + len]);
                    assert_eq!(got, want, "src+{s_off} dst+{d_off} len {len}");
                }
            }
        }
    }
}
