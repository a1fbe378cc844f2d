//! A vLLM/SGLang KV event batch (the msgpack payload of one ZMQ message), decoded
//! without copying: engine hashes, media and token ids stay slices of the payload.
//!
//! The same wire format and the same semantics as the Python decoder
//! (`mooncake_rs/interop/events.py`, the reference):
//!
//! - a batch is positional `[ts, events, dp_rank?, ...]` or a map `{"ts", "events",
//!   "data_parallel_rank"?, ...}`; `ts` is a float or an int, the rank an int or nil;
//! - each event is positional (the type tag first) or a map with a `"type"` field
//!   (anywhere in the map; the first one counts); both forms may mix in one batch;
//! - `BlockStored [hashes, parent, token_ids, block_size, lora_id, medium, lora_name,
//!   extra_keys, group_idx, kv_cache_spec_kind]`, `BlockRemoved [hashes, medium, group_idx]`,
//!   `AllBlocksCleared []`: fields after `hashes` may be missing (defaults: nil, an
//!   empty token array, block size 0), and trailing positional fields and unknown map
//!   keys are skipped unread; a repeated map key: the last one counts;
//! - `extra_keys` is nil or an array, each entry kept as its msgpack bytes (nil: none);
//! - hashes are ints (u64 or i64) or bytes; `token_ids` is decoded when it is an array
//!   of u32s, and otherwise kept as its msgpack bytes (any one value: the ingestor says
//!   what is wrong with it, after applying the events before it);
//! - an event of a type we do not know is skipped and counted; every other type error,
//!   a truncated payload or bytes after the batch is an [`EventError`] (nothing decoded).
//!
//! Known differences from the reference, all on input vLLM does not send: the contents
//! of an `extra_keys` entry or an unknown event are checked for structure and UTF-8 only
//! (the reference also builds Python objects of them: an invalid timestamp ext or a map
//! with an unhashable key fails there); an entry is kept as sent where the reference
//! re-encodes it (the same bytes for msgpack in its shortest form, as msgspec and
//! msgpack-python write it); a map event with two `"type"` keys uses the first.

use std::ops::Range;

use crate::error::{Categorized, ErrorCategory};
use crate::interop::wire::{utf8, Cursor, Fault, Head};

/// The longest engine block hash accepted as bytes (SHA-256 digests are 32 bytes).
pub const MAX_ENGINE_HASH_BYTES: usize = 64;

/// An engine's block hash as sent: opaque, compared as sent (an int 5 and the bytes
/// `b"\x05"` are different hashes, and so are -1 and 2^64-1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyRef<'a> {
    Int(i128),
    Bytes(&'a [u8]),
}

/// A `BlockStored` event's token ids: decoded while the batch was (the usual case: an
/// array of u32s), or the msgpack value as sent, for the ingestor to say what is wrong.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenIds<'a> {
    /// A range of [`Batch::tokens`].
    Decoded(Range<usize>),
    Raw(&'a [u8]),
}

impl Default for TokenIds<'_> {
    fn default() -> Self {
        TokenIds::Decoded(0..0)
    }
}

/// A `BlockStored` event. `hashes` indexes [`Batch::keys`], `extras` [`Batch::extras`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Stored<'a> {
    pub hashes: Range<usize>,
    pub parent: Option<KeyRef<'a>>,
    /// `token_ids` (empty when missing).
    pub tokens: TokenIds<'a>,
    pub block_size: i128,
    pub medium: Option<&'a str>,
    pub lora_name: Option<&'a str>,
    /// `extra_keys`, one entry per block (an empty range when nil or missing).
    pub extras: Range<usize>,
    pub group_idx: Option<i128>,
    pub kind: Option<&'a str>,
}

/// A `BlockRemoved` event. `hashes` indexes [`Batch::keys`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Removed<'a> {
    pub hashes: Range<usize>,
    pub medium: Option<&'a str>,
    pub group_idx: Option<i128>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event<'a> {
    Stored(Stored<'a>),
    Removed(Removed<'a>),
    Cleared,
}

/// One decoded batch.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Batch<'a> {
    pub ts: f64,
    pub dp_rank: Option<i128>,
    /// Events of a type this decoder does not know (skipped).
    pub unknown: usize,
    pub events: Vec<Event<'a>>,
    /// The engine hashes of every event, back to back.
    pub keys: Vec<KeyRef<'a>>,
    /// The decoded token ids of every `BlockStored`, back to back.
    pub tokens: Vec<u32>,
    /// The `extra_keys` entries of every `BlockStored`, back to back: each the msgpack
    /// bytes of the entry as sent, `None` for nil.
    pub extras: Vec<Option<&'a [u8]>>,
}

