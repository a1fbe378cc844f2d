//! The keys a store node holds, by their UTF-8 bytes, and its answer to a key list that
//! is still msgpack: a node's `batch_is_exist` of 100 keys decoded into 100 Python str
//! objects, hashed by Python and compared in its dict cost more than the rest of the
//! round trip's work on the node; here each key is read in place from the request's
//! bytes, hashed once (xxh3) and probed, and the 1/0 answers are written as the msgpack
//! array the client decodes.
//!
//! The node keeps this set beside its object table (the Python dict of key -> object,
//! pool/segment.py), adding and removing under the same lock; the set answers only
//! "is this key held".

use hashbrown::HashTable;
use xxhash_rust::xxh3::xxh3_64;

/// A msgpack key list this module cannot read (the caller answers the request with an error).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyListError {
    #[error("the key list is not a msgpack array (first byte {0:#04x})")]
    NotAnArray(u8),
    #[error("key {0} of the list is not a msgpack str (first byte {1:#04x})")]
    NotAStr(usize, u8),
    #[error("key {0} of the list is not UTF-8")]
    NotUtf8(usize),
    #[error("the key list ends inside an item ({0} bytes)")]
    Truncated(usize),
    #[error("{0} bytes follow the key list")]
    Trailing(usize),
}

/// A set of byte strings.
#[derive(Default)]
pub struct KeySet {
    keys: HashTable<Box<[u8]>>,
}

impl KeySet {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        self.keys.find(xxh3_64(key), |k| **k == *key).is_some()
    }

    /// True when the key was not held before.
    pub fn insert(&mut self, key: &[u8]) -> bool {
        let hash = xxh3_64(key);
        if self.keys.find(hash, |k| **k == *key).is_some() {
            return false;
        }
        self.keys.insert_unique(hash, key.into(), |k| xxh3_64(k));
        true
    }

    /// True when the key was held.
    pub fn remove(&mut self, key: &[u8]) -> bool {
        match self.keys.find_entry(xxh3_64(key), |k| **k == *key) {
            Ok(entry) => {
                entry.remove();
                true
            }
            Err(_) => false,
        }
    }

    pub fn clear(&mut self) {
        self.keys.clear();
    }

    /// `keys`, a msgpack array of str, answered as a msgpack array of 1 (held) / 0 (not),
    /// one a key in order: the bytes of the list `[1 if k in set else 0 for k in keys]`.
    pub fn flags_msgpack(&self, keys: &[u8]) -> Result<Vec<u8>, KeyListError> {
        let mut r = Reader { buf: keys, pos: 0 };
        let n = r.array_len()?;
        if n > keys.len() - r.pos {
            // (each key takes a byte at least: a header claiming more is cut short, and is
            // refused before anything is sized by it)
            return Err(KeyListError::Truncated(keys.len()));
        }
        let mut out = Vec::with_capacity(5 + n);
        write_array_len(&mut out, n);
        for i in 0..n {
            let key = r.str_bytes(i)?;
            std::str::from_utf8(key).map_err(|_| KeyListError::NotUtf8(i))?;
            out.push(u8::from(self.contains(key))); // (0 and 1 are msgpack positive fixints)
        }
        if r.pos != keys.len() {
            return Err(KeyListError::Trailing(keys.len() - r.pos));
        }
        Ok(out)
    }
}

/// Reads the two msgpack forms a key list is made of.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], KeyListError> {
        let end =
            self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or(KeyListError::Truncated(self.buf.len()))?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn be(&mut self, n: usize) -> Result<usize, KeyListError> {
        Ok(self.take(n)?.iter().fold(0usize, |acc, &b| (acc << 8) | usize::from(b)))
    }

    fn array_len(&mut self) -> Result<usize, KeyListError> {
        let tag = self.take(1)?[0];
        match tag {
            0x90..=0x9f => Ok(usize::from(tag & 0x0f)),
            0xdc => self.be(2),
            0xdd => self.be(4),
            _ => Err(KeyListError::NotAnArray(tag)),
        }
    }

    fn str_bytes(&mut self, i: usize) -> Result<&'a [u8], KeyListError> {
        let tag = self.take(1)?[0];
        let n = match tag {
            0xa0..=0xbf => usize::from(tag & 0x1f),
            0xd9 => self.be(1)?,
            0xda => self.be(2)?,
            0xdb => self.be(4)?,
            _ => return Err(KeyListError::NotAStr(i, tag)),
        };
        self.take(n)
    }
}

