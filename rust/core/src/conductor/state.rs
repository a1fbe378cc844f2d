//! The conductor's mutable state: instances, in-flight requests, and their load sums.

use hashbrown::HashMap;

use super::config::{DecodeSpec, PrefillSpec};
use super::links::LinkLoads;
use super::pending::Pending;
use super::RequestId;
use crate::hash::BlockHash;
use crate::index::InstanceId;

#[derive(Debug, Clone)]
pub(crate) struct PrefillInst {
    pub id: InstanceId,
    pub spec: PrefillSpec,
    /// Sum of the estimated work (`Choice::work_s`: prefill and own-tier loads, seconds;
    /// not a peer fetch, which the instance does not wait for) of queued, not started requests.
    pub queued_s: f64,
    pub queued_n: usize,
    /// Started requests: (request, start time, estimated work).
    pub running: Vec<(RequestId, f64, f64)>,
    /// Draining: `schedule` never picks it; what it holds finishes normally.
    pub draining: bool,
    /// When the started request that left last was predicted to end (`fifo_queue_s`):
    /// the next one's service starts no earlier.
    pub served_until: f64,
    /// Bytes of prefetched prefixes held in staging memory for queued requests.
    pub staged_bytes: f64,
}

impl PrefillInst {
    pub fn new(id: InstanceId, spec: PrefillSpec) -> Self {
        PrefillInst {
            id,
            spec,
            queued_s: 0.0,
            queued_n: 0,
            running: Vec::new(),
            draining: false,
            served_until: f64::NEG_INFINITY,
            staged_bytes: 0.0,
        }
    }

    /// Started request `rid` leaves (its prefill is over): when it is the first in line,
    /// the next one's service is taken to start when its predicted end was, at `scale`
    /// times its estimated work (a request leaves when its first token reaches the
    /// router, after its successor has started on the instance: forgetting the queue
    /// it waited in would predict the successor's start from its own hand-over).
    pub fn served(&mut self, rid: RequestId, scale: f64) {
        if let Some(&(head, start, est)) = self.running.first() {
            if head == rid {
                self.served_until = self.served_until.max(start) + scale * est;
            }
        }
    }

    /// Seconds until this instance could start a new request at `now` when it serves
    /// its requests one after another, each taking `scale` times its estimated work
    /// (the online calibration's service scale): the started ones in the order they
    /// started, each from its start or the end of the one before, then the queued
    /// ones. `queue_s` lets started requests count down side by side, which is what a
    /// simulated instance that starts one when the last ends does; a serving instance
    /// is told a request has "started" when it is handed over, so several overlap there
    /// while the engine works through them one batch at a time.
    #[inline]
    pub fn fifo_queue_s(&self, now: f64, scale: f64) -> f64 {
        let mut free_at = self.served_until;
        for &(_, start, est) in &self.running {
            free_at = free_at.max(start) + scale * est;
        }
        (free_at - now).max(0.0) + scale * self.queued_s.max(0.0)
    }

    /// Estimated seconds until this instance could start a new request at `now`.
    #[inline]
    pub fn queue_s(&self, now: f64) -> f64 {
        let running: f64 = self.running.iter().map(|&(_, start, est)| (est - (now - start)).max(0.0)).sum();
        self.queued_s.max(0.0) + running
    }
}

/// One request in a decode instance's batch (or on its way there).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Member {
    pub rid: RequestId,
    /// Predicted (or, once known, actual) time the request joins the decode batch.
    pub arrive_t: f64,
    /// Predicted time it leaves.
    pub end_t: f64,
    /// Context tokens it adds to each decode step (prompt + half its output).
    pub ctx: f64,
}

#[derive(Debug, Clone)]
pub(crate) struct DecodeInst {
    pub id: InstanceId,
    pub spec: DecodeSpec,
    pub members: Vec<Member>,
    /// KV tokens reserved by the members (prompt + predicted output).
    pub kv_reserved: usize,
    pub ctx_tokens: f64,
    /// Draining: `schedule` never picks it; its members finish normally.
    pub draining: bool,
}

