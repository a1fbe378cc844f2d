//! A bounded busy-wait for a socket's next bytes, then the read, in one native call.
//!
//! Why: a small control call (a pool client's 128 B get, a node's next request) is one
//! round trip of two small frames. When its two ends run on different CPUs, waking a
//! thread that sleeps in `recv` costs far more than the work on a virtual machine (an idle
//! vCPU halts; its wake-up goes through the hypervisor). A reader that polls a few tens of
//! microseconds before it sleeps is still running when the answer lands. Polling from
//! Python cost ~2 us a turn (three system calls and the interpreter between them), so the
//! answer was seen up to that late, and the wait, the read and the policy below cost
//! several Python calls per round trip; here one turn is `sched_yield` plus one
//! non-blocking `recv` (which both checks for bytes and takes them) and a `getrusage`.
//!
//! The policy (unchanged from the Python version it replaces):
//! - each turn yields the CPU first: where both ends share one CPU, the other end runs
//!   instead of waiting for the poller's time slice to end;
//! - a yield that let another thread run (the kernel's count of this thread's
//!   involuntary switches moved) ends the poll: there the blocking read costs nothing
//!   extra, and polling would only take turns with the thread that has the work;
//! - the poll is bounded (`spin`): an idle connection costs at most that much CPU after
//!   its last message, then sleeps in the blocking read;
//! - it backs off where polling does not pay: after a poll that gave up (nothing came in
//!   time, or a yield let another thread run) the next 1, 3, 7 ... [`MAX_SKIP`] waits skip
//!   the poll (the caller sleeps in its read at once); one poll that sees its bytes ends
//!   the back-off.
//!
//! The file descriptor is borrowed for each call, never kept: the caller's socket object
//! owns it (a closed socket's descriptor is -1 and the call fails with `EBADF`).

use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// The most waits skipped after polls that gave up.
pub const MAX_SKIP: u32 = 1023;

/// The poll's state for one socket (the back-off is per connection).
#[derive(Debug, Clone)]
pub struct SpinRead {
    spin: Duration,
    /// waits left that return at once without polling
    skip: u32,
    /// how many waits the next poll that gives up makes skip
    penalty: u32,
}

/// What a poll saw.
enum Polled {
    /// `n` bytes were read into the buffer (0: the peer closed the stream)
    Read(usize),
    /// nothing came (gave up, or skipped)
    Nothing,
}

impl SpinRead {
    /// `spin`: how long a wait polls before it gives up (zero: never polls).
    pub fn new(spin: Duration) -> Self {
        Self { spin, skip: 0, penalty: 0 }
    }

    /// Waits left that skip the poll (tests read and set it).
    pub fn skip(&self) -> u32 {
        self.skip
    }

    pub fn set_skip(&mut self, skip: u32) {
        self.skip = skip.min(MAX_SKIP);
    }

    /// Polls `fd` until it is readable (bytes, the end of the stream or an error: a
    /// blocking read returns at once) or the poll gives up; false when it gave up or was
    /// skipped (the read that follows sleeps until bytes come). Reads nothing: for a
    /// socket whose reads go through another layer (a sealed socket decrypts them).
    pub fn wait(&mut self, fd: RawFd) -> io::Result<bool> {
        check_fd(fd)?;
        match self.poll(fd, |fd| if readable(fd)? { Ok(Some(0)) } else { Ok(None) })? {
            Polled::Read(_) => Ok(true),
            Polled::Nothing => Ok(false),
        }
    }

