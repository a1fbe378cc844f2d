//! Cost models the conductor estimates TTFT and TBT with, each fittable by least
//! squares from measured samples (as the paper fits its prefill model from offline runs).
//!
//! Defaults are for a LLaMA3-70B-class model (80 layers, hidden 8192, 64 query heads,
//! 8 KV heads of 128, bf16) on one node of 8 H100-class GPUs; the derivation is in
//! `docs/conductor.md` ("Cost model defaults"). Replace them by `fit` from your runs.

use super::{check_nonneg, check_pos, check_pos_or_inf, ConductorError};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FitError {
    #[error("need at least {need} samples with distinct inputs, got {got}")]
    TooFewSamples { need: usize, got: usize },
    #[error("sample {0} is not finite or is negative")]
    BadSample(usize),
    #[error(
        "the samples fit a model that predicts zero time for every input (all samples 0 s?); measure real timings"
    )]
    Degenerate,
}

impl From<FitError> for ConductorError {
    fn from(e: FitError) -> Self {
        ConductorError::InvalidArgument(e.to_string())
    }
}

/// Prefill time of a prompt with `new` tokens to compute over `prefix` cached tokens,
/// in the form of the paper's equation 1 (per layer: a·n² + b·n, plus attention to the
/// cached prefix), summed over layers into four coefficients:
/// `t = c0 + c_new·new + c_new2·new² + c_cross·new·prefix` (seconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillCostModel {
    pub c0: f64,
    pub c_new: f64,
    pub c_new2: f64,
    pub c_cross: f64,
}

impl Default for PrefillCostModel {
    fn default() -> Self {
        // Effective 3.5 PFLOP/s (8 x 989 TFLOP/s bf16 dense at ~45% MFU).
        // Linear: 2 x 70.6e9 FLOP per token -> 40 us/token.
        // Attention: 4 x 8192 x 80 = 2.62 MFLOP per (query, key) pair; causal over the
        // new tokens: new²/2 pairs -> 3.7e-10 s; to the prefix: new·prefix -> 7.5e-10 s.
        PrefillCostModel { c0: 0.005, c_new: 4.0e-5, c_new2: 3.7e-10, c_cross: 7.5e-10 }
    }
}

impl PrefillCostModel {
    pub fn validate(&self) -> Result<(), ConductorError> {
        check_nonneg("prefill c0", self.c0)?;
        check_nonneg("prefill c_new", self.c_new)?;
        check_nonneg("prefill c_new2", self.c_new2)?;
        check_nonneg("prefill c_cross", self.c_cross)
    }

    /// Seconds to prefill `prompt` tokens of which the first `prefix` are cached.
    #[inline]
    pub fn predict(&self, prompt: usize, prefix: usize) -> f64 {
        let p = prefix.min(prompt) as f64;
        let n = prompt as f64 - p;
        self.c0 + self.c_new * n + self.c_new2 * n * n + self.c_cross * n * p
    }

    /// Least squares from (prompt tokens, cached prefix tokens, seconds), keeping every
    /// coefficient >= 0 (a term whose fitted weight is negative is dropped and the rest
    /// refitted).
    pub fn fit(samples: &[(usize, usize, f64)]) -> Result<Self, FitError> {
        let rows: Vec<([f64; 4], f64)> = samples
            .iter()
            .enumerate()
            .map(|(i, &(prompt, prefix, t))| {
                if !(t.is_finite() && t >= 0.0) {
                    return Err(FitError::BadSample(i));
                }
                let p = prefix.min(prompt) as f64;
                let n = prompt as f64 - p;
                Ok(([1.0, n, n * n, n * p], t))
            })
            .collect::<Result<_, _>>()?;
        let c = nonneg_lstsq(&rows)?;
        reject_zero_model(&c)?;
        Ok(PrefillCostModel { c0: c[0], c_new: c[1], c_new2: c[2], c_cross: c[3] })
    }
}

/// Time to move KV: `latency_s + tokens · bytes_per_token / bandwidth`, where blocks
/// read from SSD go at the SSD bandwidth when it is the slower one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransferCostModel {
    pub bytes_per_token: f64,
    /// Network bandwidth between instances, bytes/s.
    pub network_bandwidth: f64,
    /// SSD read bandwidth of one instance, bytes/s (also used for local SSD loads).
    pub ssd_bandwidth: f64,
    pub latency_s: f64,
    /// Host DRAM -> device copy bandwidth of one instance, bytes/s: what a local DRAM hit
    /// costs against one already in the device cache (tier `gpu`). Infinite (the
    /// default): DRAM hits are free, as when no engine reports a device tier.
    pub dram_bandwidth: f64,
}

