//! Tests of `seal.rs` (and its reader and writer): protected frames, record layout, tampering.

use std::io::{self, IoSliceMut, Read, Write};

use super::super::super::protocol::FrameError;
use super::super::overlap::GROUP;
use super::super::ConnError;
use super::writer::TAGGED_GROUP;
use super::*;

const BOTH: [WireProtection; 2] = [WireProtection::Encrypted, WireProtection::Integrity];

fn fk(key: [u8; 32], protection: WireProtection) -> FrameKey {
    FrameKey { key, protection }
}

fn frames(key: Option<FrameKey>) -> Vec<u8> {
    let mut w = FrameWriter::new(Vec::new(), key);
    w.send(b"head-1", b"payload").unwrap();
    w.send(b"head-2", b"").unwrap();
    w.into_inner()
}

fn read_two(wire: &[u8], key: Option<FrameKey>) -> Result<Vec<u8>, ConnError> {
    let mut r = FrameReader::new(wire, key);
    let mut a = [0u8; 6];
    r.read_exact(&mut a).map_err(ConnError::from)?;
    let mut payload = [0u8; 7];
    r.read_payload(&mut payload)?;
    let mut b = [0u8; 6];
    r.read_exact(&mut b).map_err(ConnError::from)?;
    r.end_frame()?;
    Ok(payload.to_vec())
}

#[test]
fn frames_are_protected_and_any_change_fails() {
    for p in BOTH {
        frames_are_protected_and_any_change_fails_with(p);
    }
}

fn frames_are_protected_and_any_change_fails_with(p: WireProtection) {
    let k = fk([7u8; 32], p);
    let wire = frames(Some(k));
    assert_eq!(wire.len(), 13 + 6 + 2 * TAG_LEN);
    assert_eq!(read_two(&wire, Some(k)).unwrap(), b"payload");
    let in_clear = wire.windows(7).any(|w| w == b"payload");
    assert_eq!(in_clear, p == WireProtection::Integrity, "the payload is in clear only without encryption");
    assert!(read_two(&wire, Some(fk([8u8; 32], p))).is_err(), "another key");
    let other = match p {
        WireProtection::Encrypted => WireProtection::Integrity,
        WireProtection::Integrity => WireProtection::Encrypted,
    };
    assert!(read_two(&wire, Some(fk([7u8; 32], other))).is_err(), "the other protection");
    for i in [0, 5, 6, 12, 13 + 1, 13 + TAG_LEN + 2, wire.len() - 1] {
        let mut bad = wire.clone();
        bad[i] ^= 1;
        assert!(read_two(&bad, Some(k)).is_err(), "flipped byte {i} went unnoticed");
    }
    // Reordered frames (a replay of frame 0 as frame 1 included) fail the sequence.
    let (f0, f1) = wire.split_at(13 + TAG_LEN);
    let swapped = [f1, f0].concat();
    let mut r = FrameReader::new(&swapped[..], Some(k));
    let mut b = [0u8; 6];
    r.read_exact(&mut b).unwrap();
    assert!(r.end_frame().is_err());
    // A payload dropped unread is still verified.
    let mut r = FrameReader::new(&wire[..], Some(k));
    r.read_exact(&mut b).unwrap();
    assert!(r.discard_payload(7).is_ok());
    let mut bad = wire.clone();
    bad[8] ^= 1;
    let mut r = FrameReader::new(&bad[..], Some(k));
    r.read_exact(&mut b).unwrap();
    assert!(r.discard_payload(7).is_err());
}

/// A payload of several records (the last one short), the way a 1 MiB slice goes.
fn big_frame(k: FrameKey) -> (Vec<u8>, Vec<u8>) {
    let payload: Vec<u8> = (0..2 * RECORD + 100).map(|i| (i * 7 % 251) as u8).collect();
    let mut w = FrameWriter::new(Vec::new(), Some(k));
    w.send(b"head-1", &payload).unwrap();
    w.send(b"head-2", b"").unwrap();
    (w.into_inner(), payload)
}

#[test]
fn payloads_go_in_records_each_verified_before_it_lands() {
    for p in BOTH {
        payloads_go_in_records_each_verified_before_it_lands_with(p);
    }
}

