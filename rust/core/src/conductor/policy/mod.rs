//! Prefill-instance selection, one file per policy. Every policy sees the same
//! [`PolicyInput`] (each prefill instance's queue and local prefix, every holder of the
//! prompt's prefix) and returns a [`Choice`] with its estimates; `schedule` then picks a
//! decode instance and applies admission. A policy's estimated TTFT of an instance is
//! `queue_s + transfer_s + prefill_s` of the option it would use there.
//!
//! Prefetch at decision time (`ConductorConfig::prefetch_staging_bytes`): a peer fetch
//! whose bytes fit the free staging memory of the candidate starts when the conductor
//! decides, into that instance's DRAM, while the request waits in its queue. Its
//! `transfer_s` is then only what the fetch adds past the queue (`max(0, fetch -
//! queue)`), priced on the links as loaded now rather than when the queue drains; a
//! fetch that does not fit starts at dequeue, as without prefetch.

mod load_balance;
mod local_cache_aware;
mod mooncake;
mod random;
mod ttft_optimal;

use super::config::PolicyKind;
use super::cost::CostModels;
use super::links::LinkLoads;
use crate::index::{InstanceId, PrefixMatch};

/// One prefill instance as a policy sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub id: InstanceId,
    /// Estimated seconds before it can start this request.
    pub queue_s: f64,
    /// Relative speed (prefill time is divided by it).
    pub speed: f64,
    /// Leading prompt blocks it holds, by tier.
    pub dram: usize,
    pub ssd: usize,
    pub gpu: usize,
    /// Bytes of staging memory free for a prefetch (0: prefetch off, or none free).
    pub stage_free_bytes: f64,
}

impl Candidate {
    pub fn local(&self) -> usize {
        self.gpu + self.dram + self.ssd
    }
}

pub struct PolicyInput<'a> {
    pub prompt_len: usize,
    pub block_size: usize,
    /// Sorted by id.
    pub cands: &'a [Candidate],
    /// Every instance (prefill or not) that holds at least the first block, sorted by id.
    pub matches: &'a [PrefixMatch],
    /// The longest of `matches` (ties: more in memory, more on the GPU, then lowest id).
    pub best: Option<PrefixMatch>,
    pub cost: &'a CostModels,
    pub balancing_threshold: f64,
    /// Current time (a fetch on candidate `c` starts at `now + c.queue_s`).
    pub now: f64,
    /// Link loads (None: fetches are priced on an idle network).
    pub links: Option<&'a LinkLoads>,
    /// Prefetch at decision time is on (`ConductorConfig::prefetch_staging_bytes > 0`):
    /// `mooncake` breaks ties between instances by the shorter queue.
    pub prefetch: bool,
}

impl PolicyInput<'_> {
    /// Prefill seconds on candidate `c` reusing `blocks` leading blocks.
    #[inline]
    pub fn prefill_s(&self, c: &Candidate, blocks: usize) -> f64 {
        self.cost.prefill.predict(self.prompt_len, self.tokens(blocks)) / c.speed
    }

    #[inline]
    pub fn tokens(&self, blocks: usize) -> usize {
        (blocks * self.block_size).min(self.prompt_len)
    }

    /// Seconds to fetch `tokens` (a share `ssd_fraction` from the holder's SSD) from
    /// `holder` to candidate `c`: the cost model's idle-link time, plus the wait behind
    /// the bytes queued on the fetch's bottleneck link when it would start.
    #[inline]
    pub fn fetch_s(&self, c: &Candidate, holder: InstanceId, tokens: usize, ssd_fraction: f64) -> f64 {
        let idle = self.cost.transfer.fetch(tokens, ssd_fraction);
        match self.links {
            Some(l) if tokens > 0 => idle + l.fetch_wait_s(holder, c.id, self.now + c.queue_s),
            _ => idle,
        }
    }

    /// Seconds a fetch of `tokens` from `holder` adds to candidate `c`'s TTFT, and
    /// whether it is a prefetch: one that fits `c`'s free staging memory starts now and
    /// runs while the request waits, so only the part past the queue counts; any other
    /// starts when the queue has drained (`fetch_s`).
    #[inline]
    pub fn peer_fetch_s(&self, c: &Candidate, holder: InstanceId, tokens: usize) -> (f64, bool) {
        let bytes = tokens as f64 * self.cost.transfer.bytes_per_token;
        if tokens == 0 || bytes > c.stage_free_bytes {
            return (self.fetch_s(c, holder, tokens, 0.0), false);
        }
        let idle = self.cost.transfer.fetch(tokens, 0.0);
        let full = match self.links {
            Some(l) => idle + l.fetch_wait_s(holder, c.id, self.now),
            None => idle,
        };
        ((full - c.queue_s).max(0.0), true)
    }

    /// A lower bound of `peer_fetch_s(c, _, tokens).0` over holders (the idle-link fetch,
    /// less the queue it may overlap): a fetch option whose bound cannot win need not be
    /// priced on the links.
    #[inline]
    pub fn peer_fetch_floor_s(&self, c: &Candidate, tokens: usize) -> f64 {
        let idle = self.cost.transfer.fetch(tokens, 0.0);
        if tokens > 0 && tokens as f64 * self.cost.transfer.bytes_per_token <= c.stage_free_bytes {
            (idle - c.queue_s).max(0.0)
        } else {
            idle
        }
    }

    /// The choice that reuses `c`'s local prefix and fetches nothing.
    pub fn local_choice(&self, idx: usize) -> Choice {
        let c = &self.cands[idx];
        Choice {
            idx,
            reused_blocks: c.local(),
            fetch_blocks: 0,
            fetch_from: None,
            queue_s: c.queue_s,
            prefill_s: self.prefill_s(c, c.local()),
            transfer_s: 0.0,
            local_load_s: 0.0,
            prefetch: false,
        }
    }
}