impl<'a> Batch<'a> {
    pub fn hashes(&self, r: &Range<usize>) -> &[KeyRef<'a>] {
        &self.keys[r.clone()]
    }

    pub fn extras(&self, r: &Range<usize>) -> &[Option<&'a [u8]>] {
        &self.extras[r.clone()]
    }
}

/// Where one batch's events put their variable-length parts.
struct Out<'o, 'a> {
    keys: &'o mut Vec<KeyRef<'a>>,
    tokens: &'o mut Vec<u32>,
    extras: &'o mut Vec<Option<&'a [u8]>>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    #[error(
        "KV event payload must be a msgpack array [ts, events, dp_rank] or a map {{ts, events, data_parallel_rank}}; got {len} bytes starting {start:02x?}"
    )]
    NotABatch { len: usize, start: Vec<u8> },
    #[error("KV event payload is not valid msgpack: {0}")]
    Msgpack(String),
    #[error("KV event payload is not an event batch: {0}")]
    Batch(String),
    #[error("KV event {index} of the batch is malformed: {message}")]
    Event { index: usize, message: String },
    #[error("KV event payload is not valid msgpack: {0} bytes follow the batch")]
    Trailing(usize),
}

impl Categorized for EventError {
    fn category(&self) -> ErrorCategory {
        ErrorCategory::MalformedEvent
    }
}

/// A field-level failure, placed in its event or the batch by the caller.
enum Bad {
    Wire(Fault),
    Type(String),
}

impl From<Fault> for Bad {
    fn from(f: Fault) -> Self {
        Bad::Wire(f)
    }
}

fn expected(what: &str, field: &str, got: &Head<'_>) -> Bad {
    Bad::Type(format!("{field}: expected {what}, got {}", got.kind()))
}

fn in_event(index: usize) -> impl Fn(Bad) -> EventError {
    move |b| match b {
        Bad::Wire(f) => EventError::Msgpack(f.to_string()),
        Bad::Type(message) => EventError::Event { index, message },
    }
}

fn in_batch(b: Bad) -> EventError {
    match b {
        Bad::Wire(f) => EventError::Msgpack(f.to_string()),
        Bad::Type(m) => EventError::Batch(m),
    }
}

fn int_or_nil(c: &mut Cursor<'_>, field: &str) -> Result<Option<i128>, Bad> {
    match c.head()? {
        Head::Int(v) => Ok(Some(v)),
        Head::Nil => Ok(None),
        h => Err(expected("int | nil", field, &h)),
    }
}

fn str_or_nil<'a>(c: &mut Cursor<'a>, field: &str) -> Result<Option<&'a str>, Bad> {
    match c.head_utf8()? {
        // head_utf8 checked it
        Head::Str(s) => Ok(utf8(s)),
        Head::Nil => Ok(None),
        h => Err(expected("str | nil", field, &h)),
    }
}

fn key_of<'a>(h: Head<'a>, field: &str) -> Result<KeyRef<'a>, Bad> {
    match h {
        Head::Int(v) => Ok(KeyRef::Int(v)),
        // kept whole in the engine hash map: a long one would be memory an engine's
        // publisher (or anyone who can reach the socket) makes the indexer keep
        Head::Bin(b) if b.len() > MAX_ENGINE_HASH_BYTES => Err(Bad::Type(format!(
            "{field}: a bytes block hash of {} bytes; at most {MAX_ENGINE_HASH_BYTES} (a SHA-256 digest is 32)",
            b.len()
        ))),
        Head::Bin(b) => Ok(KeyRef::Bytes(b)),
        h => Err(expected("int | bytes", field, &h)),
    }
}

fn hashes<'a>(c: &mut Cursor<'a>, keys: &mut Vec<KeyRef<'a>>) -> Result<Range<usize>, Bad> {
    let start = keys.len();
    match c.head()? {
        Head::Array(n) => {
            keys.reserve(n.min(c.remaining())); // each item takes at least a byte
            for _ in 0..n {
                let h = c.head()?;
                keys.push(key_of(h, "block_hashes[]")?);
            }
            Ok(start..keys.len())
        }
        h => Err(expected("array", "block_hashes", &h)),
    }
}

