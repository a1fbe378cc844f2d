//! Batches copied between caller memory given by address and the store's slots, in one
//! call: what a pool segment needs for `batch_put_from` / `batch_get_into` of many
//! objects (every chunk of every object of the batch at once, no per-chunk call from
//! Python, no staging buffer). Slots are reserved (puts) or leased (gets) first, under
//! the store's locks; the bytes are then copied with no lock held, split over a few
//! threads when the batch is large (one core's memcpy is well below what the memory
//! system moves), and puts are committed in batch order afterwards.
//!
//! The addresses are the caller's word (as a transfer engine's are): the functions are
//! `unsafe` and say what the caller guarantees.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use super::arena::Reservation;
use super::error::StoreError;
use super::tiered::{BlockRef, Store};
use crate::hash::BlockHash;
use crate::mem::stream_copy as stream;

/// One chunk: its key and the caller's memory it is copied from or into. `len` may be
/// shorter than `block_bytes` (an object's last chunk): a put zero-fills the rest of the
/// slot, a get copies only `len` bytes.
#[derive(Debug, Clone, Copy)]
pub struct AddressedChunk {
    pub key: BlockHash,
    pub addr: usize,
    pub len: usize,
}

impl AddressedChunk {
    /// One chunk per key from three parallel lists (what a front end receives); the
    /// lists must have one entry each per key.
    pub fn zip(keys: &[BlockHash], addrs: &[usize], lens: &[usize]) -> Result<Vec<AddressedChunk>, StoreError> {
        if keys.len() != addrs.len() || keys.len() != lens.len() {
            return Err(StoreError::Invalid(format!(
                "{} keys, {} addrs and {} lens: give one address and length per key",
                keys.len(),
                addrs.len(),
                lens.len()
            )));
        }
        Ok(keys.iter().zip(addrs).zip(lens).map(|((&key, &addr), &len)| AddressedChunk { key, addr, len }).collect())
    }
}

/// Every chunk fits a slot (`block_bytes`) and has a non-null address.
fn check_chunks(chunks: &[AddressedChunk], bb: usize) -> Result<(), StoreError> {
    match chunks.iter().find(|c| c.len > bb || c.addr == 0) {
        Some(c) => Err(StoreError::Invalid(format!(
            "a chunk is at most block_bytes={bb} bytes at a non-null address, got {} bytes at {:#x}",
            c.len, c.addr
        ))),
        None => Ok(()),
    }
}

/// Below this many bytes a batch is copied by the calling thread alone. A batch usually
/// follows a pause (a request's worth of other work), and after one a second thread adds
/// little to a copy on this project's 2-core KVM host: 16 MiB into huge-page slots after
/// a 20 ms sleep, 12.8 GB/s on one thread, 12.7 with a helper spawned, 13.7 with a kept
/// helper doing half (two threads double a copy only back to back, bytes still cached).
/// Starting or waking the helper costs more than that: a local `batch_put_from` of
/// 32 x 512 KiB spent 1.50-1.67 ms in its copy call with no helper, 1.68-1.82 ms with
/// one spawned, 1.63-3.66 ms with a kept helper woken by a condvar (BENCHMARKS.md, "k24p:
/// local 512 KiB after a pause"). Batches this large still get helpers, where a thread
/// start is noise and hosts with memory channels to spare gain.
const PARALLEL_MIN_BYTES: usize = 64 << 20;
/// At most this many copy threads (past that the memory system, not the cores, limits).
const MAX_COPY_THREADS: usize = 8;

fn copy_threads(total_bytes: usize) -> usize {
    if total_bytes < PARALLEL_MIN_BYTES {
        return 1;
    }
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    cores.min(MAX_COPY_THREADS).min(total_bytes / (1 << 20)).max(1)
}

