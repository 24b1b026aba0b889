//! The shared mapping of a [`super::ShmComm`] group: its file, layout and cleanup.
//!
//! Layout (all offsets fixed by `n` and `slot` bytes, checked when a member opens it):
//! a 128-byte header (magic, `n`, `slot`, the abort word), one 256-byte control block per rank
//! (its stage counter, pid, a "closed" flag and the call headers of the two halves), then, page
//! aligned, two data halves of `slot` bytes per rank. Pages are reserved with `fallocate` when the
//! file is created, so a full `/dev/shm` is an error naming the file, never a SIGBUS later.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapRaw;

use crate::CommError;

/// File names of our mappings start with this, then the creator's pid namespace (the inode of
/// `/proc/self/ns/pid`) and pid: `qsr-shm-<pidns>-<pid>-<random>`. The namespace keeps a sweep from
/// judging files of processes it cannot see (another container sharing `/dev/shm`).
pub(crate) const PREFIX: &str = "qsr-shm-";

/// This process's pid namespace (0 where `/proc` does not say).
pub(crate) fn pid_ns() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}
const MAGIC: u64 = u64::from_le_bytes(*b"QSRSHM02");
const HEADER: usize = 128;
const CTRL: usize = 256;
const PAGE: usize = 4096;

/// The mapping's first 128 bytes.
#[repr(C)]
pub(crate) struct Header {
    magic: AtomicU64,
    n: AtomicU64,
    slot: AtomicU64,
    /// 0, or the first failure any member saw (see `super::Abort`).
    pub abort: AtomicU64,
}

/// One rank's control block; only its owner writes it.
#[repr(C)]
pub(crate) struct Ctrl {
    /// Stages this rank has completed (published with Release after its data).
    pub phase: AtomicU64,
    /// The owner's process id.
    pub pid: AtomicU64,
    /// Nonzero once the owner dropped its communicator.
    pub closed: AtomicU64,
    /// Bumped by the owner while it works elsewhere for the group (a leader on the ring between
    /// hosts), so that members waiting for it count that as progress.
    pub beat: AtomicU64,
    _pad: [u64; 12],
    /// The call header of each data half: sequence number, kind|op<<8|path<<16|tagged<<24|fragment<<32,
    /// root, length in bytes, the sync tag's steps and H.
    pub call: [[AtomicU64; super::HEAD_WORDS]; 2],
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER && std::mem::size_of::<Ctrl>() <= CTRL);

fn data_offset(n: usize) -> usize {
    (HEADER + n * CTRL).div_ceil(PAGE) * PAGE
}

/// Bytes of the mapping of `n` ranks with `slot`-byte halves.
pub(crate) fn size(n: usize, slot: usize) -> usize {
    data_offset(n) + n * 2 * slot
}

/// A mapped group file. The creator removes the file when told (once every member mapped it) or,
/// failing that, when dropped; the memory stays until the last member unmaps it.
pub(crate) struct Mapping {
    raw: Arc<MmapRaw>,
    n: usize,
    slot: usize,
    /// The file while it still exists and we created it.
    owned: Option<PathBuf>,
}

fn io(path: &Path, what: &str, e: std::io::Error) -> CommError {
    CommError::io(format!("{what} shared-memory file {}", path.display()), e)
}

/// A refusal of the file door as [`io`]'s error: the system's cause, or the door's own.
fn door(path: &Path, what: &str, e: qsr_files::FileError) -> CommError {
    match e {
        qsr_files::FileError::Io { source, .. } => io(path, what, source),
        other => io(path, what, other.into()),
    }
}

