//! The conductor's instance registry, progress events, cache events, snapshots and
//! replica hints. Every method validates before it changes anything.

use super::conductor::{check_time, Conductor, DecodeLoad, PrefillLoad, Snapshot};
use super::config::{DecodeSpec, PrefillSpec};
use super::links::LinkDir;
use super::replication::ReplicationHint;
use super::state::{DecodeInst, PrefillInst, Req, Stage, State};
use super::{ConductorError, RequestId};
use crate::hash::BlockHash;
use crate::index::{InstanceId, Tier};

impl Conductor {
    pub fn add_prefill(&self, id: InstanceId, spec: PrefillSpec) -> Result<(), ConductorError> {
        spec.validate()?;
        let mut st = self.state.lock();
        if st.knows(id) {
            return Err(ConductorError::DuplicateInstance(id));
        }
        let pos = st.prefill_pos(id).unwrap_err();
        st.prefill.insert(pos, PrefillInst::new(id, spec));
        Ok(())
    }

    pub fn add_decode(&self, id: InstanceId, spec: DecodeSpec) -> Result<(), ConductorError> {
        spec.validate()?;
        let mut st = self.state.lock();
        if st.knows(id) {
            return Err(ConductorError::DuplicateInstance(id));
        }
        let pos = st.decode_pos(id).unwrap_err();
        st.decode.insert(pos, DecodeInst::new(id, spec));
        Ok(())
    }

    /// Removes an instance, its cache entries, and every in-flight request that used it
    /// (their ids are returned, sorted, so the caller can retry them).
    pub fn remove_instance(&self, id: InstanceId) -> Result<Vec<RequestId>, ConductorError> {
        let mut st = self.state.lock();
        if !st.knows(id) {
            return Err(ConductorError::UnknownInstance(id));
        }
        let mut dropped: Vec<RequestId> =
            st.reqs.iter().filter(|(_, r)| r.prefill == id || r.decode == id).map(|(&k, _)| k).collect();
        dropped.sort_unstable();
        for rid in &dropped {
            if let Some(mut r) = st.reqs.remove(rid) {
                st.drop_pending(*rid, &mut r);
                st.leave_prefill(*rid, &r);
                st.leave_decode(*rid, &r);
            }
        }
        if let Ok(i) = st.prefill_pos(id) {
            st.prefill.remove(i);
        }
        if let Ok(i) = st.decode_pos(id) {
            st.decode.remove(i);
        }
        if let Some(l) = st.links.as_mut() {
            l.forget(id);
        }
        self.index.remove_instance(id);
        Ok(dropped)
    }

    /// Records that `instance` now holds `hashes` in `tier`; returns how many are new.
    pub fn on_blocks_stored(
        &self,
        instance: InstanceId,
        hashes: &[BlockHash],
        tier: Tier,
    ) -> Result<usize, ConductorError> {
        let st = self.state.lock();
        if !st.knows(instance) {
            return Err(ConductorError::UnknownInstance(instance));
        }
        Ok(self.index.insert(instance, hashes, tier)?)
    }

    /// Records that `instance` dropped `hashes` (from `tier`, or every tier).
    pub fn on_blocks_evicted(
        &self,
        instance: InstanceId,
        hashes: &[BlockHash],
        tier: Option<Tier>,
    ) -> Result<usize, ConductorError> {
        let st = self.state.lock();
        if !st.knows(instance) {
            return Err(ConductorError::UnknownInstance(instance));
        }
        Ok(self.index.remove(instance, hashes, tier))
    }

    /// With the online calibration on: `r`'s prefill is over; its instance's line moves
    /// on from its predicted end (`PrefillInst::served`).
    fn served_in_line(&self, st: &mut State, rid: RequestId, r: &Req) {
        let cal = self.calibration.lock();
        if !cal.enabled || r.stage != Stage::Prefilling {
            return;
        }
        if let Ok(i) = st.prefill_pos(r.prefill) {
            st.prefill[i].served(rid, cal.service.at());
        }
    }

    /// Runs `f` on a request after validating the time; the clock moves only on success.
    fn event<T>(
        &self,
        rid: RequestId,
        now: Option<f64>,
        f: impl FnOnce(&mut State, f64, Req) -> Result<(Option<Req>, T), ConductorError>,
    ) -> Result<T, ConductorError> {
        if let Some(t) = now {
            check_time(t)?;
        }
        let mut st = self.state.lock();
        let t = now.unwrap_or(st.clock);
        let req = st.reqs.get(&rid).cloned().ok_or(ConductorError::UnknownRequest(rid))?;
        let (keep, out) = f(&mut st, t, req)?;
        match keep {
            Some(r) => {
                st.reqs.insert(rid, r);
            }
            None => {
                st.reqs.remove(&rid);
            }
        }
        st.clock = st.clock.max(t);
        Ok(out)
    }

