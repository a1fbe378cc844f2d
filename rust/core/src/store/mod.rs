//! The tiered block store: DRAM slots in one arena, an SSD tier of slot files,
//! eviction, leases and pins, checksums and recovery; plus [`BlockCache`], its
//! metadata-only twin for the simulator. See `docs/store.md`.
//!
//! - [`arena`]: the DRAM arena, slot reference counts, [`Lease`] and [`Reservation`].
//! - `table`: key -> slot, sharded.
//! - [`eviction`]: the policies, one file each.
//! - `slotfile` / `ssd`: the SSD tier (slot file format, recovery, demotion writer).
//! - `tiered`: [`Store`], tying them together.

pub mod arena;
mod batch_copy;
mod cache;
mod config;
pub mod crc32;
mod durable;
mod error;
mod event_wire;
mod events;
pub mod eviction;
mod inspect;
mod object_batch;
mod object_holds;
pub mod page_gather;
mod read;
pub mod segment_copy;
mod slotfile;
mod ssd;
mod table;
mod tiered;

pub use arena::{Lease, Reservation};
pub use batch_copy::AddressedChunk;
pub use cache::{BlockCache, CacheEvent};
pub use config::StoreConfig;
pub use error::StoreError;
pub use event_wire::{decode_events, encode_events};
pub use events::{EventKind, IndexEffect, StoreEvent, StoreStats};
pub use object_batch::AddressedObject;
pub use object_holds::ReservedObject;
pub use slotfile::{FILE_NAME as SSD_FILE_NAME, SLOT_HEADER as SSD_SLOT_HEADER};
pub use tiered::{BlockRef, Store};

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_final;
#[cfg(test)]
mod tests_object_holds;
#[cfg(test)]
mod tests_rows;
