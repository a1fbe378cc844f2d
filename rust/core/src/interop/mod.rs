//! Interop with engines we did not write: the parts of their KV event wire format that
//! are worth decoding in Rust.
//!
//! - [`msgpack`]: a msgpack array of token ids straight to `u32`s, so a `BlockStored`
//!   event's tokens never become Python ints (the largest cost of decoding in Python).

pub mod msgpack;

pub use msgpack::{decode_u32_array, WireError};
