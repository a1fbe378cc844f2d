//! Private memory backed by transparent huge pages where the kernel allows: aligned,
//! advised before its first touch, populated within a time budget.

use std::io;
use std::ptr::NonNull;

use super::page_size;

/// A transparent huge page (x86-64, and arm64 with 4 KiB base pages).
pub const HUGE_PAGE: usize = 2 << 20;

/// Private anonymous memory of at least one huge page, advised to be backed by
/// transparent huge pages (`MADV_HUGEPAGE`) before any page exists, then populated.
///
/// Why: a copy that follows a pause of a few milliseconds finds the page tables out of
/// cache as well as the bytes; under a hypervisor each TLB miss is then a two-level walk
/// from memory, once per 4 KiB of source and of destination. Measured on this project's
/// 2-core KVM host (BENCHMARKS.md, "k24p"): one core's streaming copy of 16 MiB after a
/// 20 ms sleep, 6.4-8.4 GB/s with 4 KiB pages on both sides, 11.3-12.8 GB/s with huge
/// pages on both, about +10% with one side huge. Back to back (page tables cached) the
/// page size hardly matters.
///
/// The start is aligned to a huge page (a mapping one huge page longer is trimmed), so
/// every whole 2 MiB of the range can be a huge page. Where the kernel has no THP, or
/// `enabled` is `never`, the advice does nothing and the memory is ordinary pages; where
/// huge pages are scarce the kernel compacts memory to make them, and populating stops
/// asking for them once its time budget is spent ([`populate_huge_within_budget`]). The
/// mapping never fails for want of huge pages.
pub(super) fn map_anonymous_huge(len: usize) -> io::Result<NonNull<u8>> {
    let span = len + HUGE_PAGE;
    // SAFETY: a fresh private mapping at a kernel-chosen address; the result is checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let base = p as usize;
    let start = base.next_multiple_of(HUGE_PAGE);
    let (head, tail) = (start - base, base + span - (start + len));
    // SAFETY: both ranges lie inside the mapping just made and outside `[start, start+len)`;
    // they are page-aligned (base, start and len are) and nothing refers to them.
    unsafe {
        if head > 0 {
            libc::munmap(base as *mut libc::c_void, head);
        }
        if tail > 0 {
            libc::munmap((start + len) as *mut libc::c_void, tail);
        }
    }
    let ptr = start as *mut libc::c_void;
    // SAFETY: advice on our own fresh mapping; a failure (no THP in this kernel) is
    // ignored on purpose: the memory is then ordinary pages.
    unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) };
    // SAFETY: `[start, start+len)` is the mapping kept above, ours alone.
    if let Err(e) = unsafe { populate_huge_within_budget(start, len, HUGE_POPULATE_SLACK, HUGE_POPULATE_PER_PAGE) } {
        // ENOMEM and the like: the memory is not there; give it back
        // SAFETY: unmapping exactly the range kept above.
        unsafe { libc::munmap(ptr, len) };
        return Err(e);
    }
    NonNull::new(start as *mut u8).ok_or_else(|| io::Error::other("mmap returned null"))
}

/// Time allowed to populate huge-advised memory: this much, plus
/// [`HUGE_POPULATE_PER_PAGE`] per huge page populated so far. With `defrag` at `madvise`
/// (the default) a fault in advised memory compacts memory synchronously when no huge
/// page is free: measured here, a 640 MiB arena that opens in 0.2-0.65 s with 4 KiB
/// pages took 6.7-10 s on a fragmented host. Past the budget the rest is populated with
/// ordinary pages (advised `MADV_NOHUGEPAGE` meanwhile, so no fault compacts), then
/// advised `MADV_HUGEPAGE` again: khugepaged, the kernel's background thread, collapses it
/// into huge pages later without stalling anyone. Opening a store so costs at most about
/// twice what it did.
const HUGE_POPULATE_SLACK: std::time::Duration = std::time::Duration::from_millis(20);
const HUGE_POPULATE_PER_PAGE: std::time::Duration = std::time::Duration::from_millis(2);

/// Makes every page of `[start, start+len)` exist and writable, huge page by huge page,
/// until the time budget (`slack` + `per_page` per huge page done) runs out; then the
/// rest with ordinary pages, left advised for khugepaged to collapse.
///
/// # Safety
/// `[start, start+len)` is a private anonymous mapping of this process that nothing
/// else uses yet (its bytes are zero and stay zero).
unsafe fn populate_huge_within_budget(
    start: usize,
    len: usize,
    slack: std::time::Duration,
    per_page: std::time::Duration,
) -> io::Result<()> {
    let began = std::time::Instant::now();
    let mut at = 0;
    while at < len {
        if began.elapsed() > slack + per_page * (at / HUGE_PAGE) as u32 {
            break;
        }
        let n = HUGE_PAGE.min(len - at);
        // SAFETY: inside the caller's mapping.
        unsafe { populate(start + at, n) }?;
        at += n;
    }
    if at < len {
        let rest = (start + at) as *mut libc::c_void;
        // SAFETY: advice on, and populating of, the rest of the caller's mapping.
        unsafe {
            libc::madvise(rest, len - at, libc::MADV_NOHUGEPAGE);
            let populated = populate(start + at, len - at);
            libc::madvise(rest, len - at, libc::MADV_HUGEPAGE);
            populated?;
        }
    }
    Ok(())
}

