//! `ttft_optimal` (ours): the lowest estimated TTFT over every way to serve the prefix,
//! with the tiers priced in and no balancing threshold.
//!
//! On each instance it compares: recomputing everything; reusing its local prefix
//! (paying the load of each tier: nothing for GPU-resident blocks, the DRAM -> device
//! copy for DRAM ones, the SSD read for SSD ones); and fetching the longer prefix of
//! every other holder (network time, at SSD speed for the share the holder keeps on SSD,
//! plus the local prefix's load). Algorithm 1 instead looks only at the single best holder,
//! counts SSD blocks as free, and needs a hand-tuned threshold to avoid hot spots; here
//! the queue term alone balances the load, because a fetch is chosen only where it wins.

use super::{keep_best, Choice, PolicyInput};

pub(super) fn option_for(input: &PolicyInput<'_>, idx: usize) -> Choice {
    let c = &input.cands[idx];
    let t = &input.cost.transfer;
    let l = c.local();
    // token counts per tier of the local prefix (the last block may be partial)
    let (gpu_tokens, mem_tokens) = (input.tokens(c.gpu), input.tokens(c.gpu + c.dram));
    let local_load_s = t.local_ssd(input.tokens(l) - mem_tokens) + t.local_dram(mem_tokens - gpu_tokens);
    let mut best = None;
    keep_best(&mut best, Choice { reused_blocks: 0, prefill_s: input.prefill_s(c, 0), ..input.local_choice(idx) });
    keep_best(&mut best, Choice { transfer_s: local_load_s, local_load_s, ..input.local_choice(idx) });
    for h in input.matches {
        let b = h.total();
        if h.instance == c.id || b <= l {
            continue;
        }
        let ssd_fraction = h.ssd as f64 / b as f64;
        let fetch_tokens = input.tokens(b) - input.tokens(l);
        // the idle-link fetch bounds the loaded one from below: skip the link loads
        // when even that cannot win
        let floor = c.queue_s + local_load_s + t.fetch(fetch_tokens, ssd_fraction) + input.prefill_s(c, b);
        if best.is_some_and(|x: Choice| floor >= x.ttft()) {
            continue;
        }
        keep_best(
            &mut best,
            Choice {
                idx,
                reused_blocks: b,
                fetch_blocks: b - l,
                fetch_from: Some(h.instance),
                queue_s: c.queue_s,
                prefill_s: input.prefill_s(c, b),
                transfer_s: local_load_s + input.fetch_s(c, h.instance, fetch_tokens, ssd_fraction),
                local_load_s,
                prefetch: false,
            },
        );
    }
    best.unwrap_or_else(|| input.local_choice(idx))
}

pub(super) fn choose(input: &PolicyInput<'_>) -> Choice {
    let mut best = None;
    for i in 0..input.cands.len() {
        keep_best(&mut best, option_for(input, i));
    }
    best.unwrap_or_else(|| input.local_choice(0))
}
