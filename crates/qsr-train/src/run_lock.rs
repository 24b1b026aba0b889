//! The run directory's lock (documented on [`RunLock`]).

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};

/// Name of the lock file inside a run directory.
pub const LOCK_FILE: &str = "lock";

/// An exclusive lock on a run directory, released on drop (or when the process dies).
///
/// The run directory's lock: one run at a time writes a run directory.
///
/// Two runs with the same `--out` would interleave their checkpoints (one run's model under the other's
/// optimizer state and cursor, under a valid manifest). The process that owns a run (`--workers`, the
/// `--nproc` launcher, or rank 0 of an external launch) holds an advisory lock on `RUN_DIR/lock` for the
/// run's life. The kernel releases it when the process dies, so a lock left by a dead process is stale
/// by construction: the next run takes it and rewrites the holder line.
#[derive(Debug)]
pub struct RunLock {
    _file: File,
    path: PathBuf,
}

impl RunLock {
    /// Creates `run_dir` if needed and locks it; refuses, naming the holder, when another live process
    /// holds the lock.
    pub fn acquire(run_dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(run_dir)
            .with_context(|| format!("cannot create run directory {}", run_dir.display()))?;
        let path = run_dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("cannot open the run lock {}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                let holder = if holder.is_empty() { "another process (no holder recorded yet)" } else { holder };
                bail!(
                    "run directory {} is in use by {holder}; wait for that run to end, or choose another --out",
                    run_dir.display()
                );
            }
            Err(TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("cannot lock {}", path.display()));
            }
        }
        // We hold the lock: whatever the file says is a previous (dead) holder's line.
        file.set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)))
            .with_context(|| format!("cannot write {}", path.display()))?;
        writeln!(file, "{}", holder_line()).with_context(|| format!("cannot write {}", path.display()))?;
        file.sync_all().with_context(|| format!("cannot sync {}", path.display()))?;
        Ok(Self { _file: file, path })
    }

    /// The lock file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// "pid P on host H (`qsr train ...`, started at unix time T)".
fn holder_line() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map_or_else(|_| "this host".to_string(), |h| h.trim().to_string());
    let since = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let args: Vec<String> = std::env::args().skip(1).collect();
    format!("pid {} on host {host} (`qsr {}`, started at unix time {since})", std::process::id(), args.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_the_same_run_directory_is_refused_naming_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunLock::acquire(dir.path()).unwrap();
        let err = RunLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(err.contains("is in use by pid") && err.contains(&std::process::id().to_string()), "{err}");
        drop(first);
        // Released on drop: the next run takes it.
        RunLock::acquire(dir.path()).unwrap();
    }
}
