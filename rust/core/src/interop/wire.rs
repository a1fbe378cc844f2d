//! A msgpack cursor over one borrowed buffer: the value heads an event batch is made of,
//! and skipping whole values (fields we do not read, trailing fields of newer engines).
//!
//! Nothing here allocates or recurses: a string or a bin is returned as a slice of the
//! input, an array or a map as its length (its items follow), and [`Cursor::skip`]
//! walks nested values with a counter, so a deeply nested or huge declared value costs
//! at most the bytes it has.

/// Why a value could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The input ended inside a value (`at`: where the value started).
    Truncated { at: usize },
    /// 0xc1, the one byte msgpack never uses.
    Reserved { at: usize },
    /// A string that is not UTF-8 where one is decoded.
    Utf8 { at: usize },
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Truncated { at } => write!(f, "truncated (a value starting at byte {at} runs past the end)"),
            Fault::Reserved { at } => write!(f, "byte 0xc1 at {at} is not msgpack"),
            Fault::Utf8 { at } => write!(f, "the string at byte {at} is not UTF-8"),
        }
    }
}

/// One value's head. Strings, bins and exts carry their bytes; arrays and maps their
/// item count (the items follow in the input).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Head<'a> {
    Nil,
    Bool(bool),
    /// Any msgpack integer (i64 or u64 range).
    Int(i128),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(usize),
    Map(usize),
    Ext(&'a [u8]),
}

impl Head<'_> {
    /// The type's name as the error messages say it.
    pub fn kind(&self) -> &'static str {
        match self {
            Head::Nil => "nil",
            Head::Bool(_) => "bool",
            Head::Int(_) => "int",
            Head::Float(_) => "float",
            Head::Str(_) => "str",
            Head::Bin(_) => "bytes",
            Head::Array(_) => "array",
            Head::Map(_) => "map",
            Head::Ext(_) => "ext",
        }
    }
}