/// What a policy decided for the prefill side.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    /// Index into `PolicyInput::cands`.
    pub idx: usize,
    pub reused_blocks: usize,
    pub fetch_blocks: usize,
    pub fetch_from: Option<InstanceId>,
    pub queue_s: f64,
    pub prefill_s: f64,
    /// The transfer's share of the TTFT (with `prefetch`, only the part past the queue).
    pub transfer_s: f64,
    /// The part of `transfer_s` that loads the instance's own tiers (its SSD blocks,
    /// DRAM -> device): it holds the instance, whose store reads them on its own loop.
    /// The rest (a fetch from a peer) is the request's own wait: the instance computes
    /// other requests meanwhile, so it does not count in the queue of those after it.
    pub local_load_s: f64,
    /// The fetch starts at the decision, into the instance's staging memory.
    pub prefetch: bool,
}

impl Choice {
    #[inline]
    pub fn ttft(&self) -> f64 {
        self.queue_s + self.transfer_s + self.prefill_s
    }

    /// Seconds of the instance's time this option takes, i.e. what it adds to the queue
    /// of the requests after it: its compute and its own-tier loads, not a peer fetch
    /// (a request waiting for its fetch is set aside while the instance computes others).
    #[inline]
    pub fn work_s(&self) -> f64 {
        self.local_load_s + self.prefill_s
    }
}

/// Keeps the option with the strictly lowest TTFT (so ties go to the first seen).
#[inline]
pub(crate) fn keep_best(best: &mut Option<Choice>, c: Choice) {
    if best.is_none_or(|b| c.ttft() < b.ttft()) {
        *best = Some(c);
    }
}

/// Runs `kind`; `rng` is the random policy's state. None only without candidates.
pub fn choose(kind: PolicyKind, input: &PolicyInput<'_>, rng: &mut u64) -> Option<Choice> {
    if input.cands.is_empty() {
        return None;
    }
    Some(match kind {
        PolicyKind::Random => random::choose(input, rng),
        PolicyKind::LoadBalance => load_balance::choose(input),
        PolicyKind::LocalCacheAware => local_cache_aware::choose(input),
        PolicyKind::Mooncake => mooncake::choose(input),
        PolicyKind::TtftOptimal => ttft_optimal::choose(input),
    })
}

/// The TTFT `kind` estimates for candidate `idx` (the quantity it minimises; for
/// random and load_balance, the TTFT of the local-prefix choice). For tests and
/// simulator reports.
pub fn estimate_for(kind: PolicyKind, input: &PolicyInput<'_>, idx: usize) -> Choice {
    match kind {
        PolicyKind::Mooncake => mooncake::option_for(input, idx),
        PolicyKind::TtftOptimal => ttft_optimal::option_for(input, idx),
        _ => input.local_choice(idx),
    }
}