/// How a batch writes its destinations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stores {
    /// Ordinary stores (the destination lines are read for ownership and stay in cache).
    Cached,
    /// Non-temporal stores: no read of each destination line before it is written, and
    /// the caller's cache is left alone. Measured on this project's 2-core host, one
    /// thread copying 32 x 512 KiB: 6.5 GB/s cached (glibc's `memmove` too, which keeps
    /// cached stores below a threshold of 3/4 of the reported L3 per thread) against
    /// 8.4 GB/s streaming.
    Streaming,
}

/// A get batch of at least this many bytes is written with streaming stores: more than a
/// core's L2 holds, so the caller would not find it in cache anyway. A smaller one (one
/// object the caller reads next) is written through the cache. Puts always stream: a
/// slot is read by a later request, not by the writer.
const STREAM_GET_MIN_BYTES: usize = 4 << 20;

/// One copy of the batch: `dst`, `src`, `len`, then `zero` bytes cleared after `dst+len`.
#[derive(Clone, Copy)]
struct Copy {
    dst: usize,
    src: usize,
    len: usize,
    zero: usize,
}

/// Largest piece of a copy a thread claims at once: small enough that the threads end
/// together, large enough that claiming costs nothing next to the copy.
const UNIT_BYTES: usize = 1 << 20;

/// The copies cut into units of at most `UNIT_BYTES` (a copy's zero fill goes with its
/// last unit).
fn units(copies: &[Copy]) -> Vec<Copy> {
    let mut out = Vec::with_capacity(copies.len());
    for c in copies {
        let mut at = 0;
        while c.len - at > UNIT_BYTES {
            out.push(Copy { dst: c.dst + at, src: c.src + at, len: UNIT_BYTES, zero: 0 });
            at += UNIT_BYTES;
        }
        out.push(Copy { dst: c.dst + at, src: c.src + at, len: c.len - at, zero: c.zero });
    }
    out
}

/// What the calling thread and its helpers share: the units, the next one to claim, and
/// how many are done.
struct Work {
    units: Vec<Copy>,
    stores: Stores,
    next: AtomicUsize,
    done: Mutex<usize>,
    all_done: Condvar,
}

impl Work {
    /// Claims and copies units until none is left.
    ///
    /// # Safety
    /// What `run_copies` requires of its copies, for as long as a unit is unfinished.
    unsafe fn drain(&self) {
        let mut mine = 0;
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(c) = self.units.get(i) else { break };
            // SAFETY: the caller's guarantee, per unit; each unit is claimed once.
            unsafe {
                match self.stores {
                    Stores::Cached => std::ptr::copy_nonoverlapping(c.src as *const u8, c.dst as *mut u8, c.len),
                    Stores::Streaming => stream::copy(c.src as *const u8, c.dst as *mut u8, c.len),
                }
                if c.zero > 0 {
                    std::ptr::write_bytes((c.dst + c.len) as *mut u8, 0, c.zero);
                }
            }
            mine += 1;
        }
        if mine > 0 {
            // this thread's non-temporal stores are ordered before the count that tells
            // the caller they are done (and so before the commit that publishes them)
            if self.stores == Stores::Streaming {
                stream::fence();
            }
            let mut done = self.done.lock();
            *done += mine;
            if *done == self.units.len() {
                self.all_done.notify_all();
            }
        }
    }
}

/// Runs the copies: the calling thread and up to `copy_threads - 1` helpers claim units
/// of at most `UNIT_BYTES` from one counter. The caller never waits for a helper to be
/// scheduled, only for units a helper has claimed: on a host whose cores are busy a
/// helper that starts late finds nothing left and touches nothing, and the batch runs at
/// one thread's speed, not behind the slowest thread's share (a fixed split of the bytes
/// halved a 16 MiB batch's speed on 2 busy cores).
///
/// # Safety
/// Every `[src, src+len)` is readable and every `[dst, dst+len+zero)` writable for the
/// call, and no destination overlaps another copy's source or destination.
unsafe fn run_copies(copies: &[Copy], stores: Stores) {
    let total: usize = copies.iter().map(|c| c.len + c.zero).sum();
    // SAFETY: the caller's guarantee, passed on.
    unsafe { run_copies_on(copies, stores, copy_threads(total)) }
}