fn parent<'a>(c: &mut Cursor<'a>) -> Result<Option<KeyRef<'a>>, Bad> {
    match c.head()? {
        Head::Nil => Ok(None),
        h => key_of(h, "parent_block_hash").map(Some),
    }
}

/// `token_ids`: an array of u32s is decoded into `out` in the same pass that finds its
/// end; anything else is kept as its bytes (checked only for msgpack structure).
fn token_ids<'a>(c: &mut Cursor<'a>, buf: &'a [u8], out: &mut Vec<u32>) -> Result<TokenIds<'a>, Bad> {
    let start = c.pos();
    let first = out.len();
    if let Ok(Head::Array(n)) = c.head() {
        out.reserve(n.min(c.remaining()));
        if c.u32_items(n, out) {
            return Ok(TokenIds::Decoded(first..out.len()));
        }
    }
    out.truncate(first);
    let mut c2 = Cursor::at(buf, start);
    c2.skip(false)?;
    *c = c2;
    Ok(TokenIds::Raw(c.since(start)))
}

/// `extra_keys`: nil, or an array with one entry per block, each kept as its msgpack
/// bytes (nil: `None`), checked for structure and UTF-8.
fn extra_keys<'a>(c: &mut Cursor<'a>, out: &mut Vec<Option<&'a [u8]>>) -> Result<Range<usize>, Bad> {
    let start = out.len();
    match c.head()? {
        Head::Nil => Ok(start..start),
        Head::Array(n) => {
            out.reserve(n.min(c.remaining()));
            for _ in 0..n {
                let at = c.pos();
                c.skip(true)?;
                let entry = c.since(at);
                out.push(if entry == [0xc0] { None } else { Some(entry) });
            }
            Ok(start..out.len())
        }
        h => Err(expected("array | nil", "extra_keys", &h)),
    }
}

fn block_size(c: &mut Cursor<'_>) -> Result<i128, Bad> {
    match c.head()? {
        Head::Int(v) => Ok(v),
        h => Err(expected("int", "block_size", &h)),
    }
}

/// Which event a tag names.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

fn kind_of(tag: &[u8]) -> Option<Kind> {
    match tag {
        b"BlockStored" => Some(Kind::Stored),
        b"BlockRemoved" => Some(Kind::Removed),
        b"AllBlocksCleared" => Some(Kind::Cleared),
        _ => None,
    }
}

/// `[tag, fields...]` with `n` items, the array head already read.
fn positional<'a>(
    c: &mut Cursor<'a>,
    buf: &'a [u8],
    n: usize,
    out: &mut Out<'_, 'a>,
) -> Result<Option<Event<'a>>, Bad> {
    if n == 0 {
        return Err(Bad::Type("expected an array of at least length 1 (the type tag)".into()));
    }
    let tag = match c.head_utf8()? {
        Head::Str(s) => s,
        h => return Err(expected("str", "the type tag", &h)),
    };
    let Some(kind) = kind_of(tag) else {
        for _ in 1..n {
            c.skip(true)?;
        }
        return Ok(None);
    };
    if kind != Kind::Cleared && n < 2 {
        return Err(Bad::Type("expected an array of at least length 2 (the tag and block_hashes)".into()));
    }
    let mut read = 1;
    let ev = match kind {
        Kind::Cleared => Event::Cleared,
        Kind::Stored => {
            let hashes = hashes(c, out.keys)?;
            let (t, e) = (out.tokens.len(), out.extras.len());
            let mut ev = Stored { hashes, tokens: TokenIds::Decoded(t..t), extras: e..e, ..Stored::default() };
            read = 2;
            // parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
            // group_idx, kv_cache_spec_kind
            for field in 0..9 {
                if read == n {
                    break;
                }
                match field {
                    0 => ev.parent = parent(c)?,
                    1 => ev.tokens = token_ids(c, buf, out.tokens)?,
                    2 => ev.block_size = block_size(c)?,
                    3 => drop(int_or_nil(c, "lora_id")?),
                    4 => ev.medium = str_or_nil(c, "medium")?,
                    5 => ev.lora_name = str_or_nil(c, "lora_name")?,
                    6 => ev.extras = extra_keys(c, out.extras)?,
                    7 => ev.group_idx = int_or_nil(c, "group_idx")?,
                    _ => ev.kind = str_or_nil(c, "kv_cache_spec_kind")?,
                }
                read += 1;
            }
            Event::Stored(ev)
        }
        Kind::Removed => {
            let hashes = hashes(c, out.keys)?;
            let mut ev = Removed { hashes, ..Removed::default() };
            read = 2;
            if read < n {
                ev.medium = str_or_nil(c, "medium")?;
                read += 1;
            }
            if read < n {
                ev.group_idx = int_or_nil(c, "group_idx")?;
                read += 1;
            }
            Event::Removed(ev)
        }
    };
    for _ in read..n {
        c.skip(false)?; // fields a newer engine appended
    }
    Ok(Some(ev))
}

