//! The one door through which qsr opens a path. Every crate of the workspace reads and writes files
//! here, and the workspace's `clippy.toml` bans the standard library's path-opening calls elsewhere.
//!
//! - **Reads** ([`read`], [`read_text`], [`open`]) take regular files only, links followed: a FIFO would
//!   block the read and a device such as `/dev/zero` never end it. Each kind of file has a bound, and a
//!   file past it is refused before it is read (a sparse 3 GB file costs nothing).
//! - **Writes** ([`write_atomic`], [`NewFile`]) go to a new file beside the target, which is renamed over
//!   it once whole: a link at the target is replaced, never followed, a FIFO is never opened, and a
//!   reader sees the old file or the new one, never half of one.
//! - **Appends** ([`append`]) and files opened in place ([`open_lock`], [`open_rw`], [`create_private`])
//!   refuse a link and anything but a regular file, without blocking on a FIFO; a new log
//!   ([`create_replacing`]) replaces what was there.
//!
//! Every error names the file and what it is for (`what`: "recipe", "checkpoint manifest").
//!
//! ```
//! let dir = tempfile::tempdir().unwrap();
//! let path = dir.path().join("summary.json");
//! qsr_files::write_atomic(&path, b"{}", "summary").unwrap();
//! assert_eq!(qsr_files::read(&path, 16, "summary").unwrap(), b"{}");
//! let e = qsr_files::read(std::path::Path::new("/dev/zero"), 16, "recipe").unwrap_err();
//! assert!(e.to_string().contains("recipe /dev/zero is not a regular file (it is a device)"));
//! ```

#![forbid(unsafe_code)]
// The door itself: the only code of the workspace allowed to open paths.
#![allow(clippy::disallowed_methods)]

use std::fs::{File, FileType, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a file could not be read or written, naming it and what it is for.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The system refused the operation.
    #[error("cannot {action} {what} {}: {source}", .path.display())]
    Io {
        /// What the file is for, e.g. `recipe`.
        what: String,
        /// The file.
        path: PathBuf,
        /// What was being done: `read`, `write`, `create`, `open`.
        action: &'static str,
        /// The system's error.
        #[source]
        source: io::Error,
    },
    /// The path is a directory, FIFO, device or socket.
    #[error("{what} {} is not a regular file (it is a {kind}): qsr reads and writes only regular files", .path.display())]
    NotRegular {
        /// What the file is for.
        what: String,
        /// The path.
        path: PathBuf,
        /// What it is instead, from [`file_kind`].
        kind: &'static str,
    },
    /// A link where qsr writes in place.
    #[error("{what} {} is a symbolic link: qsr does not write through links", .path.display())]
    Link {
        /// What the file is for.
        what: String,
        /// The link.
        path: PathBuf,
    },
    /// The file is larger than any file of its kind can be.
    #[error("{what} {} is larger than {limit} bytes, more than a {what} can be", .path.display())]
    TooLarge {
        /// What the file is for.
        what: String,
        /// The file.
        path: PathBuf,
        /// The bound of its kind.
        limit: u64,
    },
    /// A text file that is not UTF-8.
    #[error("{what} {} is not UTF-8", .path.display())]
    NotUtf8 {
        /// What the file is for.
        what: String,
        /// The file.
        path: PathBuf,
    },
}

impl FileError {
    /// The file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            FileError::Io { path, .. }
            | FileError::NotRegular { path, .. }
            | FileError::Link { path, .. }
            | FileError::TooLarge { path, .. }
            | FileError::NotUtf8 { path, .. } => path,
        }
    }

    fn io(what: &str, path: &Path, action: &'static str, source: io::Error) -> Self {
        FileError::Io { what: what.into(), path: path.into(), action, source }
    }
}

impl From<FileError> for io::Error {
    fn from(e: FileError) -> Self {
        let kind = match &e {
            FileError::Io { source, .. } => source.kind(),
            FileError::NotRegular { .. } | FileError::Link { .. } => io::ErrorKind::InvalidInput,
            FileError::TooLarge { .. } | FileError::NotUtf8 { .. } => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, e)
    }
}

/// What a file system entry is, in words for an error: `file`, `directory`, `symbolic link`, `FIFO`,
/// `device`, `socket`.
pub fn file_kind(t: FileType) -> &'static str {
    match () {
        _ if t.is_file() => "file",
        _ if t.is_dir() => "directory",
        _ if t.is_symlink() => "symbolic link",
        _ if t.is_fifo() => "FIFO",
        _ if t.is_char_device() || t.is_block_device() => "device",
        _ if t.is_socket() => "socket",
        _ => "special file",
    }
}

/// Opens `path` for reading if it is a regular file (links followed), without blocking on a FIFO.
/// Returns the file and its length.
pub fn open(path: &Path, what: &str) -> Result<(File, u64), FileError> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| refused(path, what, "read", e))?;
    let len = regular(&file, path, what)?;
    Ok((file, len))
}

/// Reads `path` whole if it is a regular file of at most `limit` bytes.
pub fn read(path: &Path, limit: u64, what: &str) -> Result<Vec<u8>, FileError> {
    let (file, len) = open(path, what)?;
    let too_large = || FileError::TooLarge { what: what.into(), path: path.into(), limit };
    if len > limit {
        return Err(too_large());
    }
    // The length is a hint (a file may grow, /proc reports 0): the bound is what holds.
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(limit + 1).read_to_end(&mut bytes).map_err(|e| FileError::io(what, path, "read", e))?;
    if bytes.len() as u64 > limit {
        return Err(too_large());
    }
    Ok(bytes)
}

/// [`read`] as UTF-8 text.
pub fn read_text(path: &Path, limit: u64, what: &str) -> Result<String, FileError> {
    String::from_utf8(read(path, limit, what)?).map_err(|_| FileError::NotUtf8 { what: what.into(), path: path.into() })
}