fn payloads_go_in_records_each_verified_before_it_lands_with(p: WireProtection) {
    let k = fk([3u8; 32], p);
    let (wire, payload) = big_frame(k);
    let rec = RECORD + TAG_LEN;
    assert_eq!(wire.len(), 6 + payload.len() + 3 * TAG_LEN + 6 + TAG_LEN, "three records and an empty one");
    let read = |wire: &[u8], staged: bool| -> (Result<(), ConnError>, Vec<u8>) {
        let mut r = FrameReader::new(wire, Some(k));
        let mut head = [0u8; 6];
        r.read_exact(&mut head).unwrap();
        let mut dst = vec![0u8; payload.len()];
        let got = if staged { r.read_payload_verified(&mut dst) } else { r.read_payload(&mut dst) };
        let got = got.and_then(|()| {
            r.read_exact(&mut head).map_err(ConnError::from)?;
            r.end_frame()
        });
        (got, dst)
    };
    for staged in [false, true] {
        let (ok, dst) = read(&wire, staged);
        assert!(ok.is_ok() && dst == payload, "an intact frame (staged: {staged})");
    }
    // A byte flipped in the second record: the first lands (verified), nothing of the
    // second or third reaches memory that others read.
    let mut bad = wire.clone();
    bad[6 + rec + 10] ^= 1;
    let (got, dst) = read(&bad, true);
    assert!(matches!(got, Err(ConnError::Frame(FrameError::BadTag))));
    assert_eq!(dst[..RECORD], payload[..RECORD]);
    assert!(dst[RECORD..].iter().all(|&b| b == 0), "an unverified record landed");
    // Into the reader's own buffer (records opened on the helper thread): refused too.
    assert!(matches!(read(&bad, false).0, Err(ConnError::Frame(FrameError::BadTag))));
    let mut bad_first = wire.clone();
    bad_first[3] ^= 1; // the head, authenticated by the first record
    assert!(read(&bad_first, false).0.is_err() && read(&bad_first, true).0.is_err());
    // Records swapped within the frame, or one repeated in place of the next (a
    // replay), fail their nonce.
    let (r0, rest) = wire[6..].split_at(rec);
    let (r1, rest) = rest.split_at(rec);
    for body in [[r1, r0, rest].concat(), [r0, r0, rest].concat()] {
        let spliced = [&wire[..6], &body[..]].concat();
        for staged in [false, true] {
            assert!(read(&spliced, staged).0.is_err(), "a moved record went unnoticed (staged: {staged})");
        }
    }
    // A frame cut after its first record fails (the stream ends), as does a dropped one.
    assert!(read(&wire[..6 + rec], true).0.is_err());
    let dropped = [&wire[..6 + rec], &wire[6 + 2 * rec..]].concat();
    assert!(read(&dropped, true).0.is_err());
    // Discarding a payload verifies every record too.
    let mut r = FrameReader::new(&bad[..], Some(k));
    r.read_exact(&mut [0u8; 6]).unwrap();
    assert!(r.discard_payload(payload.len()).is_err());
    let mut r = FrameReader::new(&wire[..], Some(k));
    r.read_exact(&mut [0u8; 6]).unwrap();
    assert!(r.discard_payload(payload.len()).is_ok());
}

/// Sealed records go to the helper in jobs of `GROUP`; tagged ones are checked inline:
/// a payload of several jobs, tampered in its second job or its last tag, fails either way.
#[test]
fn a_payload_of_several_helper_jobs_is_verified_whole() {
    for p in BOTH {
        let k = fk([5u8; 32], p);
        let payload: Vec<u8> = (0..(GROUP + 2) * RECORD + 7).map(|i| (i % 253) as u8).collect();
        let mut w = FrameWriter::new(Vec::new(), Some(k));
        w.send(b"head", &payload).unwrap();
        w.send(b"next", b"").unwrap();
        let wire = w.into_inner();
        let read = |wire: &[u8]| -> Result<Vec<u8>, ConnError> {
            let mut r = FrameReader::new(wire, Some(k));
            r.read_exact(&mut [0u8; 4]).map_err(ConnError::from)?;
            let mut dst = vec![0u8; payload.len()];
            r.read_payload(&mut dst)?;
            r.read_exact(&mut [0u8; 4]).map_err(ConnError::from)?;
            r.end_frame()?;
            Ok(dst)
        };
        assert_eq!(read(&wire).unwrap(), payload);
        // A byte of a record in the second job, and the last record's tag.
        for at in [4 + (GROUP + 1) * (RECORD + TAG_LEN) + 3, 4 + payload.len() + (GROUP + 3) * TAG_LEN - 1] {
            let mut bad = wire.clone();
            bad[at] ^= 1;
            assert!(matches!(read(&bad), Err(ConnError::Frame(FrameError::BadTag))), "byte {at}");
        }
    }
}

