//! Link load: the bytes queued and in flight on each link a KV transfer uses, so the
//! conductor prices a fetch on the network as it is, not on an idle one.
//!
//! Every instance has three links: its NIC out, its NIC in and its link to the storage
//! tier. Each link is a fluid queue: a backlog of bytes (as of a time) that drains at
//! the link's capacity, plus transfers the conductor has scheduled to start later (a
//! fetch starts when its prefill leaves the queue; the KV stream to decode when the
//! compute starts). Two sources feed it:
//!
//! - the conductor itself: each admitted request adds its fetch (holder NIC out,
//!   prefill NIC in) and its KV stream (prefill NIC out, decode NIC in) at the time it
//!   expects them to start;
//! - instance reports (`report_link_load`): the bytes an instance's transfer engine has
//!   queued or in flight on each of its links at a given time. A report replaces the
//!   conductor's own count of everything that started by then (the instance knows
//!   better); what the conductor scheduled to start after it is kept on top. A report
//!   older than the one already applied is ignored, and a stale one ages out by
//!   itself: its backlog drains at the link's capacity from the time it was measured.
//!
//! The cost of a transfer under load: the wait for the backlog of its bottleneck link
//! (`backlog / capacity`, the largest over its links) plus the idle-link transfer time
//! of the cost model. Bytes on a link are served in order here, which is pessimistic
//! against a fair-shared link (a small transfer may overtake a large one): a fetch the
//! estimate declines is one the conductor could not have been sure of.

use hashbrown::HashMap;

use crate::index::InstanceId;

/// Which of an instance's links.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkDir {
    NicOut = 0,
    NicIn = 1,
    Storage = 2,
}

/// A future transfer the conductor scheduled: it joins the backlog at `start`.
#[derive(Debug, Clone, Copy)]
struct Planned {
    start: f64,
    bytes: f64,
}

#[derive(Debug, Clone)]
struct Link {
    cap: f64,
    /// Bytes not yet carried, as of `as_of`.
    backlog: f64,
    as_of: f64,
    /// Sorted by start; only transfers that start after `as_of`.
    planned: Vec<Planned>,
}

impl Link {
    fn new(cap: f64) -> Self {
        Link { cap, backlog: 0.0, as_of: f64::NEG_INFINITY, planned: Vec::new() }
    }

    /// The backlog at `t` (>= as_of), counting planned transfers that start by then.
    fn backlog_at(&self, t: f64) -> f64 {
        if !self.cap.is_finite() {
            return 0.0;
        }
        let (mut b, mut at) = (self.backlog, self.as_of);
        for p in &self.planned {
            if p.start > t {
                break;
            }
            if p.start > at {
                b = (b - self.cap * (p.start - at)).max(0.0);
                at = p.start;
            }
            b += p.bytes;
        }
        if t > at {
            b = (b - self.cap * (t - at)).max(0.0);
        }
        b
    }

    /// Moves the planned transfers that started by `t` into the backlog.
    fn fold(&mut self, t: f64) {
        if t <= self.as_of {
            return;
        }
        let n = self.planned.partition_point(|p| p.start <= t);
        self.backlog = self.backlog_at(t);
        self.planned.drain(..n);
        self.as_of = t;
    }

    fn plan(&mut self, start: f64, bytes: f64) {
        if start <= self.as_of {
            self.backlog += bytes;
        } else {
            let k = self.planned.partition_point(|p| p.start <= start);
            self.planned.insert(k, Planned { start, bytes });
        }
        // Folding loses the detail a late report needs (what started after it), so the
        // list is folded only when long: up to its oldest half.
        if self.planned.len() > FOLD_AT {
            let t = self.planned[FOLD_AT / 2].start;
            self.fold(t);
        }
    }

    /// An instance measured `bytes` on this link at `at`: that replaces what the
    /// conductor counted up to then (a report from before the last fold is applied
    /// at the fold's time, drained by what the link carried meanwhile).
    fn report(&mut self, at: f64, bytes: f64) {
        let (at, bytes) =
            if at < self.as_of { (self.as_of, (bytes - self.cap * (self.as_of - at)).max(0.0)) } else { (at, bytes) };
        let n = self.planned.partition_point(|p| p.start <= at);
        self.planned.drain(..n);
        self.backlog = bytes;
        self.as_of = at;
    }
}

