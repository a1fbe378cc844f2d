//! `mooncake`: Algorithm 1 of the Mooncake paper (KVCache-centric scheduling), with the
//! fetch priced on the links as they are loaded.
//!
//! For each prefill instance with local prefix `l`: every other holder `h` of a longer
//! prefix `b_h` (with `b_h / l > balancing_threshold`; with `l = 0`, whenever `b_h > 0`)
//! is an option: fetch blocks `l..b_h` from `h` and prefill from `b_h`, priced as the
//! queue plus the fetch under the current link loads plus the prefill. The instance takes the fastest of
//! these and of prefilling from `l` (the fetch-vs-recompute decision). The lowest TTFT
//! over instances wins, ties to the lowest id. Tiers are ignored, as in the paper (a
//! block counts the same in DRAM or on SSD).
//!
//! The paper offers only the holders of the single longest prefix. With links loaded,
//! those are often the busy ones (an agent's latest step was just computed there, and
//! its KV stream to decode fills that NIC), and the paper's rule then either waits on
//! them or recomputes; a holder of a slightly shorter prefix on an idle NIC is usually
//! the better fetch (issue 25's 100 GB/s misses, BENCHMARKS.md).
//!
//! With prefetch at decision time on (`PolicyInput::peer_fetch_s`), a fetch that fits the
//! candidate's staging memory overlaps its queue: the option costs `max(queue, fetch) +
//! prefill` instead of `queue + fetch + prefill`. Estimates equal up to rounding then go
//! to the instance with the shorter queue, not the lower id.

use super::{keep_best, Choice, PolicyInput};

/// The option Algorithm 1 takes on candidate `idx`.
pub(super) fn option_for(input: &PolicyInput<'_>, idx: usize) -> Choice {
    option_below(input, idx, f64::INFINITY)
}

/// `option_for`, except that fetch options whose TTFT cannot be below `bound` (another
/// candidate's) are not priced on the links: the returned option may then differ, but
/// only where it cannot be chosen (its TTFT is >= `bound` either way).
fn option_below(input: &PolicyInput<'_>, idx: usize, bound: f64) -> Choice {
    let local = input.local_choice(idx);
    let c = &input.cands[idx];
    if input.best.is_none() {
        return local;
    }
    let l = c.local();
    let mut out = local;
    for h in input.matches {
        let b = h.total();
        if h.instance == c.id || b <= l || (b as f64) <= input.balancing_threshold * l as f64 {
            continue;
        }
        let fetch_tokens = input.tokens(b) - input.tokens(l);
        let prefill_s = input.prefill_s(c, b);
        // a fetch on idle links is a lower bound of one under load: when even that loses,
        // the link loads need not be looked at (most candidates, most of the time)
        let floor = local.queue_s + input.peer_fetch_floor_s(c, fetch_tokens) + prefill_s;
        if floor >= out.ttft() || floor >= bound {
            continue;
        }
        let (transfer_s, prefetch) = input.peer_fetch_s(c, h.instance, fetch_tokens);
        let fetch = Choice {
            reused_blocks: b,
            fetch_blocks: b - l,
            fetch_from: Some(h.instance),
            transfer_s,
            prefill_s,
            prefetch,
            ..local
        };
        if fetch.ttft() < out.ttft() {
            out = fetch;
        }
    }
    out
}

pub(super) fn choose(input: &PolicyInput<'_>) -> Choice {
    let mut best: Option<Choice> = None;
    for (i, c) in input.cands.iter().enumerate() {
        let bound = best.map_or(f64::INFINITY, |b| if input.prefetch { tie_bound(b.ttft()) } else { b.ttft() });
        // every option on `c` takes at least its queue: it cannot win (ties go to the
        // first seen; with prefetch, to the shorter queue, which this one is not), so its
        // fetch options need not be priced
        if c.queue_s >= bound {
            continue;
        }
        let o = option_below(input, i, bound);
        match best {
            // with prefetch, a fetch the queue hides costs `max(queue, fetch)`: every
            // instance whose queue is shorter than the fetch ties with an idle one, and
            // the idle one is taken (the busy instance's later requests would pay for it)
            Some(b)
                if input.prefetch && o.ttft() <= tie_bound(b.ttft()) && o.ttft() >= b.ttft() - tie_slack(b.ttft()) =>
            {
                if o.queue_s < b.queue_s {
                    best = Some(o);
                }
            }
            _ => keep_best(&mut best, o),
        }
    }
    best.unwrap_or_else(|| input.local_choice(0))
}

/// Estimates this close are a tie (floating-point rounding of `queue + (fetch - queue)`).
#[inline]
pub(super) fn tie_slack(ttft: f64) -> f64 {
    1e-9 * ttft.abs() + 1e-12
}

#[inline]
fn tie_bound(ttft: f64) -> f64 {
    ttft + tie_slack(ttft)
}
