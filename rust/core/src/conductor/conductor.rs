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

use super::admission::{decode_free_in, OutputLenEstimator, RejectReason};
use super::calibration::Calibration;
use super::config::{ConductorConfig, RejectionKind};
use super::decide::{candidates, Calibrated};
use super::links::LinkLoads;
use super::policy::Candidate;
use super::replication::HotTable;
use super::state::State;

use super::{ConductorError, RequestId};
use crate::hash::BlockHash;
use crate::index::{best_of, BlockIndex, InstanceId, PrefixMatch};

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
    /// without a fetch. With `prefetch`, counted from when the request leaves its queue
    /// (the wait the fetch adds from then on).
    pub fetch_abandon_s: f64,
    /// Start the fetch now, into the prefill instance's staging memory, while the request
    /// waits in its queue (`ConductorConfig::prefetch_staging_bytes`); `est_transfer_s`
    /// is then what the fetch is expected to add past the queue. False: fetch at dequeue.
    pub prefetch: bool,
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
                config.contention_aware.then(|| {
                    LinkLoads::new(config.cost.transfer.network_bandwidth, config.cost.transfer.ssd_bandwidth)
                }),
            )),
            outlen: Mutex::new(OutputLenEstimator::new(
                config.default_output_len,
                config.output_len_ewma,
                1 << 16,
                config.max_output_len,
            )),
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

    /// (prefill work scale, TBT scale) the admission applies to the cost models'
    /// estimates now (the TTFT estimate is `floor + work scale x (queue + work)`).
    pub fn calibration_scales(&self, now: f64) -> (f64, f64) {
        self.calibration.lock().scales(now)
    }

    /// Seconds the calibration adds to every TTFT estimate now: what a first token
    /// takes beyond its queue and own work on this cluster (0 with calibration off).
    pub fn calibration_floor(&self, now: f64) -> f64 {
        self.calibration.lock().floor_s(now)
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

    /// One decision in three steps (decide.rs): the candidates (each prefill instance's
    /// queue and local prefix, pending prefixes included), the estimate (policy,
    /// decode instance, calibrated TTFT/TBT), then admission: the rejection rules, and,
    /// when `commit`, the state written (loads, link plans, replica, pending prefix).
    fn decide_with(
        &self,
        req: &ScheduleRequest<'_>,
        commit: bool,
        matches: &[PrefixMatch],
        cands: &mut Vec<Candidate>,
    ) -> Result<Decision, ConductorError> {
        let mut st = self.state.lock();
        if st.reqs.contains_key(&req.request_id) {
            return Err(ConductorError::DuplicateRequest(req.request_id));
        }
        let cal = {
            let c = self.calibration.lock();
            let (work_scale, tbt_scale) = c.scales(req.now);
            Calibrated {
                enabled: c.enabled,
                work_scale,
                tbt_scale,
                floor_s: c.floor_s(req.now),
                ttft_target: c.ttft_target(self.config.ttft_slo_s, req.now),
                first_tokens: c.floor.samples(),
            }
        };
        let best = best_of(matches);
        candidates(&st, req, matches, best.map_or(0, |b| b.total()), &cal, self.config.prefetch_staging_bytes, cands);
        let est = self.estimate(&st, req, matches, best, cands, cal)?;
        if self.config.rejection != RejectionKind::None {
            let admit =
                Admit { room: est.room, ttft_target: cal.ttft_target, ttft_scale: cal.work_scale, now: req.now };
            let probe = self.probing(&st, &cal, &est.decision);
            if let Some((reason, detail, retry_after_s)) =
                probe.or_else(|| self.rejection(&st.decode, &est.decision, &admit))
            {
                return Err(ConductorError::Overloaded {
                    reason,
                    detail,
                    estimates: Some(Box::new(Decision { retry_after_s, ..est.decision })),
                });
            }
        }
        if !commit {
            return Ok(est.decision);
        }
        self.admit(&mut st, req, &est)?;
        drop(st);
        if est.decision.reused_blocks > 0 {
            self.hot.lock().record(&req.block_hashes[..est.decision.reused_blocks], req.now);
        }
        Ok(est.decision)
    }
}

/// First tokens the online calibration measures before admission trusts its estimates
/// (`Conductor::probing`).
pub const PROBE_FIRST_TOKENS: u64 = 8;
/// How many times slower than the cost model a cold cluster may turn out to be (a CPU
/// host under load measured 5-30x).
pub const PROBE_SCALE: f64 = 10.0;

/// What the rejection rules need besides the decision.
struct Admit {
    /// Whether the chosen decode instance has room.
    room: bool,
    /// The TTFT admission aims at (the SLO times the learned headroom, calibration.rs).
    ttft_target: f64,
    /// The calibration's prefill work scale (real seconds per predicted second).
    ttft_scale: f64,
    now: f64,
}

impl Conductor {
    /// A cold start (calibration on, fewer than [`PROBE_FIRST_TOKENS`] first tokens
    /// measured): the estimates are still the cost model's, which on a CPU host priced a
    /// prefill at a fifth of what it took, and at 4x overload the first half second
    /// admitted a queue that took 350 ms. So until the cluster has measured itself, a
    /// request joins a prefill instance's queue only when its estimate with the work
    /// taking [`PROBE_SCALE`] times the model's still meets the target; onto an idle
    /// instance it goes anyway (a queue of 0 is the one estimate the model cannot get
    /// wrong), which measures the latency floor and the service cost at once.
    fn probing(&self, st: &State, cal: &Calibrated, d: &Decision) -> Option<(RejectReason, String, f64)> {
        if !cal.enabled || cal.first_tokens >= PROBE_FIRST_TOKENS {
            return None;
        }
        let p = &st.prefill[st.prefill_pos(d.prefill).ok()?];
        let pessimistic = d.est_ttft_s * (PROBE_SCALE / cal.work_scale).max(1.0);
        if p.queued_n + p.running.len() == 0 || pessimistic <= cal.ttft_target {
            return None;
        }
        let detail = format!(
            "the admission is still measuring this cluster ({} of {PROBE_FIRST_TOKENS} first tokens): one request per \
             prefill instance at a time until then unless {PROBE_SCALE}x its estimate ({pessimistic:.4}s) meets \
             the target, and instance {} has {}",
            cal.first_tokens,
            p.id,
            p.queued_n + p.running.len()
        );
        Some((
            RejectReason::TtftSlo,
            detail,
            (d.est_queue_s * cal.work_scale).max(d.est_ttft_s.min(self.config.ttft_slo_s)),
        ))
    }

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
                format!(
                    "the admission target {:.4}s (the SLO {}s less the margin its misses ask for)",
                    a.ttft_target, cfg.ttft_slo_s
                )
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
