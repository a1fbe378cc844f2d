//! Token ids read in place from a caller's integer array (a numpy/torch buffer of any
//! integer width): its element type from the struct-module format, a range check that
//! every value is a u32 token id, and the ids as `&[u32]` (borrowed when the array
//! already is one, converted otherwise). The front end only exports the buffer.

use std::fmt;

use crate::{Categorized, ErrorCategory};

/// An array's integer element type: signedness and width in bytes (1, 2, 4 or 8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntKind {
    Signed(usize),
    Unsigned(usize),
}

impl IntKind {
    /// Parses a struct-module format for one integer element in native or
    /// little-endian byte order; `None` for anything else (floats, big-endian,
    /// records). Big-endian hosts are not supported: hashes are defined over
    /// little-endian tokens.
    pub fn parse(format: &str, itemsize: usize) -> Option<IntKind> {
        if cfg!(target_endian = "big") || !matches!(itemsize, 1 | 2 | 4 | 8) {
            return None;
        }
        let code = match format.as_bytes() {
            [c] | [b'@' | b'=' | b'<', c] => *c,
            _ => return None,
        };
        match code {
            b'b' | b'h' | b'i' | b'l' | b'q' | b'n' => Some(IntKind::Signed(itemsize)),
            b'B' | b'H' | b'I' | b'L' | b'Q' | b'N' => Some(IntKind::Unsigned(itemsize)),
            _ => None,
        }
    }

    pub fn size(self) -> usize {
        match self {
            IntKind::Signed(s) | IntKind::Unsigned(s) => s,
        }
    }
}

/// A token that is not a u32 id: its position and value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenOutOfRange {
    pub index: usize,
    pub value: i128,
}

impl fmt::Display for TokenOutOfRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "token at position {} is {}, outside 0..2^32-1", self.index, self.value)
    }
}

impl std::error::Error for TokenOutOfRange {}

impl Categorized for TokenOutOfRange {
    fn category(&self) -> ErrorCategory {
        ErrorCategory::InvalidArgument
    }
}

/// The bytes of an integer array (little-endian elements of `kind`; a trailing partial
/// element is ignored), read with unaligned loads where needed: a sliced array need
/// not be aligned.
#[derive(Clone, Copy, Debug)]
pub struct IntArray<'a> {
    bytes: &'a [u8],
    kind: IntKind,
}

impl<'a> IntArray<'a> {
    pub fn new(bytes: &'a [u8], kind: IntKind) -> Self {
        IntArray { bytes, kind }
    }

