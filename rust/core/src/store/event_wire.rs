//! A compact, schema'd byte encoding of a batch of store events, so a worker process can
//! hand its drained events to the conductor's process as one bytes field (msgpack-able,
//! never pickled) and the conductor applies them without a per-event Python object.
//!
//! Layout: the 4-byte magic `MCE1`, then one 18-byte record per event, in store order:
//! kind (u8: 0 stored, 1 evicted, 2 demoted, 3 promoted, 4 removed), tier (u8: 0 dram,
//! 1 ssd), key (u128, little-endian).

use super::error::StoreError;
use super::events::{EventKind, StoreEvent};
use crate::index::Tier;

/// Leading bytes of every encoded batch (the trailing digit is the format version).
pub const MAGIC: &[u8; 4] = b"MCE1";
/// Bytes of one encoded event.
pub const RECORD_BYTES: usize = 18;

fn kind_code(k: EventKind) -> u8 {
    match k {
        EventKind::Stored => 0,
        EventKind::Evicted => 1,
        EventKind::Demoted => 2,
        EventKind::Promoted => 3,
        EventKind::Removed => 4,
    }
}

fn kind_of(code: u8) -> Option<EventKind> {
    Some(match code {
        0 => EventKind::Stored,
        1 => EventKind::Evicted,
        2 => EventKind::Demoted,
        3 => EventKind::Promoted,
        4 => EventKind::Removed,
        _ => return None,
    })
}

/// The events as bytes (see the module docs).
pub fn encode_events(events: &[StoreEvent]) -> Vec<u8> {
    let mut out = Vec::with_capacity(MAGIC.len() + events.len() * RECORD_BYTES);
    out.extend_from_slice(MAGIC);
    for e in events {
        out.push(kind_code(e.kind));
        out.push(e.tier as u8);
        out.extend_from_slice(&e.key.to_le_bytes());
    }
    out
}

/// Parses [`encode_events`]' output; `StoreError::Invalid` (naming what is wrong) for
/// anything else. Never panics on input.
pub fn decode_events(bytes: &[u8]) -> Result<Vec<StoreEvent>, StoreError> {
    let Some(body) = bytes.strip_prefix(MAGIC.as_slice()) else {
        return Err(StoreError::Invalid(format!(
            "encoded store events must start with {:?} (StoreEvents.to_bytes()); got {} bytes that do not",
            std::str::from_utf8(MAGIC).unwrap_or("MCE1"),
            bytes.len()
        )));
    };
    if body.len() % RECORD_BYTES != 0 {
        return Err(StoreError::Invalid(format!(
            "encoded store events: {} bytes after the header are not a whole number of {RECORD_BYTES}-byte records",
            body.len()
        )));
    }
    body.chunks_exact(RECORD_BYTES)
        .enumerate()
        .map(|(i, r)| {
            let kind = kind_of(r[0])
                .ok_or_else(|| StoreError::Invalid(format!("encoded store event {i}: unknown kind code {}", r[0])))?;
            let tier = match r[1] {
                0 => Tier::Dram,
                1 => Tier::Ssd,
                t => return Err(StoreError::Invalid(format!("encoded store event {i}: unknown tier code {t}"))),
            };
            let mut key = [0u8; 16];
            key.copy_from_slice(&r[2..]);
            Ok(StoreEvent { kind, key: u128::from_le_bytes(key), tier })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn event(k: u8, t: bool, key: u128) -> StoreEvent {
        StoreEvent { kind: kind_of(k % 5).unwrap(), key, tier: if t { Tier::Ssd } else { Tier::Dram } }
    }

    proptest! {
        #[test]
        fn wire_round_trips(evs in proptest::collection::vec((0u8..5, any::<bool>(), any::<u128>()), 0..64)) {
            let evs: Vec<StoreEvent> = evs.into_iter().map(|(k, t, key)| event(k, t, key)).collect();
            let bytes = encode_events(&evs);
            prop_assert_eq!(bytes.len(), 4 + evs.len() * RECORD_BYTES);
            prop_assert_eq!(decode_events(&bytes).unwrap(), evs);
        }

        #[test]
        fn wire_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_events(&bytes);
            let mut framed = MAGIC.to_vec();
            framed.extend_from_slice(&bytes);
            let _ = decode_events(&framed);
        }
    }

    #[test]
    fn wire_rejects_bad_input() {
        assert!(decode_events(b"").is_err());
        assert!(decode_events(b"MCE2").is_err());
        assert_eq!(decode_events(b"MCE1").unwrap(), vec![]);
        let mut b = encode_events(&[event(0, false, 7)]);
        b.push(0);
        assert!(decode_events(&b).is_err());
        let mut b = encode_events(&[event(0, false, 7)]);
        b[4] = 9;
        assert!(matches!(decode_events(&b), Err(StoreError::Invalid(m)) if m.contains("kind")));
        let mut b = encode_events(&[event(0, false, 7)]);
        b[5] = 2;
        assert!(matches!(decode_events(&b), Err(StoreError::Invalid(m)) if m.contains("tier")));
    }
}