impl DecodeInst {
    pub fn new(id: InstanceId, spec: DecodeSpec) -> Self {
        DecodeInst { id, spec, members: Vec::new(), kv_reserved: 0, ctx_tokens: 0.0, draining: false }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Stage {
    Queued,
    Prefilling,
    PrefillDone,
    Decoding,
}

#[derive(Debug, Clone)]
pub(crate) struct Req {
    pub prefill: InstanceId,
    pub decode: InstanceId,
    pub stage: Stage,
    /// Estimated seconds of its prefill instance's time (`Choice::work_s`: prefill and
    /// own-tier loads; a peer fetch is its own wait, not the instance's): what it adds
    /// to its prefill queue.
    pub work_s: f64,
    pub kv_tokens: usize,
    pub out_pred: f64,
    pub tbt_s: f64,
    /// Output-length history key (first block of the prompt), if any.
    pub key: Option<BlockHash>,
    /// For the online calibration (calibration.rs): when it was admitted, the raw
    /// (uncalibrated) TTFT (queue and own work) and TBT estimates then, and when it
    /// started decoding.
    pub admit_t: f64,
    pub raw_ttft_s: f64,
    pub raw_tbt_s: f64,
    pub decode_t: Option<f64>,
    /// Its entry in `State::pending` (the prompt's last full block) until its prefill ends.
    pub pending_last: Option<BlockHash>,
    /// Its entry in `State::fetching` (the last block its fetch brings) until its
    /// prefill ends; None without a fetch.
    pub fetch_last: Option<BlockHash>,
    /// Bytes its prefetch holds in its prefill instance's staging memory while it is queued.
    pub staged_bytes: f64,
}

#[derive(Debug)]
pub(crate) struct State {
    /// Sorted by id.
    pub prefill: Vec<PrefillInst>,
    /// Sorted by id.
    pub decode: Vec<DecodeInst>,
    pub reqs: HashMap<RequestId, Req>,
    pub rng: u64,
    /// Latest `now` seen (the clock events without a time use).
    pub clock: f64,
    /// Prefixes admitted requests will leave on their prefill instance (`pending.rs`).
    pub pending: Pending,
    /// Prefixes admitted fetches are bringing to their prefill instance (from block 0
    /// to the last fetched block): counted there as its own, never as a fetch source;
    /// the index learns the blocks when the instance reports them stored.
    pub fetching: Pending,
    /// Bytes queued on each instance's links (`links.rs`); None: contention-blind.
    pub links: Option<LinkLoads>,
}

impl State {
    pub fn new(seed: u64, links: Option<LinkLoads>) -> Self {
        State {
            prefill: Vec::new(),
            decode: Vec::new(),
            reqs: HashMap::new(),
            rng: seed,
            clock: 0.0,
            pending: Pending::default(),
            fetching: Pending::default(),
            links,
        }
    }

    /// The request's prefill is over (or it is gone): its blocks are the index's business now.
    pub fn drop_pending(&mut self, rid: RequestId, req: &mut Req) {
        if let Some(last) = req.pending_last.take() {
            self.pending.remove(last, rid);
        }
        if let Some(last) = req.fetch_last.take() {
            self.fetching.remove(last, rid);
        }
    }

    pub fn prefill_pos(&self, id: InstanceId) -> Result<usize, usize> {
        self.prefill.binary_search_by_key(&id, |p| p.id)
    }

    pub fn decode_pos(&self, id: InstanceId) -> Result<usize, usize> {
        self.decode.binary_search_by_key(&id, |d| d.id)
    }

    pub fn knows(&self, id: InstanceId) -> bool {
        self.prefill_pos(id).is_ok() || self.decode_pos(id).is_ok()
    }

    /// Requests that still need instance `id` in its current role: on a prefill instance,
    /// those queued or prefilling there (a request past its prefill no longer uses it:
    /// its KV is the decode side's concern); on a decode instance, every member.
    pub fn held(&self, id: InstanceId) -> Option<usize> {
        if let Ok(i) = self.prefill_pos(id) {
            let p = &self.prefill[i];
            return Some(p.queued_n + p.running.len());
        }
        self.decode_pos(id).ok().map(|i| self.decode[i].members.len())
    }

    /// Takes a request out of its prefill queue (queued or running).
    pub fn leave_prefill(&mut self, rid: RequestId, req: &Req) {
        if let Ok(i) = self.prefill_pos(req.prefill) {
            let p = &mut self.prefill[i];
            match req.stage {
                Stage::Queued => {
                    p.queued_n -= 1;
                    p.queued_s = if p.queued_n == 0 { 0.0 } else { p.queued_s - req.work_s };
                    // leaving the queue, the prefetched prefix moves into the engine
                    p.staged_bytes = if p.queued_n == 0 { 0.0 } else { (p.staged_bytes - req.staged_bytes).max(0.0) };
                }
                Stage::Prefilling => p.running.retain(|r| r.0 != rid),
                _ => {}
            }
        }
    }

    /// Takes a request out of its decode instance's batch.
    pub fn leave_decode(&mut self, rid: RequestId, req: &Req) {
        if let Ok(i) = self.decode_pos(req.decode) {
            let d = &mut self.decode[i];
            if let Some(k) = d.members.iter().position(|m| m.rid == rid) {
                let m = d.members.swap_remove(k);
                d.kv_reserved -= req.kv_tokens;
                d.ctx_tokens = if d.members.is_empty() { 0.0 } else { d.ctx_tokens - m.ctx };
            }
        }
    }

    pub fn member_mut(&mut self, rid: RequestId, decode: InstanceId) -> Option<&mut Member> {
        let i = self.decode_pos(decode).ok()?;
        self.decode[i].members.iter_mut().find(|m| m.rid == rid)
    }

    /// Every load sum equals what the request table says it should be.
    pub fn check(&self) -> Result<(), String> {
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * (1.0 + a.abs().max(b.abs()));
        if !self.prefill.windows(2).all(|w| w[0].id < w[1].id) || !self.decode.windows(2).all(|w| w[0].id < w[1].id) {
            return Err("instance tables not sorted by id".into());
        }
        for p in &self.prefill {
            let queued: Vec<&Req> =
                self.reqs.values().filter(|r| r.prefill == p.id && r.stage == Stage::Queued).collect();
            let sum: f64 = queued.iter().map(|r| r.work_s).sum();
            if queued.len() != p.queued_n || !close(sum, p.queued_s) {
                return Err(format!(
                    "prefill {} queue: {} / {}s recorded, {} / {sum}s in the table",
                    p.id,
                    p.queued_n,
                    p.queued_s,
                    queued.len()
                ));
            }
            let staged: f64 = queued.iter().map(|r| r.staged_bytes).sum();
            if !close(staged, p.staged_bytes) {
                return Err(format!("prefill {} stages {} bytes, its queue says {staged}", p.id, p.staged_bytes));
            }
            let running = self.reqs.values().filter(|r| r.prefill == p.id && r.stage == Stage::Prefilling).count();
            if running != p.running.len() {
                return Err(format!("prefill {} runs {} requests, the table says {running}", p.id, p.running.len()));
            }
            for &(rid, start, est) in &p.running {
                let ok = self.reqs.get(&rid).is_some_and(|r| r.stage == Stage::Prefilling && r.prefill == p.id);
                if !ok || !start.is_finite() || !est.is_finite() {
                    return Err(format!("prefill {} lists request {rid} as running", p.id));
                }
            }
        }
        for d in &self.decode {
            let mine: Vec<(&RequestId, &Req)> = self.reqs.iter().filter(|(_, r)| r.decode == d.id).collect();
            if mine.len() != d.members.len() {
                return Err(format!("decode {} has {} members, the table says {}", d.id, d.members.len(), mine.len()));
            }
            let kv: usize = mine.iter().map(|(_, r)| r.kv_tokens).sum();
            let ctx: f64 = d.members.iter().map(|m| m.ctx).sum();
            if kv != d.kv_reserved || !close(ctx, d.ctx_tokens) {
                return Err(format!(
                    "decode {} reserves {} tokens / ctx {}, members say {kv} / {ctx}",
                    d.id, d.kv_reserved, d.ctx_tokens
                ));
            }
            for m in &d.members {
                if self.reqs.get(&m.rid).is_none_or(|r| r.decode != d.id) {
                    return Err(format!("decode {} lists unknown request {}", d.id, m.rid));
                }
            }
        }
        let pending = self.reqs.values().filter(|r| r.pending_last.is_some()).count();
        if pending != self.pending.len() {
            return Err(format!(
                "{} pending prefixes recorded, {pending} requests say they have one",
                self.pending.len()
            ));
        }
        let fetching = self.reqs.values().filter(|r| r.fetch_last.is_some()).count();
        if fetching != self.fetching.len() {
            return Err(format!(
                "{} fetched prefixes on their way recorded, {fetching} requests say they have one",
                self.fetching.len()
            ));
        }
        for (rid, r) in &self.reqs {
            if (r.pending_last.is_some() || r.fetch_last.is_some()) && r.stage > Stage::Prefilling {
                return Err(format!("request {rid} is past its prefill but still has a pending prefix"));
            }
            // Past its prefill, a request's prefill instance may have switched role since.
            let prefill_ok =
                if r.stage <= Stage::Prefilling { self.prefill_pos(r.prefill).is_ok() } else { self.knows(r.prefill) };
            if !prefill_ok || self.decode_pos(r.decode).is_err() {
                return Err(format!("request {rid} refers to a removed instance"));
            }
            if !(r.work_s.is_finite() && r.work_s >= 0.0 && r.out_pred.is_finite()) {
                return Err(format!("request {rid} has a non-finite estimate"));
            }
        }
        Ok(())
    }
}

/// splitmix64: the `random` policy's generator (state advanced only on acceptance).
pub(crate) fn next_rand(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
