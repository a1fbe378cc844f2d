//! Batches of whole objects given as (object id, address, size), each cut into chunks of
//! `block_bytes` here rather than by the caller: chunk `j` of object `oid` is the block
//! keyed `oid | j`, at `addr` plus chunk `j`'s range of [`crate::object_layout`] (an empty
//! object is one empty chunk). The keys are the pool's object segment's
//! (python/mooncake_rs/pool/chunks.py); building the three chunk lists in Python cost a
//! local batch of 32 objects about a fifth of its Python time.

use super::batch_copy::AddressedChunk;
use super::error::StoreError;
use super::tiered::Store;
use crate::hash::BlockHash;
use crate::object_layout::{chunk_count, chunk_range};

/// One object of a batch: its id (its chunk numbers are or-ed into the low bits, which
/// must be zero) and the caller's memory it is copied from or into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressedObject {
    pub oid: BlockHash,
    pub addr: usize,
    pub size: usize,
}

impl AddressedObject {
    /// One object per id from three parallel lists (what a front end receives).
    pub fn zip(oids: &[BlockHash], addrs: &[usize], sizes: &[usize]) -> Result<Vec<AddressedObject>, StoreError> {
        if oids.len() != addrs.len() || oids.len() != sizes.len() {
            return Err(StoreError::Invalid(format!(
                "{} object ids, {} addrs and {} sizes: give one address and size per object",
                oids.len(),
                addrs.len(),
                sizes.len()
            )));
        }
        Ok(oids
            .iter()
            .zip(addrs)
            .zip(sizes)
            .map(|((&oid, &addr), &size)| AddressedObject { oid, addr, size })
            .collect())
    }

    /// How many chunks of `block_bytes` hold it (at least one).
    fn chunks(&self, block_bytes: usize) -> usize {
        chunk_count(self.size as u64, block_bytes as u64) as usize
    }
}

/// Every object's chunks in batch order, and how many each has.
fn chunks_of(objects: &[AddressedObject], block_bytes: usize) -> Result<(Vec<AddressedChunk>, Vec<usize>), StoreError> {
    let total: usize = objects.iter().map(|o| o.chunks(block_bytes)).sum();
    let mut chunks = Vec::with_capacity(total);
    let mut counts = Vec::with_capacity(objects.len());
    for o in objects {
        let n = o.chunks(block_bytes);
        let numbers = (n.next_power_of_two() - 1) as BlockHash;
        if o.oid & numbers != 0 {
            return Err(StoreError::Invalid(format!(
                "object id {:#x} has bits set where its {n} chunk numbers go: ids for objects must end in zero bits",
                o.oid
            )));
        }
        if o.addr.checked_add(o.size).is_none() {
            return Err(StoreError::Invalid(format!(
                "object at {:#x} of {} bytes wraps the address space",
                o.addr, o.size
            )));
        }
        for j in 0..n {
            let (at, len) = chunk_range(o.size as u64, block_bytes as u64, j as u64);
            chunks.push(AddressedChunk { key: o.oid | j as BlockHash, addr: o.addr + at as usize, len: len as usize });
        }
        counts.push(n);
    }
    Ok((chunks, counts))
}

/// Per object: whether all of its chunks' answers are true.
fn per_object(answers: &[bool], counts: &[usize]) -> Vec<bool> {
    let mut at = 0;
    counts
        .iter()
        .map(|&n| {
            let whole = answers[at..at + n].iter().all(|&b| b);
            at += n;
            whole
        })
        .collect()
}

impl Store {
    /// [`Store::put_from_addresses`] of every chunk of every object. Per object: true if
    /// every chunk was stored now. `Full` (nothing stored) when the batch does not fit.
    ///
    /// # Safety
    /// Each `[addr, addr+size)` is readable memory for the whole call.
    pub unsafe fn put_objects_from(&self, objects: &[AddressedObject]) -> Result<Vec<bool>, StoreError> {
        let (chunks, counts) = chunks_of(objects, self.block_bytes())?;
        // SAFETY: each chunk lies inside its object's range (the caller's contract).
        let stored = unsafe { self.put_from_addresses(&chunks) }?;
        Ok(per_object(&stored, &counts))
    }

