//! Store configuration, with defaults and validation.

use std::path::PathBuf;

use super::error::StoreError;
use super::eviction::POLICY_NAMES;

#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Bytes of one block (every put must be exactly this long).
    pub block_bytes: usize,
    /// DRAM arena size; slots = dram_bytes / page_align(block_bytes).
    pub dram_bytes: usize,
    /// Directory of the SSD tier (`blocks.slots` inside); `None`: DRAM only.
    pub ssd_path: Option<PathBuf>,
    pub ssd_bytes: u64,
    /// Eviction policy name (both tiers): "lru", "s3fifo", "prefix".
    pub eviction: String,
    /// Put the arena in POSIX shared memory (mappable by other processes).
    pub shared_memory: bool,
    /// Blocks the demotion queue holds before it drops new ones.
    pub demotion_queue: usize,
    /// Events kept for `drain_events` before the oldest are dropped (0: no events).
    pub max_events: usize,
    /// Lock shards of the slot table.
    pub shards: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            block_bytes: 4096,
            dram_bytes: 64 << 20,
            ssd_path: None,
            ssd_bytes: 0,
            eviction: "lru".into(),
            shared_memory: false,
            demotion_queue: 64,
            max_events: 1 << 20,
            shards: 64,
        }
    }
}

impl StoreConfig {
    pub fn validate(&self) -> Result<usize, StoreError> {
        let bad = |m: String| Err(StoreError::Invalid(m));
        if self.block_bytes == 0 {
            return bad("block_bytes must be at least 1".into());
        }
        let stride = crate::mem::page_align(self.block_bytes);
        let slots = self.dram_bytes / stride;
        if slots == 0 {
            return bad(format!(
                "dram_bytes={} holds no block of block_bytes={} (a slot takes {stride} bytes)",
                self.dram_bytes, self.block_bytes
            ));
        }
        if slots >= u32::MAX as usize {
            return bad(format!("dram_bytes={} makes too many slots", self.dram_bytes));
        }
        if !POLICY_NAMES.contains(&self.eviction.as_str()) {
            return bad(format!("unknown eviction policy {:?}; expected one of {POLICY_NAMES:?}", self.eviction));
        }
        if self.ssd_path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return bad("ssd_path is empty; give the SSD tier a directory (or None for DRAM only)".into());
        }
        if self.ssd_path.is_some() && self.ssd_bytes == 0 {
            return bad("ssd_path is set but ssd_bytes is 0; give the SSD tier a size".into());
        }
        if self.ssd_path.is_some() && self.demotion_queue == 0 {
            return bad("demotion_queue must be at least 1".into());
        }
        Ok(slots)
    }
}
