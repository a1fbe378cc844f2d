//! The conductor: `schedule` (policy, decode selection, admission, commit) and the
//! types it returns. Registry, progress events and snapshots are in `events.rs`.
//!
//! Concurrency: one `Mutex` over the scheduling state; the prefix match runs before it
//! is taken (the index has its own sharded locks). Lock order: state, then the index,
//! then the hot-prefix table. A rejected or failed `schedule` changes nothing: all
//! estimates are computed first and the state is written only once the request is
//! admitted.

use std::cell::RefCell;
use std::sync::Arc;

use parking_lot::Mutex;

use super::admission::{decode_free_in, select_decode, DecodeAsk, OutputLenEstimator, RejectReason};
use super::calibration::Calibration;
use super::config::{ConductorConfig, RejectionKind};
use super::links::LinkLoads;
use super::policy::{self, Candidate, PolicyInput};
use super::replication::HotTable;
use super::state::{Member, Req, Stage, State};
use super::{ConductorError, RequestId};
use crate::hash::BlockHash;
use crate::index::{best_of, BlockIndex, InstanceId, PrefixMatch, Tier};

/// Where a request goes, and the estimates behind the choice.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    pub prefill: InstanceId,
    pub decode: InstanceId,
    /// Leading prompt blocks the prefill instance will use (local + fetched).
    pub reused_blocks: usize,
    /// Blocks to pull from `fetch_from` first (0 and None when none).
    pub fetch_blocks: usize,
    pub fetch_from: Option<InstanceId>,
    pub est_queue_s: f64,
    pub est_prefill_s: f64,
    pub est_transfer_s: f64,
    pub est_ttft_s: f64,
    pub est_tbt_s: f64,
    /// On a rejection: seconds after which the request may be admitted (the predicted
    /// drain time of the prefill queue that refused it, at least the TTFT estimate's
    /// excess over its target; or until a decode instance is predicted to free a
    /// place); 0 for an admitted request.
    pub retry_after_s: f64,
    /// With a fetch: seconds after the fetch starts past which the prefill instance
    /// should give it up and recompute (the recompute time of the fetched blocks: by
    /// then the fetch has cost what it was to save, so the loss is at most 2x). Infinite
    /// without a fetch.
    pub fetch_abandon_s: f64,
}

/// The arguments of `schedule`.
#[derive(Debug, Clone, Copy)]
pub struct ScheduleRequest<'a> {
    pub request_id: RequestId,
    /// Hashes of the prompt's full blocks, in order.
    pub block_hashes: &'a [BlockHash],
    pub prompt_len: usize,
    /// Current time, seconds (a virtual clock in simulation).
    pub now: f64,
    pub expected_output_len: Option<usize>,
}

/// One prefill instance's load, read-only.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillLoad {
    pub id: InstanceId,
    pub speed: f64,
    pub queued: usize,
    pub running: usize,
    pub queue_s: f64,
    /// Draining (`drain_instance`): takes no new request.
    pub draining: bool,
}

/// One decode instance's load, read-only.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeLoad {
    pub id: InstanceId,
    pub max_batch: usize,
    pub kv_capacity_tokens: usize,
    /// Requests assigned (decoding or on their way).
    pub batch: usize,
    pub decoding: usize,
    pub kv_reserved_tokens: usize,
    /// Predicted step time with the assigned batch.
    pub est_tbt_s: f64,
    /// Draining (`drain_instance`): takes no new request.
    pub draining: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub now: f64,
    pub prefill: Vec<PrefillLoad>,
    pub decode: Vec<DecodeLoad>,
    pub requests: usize,
}

pub struct Conductor {
    pub(crate) config: ConductorConfig,
    pub(crate) index: Arc<BlockIndex>,
    pub(crate) state: Mutex<State>,
    pub(crate) outlen: Mutex<OutputLenEstimator>,
    pub(crate) hot: Mutex<HotTable>,
    /// Lock order: after `state`.
    pub(crate) calibration: Mutex<Calibration>,
}