impl Mapping {
    /// Creates `dir/<PREFIX><pid>-<random>` for `n` ranks and maps it; returns it and its file name.
    pub(crate) fn create(dir: &Path, n: usize, slot: usize) -> Result<(Mapping, String), CommError> {
        let name = format!("{PREFIX}{}-{}-{:016x}", pid_ns(), std::process::id(), rand::random::<u64>());
        let path = dir.join(&name);
        let file =
            qsr_files::create_private(&path, "shared-memory file").map_err(|e| door(&path, "creating the", e))?;
        let mapped = reserve(&file, size(n, slot))
            .map_err(|e| io(&path, "reserving memory for the", e))
            .and_then(|()| map_file(&file, &path));
        let raw = match mapped {
            Ok(raw) => raw,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        // From here on the file is removed when the mapping drops, unless unlinked before.
        let map = Mapping { raw: Arc::new(raw), n, slot, owned: Some(path) };
        let h = map.header();
        h.n.store(n as u64, Ordering::Relaxed);
        h.slot.store(slot as u64, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        Ok((map, name))
    }

    /// Maps the group file `dir/name` made by a creator for `n` ranks of `slot` bytes.
    pub(crate) fn open(dir: &Path, name: &str, n: usize, slot: usize) -> Result<Mapping, CommError> {
        if !name.starts_with(PREFIX) || name.contains('/') {
            return Err(CommError::InvalidArgument(format!("{name:?} is not a qsr shared-memory file name")));
        }
        let path = dir.join(name);
        let file = qsr_files::open_rw(&path, "shared-memory file").map_err(|e| door(&path, "opening the", e))?;
        let len = file.metadata().map_err(|e| io(&path, "reading the size of the", e))?.len();
        if len != size(n, slot) as u64 {
            return Err(CommError::InvalidArgument(format!(
                "shared-memory file {} is {len} bytes, expected {} for {n} ranks",
                path.display(),
                size(n, slot)
            )));
        }
        let map = Mapping { raw: Arc::new(map_file(&file, &path)?), n, slot, owned: None };
        let h = map.header();
        let found = (h.magic.load(Ordering::Acquire), h.n.load(Ordering::Relaxed), h.slot.load(Ordering::Relaxed));
        if found != (MAGIC, n as u64, slot as u64) {
            return Err(CommError::InvalidArgument(format!(
                "shared-memory file {} holds another group (magic, ranks, slot bytes = {found:?})",
                path.display()
            )));
        }
        Ok(map)
    }

    /// Removes the file (every member has mapped it); the memory lives on in the mappings.
    pub(crate) fn unlink(&mut self) -> Result<(), CommError> {
        match self.owned.take() {
            Some(p) => std::fs::remove_file(&p).map_err(|e| io(&p, "removing the", e)),
            None => Ok(()),
        }
    }

    pub(crate) fn header(&self) -> &Header {
        // SAFETY: the mapping is page aligned and at least `HEADER` bytes; `Header` is atomics only,
        // valid for any bit pattern (the file starts zeroed).
        unsafe { &*(self.raw.as_mut_ptr() as *const Header) }
    }

    pub(crate) fn ctrl(&self, rank: usize) -> &Ctrl {
        assert!(rank < self.n);
        // SAFETY: control blocks lie inside the mapping at 256-byte aligned offsets; atomics only.
        unsafe { &*(self.raw.as_mut_ptr().add(HEADER + rank * CTRL) as *const Ctrl) }
    }

    /// A handle on `rank`'s heartbeat that keeps the mapping alive (for a closure another
    /// transport calls while it makes progress).
    pub(crate) fn beat(&self, rank: usize) -> Beat {
        assert!(rank < self.n);
        Beat { raw: Arc::clone(&self.raw), offset: HEADER + rank * CTRL + std::mem::offset_of!(Ctrl, beat) }
    }

    /// The start of `rank`'s data half `half` (`slot` bytes, page aligned).
    pub(crate) fn data(&self, rank: usize, half: usize) -> *mut u8 {
        assert!(rank < self.n && half < 2);
        // SAFETY: the offset is inside the mapping (see `size`).
        unsafe { self.raw.as_mut_ptr().add(data_offset(self.n) + (rank * 2 + half) * self.slot) }
    }
}

/// See [`Mapping::beat`].
pub(crate) struct Beat {
    raw: Arc<MmapRaw>,
    offset: usize,
}

impl Beat {
    pub(crate) fn bump(&self) {
        // SAFETY: `offset` is the 8-byte aligned `beat` field of a control block inside the mapping,
        // which `raw` keeps mapped.
        let beat = unsafe { &*(self.raw.as_mut_ptr().add(self.offset) as *const AtomicU64) };
        beat.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let _ = self.unlink();
    }
}

fn map_file(file: &File, path: &Path) -> Result<MmapRaw, CommError> {
    MmapRaw::map_raw(file).map_err(|e| io(path, "mapping the", e))
}

/// Sizes the file to `len` bytes with its pages allocated now (tmpfs reports a full filesystem
/// here instead of killing us with SIGBUS at first touch).
fn reserve(file: &File, len: usize) -> std::io::Result<()> {
    // SAFETY: plain syscall on an open descriptor.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
    match rc {
        0 => Ok(()),
        // Filesystems without fallocate: size it and let the pages come on demand.
        libc::EOPNOTSUPP | libc::EINVAL => file.set_len(len as u64),
        e => Err(std::io::Error::from_raw_os_error(e)),
    }
}

/// Whether process `pid` exists (a zombie counts as gone).
pub(crate) fn alive(pid: u32) -> bool {
    match qsr_files::read_text(Path::new(&format!("/proc/{pid}/stat")), 4096, "process status") {
        // The state follows the parenthesized command name, which may itself contain ") ".
        Ok(stat) => stat.rsplit_once(") ").is_none_or(|(_, rest)| !rest.starts_with('Z')),
        Err(_) => false,
    }
}

/// Removes group files in `dir` left by processes of our pid namespace that no longer exist (a
/// job killed between creating its mapping and every member opening it); returns the names removed.
pub(crate) fn sweep(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let ours = pid_ns().to_string();
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let mut parts = name.strip_prefix(PREFIX).unwrap_or("").split('-');
        let (Some(ns), Some(Ok(pid))) = (parts.next(), parts.next().map(str::parse::<u32>)) else {
            continue;
        };
        if ns != ours {
            continue;
        }
        if !alive(pid) && std::fs::remove_file(e.path()).is_ok() {
            removed.push(name);
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_page_aligned_and_disjoint() {
        for n in 1..=8 {
            assert_eq!(data_offset(n) % PAGE, 0);
            assert!(data_offset(n) >= HEADER + n * CTRL);
            assert_eq!(size(n, 8192), data_offset(n) + n * 2 * 8192);
        }
    }

    #[test]
    fn create_open_and_unlink() {
        let dir = std::env::temp_dir().join(format!("qsr-shm-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (mut a, name) = Mapping::create(&dir, 3, 4096).unwrap();
        let b = Mapping::open(&dir, &name, 3, 4096).unwrap();
        a.ctrl(2).phase.store(7, Ordering::Release);
        assert_eq!(b.ctrl(2).phase.load(Ordering::Acquire), 7);
        let e = Mapping::open(&dir, &name, 4, 4096).err().unwrap().to_string();
        assert!(e.contains(&name) && e.contains("expected"), "{e}");
        a.unlink().unwrap();
        assert!(!dir.join(&name).exists());
        // SAFETY: a test writing one byte into the first data half, then reading it through the other mapping.
        unsafe { *a.data(1, 1) = 9 };
        // SAFETY: as above.
        assert_eq!(unsafe { *b.data(1, 1) }, 9);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sweep_removes_files_of_dead_processes_only() {
        let dir = std::env::temp_dir().join(format!("qsr-shm-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let ns = pid_ns();
        let stale = format!("{PREFIX}{ns}-{dead}-00");
        let live = format!("{PREFIX}{ns}-{}-00", std::process::id());
        let elsewhere = format!("{PREFIX}{}-{dead}-00", ns + 1);
        for f in [&stale, &live, &elsewhere, &"unrelated".to_string()] {
            qsr_files::write_atomic(&dir.join(f), b"x", "test file").unwrap();
        }
        assert_eq!(sweep(&dir), vec![stale.clone()]);
        assert!(dir.join(&live).exists() && dir.join(&elsewhere).exists() && dir.join("unrelated").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