pub struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Cursor { buf, pos: 0 }
    }

    /// A cursor at `pos` of `buf` (a position an earlier cursor over `buf` returned).
    pub fn at(buf: &'a [u8], pos: usize) -> Self {
        Cursor { buf, pos: pos.min(buf.len()) }
    }

    /// Bytes left after the cursor.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub fn pos(&self) -> usize {
        self.pos
    }

    pub fn at_end(&self) -> bool {
        self.pos == self.buf.len()
    }

    /// The bytes from `start` to the cursor.
    pub fn since(&self, start: usize) -> &'a [u8] {
        &self.buf[start..self.pos]
    }

    #[inline]
    fn take(&mut self, n: usize, at: usize) -> Result<&'a [u8], Fault> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.buf.len() => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            _ => Err(Fault::Truncated { at }),
        }
    }

    #[inline]
    fn be<const N: usize>(&mut self, at: usize) -> Result<[u8; N], Fault> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, at)?);
        Ok(out)
    }

    #[inline]
    fn len_be(&mut self, bytes: usize, at: usize) -> Result<usize, Fault> {
        Ok(match bytes {
            1 => self.be::<1>(at)?[0] as usize,
            2 => u16::from_be_bytes(self.be::<2>(at)?) as usize,
            _ => u32::from_be_bytes(self.be::<4>(at)?) as usize,
        })
    }

    /// Reads the next value's head (and a string's, bin's or ext's bytes).
    #[inline]
    pub fn head(&mut self) -> Result<Head<'a>, Fault> {
        let at = self.pos;
        let b = self.take(1, at)?[0];
        Ok(match b {
            0x00..=0x7f => Head::Int(b as i128),
            0x80..=0x8f => Head::Map((b & 0x0f) as usize),
            0x90..=0x9f => Head::Array((b & 0x0f) as usize),
            0xa0..=0xbf => Head::Str(self.take((b & 0x1f) as usize, at)?),
            0xc0 => Head::Nil,
            0xc1 => return Err(Fault::Reserved { at }),
            0xc2 => Head::Bool(false),
            0xc3 => Head::Bool(true),
            0xc4..=0xc6 => {
                let n = self.len_be(1 << (b - 0xc4), at)?;
                Head::Bin(self.take(n, at)?)
            }
            0xc7..=0xc9 => {
                let n = self.len_be(1 << (b - 0xc7), at)?;
                Head::Ext(self.take(n + 1, at)?)
            }
            0xca => Head::Float(f32::from_be_bytes(self.be::<4>(at)?) as f64),
            0xcb => Head::Float(f64::from_be_bytes(self.be::<8>(at)?)),
            0xcc => Head::Int(self.be::<1>(at)?[0] as i128),
            0xcd => Head::Int(u16::from_be_bytes(self.be::<2>(at)?) as i128),
            0xce => Head::Int(u32::from_be_bytes(self.be::<4>(at)?) as i128),
            0xcf => Head::Int(u64::from_be_bytes(self.be::<8>(at)?) as i128),
            0xd0 => Head::Int(i8::from_be_bytes(self.be::<1>(at)?) as i128),
            0xd1 => Head::Int(i16::from_be_bytes(self.be::<2>(at)?) as i128),
            0xd2 => Head::Int(i32::from_be_bytes(self.be::<4>(at)?) as i128),
            0xd3 => Head::Int(i64::from_be_bytes(self.be::<8>(at)?) as i128),
            0xd4..=0xd8 => Head::Ext(self.take((1usize << (b - 0xd4)) + 1, at)?),
            0xd9..=0xdb => {
                let n = self.len_be(1 << (b - 0xd9), at)?;
                Head::Str(self.take(n, at)?)
            }
            0xdc | 0xdd => Head::Array(self.len_be(if b == 0xdc { 2 } else { 4 }, at)?),
            0xde | 0xdf => Head::Map(self.len_be(if b == 0xde { 2 } else { 4 }, at)?),
            0xe0..=0xff => Head::Int((b as i8) as i128),
        })
    }

    /// Reads `n` integers in `0..=u32::MAX` (the items of an array of token ids) into
    /// `out`. `false` at the first item that is something else, or is missing: the
    /// cursor and `out` are then left part way (the caller restarts from its own mark).
    /// The hot loop of ingestion: one byte test per item, no generic head.
    #[inline]
    pub fn u32_items(&mut self, n: usize, out: &mut Vec<u32>) -> bool {
        let buf = self.buf;
        let mut pos = self.pos;
        for _ in 0..n {
            let Some(&b) = buf.get(pos) else { return false };
            let (v, len) = match b {
                0x00..=0x7f => (b as u32, 1),
                0xcc if pos + 2 <= buf.len() => (buf[pos + 1] as u32, 2),
                0xcd if pos + 3 <= buf.len() => (u16::from_be_bytes([buf[pos + 1], buf[pos + 2]]) as u32, 3),
                0xce if pos + 5 <= buf.len() => {
                    (u32::from_be_bytes([buf[pos + 1], buf[pos + 2], buf[pos + 3], buf[pos + 4]]), 5)
                }
                _ => {
                    // Other encodings of an int in range (u64, signed): the general path.
                    self.pos = pos;
                    match self.head() {
                        Ok(Head::Int(v)) if (0..=u32::MAX as i128).contains(&v) => {
                            out.push(v as u32);
                            pos = self.pos;
                            continue;
                        }
                        _ => return false,
                    }
                }
            };
            out.push(v);
            pos += len;
        }
        self.pos = pos;
        true
    }

    /// The next value's head, with a string checked to be UTF-8.
    #[inline]
    pub fn head_utf8(&mut self) -> Result<Head<'a>, Fault> {
        let at = self.pos;
        let h = self.head()?;
        if let Head::Str(s) = h {
            if std::str::from_utf8(s).is_err() {
                return Err(Fault::Utf8 { at });
            }
        }
        Ok(h)
    }

    /// Skips one whole value (every item of an array or a map). `utf8`: strings inside
    /// must be UTF-8 (as for a value decoded into Python objects); otherwise only the
    /// structure is checked (as for a field that is skipped unread).
    pub fn skip(&mut self, utf8: bool) -> Result<(), Fault> {
        let mut left: u64 = 1;
        while left > 0 {
            left -= 1;
            let h = if utf8 { self.head_utf8()? } else { self.head()? };
            match h {
                Head::Array(n) => left += n as u64,
                Head::Map(n) => left += 2 * n as u64,
                _ => {}
            }
        }
        Ok(())
    }
}

