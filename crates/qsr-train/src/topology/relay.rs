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
pub(super) struct Relay {
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
    pub(super) fn new(log_dir: Option<&Path>) -> Result<Relay> {
        if let Some(dir) = log_dir {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create --log-dir {}", dir.display()))?;
        }
        Ok(Relay { log_dir: log_dir.map(Path::to_path_buf), live: Arc::new(AtomicUsize::new(0)) })
    }

    /// Pipes `c`'s stdout and stderr, for [`Relay::attach`].
    pub(super) fn prepare(&self, c: &mut Command) {
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
    }

    /// Starts copying rank `rank`'s output (its pipes taken from `child`).
    pub(super) fn attach(&self, rank: usize, child: &mut Child) -> Result<()> {
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
        let path = dir.join(name);
        File::create(&path).map(Some).with_context(|| format!("cannot create {}", path.display()))
    }

    /// Waits until every rank's output is copied (their pipes closed), at most `limit`: a process
    /// a rank left behind may hold a pipe open.
    pub(super) fn drain(&self, limit: Duration) {
        let start = Instant::now();
        while self.live.load(Ordering::SeqCst) > 0 && start.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
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
