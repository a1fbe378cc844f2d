//! `random`: a uniformly random prefill instance, reusing what it holds locally.

use super::{Choice, PolicyInput};
use crate::conductor::state::next_rand;

pub(super) fn choose(input: &PolicyInput<'_>, rng: &mut u64) -> Choice {
    let idx = (next_rand(rng) % input.cands.len() as u64) as usize;
    input.local_choice(idx)
}
