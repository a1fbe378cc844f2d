//! Draining an instance and switching its role between the prefill and the decode pool
//! without losing a request (unlike `remove_instance`, which drops what used it).
//!
//! The sequence: `drain_instance(id)` (no new request goes there; what it holds keeps its
//! state and finishes through the usual progress events) -> poll `is_drained(id)` (or
//! `held_requests(id)`) -> `switch_role(id, ...)` once it holds nothing. A prefill instance
//! holds a request while it is queued or prefilling there; a decode instance while it is
//! a member of its batch (on its way, or decoding). Draining twice is not an error (the
//! second call only reports the count); `undrain` takes new requests again.

use super::conductor::Conductor;
use super::config::{DecodeSpec, PrefillSpec};
use super::state::{DecodeInst, PrefillInst};
use super::ConductorError;
use crate::index::InstanceId;

/// The role (and its spec) an instance takes in `switch_role`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RoleSpec {
    Prefill(PrefillSpec),
    Decode(DecodeSpec),
}

impl Conductor {
    fn set_draining(&self, id: InstanceId, on: bool) -> Result<usize, ConductorError> {
        let mut st = self.state.lock();
        if let Ok(i) = st.prefill_pos(id) {
            st.prefill[i].draining = on;
        } else if let Ok(i) = st.decode_pos(id) {
            st.decode[i].draining = on;
        } else {
            return Err(ConductorError::UnknownInstance(id));
        }
        Ok(st.held(id).unwrap_or(0))
    }

    /// Stops `schedule` from picking `id`; returns how many requests it still holds.
    /// Idempotent. Its cache entries stay (a peer may still fetch from it).
    pub fn drain_instance(&self, id: InstanceId) -> Result<usize, ConductorError> {
        self.set_draining(id, true)
    }

    /// Ends a drain: `id` takes new requests again. Returns what it holds. Idempotent.
    pub fn undrain_instance(&self, id: InstanceId) -> Result<usize, ConductorError> {
        self.set_draining(id, false)
    }

    /// Requests that still need `id` in its current role (see the module docs).
    pub fn held_requests(&self, id: InstanceId) -> Result<usize, ConductorError> {
        self.state.lock().held(id).ok_or(ConductorError::UnknownInstance(id))
    }

    /// Whether `id` is draining.
    pub fn is_draining(&self, id: InstanceId) -> Result<bool, ConductorError> {
        let st = self.state.lock();
        if let Ok(i) = st.prefill_pos(id) {
            return Ok(st.prefill[i].draining);
        }
        st.decode_pos(id).map(|i| st.decode[i].draining).map_err(|_| ConductorError::UnknownInstance(id))
    }

    /// Draining and holding nothing: ready for `switch_role`. (`remove_instance` keeps
    /// its failure semantics: on a drained prefill instance it still drops the requests
    /// past their prefill that name it, whose KV may not have left it yet.)
    pub fn is_drained(&self, id: InstanceId) -> Result<bool, ConductorError> {
        let st = self.state.lock();
        let held = st.held(id).ok_or(ConductorError::UnknownInstance(id))?;
        let draining = match st.prefill_pos(id) {
            Ok(i) => st.prefill[i].draining,
            Err(_) => st.decode_pos(id).map(|i| st.decode[i].draining).unwrap_or(false),
        };
        Ok(draining && held == 0)
    }

    /// Moves a drained instance into the other pool (or re-registers it in its own with a
    /// new spec), not draining any more. Requests already past their prefill on it keep
    /// naming it as their prefill instance; nothing is dropped. Its cache entries stay.
    /// Errors: `UnknownInstance`; `InvalidArgument` when it is not draining or still
    /// holds requests (wait for `is_drained`); `InvalidConfig` for a bad spec.
    pub fn switch_role(&self, id: InstanceId, role: RoleSpec) -> Result<(), ConductorError> {
        match &role {
            RoleSpec::Prefill(s) => s.validate()?,
            RoleSpec::Decode(s) => s.validate()?,
        }
        let mut st = self.state.lock();
        let held = st.held(id).ok_or(ConductorError::UnknownInstance(id))?;
        let (in_prefill, draining) = match st.prefill_pos(id) {
            Ok(i) => (true, st.prefill[i].draining),
            Err(_) => (false, st.decode_pos(id).map(|i| st.decode[i].draining).unwrap_or(false)),
        };
        if !draining {
            return Err(ConductorError::InvalidArgument(format!(
                "instance {id} is not draining; call drain_instance({id}) and wait for is_drained first"
            )));
        }
        if held > 0 {
            return Err(ConductorError::InvalidArgument(format!(
                "instance {id} still holds {held} requests; wait until is_drained({id}) before switch_role"
            )));
        }
        if in_prefill {
            let i = st.prefill_pos(id).map_err(|_| ConductorError::UnknownInstance(id))?;
            st.prefill.remove(i);
        } else {
            let i = st.decode_pos(id).map_err(|_| ConductorError::UnknownInstance(id))?;
            st.decode.remove(i);
        }
        match role {
            RoleSpec::Prefill(spec) => {
                let pos = st.prefill_pos(id).unwrap_err();
                st.prefill.insert(pos, PrefillInst::new(id, spec));
            }
            RoleSpec::Decode(spec) => {
                let pos = st.decode_pos(id).unwrap_err();
                st.decode.insert(pos, DecodeInst::new(id, spec));
            }
        }
        Ok(())
    }
}
