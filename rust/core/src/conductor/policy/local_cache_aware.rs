//! `local_cache_aware`: minimise queue + prefill given each instance's own prefix;
//! never transfers KV between instances.

use super::{keep_best, Choice, PolicyInput};

pub(super) fn choose(input: &PolicyInput<'_>) -> Choice {
    let mut best = None;
    for i in 0..input.cands.len() {
        keep_best(&mut best, input.local_choice(i));
    }
    best.unwrap_or_else(|| input.local_choice(0))
}