    /// The poll, then one read of at most `buf.len()` bytes into `buf`: what the poll took,
    /// else a blocking `recv` (bounded by the socket's own `SO_RCVTIMEO`: `WouldBlock` when
    /// it expires). 0: the peer closed the stream.
    pub fn recv(&mut self, fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
        check_fd(fd)?;
        if buf.is_empty() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "a read of 0 bytes"));
        }
        if let Polled::Read(n) = self.poll(fd, |fd| recv_now(fd, buf))? {
            return Ok(n);
        }
        recv_blocking(fd, buf)
    }

    /// The policy around `attempt` (Some(n): it got something; None: nothing yet).
    fn poll(&mut self, fd: RawFd, mut attempt: impl FnMut(RawFd) -> io::Result<Option<usize>>) -> io::Result<Polled> {
        if self.spin.is_zero() {
            return Ok(Polled::Nothing);
        }
        if self.skip > 0 {
            self.skip -= 1;
            return Ok(Polled::Nothing);
        }
        if let Some(n) = attempt(fd)? {
            return Ok(Polled::Read(n));
        }
        let end = Instant::now() + self.spin;
        let switches = involuntary_switches();
        loop {
            // SAFETY: sched_yield takes no arguments and cannot fail on Linux.
            unsafe { libc::sched_yield() };
            let got = attempt(fd)?;
            // (a yield that let another thread run counts against polling even when the
            // bytes came meanwhile: that thread had this CPU, the poll won nothing)
            if involuntary_switches() != switches {
                self.back_off();
                return Ok(got.map_or(Polled::Nothing, Polled::Read));
            }
            if let Some(n) = got {
                self.penalty = 0;
                return Ok(Polled::Read(n));
            }
            if Instant::now() >= end {
                self.back_off();
                return Ok(Polled::Nothing);
            }
        }
    }

    fn back_off(&mut self) {
        self.penalty = (2 * self.penalty + 1).min(MAX_SKIP);
        self.skip = self.penalty;
    }
}

/// A negative descriptor (a closed Python socket's) is `EBADF`: `poll` would skip it
/// and report it never readable.
fn check_fd(fd: RawFd) -> io::Result<()> {
    if fd < 0 {
        return Err(io::Error::from_raw_os_error(libc::EBADF));
    }
    Ok(())
}

/// Whether `fd` is readable now (bytes, the end of the stream or an error).
fn readable(fd: RawFd) -> io::Result<bool> {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    loop {
        // SAFETY: one valid pollfd, timeout 0 (returns at once).
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        if r >= 0 {
            if p.revents & libc::POLLNVAL != 0 {
                return Err(io::Error::from_raw_os_error(libc::EBADF));
            }
            return Ok(r > 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// A read that does not wait: Some(n) (0 at the end of the stream), None when nothing is there.
fn recv_now(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        // SAFETY: `buf` is writable for its whole length for the duration of the call.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// A read that waits (the socket is blocking; its `SO_RCVTIMEO` bounds the wait).
fn recv_blocking(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        // SAFETY: as in recv_now.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// How often this thread was switched out while runnable (a yield that let another
/// thread run, or a preemption): the kernel's own count, no clock involved.
fn involuntary_switches() -> i64 {
    // SAFETY: an all-zero rusage is a valid value; getrusage fills it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_THREAD with a valid out-pointer; cannot fail on Linux.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) };
    u.ru_nivcsw
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn reads_bytes_that_wait_and_sees_the_end_of_the_stream() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut s = SpinRead::new(Duration::from_millis(1));
        b.write_all(b"hello").unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(s.recv(a.as_raw_fd(), &mut buf).unwrap(), 5);
        assert_eq!(&buf[..5], b"hello");
        drop(b);
        assert!(s.wait(a.as_raw_fd()).unwrap());
        assert_eq!(s.recv(a.as_raw_fd(), &mut buf).unwrap(), 0);
    }

    #[test]
    fn polls_that_give_up_skip_the_next_waits_1_3_7() {
        let (a, _b) = UnixStream::pair().unwrap();
        let mut s = SpinRead::new(Duration::from_micros(50));
        let mut skips = vec![];
        for _ in 0..4 {
            assert!(!s.wait(a.as_raw_fd()).unwrap());
            skips.push(s.skip());
            while s.skip() > 0 {
                assert!(!s.wait(a.as_raw_fd()).unwrap());
            }
        }
        assert_eq!(skips, [1, 3, 7, 15]);
    }

    #[test]
    fn a_bad_descriptor_is_an_error_not_a_hang() {
        let mut s = SpinRead::new(Duration::from_millis(1));
        let mut buf = [0u8; 4];
        assert!(s.wait(-1).is_err());
        assert!(s.recv(-1, &mut buf).is_err());
        assert!(s.recv(0, &mut []).is_err());
    }
}
