//! `SpinWait`: the bounded poll before a socket read, and the read, in one call with the
//! GIL released (mooncake_core::spin_read says why and what the policy is). One per
//! connection end (its back-off is that connection's); its calls take the socket's
//! descriptor each time, so the socket object stays the descriptor's only owner.

use std::time::Duration;

use mooncake_core::spin_read::{SpinRead, MAX_SKIP};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::gil::Lent;

/// The most one read asks for: a pool frame reader asks for 64 KiB.
const MAX_READ: usize = 16 << 20;

struct State {
    spin: SpinRead,
    /// the read buffer, kept between calls (zeroed once, not per read)
    buf: Vec<u8>,
}

#[pyclass(name = "SpinWait", module = "mooncake_rs._core", frozen)]
struct PySpinWait {
    spin: Duration,
    state: Lent<State>,
}

impl PySpinWait {
    fn take(&self) -> State {
        self.state.take_or(|| State { spin: SpinRead::new(self.spin), buf: Vec::new() })
    }
}

#[pymethods]
impl PySpinWait {
    /// `spin_s`: how long a wait polls before it gives up (0: never polls).
    #[new]
    fn new(spin_s: f64) -> PyResult<Self> {
        if !(0.0..=10.0).contains(&spin_s) {
            return Err(PyValueError::new_err(format!("spin_s is seconds in 0..10, got {spin_s}")));
        }
        let spin = Duration::from_secs_f64(spin_s);
        Ok(Self { spin, state: Lent::new(Some(State { spin: SpinRead::new(spin), buf: Vec::new() })) })
    }

    /// True when `fd` became readable (bytes, the end of the stream or an error: the
    /// blocking read that follows returns at once), False when the poll gave up or was
    /// skipped. OSError for a bad descriptor.
    fn wait(&self, py: Python<'_>, fd: i32) -> PyResult<bool> {
        let mut st = self.take();
        let r = py.detach(|| st.spin.wait(fd));
        self.state.put_back(st);
        Ok(r?)
    }

    /// The poll, then one read of at most `max_bytes` from `fd` (a blocking socket):
    /// b"" when the peer closed the stream; BlockingIOError when the socket's receive
    /// timeout expired; OSError otherwise.
    fn recv<'py>(&self, py: Python<'py>, fd: i32, max_bytes: usize) -> PyResult<Bound<'py, PyBytes>> {
        if max_bytes == 0 || max_bytes > MAX_READ {
            return Err(PyValueError::new_err(format!("max_bytes is 1..{MAX_READ}, got {max_bytes}")));
        }
        let mut st = self.take();
        if st.buf.len() < max_bytes {
            st.buf.resize(max_bytes, 0);
        }
        let r = py.detach(|| {
            let State { spin, buf } = &mut st;
            spin.recv(fd, &mut buf[..max_bytes])
        });
        let out = r.map(|n| PyBytes::new(py, &st.buf[..n]));
        self.state.put_back(st);
        Ok(out?)
    }

    /// Waits left that skip the poll (back-off; tests read and set it).
    #[getter]
    fn skip(&self) -> u32 {
        self.state.with(|s| s.spin.skip()).unwrap_or(0)
    }

    #[setter]
    fn set_skip(&self, skip: u32) {
        self.state.with(|s| s.spin.set_skip(skip));
    }

    #[getter]
    fn spin_s(&self) -> f64 {
        self.spin.as_secs_f64()
    }

    /// The most waits skipped after polls that gave up.
    #[classattr]
    const MAX_SKIP: u32 = MAX_SKIP;
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySpinWait>()
}