    pub fn on_prefill_started(&self, rid: RequestId, now: Option<f64>) -> Result<(), ConductorError> {
        self.event(rid, now, |st, t, mut r| {
            if r.stage != Stage::Queued {
                return Err(ConductorError::InvalidArgument(format!("request {rid} already started prefill")));
            }
            st.leave_prefill(rid, &r);
            if let Ok(i) = st.prefill_pos(r.prefill) {
                st.prefill[i].running.push((rid, t, r.work_s));
            }
            r.stage = Stage::Prefilling;
            Ok((Some(r), ()))
        })
    }

    /// The prefill instance spent `busy_s` seconds of its engine's time on `rid` (from
    /// when the request reached it, or the previous request's end there if later, to
    /// the end of its compute): one sample of the real per-request service cost for the
    /// online calibration (service.rs). Call it before `on_decode_started`; ignored
    /// for a request past its prefill, and unless the time is finite and >= 0.
    pub fn on_prefill_served(&self, rid: RequestId, busy_s: f64) -> Result<(), ConductorError> {
        if !(busy_s.is_finite() && busy_s >= 0.0) {
            return Err(ConductorError::InvalidArgument(format!(
                "busy_s must be a finite number of seconds >= 0, got {busy_s}"
            )));
        }
        self.event(rid, None, |_, _, r| {
            if r.stage <= Stage::Prefilling {
                self.calibration.lock().served(busy_s, r.work_s);
            }
            Ok((Some(r), ()))
        })
    }

    pub fn on_prefill_finished(&self, rid: RequestId, now: Option<f64>) -> Result<(), ConductorError> {
        self.event(rid, now, |st, t, mut r| {
            if r.stage > Stage::Prefilling {
                return Err(ConductorError::InvalidArgument(format!("request {rid} already finished prefill")));
            }
            self.served_in_line(st, rid, &r);
            st.leave_prefill(rid, &r);
            st.drop_pending(rid, &mut r);
            if let Some(m) = st.member_mut(rid, r.decode) {
                m.arrive_t = t;
                m.end_t = t + r.out_pred * r.tbt_s;
            }
            r.stage = Stage::PrefillDone;
            Ok((Some(r), ()))
        })
    }

    pub fn on_decode_started(&self, rid: RequestId, now: Option<f64>) -> Result<(), ConductorError> {
        self.event(rid, now, |st, t, mut r| {
            if r.stage == Stage::Decoding {
                return Err(ConductorError::InvalidArgument(format!("request {rid} already started decoding")));
            }
            self.served_in_line(st, rid, &r);
            st.leave_prefill(rid, &r);
            st.drop_pending(rid, &mut r);
            if let Some(m) = st.member_mut(rid, r.decode) {
                m.arrive_t = t;
                m.end_t = t + r.out_pred * r.tbt_s;
            }
            r.stage = Stage::Decoding;
            r.decode_t = Some(t);
            self.calibration.lock().first_token(r.admit_t, r.raw_ttft_s, self.config.ttft_slo_s, t);
            Ok((Some(r), ()))
        })
    }

    /// The request is done; its real output length feeds the output-length history.
    /// A length above `max_output_len` is refused (`InvalidArgument`) and the request
    /// stays registered, so the caller can report it again correctly or cancel it.
    pub fn on_decode_finished(
        &self,
        rid: RequestId,
        output_len: usize,
        now: Option<f64>,
    ) -> Result<(), ConductorError> {
        let max = self.config.max_output_len;
        if output_len > max {
            return Err(ConductorError::InvalidArgument(format!(
                "output_len {output_len} of request {rid} exceeds max_output_len {max} (ConductorConfig); \
                 report the number of tokens the request really produced"
            )));
        }
        self.event(rid, now, |st, t, mut r| {
            st.drop_pending(rid, &mut r);
            st.leave_prefill(rid, &r);
            st.leave_decode(rid, &r);
            self.outlen.lock().record(r.key, output_len);
            self.calibration.lock().finished(r.decode_t, output_len, r.raw_tbt_s, t);
            Ok((None, ()))
        })
    }

    /// Drops a request wherever it is (client gone, failure), without recording history.
    pub fn cancel(&self, rid: RequestId) -> Result<(), ConductorError> {
        self.event(rid, None, |st, _, mut r| {
            st.drop_pending(rid, &mut r);
            st.leave_prefill(rid, &r);
            st.leave_decode(rid, &r);
            Ok((None, ()))
        })
    }

