//! Admission: picking the decode instance, the rejection rules, and the output-length
//! estimate the decode-side predictions use.
//!
//! - `none`: never reject; the decode instance is the one with the lowest predicted TBT
//!   among those with room (or among all, when none has room).
//! - `early`: the decode batch is everything assigned to the instance now plus this
//!   request; reject when the TTFT or that TBT exceeds its SLO, or no instance has room.
//! - `predictive`: the batch is what is predicted to be decoding on the instance when
//!   this request arrives there (`now + est_ttft`): requests whose prefill is predicted to
//!   finish by then join, those predicted to finish decoding by then have left.

use hashbrown::HashMap;

use super::config::RejectionKind;
use super::cost::DecodeCostModel;
use super::state::DecodeInst;
use crate::hash::BlockHash;

/// Why a request was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    NoPrefillInstance,
    NoDecodeInstance,
    TtftSlo,
    TbtSlo,
    /// Every decode instance is at its batch or KV capacity.
    DecodeCapacity,
}

impl RejectReason {
    pub fn name(self) -> &'static str {
        match self {
            RejectReason::NoPrefillInstance => "no_prefill_instance",
            RejectReason::NoDecodeInstance => "no_decode_instance",
            RejectReason::TtftSlo => "ttft_slo",
            RejectReason::TbtSlo => "tbt_slo",
            RejectReason::DecodeCapacity => "decode_capacity",
        }
    }
}

impl std::fmt::Display for RejectReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The decode side of one request, as the admission sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DecodeAsk {
    pub prompt_len: usize,
    pub out_pred: f64,
    /// When the request is predicted to reach decode.
    pub arrive_t: f64,
}

impl DecodeAsk {
    pub fn kv_tokens(&self) -> usize {
        self.prompt_len + self.out_pred.ceil() as usize
    }
    pub fn ctx(&self) -> f64 {
        self.prompt_len as f64 + self.out_pred / 2.0
    }
}

/// (batch without this request, context tokens without it) on `d` as `kind` predicts.
fn predicted_load(d: &DecodeInst, kind: RejectionKind, at: f64) -> (usize, f64) {
    match kind {
        RejectionKind::Predictive => {
            let mut n = 0;
            let mut ctx = 0.0;
            for m in &d.members {
                if m.arrive_t <= at && at < m.end_t {
                    n += 1;
                    ctx += m.ctx;
                }
            }
            (n, ctx)
        }
        _ => (d.members.len(), d.ctx_tokens),
    }
}

/// The decode instance chosen for a request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct DecodePick {
    pub idx: usize,
    /// Predicted TBT with this request: always finite (the decode model's prediction,
    /// also for an instance that is full).
    pub tbt: f64,
    /// Whether it has room (batch and KV) for the request; with rejection on, a pick
    /// without room is a `DecodeCapacity` rejection.
    pub room: bool,
}

/// Chosen decode instance: the lowest predicted TBT among those with room, else (no
/// room anywhere) among all. None without instances (draining instances do not count:
/// they take no new request).
pub(crate) fn select_decode(
    decode: &[DecodeInst],
    kind: RejectionKind,
    model: &DecodeCostModel,
    ask: &DecodeAsk,
) -> Option<DecodePick> {
    let mut fit: Option<(usize, f64)> = None;
    let mut any: Option<(usize, f64)> = None;
    for (i, d) in decode.iter().enumerate() {
        if d.draining {
            continue;
        }
        let (n, ctx) = predicted_load(d, kind, ask.arrive_t);
        let tbt = model.predict(n + 1, ctx + ask.ctx());
        let room = n < d.spec.max_batch && d.kv_reserved + ask.kv_tokens() <= d.spec.kv_capacity_tokens;
        if room && fit.is_none_or(|f| tbt < f.1) {
            fit = Some((i, tbt));
        }
        if any.is_none_or(|f| tbt < f.1) {
            any = Some((i, tbt));
        }
    }
    let _ = kind; // (the batch it predicts is `kind`'s; the choice is the same for all kinds)
    match fit {
        Some((idx, tbt)) => Some(DecodePick { idx, tbt, room: true }),
        None => any.map(|(idx, tbt)| DecodePick { idx, tbt, room: false }),
    }
}

/// Seconds until a decode instance is predicted to free a place (its earliest member's
/// predicted end), the soonest over the instances that take requests; 1 s when none is
/// predicted (no member, or an end already past): the honest ``Retry-After`` of a
/// decode-side rejection.
pub(crate) fn decode_free_in(decode: &[DecodeInst], now: f64) -> f64 {
    decode
        .iter()
        .filter(|d| !d.draining)
        .flat_map(|d| d.members.iter().map(|m| m.end_t - now))
        .filter(|s| s.is_finite() && *s > 0.0)
        .fold(None, |acc: Option<f64>, s| Some(acc.map_or(s, |a| a.min(s))))
        .unwrap_or(1.0)
}

/// Output length per prompt family (the first block's hash, which carries the
/// deployment's salt: tenant, LoRA, system prompt), as an exponential moving average,
/// with a global average as fallback and a fixed default before any history.
#[derive(Debug, Clone)]
pub struct OutputLenEstimator {
    per_key: HashMap<BlockHash, f64>,
    global: Option<f64>,
    default: f64,
    weight: f64,
    capacity: usize,
    /// Upper bound of any sample and so of any estimate.
    max_len: f64,
}

impl OutputLenEstimator {
    pub fn new(default: usize, weight: f64, capacity: usize, max_len: usize) -> Self {
        let max_len = max_len.max(1) as f64;
        OutputLenEstimator {
            per_key: HashMap::new(),
            global: None,
            default: (default as f64).min(max_len),
            weight,
            capacity,
            max_len,
        }
    }

    pub fn predict(&self, key: Option<BlockHash>) -> f64 {
        key.and_then(|k| self.per_key.get(&k).copied()).or(self.global).unwrap_or(self.default)
    }

    /// Feeds one finished request's output length. The caller has already refused
    /// lengths beyond the configured `max_output_len`; the sample is clamped to it again
    /// here so that no observation can push an estimate past what a request can produce
    /// (one absurd length would otherwise make admission reject every later request).
    pub fn record(&mut self, key: Option<BlockHash>, output_len: usize) {
        let x = (output_len as f64).min(self.max_len);
        let w = self.weight;
        self.global = Some(self.global.map_or(x, |g| g + w * (x - g)));
        if let Some(k) = key {
            if self.per_key.len() >= self.capacity && !self.per_key.contains_key(&k) {
                self.per_key.clear(); // bounded memory; history rebuilds quickly
            }
            let e = self.per_key.entry(k).or_insert(x);
            *e += w * (x - *e);
        }
    }

    pub fn len(&self) -> usize {
        self.per_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.per_key.is_empty()
    }
}