impl Default for TransferCostModel {
    fn default() -> Self {
        // 80 layers x 2 (K,V) x 8 KV heads x 128 x 2 bytes = 327,680 bytes per token.
        // 8 x 200 Gbit/s RDMA at ~60% of line rate ~ 100 GB/s... use 50 GB/s to leave
        // room for the layer-wise prefill->decode stream on the same NICs.
        // SSD: 4 NVMe drives x ~5 GB/s read = 20 GB/s. Setup latency 1 ms.
        TransferCostModel {
            bytes_per_token: 327_680.0,
            network_bandwidth: 50e9,
            ssd_bandwidth: 20e9,
            latency_s: 0.001,
            dram_bandwidth: f64::INFINITY,
        }
    }
}

impl TransferCostModel {
    pub fn validate(&self) -> Result<(), ConductorError> {
        check_pos("bytes_per_token", self.bytes_per_token)?;
        check_pos("network_bandwidth", self.network_bandwidth)?;
        check_pos("ssd_bandwidth", self.ssd_bandwidth)?;
        check_pos_or_inf("dram_bandwidth", self.dram_bandwidth)?;
        check_nonneg("latency_s", self.latency_s)
    }

    /// Seconds to fetch `tokens` from another instance, `ssd_fraction` of them from its SSD.
    #[inline]
    pub fn fetch(&self, tokens: usize, ssd_fraction: f64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let bytes = tokens as f64 * self.bytes_per_token;
        let slow = self.network_bandwidth.min(self.ssd_bandwidth);
        self.latency_s + bytes * ((1.0 - ssd_fraction) / self.network_bandwidth + ssd_fraction / slow)
    }

    /// Seconds to copy `tokens` from the local DRAM to the device (0 when
    /// `dram_bandwidth` is infinite).
    #[inline]
    pub fn local_dram(&self, tokens: usize) -> f64 {
        tokens as f64 * self.bytes_per_token / self.dram_bandwidth
    }

    /// Seconds to load `tokens` from the local SSD into DRAM.
    #[inline]
    pub fn local_ssd(&self, tokens: usize) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        tokens as f64 * self.bytes_per_token / self.ssd_bandwidth
    }

    /// Fits latency and network bandwidth from (bytes, seconds) samples of network
    /// transfers; keeps `bytes_per_token` and `ssd_bandwidth`.
    pub fn fit(&self, samples: &[(f64, f64)]) -> Result<Self, FitError> {
        let rows: Vec<([f64; 2], f64)> = samples
            .iter()
            .enumerate()
            .map(|(i, &(b, t))| {
                if !(b.is_finite() && b >= 0.0 && t.is_finite() && t >= 0.0) {
                    return Err(FitError::BadSample(i));
                }
                Ok(([1.0, b], t))
            })
            .collect::<Result<_, _>>()?;
        let c = nonneg_lstsq(&rows)?;
        if c[1] <= 0.0 {
            return Err(FitError::TooFewSamples { need: 2, got: samples.len() });
        }
        Ok(TransferCostModel { latency_s: c[0], network_bandwidth: 1.0 / c[1], ..*self })
    }
}

/// Decode step time (TBT): `base_s + per_seq_s · batch + per_token_s · context tokens`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeCostModel {
    pub base_s: f64,
    pub per_seq_s: f64,
    pub per_token_s: f64,
}

impl Default for DecodeCostModel {
    fn default() -> Self {
        // Each step reads the 141 GB of weights at ~16 TB/s effective (8 x 3.35 TB/s
        // HBM at 60%): ~9 ms, plus launch overhead -> 12 ms. Per sequence: 141 GFLOP at
        // 3.5 PFLOP/s plus sampling -> 0.05 ms. Per context token: 327,680 KV bytes
        // read at 16 TB/s -> 2e-8 s.
        DecodeCostModel { base_s: 0.012, per_seq_s: 5.0e-5, per_token_s: 2.0e-8 }
    }
}

impl DecodeCostModel {
    pub fn validate(&self) -> Result<(), ConductorError> {
        check_nonneg("decode base_s", self.base_s)?;
        check_nonneg("decode per_seq_s", self.per_seq_s)?;
        check_nonneg("decode per_token_s", self.per_token_s)
    }

    #[inline]
    pub fn predict(&self, batch: usize, context_tokens: f64) -> f64 {
        self.base_s + self.per_seq_s * batch as f64 + self.per_token_s * context_tokens
    }

