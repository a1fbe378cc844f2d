//! The three steps of a decision (`Conductor::decide_with` runs them under the state
//! lock): [`candidates`] (what each prefill instance offers now), `estimate` (the
//! policy's prefill choice, the decode instance, calibrated TTFT/TBT: nothing written),
//! and `admit` (the state written for an admitted request). The rejection rules sit
//! between the last two (conductor.rs).

use super::admission::{select_decode, DecodeAsk};
use super::conductor::{Conductor, Decision, ScheduleRequest};
use super::policy::{self, Candidate, Choice, PolicyInput};
use super::state::{Member, Req, Stage, State};
use super::{ConductorError, RejectReason};
use crate::index::PrefixMatch;

/// What `estimate` found: the decision and what admitting it needs.
pub(super) struct Estimate {
    pub decision: Decision,
    /// A decode instance with room (false: every one is at its batch or KV capacity).
    pub room: bool,
    choice: Choice,
    /// Index of the decode instance in `State::decode`.
    decode_idx: usize,
    ask: DecodeAsk,
    out_pred: f64,
    /// The TTFT estimate without the latency floor or the scale (queue and own work in
    /// the cost model's seconds).
    raw_ttft_s: f64,
    raw_tbt_s: f64,
    /// The random policy's state after this decision (kept only when admitted).
    rng: u64,
}

/// The online calibration as one decision reads it (calibration.rs, service.rs).
#[derive(Debug, Clone, Copy)]
pub(super) struct Calibrated {
    /// Whether the calibration is on (the queue is then served first in, first out).
    pub enabled: bool,
    /// Real seconds per second of predicted prefill work.
    pub work_scale: f64,
    pub tbt_scale: f64,
    /// Seconds a first token takes beyond its queue and own work.
    pub floor_s: f64,
    /// The TTFT admission aims at (the SLO times the learned headroom).
    pub ttft_target: f64,
    /// First tokens the calibration has measured (a cold start trusts nothing yet).
    pub first_tokens: u64,
}

/// One candidate per prefill instance that takes requests: its queue at `now`, speed
/// and local prefix by tier, the prefix an admitted request will leave there counted
/// as DRAM (`pending.rs`; only prefixes longer than `floor`, the index's best, are
/// looked up: a shorter one would not change the choice the index already offers),
/// and the prefix an admitted fetch is bringing there, however long (it saves the
/// same fetch: the index learns the fetched blocks only once they are stored). Where
/// such a prefix is made by a queued request with a fetch, the queue is at least the
/// time until that request's predicted prefill end (its fetch is not in the queue).
/// With the calibration on, the queue is the instance's first-in-first-out backlog at
/// its measured speed, in the cost model's seconds (divided by the scale again: the
/// estimate multiplies the whole TTFT by it). `stage_cap` is the staging memory for
/// prefetches per instance (0: prefetch off).
pub(super) fn candidates(
    st: &State,
    req: &ScheduleRequest<'_>,
    matches: &[PrefixMatch],
    floor: usize,
    cal: &Calibrated,
    stage_cap: f64,
    cands: &mut Vec<Candidate>,
) {
    let now = req.now;
    cands.clear();
    let mut mi = 0;
    for p in &st.prefill {
        while mi < matches.len() && matches[mi].instance < p.id {
            mi += 1;
        }
        if p.draining {
            continue; // takes no new request (a policy still sees it as a fetch source via `matches`)
        }
        let (dram, ssd, gpu) = match matches.get(mi) {
            Some(m) if m.instance == p.id => (m.dram, m.ssd, m.gpu),
            _ => (0, 0, 0),
        };
        let queue_s = if cal.enabled { p.fifo_queue_s(now, cal.work_scale) / cal.work_scale } else { p.queue_s(now) };
        let stage_free_bytes = (stage_cap - p.staged_bytes).max(0.0);
        cands.push(Candidate { id: p.id, queue_s, speed: p.spec.speed, dram, ssd, gpu, stage_free_bytes });
    }
    let reqs = &st.reqs;
    let mut count = |inst, n, rid| {
        if let Ok(k) = cands.binary_search_by_key(&inst, |c: &Candidate| c.id) {
            let c = &mut cands[k];
            if n > c.local() {
                c.dram += n - c.local();
                // the prefix is made by a queued request that fetches: that request does
                // not hold the instance while its fetch runs (the instance computes others
                // meanwhile), so the queue's computes may end before its prefill does; a
                // request building on it starts no earlier than its predicted end
                if let Some(r) = reqs.get(&rid).filter(|r| r.stage == Stage::Queued && r.fetch_last.is_some()) {
                    c.queue_s = c.queue_s.max(r.admit_t + r.raw_ttft_s - now);
                }
            }
        }
    };
    st.pending.longest(req.block_hashes, floor, &mut count);
    st.fetching.longest(req.block_hashes, 0, &mut count);
}

