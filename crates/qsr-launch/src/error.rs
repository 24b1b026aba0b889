//! The launcher's errors: what a launch refused, how it was interrupted, which rank failed first,
//! and the exit status each gives.

/// An error of the input a run was given (exit status 2): its message is the wrapped
/// error's, whole.
#[derive(Debug)]
pub struct BadInput(anyhow::Error);

impl std::fmt::Display for BadInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.0)
    }
}

impl std::error::Error for BadInput {}

/// Marks `e` as bad input: the launcher exits with status 2.
pub fn bad_input(e: impl Into<anyhow::Error>) -> anyhow::Error {
    let e = e.into();
    if e.chain().any(|c| c.is::<BadInput>()) { e } else { anyhow::Error::new(BadInput(e)) }
}

/// The `--nproc` launcher stopped its workers because it received a signal.
#[derive(Debug, thiserror::Error)]
#[error(
    "interrupted by signal {signal} ({name}): stopped {stopped} running workers{}",
    if *.resumable { "; continue with --resume" } else { "" }
)]
pub struct Interrupted {
    /// The signal's number.
    pub signal: i32,
    /// Its name.
    pub name: &'static str,
    /// Workers that were still running.
    pub stopped: usize,
    /// Whether they were qsr's training workers, whose run continues with `--resume` (not the
    /// ranks of `qsr launch`'s program).
    pub resumable: bool,
}

/// The name of signal `s`, for messages.
pub fn signal_name(s: i32) -> &'static str {
    use signal_hook::consts::*;
    match s {
        SIGKILL => "SIGKILL",
        SIGTERM => "SIGTERM",
        SIGINT => "SIGINT",
        SIGHUP => "SIGHUP",
        SIGABRT => "SIGABRT",
        SIGSEGV => "SIGSEGV",
        SIGBUS => "SIGBUS",
        SIGILL => "SIGILL",
        SIGFPE => "SIGFPE",
        _ => "another signal",
    }
}

/// Workers of a `--nproc` launch failed: the launcher exits with the status of the one that failed
/// first ([`qsr_comm::EXIT_PEER_FAILED`] when it was killed or stopped).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct WorkersFailed {
    /// The exit status the launcher takes.
    pub status: u8,
    /// Which rank failed first, and how.
    pub message: String,
}

/// The exit status a launcher takes for `e`: 128 + N when interrupted by signal N, the status of
/// the rank that failed first, 2 for bad input, else 1.
pub fn exit_status(e: &anyhow::Error) -> u8 {
    if let Some(i) = e.chain().find_map(|c| c.downcast_ref::<Interrupted>()) {
        return (128 + i.signal).clamp(129, 255) as u8;
    }
    if let Some(w) = e.chain().find_map(|c| c.downcast_ref::<WorkersFailed>()) {
        return w.status;
    }
    if e.chain().any(|c| c.is::<BadInput>()) { 2 } else { 1 }
}
