//! Page-aligned memory mappings: private (one process) or POSIX shared memory (any
//! process on the host can map it by name).
//!
//! The store's DRAM arena and the transfer engine's `allocate()` regions are
//! [`MappedMemory`]. A shared mapping is named `/mooncake_rs.<pid>.<n>`; its creator
//! unlinks the name when the mapping is dropped, and [`sweep_stale_segments`] removes
//! segments left behind by processes that died without dropping theirs (SIGKILL).
//!
//! The mapping is raw memory: this type does not synchronise access to the bytes. Its
//! users (store slots with leases, transfer regions) own that discipline.

use std::ffi::CString;
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

/// Prefix of every shared-memory segment name this library creates.
pub const SHM_PREFIX: &str = "mooncake_rs.";

static NEXT_SEGMENT: AtomicU64 = AtomicU64::new(0);

mod huge;
pub(crate) mod stream_copy;
pub use huge::HUGE_PAGE;

/// A page-aligned mapping of `len` bytes, zero-filled on creation.
pub struct MappedMemory {
    ptr: NonNull<u8>,
    len: usize,
    /// Name of the POSIX shm segment (with the leading '/'), if shared.
    shm_name: Option<String>,
    /// Whether dropping this mapping unlinks `shm_name` (true for the creator).
    owns_name: bool,
}

// SAFETY: MappedMemory is an owned mapping; the pointer stays valid until drop, and the
// type gives out only raw pointers, whose use is the caller's (unsafe) responsibility.
unsafe impl Send for MappedMemory {}
// SAFETY: as above; no interior state is mutated through &self.
unsafe impl Sync for MappedMemory {}

pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// Rounds `n` up to a multiple of the page size.
pub fn page_align(n: usize) -> usize {
    let p = page_size();
    n.div_ceil(p) * p
}

/// Maps with `MAP_POPULATE`: page tables (and, for new memory, the pages) are set up
/// now, so the first copy into a store slot or a transfer region does not take a page
/// fault per 4 KiB on the hot path. The cost is paid once, at creation, in proportion to
/// the size, and the memory is resident from the start (a cache pool wants that).
///
/// Shared mappings included: the kernel maps shared memory writable on the populating
/// fault (measured: a first 16 MiB put into fresh slots of a shared store takes no minor
/// fault; the test below keeps it so).
fn map(len: usize, fd: libc::c_int, flags: libc::c_int) -> io::Result<NonNull<u8>> {
    // SAFETY: a fresh mapping at a kernel-chosen address; the result is checked.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags | libc::MAP_POPULATE, fd, 0)
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    NonNull::new(p as *mut u8).ok_or_else(|| io::Error::other("mmap returned null"))
}

impl MappedMemory {
    /// Private anonymous memory (this process only). One huge page or more is advised
    /// to use transparent huge pages ([`huge::map_anonymous_huge`]).
    pub fn anonymous(len: usize) -> io::Result<Self> {
        let len = page_align(len.max(1));
        let ptr = if len >= HUGE_PAGE {
            huge::map_anonymous_huge(len)?
        } else {
            map(len, -1, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS)?
        };
        Ok(MappedMemory { ptr, len, shm_name: None, owns_name: false })
    }

    /// A new POSIX shared-memory segment that other processes can [`open_shared`].
    ///
    /// [`open_shared`]: MappedMemory::open_shared
    pub fn shared(len: usize) -> io::Result<Self> {
        let len = page_align(len.max(1));
        let name = format!("/{SHM_PREFIX}{}.{}", std::process::id(), NEXT_SEGMENT.fetch_add(1, Ordering::Relaxed));
        let cname = CString::new(name.clone()).map_err(io::Error::other)?;
        // SAFETY: cname is a valid C string; the fd is closed below on every path.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let unlink = || {
            // SAFETY: cname is valid; unlinking a name we created.
            unsafe { libc::shm_unlink(cname.as_ptr()) };
        };
        // SAFETY: fd is the segment we just created.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            let e = io::Error::last_os_error();
            // SAFETY: closing our own fd.
            unsafe { libc::close(fd) };
            unlink();
            return Err(e);
        }
        let mapped = map(len, fd, libc::MAP_SHARED);
        // SAFETY: the mapping (if any) keeps the segment alive; the fd is no longer needed.
        unsafe { libc::close(fd) };
        match mapped {
            Ok(ptr) => Ok(MappedMemory { ptr, len, shm_name: Some(name), owns_name: true }),
            Err(e) => {
                unlink();
                Err(e)
            }
        }
    }

    /// Maps an existing segment created by [`shared`](MappedMemory::shared) in any
    /// process on this host. Fails if it is shorter than `len`.
    pub fn open_shared(name: &str, len: usize) -> io::Result<Self> {
        if !name.starts_with('/') || name[1..].contains('/') {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("bad shm name {name:?}")));
        }
        let cname = CString::new(name).map_err(io::Error::other)?;
        // SAFETY: valid C string; fd closed below.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fstat fills a plain struct for our fd.
        let size = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut st) != 0 {
                let e = io::Error::last_os_error();
                libc::close(fd);
                return Err(e);
            }
            st.st_size as usize
        };
        if size < len || len == 0 {
            // SAFETY: closing our own fd.
            unsafe { libc::close(fd) };
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("segment {name} has {size} bytes, {len} requested"),
            ));
        }
        let mapped = map(len, fd, libc::MAP_SHARED);
        // SAFETY: closing our own fd; the mapping stays valid.
        unsafe { libc::close(fd) };
        Ok(MappedMemory { ptr: mapped?, len, shm_name: Some(name.to_string()), owns_name: false })
    }

    /// Maps `len` bytes of a memory file this process holds an fd of (a memfd received
    /// over a unix socket), shared and unnamed: nothing in `/dev/shm`, the memory goes
    /// away with the last mapping and fd. The caller keeps (or closes) `fd`.
    pub fn map_fd(fd: std::os::fd::BorrowedFd<'_>, len: usize) -> io::Result<Self> {
        use std::os::fd::AsRawFd;
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "cannot map 0 bytes"));
        }
        let ptr = map(len, fd.as_raw_fd(), libc::MAP_SHARED)?;
        Ok(MappedMemory { ptr, len, shm_name: None, owns_name: false })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The shm segment name, for a shared mapping.
    pub fn shm_name(&self) -> Option<&str> {
        self.shm_name.as_deref()
    }
}