impl Conductor {
    /// The policy's choice among `cands`, the fetch's abandon bound, the output-length
    /// prediction, the decode instance and the calibrated estimates. Writes nothing.
    pub(super) fn estimate(
        &self,
        st: &State,
        req: &ScheduleRequest<'_>,
        matches: &[PrefixMatch],
        best: Option<PrefixMatch>,
        cands: &[Candidate],
        cal: Calibrated,
    ) -> Result<Estimate, ConductorError> {
        let cfg = &self.config;
        let now = req.now;
        let input = PolicyInput {
            prompt_len: req.prompt_len,
            block_size: cfg.block_size,
            cands,
            matches,
            best,
            cost: &cfg.cost,
            balancing_threshold: cfg.balancing_threshold,
            now,
            links: st.links.as_ref(),
            prefetch: cfg.prefetch_staging_bytes > 0.0,
        };
        let overloaded = |reason: RejectReason, detail: &str| ConductorError::Overloaded {
            reason,
            detail: detail.into(),
            estimates: None,
        };
        let mut rng = st.rng;
        let Some(choice) = policy::choose(cfg.policy, &input, &mut rng) else {
            return Err(overloaded(
                RejectReason::NoPrefillInstance,
                "no prefill instance registered (or all are draining)",
            ));
        };
        let fetch_abandon_s = if choice.fetch_blocks > 0 {
            let c = &cands[choice.idx];
            (input.prefill_s(c, choice.reused_blocks - choice.fetch_blocks) - choice.prefill_s).max(0.0)
        } else {
            f64::INFINITY
        };
        let out_pred = match req.expected_output_len {
            Some(n) if n > cfg.max_output_len => {
                return Err(ConductorError::InvalidArgument(format!(
                    "expected_output_len {n} exceeds max_output_len {} (ConductorConfig)",
                    cfg.max_output_len
                )));
            }
            Some(n) => n as f64,
            None => self.outlen.lock().predict(req.block_hashes.first().copied()),
        };
        // queue + transfer + prefill at the instances' measured speed, plus what every
        // first token takes besides (service.rs)
        let raw_ttft_s = choice.ttft();
        let ttft = cal.floor_s + raw_ttft_s * cal.work_scale;
        let ask = DecodeAsk { prompt_len: req.prompt_len, out_pred, arrive_t: now + ttft };
        let Some(pick) = select_decode(&st.decode, cfg.rejection, &cfg.cost.decode, &ask) else {
            return Err(overloaded(
                RejectReason::NoDecodeInstance,
                "no decode instance registered (or all are draining)",
            ));
        };
        let decision = Decision {
            prefill: cands[choice.idx].id,
            decode: st.decode[pick.idx].id,
            reused_blocks: choice.reused_blocks,
            fetch_blocks: choice.fetch_blocks,
            fetch_from: choice.fetch_from,
            est_queue_s: choice.queue_s,
            est_prefill_s: choice.prefill_s,
            est_transfer_s: choice.transfer_s,
            est_ttft_s: ttft,
            est_tbt_s: pick.tbt * cal.tbt_scale,
            retry_after_s: 0.0,
            fetch_abandon_s,
            prefetch: choice.prefetch,
        };
        Ok(Estimate {
            decision,
            room: pick.room,
            choice,
            decode_idx: pick.idx,
            ask,
            out_pred,
            raw_ttft_s,
            raw_tbt_s: pick.tbt,
            rng,
        })
    }

