//! Fair sharing on top of the in-order link model (`links.rs`): the fetches the
//! conductor has planned, and what a transfer planned later does to them.
//!
//! `links.rs` serves a link's bytes in order: a transfer planned after a fetch queues
//! behind it, so the fetch's price never changes. A real link (and the simulator's) is
//! shared max-min fairly: a KV stream that starts while a fetch runs takes half of the
//! link, and the fetch ends later by about what the stream carried meanwhile. That is
//! the case that made `mooncake` lose on overloaded agentic traces (issue 25): a fetch
//! priced at 0.44 s ran 1.43 s, because the holder then started computing requests
//! admitted after it, whose KV streams shared its NIC out, and every request queued
//! behind the fetch on its instance waited for it while the conductor believed that
//! instance would soon be free.
//!
//! So the conductor keeps each planned fetch (its request, links and priced window);
//! when it plans a transfer on a link, each fetch on that link still running then is
//! *re-priced*: it ends later by `min(what is left of it, what the newcomer brings) /
//! capacity` (two flows sharing a link equally: the shorter of the two is what the
//! other is delayed by). The conductor adds that delay to the fetch's request (its
//! work, so its prefill instance's queue), and later decisions see that queue as it is.

use crate::conductor::RequestId;
use crate::index::InstanceId;

/// A fetch the conductor planned: `bytes` from `src`'s NIC out to `dst`'s NIC in,
/// expected to run from `start` to `end` (re-priced as transfers join its links).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct PlannedFetch {
    pub rid: RequestId,
    pub src: InstanceId,
    pub dst: InstanceId,
    pub start: f64,
    pub end: f64,
    pub bytes: f64,
}

impl PlannedFetch {
    /// Bytes still to move at `t`, spreading the fetch evenly over its window.
    fn left_at(&self, t: f64) -> f64 {
        if t >= self.end {
            0.0
        } else if t <= self.start || self.end <= self.start {
            self.bytes
        } else {
            self.bytes * (self.end - t) / (self.end - self.start)
        }
    }
}

/// Most fetches kept: past this the ones that ended longest ago (by their window) go.
const KEEP: usize = 4096;

/// The planned fetches (few at a time: one per admitted request with a fetch whose
/// prefill has not finished).
#[derive(Debug, Clone, Default)]
pub(crate) struct PlannedFetches {
    v: Vec<PlannedFetch>,
}

impl PlannedFetches {
    pub fn add(&mut self, f: PlannedFetch) {
        if self.v.len() >= KEEP {
            self.v.sort_by(|a, b| b.end.total_cmp(&a.end));
            self.v.truncate(KEEP / 2);
        }
        self.v.push(f);
    }

    /// The request's prefill (so its fetch) started at `t`: its window moves there.
    pub fn started(&mut self, rid: RequestId, t: f64) {
        for f in self.v.iter_mut().filter(|f| f.rid == rid) {
            let d = t - f.start;
            f.start += d;
            f.end += d;
        }
    }

    /// The request's prefill is over (or it is gone): its fetch no longer runs.
    pub fn done(&mut self, rid: RequestId) {
        self.v.retain(|f| f.rid != rid);
    }

    pub fn forget_instance(&mut self, id: InstanceId) {
        self.v.retain(|f| f.src != id && f.dst != id);
    }

    /// A transfer of `bytes` starting at `start` joins the link `out` of instance `id`
    /// (its NIC out when `out`, else its NIC in), of capacity `cap`. Every planned fetch
    /// on that link, other than the newcomer's own request's, still running at `start`
    /// ends later by its fair-share delay; `(request, delay)` goes into `slowed`.
    pub fn share(&mut self, id: InstanceId, out: bool, start: f64, bytes: f64, cap: f64, own: RequestId, slowed: &mut Vec<(RequestId, f64)>) {
        if !(cap.is_finite() && cap > 0.0 && bytes > 0.0) {
            return;
        }
        for f in self.v.iter_mut() {
            let on = if out { f.src == id } else { f.dst == id };
            if !on || f.rid == own || f.end <= start {
                continue;
            }
            // from when both run; a newcomer that started first has sent some alone
            let t = start.max(f.start);
            let theirs = (bytes - (t - start) * cap).max(0.0);
            let delay = f.left_at(t).min(theirs) / cap;
            if delay > 0.0 {
                f.end += delay;
                slowed.push((f.rid, delay));
            }
        }
    }