/// Planned transfers kept per link before the oldest half is folded into the backlog.
const FOLD_AT: usize = 64;

/// What the conductor knows of every instance's links (see the module docs).
#[derive(Debug, Clone)]
pub struct LinkLoads {
    links: HashMap<InstanceId, [Link; 3]>,
    /// Time of the last report applied, per instance (older ones are ignored).
    reported: HashMap<InstanceId, f64>,
    nic_bps: f64,
    storage_bps: f64,
}

/// One instance's three links as a snapshot sees them (bytes queued at `now`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkLoad {
    pub instance: InstanceId,
    pub nic_out_bytes: f64,
    pub nic_in_bytes: f64,
    pub storage_bytes: f64,
    pub nic_bps: f64,
    pub storage_bps: f64,
}

impl LinkLoads {
    /// Default capacities for instances without their own (`set_bandwidth`).
    pub fn new(nic_bps: f64, storage_bps: f64) -> Self {
        LinkLoads { links: HashMap::new(), reported: HashMap::new(), nic_bps, storage_bps }
    }

    fn entry(&mut self, id: InstanceId) -> &mut [Link; 3] {
        let (n, s) = (self.nic_bps, self.storage_bps);
        self.links.entry(id).or_insert_with(|| [Link::new(n), Link::new(n), Link::new(s)])
    }

    pub fn set_bandwidth(&mut self, id: InstanceId, nic_bps: f64, storage_bps: f64) {
        let l = self.entry(id);
        l[0].cap = nic_bps;
        l[1].cap = nic_bps;
        l[2].cap = storage_bps;
    }

    pub fn forget(&mut self, id: InstanceId) {
        self.links.remove(&id);
        self.reported.remove(&id);
    }

    /// Seconds a transfer starting at `t` waits on link `dir` of `id` for what is ahead of it.
    #[inline]
    pub fn wait_s(&self, id: InstanceId, dir: LinkDir, t: f64) -> f64 {
        match self.links.get(&id) {
            Some(l) => {
                let k = &l[dir as usize];
                k.backlog_at(t) / k.cap
            }
            None => 0.0,
        }
    }

    /// Seconds a fetch from `src` to `dst` starting at `t` waits (its bottleneck link).
    #[inline]
    pub fn fetch_wait_s(&self, src: InstanceId, dst: InstanceId, t: f64) -> f64 {
        self.wait_s(src, LinkDir::NicOut, t).max(self.wait_s(dst, LinkDir::NicIn, t))
    }

    /// The conductor scheduled `bytes` from `src` to `dst`, starting at `start`.
    pub fn plan_transfer(&mut self, src: InstanceId, dst: InstanceId, start: f64, bytes: f64) {
        if bytes > 0.0 && start.is_finite() {
            self.entry(src)[LinkDir::NicOut as usize].plan(start, bytes);
            self.entry(dst)[LinkDir::NicIn as usize].plan(start, bytes);
        }
    }

    /// An instance's report: bytes queued or in flight on each link, measured at `at`.
    /// Returns false (and changes nothing) when it is older than the last applied.
    pub fn report(&mut self, id: InstanceId, at: f64, bytes: [f64; 3]) -> bool {
        if self.reported.get(&id).is_some_and(|&r| at < r) {
            return false;
        }
        self.reported.insert(id, at);
        for (k, b) in self.entry(id).iter_mut().zip(bytes) {
            k.report(at, b);
        }
        true
    }

    pub fn load(&self, id: InstanceId, now: f64) -> LinkLoad {
        let get = |d: LinkDir| self.links.get(&id).map_or(0.0, |l| l[d as usize].backlog_at(now));
        let caps = self.links.get(&id).map_or((self.nic_bps, self.storage_bps), |l| (l[0].cap, l[2].cap));
        LinkLoad {
            instance: id,
            nic_out_bytes: get(LinkDir::NicOut),
            nic_in_bytes: get(LinkDir::NicIn),
            storage_bytes: get(LinkDir::Storage),
            nic_bps: caps.0,
            storage_bps: caps.1,
        }
    }