    /// [`Store::get_into_addresses`] of every chunk of every object. Per object: true if
    /// every chunk was found and copied (a chunk missing leaves its range untouched, the
    /// object's other chunks are copied).
    ///
    /// # Safety
    /// Each `[addr, addr+size)` is writable memory for the whole call, no two overlap.
    pub unsafe fn get_objects_into(&self, objects: &[AddressedObject], promote: bool) -> Result<Vec<bool>, StoreError> {
        let (chunks, counts) = chunks_of(objects, self.block_bytes())?;
        // SAFETY: each chunk lies inside its object's range (the caller's contract).
        let found = unsafe { self.get_into_addresses(&chunks, promote) }?;
        Ok(per_object(&found, &counts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreConfig;

    const BB: usize = 4096;

    fn store(slots: usize) -> Store {
        Store::open(StoreConfig { block_bytes: BB, dram_bytes: slots * BB, ..Default::default() }).unwrap()
    }

    /// The reference: the chunk list written out by hand, as the pool's Python built it,
    /// stored with `put_from_addresses` and read with `get_into_addresses`. Both stores
    /// then hold the same bytes under the same keys, and the object calls read back what
    /// was put, a missing object reported and its memory untouched.
    #[test]
    fn objects_cut_into_the_same_chunks_as_a_hand_built_list() {
        let sizes = [0usize, 1, BB - 1, BB, BB + 1, 7 * BB, 9 * BB - 5];
        let total: usize = sizes.iter().sum();
        let src: Vec<u8> = (0..total).map(|i| (i * 7 + i / 251) as u8).collect();
        let base = src.as_ptr() as usize;
        let mut objects = Vec::new();
        let mut at = 0;
        for (i, &size) in sizes.iter().enumerate() {
            // a zero-size object still has a valid (non-null) address
            let addr = if size == 0 { base } else { base + at };
            objects.push(AddressedObject { oid: ((i as u128 + 1) << 70) | ((i as u128) << 24), addr, size });
            at += size;
        }
        let mut by_hand = Vec::new();
        for o in &objects {
            let n = o.size.div_ceil(BB).max(1);
            for j in 0..n {
                by_hand.push(AddressedChunk {
                    key: o.oid | j as u128,
                    addr: o.addr + j * BB,
                    len: BB.min(o.size - j * BB),
                });
            }
        }
        assert_eq!(
            chunks_of(&objects, BB).unwrap().0.iter().map(|c| (c.key, c.addr, c.len)).collect::<Vec<_>>(),
            by_hand.iter().map(|c| (c.key, c.addr, c.len)).collect::<Vec<_>>()
        );
        let (fast, slow) = (store(64), store(64));
        // SAFETY: every range lies inside `src`.
        assert_eq!(unsafe { fast.put_objects_from(&objects) }.unwrap(), vec![true; sizes.len()]);
        assert!(unsafe { slow.put_from_addresses(&by_hand) }.unwrap().iter().all(|&b| b));
        for c in &by_hand {
            assert_eq!(
                fast.get(c.key, true).unwrap().unwrap().bytes(),
                slow.get(c.key, true).unwrap().unwrap().bytes()
            );
        }
        // read back into a fresh buffer, plus one object never stored
        let mut got = vec![0x5Au8; total + 16];
        let g = got.as_mut_ptr() as usize;
        let mut outs: Vec<AddressedObject> =
            objects.iter().map(|o| AddressedObject { addr: o.addr - base + g, ..*o }).collect();
        outs.push(AddressedObject { oid: 99 << 80, addr: g + total, size: 16 });
        // SAFETY: every range lies inside `got`, disjoint (the empty object's is empty).
        let found = unsafe { fast.get_objects_into(&outs, true) }.unwrap();
        assert_eq!(found, [vec![true; sizes.len()], vec![false]].concat());
        assert_eq!(&got[..total], &src[..]);
        assert_eq!(&got[total..], &[0x5Au8; 16]);
        // stored already: false for each object
        assert_eq!(unsafe { fast.put_objects_from(&objects[1..3]) }.unwrap(), vec![false, false]);
        fast.check_integrity().unwrap();
    }

    #[test]
    fn ids_with_chunk_bits_set_and_uneven_lists_are_refused() {
        let s = store(8);
        let buf = vec![1u8; 3 * BB];
        let p = buf.as_ptr() as usize;
        let three = [AddressedObject { oid: 1 << 64 | 2, addr: p, size: 3 * BB }];
        assert!(matches!(unsafe { s.put_objects_from(&three) }, Err(StoreError::Invalid(_))));
        let wrap = [AddressedObject { oid: 1 << 64, addr: usize::MAX - 10, size: 100 }];
        assert!(matches!(unsafe { s.get_objects_into(&wrap, true) }, Err(StoreError::Invalid(_))));
        assert!(matches!(AddressedObject::zip(&[1 << 64], &[p, p], &[1]), Err(StoreError::Invalid(_))));
        assert_eq!(s.stats().blocks_dram, 0);
    }
}
