//! Pure-Rust core of mooncake_rs.
//!
//! Nothing in this crate knows about Python: the PyO3 glue lives in `rust/python`, and
//! everything here is tested with `cargo test` alone. See `DESIGN.md` (shared) and the
//! top-level README for the architecture.
//!
//! Modules, one role each:
//! - [`hash`]: chained 128-bit hashes of full token blocks.
//! - [`hash_xxh3`]: the RFC standard rolling XXH3-64 sequence hash (interop with other indexers).
//! - [`index`]: which instance holds which block, in which tier; longest-prefix matching.
//! - [`interop`]: decoding the parts of other engines' KV event wire format that pay in Rust.
//! - [`mem`]: page-aligned private or shared-memory mappings (store arenas, transfer regions).
//! - [`object_layout`]: how an object lies in fixed-size chunks; the transfer spans of one.
//! - [`conductor`]: global scheduling (Algorithm 1 and better), admission, replica hints.
//! - [`transfer`]: batch transfers between registered memory (local, shm, tcp).
//! - [`seal`]: AES-256-GCM records for the sealed sessions of a deployment's control plane.
//! - [`error`]: the error categories every module's error enum maps to.
//! - [`token_array`]: token ids read in place from an integer array of any width.
//! - [`block_keys`]: block keys in their 16-byte little-endian buffer form.
//! - [`args`]: checks of plain arguments (seconds, paired lists) every front end shares.

pub mod args;
pub mod block_keys;
pub mod conductor;
pub mod error;
pub mod exists_frames;
pub mod hash;
pub mod hash_xxh3;
pub mod index;
pub mod interop;
pub mod key_set;
pub mod mem;
pub mod object_layout;
pub mod seal;
pub mod spin_read;
pub mod store;
pub mod token_array;
pub mod transfer;

pub use error::{Categorized, ErrorCategory};
pub use hash::{BlockHash, HashAlgorithm, HashError, PrefixHasher};
pub use hash_xxh3::{SeqHash, Xxh3RollingHasher};
pub use index::{BlockIndex, IndexError, IndexStats, InstanceId, PrefixMatch, Tier};
pub use transfer::{Engine as TransferEngine, TransferError};