/// A msgpack array header for `n` items, in its shortest form (as msgspec writes it).
pub(crate) fn write_array_len(out: &mut Vec<u8>, n: usize) {
    if n < 16 {
        out.push(0x90 | n as u8);
    } else if let Ok(n) = u16::try_from(n) {
        out.push(0xdc);
        out.extend_from_slice(&n.to_be_bytes());
    } else {
        out.push(0xdd);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A msgpack array of str, written by hand in the form named (the reference encoder).
    fn list(keys: &[&str], wide: bool) -> Vec<u8> {
        let mut out = Vec::new();
        if wide {
            out.push(0xdd);
            out.extend_from_slice(&(keys.len() as u32).to_be_bytes());
        } else {
            write_array_len(&mut out, keys.len());
        }
        for k in keys {
            let b = k.as_bytes();
            if b.len() < 32 && !wide {
                out.push(0xa0 | b.len() as u8);
            } else if b.len() < 256 && !wide {
                out.extend_from_slice(&[0xd9, b.len() as u8]);
            } else if wide {
                out.push(0xdb);
                out.extend_from_slice(&(b.len() as u32).to_be_bytes());
            } else {
                out.push(0xda);
                out.extend_from_slice(&(b.len() as u16).to_be_bytes());
            }
            out.extend_from_slice(b);
        }
        out
    }

    fn flags_of(answer: &[u8]) -> Vec<u8> {
        let mut r = Reader { buf: answer, pos: 0 };
        let n = r.array_len().unwrap();
        let out = r.take(n).unwrap().to_vec();
        assert_eq!(r.pos, answer.len());
        out
    }

    #[test]
    fn flags_match_a_std_set_key_by_key() {
        let mut set = KeySet::new();
        let mut reference = std::collections::HashSet::new();
        let pool: Vec<String> = (0..400)
            .map(|i| if i % 7 == 0 { "é".repeat(i % 40 + 1) } else { format!("k{i}-{}", "x".repeat(i % 300)) })
            .collect();
        let mut seed = 7u64;
        let mut next = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as usize
        };
        for round in 0..50 {
            for _ in 0..40 {
                let k = &pool[next() % pool.len()];
                if next() % 3 == 0 {
                    assert_eq!(set.remove(k.as_bytes()), reference.remove(k));
                } else {
                    assert_eq!(set.insert(k.as_bytes()), reference.insert(k.clone()));
                }
            }
            assert_eq!(set.len(), reference.len());
            let asked: Vec<&str> =
                (0..next() % (20 + round * 10)).map(|_| pool[next() % pool.len()].as_str()).collect();
            let want: Vec<u8> = asked.iter().map(|k| u8::from(reference.contains(*k))).collect();
            for wide in [false, true] {
                let answer = set.flags_msgpack(&list(&asked, wide)).unwrap();
                assert_eq!(flags_of(&answer), want);
            }
        }
        set.clear();
        assert!(set.is_empty() && !set.contains(b"k1-x"));
    }

    #[test]
    fn long_lists_get_the_wide_array_header() {
        let keys: Vec<String> = (0..70_000).map(|i| format!("{i}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut set = KeySet::new();
        set.insert(b"5");
        let answer = set.flags_msgpack(&list(&refs, false)).unwrap();
        assert_eq!(&answer[..5], &[0xdd, 0, 1, 0x11, 0x70]);
        let flags = flags_of(&answer);
        assert_eq!(flags.len(), 70_000);
        assert_eq!(flags.iter().map(|&f| usize::from(f)).sum::<usize>(), 1);
        assert_eq!(flags[5], 1);
    }

    #[test]
    fn malformed_lists_are_refused_not_read_past() {
        let set = KeySet::new();
        assert_eq!(set.flags_msgpack(&[]), Err(KeyListError::Truncated(0)));
        assert_eq!(set.flags_msgpack(&[0xa1, b'k']), Err(KeyListError::NotAnArray(0xa1)));
        assert_eq!(set.flags_msgpack(&[0x92, 0xa1, b'k', 0x05]), Err(KeyListError::NotAStr(1, 0x05)));
        assert_eq!(set.flags_msgpack(&[0x91, 0xa3, b'k']), Err(KeyListError::Truncated(3)));
        assert_eq!(set.flags_msgpack(&[0x91, 0xdb, 0xff, 0xff, 0xff, 0xff]), Err(KeyListError::Truncated(6)));
        assert_eq!(set.flags_msgpack(&[0xdd, 0xff, 0xff, 0xff, 0xff]), Err(KeyListError::Truncated(5)));
        assert_eq!(set.flags_msgpack(&[0x91, 0xa1, 0xff]), Err(KeyListError::NotUtf8(0)));
        assert_eq!(set.flags_msgpack(&[0x91, 0xa1, b'k', 0xc0]), Err(KeyListError::Trailing(1)));
        assert_eq!(set.flags_msgpack(&[0x90]), Ok(vec![0x90]));
    }
}
