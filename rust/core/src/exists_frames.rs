//! A store node's answer to `Exists` requests (a `batch_is_exist`) read, answered and
//! written in one native call, without the interpreter.
//!
//! Why: a `batch_is_exist` of 100 small keys is a ~2 KiB request and a ~110 B answer; the
//! node's share of its round trip was ~5 us of Python around ~2 us of work (read the
//! frame, decode its header, dispatch, build the answer, encode it, write it), and with
//! both ends on different CPUs every microsecond of it is on the round trip. Here a
//! node's connection reader reads, answers every whole `Exists` frame at the front of
//! what it read from the node's key set ([`KeySet`]), writes the answers, and hands back
//! only what it does not answer itself (any other request, a partial frame, a frame laid
//! out differently): the caller's general decoder reads that, in order, so nothing is
//! answered out of turn and every error keeps its one handler.
//!
//! The wire format is the pool protocol's (python/mooncake_rs/pool/protocol.py): a 4-byte
//! big-endian length, then a msgpack map with the tag field `op` first. An `Exists` as
//! msgspec writes it is `{"op": "exists", "rid": N, "keys": [str, ...]}`; its answer is
//! `{"op": "answer", "rid": N, "values": [1|0, ...]}` (the `FlagsAnswer` the Python
//! handler sends, byte for byte).

use std::io;
use std::ops::Range;
use std::os::fd::RawFd;

#[cfg(test)]
use crate::key_set::write_array_len;
use crate::key_set::KeySet;
use crate::spin_read::SpinRead;

/// A frame's length prefix.
pub const HDR: usize = 4;

/// The bytes an `Exists` body starts with: a 3-entry map, `"op": "exists"`, `"rid"`.
const EXISTS_HEAD: &[u8] = b"\x83\xa2op\xa6exists\xa3rid";
/// The key before the key list.
const KEYS_KEY: &[u8] = b"\xa4keys";
/// An answer body up to its rid.
const ANSWER_HEAD: &[u8] = b"\x83\xa2op\xa6answer\xa3rid";
/// The key before the answer's list.
const VALUES_KEY: &[u8] = b"\xa6values";

/// The rid and key-list bytes of an `Exists` body laid out as msgspec writes it; None for
/// anything else (another request, other field order, a malformed body): the caller's
/// general decoder answers those.
pub fn parse_exists(body: &[u8]) -> Option<(u64, &[u8])> {
    let rest = body.strip_prefix(EXISTS_HEAD)?;
    let (rid, rest) = read_uint(rest)?;
    Some((rid, rest.strip_prefix(KEYS_KEY)?))
}

/// Appends the whole answer frame (length prefix included) to `out`.
pub fn write_answer_frame(out: &mut Vec<u8>, rid: u64, flags_msgpack: &[u8]) {
    let start = out.len();
    out.extend_from_slice(&[0; HDR]);
    out.extend_from_slice(ANSWER_HEAD);
    write_uint(out, rid);
    out.extend_from_slice(VALUES_KEY);
    out.extend_from_slice(flags_msgpack);
    let body = (out.len() - start - HDR) as u32; // (a list of 1-byte flags: far below 4 GiB)
    out[start..start + HDR].copy_from_slice(&body.to_be_bytes());
}

/// Answers the whole `Exists` frames at the front of `buf` from `keys`, appending their
/// answer frames to `out`; returns how many bytes of `buf` they took (the first frame it
/// leaves starts there: another request, a partial frame, or one whose key list the set
/// refuses, for the caller's decoder to answer with its error).
pub fn answer_leading(buf: &[u8], keys: &KeySet, out: &mut Vec<u8>) -> usize {
    let mut pos = 0;
    while let Some(len) = frame_len(&buf[pos..]) {
        let Some(body) = buf.get(pos + HDR..pos + HDR + len) else { break };
        let Some((rid, key_list)) = parse_exists(body) else { break };
        let Ok(flags) = keys.flags_msgpack(key_list) else { break };
        write_answer_frame(out, rid, &flags);
        pos += HDR + len;
    }
    pos
}

/// The body length a frame's prefix gives, when `buf` holds the prefix.
pub fn frame_len(buf: &[u8]) -> Option<usize> {
    let prefix: [u8; HDR] = buf.get(..HDR)?.try_into().ok()?;
    Some(u32::from_be_bytes(prefix) as usize)
}

