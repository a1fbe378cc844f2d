//! The staged path's one-copy mode: the server of a restricted region copies a chunk
//! straight between the region and the peer process's own buffer (`process_vm_readv` for
//! a write, `process_vm_writev` for a read), after checking the chunk against the live
//! grants as for a staged chunk. Two copies through a staging buffer could not reach half
//! of one shm copy on a 2-core host (BENCHMARKS.md, "k26s"); one kernel copy can ("k26t").
//!
//! The peer maps nothing of the region and the server touches only the addresses the peer
//! named for that chunk. Which process those addresses belong to comes from the kernel,
//! never from a message: the pid the unix socket's `SO_PEERCRED` reports (the process
//! that connected), pinned with a pidfd at attach. Before each commit the server checks
//! that the pidfd's process has not exited (so the pid was not reused: a pid is freed only
//! once its process is gone) and that the socket is still open; at attach it reads a nonce
//! the peer put at an address it named, so a pid that is not the peer's (another
//! namespace's numbering, a reuse before the pidfd was taken) is caught before any copy.
//! Where any of this fails (no pid in our namespace, no pidfd, `EPERM` from Yama or
//! another uid, `ENOSYS`) the connection keeps the staging buffer.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// Bytes of the nonce the peer leaves at its probe address.
pub const NONCE_LEN: usize = 16;

/// The process at the other end of a staging connection, pinned by a pidfd.
pub struct PeerProcess {
    pid: libc::pid_t,
    pidfd: OwnedFd,
}

impl PeerProcess {
    /// The process that connected `s`, if the server may copy to and from its memory:
    /// the `NONCE_LEN` bytes at its `probe` address must be `nonce`. The error says why
    /// not (the connection then keeps the staging buffer).
    pub fn attach(s: &UnixStream, probe: u64, nonce: &[u8; NONCE_LEN]) -> io::Result<PeerProcess> {
        let pid = super::fdpass::peer_pid(s)?;
        if pid <= 0 {
            return Err(io::Error::other("the peer's pid is not visible from this pid namespace"));
        }
        let peer = PeerProcess::open(pid)?;
        let mut seen = [0u8; NONCE_LEN];
        peer.read_into(seen.as_mut_ptr(), probe, NONCE_LEN)?;
        if !peer.alive() {
            return Err(io::Error::other("the peer exited during attach"));
        }
        if &seen != nonce {
            return Err(io::Error::other("the probe address does not hold the peer's nonce: not the peer's process"));
        }
        Ok(peer)
    }

    /// Pins process `pid` with a pidfd (it may already be another process than the one
    /// meant: `attach` checks the nonce after this).
    fn open(pid: libc::pid_t) -> io::Result<PeerProcess> {
        // SAFETY: pidfd_open takes a pid and flags; the result is checked.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh fd that nobody else owns.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Ok(PeerProcess { pid, pidfd })
    }

    /// Whether the attached process has not exited (its pid still names it).
    pub fn alive(&self) -> bool {
        let mut p = libc::pollfd { fd: self.pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd; zero timeout. A pidfd polls readable once its process exits.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n == 0
    }

    /// Whether a commit that came on `s` may still be served: the process is alive (its
    /// pid was not reused) and has not closed or shut down its end of `s` (a peer that
    /// gave up on its requests, after its I/O timeout, has taken its buffers back).
    pub fn still_there(&self, s: &UnixStream) -> bool {
        let mut fds = [
            libc::pollfd { fd: self.pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 },
        ];
        // SAFETY: two valid pollfds in a live array; zero timeout.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, 0) };
        n == 0
    }

    /// Copies `len` bytes from the peer's address `addr` to `dst`.
    ///
    /// `dst` must be writable for `len` bytes; a bad `addr` is an error (`EFAULT`), never
    /// a fault of ours.
    pub fn read_into(&self, dst: *mut u8, addr: u64, len: usize) -> io::Result<()> {
        self.copy(dst, addr, len, false)
    }

    /// Copies `len` bytes from `src` to the peer's address `addr`.
    ///
    /// `src` must be readable for `len` bytes.
    pub fn write_from(&self, src: *const u8, addr: u64, len: usize) -> io::Result<()> {
        self.copy(src as *mut u8, addr, len, true)
    }

    fn copy(&self, local: *mut u8, addr: u64, len: usize, to_peer: bool) -> io::Result<()> {
        let mut done = 0usize;
        while done < len {
            let l = libc::iovec { iov_base: local.wrapping_add(done).cast(), iov_len: len - done };
            let r =
                libc::iovec { iov_base: (addr as usize).wrapping_add(done) as *mut libc::c_void, iov_len: len - done };
            // SAFETY: the local iovec is the caller's checked range (see read_into /
            // write_from); the remote one is only an address in the peer's space, which the
            // kernel checks (EFAULT), never dereferenced here.
            let n = unsafe {
                if to_peer {
                    libc::process_vm_writev(self.pid, &l, 1, &r, 1, 0)
                } else {
                    libc::process_vm_readv(self.pid, &l, 1, &r, 1, 0)
                }
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::WriteZero, "the peer's range ended short"));
            }
            // A short count: the rest starts at a page the kernel could not reach; the next
            // call reports why (EFAULT), or goes on if it was transient.
            done += n as usize;
        }
        Ok(())
    }
}

