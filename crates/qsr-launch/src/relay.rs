//! `qsr launch`'s rank output: each line a rank writes to stdout or stderr goes to the launcher's
//! stdout or stderr prefixed `[rank R] `, and with `--log-dir` also, as written, to
//! `rank-R.stdout.log` / `rank-R.stderr.log` there (torchrun's `--tee` with `--log-dir`).

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// Longest line copied whole; a longer one is copied in pieces of this size, each prefixed.
const MAX_LINE: usize = 1 << 20;

/// Copies the ranks' output (see the module docs).
pub(crate) struct Relay {
    log_dir: Option<PathBuf>,
    /// Copiers still running.
    live: Arc<AtomicUsize>,
}

#[derive(Clone, Copy)]
enum Stream {
    Out,
    Err,
}

impl Relay {
    /// A relay that also writes per-rank log files under `log_dir` (created if missing).
    pub(crate) fn new(log_dir: Option<&Path>) -> Result<Relay> {
        if let Some(dir) = log_dir {
            if std::fs::metadata(dir).is_ok_and(|m| !m.is_dir()) {
                anyhow::bail!("--log-dir {}: not a directory (it names a file)", dir.display());
            }
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create --log-dir {}", dir.display()))?;
        }
        Ok(Relay { log_dir: log_dir.map(Path::to_path_buf), live: Arc::new(AtomicUsize::new(0)) })
    }

    /// Pipes `c`'s stdout and stderr, for [`Relay::attach`].
    pub(crate) fn prepare(&self, c: &mut Command) {
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
    }

    /// Starts copying rank `rank`'s output (its pipes taken from `child`).
    pub(crate) fn attach(&self, rank: usize, child: &mut Child) -> Result<()> {
        let out = child.stdout.take().map(|p| (Box::new(p) as Box<dyn Read + Send>, Stream::Out));
        let err = child.stderr.take().map(|p| (Box::new(p) as Box<dyn Read + Send>, Stream::Err));
        for (pipe, stream) in out.into_iter().chain(err) {
            let log = self.log_file(rank, stream)?;
            let live = Arc::clone(&self.live);
            live.fetch_add(1, Ordering::SeqCst);
            std::thread::Builder::new()
                .name(format!("qsr-relay-{rank}"))
                .spawn(move || {
                    copy_lines(pipe, rank, stream, log);
                    live.fetch_sub(1, Ordering::SeqCst);
                })
                .context("cannot start a thread for a rank's output")?;
        }
        Ok(())
    }

    fn log_file(&self, rank: usize, stream: Stream) -> Result<Option<File>> {
        let Some(dir) = &self.log_dir else {
            return Ok(None);
        };
        let name = match stream {
            Stream::Out => format!("rank-{rank}.stdout.log"),
            Stream::Err => format!("rank-{rank}.stderr.log"),
        };
        new_log(dir, &name).map(Some)
    }

    /// Waits until every rank's output is copied (their pipes closed), at most `limit`: a process
    /// a rank left behind may hold a pipe open.
    pub(crate) fn drain(&self, limit: Duration) {
        let start = Instant::now();
        while self.live.load(Ordering::SeqCst) > 0 && start.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A new, empty `dir/name` for writing: created under a name of this process's own, then renamed into
/// place, so that a link or a FIFO already at `dir/name` is replaced, never followed (its target
/// overwritten) nor opened (a FIFO blocks until someone reads it): issue 56, D5.
fn new_log(dir: &Path, name: &str) -> Result<File> {
    Ok(qsr_files::create_replacing(&dir.join(name), "rank log")?)
}

/// Copies `pipe` line by line to this process's `stream`, prefixed, and to `log` as it came.
fn copy_lines(pipe: Box<dyn Read + Send>, rank: usize, stream: Stream, mut log: Option<File>) {
    let mut reader = BufReader::new(pipe);
    let mut line = Vec::new();
    let prefix = format!("[rank {rank}] ");
    loop {
        line.clear();
        match (&mut reader).take(MAX_LINE as u64).read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if let Some(f) = &mut log
            && f.write_all(&line).is_err()
        {
            log = None;
        }
        let mut shown = prefix.clone().into_bytes();
        shown.extend_from_slice(&line);
        if !shown.ends_with(b"\n") {
            shown.push(b'\n');
        }
        // A closed terminal or a full disk must not stop the rank: its pipe is still drained.
        let _ = match stream {
            Stream::Out => std::io::stdout().lock().write_all(&shown),
            Stream::Err => std::io::stderr().lock().write_all(&shown),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// D5: a rank's log that is a link is replaced, its target left as it was; one that is a FIFO is
    /// replaced without being opened (which would block); a directory there is an error naming it.
    #[test]
    fn a_log_file_that_is_a_link_or_a_fifo_is_replaced_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("precious.txt");
        std::fs::write(&target, "keep me").unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join("rank-0.stdout.log")).unwrap();
        let mut log = new_log(dir.path(), "rank-0.stdout.log").unwrap();
        log.write_all(b"line\n").unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me");
        let written = dir.path().join("rank-0.stdout.log");
        assert!(std::fs::symlink_metadata(&written).unwrap().is_file());
        assert_eq!(std::fs::read_to_string(&written).unwrap(), "line\n");
        let fifo = dir.path().join("rank-0.stderr.log");
        assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        new_log(dir.path(), "rank-0.stderr.log").unwrap();
        assert!(std::fs::symlink_metadata(&fifo).unwrap().is_file());
        std::fs::create_dir(dir.path().join("rank-1.stdout.log")).unwrap();
        let err = format!("{:#}", new_log(dir.path(), "rank-1.stdout.log").unwrap_err());
        assert!(err.contains("rank-1.stdout.log"), "{err}");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(names.iter().all(|n| !n.to_string_lossy().starts_with('.')), "no temporary left: {names:?}");
    }

    /// D12: `--log-dir` naming a file says so, instead of "File exists".
    #[test]
    fn a_log_dir_that_is_a_file_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("logs");
        std::fs::write(&file, "").unwrap();
        let err = format!("{:#}", Relay::new(Some(&file)).err().unwrap());
        assert!(err.contains("not a directory") && err.contains("logs"), "{err}");
    }
}