thread_local! {
    static SCRATCH: RefCell<(Vec<PrefixMatch>, Vec<Candidate>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

pub(crate) fn check_time(now: f64) -> Result<(), ConductorError> {
    if now.is_finite() {
        Ok(())
    } else {
        Err(ConductorError::InvalidArgument(format!("now must be a finite time in seconds, got {now}")))
    }
}

impl Conductor {
    /// A conductor with its own, empty block index.
    pub fn new(config: ConductorConfig) -> Result<Self, ConductorError> {
        Self::with_index(config, Arc::new(BlockIndex::new()))
    }

    /// A conductor over a shared block index.
    pub fn with_index(config: ConductorConfig, index: Arc<BlockIndex>) -> Result<Self, ConductorError> {
        config.validate()?;
        Ok(Conductor {
            state: Mutex::new(State::new(
                config.seed,
                config.contention_aware.then(|| LinkLoads::new(config.cost.transfer.network_bandwidth, config.cost.transfer.ssd_bandwidth)),
            )),
            outlen: Mutex::new(OutputLenEstimator::new(config.default_output_len, config.output_len_ewma, 1 << 16, config.max_output_len)),
            hot: Mutex::new(HotTable::new(config.hot_half_life_s, config.hot_capacity)),
            calibration: Mutex::new(Calibration::default()),
            index,
            config,
        })
    }

    pub fn config(&self) -> &ConductorConfig {
        &self.config
    }

    pub fn index(&self) -> &Arc<BlockIndex> {
        &self.index
    }

    /// Turns the online calibration of the admission estimates on or off
    /// (calibration.rs); off, the decisions carry the cost models' estimates as they are.
    pub fn set_online_calibration(&self, enabled: bool) {
        self.calibration.lock().enabled = enabled;
    }

    /// (TTFT scale, TBT scale) the admission applies to the cost models' estimates now.
    pub fn calibration_scales(&self, now: f64) -> (f64, f64) {
        self.calibration.lock().scales(now)
    }

    /// Chooses the prefill and decode instances of a request and admits it (it then
    /// counts in their loads), or rejects it with `Overloaded` and changes nothing.
    pub fn schedule(&self, req: &ScheduleRequest<'_>) -> Result<Decision, ConductorError> {
        self.decide(req, true)
    }

    /// What `schedule` would decide now, without admitting anything.
    pub fn preview(&self, req: &ScheduleRequest<'_>) -> Result<Decision, ConductorError> {
        self.decide(req, false)
    }

    fn validate(&self, req: &ScheduleRequest<'_>) -> Result<(), ConductorError> {
        check_time(req.now)?;
        if req.prompt_len == 0 {
            return Err(ConductorError::InvalidArgument("prompt_len must be > 0".into()));
        }
        if req.block_hashes.len().saturating_mul(self.config.block_size) > req.prompt_len {
            return Err(ConductorError::InvalidArgument(format!(
                "{} full blocks of {} tokens do not fit in prompt_len {}",
                req.block_hashes.len(),
                self.config.block_size,
                req.prompt_len
            )));
        }
        Ok(())
    }

    fn decide(&self, req: &ScheduleRequest<'_>, commit: bool) -> Result<Decision, ConductorError> {
        self.validate(req)?;
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            let (matches, cands) = &mut *s;
            self.index.match_prefix_into(req.block_hashes, matches);
            self.decide_with(req, commit, matches, cands)
        })
    }

    fn decide_with(
        &self,
        req: &ScheduleRequest<'_>,
        commit: bool,
        matches: &[PrefixMatch],
        cands: &mut Vec<Candidate>,
    ) -> Result<Decision, ConductorError> {
        let cfg = &self.config;
        let now = req.now;
        let mut st = self.state.lock();
        if st.reqs.contains_key(&req.request_id) {
            return Err(ConductorError::DuplicateRequest(req.request_id));
        }
        let best = best_of(matches);
        candidates(&st, req, matches, best.map_or(0, |b| b.total()), cands);
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
        };
        let mut rng = st.rng;
        let overloaded = |reason: RejectReason, detail: String, est: Option<Decision>| ConductorError::Overloaded {
            reason,
            detail,
            estimates: est.map(Box::new),
        };
        let Some(choice) = policy::choose(cfg.policy, &input, &mut rng) else {
            return Err(overloaded(RejectReason::NoPrefillInstance, "no prefill instance registered (or all are draining)".into(), None));
        };
        let fetch_abandon_s = if choice.fetch_blocks > 0 {
            let c = &cands[choice.idx];
            (input.prefill_s(c, choice.reused_blocks - choice.fetch_blocks) - choice.prefill_s).max(0.0)
        } else {
            f64::INFINITY
        };
        let key = req.block_hashes.first().copied();
        let out_pred = match req.expected_output_len {
            Some(n) if n > cfg.max_output_len => {
                return Err(ConductorError::InvalidArgument(format!(
                    "expected_output_len {n} exceeds max_output_len {} (ConductorConfig)",
                    cfg.max_output_len
                )));
            }
            Some(n) => n as f64,
            None => self.outlen.lock().predict(key),
        };
        let raw_ttft = choice.ttft();
        let (ttft_scale, tbt_scale, ttft_target) = {
            let cal = self.calibration.lock();
            let (a, b) = cal.scales(now);
            (a, b, cal.ttft_target(cfg.ttft_slo_s, now))
        };
        let ttft = raw_ttft * ttft_scale;
        let ask = DecodeAsk { prompt_len: req.prompt_len, out_pred, arrive_t: now + ttft };
        let Some(pick) = select_decode(&st.decode, cfg.rejection, &cfg.cost.decode, &ask) else {
            return Err(overloaded(RejectReason::NoDecodeInstance, "no decode instance registered (or all are draining)".into(), None));
        };
        let (di, raw_tbt) = (pick.idx, pick.tbt);
        let tbt = raw_tbt * tbt_scale;
        let prefill_id = cands[choice.idx].id;
        let decision = Decision {
            prefill: prefill_id,
            decode: st.decode[di].id,
            reused_blocks: choice.reused_blocks,
            fetch_blocks: choice.fetch_blocks,
            fetch_from: choice.fetch_from,
            est_queue_s: choice.queue_s,
            est_prefill_s: choice.prefill_s,
            est_transfer_s: choice.transfer_s,
            est_ttft_s: ttft,
            est_tbt_s: tbt,
            retry_after_s: 0.0,
            fetch_abandon_s,
        };
        if cfg.rejection != RejectionKind::None {
            let admit = Admit { room: pick.room, ttft_target, ttft_scale, now };
            if let Some((reason, detail, retry_after_s)) = self.rejection(&st.decode, &decision, &admit) {
                return Err(overloaded(reason, detail, Some(Decision { retry_after_s, ..decision })));
            }
        }
        if !commit {
            return Ok(decision);
        }
        // `cands` skips draining instances, so its index is not the table's
        let pi = st.prefill_pos(prefill_id).map_err(|_| ConductorError::UnknownInstance(prefill_id))?;
        // Admitted: record the replica the fetch creates, then the loads.
        if choice.fetch_blocks > 0 {
            let local = choice.reused_blocks - choice.fetch_blocks;
            self.index.insert(prefill_id, &req.block_hashes[local..choice.reused_blocks], Tier::Dram)?;
        }
        self.plan_links(&mut st, req, &decision);
        let work_s = choice.transfer_s + choice.prefill_s;
        st.prefill[pi].queued_s += work_s;
        st.prefill[pi].queued_n += 1;
        let member = Member { rid: req.request_id, arrive_t: ask.arrive_t, end_t: ask.arrive_t + out_pred * tbt_or(tbt, cfg), ctx: ask.ctx() };
        let d = &mut st.decode[di];
        d.members.push(member);
        d.kv_reserved += ask.kv_tokens();
        d.ctx_tokens += member.ctx;
        let pending_last = req.block_hashes.last().copied();
        st.pending.add(req.block_hashes, prefill_id, req.request_id);
        st.reqs.insert(
            req.request_id,
            Req {
                prefill: prefill_id,
                decode: decision.decode,
                stage: Stage::Queued,
                work_s,
                kv_tokens: ask.kv_tokens(),
                out_pred,
                tbt_s: tbt_or(tbt, cfg),
                key,
                admit_t: now,
                raw_ttft_s: raw_ttft,
                raw_tbt_s: raw_tbt,
                decode_t: None,
                pending_last,
            },
        );
        st.rng = rng;
        st.clock = st.clock.max(now);
        drop(st);
        if choice.reused_blocks > 0 {
            self.hot.lock().record(&req.block_hashes[..choice.reused_blocks], now);
        }
        Ok(decision)
    }

    /// An admitted request's transfers on the link loads: its fetch (holder NIC out,
    /// prefill NIC in) when its prefill is expected to start, its KV stream to decode
    /// (prefill NIC out, decode NIC in) when its compute is.
    fn plan_links(&self, st: &mut State, req: &ScheduleRequest<'_>, d: &Decision) {
        let Some(links) = st.links.as_mut() else { return };
        let bpt = self.config.cost.transfer.bytes_per_token;
        let start = req.now + d.est_queue_s;
        if let Some(src) = d.fetch_from {
            let tokens = (d.reused_blocks * self.config.block_size).min(req.prompt_len)
                - ((d.reused_blocks - d.fetch_blocks) * self.config.block_size).min(req.prompt_len);
            links.plan_transfer(src, d.prefill, start, tokens as f64 * bpt);
        }
        links.plan_transfer(d.prefill, d.decode, start + d.est_transfer_s, req.prompt_len as f64 * bpt);
    }
}

