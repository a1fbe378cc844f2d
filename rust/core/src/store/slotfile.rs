//! The SSD tier's slot file: a file header, then fixed-size slots, each a 64-byte
//! header (magic, key, length, checksum, generation, header checksum) followed by the
//! block bytes. A slot is written data first, header second; a slot whose header or
//! data checksum does not match (torn write, flipped bit) is never served.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64;

use super::error::StoreError;
use crate::hash::BlockHash;
use crate::mem::page_align;

const FILE_MAGIC: u64 = u64::from_le_bytes(*b"MCRSSSD1");
const SLOT_MAGIC: u64 = u64::from_le_bytes(*b"MCRSBLK1");
const FILE_HEADER: u64 = 4096;
pub const SLOT_HEADER: usize = 64;
pub const FILE_NAME: &str = "blocks.slots";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotHeader {
    pub key: BlockHash,
    pub length: u64,
    pub checksum: u64,
    pub generation: u64,
}

impl SlotHeader {
    fn encode(&self) -> [u8; SLOT_HEADER] {
        let mut b = [0u8; SLOT_HEADER];
        b[0..8].copy_from_slice(&SLOT_MAGIC.to_le_bytes());
        b[8..24].copy_from_slice(&self.key.to_le_bytes());
        b[24..32].copy_from_slice(&self.length.to_le_bytes());
        b[32..40].copy_from_slice(&self.checksum.to_le_bytes());
        b[40..48].copy_from_slice(&self.generation.to_le_bytes());
        let sum = xxh3_64(&b[0..48]);
        b[48..56].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// `Ok(None)` for a never-written slot (all zero magic), `Err(())` for a damaged one.
    fn decode(b: &[u8; SLOT_HEADER]) -> Result<Option<Self>, ()> {
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        if b.iter().all(|&x| x == 0) {
            return Ok(None);
        }
        if u64_at(0) != SLOT_MAGIC || u64_at(48) != xxh3_64(&b[0..48]) {
            return Err(());
        }
        let mut k = [0u8; 16];
        k.copy_from_slice(&b[8..24]);
        Ok(Some(SlotHeader {
            key: u128::from_le_bytes(k),
            length: u64_at(24),
            checksum: u64_at(32),
            generation: u64_at(40),
        }))
    }
}

/// What a scan of an existing file found.
pub struct Recovered {
    /// (slot, header) of every intact block.
    pub intact: Vec<(u32, SlotHeader)>,
    /// Slots whose header or data failed their checksum.
    pub corrupt: u64,
}

pub struct SlotFile {
    file: File,
    path: PathBuf,
    block_bytes: usize,
    stride: u64,
    slots: u32,
}

fn file_header(block_bytes: usize, slots: u32, stride: u64) -> [u8; 40] {
    let mut b = [0u8; 40];
    b[0..8].copy_from_slice(&FILE_MAGIC.to_le_bytes());
    b[8..16].copy_from_slice(&(block_bytes as u64).to_le_bytes());
    b[16..24].copy_from_slice(&(slots as u64).to_le_bytes());
    b[24..32].copy_from_slice(&stride.to_le_bytes());
    let sum = xxh3_64(&b[0..32]);
    b[32..40].copy_from_slice(&sum.to_le_bytes());
    b
}

/// Free bytes of the filesystem holding `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs fills a plain struct for a valid C path.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) != 0 {
            return None;
        }
        Some(st.f_bavail as u64 * st.f_frsize as u64)
    }
}

/// Takes an exclusive `flock` on the tier file (released when the file closes): a second
/// store on the same file, in this process or another, would overwrite the first one's
/// slots, so its open is refused.
fn lock_exclusive(file: &File, path: &Path) -> Result<(), StoreError> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a file descriptor this `File` owns; no memory is involved.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Err(StoreError::Locked(format!(
            "{} is in use by another Store (in this or another process); an SSD tier file has one \
             owner: close that store or give this one another ssd_path",
            path.display()
        )));
    }
    Err(StoreError::io(&format!("locking {}", path.display()), e))
}

/// Why an existing, non-empty file header is not the one this store would write: a
/// damaged header (its checksum fails), a file that is not a tier file, or one made with
/// another geometry (says which).
fn header_mismatch(path: &Path, head: &[u8; 40], block_bytes: usize, slots: u32, stride: u64) -> StoreError {
    let u64_at = |i: usize| u64::from_le_bytes(head[i..i + 8].try_into().unwrap_or([0; 8]));
    let p = path.display();
    // A flipped bit or two in the magic is damage; a wholly different one, another file.
    let magic_bits = (u64_at(0) ^ FILE_MAGIC).count_ones();
    if xxh3_64(&head[0..32]) != u64_at(32) {
        if magic_bits > 8 {
            return StoreError::Invalid(format!("{p} is not an SSD tier file (unknown magic); use a new ssd_path"));
        }
        return StoreError::Corrupt(format!(
            "the file header of {p} is damaged (its checksum does not match): the file cannot be trusted; \
             delete it or use a new ssd_path"
        ));
    }
    if magic_bits != 0 {
        return StoreError::Invalid(format!("{p} is not an SSD tier file of this version; use a new ssd_path"));
    }
    StoreError::Invalid(format!(
        "{p} was made with block_bytes={}, {} slots of {} bytes; this store asks for block_bytes={block_bytes}, \
         {slots} slots of {stride} bytes: open it with the same block_bytes / ssd_bytes or use a new ssd_path",
        u64_at(8),
        u64_at(16),
        u64_at(24)
    ))
}

