//! Which reserved objects an owner still waits to land, and how much of each has. The
//! owner `expect`s a group of objects (one put's, in one or more watched regions: their
//! slot offsets and sizes); every landed write adds the bytes of the objects' slots it
//! covers, and the write that completes a group's last object runs `on_complete` for the
//! whole group before it is answered (the regions' [`WriteLanded`]). The other writes of
//! the group are answered at once, so the writer learns of the group's outcome from its
//! last write: a writer whose writes all succeeded knows the group was completed.
//!
//! Coverage is kept as byte ranges, not a byte count: a slice that a writer sent again
//! after losing a connection (its first copy may have landed) covers nothing new, so an
//! object is never complete while a range of it is still unwritten.
//!
//! Objects may also be held *unbound* (`expect_unbound`): slots reserved before their
//! writer knew what it would put in them (a store node's spare slots). Their writes are
//! counted as they land, but nothing completes until the owner `arm`s a group of them,
//! once it knows what they are; `arm` says whether that group has landed whole already
//! (then the owner completes it itself), else the write that completes it does. So the
//! owner may learn what the slots hold before, during or after their bytes arrive.
//!
//! A watched region's slots all have its `chunk_bytes`; an object of `size` bytes holds
//! `ceil(size / chunk_bytes)` of them, not necessarily adjacent, and of its last slot only
//! `size - (n - 1) * chunk_bytes` bytes.

use hashbrown::{HashMap, HashSet};
use parking_lot::Mutex;

use super::landing::WriteLanded;
use super::{AccessError, RegionId};

/// What completes a group: its objects' ids (in `expect` order) and its token. Its error
/// is the completing write's answer.
pub type OnComplete<T> = Box<dyn Fn(Vec<u64>, T) -> Result<(), AccessError> + Send + Sync>;

/// One object of a group, as `expect` takes it.
pub struct Expected<'a> {
    pub id: u64,
    pub region: RegionId,
    /// One per slot, each at a slot boundary.
    pub offsets: &'a [u64],
    pub size: u64,
}

/// The objects some owner waits for, in the regions it watches.
pub struct LandingTable<T> {
    state: Mutex<State<T>>,
    on_complete: OnComplete<T>,
}

struct State<T> {
    /// Watched region -> its slot size.
    chunk: HashMap<RegionId, u64>,
    /// (region, slot index) -> (object id, the slot's place in the object's `slots`).
    slots: HashMap<(RegionId, u64), (u64, usize)>,
    objects: HashMap<u64, Pending>,
    /// Group id (its first object's id) -> the group.
    groups: HashMap<u64, Group<T>>,
}

struct Pending {
    /// None: unbound, not in a group until `arm`.
    group: Option<u64>,
    region: RegionId,
    /// Bytes of the object not yet covered by a landed write.
    missing: u64,
    slots: Vec<SlotCover>,
}

struct Group<T> {
    ids: Vec<u64>,
    /// Objects of the group not yet complete.
    waiting: usize,
    token: T,
}

struct SlotCover {
    index: u64,
    /// Bytes of the slot the object uses (from the slot's start).
    used: u64,
    /// Disjoint, sorted ranges (slot-relative) landed so far.
    covered: Vec<(u64, u64)>,
}

impl SlotCover {
    /// Adds `lo..hi` (slot-relative, inside `used`) and returns how many of its bytes
    /// were not covered before.
    fn cover(&mut self, lo: u64, hi: u64) -> u64 {
        let mut new = hi - lo;
        let (mut start, mut end) = (lo, hi);
        let mut kept = Vec::with_capacity(self.covered.len() + 1);
        for &(a, b) in &self.covered {
            if b < start || a > end {
                kept.push((a, b));
                continue;
            }
            // overlaps or touches: what of it lies inside lo..hi was counted already
            new -= b.min(hi).saturating_sub(a.max(lo));
            start = start.min(a);
            end = end.max(b);
        }
        kept.push((start, end));
        kept.sort_unstable();
        self.covered = kept;
        new
    }
}

