//! A msgpack array of unsigned integers (an event's `token_ids`) decoded to `u32`s.
//!
//! Only what that field can hold is accepted: an array header (fixarray, array16,
//! array32) followed by integers in `0..=u32::MAX` in any msgpack integer encoding.
//! The input must be exactly one such array (the bytes a msgspec `Raw` field captured).

use crate::error::{Categorized, ErrorCategory};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("token_ids must be a msgpack array, got type byte 0x{0:02x}")]
    NotAnArray(u8),
    #[error("token_ids is truncated: {needed} more bytes needed at byte {at}")]
    Truncated { at: usize, needed: usize },
    #[error("token_ids[{index}] is not an integer (type byte 0x{byte:02x})")]
    NotAnInteger { index: usize, byte: u8 },
    #[error("token_ids[{index}] = {value} is outside 0..2^32-1")]
    OutOfRange { index: usize, value: i128 },
    #[error("{0} bytes follow the token_ids array")]
    TrailingBytes(usize),
}

impl Categorized for WireError {
    fn category(&self) -> ErrorCategory {
        ErrorCategory::InvalidArgument
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(WireError::Truncated { at: self.pos, needed: self.pos + n - self.buf.len() }),
        }
    }

    fn byte(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
}

/// Decodes `buf` (one msgpack array of integers) into `out` (cleared first).
pub fn decode_u32_array(buf: &[u8], out: &mut Vec<u32>) -> Result<(), WireError> {
    out.clear();
    let mut r = Reader { buf, pos: 0 };
    let tag = r.byte()?;
    let len = match tag {
        0x90..=0x9f => (tag & 0x0f) as usize,
        0xdc => u16::from_be_bytes(r.be::<2>()?) as usize,
        0xdd => u32::from_be_bytes(r.be::<4>()?) as usize,
        other => return Err(WireError::NotAnArray(other)),
    };
    // Every element takes at least one byte: bound the allocation by the input.
    out.reserve(len.min(buf.len()));
    for index in 0..len {
        let b = r.byte()?;
        let value: i128 = match b {
            0x00..=0x7f => b as i128,
            0xcc => r.byte()? as i128,
            0xcd => u16::from_be_bytes(r.be::<2>()?) as i128,
            0xce => u32::from_be_bytes(r.be::<4>()?) as i128,
            0xcf => u64::from_be_bytes(r.be::<8>()?) as i128,
            0xd0 => i8::from_be_bytes(r.be::<1>()?) as i128,
            0xd1 => i16::from_be_bytes(r.be::<2>()?) as i128,
            0xd2 => i32::from_be_bytes(r.be::<4>()?) as i128,
            0xd3 => i64::from_be_bytes(r.be::<8>()?) as i128,
            0xe0..=0xff => (b as i8) as i128,
            byte => return Err(WireError::NotAnInteger { index, byte }),
        };
        if !(0..=u32::MAX as i128).contains(&value) {
            return Err(WireError::OutOfRange { index, value });
        }
        out.push(value as u32);
    }
    if r.pos != buf.len() {
        return Err(WireError::TrailingBytes(buf.len() - r.pos));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dec(b: &[u8]) -> Result<Vec<u32>, WireError> {
        let mut v = Vec::new();
        decode_u32_array(b, &mut v).map(|_| v)
    }

    #[test]
    fn every_integer_encoding() {
        // [1, 200, 60000, 4000000000, 5 as u64, 6 as i8, 7 as i16, 8 as i32, 9 as i64]
        let mut b = vec![0x99, 0x01, 0xcc, 200, 0xcd, 0xea, 0x60, 0xce, 0xee, 0x6b, 0x28, 0x00];
        b.extend_from_slice(&[0xcf, 0, 0, 0, 0, 0, 0, 0, 5, 0xd0, 6, 0xd1, 0, 7, 0xd2, 0, 0, 0, 8]);
        b.extend_from_slice(&[0xd3, 0, 0, 0, 0, 0, 0, 0, 9]);
        assert_eq!(dec(&b).unwrap(), vec![1, 200, 60000, 4_000_000_000, 5, 6, 7, 8, 9]);
        assert_eq!(dec(&[0x90]).unwrap(), Vec::<u32>::new());
        let mut long = vec![0xdc, 0x00, 0x20];
        long.extend(std::iter::repeat_n(0x07, 32));
        assert_eq!(dec(&long).unwrap(), vec![7; 32]);
        let mut long32 = vec![0xdd, 0, 0, 0, 2, 1, 2];
        assert_eq!(dec(&long32).unwrap(), vec![1, 2]);
        long32.push(3);
        assert_eq!(dec(&long32), Err(WireError::TrailingBytes(1)));
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        assert_eq!(dec(&[]), Err(WireError::Truncated { at: 0, needed: 1 }));
        assert_eq!(dec(&[0x81]), Err(WireError::NotAnArray(0x81)));
        assert_eq!(dec(&[0x92, 0x01]), Err(WireError::Truncated { at: 2, needed: 1 }));
        assert_eq!(dec(&[0x91, 0xce, 0x00]), Err(WireError::Truncated { at: 2, needed: 3 }));
        assert_eq!(dec(&[0x91, 0xff]), Err(WireError::OutOfRange { index: 0, value: -1 }));
        assert!(matches!(dec(&[0x91, 0xcf, 0, 0, 0, 1, 0, 0, 0, 0]), Err(WireError::OutOfRange { .. })));
        assert_eq!(dec(&[0x91, 0xc0]), Err(WireError::NotAnInteger { index: 0, byte: 0xc0 }));
        // A huge declared length with no data: bounded allocation, then Truncated.
        assert!(matches!(dec(&[0xdd, 0xff, 0xff, 0xff, 0xff]), Err(WireError::Truncated { .. })));
        for n in 0..64u8 {
            let b: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37).wrapping_add(n)).collect();
            let _ = dec(&b);
        }
    }
}
