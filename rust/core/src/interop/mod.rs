//! Interop with engines we did not write: their KV event wire format, decoded and
//! applied in Rust.
//!
//! - [`wire`]: a msgpack cursor (value heads, skipping whole values);
//! - [`msgpack`]: a msgpack array of token ids straight to `u32`s;
//! - [`events`]: one event batch (a ZMQ message's payload), borrowed from the payload;
//! - [`media`]: medium names to canonical ones;
//! - [`engine_map`]: one instance's engine hash -> our hash map, bounded;
//! - [`ingest`]: [`EventIngestor`], one message's events into block indexes in one call.

pub mod engine_map;
pub mod events;
pub mod ingest;
pub mod media;
pub mod msgpack;
pub mod wire;

pub use engine_map::{EngineHash, EngineHashMap, MapError, MAX_GROUPS, MEDIA_BITS};
pub use events::{decode_batch, Batch, Event, EventError, KeyRef};
pub use ingest::{ChainHasher, EventIngestor, IngestError, IngestStats, Sink, Step, StoredMeta, Tokens};
pub use media::canonical_medium;
pub use msgpack::{decode_u32_array, WireError};