/// [`run_copies`] on `threads` threads at most (the caller's included).
///
/// # Safety
/// As [`run_copies`].
unsafe fn run_copies_on(copies: &[Copy], stores: Stores, threads: usize) {
    let work = Arc::new(Work {
        units: units(copies),
        stores,
        next: AtomicUsize::new(0),
        done: Mutex::new(0),
        all_done: Condvar::new(),
    });
    let helpers = threads.min(work.units.len()).saturating_sub(1);
    for _ in 0..helpers {
        let w = work.clone();
        // SAFETY: a helper copies only units it claimed, and this function returns only
        // after every claimed unit is done (below); after that it claims nothing.
        let spawned = std::thread::Builder::new().name("mc-store-copy".into()).spawn(move || unsafe { w.drain() });
        if spawned.is_err() {
            break; // no thread to be had: the caller copies alone
        }
    }
    // SAFETY: the caller's guarantee.
    unsafe { work.drain() };
    let mut done = work.done.lock();
    while *done < work.units.len() {
        work.all_done.wait(&mut done);
    }
}

impl Store {
    /// Stores every chunk, copied from its address (zero-filled past `len`), as chain
    /// positions 0..n. Per chunk: true if stored now, false if its key was stored
    /// already (nothing written). All slots are reserved before any byte moves: when
    /// the store cannot hold the whole batch it answers `Full` and stores none of it.
    ///
    /// # Safety
    /// Each `[addr, addr+len)` is readable memory for the whole call.
    pub unsafe fn put_from_addresses(&self, chunks: &[AddressedChunk]) -> Result<Vec<bool>, StoreError> {
        let bb = self.block_bytes();
        check_chunks(chunks, bb)?;
        let mut reserved: Vec<Option<Reservation>> = Vec::with_capacity(chunks.len());
        for c in chunks {
            if self.contains(c.key) {
                reserved.push(None);
                continue;
            }
            // an error drops the reservations made so far: their slots return to the free list
            reserved.push(Some(self.reserve(c.key)?));
        }
        let copies: Vec<Copy> = reserved
            .iter()
            .zip(chunks)
            .filter_map(|(r, c)| {
                r.as_ref().map(|r| Copy { dst: r.as_mut_ptr() as usize, src: c.addr, len: c.len, zero: bb - c.len })
            })
            .collect();
        // SAFETY: destinations are slots reserved by this call alone (each `bb` bytes);
        // sources are the caller's readable ranges (this function's contract), never a
        // reserved slot (a reserved slot is not visible to anyone else).
        unsafe { run_copies(&copies, Stores::Streaming) };
        Ok(reserved
            .into_iter()
            .enumerate()
            .map(|(i, r)| r.is_some_and(|r| self.commit(r, i.min(u32::MAX as usize) as u32)))
            .collect())
    }

