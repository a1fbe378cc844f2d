//! `mooncake`: Algorithm 1 of the Mooncake paper (KVCache-centric scheduling).
//!
//! For each prefill instance with local prefix `l` and the global best prefix `b`
//! (held by instance `h`): when `b / l > balancing_threshold` (with `l = 0`, whenever
//! `b > 0`), the instance may fetch blocks `l..b` from `h` and prefill from `b`; it does
//! so only when transfer + prefill from `b` is cheaper than prefilling from `l` (the
//! fetch-vs-recompute decision). Otherwise it prefills from `l`. The instance's TTFT is
//! queue + (transfer) + prefill; the lowest TTFT wins, ties to the lowest id. Tiers are
//! ignored, as in the paper (a block counts the same in DRAM or on SSD).

use super::{keep_best, Choice, PolicyInput};

/// The option Algorithm 1 takes on candidate `idx`.
pub(super) fn option_for(input: &PolicyInput<'_>, idx: usize) -> Choice {
    let local = input.local_choice(idx);
    let c = &input.cands[idx];
    let Some(best) = input.best else {
        return local;
    };
    let l = c.local();
    let b = best.total();
    if best.instance == c.id || b <= l || (b as f64) <= input.balancing_threshold * l as f64 {
        return local;
    }
    let fetch_tokens = input.tokens(b) - input.tokens(l);
    let transfer_s = input.cost.transfer.fetch(fetch_tokens, 0.0);
    let fetch = Choice {
        reused_blocks: b,
        fetch_blocks: b - l,
        fetch_from: Some(best.instance),
        transfer_s,
        prefill_s: input.prefill_s(c, b),
        ..local
    };
    if fetch.ttft() < local.ttft() {
        fetch
    } else {
        local
    }
}

pub(super) fn choose(input: &PolicyInput<'_>) -> Choice {
    let mut best = None;
    for i in 0..input.cands.len() {
        keep_best(&mut best, option_for(input, i));
    }
    best.unwrap_or_else(|| input.local_choice(0))
}
