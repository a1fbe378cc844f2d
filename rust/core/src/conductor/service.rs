//! What a request's first token really costs on the serving cluster, measured online:
//! the per-request service cost of a prefill instance and the latency floor every
//! request pays whatever the queue (the online TTFT calibration, calibration.rs).
//!
//! Why two numbers and not one ratio: a first token's latency on a real cluster is a
//! fixed part (message hops through the router and the decode instance's loop, a
//! thread's wait for the interpreter, the engine step a request waits to join: ~10-25
//! ms on a shared CPU host) plus the prefill queue ahead of it, served one request
//! after another at the instance's real speed. The cost model predicts the prefill
//! work from the engine alone (1 ms for 48 tokens of the tiny model), so one
//! measured/predicted ratio came out at ~30 and multiplied the queue by the hops:
//! three requests ahead already "took" 120 ms, and admission at 2x its capacity let
//! 4-6% through while a plain queue kept two thirds of all requests within the SLO
//! (issue 26, BENCHMARKS.md). So:
//!
//! - [`ServiceScale`]: seconds a prefill instance's engine really spends per second of
//!   predicted work. The instance measures each request's share of its engine's time
//!   (from when the request reached it, or the previous request's end there if later,
//!   to the end of its compute: prefill.py) and the router passes it on
//!   (`Conductor::on_prefill_served`). A ratio of two moving sums (time over predicted
//!   work), so a batched step (one request carries the step, the others of its batch
//!   0) counts right. Measured on the instance and not from when first tokens reach
//!   the router: there, the hops a request takes before and after the engine made an
//!   idle instance look busy.
//! - [`LatencyFloor`]: a high quantile ([`FLOOR_QUANTILE`]) of what a first token took
//!   beyond its queue and its own scaled work: the hops, learned as an amount of
//!   seconds, added once and never multiplied by the queue.
//!
//! The estimate admission checks is then `floor + scale x (queue + own work)`, the
//! queue served first in, first out (state.rs, `fifo_queue_s`).

/// Weight of one departure in the service scale's moving sums.
pub const SERVICE_WEIGHT: f64 = 0.1;
/// Bounds of the service scale (one odd interval cannot shut or flood admission).
pub const MIN_SERVICE: f64 = 0.2;
pub const MAX_SERVICE: f64 = 100.0;

/// Per-request service cost over the cost model's prediction (1 before any sample).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ServiceScale {
    busy_s: f64,
    work_s: f64,
    samples: u64,
}

impl ServiceScale {
    pub fn at(&self) -> f64 {
        if self.samples == 0 || self.work_s <= 0.0 {
            return 1.0;
        }
        (self.busy_s / self.work_s).clamp(MIN_SERVICE, MAX_SERVICE)
    }

    /// An instance spent `interval` seconds of its engine on a request the cost model
    /// priced at `work` seconds; ignored unless both are finite, the interval >= 0 and
    /// the work > 0.
    pub fn observe(&mut self, interval: f64, work: f64) {
        if !(interval.is_finite() && interval >= 0.0 && work.is_finite() && work > 0.0) {
            return;
        }
        let w = SERVICE_WEIGHT;
        if self.samples == 0 {
            // the cost model's word (a scale of 1) as the prior: one slow first request
            // moves the scale by a step, not to its own ratio
            (self.busy_s, self.work_s) = (work, work);
        }
        self.busy_s += w * (interval - self.busy_s);
        self.work_s += w * (work - self.work_s);
        self.samples += 1;
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }
}

/// The quantile of the latency beyond the queue that the floor tracks: the SLO is
/// judged at p90, and the queue part of an estimate is a mean; the p95 of the rest
/// leaves the margin.
pub const FLOOR_QUANTILE: f64 = 0.95;
/// Step of the floor per sample, as a share of the TTFT SLO (1 ms at a 50 ms SLO).
pub const FLOOR_STEP: f64 = 0.02;
/// How fast the floor relaxes toward 0 without observations (only admitted requests
/// feed it: a floor that refuses everything must come down by itself, in seconds).
pub const FLOOR_HALF_LIFE_S: f64 = 3.0;
/// The floor never exceeds this many SLOs: past one it refuses everything anyway, and
/// the higher it went the longer it would take to open again.
pub const MAX_FLOOR_SLOS: f64 = 1.0;