/// Appends an `Exists` request frame (length prefix included) for `keys` (each a key's
/// UTF-8 bytes) to `out`, laid out as msgspec writes it: what a client sends (the client
/// writes it with msgspec; the tests here with this).
#[cfg(test)]
fn write_exists_frame(out: &mut Vec<u8>, rid: u64, keys: &[&[u8]]) {
    let start = out.len();
    out.extend_from_slice(&[0; HDR]);
    out.extend_from_slice(EXISTS_HEAD);
    write_uint(out, rid);
    out.extend_from_slice(KEYS_KEY);
    write_array_len(out, keys.len());
    for k in keys {
        write_str_len(out, k.len());
        out.extend_from_slice(k);
    }
    let body = out.len() - start - HDR;
    out[start..start + HDR].copy_from_slice(&(body as u32).to_be_bytes());
}

/// The rid and 1/0 flags of an answer body laid out as a node writes it for an `Exists`
/// (every value 0 or 1, nothing after the list); None for anything else (an error, a
/// `Failure`, another layout): the caller's general decoder reads those.
pub fn parse_flags_answer(body: &[u8]) -> Option<(u64, &[u8])> {
    let rest = body.strip_prefix(ANSWER_HEAD)?;
    let (rid, rest) = read_uint(rest)?;
    let rest = rest.strip_prefix(VALUES_KEY)?;
    let (&tag, rest) = rest.split_first()?;
    let (n, flags) = match tag {
        0x90..=0x9f => (usize::from(tag & 0x0f), rest),
        0xdc => (usize::from(u16::from_be_bytes(rest.get(..2)?.try_into().ok()?)), &rest[2..]),
        0xdd => (u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize, &rest[4..]),
        _ => return None,
    };
    (flags.len() == n && flags.iter().all(|&f| f <= 1)).then_some((rid, flags))
}

/// One connection end's reader: its poll state and read buffer.
pub struct ExistsReader {
    spin: SpinRead,
    buf: Vec<u8>,
    out: Vec<u8>,
}

/// What one [`ExistsReader::serve`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Served {
    /// the peer closed the stream
    End,
    /// these bytes of the buffer are left for the caller (empty: every frame was answered)
    Rest(Range<usize>),
}

impl ExistsReader {
    /// `spin`: how long a read polls before it sleeps (spin_read.rs); `read_bytes`: what
    /// one read asks for.
    pub fn new(spin: SpinRead, read_bytes: usize) -> Self {
        Self { spin, buf: vec![0; read_bytes.max(1)], out: Vec::new() }
    }

    /// One read of `fd` (a blocking socket: the poll, then a read bounded by its own
    /// receive timeout); `answer(read, out)` answers the frames at the read's front it can
    /// (appending their answer frames to `out`) and returns how many bytes they took
    /// ([`answer_leading`], or 0 when the node's key set is not current). The answers are
    /// written back on `fd` before this returns; the bytes left (from the first frame not
    /// answered) are `Served::Rest`, read with [`Self::bytes`].
    pub fn serve(&mut self, fd: RawFd, answer: impl FnOnce(&[u8], &mut Vec<u8>) -> usize) -> io::Result<Served> {
        let n = self.spin.recv(fd, &mut self.buf)?;
        if n == 0 {
            return Ok(Served::End);
        }
        self.out.clear();
        let taken = answer(&self.buf[..n], &mut self.out);
        if !self.out.is_empty() {
            send_all(fd, &self.out)?;
        }
        Ok(Served::Rest(taken..n))
    }

    /// The bytes of a `Served::Rest` range (valid until the next `serve`).
    pub fn bytes(&self, range: Range<usize>) -> &[u8] {
        &self.buf[range]
    }
}

/// Writes all of `data` on a blocking socket (bounded by its own send timeout:
/// `WouldBlock` when it expires); never raises SIGPIPE on a closed peer (`EPIPE` instead).
fn send_all(fd: RawFd, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        // SAFETY: `data` is readable for its whole length for the duration of the call.
        let n = unsafe { libc::send(fd, data.as_ptr().cast(), data.len(), libc::MSG_NOSIGNAL) };
        if n >= 0 {
            data = &data[n as usize..];
            continue;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}

fn read_uint(b: &[u8]) -> Option<(u64, &[u8])> {
    let (&tag, rest) = b.split_first()?;
    let width = match tag {
        0x00..=0x7f => return Some((u64::from(tag), rest)),
        0xcc => 1,
        0xcd => 2,
        0xce => 4,
        0xcf => 8,
        _ => return None,
    };
    let (be, rest) = (rest.get(..width)?, &rest[width..]);
    Some((be.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)), rest))
}

