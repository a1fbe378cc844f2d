//! `mooncake`: Algorithm 1 of the Mooncake paper (KVCache-centric scheduling), with the
//! fetch priced on the links as they are loaded.
//!
//! For each prefill instance with local prefix `l` and the global best prefix `b`: when
//! `b / l > balancing_threshold` (with `l = 0`, whenever `b > 0`), the instance may
//! fetch blocks `l..b` from a holder of `b` and prefill from `b`; among the holders of
//! `b` it takes the one whose fetch is fastest under the current link loads (the one
//! with the most free bandwidth), and it fetches only when queue + fetch + prefill
//! from `b` beats prefilling from `l` (the fetch-vs-recompute decision). Otherwise it
//! prefills from `l`. The lowest TTFT wins, ties to the lowest id. Tiers are ignored, as
//! in the paper (a block counts the same in DRAM or on SSD).

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
    if b <= l || (b as f64) <= input.balancing_threshold * l as f64 {
        return local;
    }
    let fetch_tokens = input.tokens(b) - input.tokens(l);
    let prefill_s = input.prefill_s(c, b);
    // a fetch on idle links is a lower bound of one under load: when even that loses,
    // the link loads need not be looked at (most candidates, most of the time)
    let idle = input.cost.transfer.fetch(fetch_tokens, 0.0);
    if local.queue_s + idle + prefill_s >= local.ttft() {
        return local;
    }
    let mut out = local;
    for h in input.matches {
        if h.instance == c.id || h.total() < b {
            continue;
        }
        let fetch = Choice {
            reused_blocks: b,
            fetch_blocks: b - l,
            fetch_from: Some(h.instance),
            transfer_s: input.fetch_s(c, h.instance, fetch_tokens, 0.0),
            prefill_s,
            ..local
        };
        if fetch.ttft() < out.ttft() {
            out = fetch;
        }
    }
    out
}

pub(super) fn choose(input: &PolicyInput<'_>) -> Choice {
    let mut best = None;
    for i in 0..input.cands.len() {
        keep_best(&mut best, option_for(input, i));
    }
    best.unwrap_or_else(|| input.local_choice(0))
}
