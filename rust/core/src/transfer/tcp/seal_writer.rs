//! The sending half of a protected connection (the layout and the rules: [`seal`](super)).

use std::io::{self, IoSlice, Write};

use super::{Direction, FrameKey, RECORD, TAG_LEN};

/// The sending half of a connection: frames out, each sealed when keyed.
pub struct FrameWriter<W> {
    inner: W,
    seal: Option<Direction>,
    /// A group of records' ciphertext when encrypting (the caller's bytes are never
    /// written to); at most [`SEALED_GROUP`] records, allocated once per connection,
    /// unused integrity-only.
    scratch: Vec<u8>,
}

impl<W: Write> FrameWriter<W> {
    pub fn new(inner: W, key: Option<FrameKey>) -> Self {
        FrameWriter { inner, seal: key.as_ref().map(Direction::new), scratch: Vec::new() }
    }

    /// Writes one frame (`head`, then `data`, protected record by record when keyed),
    /// a group of records per vectored write (see [`TAGGED_GROUP`], [`SEALED_GROUP`]),
    /// and no allocation after the first frame.
    pub fn send(&mut self, head: &[u8], data: &[u8]) -> io::Result<()> {
        let FrameWriter { inner, seal, scratch } = self;
        let Some(dir) = seal else {
            return write_all_parts(inner, &mut [head, data, &[]]);
        };
        let in_clear = dir.guard.in_clear();
        let group = if in_clear { TAGGED_GROUP } else { SEALED_GROUP };
        let empty: &[u8] = &[];
        // Records `from..to` of the payload, as a byte range of `data`.
        let span = |from: usize, to: usize| (from * RECORD).min(data.len())..(to * RECORD).min(data.len());
        // A frame without payload is one empty record (it carries the head's tag).
        let records = data.len().div_ceil(RECORD).max(1);
        let mut i = 0;
        while i < records {
            let k = (records - i).min(group);
            let base = span(i, i).start;
            let mut tags = [[0u8; TAG_LEN]; TAGGED_GROUP];
            if !in_clear {
                // The caller's bytes are never written to: the group is sealed in `scratch`.
                scratch.clear();
                scratch.extend_from_slice(&data[span(i, i + k)]);
            }
            for (j, tag) in tags[..k].iter_mut().enumerate() {
                let aad = if i + j == 0 { head } else { empty };
                let r = span(i + j, i + j + 1);
                let seq = dir.next_seq();
                *tag = if in_clear {
                    // Integrity-only: tagged where the caller keeps it; there is always a tag.
                    dir.guard.tag_in_clear(seq, aad, &data[r]).unwrap_or_default()
                } else {
                    dir.guard.protect(seq, aad, &mut scratch[r.start - base..r.end - base])
                };
            }
            let source: &[u8] = if in_clear { &data[base..] } else { &scratch[..] };
            let mut slices = [IoSlice::new(empty); 2 * TAGGED_GROUP + 1];
            let mut used = 0;
            if i == 0 {
                slices[0] = IoSlice::new(head);
                used = 1;
            }
            for (j, tag) in tags[..k].iter().enumerate() {
                let r = span(i + j, i + j + 1);
                slices[used] = IoSlice::new(&source[r.start - base..r.end - base]);
                slices[used + 1] = IoSlice::new(tag);
                used += 2;
            }
            write_all_slices(inner, &mut slices[..used])?;
            i += k;
        }
        Ok(())
    }

    /// The inner writer, given back (tests read what was written).
    pub fn into_inner(self) -> W {
        self.inner
    }

    pub fn get_ref(&self) -> &W {
        &self.inner
    }

    pub fn get_mut(&mut self) -> &mut W {
        &mut self.inner
    }
}

/// Records of an integrity-only frame handed to the socket in one vectored write (up to
/// 1 MiB: a whole slice), so a 512 KiB request is one system call, not eight. The tags of
/// a group are computed first, the records where the caller keeps them; the socket then
/// reads head, records and tags from there. (The caller's bytes must not change until
/// `send` returns, as without a token; if they do, the receiver sees a bad tag and closes
/// the connection, never accepts other bytes.)
pub(super) const TAGGED_GROUP: usize = 16;

/// Records of an encrypted frame sealed into the writer's buffer and then written
/// together: one. Four (256 KiB, a 512 KiB request in two system calls instead of eight)
/// measured slower on a quiet host (BENCHMARKS.md, "Issue 26, authenticated TCP like for
/// like": encrypted 512 KiB 0.28-0.30x of the socket stream against main's 0.43-0.54x):
/// with one record a write, the receiver opens record n while the sender seals n + 1.
const SEALED_GROUP: usize = 1;

/// `write_all` over several slices (std's `write_all_vectored` is not stable).
fn write_all_slices(w: &mut impl Write, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match w.write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_all_parts(w: &mut impl Write, parts: &mut [&[u8]; 3]) -> io::Result<()> {
    let mut first = 0;
    while first < parts.len() {
        if parts[first].is_empty() {
            first += 1;
            continue;
        }
        // No allocation per frame: at most three slices, on the stack.
        let slices = [IoSlice::new(parts[0]), IoSlice::new(parts[1]), IoSlice::new(parts[2])];
        let mut n = match w.write_vectored(&slices[first..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        while n > 0 {
            let p = &mut parts[first];
            let k = n.min(p.len());
            *p = &p[k..];
            n -= k;
            if p.is_empty() {
                first += 1;
            }
        }
    }
    Ok(())
}
