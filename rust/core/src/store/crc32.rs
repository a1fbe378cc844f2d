//! CRC-32 (the IEEE polynomial of zlib, gzip and Python's `zlib.crc32`), optionally
//! fused with a copy: [`copy_crc32`] reads each input vector once, stores it to the
//! destination and folds it into the checksum, so a block copied into (or out of) the
//! store gets its checksum for the price of the copy.
//!
//! Four kernels ([`Crc32Kernel`]), the fastest the CPU has picked at run time: 512-bit
//! VPCLMULQDQ folding with 64-byte loads and stores (AVX-512F, `vpclmul.rs`), 256-bit
//! with 32-byte ones (AVX2, `vpclmul256.rs`), 128-bit PCLMULQDQ folding with 16-byte
//! ones (`clmul.rs`), and slicing-by-8 tables everywhere else and for short inputs and
//! tails. With a 64-byte vector a load, a store and two carry-less multiplies, the
//! folding no longer limits a copy (BENCHMARKS.md, issue 23).
//!
//! [`copy_crc32_streaming`] is the same with non-temporal stores, for a destination that
//! will not be read soon (a slot of the store being filled): the stores go to memory
//! without first reading each destination line into the cache (a cold destination costs
//! one memory pass instead of two) and without evicting what the caller works on.
//!
//! Values follow zlib's convention: `crc32(crc32(0, a), b) == crc32(0, a ++ b)`.

#[cfg(target_arch = "x86_64")]
mod clmul;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod vpclmul;
#[cfg(target_arch = "x86_64")]
mod vpclmul256;

const POLY: u32 = 0xEDB8_8320; // reflected 0x04C11DB7

const fn make_tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            k += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut s = 1;
    while s < 8 {
        let mut i = 0;
        while i < 256 {
            let prev = t[s - 1][i];
            t[s][i] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
            i += 1;
        }
        s += 1;
    }
    t
}

static TABLES: [[u32; 256]; 8] = make_tables();

