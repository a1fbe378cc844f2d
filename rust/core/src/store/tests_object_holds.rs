//! Whole-object reserve / commit / lease (object_holds.rs) against the per-chunk calls
//! as reference: the same blocks stored with the same bytes, the same slots leased, and
//! nothing kept of an object that did not fit or could not be committed whole.

use super::*;
use crate::hash::BlockHash;

const BB: usize = 128;

fn store(slots: usize) -> Store {
    Store::open(StoreConfig { block_bytes: BB, dram_bytes: slots * crate::mem::page_size(), ..Default::default() })
        .unwrap()
}

fn chunk_bytes(oid: BlockHash, j: usize) -> Vec<u8> {
    (0..BB).map(|i| (oid >> 16) as u8 ^ (j as u8).wrapping_mul(31) ^ i as u8).collect()
}

#[test]
fn a_committed_object_is_what_per_chunk_reserve_and_commit_store() {
    let (s, reference) = (store(16), store(16));
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for round in 0..40u128 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let n = 1 + (rng % 4) as usize;
        let oid = (round + 1) << 24;
        let mut obj = s.reserve_object(oid, n).unwrap();
        assert_eq!((obj.oid(), obj.len()), (oid, n));
        let offsets = obj.offsets();
        for j in 0..n {
            obj.chunk_mut(j).unwrap().copy_from_slice(&chunk_bytes(oid, j));
            // the reference: one reservation per chunk key
            let mut r = reference.reserve(oid | j as BlockHash).unwrap();
            r.bytes_mut().copy_from_slice(&chunk_bytes(oid, j));
            assert!(reference.commit(r, 0));
        }
        assert!(obj.chunk_mut(n).is_none());
        assert!(s.commit_object(obj, false));
        for (j, &offset) in offsets.iter().enumerate() {
            let key = oid | j as BlockHash;
            let (mut got, mut want) = (vec![0u8; BB], vec![0u8; BB]);
            assert!(s.get_into(key, &mut got, true).unwrap());
            assert!(reference.get_into(key, &mut want, true).unwrap());
            assert_eq!(got, want, "round {round} chunk {j}");
            assert_eq!(s.slot_offset(key), Some(offset as usize), "written where the reservation said");
        }
        // the lease of the whole object holds exactly the slots a per-chunk lookup finds
        let leases = s.lease_object(oid, n, true).unwrap().expect("every chunk is there");
        let keys: Vec<BlockHash> = (0..n).map(|j| oid | j as BlockHash).collect();
        let run = s.lookup_prefix(&keys, true).unwrap();
        assert_eq!(
            leases.iter().map(|l| l.offset()).collect::<Vec<_>>(),
            run.iter().map(|l| l.offset()).collect::<Vec<_>>()
        );
    }
    // the store evicted older objects whole or in part; whatever it holds is right
    assert!(s.stats().blocks_dram <= 16);
}

#[test]
fn an_object_that_does_not_fit_keeps_no_slot() {
    let s = store(4);
    // two blocks pinned: two slots left for anything else
    for k in [1u128, 2] {
        assert!(s.put(k, &[7u8; BB]).unwrap());
        s.pin(k).unwrap();
    }
    let e = s.reserve_object(1 << 24, 3).unwrap_err();
    assert!(matches!(e, StoreError::Full { .. }), "{e}");
    // the first two chunks' slots were given back: an object of two fits now
    let obj = s.reserve_object(2 << 24, 2).unwrap();
    assert_eq!(obj.len(), 2);
    assert!(!s.contains(1 << 24) && !s.contains((1 << 24) | 1));
}

#[test]
fn an_aborted_object_gives_its_slots_back_in_order() {
    let s = store(8);
    let a = s.reserve_object(1 << 24, 3).unwrap();
    let first = a.offsets();
    drop(a);
    // freed last chunk first: the next object gets the same slots in the same order
    let b = s.reserve_object(2 << 24, 3).unwrap();
    assert_eq!(b.offsets(), first);
    assert!(first.windows(2).all(|w| w[0] < w[1]), "{first:?}");
    assert!(!s.contains(1 << 24));
}

#[test]
fn a_pinned_commit_pins_every_chunk() {
    let s = store(4);
    let obj = s.reserve_object(1 << 24, 2).unwrap();
    assert!(s.commit_object(obj, true));
    for j in 0..2u128 {
        let e = s.remove((1 << 24) | j).unwrap_err();
        assert!(e.to_string().contains("pinned"), "{e}");
    }
    // pinned: never evicted by the objects that follow
    for i in 2..6u128 {
        if let Ok(o) = s.reserve_object(i << 24, 1) {
            assert!(s.commit_object(o, false));
        }
    }
    assert!(s.contains(1 << 24) && s.contains((1 << 24) | 1));
}

#[test]
fn a_commit_that_cannot_publish_every_chunk_keeps_nothing_of_its_own() {
    let s = store(8);
    let oid = 5u128 << 24;
    let obj = s.reserve_object(oid, 3).unwrap();
    // another writer stored chunk 1's key meanwhile (ids are random, so only a collision)
    assert!(s.put(oid | 1, &[9u8; BB]).unwrap());
    assert!(!s.commit_object(obj, true));
    assert!(!s.contains(oid) && !s.contains(oid | 2), "the chunks this commit published are taken out");
    let mut other = vec![0u8; BB];
    assert!(s.get_into(oid | 1, &mut other, true).unwrap(), "the other writer's block stays");
    assert_eq!(other, vec![9u8; BB]);
    s.remove(oid | 1).unwrap();
    assert_eq!(s.stats().pinned, 0, "no pin left behind");
}

#[test]
fn a_lease_of_an_object_missing_a_chunk_is_none() {
    let s = store(8);
    let oid = 3u128 << 24;
    let obj = s.reserve_object(oid, 3).unwrap();
    assert!(s.commit_object(obj, false));
    s.remove(oid | 2).unwrap();
    assert!(s.lease_object(oid, 3, true).unwrap().is_none());
    assert_eq!(s.lease_object(oid, 2, true).unwrap().map(|l| l.len()), Some(2));
}

#[test]
fn object_ids_must_leave_room_for_their_chunk_numbers() {
    let s = store(4);
    let e = s.reserve_object((1 << 24) | 2, 3).unwrap_err();
    assert!(e.to_string().contains("chunk numbers"), "{e}");
    let e = s.reserve_object(1 << 24, 0).unwrap_err();
    assert!(e.to_string().contains("at least one chunk"), "{e}");
    assert!(s.lease_object(3, 2, true).is_err());
    assert!(!s.contains(1 << 24));
}
