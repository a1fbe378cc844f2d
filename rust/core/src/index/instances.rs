//! Instance id ↔ dense slot mapping, so holders pack into 32 bits.

use hashbrown::HashMap;

use super::holders::MAX_SLOT;
use super::{IndexError, InstanceId};

#[derive(Default, Debug)]
pub(crate) struct Instances {
    by_id: HashMap<InstanceId, u32>,
    /// slot → id; `None` for a freed slot.
    ids: Vec<Option<InstanceId>>,
    free: Vec<u32>,
}

impl Instances {
    pub(crate) fn slot_of(&self, id: InstanceId) -> Option<u32> {
        self.by_id.get(&id).copied()
    }

    pub(crate) fn id_of(&self, slot: u32) -> Option<InstanceId> {
        self.ids.get(slot as usize).copied().flatten()
    }

    pub(crate) fn get_or_add(&mut self, id: InstanceId) -> Result<u32, IndexError> {
        if let Some(s) = self.slot_of(id) {
            return Ok(s);
        }
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let s = self.ids.len() as u32;
                if s > MAX_SLOT {
                    return Err(IndexError::TooManyInstances(MAX_SLOT + 1));
                }
                self.ids.push(None);
                s
            }
        };
        self.ids[slot as usize] = Some(id);
        self.by_id.insert(id, slot);
        Ok(slot)
    }

    /// Frees the slot; the caller must already have removed every entry that used it.
    pub(crate) fn remove(&mut self, id: InstanceId) {
        if let Some(slot) = self.by_id.remove(&id) {
            self.ids[slot as usize] = None;
            self.free.push(slot);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(crate) fn ids(&self) -> Vec<InstanceId> {
        let mut v: Vec<_> = self.by_id.keys().copied().collect();
        v.sort_unstable();
        v
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.by_id.allocation_size() + self.ids.capacity() * 16 + self.free.capacity() * 4
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        for (&id, &slot) in &self.by_id {
            if self.id_of(slot) != Some(id) {
                return Err(format!("instance {id} maps to slot {slot}, which does not map back"));
            }
        }
        let live = self.ids.iter().filter(|x| x.is_some()).count();
        if live != self.by_id.len() || live + self.free.len() != self.ids.len() {
            return Err("instance slot table out of step with its free list".into());
        }
        Ok(())
    }
}
