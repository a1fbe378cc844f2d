//! What instances tell the conductor about their links, and what it shows of them:
//! `set_link_bandwidth`, `report_link_load`, `link_loads` (see `links.rs` for the model).

use super::conductor::{check_time, Conductor};
use super::links::LinkLoad;
use super::{check_nonneg, check_pos_or_inf, ConductorError};
use crate::index::InstanceId;

impl Conductor {
    /// The capacities of an instance's links, bytes/s (NIC each way, storage link);
    /// infinite = never a bottleneck. Instances without their own use the transfer
    /// model's `network_bandwidth` / `ssd_bandwidth`.
    pub fn set_link_bandwidth(
        &self,
        instance: InstanceId,
        nic_bps: f64,
        storage_bps: f64,
    ) -> Result<(), ConductorError> {
        check_pos_or_inf("nic_bps", nic_bps)?;
        check_pos_or_inf("storage_bps", storage_bps)?;
        let mut st = self.state.lock();
        if !st.knows(instance) {
            return Err(ConductorError::UnknownInstance(instance));
        }
        if let Some(l) = st.links.as_mut() {
            l.set_bandwidth(instance, nic_bps, storage_bps);
        }
        Ok(())
    }

    /// An instance's measurement at time `at`: bytes queued or in flight on its NIC out,
    /// its NIC in and its storage link (its transfer engine's counters). It replaces
    /// what the conductor counted on those links up to `at`; transfers the conductor
    /// scheduled to start later stay on top. Returns false when the report is older
    /// than the last one applied for the instance (it is ignored), or when the
    /// conductor is not `contention_aware`.
    pub fn report_link_load(
        &self,
        instance: InstanceId,
        at: f64,
        nic_out_bytes: f64,
        nic_in_bytes: f64,
        storage_bytes: f64,
    ) -> Result<bool, ConductorError> {
        check_time(at)?;
        check_nonneg("nic_out_bytes", nic_out_bytes)?;
        check_nonneg("nic_in_bytes", nic_in_bytes)?;
        check_nonneg("storage_bytes", storage_bytes)?;
        let mut st = self.state.lock();
        if !st.knows(instance) {
            return Err(ConductorError::UnknownInstance(instance));
        }
        let applied = match st.links.as_mut() {
            Some(l) => l.report(instance, at, [nic_out_bytes, nic_in_bytes, storage_bytes]),
            None => false,
        };
        st.clock = st.clock.max(at);
        Ok(applied)
    }

    /// Every registered instance's link backlog at `now` (default: the latest time
    /// seen), sorted by id; empty when the conductor is not `contention_aware`.
    pub fn link_loads(&self, now: Option<f64>) -> Result<Vec<LinkLoad>, ConductorError> {
        if let Some(t) = now {
            check_time(t)?;
        }
        let st = self.state.lock();
        let t = now.unwrap_or(st.clock);
        let Some(l) = st.links.as_ref() else { return Ok(Vec::new()) };
        let mut ids: Vec<InstanceId> = st.prefill.iter().map(|p| p.id).chain(st.decode.iter().map(|d| d.id)).collect();
        ids.sort_unstable();
        Ok(ids.into_iter().map(|id| l.load(id, t)).collect())
    }
}