/// `{"type": ..., fields...}` with `n` entries, the map head already read: one pass to
/// find the tag and where each field's value is, then the fields of that type.
fn mapped<'a>(c: &mut Cursor<'a>, buf: &'a [u8], n: usize, out: &mut Out<'_, 'a>) -> Result<Option<Event<'a>>, Bad> {
    const FIELDS: [&[u8]; 10] = [
        b"block_hashes",
        b"parent_block_hash",
        b"token_ids",
        b"block_size",
        b"lora_id",
        b"medium",
        b"lora_name",
        b"extra_keys",
        b"group_idx",
        b"kv_cache_spec_kind",
    ];
    let mut at: [Option<usize>; 10] = [None; 10];
    let mut tag: Option<&[u8]> = None;
    let start = c.pos();
    for _ in 0..n {
        let key = match c.head_utf8()? {
            Head::Str(s) => s,
            h => return Err(expected("str", "a key", &h)),
        };
        if key == b"type" && tag.is_none() {
            match c.head_utf8()? {
                Head::Str(s) => tag = Some(s),
                h => return Err(expected("str", "type", &h)),
            }
            continue;
        }
        if let Some(i) = FIELDS.iter().position(|f| *f == key) {
            at[i] = Some(c.pos());
        }
        c.skip(false)?;
    }
    let Some(tag) = tag else {
        return Err(Bad::Type("missing the \"type\" field".into()));
    };
    let Some(kind) = kind_of(tag) else {
        // An unknown type: its contents as the reference decodes them (UTF-8 strings).
        let end = c.pos();
        let mut again = Cursor::at(buf, start);
        for _ in 0..2 * n {
            again.skip(true)?;
        }
        debug_assert_eq!(again.pos(), end);
        return Ok(None);
    };
    let field = |i: usize| at[i].map(|p| Cursor::at(buf, p));
    Ok(Some(match kind {
        Kind::Cleared => Event::Cleared,
        Kind::Stored | Kind::Removed => {
            let Some(mut hc) = field(0) else {
                return Err(Bad::Type("missing the \"block_hashes\" field".into()));
            };
            let hashes = hashes(&mut hc, out.keys)?;
            let medium = match field(5) {
                Some(mut f) => str_or_nil(&mut f, "medium")?,
                None => None,
            };
            let group_idx = match field(8) {
                Some(mut f) => int_or_nil(&mut f, "group_idx")?,
                None => None,
            };
            if kind == Kind::Removed {
                Event::Removed(Removed { hashes, medium, group_idx })
            } else {
                let (t, e) = (out.tokens.len(), out.extras.len());
                let mut ev = Stored {
                    hashes,
                    tokens: TokenIds::Decoded(t..t),
                    extras: e..e,
                    medium,
                    group_idx,
                    ..Stored::default()
                };
                if let Some(mut f) = field(1) {
                    ev.parent = parent(&mut f)?;
                }
                if let Some(mut f) = field(2) {
                    ev.tokens = token_ids(&mut f, buf, out.tokens)?;
                }
                if let Some(mut f) = field(3) {
                    ev.block_size = block_size(&mut f)?;
                }
                if let Some(mut f) = field(4) {
                    int_or_nil(&mut f, "lora_id")?;
                }
                if let Some(mut f) = field(6) {
                    ev.lora_name = str_or_nil(&mut f, "lora_name")?;
                }
                if let Some(mut f) = field(7) {
                    ev.extras = extra_keys(&mut f, out.extras)?;
                }
                if let Some(mut f) = field(9) {
                    ev.kind = str_or_nil(&mut f, "kv_cache_spec_kind")?;
                }
                Event::Stored(ev)
            }
        }
    }))
}