    /// Least squares from (batch size, total context tokens, step seconds).
    pub fn fit(samples: &[(usize, f64, f64)]) -> Result<Self, FitError> {
        let rows: Vec<([f64; 3], f64)> = samples
            .iter()
            .enumerate()
            .map(|(i, &(b, ctx, t))| {
                if !(ctx.is_finite() && ctx >= 0.0 && t.is_finite() && t >= 0.0) {
                    return Err(FitError::BadSample(i));
                }
                Ok(([1.0, b as f64, ctx], t))
            })
            .collect::<Result<_, _>>()?;
        let c = nonneg_lstsq(&rows)?;
        reject_zero_model(&c)?;
        Ok(DecodeCostModel { base_s: c[0], per_seq_s: c[1], per_token_s: c[2] })
    }
}

/// The three models together.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CostModels {
    pub prefill: PrefillCostModel,
    pub transfer: TransferCostModel,
    pub decode: DecodeCostModel,
}

impl CostModels {
    pub fn validate(&self) -> Result<(), ConductorError> {
        self.prefill.validate()?;
        self.transfer.validate()?;
        self.decode.validate()
    }
}

/// Least squares with every coefficient >= 0: solve, drop the terms that came out
/// negative, solve again on the rest (at most K rounds). Columns are scaled to unit norm
/// first so n² (~1e8) and 1 live in one well-conditioned system.
/// A fitted model whose every coefficient is zero estimates every request at 0 s, which
/// would make the conductor admit anything and route blindly: refuse it.
fn reject_zero_model<const K: usize>(c: &[f64; K]) -> Result<(), FitError> {
    if c.iter().all(|&v| v == 0.0) {
        return Err(FitError::Degenerate);
    }
    Ok(())
}

fn nonneg_lstsq<const K: usize>(rows: &[([f64; K], f64)]) -> Result<[f64; K], FitError> {
    // No samples is no information: an all-zero model would price every request at 0 s.
    if rows.is_empty() {
        return Err(FitError::TooFewSamples { need: 1, got: 0 });
    }
    let mut active = [true; K];
    let mut scale = [0.0f64; K];
    for (x, _) in rows {
        for k in 0..K {
            scale[k] += x[k] * x[k];
        }
    }
    for (k, s) in scale.iter_mut().enumerate() {
        *s = s.sqrt();
        if *s == 0.0 {
            active[k] = false; // a column of zeros carries no information
            *s = 1.0;
        }
    }
    for _ in 0..=K {
        let idx: Vec<usize> = (0..K).filter(|&k| active[k]).collect();
        let m = idx.len();
        let mut c = [0.0f64; K];
        if m == 0 {
            return Ok(c);
        }
        // Normal equations A^T A c = A^T y on the active, scaled columns.
        let mut a = vec![vec![0.0f64; m + 1]; m];
        for (x, y) in rows {
            for (i, &ki) in idx.iter().enumerate() {
                let xi = x[ki] / scale[ki];
                for (j, &kj) in idx.iter().enumerate() {
                    a[i][j] += xi * x[kj] / scale[kj];
                }
                a[i][m] += xi * y;
            }
        }
        let sol = solve(a).ok_or(FitError::TooFewSamples { need: m, got: rows.len() })?;
        let mut dropped = false;
        for (i, &k) in idx.iter().enumerate() {
            let v = sol[i] / scale[k];
            if v < 0.0 {
                active[k] = false;
                dropped = true;
            } else {
                c[k] = v;
            }
        }
        if !dropped {
            return Ok(c);
        }
    }
    Err(FitError::TooFewSamples { need: K, got: rows.len() })
}

/// Gaussian elimination with partial pivoting on an augmented m x (m+1) matrix.
fn solve(mut a: Vec<Vec<f64>>) -> Option<Vec<f64>> {
    let m = a.len();
    let norm = a.iter().flat_map(|r| r[..m].iter()).fold(0.0f64, |acc, v| acc.max(v.abs()));
    for col in 0..m {
        let piv = (col..m).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[piv][col].abs() <= 1e-12 * norm.max(f64::MIN_POSITIVE) {
            return None; // singular: too few distinct samples
        }
        a.swap(col, piv);
        for r in 0..m {
            if r != col {
                let f = a[r][col] / a[col][col];
                let pivot_row = a[col].clone();
                for (x, p) in a[r][col..].iter_mut().zip(&pivot_row[col..]) {
                    *x -= f * p;
                }
            }
        }
    }
    Some((0..m).map(|i| a[i][m] / a[i][i]).collect())
}