    pub fn len(&self) -> usize {
        self.bytes.len() / self.kind.size()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` widened to i128.
    fn get(&self, i: usize) -> i128 {
        let size = self.kind.size();
        let mut raw = [0u8; 8];
        raw[..size].copy_from_slice(&self.bytes[i * size..(i + 1) * size]);
        let unsigned = u64::from_le_bytes(raw);
        match self.kind {
            IntKind::Unsigned(_) => unsigned as i128,
            IntKind::Signed(s) => {
                let shift = 64 - 8 * (s as u32);
                (((unsigned << shift) as i64) >> shift) as i128
            }
        }
    }

    /// The elements as a typed slice, when the bytes are aligned for `T` and `T` has
    /// the element size.
    fn typed<T: Copy>(&self) -> Option<&'a [T]> {
        if self.kind.size() != std::mem::size_of::<T>()
            || !(self.bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
        {
            return None;
        }
        // SAFETY: the bytes hold len() elements of T's size at an address aligned for T,
        // T is one of the integer types (every bit pattern valid), and the slice borrows
        // the same memory for the same lifetime.
        Some(unsafe { std::slice::from_raw_parts(self.bytes.as_ptr().cast::<T>(), self.len()) })
    }

    /// The first element that is not a u32 token id, if any.
    pub fn first_out_of_range(&self) -> Option<TokenOutOfRange> {
        let find = |ok: &dyn Fn(i128) -> bool| {
            (0..self.len())
                .map(|i| (i, self.get(i)))
                .find(|&(_, v)| !ok(v))
                .map(|(index, value)| TokenOutOfRange { index, value })
        };
        let in_range = |v: i128| (0..=u32::MAX as i128).contains(&v);
        match self.kind {
            IntKind::Unsigned(1..=4) => None, // every value fits
            // A branch-free (vectorised) OR of sign or high bits first; the slow path only
            // finds the position of a bad value.
            IntKind::Signed(4) => match self.typed::<i32>() {
                Some(s) if s.iter().fold(0i32, |acc, &x| acc | x) >= 0 => None,
                _ => find(&|v| v >= 0),
            },
            IntKind::Signed(8) => match self.typed::<i64>() {
                Some(s) if s.iter().fold(0u64, |acc, &x| acc | x as u64) <= u32::MAX as u64 => None,
                _ => find(&in_range),
            },
            IntKind::Unsigned(8) => match self.typed::<u64>() {
                Some(s) if s.iter().fold(0u64, |acc, &x| acc | x) <= u32::MAX as u64 => None,
                _ => find(&in_range),
            },
            _ => find(&in_range),
        }
    }

    /// Checks every element is a u32 token id.
    pub fn check_tokens(&self) -> Result<(), TokenOutOfRange> {
        self.first_out_of_range().map_or(Ok(()), Err)
    }

    /// The elements as u32 (call after [`check_tokens`](Self::check_tokens): values are
    /// truncated): in place when the array holds aligned 4-byte integers, converted
    /// otherwise.
    pub fn with_u32<R>(&self, f: impl FnOnce(&[u32]) -> R) -> R {
        if let Some(s) = self.typed::<u32>() {
            return f(s); // i32 and u32 arrays: checked i32 values have the u32 bit pattern
        }
        let v: Vec<u32> = if let Some(s) = self.typed::<i64>() {
            s.iter().map(|&x| x as u32).collect()
        } else if let Some(s) = self.typed::<u64>() {
            s.iter().map(|&x| x as u32).collect()
        } else {
            (0..self.len()).map(|i| self.get(i) as u32).collect()
        };
        f(&v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le_bytes(values: &[i128], size: usize) -> Vec<u8> {
        values.iter().flat_map(|&v| (v as u64).to_le_bytes()[..size].to_vec()).collect()
    }

    #[test]
    fn parse_accepts_native_and_little_endian_integers_only() {
        assert_eq!(IntKind::parse("i", 4), Some(IntKind::Signed(4)));
        assert_eq!(IntKind::parse("<q", 8), Some(IntKind::Signed(8)));
        assert_eq!(IntKind::parse("=H", 2), Some(IntKind::Unsigned(2)));
        assert_eq!(IntKind::parse("@B", 1), Some(IntKind::Unsigned(1)));
        for bad in ["f", "d", ">i", "!i", "ii", "", "2i"] {
            assert_eq!(IntKind::parse(bad, 4), None, "{bad}");
        }
        assert_eq!(IntKind::parse("i", 3), None);
    }

    /// Every width and signedness, aligned and not, against a simple reference.
    #[test]
    fn range_check_and_conversion_match_a_reference() {
        let cases: [(IntKind, Vec<i128>); 6] = [
            (IntKind::Signed(4), vec![0, 1, 7, i32::MAX as i128]),
            (IntKind::Signed(4), vec![3, -1, 5]),
            (IntKind::Signed(8), vec![1, u32::MAX as i128, 2]),
            (IntKind::Signed(8), vec![1, u32::MAX as i128 + 1, -4]),
            (IntKind::Unsigned(8), vec![9, 1 << 40]),
            (IntKind::Signed(2), vec![1, -2, 300]),
        ];
        for (kind, values) in cases {
            let raw = le_bytes(&values, kind.size());
            for shift in [0, 1] {
                let mut buf = vec![0u8; shift];
                buf.extend_from_slice(&raw);
                let a = IntArray::new(&buf[shift..], kind);
                assert_eq!(a.len(), values.len());
                let expect = values.iter().position(|&v| !(0..=u32::MAX as i128).contains(&v));
                let got = a.first_out_of_range();
                assert_eq!(got.map(|e| e.index), expect, "{kind:?} {values:?}");
                if let Some(e) = got {
                    assert_eq!(e.value, values[e.index]);
                    assert_eq!(
                        a.check_tokens().unwrap_err().to_string(),
                        format!("token at position {} is {}, outside 0..2^32-1", e.index, e.value)
                    );
                } else {
                    let ids = a.with_u32(|s| s.to_vec());
                    assert_eq!(ids, values.iter().map(|&v| v as u32).collect::<Vec<_>>());
                }
            }
        }
    }

    #[test]
    fn small_unsigned_always_fit_and_partial_elements_are_ignored() {
        let a = IntArray::new(&[1, 0, 255, 255, 9], IntKind::Unsigned(2));
        assert_eq!(a.len(), 2);
        assert!(a.check_tokens().is_ok());
        assert_eq!(a.with_u32(|s| s.to_vec()), vec![1, 65535]);
        assert!(IntArray::new(&[], IntKind::Signed(8)).is_empty());
    }
}
