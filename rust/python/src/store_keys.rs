//! Block keys for the store's batch calls: the extractor moved to `keys.rs`, which every
//! glue entry point taking several keys now shares (index, conductor, store, block
//! cache). Re-exported here so code naming the old path keeps building.

#[allow(unused_imports)]
pub use crate::keys::{keys_from_py, KEY_BYTES};