    /// Read-only loads at `now` (default: the latest time seen).
    pub fn snapshot(&self, now: Option<f64>) -> Result<Snapshot, ConductorError> {
        if let Some(t) = now {
            check_time(t)?;
        }
        let st = self.state.lock();
        let t = now.unwrap_or(st.clock);
        let model = &self.config.cost.decode;
        Ok(Snapshot {
            now: t,
            prefill: st
                .prefill
                .iter()
                .map(|p| PrefillLoad {
                    id: p.id,
                    speed: p.spec.speed,
                    queued: p.queued_n,
                    running: p.running.len(),
                    queue_s: p.queue_s(t),
                    draining: p.draining,
                })
                .collect(),
            decode: st
                .decode
                .iter()
                .map(|d| DecodeLoad {
                    id: d.id,
                    max_batch: d.spec.max_batch,
                    kv_capacity_tokens: d.spec.kv_capacity_tokens,
                    batch: d.members.len(),
                    decoding: d
                        .members
                        .iter()
                        .filter(|m| st.reqs.get(&m.rid).is_some_and(|r| r.stage == Stage::Decoding))
                        .count(),
                    kv_reserved_tokens: d.kv_reserved,
                    est_tbt_s: if d.members.is_empty() { 0.0 } else { model.predict(d.members.len(), d.ctx_tokens) },
                    draining: d.draining,
                })
                .collect(),
            requests: st.reqs.len(),
        })
    }

    /// Output length the conductor would assume for a prompt starting with `first_block`.
    pub fn predicted_output_len(&self, first_block: Option<BlockHash>) -> f64 {
        self.outlen.lock().predict(first_block)
    }

    /// Replicas worth making now (the paper's hotspot migration), hottest first: for a
    /// hot prefix whose every prefill holder is busy — its queue above
    /// `hot_busy_fraction × ttft_slo_s`, or (contention-aware) its NIC out backed up by
    /// more than `hot_link_busy_s`, so fetching from it is slow — a copy from the holder
    /// that could serve it soonest to the least busy prefill instance without it (nor an
    /// admitted fetch of it on its way there), if that one is less busy. The hints' bytes
    /// add up to at most `hot_replica_max_bytes`.
    pub fn replication_hints(&self, now: Option<f64>) -> Result<Vec<ReplicationHint>, ConductorError> {
        if let Some(t) = now {
            check_time(t)?;
        }
        let cfg = &self.config;
        // per prefill instance: (id, queue, NIC out wait, NIC in wait)
        let (t, loads) = {
            let st = self.state.lock();
            let t = now.unwrap_or(st.clock);
            let wait = |id: InstanceId, d: LinkDir| st.links.as_ref().map_or(0.0, |l| l.wait_s(id, d, t));
            let loads: Vec<(InstanceId, f64, f64, f64)> = st
                .prefill
                .iter()
                .map(|p| (p.id, p.queue_s(t), wait(p.id, LinkDir::NicOut), wait(p.id, LinkDir::NicIn)))
                .collect();
            (t, loads)
        };
        let hot = self.hot.lock().hot(t, cfg.hot_min_hits);
        let busy = cfg.hot_busy_fraction * cfg.ttft_slo_s;
        let block_bytes = cfg.block_size as f64 * cfg.cost.transfer.bytes_per_token;
        let mut budget = cfg.hot_replica_max_bytes;
        let mut hints = Vec::new();
        for (blocks, hits) in hot {
            let bytes = blocks.len() as f64 * block_bytes;
            if bytes > budget {
                continue; // a smaller one may still fit
            }
            let matches = self.index.match_prefix(&blocks);
            let full = |id: InstanceId| matches.iter().any(|m| m.instance == id && m.total() == blocks.len());
            // the holder that can serve it soonest, by its queue or its links
            let Some(&(from, from_q, from_out, _)) =
                loads.iter().filter(|l| full(l.0)).min_by(|a, b| a.1.min(a.2).total_cmp(&b.1.min(b.2)))
            else {
                continue;
            };
            let queue_bound = from_q > busy;
            let link_bound = from_out > cfg.hot_link_busy_s;
            if !queue_bound && !link_bound {
                continue; // some holder still has time for it
            }
            // an instance that an admitted fetch is bringing the prefix to gets it anyway
            // (the index learns it only once it is stored): a copy there would move the
            // same bytes twice
            let mut coming: Vec<InstanceId> = Vec::new();
            self.state.lock().fetching.longest(&blocks, blocks.len() - 1, |i, _, _| coming.push(i));
            let target = loads
                .iter()
                .copied()
                .filter(|l| !full(l.0) && !coming.contains(&l.0) && l.3 <= cfg.hot_link_busy_s)
                .min_by(|a, b| a.1.total_cmp(&b.1));
            if let Some((to, to_q, _, _)) = target {
                if to_q < from_q || link_bound {
                    budget -= bytes;
                    hints.push(ReplicationHint {
                        blocks,
                        from_instance: from,
                        to_instance: to,
                        hits,
                        from_queue_s: from_q,
                        to_queue_s: to_q,
                    });
                }
            }
        }
        Ok(hints)
    }

    /// Checks every invariant of the state, the hot table and the index.
    pub fn check_integrity(&self) -> Result<(), String> {
        self.state.lock().check()?;
        self.hot.lock().check()?;
        self.index.check_integrity()
    }
}
