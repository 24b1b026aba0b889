//! The run directory's lock (documented on [`RunLock`]).

use std::fs::{File, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};

/// Name of the lock file inside a run directory.
pub(crate) const LOCK_FILE: &str = "lock";

/// An exclusive lock on a run directory, released on drop (or when the process dies).
///
/// The run directory's lock: one run at a time writes a run directory.
///
/// Two runs with the same `--out` would interleave their checkpoints (one run's model under the other's
/// optimizer state and cursor, under a valid manifest). The process that owns a run (`--workers`, the
/// `--nproc` launcher, or rank 0 of an external launch) holds an advisory lock on `RUN_DIR/lock` for the
/// run's life. The kernel releases it when the process dies, so a lock left by a dead process is stale
/// by construction: the next run takes it and rewrites the holder line.
///
/// The workers of an elastic job started by hand (`--elastic --rendezvous`) have no one owner (rank 0
/// changes with the membership): each holds a shared lock for its job ([`RunLock::share`]), whose
/// line names the job, so a second job or any other run is refused while one of them lives.
#[derive(Debug)]
pub(crate) struct RunLock {
    _file: File,
}

impl RunLock {
    /// Creates `run_dir` if needed and locks it; refuses, naming the holder, when another live process
    /// holds the lock.
    pub(crate) fn acquire(run_dir: &Path) -> Result<Self> {
        let (mut file, path) = open(run_dir)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => return Err(in_use(run_dir, &mut file)),
            Err(TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("cannot lock {}", path.display()));
            }
        }
        // We hold the lock: whatever the file says is a previous (dead) holder's line.
        write_holder(&mut file, &path, &holder_line())?;
        Ok(Self { _file: file })
    }

    /// A worker's share of elastic job `job`'s lock (its store at `store`, as this worker reaches it):
    /// a worker that finds the lock free writes the job's line under the exclusive lock, then every
    /// worker holds a shared lock and checks that the line names its job, by id (workers may spell
    /// the store's address differently). Refuses, naming the holder, while another job or run holds
    /// the directory.
    pub(crate) fn share(run_dir: &Path, job: &str, store: &str) -> Result<Self> {
        let (mut file, path) = open(run_dir)?;
        let ours = format!("elastic job {job} ");
        let mine = format!("{ours}(store {store})");
        // A sibling writing the job's line holds the lock alone for a moment: retry for a second.
        for _ in 0..50 {
            if file.try_lock().is_ok() {
                write_holder(&mut file, &path, &format!("{mine}, first worker {}", holder_line()))?;
                file.unlock().with_context(|| format!("cannot unlock {}", path.display()))?;
            }
            match file.try_lock_shared() {
                Ok(()) if read_holder(&mut file).starts_with(&ours) => return Ok(Self { _file: file }),
                // Another job's line: it holds the directory, unless it died meanwhile (then the
                // exclusive lock above succeeds on the next try).
                Ok(()) => file.unlock().with_context(|| format!("cannot unlock {}", path.display()))?,
                Err(TryLockError::WouldBlock) => {}
                Err(TryLockError::Error(e)) => {
                    return Err(e).with_context(|| format!("cannot lock {}", path.display()));
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Err(in_use(run_dir, &mut file))
    }
}

/// Creates `run_dir` if needed and opens its lock file.
fn open(run_dir: &Path) -> Result<(File, PathBuf)> {
    std::fs::create_dir_all(run_dir).with_context(|| format!("cannot create run directory {}", run_dir.display()))?;
    let path = run_dir.join(LOCK_FILE);
    let file = qsr_files::open_lock(&path, "run lock")?;
    Ok((file, path))
}

/// The holder line, as far as it can be read.
fn read_holder(file: &mut File) -> String {
    let mut holder = String::new();
    let _ = file.seek(SeekFrom::Start(0)).and_then(|_| file.take(4096).read_to_string(&mut holder));
    holder.trim().to_string()
}

/// Replaces the holder line (under the exclusive lock).
fn write_holder(file: &mut File, path: &Path, line: &str) -> Result<()> {
    file.set_len(0)
        .and_then(|()| file.seek(SeekFrom::Start(0)))
        .and_then(|_| writeln!(file, "{line}"))
        .and_then(|()| file.sync_all())
        .with_context(|| format!("cannot write {}", path.display()))
}

/// The refusal of a directory another process holds, naming it.
fn in_use(run_dir: &Path, file: &mut File) -> anyhow::Error {
    let holder = read_holder(file);
    let holder = if holder.is_empty() { "another process (no holder recorded yet)" } else { holder.as_str() };
    anyhow::anyhow!(
        "run directory {} is in use by {holder}; wait for that run to end, or choose another --out",
        run_dir.display()
    )
}

/// "pid P on host H (`qsr train ...`, started at unix time T)".
fn holder_line() -> String {
    let host = qsr_files::read_text(Path::new("/proc/sys/kernel/hostname"), 4096, "host name")
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

    #[test]
    fn workers_of_one_elastic_job_share_the_lock_and_other_runs_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let a1 = RunLock::share(dir.path(), "job-a", "h:1").unwrap();
        // Another spelling of the same store's address: the same job.
        let a2 = RunLock::share(dir.path(), "job-a", "localhost:1").unwrap();
        let other = RunLock::share(dir.path(), "job-b", "h:2").unwrap_err().to_string();
        assert!(other.contains("in use by elastic job job-a (store h:1)"), "{other}");
        let run = RunLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(run.contains("elastic job job-a"), "{run}");
        drop((a1, a2));
        // The job ended: its stale line does not keep the next job out.
        let _b = RunLock::share(dir.path(), "job-b", "h:2").unwrap();
        let exclusive = RunLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(exclusive.contains("job-b"), "{exclusive}");
    }

    #[test]
    fn an_elastic_job_is_refused_a_directory_a_run_holds() {
        let dir = tempfile::tempdir().unwrap();
        let _run = RunLock::acquire(dir.path()).unwrap();
        let err = RunLock::share(dir.path(), "job-a", "h:1").unwrap_err().to_string();
        assert!(err.contains("in use by pid"), "{err}");
    }
}