/// The portable update (slicing-by-8), zlib's convention.
pub fn crc32_tables(crc: u32, data: &[u8]) -> u32 {
    let t = &TABLES;
    let mut c = !crc;
    let mut chunks = data.chunks_exact(8);
    for ch in &mut chunks {
        let lo = u32::from_le_bytes([ch[0], ch[1], ch[2], ch[3]]) ^ c;
        let hi = u32::from_le_bytes([ch[4], ch[5], ch[6], ch[7]]);
        c = t[7][(lo & 0xff) as usize]
            ^ t[6][((lo >> 8) & 0xff) as usize]
            ^ t[5][((lo >> 16) & 0xff) as usize]
            ^ t[4][(lo >> 24) as usize]
            ^ t[3][(hi & 0xff) as usize]
            ^ t[2][((hi >> 8) & 0xff) as usize]
            ^ t[1][((hi >> 16) & 0xff) as usize]
            ^ t[0][(hi >> 24) as usize];
    }
    for &b in chunks.remainder() {
        c = t[0][((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// One implementation of the functions below. The public functions use
/// [`Crc32Kernel::best`]; the `*_using` ones take a kernel by name (tests compare every
/// kernel with the reference, benches compare them with each other). Ordered from the
/// slowest: a kernel the CPU lacks falls back to the best one below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Crc32Kernel {
    /// Slicing-by-8 tables after a plain copy: every CPU.
    Tables,
    /// 128-bit PCLMULQDQ folding, 16-byte loads and stores (x86-64 with PCLMULQDQ and
    /// SSE4.1), for inputs of at least 128 bytes.
    Clmul128,
    /// 256-bit VPCLMULQDQ folding, 32-byte loads and stores (x86-64 with AVX2 and
    /// VPCLMULQDQ), for inputs of at least 128 bytes.
    Vpclmul256,
    /// 512-bit VPCLMULQDQ folding, 64-byte loads and stores (x86-64 with AVX-512F and
    /// VPCLMULQDQ), for inputs of at least 256 bytes.
    Vpclmul512,
}

impl Crc32Kernel {
    /// Every kernel, slowest first.
    pub const ALL: [Crc32Kernel; 4] =
        [Crc32Kernel::Tables, Crc32Kernel::Clmul128, Crc32Kernel::Vpclmul256, Crc32Kernel::Vpclmul512];

    /// Whether this CPU runs this kernel (checked once per process).
    pub fn available(self) -> bool {
        match self {
            Crc32Kernel::Tables => true,
            #[cfg(target_arch = "x86_64")]
            Crc32Kernel::Clmul128 => clmul::available(),
            #[cfg(target_arch = "x86_64")]
            Crc32Kernel::Vpclmul256 => vpclmul256::available(),
            #[cfg(target_arch = "x86_64")]
            Crc32Kernel::Vpclmul512 => vpclmul::available(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The fastest kernel this CPU runs (chosen once per process).
    pub fn best() -> Crc32Kernel {
        static BEST: std::sync::OnceLock<Crc32Kernel> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| Self::ALL.into_iter().rev().find(|k| k.available()).unwrap_or(Crc32Kernel::Tables))
    }

    /// This kernel, or the best one below it that the CPU runs.
    fn usable(self) -> Crc32Kernel {
        Self::ALL.into_iter().rev().find(|k| *k <= self && k.available()).unwrap_or(Crc32Kernel::Tables)
    }
}

/// CRC-32 of `data` continued from `crc` (0 to start).
pub fn crc32(crc: u32, data: &[u8]) -> u32 {
    // SAFETY: the best kernel is available; `data` is readable for its length and a null
    // destination is never written.
    unsafe { checksum_copy(Crc32Kernel::best(), false, crc, data.as_ptr(), std::ptr::null_mut(), data.len()) }
}

/// [`crc32`] with the named kernel (or the best one below it the CPU runs).
pub fn crc32_using(kernel: Crc32Kernel, crc: u32, data: &[u8]) -> u32 {
    // SAFETY: `data` is readable for its length and a null destination is never written.
    unsafe { checksum_copy(kernel.usable(), false, crc, data.as_ptr(), std::ptr::null_mut(), data.len()) }
}

/// Copies `len` bytes from `src` to `dst` and returns the CRC-32 of those bytes continued
/// from `crc`.
///
/// # Safety
/// `src` must be readable and `dst` writable for `len` bytes, and the two ranges must
/// not overlap (each vector is stored before the next is read).
pub unsafe fn copy_crc32(crc: u32, src: *const u8, dst: *mut u8, len: usize) -> u32 {
    // SAFETY: the caller's contract; the best kernel is available.
    unsafe { checksum_copy(Crc32Kernel::best(), false, crc, src, dst, len) }
}

/// [`copy_crc32`] with non-temporal stores (the destination bypasses the cache). Call
/// [`store_fence`] after the last of a batch of these and before anything that makes the
/// bytes visible to another thread or process (the stores are weakly ordered).
///
/// # Safety
/// As [`copy_crc32`].
pub unsafe fn copy_crc32_streaming(crc: u32, src: *const u8, dst: *mut u8, len: usize) -> u32 {
    // SAFETY: the caller's contract; the best kernel is available.
    unsafe { checksum_copy(Crc32Kernel::best(), true, crc, src, dst, len) }
}

/// [`copy_crc32`] (or, with `streaming`, [`copy_crc32_streaming`]) with the named kernel
/// (or the best one below it the CPU runs).
///
/// # Safety
/// As [`copy_crc32`]; `dst` must not be null.
pub unsafe fn copy_crc32_using(
    kernel: Crc32Kernel,
    streaming: bool,
    crc: u32,
    src: *const u8,
    dst: *mut u8,
    len: usize,
) -> u32 {
    debug_assert!(!dst.is_null());
    // SAFETY: the caller's contract; `dst` is not null, so it is copied to.
    unsafe { checksum_copy(kernel.usable(), streaming, crc, src, dst, len) }
}

/// The dispatch: the widest kernel at most `kernel` whose minimum length `len` reaches
/// (after, when copying, the bytes up to the first destination address aligned to its
/// store width: streaming stores need it, and ordinary stores that straddle cache lines
/// cost two).
///
/// # Safety
/// `kernel` is available; `src` readable for `len`; `dst` null (checksum only) or
/// writable for `len` and not overlapping `src`.
#[allow(unused_variables)]
unsafe fn checksum_copy(
    kernel: Crc32Kernel,
    streaming: bool,
    crc: u32,
    src: *const u8,
    dst: *mut u8,
    len: usize,
) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        let stream = streaming && !dst.is_null();
        // the kernel's streaming or cached variant; the width its stores are aligned to
        let pick =
            |streaming_fold: KernelFold, cached_fold: KernelFold| if stream { streaming_fold } else { cached_fold };
        // SAFETY (each call below): the contract; a kernel at most `kernel` that the CPU
        // runs: Vpclmul512 means AVX-512F + VPCLMULQDQ, Vpclmul256 AVX2 + VPCLMULQDQ (the
        // 512-bit detection includes it), Clmul128 PCLMULQDQ + SSE4.1.
        if kernel == Crc32Kernel::Vpclmul512 && len >= vpclmul::MIN_LEN {
            let fold = pick(vpclmul::fold::<true>, vpclmul::fold::<false>);
            if let Some(c) = unsafe { after_aligned_head(crc, src, dst, len, 64, vpclmul::MIN_LEN, fold) } {
                return c;
            }
        }
        if kernel >= Crc32Kernel::Vpclmul256 && len >= vpclmul256::MIN_LEN {
            let fold = pick(vpclmul256::fold::<true>, vpclmul256::fold::<false>);
            if let Some(c) = unsafe { after_aligned_head(crc, src, dst, len, 32, vpclmul256::MIN_LEN, fold) } {
                return c;
            }
        }
        if kernel >= Crc32Kernel::Clmul128 && len >= clmul::MIN_LEN {
            // ordinary 16-byte stores may be unaligned; streaming ones must not
            let fold = pick(clmul::fold::<true>, clmul::fold::<false>);
            let align = if stream { 16 } else { 1 };
            if let Some(c) = unsafe { after_aligned_head(crc, src, dst, len, align, clmul::MIN_LEN, fold) } {
                return c;
            }
        }
    }
    // SAFETY: the caller's contract: `src` readable, `dst` (when not null) writable for
    // `len`, no overlap.
    unsafe {
        if dst.is_null() {
            crc32_tables(crc, std::slice::from_raw_parts(src, len))
        } else {
            std::ptr::copy_nonoverlapping(src, dst, len);
            crc32_tables(crc, std::slice::from_raw_parts(dst, len))
        }
    }
}

/// A folding kernel: `(crc, src, dst or null, len) -> crc` (see [`checksum_copy`]).
#[cfg(target_arch = "x86_64")]
type KernelFold = unsafe fn(u32, *const u8, *mut u8, usize) -> u32;

/// One kernel's turn in [`checksum_copy`]: the bytes before the first destination
/// address aligned to `align` by the tables, the rest by `fold`; `None` (nothing done)
/// when what is left after that head is shorter than the kernel's `min_len`. Without a
/// destination there is no head.
///
/// # Safety
/// As [`checksum_copy`], and `fold` runs on this CPU.
#[cfg(target_arch = "x86_64")]
unsafe fn after_aligned_head(
    crc: u32,
    src: *const u8,
    dst: *mut u8,
    len: usize,
    align: usize,
    min_len: usize,
    fold: KernelFold,
) -> Option<u32> {
    let head = if dst.is_null() { 0 } else { dst.align_offset(align).min(len) };
    if len - head < min_len {
        return None;
    }
    // SAFETY: `head <= len`, so both parts stay inside the caller's ranges; `dst + head`
    // is `align`-aligned (what the kernel's stores need); `fold` runs here (the contract).
    unsafe {
        let c = if head == 0 { crc } else { checksum_copy(Crc32Kernel::Tables, false, crc, src, dst, head) };
        let d = if dst.is_null() { dst } else { dst.add(head) };
        Some(fold(c, src.add(head), d, len - head))
    }
}

/// Orders every non-temporal store made before it ([`copy_crc32_streaming`]) before every
/// store after it.
pub fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no operands and is part of the x86-64 baseline (SSE).
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}
