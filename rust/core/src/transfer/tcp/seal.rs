//! Frame protection after an authenticated handshake.
//!
//! The handshake proves that both ends know the token, but by itself it protects
//! nothing that follows: a relay could pass a real handshake through and then read KV or
//! inject frames of its own. So when the engines share a token, every frame after the
//! handshake is protected under a per-connection, per-direction key
//! ([`AuthKey::frame_keys`](super::super::auth::AuthKey::frame_keys)), bound to the
//! frame's sequence number (counted per direction from 0, never sent): the frame's
//! header and body (`head`) are authenticated data, its payload (KV bytes) is either
//! encrypted (AES-256-GCM, [`WireProtection::Encrypted`], the default) or left in clear
//! and tagged (GMAC, [`WireProtection::Integrity`]; see [`guard`](super::guard)
//! for why GMAC and which crate), and a [`TAG_LEN`]-byte tag follows. A forged, replayed, reordered
//! or dropped frame fails its tag (or the next one's) and the receiver closes the
//! connection; with encryption a relay sees no KV byte. Without a token there is no
//! authentication at all and frames carry no tag.
//!
//! A frame's payload is protected in records of at most [`RECORD`] bytes, each with its
//! own tag and sequence number (the first record's authenticated data is the head; a
//! frame without a payload is one empty record). Bounded records keep the work in
//! cache: an encrypting sender copies a record into a buffer it reuses, seals it there
//! and hands it to the kernel while it is still hot ([`SEALED_GROUP`]); an integrity-only sender tags a slice's records where they are and the
//! socket write reads the caller's bytes directly (no copy). A receiver reads a record
//! and its tag together and verifies the record right after receiving it,
//! instead of a second pass over a whole slice (1 MiB) from memory. A record dropped,
//! repeated, reordered or moved into another frame fails its sequence number.
//!
//! A receiver can check a tag only after the record's last byte. So the server stages a
//! write's payload record by record and copies a record into the region only once its
//! tag matched: an unverified byte never lands in served memory (a write cut short
//! after some records leaves those verified bytes and fails the request, as a write
//! without a token cut short does). The copy out of the stage uses streaming stores
//! (the region is not read back by this thread; an ordinary copy first reads each
//! destination line from memory), fenced before the write's response. A read response
//! is received straight into the initiator's own buffer and verified (and decrypted)
//! there, whose content is undefined until the request reports `ok` (a bad tag fails or
//! retries the request, never reports it done); sealed records of a response of more
//! than one record are decrypted on a helper thread while the next record arrives
//! ([`Overlap`]), tagged ones are checked as they arrive.

use super::super::config::WireProtection;
use super::guard::Guard;
pub use super::guard::{FrameKey, TAG_LEN};

#[path = "seal_reader.rs"]
mod reader;
#[path = "seal_writer.rs"]
mod writer;
pub use reader::FrameReader;
pub use writer::FrameWriter;

/// Most payload bytes of one protected record (a frame's payload is one or more records).
pub const RECORD: usize = 64 << 10;

/// Most bytes of a frame's head (a header and a small body, `MAX_CONTROL`): more is not a frame.
const MAX_HEAD: usize = 4096;

/// Room after a staged record for its head and the head's length, where a tagged first
/// record's input is laid out ([`Guard::open_with_room`]).
const HEAD_ROOM: usize = MAX_HEAD + 8;

/// One end's keys of a connection (`None` everywhere without a token).
#[derive(Clone, Copy, Default, Debug)]
pub struct FrameKeys {
    pub send: Option<FrameKey>,
    pub recv: Option<FrameKey>,
}

impl FrameKeys {
    pub fn keyed(send: [u8; 32], recv: [u8; 32], protection: WireProtection) -> FrameKeys {
        FrameKeys { send: Some(FrameKey { key: send, protection }), recv: Some(FrameKey { key: recv, protection }) }
    }
}

/// A direction's protection and the number of its next record.
struct Direction {
    guard: Guard,
    seq: u64,
}

impl Direction {
    fn new(key: &FrameKey) -> Direction {
        Direction { guard: Guard::new(key), seq: 0 }
    }

    /// The number of the next record (a connection never sends 2^64 records).
    fn next_seq(&mut self) -> u64 {
        let n = self.seq;
        self.seq = self.seq.wrapping_add(1);
        n
    }
}

#[cfg(test)]
#[path = "seal_tests.rs"]
mod tests;
