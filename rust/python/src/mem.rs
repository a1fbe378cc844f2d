//! Shared-memory housekeeping: removing the segments of processes that died without
//! dropping their mappings (a SIGKILLed worker).

use pyo3::prelude::*;

/// Unlinks `/dev/shm/mooncake_rs.<pid>.*`; returns how many segments were removed.
#[pyfunction]
fn remove_shm_segments_of(pid: i32) -> usize {
    mooncake_core::mem::remove_segments_of(pid)
}

/// Unlinks the segments of every process that is no longer running; returns how many.
#[pyfunction]
fn sweep_stale_shm_segments() -> usize {
    mooncake_core::mem::sweep_stale_segments()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(remove_shm_segments_of, m)?)?;
    m.add_function(wrap_pyfunction!(sweep_stale_shm_segments, m)?)?;
    Ok(())
}
