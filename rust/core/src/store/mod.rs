//! The tiered block store: DRAM slots in one arena, an SSD tier of slot files,
//! eviction, leases and pins, checksums and recovery; plus [`BlockCache`], its
//! metadata-only twin for the simulator.

mod cache;
mod error;
pub mod eviction;

pub use cache::{BlockCache, CacheEvent};
pub use error::StoreError;
