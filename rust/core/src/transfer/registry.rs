//! In-process registry: engines of one process find each other by name (the embedded
//! default of the serving layer), and transfers between them are plain memcpy.

use std::sync::{Arc, OnceLock, Weak};

use hashbrown::HashMap;
use parking_lot::Mutex;

use super::inner::EngineInner;
use super::TransferError;

#[derive(Default)]
pub struct EngineRegistry {
    engines: Mutex<HashMap<String, Weak<EngineInner>>>,
}

static GLOBAL: OnceLock<Arc<EngineRegistry>> = OnceLock::new();

impl EngineRegistry {
    pub fn new() -> Arc<EngineRegistry> {
        Arc::new(EngineRegistry::default())
    }

    /// The process-wide default registry.
    pub fn global() -> Arc<EngineRegistry> {
        GLOBAL.get_or_init(EngineRegistry::new).clone()
    }

    pub(crate) fn insert(&self, name: &str, engine: Weak<EngineInner>) -> Result<(), TransferError> {
        let mut m = self.engines.lock();
        if m.get(name).is_some_and(|w| w.strong_count() > 0) {
            return Err(TransferError::InvalidRequest(format!(
                "an engine named {name:?} is already registered in this registry; pick another name"
            )));
        }
        m.insert(name.to_string(), engine);
        Ok(())
    }

    pub(crate) fn remove(&self, name: &str, engine: &Weak<EngineInner>) {
        let mut m = self.engines.lock();
        if m.get(name).is_some_and(|w| w.ptr_eq(engine)) {
            m.remove(name);
        }
    }

    pub(crate) fn get(&self, name: &str) -> Option<Arc<EngineInner>> {
        self.engines.lock().get(name).and_then(|w| w.upgrade()).filter(|e| !e.is_closed())
    }

    /// Names of the live engines, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .engines
            .lock()
            .iter()
            .filter(|(_, w)| w.upgrade().is_some_and(|e| !e.is_closed()))
            .map(|(n, _)| n.clone())
            .collect();
        v.sort();
        v
    }

    /// The TCP address of a live engine ("" when it does not listen).
    pub fn address_of(&self, name: &str) -> Option<String> {
        self.get(name).map(|e| e.address())
    }
}
