//! Block keys (128-bit block hashes) in their buffer form: 16 little-endian bytes each.
//! Which array shapes hold keys in that form, and the bytes decoded; what a front end
//! calls after exporting a caller's buffer.

use crate::args::ArgumentError;
use crate::BlockHash;

/// Bytes of one key in a key buffer.
pub const KEY_BYTES: usize = 16;

/// Whether an array of `shape` with `itemsize`-byte items holds raw 16-byte keys: a
/// flat byte range, 1-D 16-byte items, or 2-D rows of 16 bytes. `Ok(false)`: a 1-D
/// array of other items (an int64 array), one key per item's value. Any other shape is
/// an error saying what to pass.
pub fn holds_raw_keys(shape: &[usize], itemsize: usize) -> Result<bool, ArgumentError> {
    match shape.len() {
        0 | 1 => Ok(itemsize == 1 || itemsize == KEY_BYTES),
        2 if shape[1].checked_mul(itemsize) == Some(KEY_BYTES) => Ok(true),
        2 => Err(ArgumentError(format!(
            "a 2-D key buffer needs rows of 16 bytes (e.g. shape (n, 16) uint8 or (n, 2) uint64), got shape {shape:?} of {itemsize}-byte items"
        ))),
        n => Err(ArgumentError(format!("a key buffer must be 1-D or 2-D (rows of 16 bytes), got {n}-D"))),
    }
}

/// Raw little-endian 16-byte keys → block hashes; the length must be a whole number
/// of keys.
pub fn keys_from_le_bytes(bytes: &[u8]) -> Result<Vec<BlockHash>, ArgumentError> {
    if !bytes.len().is_multiple_of(KEY_BYTES) {
        return Err(ArgumentError(format!(
            "a key buffer of {} bytes is not a whole number of 16-byte keys",
            bytes.len()
        )));
    }
    Ok(bytes.chunks_exact(KEY_BYTES).map(|c| u128::from_le_bytes(c.try_into().unwrap_or([0; KEY_BYTES]))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_little_endian_keys_and_refuses_a_partial_one() {
        let keys: [u128; 3] = [0, 1, u128::MAX - 5];
        let bytes: Vec<u8> = keys.iter().flat_map(|k| k.to_le_bytes()).collect();
        assert_eq!(keys_from_le_bytes(&bytes).unwrap(), keys);
        assert!(keys_from_le_bytes(&[]).unwrap().is_empty());
        let e = keys_from_le_bytes(&bytes[..20]).unwrap_err();
        assert_eq!(e.0, "a key buffer of 20 bytes is not a whole number of 16-byte keys");
    }

    #[test]
    fn raw_key_shapes() {
        assert_eq!(holds_raw_keys(&[48], 1), Ok(true));
        assert_eq!(holds_raw_keys(&[3], 16), Ok(true));
        assert_eq!(holds_raw_keys(&[], 16), Ok(true));
        assert_eq!(holds_raw_keys(&[3], 8), Ok(false), "an int64 array: one key per value");
        for (shape, item) in [([3, 16], 1), ([3, 2], 8), ([3, 4], 4)] {
            assert_eq!(holds_raw_keys(&shape, item), Ok(true));
        }
        assert!(holds_raw_keys(&[3, 3], 4).unwrap_err().0.contains("rows of 16 bytes"));
        assert!(holds_raw_keys(&[1, 2, 16], 1).unwrap_err().0.ends_with("got 3-D"));
    }
}
