//! Conductor configuration, with defaults and validation.

use super::cost::CostModels;
use super::{check_nonneg, check_pos, ConductorError};

/// Which prefill-selection policy `schedule` runs (see `policy/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    Random,
    LoadBalance,
    LocalCacheAware,
    Mooncake,
    TtftOptimal,
}

impl PolicyKind {
    pub fn parse(name: &str) -> Result<Self, ConductorError> {
        Ok(match name {
            "random" => PolicyKind::Random,
            "load_balance" => PolicyKind::LoadBalance,
            "local_cache_aware" => PolicyKind::LocalCacheAware,
            "mooncake" => PolicyKind::Mooncake,
            "ttft_optimal" => PolicyKind::TtftOptimal,
            other => {
                return Err(ConductorError::InvalidConfig(format!(
                "unknown policy {other:?}; expected random, load_balance, local_cache_aware, mooncake or ttft_optimal"
            )))
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Random => "random",
            PolicyKind::LoadBalance => "load_balance",
            PolicyKind::LocalCacheAware => "local_cache_aware",
            PolicyKind::Mooncake => "mooncake",
            PolicyKind::TtftOptimal => "ttft_optimal",
        }
    }
}

/// When `schedule` may reject a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectionKind {
    /// Never reject (except with no instance to run on).
    None,
    /// Reject when the estimated TTFT, or the TBT of the chosen decode instance with
    /// its current batch plus this request, exceeds its SLO.
    Early,
    /// Like `Early`, but the decode load is predicted for the time this request
    /// reaches decode.
    Predictive,
}

impl RejectionKind {
    pub fn parse(name: &str) -> Result<Self, ConductorError> {
        Ok(match name {
            "none" => RejectionKind::None,
            "early" => RejectionKind::Early,
            "predictive" => RejectionKind::Predictive,
            other => {
                return Err(ConductorError::InvalidConfig(format!(
                    "unknown rejection {other:?}; expected none, early or predictive"
                )))
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            RejectionKind::None => "none",
            RejectionKind::Early => "early",
            RejectionKind::Predictive => "predictive",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ConductorConfig {
    /// Tokens per block (the hashes passed to `schedule` are of full blocks).
    pub block_size: usize,
    pub ttft_slo_s: f64,
    pub tbt_slo_s: f64,
    pub policy: PolicyKind,
    /// Algorithm 1's kvcache_balancing_threshold: fetch the global best prefix only
    /// when best_len / local_len exceeds it (>= 1). The paper's 2.0 kept instances from
    /// fetching small increments from an idle-priced network; with the load-aware
    /// estimate (`contention_aware`) a fetch is taken only where it wins, so the
    /// default is 1.0 (no extra guard; docs/conductor.md, "Why mooncake lost").
    pub balancing_threshold: f64,
    pub rejection: RejectionKind,
    /// Seed of the `random` policy.
    pub seed: u64,
    pub cost: CostModels,
    /// Output length assumed when neither the caller nor history gives one.
    pub default_output_len: usize,
    /// Weight of a new sample in the per-prefix output-length average (0 < w <= 1).
    pub output_len_ewma: f64,
    /// Longest output a request can produce (the model's context window is a safe
    /// value). `on_decode_finished` refuses longer lengths and `expected_output_len`
    /// above it is refused at schedule time, so no single observation can poison the
    /// output-length estimate that admission relies on.
    pub max_output_len: usize,
    /// Replication: a prefix is hot after this many (decayed) hits.
    pub hot_min_hits: f64,
    /// Replication: hit counts halve every this many seconds.
    pub hot_half_life_s: f64,
    /// Replication: an instance is busy when its queue exceeds this fraction of the TTFT SLO.
    pub hot_busy_fraction: f64,
    /// Replication: at most this many prefixes are tracked.
    pub hot_capacity: usize,
    /// Price fetches on the links as they are loaded (`links.rs`): what the conductor
    /// scheduled on each link plus what instances report. Off: an idle network.
    pub contention_aware: bool,
    /// Replication: a prefix is also hot when every holder's NIC out is backed up by
    /// more than this many seconds (its links are the bottleneck, not its queue).
    pub hot_link_busy_s: f64,
    /// Replication: at most this many bytes of replicas per `replication_hints` call.
    pub hot_replica_max_bytes: f64,
    /// Prefetch at decision time: bytes of DRAM per prefill instance for prefixes fetched
    /// while their request waits in its queue (`policy/mod.rs`). A fetch that would not
    /// fit in what is free starts at dequeue instead. 0: off (every fetch at dequeue).
    /// Default 64 GB: on (the serving `Cluster` starts a fetch when the instance accepts
    /// the request, so this is the estimate that matches it; BENCHMARKS.md "k25q").
    pub prefetch_staging_bytes: f64,
}

impl Default for ConductorConfig {
    fn default() -> Self {
        ConductorConfig {
            block_size: 512,
            ttft_slo_s: 10.0,
            tbt_slo_s: 0.1,
            policy: PolicyKind::Mooncake,
            balancing_threshold: 1.0,
            rejection: RejectionKind::None,
            seed: 0,
            cost: CostModels::default(),
            default_output_len: 256,
            output_len_ewma: 0.2,
            max_output_len: 1 << 20,
            hot_min_hits: 4.0,
            hot_half_life_s: 60.0,
            hot_busy_fraction: 0.25,
            hot_capacity: 4096,
            contention_aware: true,
            hot_link_busy_s: 0.5,
            hot_replica_max_bytes: 64e9,
            prefetch_staging_bytes: 64e9,
        }
    }
}

impl ConductorConfig {
    pub fn validate(&self) -> Result<(), ConductorError> {
        if self.block_size == 0 {
            return Err(ConductorError::InvalidConfig("block_size must be > 0".into()));
        }
        check_pos("ttft_slo_s", self.ttft_slo_s)?;
        check_pos("tbt_slo_s", self.tbt_slo_s)?;
        if !(self.balancing_threshold.is_finite() && self.balancing_threshold >= 1.0) {
            return Err(ConductorError::InvalidConfig(format!(
                "balancing_threshold must be finite and >= 1, got {}",
                self.balancing_threshold
            )));
        }
        if !(self.output_len_ewma > 0.0 && self.output_len_ewma <= 1.0) {
            return Err(ConductorError::InvalidConfig(format!(
                "output_len_ewma must be in (0, 1], got {}",
                self.output_len_ewma
            )));
        }
        if self.max_output_len == 0 {
            return Err(ConductorError::InvalidConfig("max_output_len must be > 0".into()));
        }
        if self.default_output_len > self.max_output_len {
            return Err(ConductorError::InvalidConfig(format!(
                "default_output_len ({}) must not exceed max_output_len ({})",
                self.default_output_len, self.max_output_len
            )));
        }
        check_nonneg("hot_min_hits", self.hot_min_hits)?;
        check_pos("hot_half_life_s", self.hot_half_life_s)?;
        check_nonneg("hot_busy_fraction", self.hot_busy_fraction)?;
        check_nonneg("hot_link_busy_s", self.hot_link_busy_s)?;
        check_nonneg("hot_replica_max_bytes", self.hot_replica_max_bytes)?;
        check_nonneg("prefetch_staging_bytes", self.prefetch_staging_bytes)?;
        if self.hot_capacity == 0 {
            return Err(ConductorError::InvalidConfig("hot_capacity must be > 0".into()));
        }
        self.cost.validate()
    }
}

/// A prefill instance as registered.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillSpec {
    /// Relative speed: estimated prefill time is divided by it (1 = the cost model's node).
    pub speed: f64,
}

impl Default for PrefillSpec {
    fn default() -> Self {
        PrefillSpec { speed: 1.0 }
    }
}

/// A decode instance as registered.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeSpec {
    /// Largest decode batch (requests).
    pub max_batch: usize,
    /// KV cache capacity in tokens (prompt + output of every request in the batch).
    pub kv_capacity_tokens: usize,
}

impl Default for DecodeSpec {
    fn default() -> Self {
        // 8 x 80 GB minus ~140 GB of weights leaves ~500 GB; at 320 KiB per token
        // (LLaMA3-70B, bf16, GQA 8 KV heads) about 1.5M tokens; keep headroom.
        DecodeSpec { max_batch: 256, kv_capacity_tokens: 1_000_000 }
    }
}

impl PrefillSpec {
    pub fn validate(&self) -> Result<(), ConductorError> {
        check_pos("speed", self.speed)
    }
}

impl DecodeSpec {
    pub fn validate(&self) -> Result<(), ConductorError> {
        if self.max_batch == 0 || self.kv_capacity_tokens == 0 {
            return Err(ConductorError::InvalidConfig("max_batch and kv_capacity_tokens must be > 0".into()));
        }
        Ok(())
    }
}
