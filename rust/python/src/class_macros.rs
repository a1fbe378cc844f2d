//! The glue's two repeated shapes, written once: a class that wraps a core value and
//! shows its fields as read-only properties, and a constructor whose every argument
//! defaults to the core's `Default` (so the defaults are written only in the core).

/// `#[pymethods]` of a class that wraps a core value in `inner`: one read-only property
/// per listed field (the core field, copied out; doc comments become its docstring),
/// then the class's other methods as written.
macro_rules! inner_getters {
    ($ty:ty { $( $(#[$attr:meta])* $name:ident: $t:ty ),* $(,)? } $($methods:tt)*) => {
        #[pyo3::pymethods]
        #[allow(clippy::wrong_self_convention)] // Python property names (`from_instance`)
        impl $ty {
            $( $(#[$attr])* #[getter] fn $name(&self) -> $t { self.inner.$name } )*
            $($methods)*
        }
    };
}

/// `base` with each named `Option` argument that is `Some` written over the field of the
/// same name: `with_overrides!(Model::default(); c0, c_new)`.
macro_rules! with_overrides {
    ($base:expr; $($field:ident),* $(,)?) => {{
        let mut value = $base;
        $( if let Some(v) = $field { value.$field = v; } )*
        value
    }};
}

pub(crate) use {inner_getters, with_overrides};