/// `s` as `&str` (the caller took it from [`Cursor::head_utf8`] or checks the result).
pub fn utf8(s: &[u8]) -> Option<&str> {
    std::str::from_utf8(s).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_of_every_encoding() {
        let mut b = vec![0x05, 0xe0, 0xcc, 0xff, 0xd3];
        b.extend_from_slice(&(-7i64).to_be_bytes());
        b.extend_from_slice(&[0xcf]);
        b.extend_from_slice(&u64::MAX.to_be_bytes());
        b.extend_from_slice(&[0xa2, b'h', b'i', 0xc4, 1, 9, 0xd9, 1, b'x', 0xc0, 0xc3, 0x92, 0x81]);
        b.extend_from_slice(&[0xca, 0x3f, 0x80, 0, 0, 0xd4, 1, 2, 0xdc, 0, 3]);
        let mut c = Cursor::new(&b);
        let want = [
            Head::Int(5),
            Head::Int(-32),
            Head::Int(255),
            Head::Int(-7),
            Head::Int(u64::MAX as i128),
            Head::Str(b"hi"),
            Head::Bin(&[9]),
            Head::Str(b"x"),
            Head::Nil,
            Head::Bool(true),
            Head::Array(2),
            Head::Map(1),
            Head::Float(1.0),
            Head::Ext(&[1, 2]),
            Head::Array(3),
        ];
        for w in want {
            assert_eq!(c.head().unwrap(), w);
        }
        assert!(c.at_end());
    }

    #[test]
    fn skip_walks_nested_values_and_stops_at_truncation() {
        // [1, {"a": [2, 3]}, "x"] then 7
        let b = [0x93, 0x01, 0x81, 0xa1, b'a', 0x92, 0x02, 0x03, 0xa1, b'x', 0x07];
        let mut c = Cursor::new(&b);
        c.skip(true).unwrap();
        assert_eq!(c.head().unwrap(), Head::Int(7));
        for cut in 0..b.len() - 1 {
            let mut c = Cursor::new(&b[..cut]);
            assert!(matches!(c.skip(false), Err(Fault::Truncated { .. })), "cut {cut}");
        }
        // A huge declared array with nothing in it: an error after one byte, no allocation.
        let mut c = Cursor::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
        assert!(c.skip(false).is_err());
        assert_eq!(Cursor::new(&[0xc1]).head(), Err(Fault::Reserved { at: 0 }));
        assert_eq!(Cursor::new(&[0xa1, 0xff]).head_utf8(), Err(Fault::Utf8 { at: 0 }));
        assert!(Cursor::new(&[0x91, 0xa1, 0xff]).skip(false).is_ok());
        assert!(Cursor::new(&[0x91, 0xa1, 0xff]).skip(true).is_err());
        assert!(Cursor::new(&[0xc9, 0xff, 0xff, 0xff, 0xff]).head().is_err());
    }

    #[test]
    fn u32_items_take_every_encoding_and_stop_at_anything_else() {
        let mut b = vec![0x05, 0xcc, 200, 0xcd, 0xea, 0x60, 0xce, 0xee, 0x6b, 0x28, 0x00, 0xcf];
        b.extend_from_slice(&5u64.to_be_bytes());
        b.extend_from_slice(&[0xd0, 6]);
        let mut out = Vec::new();
        let mut c = Cursor::new(&b);
        assert!(c.u32_items(6, &mut out));
        assert_eq!(out, vec![5, 200, 60000, 4_000_000_000, 5, 6]);
        assert!(c.at_end());
        for bad in [&[0xff][..], &[0xc0], &[0xcf, 0, 0, 0, 1, 0, 0, 0, 0], &[0xce, 0, 0], &[0xcd, 1], &[0xcc], &[]] {
            let mut out = Vec::new();
            assert!(!Cursor::new(bad).u32_items(1, &mut out), "{bad:?}");
        }
    }
}