/// Seconds a first token takes beyond its queue and its own work (0 before any sample).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LatencyFloor {
    secs: f64,
    last_t: Option<f64>,
    samples: u64,
}

impl LatencyFloor {
    pub fn at(&self, now: f64) -> f64 {
        let Some(t) = self.last_t else {
            return 0.0;
        };
        self.secs * 0.5f64.powf((now - t).max(0.0) / FLOOR_HALF_LIFE_S)
    }

    /// A first token came `beyond` seconds later than its queue and work predicted,
    /// under a TTFT SLO of `slo`: a stochastic quantile step of `FLOOR_STEP * slo`.
    pub fn observe(&mut self, beyond: f64, slo: f64, now: f64) {
        if !(beyond.is_finite() && slo.is_finite() && slo > 0.0 && now.is_finite()) {
            return;
        }
        let cur = self.at(now);
        let step = FLOOR_STEP * slo;
        let next = if beyond > cur { cur + step * FLOOR_QUANTILE } else { cur - step * (1.0 - FLOOR_QUANTILE) };
        self.secs = next.clamp(0.0, MAX_FLOOR_SLOS * slo);
        self.last_t = Some(now);
        self.samples += 1;
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uniform(x: &mut u64) -> f64 {
        *x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (*x >> 11) as f64 / (1u64 << 53) as f64
    }

    #[test]
    fn the_service_scale_is_time_over_work_also_for_batched_departures() {
        let mut s = ServiceScale::default();
        assert_eq!(s.at(), 1.0);
        // each request priced 1 ms, served in 10 ms, departing in batches of 4: one
        // 40 ms interval, then three zeros
        for i in 0..4000 {
            s.observe(if i % 4 == 0 { 0.04 } else { 0.0 }, 0.001);
        }
        assert!((s.at() / 10.0 - 1.0).abs() < 0.3, "{}", s.at());
        // bad samples are ignored; the bounds hold
        s.observe(f64::NAN, 0.001);
        s.observe(0.01, 0.0);
        s.observe(-1.0, 0.001);
        assert_eq!(s.samples(), 4000);
        let mut s = ServiceScale::default();
        s.observe(0.01, 0.001); // the first sample is one step from the prior (1)
        assert!((s.at() - 1.9).abs() < 1e-9, "{}", s.at());
        for _ in 0..100 {
            s.observe(1e9, 1e-9);
        }
        assert_eq!(s.at(), MAX_SERVICE);
    }

    #[test]
    fn the_floor_tracks_a_high_quantile_of_the_latency_beyond_the_queue() {
        // beyond the queue: uniform 10..30 ms; the p95 is 29 ms
        let mut f = LatencyFloor::default();
        assert_eq!(f.at(0.0), 0.0);
        let mut x = 3;
        for _ in 0..20000 {
            f.observe(0.01 + 0.02 * uniform(&mut x), 0.05, 0.0);
        }
        let v = f.at(0.0);
        assert!((0.026..=0.031).contains(&v), "{v}");
        // a quiet half-life later: half; bounds; bad samples ignored
        assert!((f.at(FLOOR_HALF_LIFE_S) - v / 2.0).abs() < 1e-9);
        f.observe(f64::NAN, 0.05, 0.0);
        f.observe(0.01, 0.0, 0.0);
        assert_eq!(f.samples(), 20000);
        let mut f = LatencyFloor::default();
        for _ in 0..10000 {
            f.observe(1e9, 0.05, 0.0);
        }
        assert!(f.at(0.0) <= MAX_FLOOR_SLOS * 0.05 + 1e-12);
        for _ in 0..100000 {
            f.observe(-1.0, 0.05, 0.0);
        }
        assert_eq!(f.at(0.0), 0.0);
    }
}