impl SlotFile {
    /// The stride of one slot for `block_bytes`.
    pub fn stride_for(block_bytes: usize) -> u64 {
        page_align(SLOT_HEADER + block_bytes) as u64
    }

    /// Opens (or creates) `dir/blocks.slots` with room for `ssd_bytes`.
    pub fn open(dir: &Path, block_bytes: usize, ssd_bytes: u64) -> Result<Self, StoreError> {
        let stride = Self::stride_for(block_bytes);
        let slots = (ssd_bytes.saturating_sub(FILE_HEADER) / stride).min(u32::MAX as u64 - 1) as u32;
        if slots == 0 {
            return Err(StoreError::Invalid(format!(
                "ssd_bytes={ssd_bytes} holds no slot; an SSD slot of block_bytes={block_bytes} needs {} bytes",
                stride + FILE_HEADER
            )));
        }
        std::fs::create_dir_all(dir).map_err(|e| StoreError::io(&format!("creating {}", dir.display()), e))?;
        let path = dir.join(FILE_NAME);
        let existed = path.exists();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| StoreError::io(&format!("opening {}", path.display()), e))?;
        lock_exclusive(&file, &path)?;
        let want = file_header(block_bytes, slots, stride);
        let total = FILE_HEADER + slots as u64 * stride;
        let mut head = [0u8; 40];
        let len = file.metadata().map_err(|e| StoreError::io("stat", e))?.len();
        if existed && len > 0 && len < 40 {
            return Err(StoreError::Invalid(format!(
                "{} is not an SSD tier file ({len} bytes, shorter than its header); use a new ssd_path",
                path.display()
            )));
        }
        if existed && len >= 40 {
            file.read_exact_at(&mut head, 0).map_err(|e| StoreError::io("reading the file header", e))?;
            if head != want && head.iter().any(|&b| b != 0) {
                return Err(header_mismatch(&path, &head, block_bytes, slots, stride));
            }
        }
        let needed = total.saturating_sub(len);
        if needed > 0 {
            if let Some(free) = free_bytes(dir) {
                if free < needed {
                    return Err(StoreError::Io(format!(
                        "{} needs {needed} more bytes for ssd_bytes={ssd_bytes}, only {free} free",
                        dir.display()
                    )));
                }
            }
            file.set_len(total).map_err(|e| StoreError::io("sizing the slot file", e))?;
        }
        if head != want {
            file.write_all_at(&want, 0).map_err(|e| StoreError::io("writing the file header", e))?;
            file.sync_data().map_err(|e| StoreError::io("syncing the slot file", e))?;
        }
        Ok(SlotFile { file, path, block_bytes, stride, slots })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn slots(&self) -> u32 {
        self.slots
    }

    fn offset(&self, slot: u32) -> u64 {
        FILE_HEADER + slot as u64 * self.stride
    }

    /// Writes `data` (block_bytes) into `slot`: data first, then the header.
    pub fn write(&self, slot: u32, key: BlockHash, generation: u64, data: &[u8]) -> std::io::Result<()> {
        let h = SlotHeader { key, length: data.len() as u64, checksum: xxh3_64(data), generation };
        let off = self.offset(slot);
        self.file.write_all_at(data, off + SLOT_HEADER as u64)?;
        self.file.write_all_at(&h.encode(), off)
    }

    /// Clears `slot`'s header (a never-written slot to recovery): a removed block is not
    /// recovered at the next open.
    pub fn erase(&self, slot: u32) -> std::io::Result<()> {
        self.file.write_all_at(&[0u8; SLOT_HEADER], self.offset(slot))
    }

    /// Reads the header of `slot`.
    fn header(&self, slot: u32) -> std::io::Result<Result<Option<SlotHeader>, ()>> {
        let mut b = [0u8; SLOT_HEADER];
        self.file.read_exact_at(&mut b, self.offset(slot))?;
        Ok(SlotHeader::decode(&b))
    }

    /// Reads `slot` into `out` and checks it holds `key` at `generation`, intact.
    /// `Ok(false)`: the slot holds something else or is damaged.
    pub fn read(&self, slot: u32, key: BlockHash, generation: u64, out: &mut [u8]) -> std::io::Result<bool> {
        let h = match self.header(slot)? {
            Ok(Some(h)) => h,
            _ => return Ok(false),
        };
        if h.key != key || h.generation != generation || h.length != out.len() as u64 {
            return Ok(false);
        }
        self.file.read_exact_at(out, self.offset(slot) + SLOT_HEADER as u64)?;
        Ok(xxh3_64(out) == h.checksum)
    }

    /// Scans every slot (verifying data checksums) after a restart.
    pub fn recover(&self) -> Result<Recovered, StoreError> {
        let mut intact = Vec::new();
        let mut corrupt = 0;
        let mut buf = vec![0u8; self.block_bytes];
        for slot in 0..self.slots {
            let h = match self.header(slot).map_err(|e| StoreError::io("recovery read", e))? {
                Ok(Some(h)) => h,
                Ok(None) => continue,
                Err(()) => {
                    corrupt += 1;
                    continue;
                }
            };
            let ok = h.length == self.block_bytes as u64
                && self.read(slot, h.key, h.generation, &mut buf).map_err(|e| StoreError::io("recovery read", e))?;
            if ok {
                intact.push((slot, h));
            } else {
                corrupt += 1;
            }
        }
        Ok(Recovered { intact, corrupt })
    }

    pub fn sync(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }
}