    /// Copies the first `len` bytes of every chunk to its address. Per chunk: true if it
    /// was found (SSD chunks are promoted unless `promote` is false) and copied.
    ///
    /// # Safety
    /// Each `[addr, addr+len)` is writable memory for the whole call, and no two ranges
    /// overlap.
    pub unsafe fn get_into_addresses(&self, chunks: &[AddressedChunk], promote: bool) -> Result<Vec<bool>, StoreError> {
        let bb = self.block_bytes();
        check_chunks(chunks, bb)?;
        let keys: Vec<BlockHash> = chunks.iter().map(|c| c.key).collect();
        // leases (or private SSD copies) held until every copy is done
        let blocks: Vec<Option<BlockRef>> = self.get_batch(&keys, promote)?;
        let copies: Vec<Copy> = blocks
            .iter()
            .zip(chunks)
            .filter_map(|(b, c)| {
                b.as_ref().map(|b| Copy { dst: c.addr, src: b.bytes().as_ptr() as usize, len: c.len, zero: 0 })
            })
            .collect();
        // SAFETY: sources are leased slots or owned copies held in `blocks` until after
        // the copies; destinations are the caller's writable, disjoint ranges.
        let total: usize = copies.iter().map(|c| c.len).sum();
        let stores = if total >= STREAM_GET_MIN_BYTES { Stores::Streaming } else { Stores::Cached };
        unsafe { run_copies(&copies, stores) };
        Ok(blocks.iter().map(Option::is_some).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreConfig;

    const BB: usize = 8192;

    fn store(slots: usize) -> Store {
        Store::open(StoreConfig { block_bytes: BB, dram_bytes: slots * BB, ..Default::default() }).unwrap()
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect()
    }

    /// Copies longer than a unit are cut into units that cover them exactly once, in
    /// order, with the zero fill after the last byte; and copying the units does what
    /// copying the whole ranges does.
    #[test]
    fn units_cover_each_copy_once_with_its_zero_fill_last() {
        let big = 3 * UNIT_BYTES + 12_345;
        let src = pattern(big + 100, 3);
        let mut dst = vec![0xAAu8; big + 100 + 4096];
        let d = dst.as_mut_ptr() as usize;
        let copies = [
            Copy { dst: d, src: src.as_ptr() as usize, len: big, zero: 1000 },
            Copy { dst: d + big + 1000, src: src.as_ptr() as usize + big, len: 100, zero: 7 },
        ];
        let u = units(&copies);
        assert_eq!(u.len(), 5);
        assert!(u.iter().all(|c| c.len <= UNIT_BYTES));
        assert_eq!(u.iter().map(|c| c.len).sum::<usize>(), big + 100);
        assert_eq!((u[3].zero, u[4].zero), (1000, 7));
        assert!(u.windows(2).take(3).all(|w| w[0].dst + w[0].len == w[1].dst && w[0].zero == 0));
        // SAFETY: every range lies inside `src` / `dst`, and none overlaps another.
        unsafe { run_copies(&copies, Stores::Cached) };
        assert_eq!(&dst[..big], &src[..big]);
        assert!(dst[big..big + 1000].iter().all(|&b| b == 0));
        assert_eq!(&dst[big + 1000..big + 1100], &src[big..big + 100]);
        assert!(dst[big + 1100..big + 1107].iter().all(|&b| b == 0));
        assert!(dst[big + 1107..].iter().all(|&b| b == 0xAA));
    }

    /// The reference: one `put`/`get_into` per chunk, against the batch call, on a batch
    /// large enough to be copied by several threads.
    #[test]
    fn batch_copies_match_per_chunk_puts_and_gets() {
        let n = 1200; // ~9.4 MiB: one thread (copies on several: the test below)
        let src = pattern(n * BB - 100, 7);
        let chunks: Vec<AddressedChunk> = (0..n)
            .map(|i| {
                let len = if i == n - 1 { BB - 100 } else { BB };
                AddressedChunk { key: 1000 + i as u128, addr: src.as_ptr() as usize + i * BB, len }
            })
            .collect();
        let fast = store(n + 8);
        // SAFETY: every range lies inside `src`.
        let put = unsafe { fast.put_from_addresses(&chunks) }.unwrap();
        assert!(put.iter().all(|&b| b));
        let slow = store(n + 8);
        for c in &chunks {
            let mut block = vec![0u8; BB];
            block[..c.len].copy_from_slice(&src[c.addr - src.as_ptr() as usize..][..c.len]);
            slow.put(c.key, &block).unwrap();
        }
        let mut got = vec![0u8; src.len()];
        let outs: Vec<AddressedChunk> = chunks
            .iter()
            .map(|c| AddressedChunk { addr: c.addr - src.as_ptr() as usize + got.as_mut_ptr() as usize, ..*c })
            .collect();
        // SAFETY: every range lies inside `got`, disjoint.
        assert!(unsafe { fast.get_into_addresses(&outs, true) }.unwrap().iter().all(|&b| b));
        assert_eq!(got, src);
        for c in &chunks {
            assert_eq!(
                fast.get(c.key, true).unwrap().unwrap().bytes(),
                slow.get(c.key, true).unwrap().unwrap().bytes()
            );
        }
        // stored already: false, nothing written; a missing key: false, its range untouched
        // SAFETY: as above.
        assert_eq!(unsafe { fast.put_from_addresses(&chunks[..2]) }.unwrap(), vec![false, false]);
        let mut one = vec![9u8; 16];
        let miss = [AddressedChunk { key: 5, addr: one.as_mut_ptr() as usize, len: 16 }];
        assert_eq!(unsafe { fast.get_into_addresses(&miss, true) }.unwrap(), vec![false]);
        assert_eq!(one, vec![9u8; 16]);
        fast.check_integrity().unwrap();
    }

    /// Copies shared by several threads (what a batch of 64 MiB or more gets) write what
    /// `copy_from_slice` writes, with either kind of store, at odd lengths and offsets,
    /// zero fills included, and nothing else.
    #[test]
    fn copies_on_several_threads_equal_plain_copies() {
        let src = pattern(5 * UNIT_BYTES + 777, 11);
        for stores in [Stores::Cached, Stores::Streaming] {
            for threads in [1, 2, 3] {
                let mut dst = vec![0xC3u8; src.len() + 3 * 4096 + 64];
                let d = dst.as_mut_ptr() as usize;
                let s0 = src.as_ptr() as usize;
                // (src offset, dst offset, len, zero): a long one cut into units, short
                // ones, misaligned both sides, with and without a zero fill
                let plan = [
                    (1, 3, 2 * UNIT_BYTES + 5, 100),
                    (2 * UNIT_BYTES + 9, 2 * UNIT_BYTES + 200, UNIT_BYTES - 1, 0),
                    (3 * UNIT_BYTES + 70, 3 * UNIT_BYTES + 400, 2 * UNIT_BYTES + 700, 4096),
                ];
                let copies: Vec<Copy> =
                    plan.iter().map(|&(so, dof, len, zero)| Copy { dst: d + dof, src: s0 + so, len, zero }).collect();
                let mut want = dst.clone();
                for &(so, dof, len, zero) in &plan {
                    want[dof..dof + len].copy_from_slice(&src[so..so + len]);
                    want[dof + len..dof + len + zero].fill(0);
                }
                // SAFETY: every range lies inside `src` / `dst`, no two destinations overlap.
                unsafe { run_copies_on(&copies, stores, threads) };
                assert!(dst == want, "{stores:?} on {threads} threads");
            }
        }
    }

    #[test]
    fn a_batch_larger_than_the_store_stores_none_of_it_and_bad_chunks_are_refused() {
        let s = store(4);
        let src = pattern(6 * BB, 1);
        let chunks: Vec<AddressedChunk> = (0..6)
            .map(|i| AddressedChunk { key: i as u128 + 1, addr: src.as_ptr() as usize + i * BB, len: BB })
            .collect();
        // SAFETY: inside `src`.
        assert!(matches!(unsafe { s.put_from_addresses(&chunks) }, Err(StoreError::Full { .. })));
        assert_eq!(s.stats().blocks_dram, 0);
        let long = [AddressedChunk { key: 1, addr: src.as_ptr() as usize, len: BB + 1 }];
        assert!(matches!(unsafe { s.put_from_addresses(&long) }, Err(StoreError::Invalid(_))));
        let null = [AddressedChunk { key: 1, addr: 0, len: 1 }];
        assert!(matches!(unsafe { s.get_into_addresses(&null, true) }, Err(StoreError::Invalid(_))));
        s.check_integrity().unwrap();
    }
}
