//! Store: the batch read API (`lookup_prefix`, `commit_leased`), and the defences of
//! issue 17: remove() final across threads and durable across a reopen, one owner per
//! SSD tier file, a damaged file header named as such, an empty ssd_path refused, and
//! remove of a pinned block refused.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use super::*;

const BB: usize = 256;

fn block(key: u128) -> Vec<u8> {
    (0..BB).map(|i| (key as u8).wrapping_mul(29).wrapping_add(i as u8)).collect()
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mooncake_store_final_{tag}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn tiered(dir: &Path, slots: usize, ssd_slots: u64, queue: usize) -> Result<Store, StoreError> {
    Store::open(StoreConfig {
        block_bytes: BB,
        dram_bytes: slots * crate::mem::page_size(),
        ssd_path: Some(dir.to_path_buf()),
        ssd_bytes: 4096 + ssd_slots * 4096,
        demotion_queue: queue,
        ..Default::default()
    })
}

fn dram(slots: usize) -> Store {
    Store::open(StoreConfig { block_bytes: BB, dram_bytes: slots * crate::mem::page_size(), ..Default::default() })
        .unwrap()
}

#[test]
fn lookup_prefix_is_the_leading_run_leased() {
    let s = dram(8);
    for k in [1u128, 2, 3, 5] {
        s.put(k, &block(k)).unwrap();
    }
    // reference: the longest leading run of keys that contains() says are held
    let keys = [1u128, 2, 3, 4, 5];
    let want = keys.iter().take_while(|k| s.contains(**k)).count();
    let got = s.lookup_prefix(&keys, true).unwrap();
    assert_eq!(got.len(), want);
    for (k, l) in keys.iter().zip(&got) {
        assert_eq!(l.bytes(), &block(*k)[..]);
        assert_eq!(Some(l.offset()), s.slot_offset(*k));
    }
    assert!(s.lookup_prefix(&[9, 1], true).unwrap().is_empty());
    assert!(s.lookup_prefix(&[], true).unwrap().is_empty());
    // leased: a full store cannot evict them
    // leased: putting many more blocks evicts others, never them
    for k in 10..30u128 {
        s.put(k, &block(k)).unwrap();
    }
    assert!(s.contains(1) && s.contains(2) && s.contains(3) && !s.contains(5));
    drop(got);
    s.check_integrity().unwrap();
}

#[test]
fn a_cloned_lease_holds_the_slot_until_the_last_clone_goes() {
    let s = dram(2);
    s.put(1, &block(1)).unwrap();
    let mut run = s.lookup_prefix(&[1], true).unwrap();
    let first = run.pop().unwrap();
    let clone = first.clone();
    assert_eq!(clone.offset(), first.offset());
    drop(first);
    for k in 10..20u128 {
        s.put(k, &block(k)).unwrap();
    }
    assert!(s.contains(1) && clone.bytes() == &block(1)[..]);
    drop(clone);
    for k in 20..30u128 {
        s.put(k, &block(k)).unwrap();
    }
    assert!(!s.contains(1));
    s.check_integrity().unwrap();
}

#[test]
fn lookup_prefix_promotes_from_ssd() {
    let dir = tmpdir("lp");
    let s = tiered(&dir, 4, 32, 1024).unwrap();
    for k in 0..8u128 {
        s.put(k, &block(k)).unwrap();
    }
    s.flush().unwrap();
    assert_eq!(s.tier_of(0), Some(crate::index::Tier::Ssd));
    let got = s.lookup_prefix(&[0, 1, 99], false).unwrap();
    assert!(got.is_empty(), "promote=false: DRAM only, key 0 is on SSD");
    let got = s.lookup_prefix(&[6, 7, 0, 99], true).unwrap();
    assert_eq!(got.len(), 3);
    assert_eq!(got[2].bytes(), &block(0)[..]);
    assert_eq!(s.tier_of(0), Some(crate::index::Tier::Dram), "promoted");
    drop(got);
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn commit_leased_returns_the_published_slot() {
    let s = dram(2);
    let mut r = s.reserve(1).unwrap();
    r.bytes_mut().copy_from_slice(&block(1));
    let off = r.offset();
    let l = s.commit_leased(r, 0).unwrap();
    assert_eq!(l.offset(), off);
    assert_eq!(s.slot_offset(1), Some(off));
    assert_eq!(l.bytes(), &block(1)[..]);
    let r2 = s.reserve(1).unwrap();
    assert!(s.commit_leased(r2, 0).is_none(), "key stored meanwhile");
    drop(l);
    s.check_integrity().unwrap();
}

#[test]
fn remove_of_pinned_is_refused() {
    let s = dram(2);
    s.put(1, &block(1)).unwrap();
    s.pin(1).unwrap();
    assert!(matches!(s.remove(1), Err(StoreError::Invalid(_))));
    assert!(s.contains(1));
    assert_eq!(s.unpin(1).unwrap(), 0, "the pinner's unpin still works");
    assert!(s.remove(1).unwrap());
}

#[test]
fn removed_stays_removed_after_reopen() {
    let dir = tmpdir("durable");
    {
        let s = tiered(&dir, 2, 32, 1024).unwrap();
        for k in 0..20u128 {
            s.put(k, &block(k)).unwrap();
        }
        s.flush().unwrap();
        for k in 0..10u128 {
            assert!(s.remove(k).unwrap(), "key {k}");
        }
        s.flush().unwrap();
    }
    let s = tiered(&dir, 2, 32, 1024).unwrap();
    for k in 0..10u128 {
        assert!(!s.contains(k), "removed key {k} recovered");
    }
    for k in 10..18u128 {
        assert!(s.contains(k), "kept key {k} lost");
    }
    // put again after a remove: back, and durable too
    s.put(3, &block(3)).unwrap();
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// One owner per key puts, reads and removes it while readers promote random keys and a
/// 2-slot DRAM tier demotes constantly; a key is never seen again after its remove.
#[test]
fn remove_is_final_under_demotion_and_promotion() {
    let dir = tmpdir("race");
    let s = tiered(&dir, 2, 64, 8).unwrap();
    let stop = AtomicBool::new(false);
    let removed: Vec<HashSet<u128>> = std::thread::scope(|sc| {
        for r in 0..2u128 {
            let (s, stop) = (&s, &stop);
            sc.spawn(move || {
                let mut k = r;
                while !stop.load(Ordering::Relaxed) {
                    k = (k * 6364136223846793005 + 1442695040888963407) % (1 << 20);
                    if let Ok(Some(b)) = s.get(k % 400, true) {
                        assert_eq!(b.bytes(), &block(k % 400)[..]);
                    }
                }
            });
        }
        let writers: Vec<_> = (0..2u128)
            .map(|w| {
                let s = &s;
                sc.spawn(move || {
                    let mut gone = HashSet::new();
                    for i in 0..600u128 {
                        let k = w * 200 + i % 200;
                        let _ = s.put(k, &block(k));
                        if i % 3 == 0 {
                            let _ = s.get(k, true);
                        }
                        if i >= 400 {
                            s.remove(k).unwrap();
                            assert!(!s.contains(k), "key {k} present right after its remove");
                            gone.insert(k);
                        }
                    }
                    gone
                })
            })
            .collect();
        let gone = writers.into_iter().map(|h| h.join().unwrap()).collect();
        stop.store(true, Ordering::Relaxed);
        gone
    });
    s.flush().unwrap();
    for k in removed.iter().flatten() {
        assert!(!s.contains(*k), "key {k} came back after its remove");
        assert!(s.get(*k, true).unwrap().is_none());
    }
    drop(s);
    let s = tiered(&dir, 2, 64, 8).unwrap();
    for k in removed.iter().flatten() {
        assert!(!s.contains(*k), "key {k} recovered after its remove");
    }
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn second_store_on_one_file_is_refused() {
    let dir = tmpdir("lock");
    let a = tiered(&dir, 2, 8, 16).unwrap();
    a.put(1, &block(1)).unwrap();
    let e = tiered(&dir, 2, 8, 16).err().expect("second open refused");
    assert!(matches!(e, StoreError::Locked(_)), "{e}");
    assert!(e.to_string().contains("in use by another Store"), "{e}");
    drop(a);
    assert!(tiered(&dir, 2, 8, 16).is_ok(), "free again once the first store closed");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn damaged_file_header_is_named() {
    let dir = tmpdir("hdr");
    drop(tiered(&dir, 2, 8, 16).unwrap());
    let path = dir.join(SSD_FILE_NAME);
    for (byte, bit) in [(9usize, 0x01u8), (2, 0x10), (35, 0x80)] {
        let mut b = std::fs::read(&path).unwrap();
        b[byte] ^= bit;
        std::fs::write(&path, &b).unwrap();
        let e = tiered(&dir, 2, 8, 16).err().expect("damaged header refused");
        assert!(matches!(e, StoreError::Corrupt(_)), "byte {byte}: {e}");
        assert!(e.to_string().contains("damaged"), "{e}");
        b[byte] ^= bit;
        std::fs::write(&path, &b).unwrap();
    }
    // an intact header of another geometry says which
    let e = tiered(&dir, 2, 16, 16).err().unwrap();
    assert!(matches!(e, StoreError::Invalid(_)) && e.to_string().contains("block_bytes=256"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn empty_ssd_path_is_refused() {
    let e = Store::open(StoreConfig { ssd_path: Some(PathBuf::new()), ssd_bytes: 1 << 20, ..Default::default() })
        .err()
        .unwrap();
    assert!(matches!(e, StoreError::Invalid(_)) && e.to_string().contains("empty"), "{e}");
}
