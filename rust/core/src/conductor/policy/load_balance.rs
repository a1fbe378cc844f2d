//! `load_balance`: the instance with the least queued work (ties: lowest id); it reuses
//! whatever prefix it holds, but the prefix does not steer the choice.

use super::{Choice, PolicyInput};

pub(super) fn choose(input: &PolicyInput<'_>) -> Choice {
    let mut idx = 0;
    for (i, c) in input.cands.iter().enumerate() {
        if c.queue_s < input.cands[idx].queue_s {
            idx = i;
        }
    }
    input.local_choice(idx)
}
