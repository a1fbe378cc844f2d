//! File descriptors between processes of one host: a sealed memory file (memfd) and
//! passing its fd over a unix socket (`SCM_RIGHTS`).
//!
//! The staged path for restricted regions ([`super::staged`]) gives a same-host peer a
//! staging buffer by handing it the fd, not a name: nothing appears in `/dev/shm`, no
//! other process can open it by guessing, and the buffer is freed when both ends drop
//! it. The memfd is sealed against shrinking and growing before it is passed, so the
//! peer (which gets a full fd) cannot truncate it under the owner's copies (an access
//! past the end of a truncated mapping is SIGBUS).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A new memfd of `len` bytes, sealed so that its size can never change.
pub fn sealed_memfd(name: &str, len: usize) -> io::Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).map_err(io::Error::other)?;
    // SAFETY: cname is a valid C string; the result is checked.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain fcntl/ftruncate calls on our own fd.
    unsafe {
        if libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) != 0
            || libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) != 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(fd)
}

/// The size of the memory file behind `fd`, if it is sealed against resizing (else an error:
/// its owner could truncate it under our copies).
pub fn sealed_len(fd: BorrowedFd<'_>) -> io::Result<usize> {
    // SAFETY: fcntl and fstat on a valid fd; fstat fills a plain struct.
    let (seals, size) = unsafe {
        let seals = libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS);
        let mut st: libc::stat = std::mem::zeroed();
        if seals < 0 || libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
            return Err(io::Error::last_os_error());
        }
        (seals, st.st_size as usize)
    };
    let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    if seals & need != need {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "the staging buffer is not sealed against resizing"));
    }
    Ok(size)
}

/// Sends `bytes` (at least one) with `fd` attached.
pub fn send_with_fd(s: &UnixStream, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    let mut space = [0u8; 64];
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    // SAFETY: msghdr is plain data; every pointer set below outlives the sendmsg call,
    // and CMSG_SPACE(4) (24 bytes) fits in `space`.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = space.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = libc::CMSG_SPACE(4) as _;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(4) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut libc::c_int, fd.as_raw_fd());
        let n = libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != bytes.len() {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "short send of a message with an fd"));
        }
    }
    Ok(())
}

/// Receives exactly `buf.len()` bytes, the first of them sent with one fd attached
/// (by [`send_with_fd`]); the fd, or an error if none came.
pub fn recv_with_fd(s: &UnixStream, buf: &mut [u8]) -> io::Result<OwnedFd> {
    let mut space = [0u8; 64];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: buf.len() };
    let mut got_fd: Option<OwnedFd> = None;
    // SAFETY: as in send_with_fd; the kernel writes at most msg_controllen bytes of
    // control data and at most iov_len bytes of data; every fd it passed is taken into
    // an OwnedFd (closed if it is not the one we expect).
    let n = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = space.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space.len() as _;
        let n = libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const libc::c_int;
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                for i in 0..count {
                    let fd = OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i)));
                    if got_fd.is_none() {
                        got_fd = Some(fd);
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
        n as usize
    };
    if n == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    let fd = got_fd.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no fd came with the message"))?;
    io::Read::read_exact(&mut &*s, &mut buf[n..])?;
    Ok(fd)
}

/// The user id of the process at the other end of `s` (`SO_PEERCRED`).
pub fn peer_uid(s: &UnixStream) -> io::Result<u32> {
    peer_cred(s).map(|c| c.uid)
}

/// The pid of the process that connected `s` (`SO_PEERCRED`, as numbered in our pid
/// namespace; 0 when it has no number there), from the kernel, not from a message.
pub fn peer_pid(s: &UnixStream) -> io::Result<libc::pid_t> {
    peer_cred(s).map(|c| c.pid)
}

fn peer_cred(s: &UnixStream) -> io::Result<libc::ucred> {
    // SAFETY: getsockopt fills a plain ucred struct of the size we pass.
    unsafe {
        let mut cred: libc::ucred = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        if libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut _ as *mut libc::c_void,
            &mut len,
        ) != 0
        {
            return Err(io::Error::last_os_error());
        }
        Ok(cred)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_sealed_memfd_passes_over_a_unix_socket_and_cannot_be_resized() {
        let fd = sealed_memfd("test", 1 << 16).unwrap();
        assert_eq!(sealed_len(fd.as_fd()).unwrap(), 1 << 16);
        // SAFETY: ftruncate on our own fd (expected to fail: sealed).
        assert_ne!(unsafe { libc::ftruncate(fd.as_raw_fd(), 10) }, 0, "a sealed memfd shrank");
        let (a, b) = UnixStream::pair().unwrap();
        send_with_fd(&a, b"hello", fd.as_fd()).unwrap();
        let mut buf = [0u8; 5];
        let got = recv_with_fd(&b, &mut buf).unwrap();
        assert_eq!(&buf, b"hello");
        let mine = crate::mem::MappedMemory::map_fd(fd.as_fd(), 1 << 16).unwrap();
        let theirs = crate::mem::MappedMemory::map_fd(got.as_fd(), 1 << 16).unwrap();
        // SAFETY: both mappings are 64 KiB of the same file; single-threaded test.
        unsafe {
            *mine.as_ptr().add(100) = 42;
            assert_eq!(*theirs.as_ptr().add(100), 42, "the two mappings are not the same memory");
        }
        assert_eq!(peer_uid(&a).unwrap(), unsafe { libc::getuid() });
        assert_eq!(peer_pid(&a).unwrap() as u32, std::process::id());
        // A message without an fd is refused, and an unsealed memfd is not accepted.
        a.try_clone().unwrap();
        io::Write::write_all(&mut &a, b"x").unwrap();
        assert!(recv_with_fd(&b, &mut [0u8; 1]).is_err());
        // SAFETY: a plain memfd_create with a valid name.
        let plain = unsafe { OwnedFd::from_raw_fd(libc::memfd_create(c"plain".as_ptr(), 0)) };
        assert!(sealed_len(plain.as_fd()).is_err());
    }
}