/// Writes `bytes` as the whole of `path`: to a new file beside it, synced, then renamed over it.
pub fn write_atomic(path: &Path, bytes: &[u8], what: &str) -> Result<(), FileError> {
    let mut file = NewFile::create(path, what)?;
    file.write_all(bytes).map_err(|e| FileError::io(what, path, "write", e))?;
    file.commit()
}

/// A file being written in full beside its target, which [`commit`](Self::commit) renames over the
/// target; dropped uncommitted, it is removed and the target is left as it was.
#[derive(Debug)]
pub struct NewFile {
    file: File,
    tmp: PathBuf,
    path: PathBuf,
    what: String,
    committed: bool,
}

impl NewFile {
    /// Starts writing `path`. A directory at `path` is refused at once.
    pub fn create(path: &Path, what: &str) -> Result<Self, FileError> {
        let (file, tmp) = new_beside(path, what)?;
        Ok(Self { file, tmp, path: path.into(), what: what.into(), committed: false })
    }

    /// Syncs the file and renames it over its target.
    pub fn commit(mut self) -> Result<(), FileError> {
        self.file.sync_all().map_err(|e| FileError::io(&self.what, &self.tmp, "write", e))?;
        std::fs::rename(&self.tmp, &self.path).map_err(|e| FileError::io(&self.what, &self.path, "write", e))?;
        self.committed = true;
        Ok(())
    }
}

impl Write for NewFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl Drop for NewFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Opens `path` for appending, created if missing: a link or anything but a regular file is refused,
/// a FIFO without blocking.
pub fn append(path: &Path, what: &str) -> Result<File, FileError> {
    let mut options = OpenOptions::new();
    options.append(true).create(true);
    in_place(&options, path, what)
}

/// Opens `path` for reading and writing in place, created if missing, never truncated (a lock file
/// and the holder it names), refusing links and anything but a regular file.
pub fn open_lock(path: &Path, what: &str) -> Result<File, FileError> {
    let mut options = OpenOptions::new();
    options.read(true).write(true).create(true).truncate(false);
    in_place(&options, path, what)
}

/// A new, empty `path` for writing as it goes (a log): created beside it, then renamed into place
/// at once, so that a link or a FIFO already at `path` is replaced, never followed nor opened.
pub fn create_replacing(path: &Path, what: &str) -> Result<File, FileError> {
    let (file, tmp) = new_beside(path, what)?;
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(FileError::io(what, path, "create", e));
    }
    Ok(file)
}

/// Opens an existing regular file for reading and writing in place (a shared-memory segment), refusing
/// links and anything else.
pub fn open_rw(path: &Path, what: &str) -> Result<File, FileError> {
    let mut options = OpenOptions::new();
    options.read(true).write(true);
    in_place(&options, path, what)
}

/// Creates `path` for reading and writing, readable and writable by its owner only (mode 0600): a
/// shared-memory segment. Anything already there, a link included, is an error
/// (`io::ErrorKind::AlreadyExists` in [`FileError::Io`]).
pub fn create_private(path: &Path, what: &str) -> Result<File, FileError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| FileError::io(what, path, "create", e))
}

/// Syncs the directory `dir`, so that the renames and creations in it survive a crash.
pub fn sync_dir(dir: &Path) -> Result<(), FileError> {
    let d = File::open(dir).map_err(|e| FileError::io("directory", dir, "open", e))?;
    d.sync_all().map_err(|e| FileError::io("directory", dir, "sync", e))
}

/// Opens `path` with `options` plus no-follow and non-blocking, then checks it is a regular file.
fn in_place(options: &OpenOptions, path: &Path, what: &str) -> Result<File, FileError> {
    let mut options = options.clone();
    let file = options
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| refused(path, what, "open", e))?;
    regular(&file, path, what)?;
    Ok(file)
}

/// The length of the opened `file` if it is a regular file.
fn regular(file: &File, path: &Path, what: &str) -> Result<u64, FileError> {
    let meta = file.metadata().map_err(|e| FileError::io(what, path, "read", e))?;
    if !meta.is_file() {
        return Err(FileError::NotRegular { what: what.into(), path: path.into(), kind: file_kind(meta.file_type()) });
    }
    Ok(meta.len())
}

/// The error of an open that failed: a link refused by no-follow, or a FIFO or socket that cannot be
/// opened without a peer, named as such; otherwise the system's error.
fn refused(path: &Path, what: &str, action: &'static str, e: io::Error) -> FileError {
    match (e.raw_os_error(), path.symlink_metadata()) {
        (Some(libc::ELOOP), Ok(m)) if m.file_type().is_symlink() => {
            FileError::Link { what: what.into(), path: path.into() }
        }
        (_, Ok(m)) if !m.is_file() && !m.file_type().is_symlink() => {
            FileError::NotRegular { what: what.into(), path: path.into(), kind: file_kind(m.file_type()) }
        }
        _ => FileError::io(what, path, action, e),
    }
}

/// A new file beside `path`, to be renamed over it, and its name; a directory at `path` is refused.
fn new_beside(path: &Path, what: &str) -> Result<(File, PathBuf), FileError> {
    if let Ok(meta) = path.symlink_metadata()
        && meta.is_dir()
    {
        return Err(FileError::NotRegular { what: what.into(), path: path.into(), kind: "directory" });
    }
    let tmp = beside(path);
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| FileError::io(what, &tmp, "create", e))?;
    Ok((file, tmp))
}

/// A name for a new file beside `path`, unique to this process and call.
fn beside(path: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.{}.{n}.tmp", std::process::id()))
}

#[cfg(test)]
mod tests;