fn events<'a>(c: &mut Cursor<'a>, buf: &'a [u8], batch: &mut Batch<'a>) -> Result<(), EventError> {
    let n = match c.head().map_err(|f| in_batch(f.into()))? {
        Head::Array(n) => n,
        h => return Err(in_batch(expected("array", "events", &h))),
    };
    batch.events.clear();
    batch.keys.clear();
    batch.tokens.clear();
    batch.extras.clear();
    batch.unknown = 0;
    batch.events.reserve(n.min(buf.len()));
    for index in 0..n {
        let err = in_event(index);
        let mut out = Out { keys: &mut batch.keys, tokens: &mut batch.tokens, extras: &mut batch.extras };
        let got = match c.head().map_err(|f| err(f.into()))? {
            Head::Array(k) => positional(c, buf, k, &mut out),
            Head::Map(k) => mapped(c, buf, k, &mut out),
            _ => return Err(err(Bad::Type("an event must be an array or a map".into()))),
        };
        match got.map_err(err)? {
            Some(ev) => batch.events.push(ev),
            None => batch.unknown += 1,
        }
    }
    Ok(())
}

fn ts(c: &mut Cursor<'_>) -> Result<f64, Bad> {
    match c.head()? {
        Head::Float(v) => Ok(v),
        Head::Int(v) => Ok(v as f64),
        h => Err(expected("float", "ts", &h)),
    }
}

/// Decodes one payload. On error nothing is returned (no partial batch).
pub fn decode_batch(buf: &[u8]) -> Result<Batch<'_>, EventError> {
    let mut batch = Batch::default();
    let mut c = Cursor::new(buf);
    match buf.first() {
        Some(0x90..=0x9f | 0xdc | 0xdd) => {
            let Head::Array(n) = c.head().map_err(|f| in_batch(f.into()))? else {
                return Err(EventError::Batch("expected an array".into())); // the first byte said so
            };
            if n < 2 {
                return Err(EventError::Batch(format!("expected an array of at least length 2 [ts, events], got {n}")));
            }
            batch.ts = ts(&mut c).map_err(in_batch)?;
            events(&mut c, buf, &mut batch)?;
            if n > 2 {
                batch.dp_rank = int_or_nil(&mut c, "data_parallel_rank").map_err(in_batch)?;
            }
            for _ in 3..n {
                c.skip(false).map_err(|f| in_batch(f.into()))?;
            }
        }
        Some(0x80..=0x8f | 0xde | 0xdf) => {
            let Head::Map(n) = c.head().map_err(|f| in_batch(f.into()))? else {
                return Err(EventError::Batch("expected a map".into())); // the first byte said so
            };
            let (mut seen_ts, mut seen_events) = (false, false);
            for _ in 0..n {
                let key = match c.head_utf8().map_err(|f| in_batch(f.into()))? {
                    Head::Str(s) => s,
                    h => return Err(in_batch(expected("str", "a key", &h))),
                };
                match key {
                    b"ts" => {
                        batch.ts = ts(&mut c).map_err(in_batch)?;
                        seen_ts = true;
                    }
                    b"events" => {
                        events(&mut c, buf, &mut batch)?;
                        seen_events = true;
                    }
                    b"data_parallel_rank" => {
                        batch.dp_rank = int_or_nil(&mut c, "data_parallel_rank").map_err(in_batch)?
                    }
                    _ => c.skip(false).map_err(|f| in_batch(f.into()))?,
                }
            }
            if !seen_ts || !seen_events {
                let missing = if seen_ts { "events" } else { "ts" };
                return Err(EventError::Batch(format!("missing the \"{missing}\" field")));
            }
        }
        _ => return Err(EventError::NotABatch { len: buf.len(), start: buf[..buf.len().min(8)].to_vec() }),
    }
    if !c.at_end() {
        return Err(EventError::Trailing(buf.len() - c.pos()));
    }
    Ok(batch)
}

#[cfg(test)]
#[path = "events_tests.rs"]
pub(crate) mod tests;
