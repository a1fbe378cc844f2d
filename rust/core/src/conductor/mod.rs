//! The conductor: KVCache-centric global scheduling (Algorithm 1 of the Mooncake paper
//! and better policies), SLO-aware admission with early and predictive rejection, and
//! hot-prefix replication decisions.
//!
//! - [`conductor`]: the instance registry, `schedule`, progress events, snapshots.
//! - `decide`: one decision's steps (candidates, estimate, admit).
//! - [`policy`]: one file per prefill-selection policy.
//! - [`cost`]: fitted cost models (prefill, KV transfer, decode step).
//! - [`admission`]: decode selection, rejection rules, output-length estimates.
//! - [`calibration`]: the admission estimates calibrated online on the serving cluster;
//!   [`service`]: the prefill service scale and the TTFT latency floor it learns.
//! - [`drain`]: draining an instance and switching its role without losing a request.
//! - [`replication`]: hot-prefix counters and replica hints.
//! - [`config`]: configuration and its validation.
//!
//! See `docs/conductor.md` for the design and its limits.

pub mod admission;
pub mod calibration;
#[allow(clippy::module_inception)]
pub mod conductor;
pub mod config;
pub mod cost;
mod decide;
pub mod drain;
mod events;
mod link_events;
pub mod links;
mod pending;
pub mod policy;
pub mod replication;
pub mod service;
mod state;
mod store_events;

pub use admission::{OutputLenEstimator, RejectReason};
pub use conductor::{Conductor, Decision, DecodeLoad, PrefillLoad, ScheduleRequest, Snapshot};
pub use config::{ConductorConfig, DecodeSpec, PolicyKind, PrefillSpec, RejectionKind};
pub use cost::{CostModels, DecodeCostModel, FitError, PrefillCostModel, TransferCostModel};
pub use drain::RoleSpec;
pub use links::{LinkDir, LinkLoad, LinkLoads};
pub use replication::ReplicationHint;
pub use store_events::AppliedEvents;

use crate::error::{Categorized, ErrorCategory};
use crate::index::{IndexError, InstanceId};

/// A request id as the caller names it.
pub type RequestId = u64;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConductorError {
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    #[error("unknown instance {0}; add it with add_prefill/add_decode first")]
    UnknownInstance(InstanceId),
    #[error("instance {0} is already registered")]
    DuplicateInstance(InstanceId),
    #[error("unknown request {0} (never scheduled, or already finished)")]
    UnknownRequest(RequestId),
    #[error("request {0} is already scheduled")]
    DuplicateRequest(RequestId),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("request rejected ({reason}): {detail}")]
    Overloaded { reason: RejectReason, detail: String, estimates: Option<Box<Decision>> },
    #[error(transparent)]
    Index(#[from] IndexError),
}

impl Categorized for ConductorError {
    fn category(&self) -> ErrorCategory {
        match self {
            ConductorError::Overloaded { .. } => ErrorCategory::Overloaded,
            ConductorError::Index(e) => e.category(),
            _ => ErrorCategory::InvalidArgument,
        }
    }
}

/// Finite and >= 0, or an error naming the field.
pub(crate) fn check_nonneg(name: &str, v: f64) -> Result<(), ConductorError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(ConductorError::InvalidConfig(format!("{name} must be finite and >= 0, got {v}")))
    }
}

/// > 0, infinity allowed (a rate that costs nothing).
pub(crate) fn check_pos_or_inf(name: &str, v: f64) -> Result<(), ConductorError> {
    if v > 0.0 {
        Ok(())
    } else {
        Err(ConductorError::InvalidConfig(format!("{name} must be > 0 (infinite: costs nothing), got {v}")))
    }
}

/// Finite and > 0.
pub(crate) fn check_pos(name: &str, v: f64) -> Result<(), ConductorError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(ConductorError::InvalidConfig(format!("{name} must be finite and > 0, got {v}")))
    }
}

#[cfg(test)]
mod drain_tests;
#[cfg(test)]
mod fetch_arrival_tests;
#[cfg(test)]
mod fetch_wait_tests;
#[cfg(test)]
mod link_tests;
#[cfg(test)]
mod prefetch_tests;
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod service_tests;
#[cfg(test)]
mod tests;