#[cfg(test)]
fn write_str_len(out: &mut Vec<u8>, n: usize) {
    if n < 32 {
        out.push(0xa0 | n as u8);
    } else if let Ok(n) = u8::try_from(n) {
        out.extend_from_slice(&[0xd9, n]);
    } else if let Ok(n) = u16::try_from(n) {
        out.push(0xda);
        out.extend_from_slice(&n.to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

/// A msgpack uint in its shortest form (as msgspec writes it).
fn write_uint(out: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        out.push(v as u8);
    } else if let Ok(v) = u8::try_from(v) {
        out.extend_from_slice(&[0xcc, v]);
    } else if let Ok(v) = u16::try_from(v) {
        out.push(0xcd);
        out.extend_from_slice(&v.to_be_bytes());
    } else if let Ok(v) = u32::try_from(v) {
        out.push(0xce);
        out.extend_from_slice(&v.to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    fn exists_frame(rid: u64, keys: &[&str]) -> Vec<u8> {
        let mut out = Vec::new();
        write_exists_frame(&mut out, rid, &keys.iter().map(|k| k.as_bytes()).collect::<Vec<_>>());
        out
    }

    fn framed(body: &[u8]) -> Vec<u8> {
        let mut f = (body.len() as u32).to_be_bytes().to_vec();
        f.extend_from_slice(body);
        f
    }

    fn answer(rid: u64, flags: &[u8]) -> Vec<u8> {
        let mut list = vec![0x90 | flags.len() as u8];
        list.extend_from_slice(flags);
        let mut out = Vec::new();
        write_answer_frame(&mut out, rid, &list);
        out
    }

    fn set(keys: &[&str]) -> KeySet {
        let mut s = KeySet::new();
        for k in keys {
            s.insert(k.as_bytes());
        }
        s
    }

    #[test]
    fn rids_of_every_width_read_back() {
        for rid in [0, 1, 127, 128, 255, 256, 65_535, 65_536, u64::from(u32::MAX), u64::from(u32::MAX) + 1, u64::MAX] {
            let f = exists_frame(rid, &["k"]);
            let (got, keys) = parse_exists(&f[HDR..]).unwrap();
            assert_eq!((got, keys), (rid, &b"\x91\xa1k"[..]));
            let a = answer(rid, &[1]);
            let body = &a[HDR..];
            assert_eq!(u32::from_be_bytes(a[..HDR].try_into().unwrap()) as usize, body.len());
            let rest = body.strip_prefix(ANSWER_HEAD).unwrap();
            let (back, rest) = read_uint(rest).unwrap();
            assert_eq!((back, rest), (rid, &b"\xa6values\x91\x01"[..]));
        }
    }

    #[test]
    fn other_bodies_are_left_to_the_caller() {
        assert_eq!(parse_exists(b""), None);
        assert_eq!(parse_exists(b"\x83\xa2op\xa6lookup\xa3rid\x01\xa4keys\x90"), None);
        assert_eq!(parse_exists(b"\x83\xa3rid\x01\xa2op\xa6exists\xa4keys\x90"), None); // (another field order)
        assert_eq!(parse_exists(b"\x83\xa2op\xa6exists\xa3rid\xd0\x01\xa4keys\x90"), None); // (a signed rid)
        assert_eq!(parse_exists(b"\x83\xa2op\xa6exists\xa3rid\xcd\x01"), None); // (cut inside the rid)
        assert_eq!(parse_exists(b"\x83\xa2op\xa6exists\xa3rid\x01\xa4kezs\x90"), None);
    }

    #[test]
    fn leading_exists_frames_are_answered_and_the_rest_left_in_order() {
        let s = set(&["a", "c"]);
        let other = framed(b"\x83\xa2op\xa5sizes\xa3rid\x03\xa4keys\x91\xa1a");
        let mut buf = exists_frame(1, &["a", "b"]);
        buf.extend(exists_frame(2, &["c"]));
        let answered = buf.len();
        buf.extend(&other);
        buf.extend(exists_frame(4, &["a"])); // (after another request: the caller's, to keep the order)
        let mut out = Vec::new();
        assert_eq!(answer_leading(&buf, &s, &mut out), answered);
        let mut want = answer(1, &[1, 0]);
        want.extend(answer(2, &[1]));
        assert_eq!(out, want);

        // a partial frame (header or body) is left whole
        let f = exists_frame(5, &["a"]);
        for cut in 0..f.len() {
            let mut out = Vec::new();
            assert_eq!(answer_leading(&f[..cut], &s, &mut out), 0);
            assert!(out.is_empty());
        }
        // a key list the set refuses (a non-str key) is left for the caller's error
        let bad = framed(b"\x83\xa2op\xa6exists\xa3rid\x01\xa4keys\x91\x05");
        let mut out = Vec::new();
        assert_eq!(answer_leading(&bad, &s, &mut out), 0);
        assert!(out.is_empty());
    }

    #[test]
    fn serve_reads_answers_on_the_socket_and_hands_back_the_rest() {
        let (node, mut client) = UnixStream::pair().unwrap();
        let s = set(&["x"]);
        let mut r = ExistsReader::new(SpinRead::new(Duration::from_micros(50)), 1 << 16);
        let mut sent = exists_frame(9, &["x", "y"]);
        let tail = framed(b"\x81\xa2op\xa5stats");
        sent.extend(&tail);
        client.write_all(&sent).unwrap();
        let got = r.serve(node.as_raw_fd(), |buf, out| answer_leading(buf, &s, out)).unwrap();
        let Served::Rest(range) = got else { panic!("{got:?}") };
        assert_eq!(r.bytes(range), &tail[..]);
        let want = answer(9, &[1, 0]);
        let mut back = vec![0; want.len()];
        client.read_exact(&mut back).unwrap();
        assert_eq!(back, want);

        // a set that is not current answers nothing: every byte goes to the caller
        client.write_all(&exists_frame(10, &["x"])).unwrap();
        let got = r.serve(node.as_raw_fd(), |_, _| 0).unwrap();
        assert_eq!(got, Served::Rest(0..exists_frame(10, &["x"]).len()));

        drop(client);
        assert_eq!(r.serve(node.as_raw_fd(), |buf, out| answer_leading(buf, &s, out)).unwrap(), Served::End);
        assert!(r.serve(-1, |_, _| 0).is_err());
    }

    #[test]
    fn a_written_request_reads_back_with_every_key_form() {
        let keys: Vec<Vec<u8>> = [0usize, 1, 31, 32, 255, 256, 70_000]
            .iter()
            .map(|&n| "k".repeat(n).into_bytes())
            .chain(["é".repeat(20).into_bytes()])
            .collect();
        for count in [0usize, 1, 15, 16, 70_000] {
            let asked: Vec<&[u8]> = (0..count).map(|i| keys[i % keys.len()].as_slice()).collect();
            let mut out = Vec::new();
            write_exists_frame(&mut out, 300, &asked);
            let len = u32::from_be_bytes(out[..HDR].try_into().unwrap()) as usize;
            assert_eq!(len, out.len() - HDR);
            let (rid, list) = parse_exists(&out[HDR..]).unwrap();
            assert_eq!(rid, 300);
            let mut set = KeySet::new();
            set.insert(&keys[1]);
            let flags = set.flags_msgpack(list).unwrap(); // (the node's reader takes it as its list)
            let mut answer = Vec::new();
            write_answer_frame(&mut answer, rid, &flags);
            let (back, got) = parse_flags_answer(&answer[HDR..]).unwrap();
            assert_eq!(back, 300);
            let want: Vec<u8> = asked.iter().map(|k| u8::from(*k == keys[1].as_slice())).collect();
            assert_eq!(got, &want[..]);
        }
    }

    #[test]
    fn answers_other_than_flags_are_left_to_the_caller() {
        let mut a = Vec::new();
        write_answer_frame(&mut a, 5, b"\x92\x01\x02"); // (a value that is no flag: a size, a code)
        assert_eq!(parse_flags_answer(&a[HDR..]), None);
        let mut a = Vec::new();
        write_answer_frame(&mut a, 5, b"\x92\x01\xff");
        assert_eq!(parse_flags_answer(&a[HDR..]), None);
        let mut a = Vec::new();
        write_answer_frame(&mut a, 5, b"\x92\x01"); // (cut short)
        assert_eq!(parse_flags_answer(&a[HDR..]), None);
        let mut a = Vec::new();
        write_answer_frame(&mut a, 5, b"\x91\x01\x80"); // (something after the list: an Answer's metrics)
        assert_eq!(parse_flags_answer(&a[HDR..]), None);
        assert_eq!(parse_flags_answer(b"\x84\xa2op\xa7failure\xa3rid\x05"), None);
        assert_eq!(parse_flags_answer(b""), None);
    }
}
