//! `PrefixHasher`: chained block hashes of token sequences.

use mooncake_core::{HashAlgorithm, HashError, PrefixHasher};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::block_hashes::PyBlockHashes;
use crate::convert::{extras_arg, extras_refs, hash_from_py, hashes_to_list, Tokens};
use crate::errors::{invalid, OrRaise};
use crate::gil::detached_infallible;

#[pyclass(name = "PrefixHasher", module = "mooncake_rs._core", frozen)]
pub struct PyPrefixHasher {
    pub inner: PrefixHasher,
}

#[pymethods]
impl PyPrefixHasher {
    #[new]
    #[pyo3(signature = (block_size, seed = 0, extra = None, algorithm = "xxh3"))]
    fn new(py: Python<'_>, block_size: i64, seed: u64, extra: Option<Vec<u8>>, algorithm: &str) -> PyResult<Self> {
        if block_size < 1 {
            return Err(invalid(py, format!("block_size must be >= 1, got {block_size}")));
        }
        let algorithm = HashAlgorithm::parse(algorithm).or_raise(py)?;
        let inner = PrefixHasher::new(block_size as usize, seed, extra.as_deref(), algorithm).or_raise(py)?;
        Ok(PyPrefixHasher { inner })
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[getter]
    fn seed(&self) -> u64 {
        self.inner.seed()
    }

    #[getter]
    fn algorithm(&self) -> &'static str {
        self.inner.algorithm().name()
    }

    /// The implicit parent of the first block.
    #[getter]
    fn root(&self) -> u128 {
        self.inner.root()
    }

    /// One chained hash per full block of `tokens`. `extras`: one `bytes | None` per
    /// full block (an engine's per-block `extra_keys` entry as msgpack), folded into the
    /// chain; fewer than the blocks: the rest have none.
    #[pyo3(signature = (tokens, parent = None, extras = None))]
    fn hash<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        parent: Option<&Bound<'py, PyAny>>,
        extras: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let hashes = self.hash_vec(py, tokens, parent, extras)?;
        hashes_to_list(py, &hashes)
    }

    /// Like `hash`, as a `BlockHashes` buffer instead of a list of ints: no Python int is
    /// built per block; the index, the conductor and the store take it as it is.
    /// Tokens: a list/tuple of ints or a 1-D integer buffer (numpy int32/uint32 is read in
    /// place); `parent` continues a chain (e.g. `previous[-1]`).
    /// `extras` as for `hash`.
    #[pyo3(signature = (tokens, parent = None, extras = None))]
    fn hash_blocks(
        &self,
        tokens: &Bound<'_, PyAny>,
        parent: Option<&Bound<'_, PyAny>>,
        extras: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyBlockHashes> {
        let hashes = self.hash_vec(tokens.py(), tokens, parent, extras)?;
        Ok(PyBlockHashes::from_vec(hashes))
    }

    /// `hash` of every sequence, in one call with the GIL released.
    fn hash_many<'py>(&self, py: Python<'py>, sequences: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyList>>> {
        let hasher = self.inner.clone();
        let all = hash_sequences(py, sequences, move |t| hasher.hash_tokens(t, None))?;
        all.iter().map(|h| hashes_to_list(py, h)).collect()
    }

    /// `hash_many` returning one `BlockHashes` per sequence (GIL released while hashing).
    fn hash_many_blocks(&self, py: Python<'_>, sequences: &Bound<'_, PyAny>) -> PyResult<Vec<PyBlockHashes>> {
        let hasher = self.inner.clone();
        let all = hash_sequences(py, sequences, move |t| hasher.hash_tokens(t, None))?;
        Ok(all.into_iter().map(PyBlockHashes::from_vec).collect())
    }

    fn __repr__(&self) -> String {
        format!(
            "PrefixHasher(block_size={}, seed={}, algorithm={:?})",
            self.inner.block_size(),
            self.inner.seed(),
            self.inner.algorithm().name()
        )
    }
}

impl PyPrefixHasher {
    /// `hash` and `hash_blocks`: with the GIL held (a 16k-token prompt at block 16 is
    /// ~10-20 us, and a released GIL would let another thread change a numpy buffer
    /// being read).
    fn hash_vec(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        parent: Option<&Bound<'_, PyAny>>,
        extras: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<mooncake_core::BlockHash>> {
        let parent = parent.map(hash_from_py).transpose()?;
        self.inner.check_parent(parent).or_raise(py)?;
        hash_tokens_arg(
            py,
            tokens,
            extras,
            |t| self.inner.hash_tokens(t, parent),
            |t, refs| self.inner.hash_tokens_with_extras(t, parent, refs),
        )
    }
}

/// `hash(tokens, extras=...)` of either hasher (this one, `Xxh3RollingHasher`): `plain`
/// when no extras are given, else `with_extras` with one `bytes | None` per block.
pub(crate) fn hash_tokens_arg<H>(
    py: Python<'_>,
    tokens: &Bound<'_, PyAny>,
    extras: Option<&Bound<'_, PyAny>>,
    plain: impl FnOnce(&[u32]) -> Vec<H>,
    with_extras: impl FnOnce(&[u32], &[Option<&[u8]>]) -> Result<Vec<H>, HashError>,
) -> PyResult<Vec<H>> {
    let extras = extras_arg(py, extras)?;
    let tokens = Tokens::extract(tokens)?;
    if extras.is_empty() {
        return Ok(tokens.with_u32(plain));
    }
    let refs = extras_refs(&extras);
    tokens.with_u32(|t| with_extras(t, &refs)).or_raise(py)
}

/// `hash_many` of either hasher: every token sequence of `sequences` converted (owned),
/// then each hashed by `hash` with the GIL released.
pub(crate) fn hash_sequences<H: Send>(
    py: Python<'_>,
    sequences: &Bound<'_, PyAny>,
    hash: impl Fn(&[u32]) -> Vec<H> + Send,
) -> PyResult<Vec<Vec<H>>> {
    let mut owned = Vec::new();
    for (i, seq) in
        sequences.try_iter().map_err(|_| invalid(py, "hash_many takes a list of token sequences"))?.enumerate()
    {
        let seq = seq?;
        let tokens = Tokens::extract(&seq).map_err(|e| invalid(py, format!("sequence {i}: {}", e.value(py))))?;
        owned.push(tokens.to_vec());
    }
    Ok(detached_infallible(py, move || owned.iter().map(|t| hash(t)).collect()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPrefixHasher>()
}
