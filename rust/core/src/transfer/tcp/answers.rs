//! The serving side's responses, held while the next request is already queued.
//!
//! A served connection answers every request with a frame of its own. Written one by
//! one, each answer is a system call on the server and, on the client, a wake-up of the
//! receiver thread per request: with 64 KiB writes about 16 a MB, each a cross-core
//! wake-up (an IPI, a VM exit under KVM) that also preempts whatever ran on that core
//! (BENCHMARKS.md, "k26q"). So answers are buffered while the server still has a whole
//! request header waiting to be read, and written together when it has none (before it
//! would block for the next request) or when [`MAX_HELD`] are waiting. Whatever the
//! client does, an answer is never held across a wait for input that may not come: the
//! server flushes before every read that could block between requests, and a request it
//! has started reading was already sent whole by the client (a client never waits for
//! answers in the middle of a frame), so at most one frame's arrival delays them.
//!
//! A response with a payload (a read) goes straight to the socket after the answers
//! held before it (`BufWriter` writes anything larger than its buffer directly, in
//! order).

use std::io::{self, BufReader, BufWriter, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;

use super::super::protocol::HEADER_LEN;

/// Most answers held before they are written anyway (bounds the delay of the first one
/// to a few frames' arrival).
pub const MAX_HELD: usize = 8;

/// Most bytes of requests whose answers are held. A client keeps at most `window_bytes`
/// (4 MiB by default) unanswered per connection; holding the answers of a whole window
/// would stall it until this server drained everything queued, emptying the pipeline
/// (encrypted 512 KiB writes, where the server is behind: 1.09 CPU-s/GB without this
/// bound against main's 0.85, 0.70 with it; BENCHMARKS.md, "k26q"). An eighth of the
/// default keeps the client sending.
pub const MAX_HELD_BYTES: usize = 512 << 10;

/// Buffer of held answers: a few dozen bytes each (a head and, with a token, a tag).
const HOLD_BYTES: usize = 4096;

/// The writing half of a served connection.
pub struct Answers {
    out: BufWriter<TcpStream>,
    held: usize,
    held_bytes: usize,
}

impl Answers {
    pub fn new(stream: TcpStream) -> Answers {
        Answers { out: BufWriter::with_capacity(HOLD_BYTES, stream), held: 0, held_bytes: 0 }
    }

    /// Called after each answered request that moved `bytes`: writes the held answers
    /// unless the next request's header is already here (in `input`'s buffer or the
    /// socket), fewer than [`MAX_HELD`] are held and their requests moved less than
    /// [`MAX_HELD_BYTES`].
    pub fn answered(&mut self, input: &BufReader<TcpStream>, bytes: usize) -> io::Result<()> {
        self.held += 1;
        self.held_bytes = self.held_bytes.saturating_add(bytes);
        if self.held >= MAX_HELD || self.held_bytes >= MAX_HELD_BYTES || !header_waiting(input) {
            self.flush()?;
        }
        Ok(())
    }

    /// Answers held now.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.held
    }
}

impl Write for Answers {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.out.write(buf)
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.out.write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.held = 0;
        self.held_bytes = 0;
        self.out.flush()
    }
}

/// Whether a whole frame header can be read from `input` without blocking.
fn header_waiting(input: &BufReader<TcpStream>) -> bool {
    let buffered = input.buffer().len();
    buffered >= HEADER_LEN || buffered + socket_queued(input.get_ref()) >= HEADER_LEN
}

/// Bytes queued for reading on `s` (0 when unknown: then the answers are written).
fn socket_queued(s: &TcpStream) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer, which outlives the call;
    // the descriptor is a socket this connection owns.
    let rc = unsafe { libc::ioctl(s.as_raw_fd(), libc::FIONREAD, &mut n as *mut libc::c_int) };
    if rc == 0 {
        n.max(0) as usize
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;
    use std::time::Duration;

    /// (server's answers, server's input, the client's end).
    fn pair() -> (Answers, BufReader<TcpStream>, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server, _) = l.accept().unwrap();
        let input = BufReader::new(server.try_clone().unwrap());
        client.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        (Answers::new(server), input, client)
    }

    /// What the client can read without waiting.
    fn arrived(client: &mut TcpStream) -> Vec<u8> {
        client.set_nonblocking(true).unwrap();
        let mut out = vec![0u8; 4096];
        let n = client.read(&mut out).unwrap_or(0);
        client.set_nonblocking(false).unwrap();
        out.truncate(n);
        out
    }

    #[test]
    fn answers_are_written_at_once_when_no_request_is_waiting() {
        let (mut a, input, mut client) = pair();
        a.write_all(b"first").unwrap();
        a.answered(&input, 1).unwrap();
        assert_eq!(a.held(), 0);
        let mut got = [0u8; 5];
        client.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"first");
    }

    /// While a whole header is queued, answers wait (in order) until none is or
    /// `MAX_HELD` are held; loopback delivers a write before it returns.
    #[test]
    fn answers_wait_while_a_request_header_is_queued_and_at_most_max_held() {
        let (mut a, input, mut client) = pair();
        client.write_all(&[7u8; HEADER_LEN]).unwrap();
        let mut sent = Vec::new();
        for i in 0..MAX_HELD - 1 {
            let answer = [b'a' + i as u8; 3];
            a.write_all(&answer).unwrap();
            sent.extend_from_slice(&answer);
            a.answered(&input, 1).unwrap();
            assert_eq!(a.held(), i + 1, "held while the next header is waiting");
        }
        assert!(arrived(&mut client).is_empty(), "nothing written yet");
        a.write_all(b"zzz").unwrap();
        sent.extend_from_slice(b"zzz");
        a.answered(&input, 1).unwrap();
        assert_eq!(a.held(), 0, "written at MAX_HELD");
        let mut got = vec![0u8; sent.len()];
        client.read_exact(&mut got).unwrap();
        assert_eq!(got, sent, "every answer, in order");
    }

    /// Answers of requests that moved MAX_HELD_BYTES are written even while a header
    /// waits, so a client whose window is in bytes keeps room to send.
    #[test]
    fn answers_of_a_window_share_of_bytes_are_written() {
        let (mut a, input, mut client) = pair();
        client.write_all(&[7u8; HEADER_LEN]).unwrap();
        a.write_all(b"big").unwrap();
        a.answered(&input, MAX_HELD_BYTES / 2).unwrap();
        assert_eq!(a.held(), 1);
        a.write_all(b"big").unwrap();
        a.answered(&input, MAX_HELD_BYTES / 2).unwrap();
        assert_eq!(a.held(), 0, "written at MAX_HELD_BYTES");
        let mut got = [0u8; 6];
        client.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"bigbig");
    }

    #[test]
    fn a_partial_header_does_not_hold_answers_and_dropping_writes_what_is_held() {
        let (mut a, input, mut client) = pair();
        client.write_all(&[7u8; HEADER_LEN - 1]).unwrap();
        a.write_all(b"one").unwrap();
        a.answered(&input, 1).unwrap();
        assert_eq!(a.held(), 0, "a header that is not whole may never complete: written");
        client.write_all(&[7u8]).unwrap();
        a.write_all(b"two").unwrap();
        a.answered(&input, 1).unwrap();
        assert_eq!(a.held(), 1);
        drop(a);
        let mut got = [0u8; 6];
        client.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"onetwo");
    }
}