    /// Instance `id` reported `bytes` queued or in flight on its NIC out (`out`) or in
    /// at `at`, a link of capacity `cap`. A planned fetch on that link still running
    /// then cannot end before those bytes have drained (the link carries the fetch and
    /// what shares it with it): a fetch planned to end sooner ends then; `(request,
    /// seconds later)` goes into `slowed`.
    pub fn reported(&mut self, id: InstanceId, out: bool, at: f64, bytes: f64, cap: f64, slowed: &mut Vec<(RequestId, f64)>) {
        if !(cap.is_finite() && cap > 0.0 && bytes > 0.0) {
            return;
        }
        let drained = at + bytes / cap;
        for f in self.v.iter_mut() {
            let on = if out { f.src == id } else { f.dst == id };
            if on && f.start <= at && f.end > at && f.end < drained {
                slowed.push((f.rid, drained - f.end));
                f.end = drained;
            }
        }
    }

    #[cfg(test)]
    pub fn get(&self, rid: RequestId) -> Option<PlannedFetch> {
        self.v.iter().find(|f| f.rid == rid).copied()
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.v.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fetch(rid: RequestId, start: f64, end: f64, bytes: f64) -> PlannedFetch {
        PlannedFetch { rid, src: 1, dst: 2, start, end, bytes }
    }

    #[test]
    fn a_stream_joining_a_running_fetch_delays_it_by_the_shorter_of_the_two() {
        let mut p = PlannedFetches::default();
        p.add(fetch(7, 0.0, 10.0, 100.0)); // 10 B/s link, alone
        let mut slowed = Vec::new();
        // at 5: 50 bytes left; a 20-byte stream shares the link: the fetch ends 2 s later
        p.share(1, true, 5.0, 20.0, 10.0, 99, &mut slowed);
        assert_eq!(slowed, vec![(7, 2.0)]);
        assert_eq!(p.get(7).unwrap().end, 12.0);
        // a 1,000-byte stream at 12 - 3 = 9: what is left of the fetch (100 * 3/12 = 25 bytes) is the delay
        slowed.clear();
        p.share(1, true, 9.0, 1000.0, 10.0, 99, &mut slowed);
        assert_eq!(slowed.len(), 1);
        assert!((slowed[0].1 - 100.0 * 3.0 / 12.0 / 10.0).abs() < 1e-9, "{slowed:?}");
        // not on that link (2 is the fetch's NIC in, not out), after it, or its own request
        slowed.clear();
        p.share(2, true, 5.0, 20.0, 10.0, 99, &mut slowed);
        p.share(1, true, 100.0, 20.0, 10.0, 99, &mut slowed);
        p.share(1, true, 5.0, 20.0, 10.0, 7, &mut slowed);
        assert!(slowed.is_empty());
        // on its NIC in it counts too
        p.share(2, false, 5.0, 20.0, 10.0, 99, &mut slowed);
        assert_eq!(slowed.len(), 1);
    }

    #[test]
    fn a_stream_that_started_first_delays_by_what_it_has_left() {
        let mut p = PlannedFetches::default();
        p.add(fetch(1, 4.0, 14.0, 100.0));
        let mut slowed = Vec::new();
        // a 50-byte stream from 2: 20 bytes sent alone by 4, 30 left to share
        p.share(1, true, 2.0, 50.0, 10.0, 9, &mut slowed);
        assert_eq!(slowed, vec![(1, 3.0)]);
        // one that is over before the fetch starts delays nothing
        slowed.clear();
        p.share(1, true, 0.0, 30.0, 10.0, 9, &mut slowed);
        assert!(slowed.is_empty());
    }

    #[test]
    fn a_report_of_a_backed_up_link_moves_a_running_fetchs_end() {
        let mut p = PlannedFetches::default();
        p.add(fetch(1, 0.0, 2.0, 10.0));
        p.add(fetch(2, 5.0, 6.0, 10.0)); // not started by the report
        let mut slowed = Vec::new();
        // 1's NIC out holds 30 bytes at 1 (10 B/s): drained at 4, the fetch ends then
        p.reported(1, true, 1.0, 30.0, 10.0, &mut slowed);
        assert_eq!(slowed, vec![(1, 2.0)]);
        // a report that says less moves nothing back (the fetch's end only grows)
        slowed.clear();
        p.reported(1, true, 2.0, 5.0, 10.0, &mut slowed);
        p.reported(2, true, 1.0, 30.0, 10.0, &mut slowed); // 2 is its NIC in, not out
        assert!(slowed.is_empty());
        assert_eq!(p.get(1).unwrap().end, 4.0);
    }

    #[test]
    fn started_moves_the_window_and_done_drops_it() {
        let mut p = PlannedFetches::default();
        p.add(fetch(1, 4.0, 6.0, 10.0));
        p.started(1, 5.0);
        assert_eq!((p.get(1).unwrap().start, p.get(1).unwrap().end), (5.0, 7.0));
        p.done(1);
        assert_eq!(p.len(), 0);
        p.add(fetch(2, 0.0, 1.0, 1.0));
        p.forget_instance(2);
        assert_eq!(p.len(), 0);
    }
}
