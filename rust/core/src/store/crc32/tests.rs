//! Every kernel, forced by name, against a bit-by-bit reference: every length up to past
//! the kernels' block sizes, many source and destination alignments, start values,
//! cached and streaming copies and checksum-only, and large buffers.

use super::*;

/// Bit by bit, straight from the definition: the reference the fast paths answer to.
fn reference(crc: u32, data: &[u8]) -> u32 {
    let mut c = !crc;
    for &b in data {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
        }
    }
    !c
}

fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The kernels this CPU runs (a kernel it lacks would silently run a lesser one).
fn kernels() -> Vec<Crc32Kernel> {
    let ks: Vec<_> = Crc32Kernel::ALL.into_iter().filter(|k| k.available()).collect();
    for k in Crc32Kernel::ALL.into_iter().filter(|k| !k.available()) {
        eprintln!("crc32 tests: this CPU lacks {k:?}; its checks are skipped");
    }
    ks
}

/// Copies `src` to `at` bytes into a fresh, fenced buffer with `kernel`, checks the
/// checksum, the bytes and that nothing outside them was written.
fn check_copy(kernel: Crc32Kernel, streaming: bool, start: u32, src: &[u8], at: usize, want: u32) {
    let n = src.len();
    let mut out = vec![0xA5u8; at + n + 80];
    // SAFETY: `out` holds `at + n + 80` bytes, so `at..at + n` is inside it; `src` and
    // `out` are distinct allocations.
    let got = unsafe { copy_crc32_using(kernel, streaming, start, src.as_ptr(), out.as_mut_ptr().add(at), n) };
    store_fence();
    let what = format!("{kernel:?} streaming {streaming} len {n} dst offset {at} start {start:#x}");
    assert_eq!(got, want, "checksum, {what}");
    assert_eq!(&out[at..at + n], src, "copied bytes, {what}");
    assert!(out[..at].iter().chain(&out[at + n..]).all(|&b| b == 0xA5), "wrote outside, {what}");
}

/// (x^n mod P)' << 1: how every folding constant is made.
fn fold_constant(n: u32) -> i64 {
    let mut r: u64 = 1;
    for _ in 0..n {
        r <<= 1;
        if r & (1 << 32) != 0 {
            r ^= 0x1_04C1_1DB7;
        }
    }
    ((r as u32).reverse_bits() as i64) << 1
}

#[cfg(target_arch = "x86_64")]
#[test]
fn folding_constants_are_powers_of_x_mod_p() {
    assert_eq!(fold_constant(2048 + 32), vpclmul::K1_2048);
    assert_eq!(fold_constant(2048 - 32), vpclmul::K2_2048);
    assert_eq!(fold_constant(256 + 32), vpclmul256::K1_256);
    assert_eq!(fold_constant(256 - 32), vpclmul256::K2_256);
    assert_eq!(fold_constant(1024 + 32), clmul::K1_8);
    assert_eq!(fold_constant(1024 - 32), clmul::K2_8);
    assert_eq!(fold_constant(512 + 32), clmul::K1);
    assert_eq!(fold_constant(512 - 32), clmul::K2);
    assert_eq!(fold_constant(128 + 32), clmul::K3);
    assert_eq!(fold_constant(128 - 32), clmul::K4);
    assert_eq!(fold_constant(64), clmul::K5);
}

#[test]
fn known_values() {
    for k in kernels() {
        assert_eq!(crc32_using(k, 0, b""), 0);
        assert_eq!(crc32_using(k, 0, b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32_using(k, 0, &[0u8; 4096]), reference(0, &[0u8; 4096]), "{k:?}");
    }
    assert_eq!(crc32(0, b"123456789"), 0xCBF4_3926);
}

#[test]
fn the_best_kernel_is_one_the_cpu_runs() {
    assert!(Crc32Kernel::best().available());
    assert!(Crc32Kernel::Tables.available());
    assert!(Crc32Kernel::ALL.into_iter().all(|k| k.usable() <= k && k.usable().available()));
}

#[test]
fn every_kernel_every_length_and_alignment_matches_the_reference() {
    let pool = bytes(700 + 64, 11);
    let kernels = kernels();
    for n in 0..=600usize {
        for (i, src_at) in [0usize, 1, 3, 8, 15, 16, 33, 63].into_iter().enumerate() {
            let src = &pool[src_at..src_at + n];
            let start = [0u32, 0xFFFF_FFFF, 0x1234_5678, 1][(n + i) % 4];
            let want = reference(start, src);
            for &k in &kernels {
                assert_eq!(crc32_using(k, start, src), want, "{k:?} checksum only, len {n} src offset {src_at}");
                for dst_at in [0usize, 1, 7, 16, 17, 32, 48, 63] {
                    check_copy(k, false, start, src, dst_at, want);
                    check_copy(k, true, start, src, dst_at, want);
                }
            }
        }
    }
}

#[test]
fn every_kernel_on_large_buffers() {
    for n in [4095usize, 4096, 65536 + 17, (1 << 20) + 5, 8 << 20] {
        let data = bytes(n + 64, n as u64);
        for src_at in [0usize, 5] {
            let src = &data[src_at..src_at + n];
            let want = crc32_tables(7, src);
            // the tables themselves answer to the bitwise reference on a prefix
            assert_eq!(crc32_tables(7, &src[..1000]), reference(7, &src[..1000]));
            for k in kernels() {
                assert_eq!(crc32_using(k, 7, src), want, "{k:?} len {n}");
                for dst_at in [0usize, 9, 48] {
                    check_copy(k, false, 7, src, dst_at, want);
                    check_copy(k, true, 7, src, dst_at, want);
                }
            }
        }
    }
}

#[test]
fn the_public_functions_match_the_reference() {
    for n in (0..300).chain([511, 512, 513, 4095, 4096, 65536 + 17]) {
        let data = bytes(n, n as u64 + 1);
        for start in [0u32, 1, 0xFFFF_FFFF, 0x1234_5678] {
            let want = reference(start, &data);
            assert_eq!(crc32(start, &data), want, "len {n} start {start:#x}");
            assert_eq!(crc32_tables(start, &data), want, "tables, len {n}");
            for shift in [0usize, 1, 7, 15] {
                let mut out = vec![0u8; n + 16];
                let mut out2 = vec![0u8; n + 16];
                // SAFETY: each `out` holds n + 16 >= shift + n bytes; distinct allocations.
                let (got, got_streaming) = unsafe {
                    (
                        copy_crc32(start, data.as_ptr(), out.as_mut_ptr().add(shift), n),
                        copy_crc32_streaming(start, data.as_ptr(), out2.as_mut_ptr().add(shift), n),
                    )
                };
                store_fence();
                assert_eq!((got, got_streaming), (want, want), "copies, len {n} shift {shift}");
                assert_eq!(&out[shift..shift + n], &data[..]);
                assert_eq!(out, out2);
            }
        }
    }
}

#[test]
fn continuing_equals_one_pass() {
    let data = bytes(10_000, 7);
    for k in kernels() {
        for cut in [0, 1, 127, 128, 255, 256, 1000, 9999, 10_000] {
            let whole = crc32_using(k, 0, &data);
            assert_eq!(crc32_using(k, crc32_using(k, 0, &data[..cut]), &data[cut..]), whole, "{k:?} cut {cut}");
        }
    }
}