    /// Instances with link state, sorted by id.
    #[allow(dead_code)]
    pub fn instances(&self) -> Vec<InstanceId> {
        let mut v: Vec<InstanceId> = self.links.keys().copied().collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference: the same fluid queue, replayed step by step from every event.
    fn reference(cap: f64, events: &[(f64, f64)], t: f64) -> f64 {
        let mut ev: Vec<(f64, f64)> = events.iter().copied().filter(|e| e.0 <= t).collect();
        ev.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (mut b, mut at) = (0.0f64, f64::NEG_INFINITY);
        for (s, x) in ev {
            if at.is_finite() {
                b = (b - cap * (s - at)).max(0.0);
            }
            at = s;
            b += x;
        }
        if at.is_finite() {
            b = (b - cap * (t - at)).max(0.0);
        }
        b
    }

    #[test]
    fn backlog_matches_a_step_by_step_replay() {
        let mut seed = 7u64;
        for _ in 0..200 {
            let mut l = LinkLoads::new(10.0, 5.0);
            let mut events = Vec::new();
            let mut now = 0.0;
            for _ in 0..20 {
                let r = crate::conductor::state::next_rand(&mut seed);
                now += (r % 100) as f64 / 100.0;
                let start = now + ((r >> 8) % 300) as f64 / 100.0;
                let bytes = ((r >> 20) % 50) as f64;
                if bytes > 0.0 {
                    l.plan_transfer(1, 2, start, bytes);
                    events.push((start, bytes));
                }
                let probe = now + ((r >> 32) % 500) as f64 / 100.0;
                let want = reference(10.0, &events, probe);
                let got = l.wait_s(1, LinkDir::NicOut, probe) * 10.0;
                assert!((got - want).abs() < 1e-6 * (1.0 + want), "{got} vs {want}");
                assert_eq!(l.wait_s(2, LinkDir::NicIn, probe), l.wait_s(1, LinkDir::NicOut, probe));
            }
        }
    }

    #[test]
    fn a_report_replaces_what_started_and_keeps_what_is_planned() {
        let mut l = LinkLoads::new(10.0, 10.0);
        l.plan_transfer(1, 2, 0.0, 100.0); // started at 0
        l.plan_transfer(1, 2, 5.0, 40.0); // planned for 5
        assert!((l.wait_s(1, LinkDir::NicOut, 1.0) - 9.0).abs() < 1e-9);
        // the instance says its NIC out is idle at 1: the first transfer went elsewhere
        assert!(l.report(1, 1.0, [0.0, 0.0, 0.0]));
        assert_eq!(l.wait_s(1, LinkDir::NicOut, 2.0), 0.0);
        assert!((l.wait_s(1, LinkDir::NicOut, 5.0) - 4.0).abs() < 1e-9);
        // an older report is ignored
        assert!(!l.report(1, 0.5, [1e9, 0.0, 0.0]));
        assert!((l.wait_s(1, LinkDir::NicOut, 5.0) - 4.0).abs() < 1e-9);
        // a stale report drains at the link's capacity
        assert!(l.report(1, 6.0, [50.0, 0.0, 0.0]));
        assert!((l.wait_s(1, LinkDir::NicOut, 8.0) - 3.0).abs() < 1e-9);
        assert_eq!(l.wait_s(1, LinkDir::NicOut, 100.0), 0.0);
    }

    #[test]
    fn fetch_wait_is_the_bottleneck_link() {
        let mut l = LinkLoads::new(10.0, 10.0);
        l.plan_transfer(3, 4, 0.0, 50.0); // 3 out busy 5 s
        l.plan_transfer(5, 6, 0.0, 20.0); // 6 in busy 2 s
        assert!((l.fetch_wait_s(3, 6, 0.0) - 5.0).abs() < 1e-9);
        assert!((l.fetch_wait_s(5, 6, 0.0) - 2.0).abs() < 1e-9);
        assert_eq!(l.fetch_wait_s(7, 8, 0.0), 0.0);
        l.set_bandwidth(3, 50.0, 1.0);
        assert!((l.fetch_wait_s(3, 8, 0.0) - 1.0).abs() < 1e-9);
    }
}
