//! The row-wise batch calls a front end makes with one buffer for many blocks
//! (`put_many_packed`, `get_many_into`) against the one-block calls as reference, and
//! the parallel-list check of `AddressedChunk::zip`.

use super::*;

const BB: usize = 128;

fn store(slots: usize) -> Store {
    Store::open(StoreConfig { block_bytes: BB, dram_bytes: slots * crate::mem::page_size(), ..Default::default() })
        .unwrap()
}

fn rows(keys: &[u128]) -> Vec<u8> {
    keys.iter().flat_map(|&k| (0..BB).map(move |i| (k as u8).wrapping_mul(7).wrapping_add(i as u8))).collect()
}

#[test]
fn packed_put_and_row_get_match_the_single_block_calls() {
    let s = store(8);
    let keys = [11u128, 12, 13];
    let data = rows(&keys);
    assert_eq!(s.put_many_packed(&keys, &data).unwrap(), vec![true, true, true]);
    assert_eq!(s.put_many_packed(&keys[..1], &data[..BB]).unwrap(), vec![false], "already stored");
    for (i, &k) in keys.iter().enumerate() {
        let mut one = vec![0u8; BB];
        assert!(s.get_into(k, &mut one, true).unwrap());
        assert_eq!(one, data[i * BB..(i + 1) * BB]);
    }
    // A missing key's row is left as it was.
    let mut out = vec![0xAAu8; 3 * BB];
    assert_eq!(s.get_many_into(&[13, 99, 11], &mut out, true).unwrap(), vec![true, false, true]);
    assert_eq!(out[..BB], data[2 * BB..]);
    assert!(out[BB..2 * BB].iter().all(|&b| b == 0xAA));
    assert_eq!(out[2 * BB..], data[..BB]);
}

#[test]
fn row_calls_refuse_a_buffer_of_the_wrong_size_before_touching_anything() {
    let s = store(4);
    let e = s.put_many_packed(&[1, 2], &[0u8; BB]).unwrap_err();
    assert_eq!(e.to_string(), format!("datas has {BB} bytes; 2 keys need {} (block_bytes each)", 2 * BB));
    assert!(!s.contains(1));
    let mut out = vec![0u8; BB + 1];
    let e = s.get_many_into(&[1], &mut out, true).unwrap_err();
    assert_eq!(e.to_string(), format!("out has {} bytes; 1 keys need {BB}", BB + 1));
    assert_eq!(s.get_many_into(&[], &mut [], true).unwrap(), Vec::<bool>::new());
}

#[test]
fn addressed_chunks_need_one_address_and_length_per_key() {
    let c = AddressedChunk::zip(&[5, 6], &[100, 200], &[1, 2]).unwrap();
    assert_eq!(c.iter().map(|c| (c.key, c.addr, c.len)).collect::<Vec<_>>(), vec![(5, 100, 1), (6, 200, 2)]);
    let e = AddressedChunk::zip(&[5, 6], &[100], &[1, 2]).unwrap_err();
    assert_eq!(e.to_string(), "2 keys, 1 addrs and 2 lens: give one address and length per key");
}

#[test]
fn padded_put_matches_a_put_of_the_value_padded_by_hand() {
    // one slot, so the padded put reuses the slot a full block of 0xFF left behind:
    // its tail must come out zeroed, not stale
    let s = store(1);
    assert!(s.put(1, &[0xFFu8; BB]).unwrap());
    assert!(s.remove(1).unwrap());
    let value: Vec<u8> = (0..37u8).collect();
    assert!(s.put_padded(2, &value).unwrap());
    assert!(!s.put_padded(2, &[9u8; 5]).unwrap(), "already stored: nothing changes");
    let mut by_hand = value.clone();
    by_hand.resize(BB, 0);
    let mut got = vec![0xAAu8; BB];
    assert!(s.get_into(2, &mut got, true).unwrap());
    assert_eq!(got, by_hand);
    // a value of exactly one block is stored as put stores it
    assert!(s.remove(2).unwrap());
    let full = rows(&[3]);
    assert!(s.put_padded(3, &full).unwrap());
    assert!(s.get_into(3, &mut got, true).unwrap());
    assert_eq!(got, full);
}

#[test]
fn padded_put_refuses_an_empty_or_oversized_value() {
    let s = store(2);
    assert!(matches!(s.put_padded(1, &[]), Err(StoreError::Invalid(_))));
    assert!(matches!(s.put_padded(1, &[0u8; BB + 1]), Err(StoreError::Invalid(_))));
    assert!(!s.contains(1));
}