    /// Writes an admitted request into the state: its transfers on the link loads, the
    /// prefill queue, the decode batch, its pending prefix and its record.
    ///
    /// The replica its fetch creates is not written into the index here: the blocks
    /// are not on the prefill instance yet, and a later request that planned a fetch
    /// from there (or a replication hint that counted them) would find nothing and
    /// recompute. The index learns them when the instance reports them stored (the
    /// simulator on arrival, the serving `Cluster` through its store events when the
    /// fetch commits). Until then only the instance itself counts them as its own
    /// (`State::fetching`): a request routed there runs after this one, so after its
    /// fetch.
    pub(super) fn admit(
        &self,
        st: &mut State,
        req: &ScheduleRequest<'_>,
        est: &Estimate,
    ) -> Result<(), ConductorError> {
        let cfg = &self.config;
        let (d, choice) = (&est.decision, &est.choice);
        // `cands` skips draining instances, so the policy's index is not the table's
        let pi = st.prefill_pos(d.prefill).map_err(|_| ConductorError::UnknownInstance(d.prefill))?;
        self.plan_links(st, req, d);
        let staged_bytes =
            if d.prefetch { self.fetch_tokens(req, d) as f64 * cfg.cost.transfer.bytes_per_token } else { 0.0 };
        // what it takes of the instance's time: a peer fetch is the request's own wait
        // (the instance computes other requests meanwhile), so it is not in the queue
        let work_s = choice.work_s();
        st.prefill[pi].queued_s += work_s;
        st.prefill[pi].queued_n += 1;
        st.prefill[pi].staged_bytes += staged_bytes;
        let tbt_s = tbt_or(d.est_tbt_s, cfg.tbt_slo_s);
        let ask = &est.ask;
        let member = Member {
            rid: req.request_id,
            arrive_t: ask.arrive_t,
            end_t: ask.arrive_t + est.out_pred * tbt_s,
            ctx: ask.ctx(),
        };
        let dec = &mut st.decode[est.decode_idx];
        dec.members.push(member);
        dec.kv_reserved += ask.kv_tokens();
        dec.ctx_tokens += member.ctx;
        st.pending.add(req.block_hashes, d.prefill, req.request_id);
        let fetch_last = if choice.fetch_blocks > 0 {
            st.fetching.add(&req.block_hashes[..choice.reused_blocks], d.prefill, req.request_id);
            Some(req.block_hashes[choice.reused_blocks - 1])
        } else {
            None
        };
        st.reqs.insert(
            req.request_id,
            Req {
                prefill: d.prefill,
                decode: d.decode,
                stage: Stage::Queued,
                work_s,
                kv_tokens: ask.kv_tokens(),
                out_pred: est.out_pred,
                tbt_s,
                key: req.block_hashes.first().copied(),
                admit_t: req.now,
                raw_ttft_s: est.raw_ttft_s,
                raw_tbt_s: est.raw_tbt_s,
                decode_t: None,
                pending_last: req.block_hashes.last().copied(),
                fetch_last,
                staged_bytes,
            },
        );
        st.rng = est.rng;
        st.clock = st.clock.max(req.now);
        Ok(())
    }

    /// Tokens of the decision's fetch (0 without one).
    fn fetch_tokens(&self, req: &ScheduleRequest<'_>, d: &Decision) -> usize {
        let bs = self.config.block_size;
        (d.reused_blocks * bs).min(req.prompt_len) - ((d.reused_blocks - d.fetch_blocks) * bs).min(req.prompt_len)
    }

    /// An admitted request's transfers on the link loads: its fetch (holder NIC out,
    /// prefill NIC in) now when it is a prefetch, else when its prefill is expected to
    /// start; its KV stream to decode (prefill NIC out, decode NIC in) when its compute is.
    fn plan_links(&self, st: &mut State, req: &ScheduleRequest<'_>, d: &Decision) {
        let tokens = self.fetch_tokens(req, d);
        let Some(links) = st.links.as_mut() else { return };
        let bpt = self.config.cost.transfer.bytes_per_token;
        let start = req.now + d.est_queue_s;
        if let Some(src) = d.fetch_from {
            let fetch_start = if d.prefetch { req.now } else { start };
            links.plan_transfer(src, d.prefill, fetch_start, tokens as f64 * bpt);
        }
        links.plan_transfer(d.prefill, d.decode, start + d.est_transfer_s, req.prompt_len as f64 * bpt);
    }
}

/// A finite TBT for load predictions (an over-full instance under `none` still decodes).
fn tbt_or(tbt: f64, slo: f64) -> f64 {
    if tbt.is_finite() {
        tbt
    } else {
        slo
    }
}