impl Drop for MappedMemory {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly the mapping created in the constructor.
        unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
        if self.owns_name {
            if let Some(name) = &self.shm_name {
                if let Ok(c) = CString::new(name.as_str()) {
                    // SAFETY: unlinking the name this mapping created.
                    unsafe { libc::shm_unlink(c.as_ptr()) };
                }
            }
        }
    }
}

impl std::fmt::Debug for MappedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedMemory").field("len", &self.len).field("shm_name", &self.shm_name).finish()
    }
}

/// Unlinks every `/dev/shm/mooncake_rs.<pid>.*` segment for which `dead(pid)` holds.
/// Returns how many were removed.
fn remove_segments_where(mut dead: impl FnMut(i32) -> bool) -> usize {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return 0;
    };
    let mut removed = 0;
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(SHM_PREFIX)) else {
            continue;
        };
        let Some(pid) = rest.split('.').next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        if dead(pid) && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Unlinks `/dev/shm/mooncake_rs.<pid>.*` segments whose creating process is gone.
/// Returns how many were removed.
pub fn sweep_stale_segments() -> usize {
    remove_segments_where(|pid| {
        // SAFETY: kill with signal 0 only checks for existence.
        let alive =
            unsafe { libc::kill(pid, 0) } == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        !alive
    })
}

/// Unlinks the segments created by process `pid` (one known to be gone, e.g. a worker
/// that was killed before it could drop its mappings). Returns how many were removed.
pub fn remove_segments_of(pid: i32) -> usize {
    remove_segments_where(|p| p == pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anonymous_is_page_aligned_and_zeroed() {
        let m = MappedMemory::anonymous(10).unwrap();
        assert_eq!(m.as_ptr() as usize % page_size(), 0);
        assert_eq!(m.len(), page_size());
        // SAFETY: the mapping is len bytes long and exclusively ours.
        let s = unsafe { std::slice::from_raw_parts(m.as_ptr(), m.len()) };
        assert!(s.iter().all(|&b| b == 0));
    }

    #[test]
    fn shared_is_visible_through_a_second_mapping_and_unlinked_on_drop() {
        let a = MappedMemory::shared(8192).unwrap();
        let name = a.shm_name().unwrap().to_string();
        let b = MappedMemory::open_shared(&name, 8192).unwrap();
        // SAFETY: both mappings are 8192 bytes; this test is the only user.
        unsafe {
            *a.as_ptr().add(100) = 42;
            assert_eq!(*b.as_ptr().add(100), 42);
        }
        assert!(MappedMemory::open_shared(&name, 1 << 30).is_err(), "longer than the segment");
        drop(b);
        drop(a);
        assert!(MappedMemory::open_shared(&name, 8192).is_err(), "name unlinked");
        assert!(MappedMemory::open_shared("no-slash", 10).is_err());
    }

    /// Minor page faults taken by this thread so far (per thread: the test harness runs
    /// other tests on other threads meanwhile).
    fn thread_minor_faults() -> i64 {
        // SAFETY: getrusage fills a plain struct.
        unsafe {
            let mut u: libc::rusage = std::mem::zeroed();
            assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut u), 0);
            u.ru_minflt
        }
    }

    /// The first store into every page of a new mapping, shared or private, takes no
    /// page fault: `MAP_POPULATE` set the pages up writable when it was mapped (without
    /// it, one fault per page).
    #[test]
    fn first_stores_into_a_new_mapping_take_no_page_faults() {
        let pages = 512;
        for shared in [false, true] {
            let m = if shared {
                MappedMemory::shared(pages * page_size()).unwrap()
            } else {
                MappedMemory::anonymous(pages * page_size()).unwrap()
            };
            let before = thread_minor_faults();
            for i in 0..pages {
                // SAFETY: inside the mapping, which only this test uses.
                unsafe { std::ptr::write_volatile(m.as_ptr().add(i * page_size() + 8), 7u8) };
            }
            let faults = thread_minor_faults() - before;
            assert!(faults < pages as i64 / 8, "shared={shared}: {faults} faults writing {pages} fresh pages");
        }
    }

    #[test]
    fn segments_of_a_pid_are_removed_and_only_those() {
        // Fake segments of two pids that cannot be running (pid_max is far below them),
        // so no live mapping of this test process is touched.
        let path = |pid: i32| format!("/dev/shm/{SHM_PREFIX}{pid}.0");
        let (gone, other) = (i32::MAX - 1, i32::MAX);
        std::fs::write(path(gone), b"x").unwrap();
        std::fs::write(path(other), b"x").unwrap();
        assert_eq!(remove_segments_of(gone), 1);
        assert!(!std::path::Path::new(&path(gone)).exists());
        assert!(std::path::Path::new(&path(other)).exists(), "another pid's segment stays");
        assert!(sweep_stale_segments() >= 1, "a dead pid's segment is swept");
        assert!(!std::path::Path::new(&path(other)).exists());
    }
}
