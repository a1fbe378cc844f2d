//! Fast 128-bit int conversions.
//!
//! Block hashes are 128-bit Python ints, and converting them is on the hot path of every
//! request (a 16k-token prompt has 1,024 blocks of 16). The stable ABI has no 128-bit
//! conversion, so the generic route builds each int from two 64-bit halves with a shift
//! and an or (several allocations per hash). CPython does export byte-array
//! conversions: `PyLong_FromUnsignedNativeBytes` / `PyLong_AsNativeBytes` (3.13+) and
//! `_PyLong_FromByteArray` / `_PyLong_AsByteArray` (3.11, 3.12). They are looked up once
//! at run time with `dlsym`, so one abi3 wheel uses the fast path on every version and
//! falls back to the generic route where a symbol is missing.

use std::ffi::{c_int, c_void, CStr};
use std::sync::OnceLock;

use pyo3::ffi;
use pyo3::prelude::*;

type FromNative = unsafe extern "C" fn(*const c_void, usize, c_int) -> *mut ffi::PyObject;
type FromByteArray = unsafe extern "C" fn(*const u8, usize, c_int, c_int) -> *mut ffi::PyObject;
type AsNative = unsafe extern "C" fn(*mut ffi::PyObject, *mut c_void, isize, c_int) -> isize;
/// The 3.11/3.12 signature (3.13 added a parameter; there `AsNative` exists and wins).
type AsByteArray312 = unsafe extern "C" fn(*mut ffi::PyObject, *mut u8, usize, c_int, c_int) -> c_int;

#[derive(Clone, Copy)]
enum FromImpl {
    Native(FromNative),
    ByteArray(FromByteArray),
    Generic,
}

#[derive(Clone, Copy)]
enum AsImpl {
    Native(AsNative),
    ByteArray(AsByteArray312),
    Generic,
}

struct Api {
    from: FromImpl,
    to: AsImpl,
}

fn symbol(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: dlsym with RTLD_DEFAULT looks the name up in the already loaded process
    // image (the interpreter); a null result means absent.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

fn api() -> &'static Api {
    static API: OnceLock<Api> = OnceLock::new();
    API.get_or_init(|| {
        // SAFETY (both blocks): each symbol is transmuted to the signature CPython
        // declares for it in the versions where it exists (see the module docs).
        let from = if let Some(p) = symbol(c"PyLong_FromUnsignedNativeBytes") {
            FromImpl::Native(unsafe { std::mem::transmute::<*mut c_void, FromNative>(p) })
        } else if let Some(p) = symbol(c"_PyLong_FromByteArray") {
            FromImpl::ByteArray(unsafe { std::mem::transmute::<*mut c_void, FromByteArray>(p) })
        } else {
            FromImpl::Generic
        };
        let to = if let Some(p) = symbol(c"PyLong_AsNativeBytes") {
            AsImpl::Native(unsafe { std::mem::transmute::<*mut c_void, AsNative>(p) })
        } else if let Some(p) = symbol(c"_PyLong_AsByteArray") {
            AsImpl::ByteArray(unsafe { std::mem::transmute::<*mut c_void, AsByteArray312>(p) })
        } else {
            AsImpl::Generic
        };
        Api { from, to }
    })
}

const LITTLE_ENDIAN: c_int = 1;
const UNSIGNED_BUFFER: c_int = 4;
const REJECT_NEGATIVE: c_int = 8;

/// u128 → Python int.
pub fn u128_to_py(py: Python<'_>, v: u128) -> PyResult<Bound<'_, PyAny>> {
    if v <= u64::MAX as u128 {
        return Ok((v as u64).into_pyobject(py)?.into_any());
    }
    let bytes = v.to_le_bytes();
    // SAFETY: `bytes` is 16 readable bytes; the functions return a new reference or
    // null with an exception set, which from_owned_ptr_or_err turns into Err.
    unsafe {
        let ptr = match api().from {
            FromImpl::Native(f) => f(bytes.as_ptr() as *const c_void, 16, LITTLE_ENDIAN),
            FromImpl::ByteArray(f) => f(bytes.as_ptr(), 16, 1, 0),
            FromImpl::Generic => return Ok(v.into_pyobject(py)?.into_any()),
        };
        Bound::from_owned_ptr_or_err(py, ptr)
    }
}

/// Python int (or anything with `__index__`) → u128. Errors are Python's own
/// (TypeError for a non-int, OverflowError/ValueError outside 0..2^128).
pub fn u128_from_py(obj: &Bound<'_, PyAny>) -> PyResult<u128> {
    let py = obj.py();
    // SAFETY: PyLong_Check only reads the type.
    let index;
    let int = if unsafe { ffi::PyLong_Check(obj.as_ptr()) } != 0 {
        obj
    } else {
        // SAFETY: PyNumber_Index returns a new reference or null with an exception.
        index = unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyNumber_Index(obj.as_ptr()))? };
        &index
    };
    let mut buf = [0u8; 16];
    // SAFETY: `int` is a live int object; `buf` has 16 writable bytes.
    unsafe {
        match api().to {
            AsImpl::Native(f) => {
                let flags = LITTLE_ENDIAN | UNSIGNED_BUFFER | REJECT_NEGATIVE;
                let n = f(int.as_ptr(), buf.as_mut_ptr() as *mut c_void, 16, flags);
                if n < 0 {
                    return Err(PyErr::fetch(py));
                }
                if n > 16 {
                    return Err(pyo3::exceptions::PyOverflowError::new_err("int does not fit in 128 bits"));
                }
            }
            AsImpl::ByteArray(f) => {
                if f(int.as_ptr(), buf.as_mut_ptr(), 16, 1, 0) < 0 {
                    return Err(PyErr::fetch(py));
                }
            }
            AsImpl::Generic => return int.extract::<u128>(),
        }
    }
    Ok(u128::from_le_bytes(buf))
}