/// A page of this process followed by an unmapped one (its address): a copy that runs off
/// its end meets a hole (for the tests of a bad peer address). The caller unmaps the page.
#[cfg(test)]
pub(crate) fn page_before_a_hole() -> u64 {
    // SAFETY: a fresh anonymous mapping of two pages, its second page unmapped at once;
    // nothing else knows of it.
    unsafe {
        let m = libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(m, libc::MAP_FAILED);
        assert_eq!(libc::munmap((m as *mut u8).add(4096).cast(), 4096), 0);
        m as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    /// A pinned process is seen to exit (so its pid is never used after it could have been
    /// reused), a closed or half-shut socket is seen, and a copy to or from an address the
    /// process does not map fails instead of faulting.
    #[test]
    fn a_pinned_process_exit_and_a_shut_socket_are_seen() {
        let mut child = Command::new("sleep").arg("30").stdin(Stdio::null()).spawn().unwrap();
        let p = PeerProcess::open(child.id() as libc::pid_t).unwrap();
        assert!(p.alive(), "a running child read as exited");
        let mut buf = [0u8; 64];
        // Page 0 is never mapped: EFAULT, not a crash.
        let e = p.read_into(buf.as_mut_ptr(), 8, buf.len()).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EFAULT), "{e}");
        assert!(p.write_from(buf.as_ptr(), 8, buf.len()).is_err());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!p.alive(), "an exited (and reaped) child read as alive");

        let me = PeerProcess::open(std::process::id() as libc::pid_t).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        assert!(me.still_there(&a));
        b.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(!me.still_there(&a), "a peer that shut its end down read as still there");
        assert!(!p.still_there(&UnixStream::pair().unwrap().0), "an exited process read as still there");
    }

    /// Copies to and from this process through the kernel match a plain copy, across
    /// page boundaries and odd lengths, and a range that runs into an unmapped page fails.
    #[test]
    fn copies_through_the_kernel_match_a_plain_copy_and_stop_at_an_unmapped_page() {
        let me = PeerProcess::open(std::process::id() as libc::pid_t).unwrap();
        let src: Vec<u8> = (0..3 * 4096 + 77).map(|i: u32| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
        for (off, len) in [(0usize, 1usize), (1, 4095), (4095, 2), (100, 3 * 4096 - 100), (0, src.len())] {
            let mut got = vec![0u8; len];
            me.read_into(got.as_mut_ptr(), src[off..].as_ptr() as u64, len).unwrap();
            assert!(got == src[off..off + len], "read {off}+{len}");
            let mut dst = vec![0u8; len];
            me.write_from(src[off..].as_ptr(), dst.as_mut_ptr() as u64, len).unwrap();
            assert!(dst == src[off..off + len], "write {off}+{len}");
        }
        // Two pages, the second unmapped: a copy across them fails (after a short count).
        let m = page_before_a_hole();
        let mut got = vec![0u8; 200];
        assert!(me.read_into(got.as_mut_ptr(), m + 4000, 200).is_err(), "a copy past a mapping's end");
        me.read_into(got.as_mut_ptr(), m + 3896, 200).unwrap();
        // SAFETY: the mapped first page of `m`, touched by nothing after this.
        unsafe {
            libc::munmap(m as *mut libc::c_void, 4096);
        }
    }
}
