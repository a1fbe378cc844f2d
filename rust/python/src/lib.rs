//! `mooncake_rs._core`: the PyO3 glue. The only crate that knows about Python.
//!
//! One file per exposed part of the core; shared plumbing in `errors` (core errors →
//! the Python exception tree), `gil` (release the GIL around blocking core calls),
//! `convert` (token buffers, hash lists), `keys` (the one block-key extractor), `pyint` (fast 128-bit ints) and `logging` (`MOONCAKE_LOG`).

use pyo3::prelude::*;

mod block_cache;
mod block_hashes;
mod class_macros;
mod conductor;
mod conductor_cost;
mod conductor_types;
mod convert;
mod errors;
mod exists_frames;
mod gil;
mod hash;
mod hash_xxh3;
mod index;
mod interop;
mod interop_ingest;
mod interop_map;
mod key_table;
mod keys;
mod logging;
mod mem;
mod page_gather;
mod page_gather_each;
mod pyint;
mod request_saver;
mod seal;
mod segment_copy;
mod spin_read;
mod store;
mod store_block;
mod store_events;
mod store_keys;
mod store_object;
mod store_run;
mod transfer;
mod transfer_completion;
mod transfer_landing;
mod transfer_objects;
mod transfer_rights;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    logging::init_from_env();
    errors::init(m.py());
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    hash::register(m)?;
    block_hashes::register(m)?;
    hash_xxh3::register(m)?;
    index::register(m)?;
    interop::register(m)?;
    interop_ingest::register(m)?;
    conductor::register(m)?;
    block_cache::register(m)?;
    store::register(m)?;
    transfer::register(m)?;
    transfer_rights::register(m)?;
    transfer_landing::register(m)?;
    mem::register(m)?;
    seal::register(m)?;
    segment_copy::register(m)?;
    page_gather::register(m)?;
    page_gather_each::register(m)?;
    request_saver::register(m)?;
    key_table::register(m)?;
    exists_frames::register(m)?;
    spin_read::register(m)?;
    Ok(())
}
