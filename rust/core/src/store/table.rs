//! The slot table: key -> (slot, pins), split into shards with one mutex each. A
//! lookup holds one shard lock for one probe; no lock is held during copies or I/O.

use hashbrown::HashMap;
use parking_lot::{Mutex, MutexGuard};

use crate::hash::BlockHash;

#[derive(Debug, Clone, Copy)]
pub struct Entry {
    pub slot: u32,
    pub pins: u32,
}

pub struct Table {
    shards: Box<[Mutex<HashMap<BlockHash, Entry>>]>,
}

impl Table {
    pub fn new(shards: usize) -> Self {
        let n = shards.max(1).next_power_of_two();
        Table { shards: (0..n).map(|_| Mutex::new(HashMap::new())).collect() }
    }

    pub fn shard(&self, key: BlockHash) -> MutexGuard<'_, HashMap<BlockHash, Entry>> {
        // Keys are hashes (or, in tests and traces, small dense ids): fold both halves.
        let h = (key as u64) ^ ((key >> 64) as u64);
        let h = h.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        self.shards[(h as usize) & (self.shards.len() - 1)].lock()
    }

    /// A snapshot of every entry (for integrity checks and stats).
    pub fn snapshot(&self) -> Vec<(BlockHash, Entry)> {
        let mut out = Vec::new();
        for s in self.shards.iter() {
            out.extend(s.lock().iter().map(|(k, e)| (*k, *e)));
        }
        out
    }
}