impl<T> LandingTable<T> {
    pub fn new(on_complete: OnComplete<T>) -> LandingTable<T> {
        LandingTable {
            state: Mutex::new(State {
                chunk: HashMap::new(),
                slots: HashMap::new(),
                objects: HashMap::new(),
                groups: HashMap::new(),
            }),
            on_complete,
        }
    }

    /// Watches `region`, whose slots have `chunk_bytes` bytes (attach the table to the
    /// region's engine with `Engine::watch_writes` too).
    pub fn add_region(&self, region: RegionId, chunk_bytes: u64) -> Result<(), String> {
        if chunk_bytes == 0 {
            return Err("a watched region needs chunk_bytes > 0".into());
        }
        let mut st = self.state.lock();
        if st.chunk.contains_key(&region) {
            return Err(format!("region {region} is watched already"));
        }
        st.chunk.insert(region, chunk_bytes);
        Ok(())
    }

    /// Waits for a group of objects (at least one; each of at least one byte). A slot
    /// that an earlier object still held here (one whose reservation ended without a
    /// `forget`) is taken over, and that object's group forgotten whole. Nothing is
    /// recorded when any object is refused.
    pub fn expect(&self, objects: &[Expected<'_>], token: T) -> Result<(), String> {
        self.add(objects, Some(token))
    }

    /// Counts the writes that land in these objects' slots without waiting for them as a
    /// group: nothing completes until `arm` names them. Refused as `expect` refuses.
    pub fn expect_unbound(&self, objects: &[Expected<'_>]) -> Result<(), String> {
        self.add(objects, None)
    }

    fn add(&self, objects: &[Expected<'_>], token: Option<T>) -> Result<(), String> {
        let mut st = self.state.lock();
        let mut pending = Vec::with_capacity(objects.len());
        for o in objects {
            let cb = *st.chunk.get(&o.region).ok_or_else(|| format!("region {} is not watched here", o.region))?;
            pending.push((o.id, Pending::new(o, cb)?));
        }
        let Some(&(group, _)) = pending.first() else { return Err("a group needs at least one object".into()) };
        let (mut seen_ids, mut seen_slots) = (HashSet::new(), HashSet::new());
        for (id, p) in &pending {
            if !seen_ids.insert(*id) {
                return Err(format!("object {id} is twice in the group"));
            }
            if let Some(s) = p.slots.iter().find(|s| !seen_slots.insert((p.region, s.index))) {
                return Err(format!("object {id}: slot {} of region {} is held twice in the group", s.index, p.region));
            }
        }
        for (id, p) in &pending {
            st.forget(*id);
            for s in &p.slots {
                if let Some(&(other, _)) = st.slots.get(&(p.region, s.index)) {
                    st.forget(other);
                }
            }
        }
        st.forget_group(group);
        let ids: Vec<u64> = pending.iter().map(|(id, _)| *id).collect();
        let bound = token.is_some();
        for (id, mut p) in pending {
            p.group = bound.then_some(group);
            for (k, s) in p.slots.iter().enumerate() {
                st.slots.insert((p.region, s.index), (id, k));
            }
            st.objects.insert(id, p);
        }
        if let Some(token) = token {
            st.groups.insert(group, Group { waiting: ids.len(), ids, token });
        }
        Ok(())
    }

    /// Makes unbound objects `ids` one group completed with `token`. `Ok(true)`: every
    /// byte of them had landed already, so nothing will complete them: the caller does
    /// (they are no longer waited for). `Ok(false)`: the write that lands their last
    /// missing byte completes them. Refused, changing nothing, when an id is not an
    /// unbound object here (never held, forgotten, or armed already) or is named twice.
    pub fn arm(&self, ids: &[u64], token: T) -> Result<bool, String> {
        let mut st = self.state.lock();
        let Some(&group) = ids.first() else { return Err("arm: a group needs at least one object".into()) };
        let mut seen = HashSet::new();
        for id in ids {
            if !seen.insert(*id) {
                return Err(format!("arm: object {id} is named twice"));
            }
            match st.objects.get(id) {
                Some(p) if p.group.is_none() => {}
                Some(_) => return Err(format!("arm: object {id} is in a group already")),
                None => return Err(format!("arm: object {id} is not held unbound here")),
            }
        }
        let mut waiting = 0;
        for id in ids {
            let landed = st.objects.get(id).is_some_and(|p| p.missing == 0);
            if landed {
                st.take_object(*id);
            } else if let Some(p) = st.objects.get_mut(id) {
                p.group = Some(group);
                waiting += 1;
            }
        }
        if waiting == 0 {
            return Ok(true);
        }
        st.groups.insert(group, Group { waiting, ids: ids.to_vec(), token });
        Ok(false)
    }

    /// Stops waiting for object `id`'s group (its reservation ended, so the group cannot
    /// complete); whether it was waited for.
    pub fn forget(&self, id: u64) -> bool {
        self.state.lock().forget(id)
    }

    /// `forget` of each id, under one lock; how many were waited for.
    pub fn forget_many(&self, ids: &[u64]) -> usize {
        let mut st = self.state.lock();
        if st.objects.is_empty() {
            return 0;
        }
        ids.iter().filter(|&&id| st.forget(id)).count()
    }

    /// How many objects are waited for.
    pub fn pending(&self) -> usize {
        self.state.lock().objects.len()
    }

    /// Adds a landed write of `offset..offset+len` of `region`; the groups it completed
    /// are taken out and returned, for the caller to complete outside the lock.
    fn land(&self, region: RegionId, offset: u64, len: u64) -> Vec<(Vec<u64>, T)> {
        let Some(end) = offset.checked_add(len).filter(|_| len > 0) else { return Vec::new() };
        let mut st = self.state.lock();
        if st.objects.is_empty() {
            return Vec::new();
        }
        let Some(&cb) = st.chunk.get(&region) else { return Vec::new() };
        let mut done = Vec::new();
        for index in offset / cb..=(end - 1) / cb {
            let Some(&(id, k)) = st.slots.get(&(region, index)) else { continue };
            let Some(p) = st.objects.get_mut(&id) else { continue };
            let s = &mut p.slots[k];
            let base = index * cb;
            let (lo, hi) = (offset.max(base) - base, end.min(base + s.used).saturating_sub(base));
            if lo >= hi {
                continue; // (only the unused tail of the object's last slot)
            }
            let newly = s.cover(lo, hi);
            p.missing -= newly;
            // (an unbound object stays, complete, until `arm` makes it part of a group)
            if let (0, Some(group), true) = (p.missing, p.group, newly > 0) {
                st.take_object(id);
                if let Some(g) = st.groups.get_mut(&group) {
                    g.waiting -= 1;
                    if g.waiting == 0 {
                        done.extend(st.groups.remove(&group).map(|g| (g.ids, g.token)));
                    }
                }
            }
        }
        done
    }
}

impl Pending {
    /// Object `o` in slots of `cb` bytes, nothing landed yet (its group set by `expect`).
    fn new(o: &Expected<'_>, cb: u64) -> Result<Pending, String> {
        if o.size == 0 {
            return Err(format!("object {}: an empty object has no byte to land", o.id));
        }
        let n = o.size.div_ceil(cb);
        if o.offsets.len() as u64 != n {
            return Err(format!(
                "object {}: {} bytes hold {n} slots of {cb} bytes, got {} offsets",
                o.id,
                o.size,
                o.offsets.len()
            ));
        }
        if let Some(off) = o.offsets.iter().find(|&&off| off % cb != 0) {
            return Err(format!("object {}: slot offset {off} is not a multiple of {cb}", o.id));
        }
        let last = o.offsets.len() - 1;
        let slots = o
            .offsets
            .iter()
            .enumerate()
            .map(|(k, &off)| SlotCover {
                index: off / cb,
                used: if k < last { cb } else { o.size - last as u64 * cb },
                covered: Vec::new(),
            })
            .collect();
        Ok(Pending { group: None, region: o.region, missing: o.size, slots })
    }
}

impl<T> State<T> {
    /// Removes object `id` and its slots; `Some(its group)` if it was held (an unbound
    /// object's: None inside).
    fn take_object(&mut self, id: u64) -> Option<Option<u64>> {
        let p = self.objects.remove(&id)?;
        for s in &p.slots {
            if self.slots.get(&(p.region, s.index)).is_some_and(|&(o, _)| o == id) {
                self.slots.remove(&(p.region, s.index));
            }
        }
        Some(p.group)
    }

    fn forget_group(&mut self, group: u64) {
        if let Some(g) = self.groups.remove(&group) {
            for id in g.ids {
                self.take_object(id);
            }
        }
    }

    fn forget(&mut self, id: u64) -> bool {
        match self.take_object(id) {
            Some(group) => {
                if let Some(group) = group {
                    self.forget_group(group);
                }
                true
            }
            None => false,
        }
    }
}

impl<T: Send> WriteLanded for LandingTable<T> {
    fn landed(&self, region: RegionId, offset: u64, len: u64) -> Result<(), AccessError> {
        let mut result = Ok(());
        for (ids, token) in self.land(region, offset, len) {
            result = result.and((self.on_complete)(ids, token));
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    const CB: u64 = 100;
    const R: RegionId = 1;
    const R2: RegionId = 2;

    type Seen = Arc<Mutex<Vec<(Vec<u64>, &'static str)>>>;

    /// A table over regions 1 (100-byte slots) and 2 (1000-byte slots) whose
    /// completions are recorded; a group whose first object is 7 is refused.
    fn table() -> (LandingTable<&'static str>, Seen) {
        let seen: Seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let t = LandingTable::new(Box::new(move |ids: Vec<u64>, tok| {
            let refuse = ids[0] == 7;
            s.lock().push((ids, tok));
            if refuse {
                Err(AccessError::OwnerRefused)
            } else {
                Ok(())
            }
        }));
        t.add_region(R, CB).unwrap();
        t.add_region(R2, 10 * CB).unwrap();
        (t, seen)
    }

    fn obj(id: u64, region: RegionId, offsets: &[u64], size: u64) -> Expected<'_> {
        Expected { id, region, offsets, size }
    }

    fn land(t: &LandingTable<&'static str>, region: RegionId, offset: u64, len: u64) -> Result<(), AccessError> {
        t.landed(region, offset, len)
    }

    #[test]
    fn an_object_completes_on_its_last_byte_in_any_order() {
        let (t, seen) = table();
        // 250 bytes in slots 3, 4 and 9 (the last one: 50 bytes), landed out of order
        t.expect(&[obj(1, R, &[300, 400, 900], 250)], "a").unwrap();
        assert_eq!(land(&t, R, 900, 30), Ok(()));
        assert_eq!(land(&t, R, 300, 100), Ok(()));
        assert_eq!(land(&t, R, 930, 19), Ok(()));
        assert_eq!(land(&t, R, 400, 100), Ok(()));
        assert!(seen.lock().is_empty(), "byte 949 of slot 9 is still missing");
        assert_eq!(land(&t, R2, 949, 1), Ok(()), "the same offset in another region");
        assert!(seen.lock().is_empty());
        assert_eq!(land(&t, R, 949, 1), Ok(()));
        assert_eq!(*seen.lock(), vec![(vec![1], "a")]);
        assert_eq!(t.pending(), 0);
        // later writes into those slots complete nothing
        assert_eq!(land(&t, R, 300, 100), Ok(()));
        assert_eq!(seen.lock().len(), 1);
    }

    #[test]
    fn a_group_completes_with_its_last_object_across_regions() {
        let (t, seen) = table();
        t.expect(&[obj(2, R, &[0], 100), obj(3, R2, &[2000, 3000], 1500), obj(4, R, &[500], 1)], "g").unwrap();
        assert_eq!(t.pending(), 3);
        assert_eq!(land(&t, R, 0, 100), Ok(()));
        assert_eq!(land(&t, R, 500, 1), Ok(()));
        assert_eq!(land(&t, R2, 2000, 1000), Ok(()));
        assert!(seen.lock().is_empty(), "object 3's second slot is missing");
        assert_eq!(t.pending(), 1);
        assert_eq!(land(&t, R2, 3000, 500), Ok(()));
        assert_eq!(*seen.lock(), vec![(vec![2, 3, 4], "g")]);
        assert_eq!(t.pending(), 0);
    }

    #[test]
    fn a_range_landed_twice_counts_once() {
        let (t, seen) = table();
        t.expect(&[obj(2, R, &[0, 100], 200)], "b").unwrap();
        assert_eq!(land(&t, R, 0, 100), Ok(()));
        assert_eq!(land(&t, R, 0, 100), Ok(())); // sent again after a lost connection
        assert_eq!(land(&t, R, 50, 60), Ok(())); // overlapping both slots
        assert!(seen.lock().is_empty(), "bytes 110..200 never landed");
        assert_eq!(land(&t, R, 110, 90), Ok(()));
        assert_eq!(*seen.lock(), vec![(vec![2], "b")]);
    }

    #[test]
    fn the_unused_tail_of_the_last_slot_is_not_waited_for() {
        let (t, seen) = table();
        t.expect(&[obj(3, R, &[500], 40)], "c").unwrap();
        assert_eq!(land(&t, R, 540, 60), Ok(()));
        assert!(seen.lock().is_empty());
        assert_eq!(land(&t, R, 500, 40), Ok(()));
        assert_eq!(*seen.lock(), vec![(vec![3], "c")]);
    }

    #[test]
    fn a_refused_completion_is_the_completing_writes_answer() {
        let (t, seen) = table();
        t.expect(&[obj(7, R, &[0], 10), obj(8, R, &[100], 10)], "x").unwrap();
        assert_eq!(land(&t, R, 0, 10), Ok(()));
        assert_eq!(land(&t, R, 100, 5), Ok(()));
        assert_eq!(land(&t, R, 105, 5), Err(AccessError::OwnerRefused));
        assert_eq!(*seen.lock(), vec![(vec![7, 8], "x")]);
    }

    #[test]
    fn forgetting_one_object_or_taking_its_slot_ends_the_groups_wait() {
        let (t, seen) = table();
        t.expect(&[obj(4, R, &[0, 100], 200), obj(5, R, &[300], 100)], "d").unwrap();
        assert!(t.forget(5));
        assert!(!t.forget(4), "its group went with object 5");
        assert_eq!(t.pending(), 0);
        assert_eq!(land(&t, R, 0, 400), Ok(()));
        assert!(seen.lock().is_empty());
        // slot 2 reserved again for object 9 before object 6's group was forgotten
        t.expect(&[obj(6, R, &[200], 100), obj(10, R, &[600], 100)], "e").unwrap();
        t.expect(&[obj(9, R, &[200], 100)], "f").unwrap();
        assert_eq!(t.pending(), 1, "object 6's whole group is dropped");
        assert_eq!(land(&t, R, 200, 100), Ok(()));
        assert_eq!(land(&t, R, 600, 100), Ok(()));
        assert_eq!(*seen.lock(), vec![(vec![9], "f")]);
    }

    #[test]
    fn unbound_objects_complete_only_once_armed_before_during_or_after_landing() {
        let (t, seen) = table();
        t.expect_unbound(&[obj(20, R, &[0], 100), obj(21, R, &[100], 100), obj(22, R, &[200, 300], 150)]).unwrap();
        t.expect_unbound(&[obj(23, R2, &[0], 10)]).unwrap();
        // all of 20 and 21 land before anything is armed: nothing completes
        assert_eq!(land(&t, R, 0, 200), Ok(()));
        assert!(seen.lock().is_empty());
        assert_eq!(t.pending(), 4);
        // armed after landing: the caller completes them, nothing else will
        assert_eq!(t.arm(&[21, 20], "late"), Ok(true));
        assert!(seen.lock().is_empty());
        assert_eq!(t.pending(), 2);
        // armed while half landed: the write of its last byte completes it
        assert_eq!(land(&t, R, 200, 100), Ok(()));
        assert_eq!(t.arm(&[22], "during"), Ok(false));
        assert_eq!(land(&t, R, 300, 49), Ok(()));
        assert!(seen.lock().is_empty(), "byte 349 is missing");
        assert_eq!(land(&t, R, 300, 50), Ok(()));
        assert_eq!(*seen.lock(), vec![(vec![22], "during")]);
        // armed before any byte
        assert_eq!(t.arm(&[23], "early"), Ok(false));
        assert_eq!(land(&t, R2, 0, 10), Ok(()));
        assert_eq!(seen.lock().last(), Some(&(vec![23], "early")));
        assert_eq!(t.pending(), 0);
    }

    #[test]
    fn arming_what_is_not_unbound_is_refused_and_changes_nothing() {
        let (t, seen) = table();
        t.expect_unbound(&[obj(30, R, &[0], 10), obj(31, R, &[100], 10)]).unwrap();
        t.expect(&[obj(32, R, &[200], 10)], "bound").unwrap();
        assert!(t.arm(&[], "x").is_err());
        assert!(t.arm(&[30, 99], "x").is_err(), "99 was never held");
        assert!(t.arm(&[30, 32], "x").is_err(), "32 is in a group");
        assert!(t.arm(&[30, 30], "x").is_err());
        assert_eq!(t.arm(&[30], "a"), Ok(false));
        assert!(t.arm(&[30], "again").is_err(), "armed already");
        // an unbound object forgotten (its slots given back) takes no other object with it
        assert!(t.forget(31));
        assert!(t.arm(&[31], "x").is_err());
        assert_eq!(t.pending(), 2);
        assert_eq!(land(&t, R, 0, 300), Ok(()));
        assert_eq!(*seen.lock(), vec![(vec![30], "a"), (vec![32], "bound")]);
    }

    #[test]
    fn bad_expectations_are_refused_whole() {
        let (t, _) = table();
        assert!(t.expect(&[], "z").is_err());
        assert!(t.expect(&[obj(1, R, &[], 0)], "z").is_err());
        assert!(t.expect(&[obj(1, R, &[0], 101)], "z").is_err());
        assert!(t.expect(&[obj(1, R, &[0, 100], 100)], "z").is_err());
        assert!(t.expect(&[obj(1, R, &[50], 10)], "z").is_err());
        assert!(t.expect(&[obj(1, 99, &[0], 10)], "z").is_err(), "not a watched region");
        assert!(t.expect(&[obj(1, R, &[0], 10), obj(1, R, &[100], 10)], "z").is_err());
        assert!(t.expect(&[obj(1, R, &[0], 10), obj(2, R, &[0], 10)], "z").is_err(), "one slot, two objects");
        assert!(t.expect(&[obj(1, R, &[0], 10), obj(2, R, &[150], 10)], "z").is_err());
        assert_eq!(t.pending(), 0);
        assert!(t.add_region(R, CB).is_err());
        assert!(t.add_region(3, 0).is_err());
        // a write past the end of the address space, or empty, lands nothing
        assert_eq!(land(&t, R, u64::MAX, 2), Ok(()));
        assert_eq!(land(&t, R, 0, 0), Ok(()));
    }
}