/// One candidate per prefill instance that takes requests: its queue at `now`, speed
/// and local prefix by tier, the prefix an admitted request will leave there counted
/// as DRAM (`pending.rs`; only prefixes longer than `floor`, the index's best, are
/// looked up: a shorter one would not change the choice the index already offers).
fn candidates(st: &State, req: &ScheduleRequest<'_>, matches: &[PrefixMatch], floor: usize, cands: &mut Vec<Candidate>) {
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
        cands.push(Candidate { id: p.id, queue_s: p.queue_s(now), speed: p.spec.speed, dram, ssd, gpu });
    }
    st.pending.longest(req.block_hashes, floor, |inst, n| {
        if let Ok(k) = cands.binary_search_by_key(&inst, |c| c.id) {
            let c = &mut cands[k];
            if n > c.local() {
                c.dram += n - c.local();
            }
        }
    });
}

/// What the rejection rules need besides the decision.
struct Admit {
    /// Whether the chosen decode instance has room.
    room: bool,
    /// The TTFT admission aims at (the SLO times the learned headroom, calibration.rs).
    ttft_target: f64,
    /// The calibration's TTFT scale (measured over predicted).
    ttft_scale: f64,
    now: f64,
}

impl Conductor {
    /// Why the admission rejects `d` (reason, detail, seconds to retry after), or None.
    /// The checks in order: TTFT over its target, no decode instance with room, TBT over
    /// its SLO. Every estimate here is finite (calibrated when that is on).
    fn rejection(
        &self,
        decode: &[super::state::DecodeInst],
        d: &Decision,
        a: &Admit,
    ) -> Option<(RejectReason, String, f64)> {
        let cfg = &self.config;
        let (room, now) = (a.room, a.now);
        if d.est_ttft_s > a.ttft_target {
            let target = if a.ttft_target < cfg.ttft_slo_s {
                format!("the admission target {:.4}s (the SLO {}s less the margin its misses ask for)", a.ttft_target, cfg.ttft_slo_s)
            } else {
                format!("the SLO {}s", cfg.ttft_slo_s)
            };
            let detail = format!("estimated TTFT {:.4}s (queue {:.4}s) exceeds {target}", d.est_ttft_s, d.est_queue_s);
            // The wait: until the queue ahead has drained (its predicted time, calibrated),
            // and at least until the estimate would be back under the target. The queue
            // drains at about real time; waiting only the excess would send every
            // rejected client back while the queue that refused it is still there.
            let drain = d.est_queue_s * a.ttft_scale;
            return Some((RejectReason::TtftSlo, detail, drain.max(d.est_ttft_s - a.ttft_target)));
        }
        if !room {
            let di = decode.iter().position(|x| x.id == d.decode);
            let what = di.map_or(String::new(), |i| {
                let x = &decode[i];
                format!(
                    " (decode instance {}: {} of {} requests, {} of {} KV tokens reserved)",
                    x.id,
                    x.members.len(),
                    x.spec.max_batch,
                    x.kv_reserved,
                    x.spec.kv_capacity_tokens
                )
            });
            let detail = format!("every decode instance is at its batch or KV capacity{what}");
            return Some((RejectReason::DecodeCapacity, detail, decode_free_in(decode, now)));
        }
        if d.est_tbt_s > cfg.tbt_slo_s {
            let detail = format!("predicted TBT {:.4}s exceeds the SLO {}s", d.est_tbt_s, cfg.tbt_slo_s);
            return Some((RejectReason::TbtSlo, detail, decode_free_in(decode, now)));
        }
        None
    }
}

/// A finite TBT for load predictions (an over-full instance under `none` still decodes).
fn tbt_or(tbt: f64, cfg: &ConductorConfig) -> f64 {
    if tbt.is_finite() {
        tbt
    } else {
        cfg.tbt_slo_s
    }
}