/// The staged landing (verified records copied out with streaming stores) against the
/// reference, the payload itself: every length around the streaming threshold and a
/// record's size, at destination offsets that are and are not 64-byte aligned, writes
/// exactly the payload and nothing either side, under both protections.
#[test]
fn staged_landing_writes_the_payload_exactly_at_any_alignment_and_length() {
    for p in BOTH {
        let k = fk([9u8; 32], p);
        for len in [1, 63, 1023, 1024, 1025, 4097, RECORD - 1, RECORD, RECORD + 1, 3 * RECORD + 65] {
            let payload: Vec<u8> = (0..len).map(|i| (i * 13 % 251) as u8 ^ 0x5a).collect();
            let mut w = FrameWriter::new(Vec::new(), Some(k));
            w.send(b"head", &payload).unwrap();
            for at in [0usize, 1, 17, 63, 64] {
                let mut r = FrameReader::new(&w.get_ref()[..], Some(k));
                r.read_exact(&mut [0u8; 4]).unwrap();
                let mut region = vec![0xEEu8; len + 256];
                // `at` bytes past a 64-byte boundary inside `region`
                let start = (64 - region.as_ptr() as usize % 64) % 64 + at;
                r.read_payload_verified(&mut region[start..start + len]).unwrap();
                assert!(region[start..start + len] == payload[..], "{p:?} len {len} at +{at}");
                assert!(region[..start].iter().chain(&region[start + len..]).all(|&b| b == 0xEE), "{p:?} len {len}");
            }
        }
    }
}

/// A writer that takes at most `max` bytes a call, as a socket with a full buffer does.
struct Trickle {
    out: Vec<u8>,
    max: usize,
}

impl Write for Trickle {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = buf.len().min(self.max);
        self.out.extend_from_slice(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[test]
fn integrity_frames_of_many_records_go_out_as_the_record_layout_says() {
    let k = fk([6u8; 32], WireProtection::Integrity);
    // Two full groups of records and a short one, and a frame without payload.
    let payload: Vec<u8> = (0..(2 * TAGGED_GROUP + 3) * RECORD + 11).map(|i| (i % 241) as u8).collect();
    for max in [usize::MAX, 1000, 7] {
        let mut w = FrameWriter::new(Trickle { out: Vec::new(), max }, Some(k));
        w.send(b"head-1", &payload).unwrap();
        w.send(b"head-2", b"").unwrap();
        // The reference: record by record, head before the first, each record's tag after it.
        let g = Guard::new(&k);
        let mut want = b"head-1".to_vec();
        for (seq, record) in payload.chunks(RECORD).enumerate() {
            let aad: &[u8] = if seq == 0 { b"head-1" } else { b"" };
            want.extend_from_slice(record);
            want.extend_from_slice(&g.tag_in_clear(seq as u64, aad, record).unwrap());
        }
        let last = payload.len().div_ceil(RECORD) as u64;
        want.extend_from_slice(b"head-2");
        want.extend_from_slice(&g.tag_in_clear(last, b"head-2", b"").unwrap());
        assert!(w.into_inner().out == want, "writes of at most {max} bytes");
        // Read back through a socket that returns at most `max` bytes a call, across
        // a record's end and its tag.
        for staged in [true, false] {
            let mut r = FrameReader::new(TrickleIn { data: &want, max }, Some(k));
            r.read_exact(&mut [0u8; 6]).unwrap();
            let mut dst = vec![0u8; payload.len()];
            if staged { r.read_payload_verified(&mut dst) } else { r.read_payload(&mut dst) }.unwrap();
            assert!(dst == payload);
            r.read_exact(&mut [0u8; 6]).unwrap();
            r.end_frame().unwrap();
        }
    }
}

/// A reader that hands out at most `max` bytes a call, filling several buffers of a
/// vectored read as a socket does.
struct TrickleIn<'a> {
    data: &'a [u8],
    max: usize,
}

impl Read for TrickleIn<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_vectored(&mut [IoSliceMut::new(buf)])
    }

    fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        let mut n = 0;
        for b in bufs {
            let k = b.len().min(self.max - n).min(self.data.len());
            b[..k].copy_from_slice(&self.data[..k]);
            self.data = &self.data[k..];
            n += k;
        }
        Ok(n)
    }
}

#[test]
fn without_a_key_frames_are_bare() {
    assert_eq!(frames(None), b"head-1payloadhead-2".to_vec());
    assert_eq!(read_two(&frames(None), None).unwrap(), b"payload");
}