/// Populates `[start, start+len)` writable now (what `MAP_POPULATE` does at `mmap`).
/// `MADV_POPULATE_WRITE` needs Linux 5.14; before that, one write per page.
///
/// # Safety
/// As [`populate_huge_within_budget`].
unsafe fn populate(start: usize, len: usize) -> io::Result<()> {
    // SAFETY: the caller's mapping.
    if unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) } == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EINVAL) {
        return Err(e);
    }
    for at in (0..len).step_by(page_size()) {
        // SAFETY: inside the mapping; a zero write into zero-filled private memory
        // changes no byte, it only makes the page exist.
        unsafe { std::ptr::write_volatile((start + at) as *mut u8, 0) };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::MappedMemory;

    /// Minor page faults taken by this thread so far.
    fn thread_minor_faults() -> i64 {
        // SAFETY: getrusage fills a plain struct.
        unsafe {
            let mut u: libc::rusage = std::mem::zeroed();
            assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut u), 0);
            u.ru_minflt
        }
    }

    /// The `VmFlags` line of the mapping of this process that contains `addr`.
    fn vm_flags_at(addr: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                        inside = a <= addr && addr < b;
                        continue;
                    }
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return Some(flags.trim().to_string());
                }
            }
        }
        None
    }

    /// A private mapping of a huge page or more starts on a huge-page boundary, is
    /// zero-filled and populated, and carries the huge-page advice where the kernel has
    /// THP (smaps shows `hg`); a smaller one is ordinary. Whether huge pages were free to
    /// back it is the kernel's business and not asserted.
    #[test]
    fn large_private_mappings_are_huge_page_aligned_and_advised() {
        let len = 3 * HUGE_PAGE + page_size();
        let m = MappedMemory::anonymous(len).unwrap();
        assert_eq!(m.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(m.len(), len);
        // SAFETY: the mapping is `len` bytes long and only this test uses it.
        let s = unsafe { std::slice::from_raw_parts_mut(m.as_ptr(), m.len()) };
        assert!(s.iter().all(|&b| b == 0));
        s[len - 1] = 9; // the last byte is ours
        let thp = std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists();
        let flags = vm_flags_at(m.as_ptr() as usize).expect("the mapping is in smaps");
        assert_eq!(thp, flags.split(' ').any(|f| f == "hg"), "THP in kernel: {thp}, VmFlags: {flags}");
        let small = MappedMemory::anonymous(HUGE_PAGE / 2).unwrap();
        let flags = vm_flags_at(small.as_ptr() as usize).expect("the mapping is in smaps");
        assert!(!flags.split(' ').any(|f| f == "hg"), "{flags}");
    }

    /// With no time budget the populate gives up on huge pages at once: the whole range
    /// is still populated, zeroed and writable, and advised huge again afterwards (smaps
    /// `hg`, not `nh`) for khugepaged.
    #[test]
    fn populating_past_its_budget_falls_back_to_ordinary_pages() {
        let len = 2 * HUGE_PAGE;
        // SAFETY: a fresh private mapping, checked, unmapped at the end of the test.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let start = p as usize;
        let before = thread_minor_faults();
        // SAFETY: the mapping above, used by nothing else.
        unsafe { populate_huge_within_budget(start, len, std::time::Duration::ZERO, std::time::Duration::ZERO) }
            .unwrap();
        let populating = thread_minor_faults() - before;
        // SAFETY: inside the mapping.
        let s = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, len) };
        assert!(s.iter().all(|&b| b == 0));
        let before = thread_minor_faults();
        s.iter_mut().step_by(page_size()).for_each(|b| *b = 1);
        assert!(thread_minor_faults() - before < 8, "populated: {populating} faults while populating");
        if std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
            let flags = vm_flags_at(start).expect("the mapping is in smaps");
            assert!(flags.split(' ').any(|f| f == "hg") && !flags.split(' ').any(|f| f == "nh"), "{flags}");
        }
        // SAFETY: unmapping the mapping made above; `s` is not used after.
        unsafe { libc::munmap(p, len) };
    }
}
