//! How a rank's process ends: the exit status that tells a launcher whether this rank failed for a
//! reason of its own or only because another rank failed.

use std::error::Error;
use std::process::ExitCode;

use crate::{CommError, WorkerError};

/// The exit status with which a rank says it stopped only because another rank failed (a peer died,
/// stalled or aborted): launchers (`qsr launch`, `qsr train --nproc`) then name the rank that failed
/// first instead of this one. qsr's trainer exits with it, and so does a program whose `main` ends
/// with [`exit_code`].
pub const EXIT_PEER_FAILED: u8 = 3;

/// The exit status for a rank that ends with `error`: [`EXIT_PEER_FAILED`] when a [`CommError`] in
/// its chain of sources says another rank failed first ([`CommError::peer_failed`]), else 1.
///
/// ```
/// use qsr_comm::{CommError, EXIT_PEER_FAILED, exit_status};
/// let lost = CommError::PeerLost { rank: 1, addr: "10.0.0.2:29500".into(), during: "all_reduce".into(), detail: "reset".into() };
/// assert_eq!(exit_status(&lost), EXIT_PEER_FAILED);
/// assert_eq!(exit_status(&CommError::InvalidArgument("root 9".into())), 1);
/// ```
pub fn exit_status(error: &(dyn Error + 'static)) -> u8 {
    if links(error).any(|e| e.downcast_ref::<CommError>().is_some_and(CommError::peer_failed)) {
        EXIT_PEER_FAILED
    } else {
        1
    }
}

/// `error` and its causes, a [`WorkerError`]'s (which prints its worker's causes on its one line)
/// through its worker's error.
fn links<'a>(error: &'a (dyn Error + 'static)) -> impl Iterator<Item = &'a (dyn Error + 'static)> {
    std::iter::successors(Some(error), |&e| match e.downcast_ref::<WorkerError>() {
        Some(w) => Some(AsRef::<dyn Error + Send + Sync>::as_ref(w.error())),
        None => e.source(),
    })
}

/// The environment variable in which a launcher (`qsr launch`, `qsr train --nproc`) names the file
/// where the rank it starts leaves its [`FailureRecord`].
pub const FAILURE_FILE: &str = "QSR_FAILURE_FILE";

/// What a failed rank leaves its launcher ([`record_failure`]): the rank its error blames, so that a
/// launcher whose ranks only lost a peer can name the peer, on its own node or another.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FailureRecord {
    /// The rank a [`CommError`] in the error's chain blames ([`CommError::blamed_rank`]).
    pub blames: Option<usize>,
    /// Whether the rank stopped only because another failed ([`exit_status`] is [`EXIT_PEER_FAILED`]).
    pub peer_failed: bool,
    /// The error and its chain of sources, as the rank printed it.
    pub message: String,
}

impl FailureRecord {
    /// The record of a rank that ends with `error`.
    pub fn of(error: &(dyn Error + 'static)) -> Self {
        let blames = links(error).find_map(|e| e.downcast_ref::<CommError>().and_then(CommError::blamed_rank));
        let peer_failed = exit_status(error) == EXIT_PEER_FAILED;
        FailureRecord { blames, peer_failed, message: chain(error) }
    }
}

/// Leaves `error`'s [`FailureRecord`] where the launcher asked ([`FAILURE_FILE`]), if it did; a rank
/// that cannot write it says so and goes on failing as it was.
pub fn record_failure(error: &(dyn Error + 'static)) {
    let Some(path) = std::env::var_os(FAILURE_FILE) else {
        return;
    };
    let record = serde_json::to_vec(&FailureRecord::of(error)).unwrap_or_default();
    if let Err(e) = qsr_files::write_atomic(std::path::Path::new(&path), &record, "failure record") {
        eprintln!("{e}");
    }
}

/// `error` and its chain of sources, joined by `: `.
fn chain(error: &(dyn Error + 'static)) -> String {
    let mut message = error.to_string();
    let mut next = error.source();
    while let Some(cause) = next {
        message += &format!(": {cause}");
        next = cause.source();
    }
    message
}

/// What a rank's `main` returns: success, or `Error: ` and the error's chain of sources on stderr with
/// the status of [`exit_status`], so that `qsr launch` (and `qsr train --nproc`) blame the rank that
/// failed first and count the others as stopped. Takes `anyhow::Result<()>` and
/// `Result<(), Box<dyn Error + Send + Sync>>`.
///
/// ```no_run
/// fn run() -> anyhow::Result<()> {
///     let results = qsr_comm::run_workers(4, |comm| -> anyhow::Result<()> { Ok(()) })?;
///     results.into_iter().collect()
/// }
///
/// fn main() -> std::process::ExitCode {
///     qsr_comm::exit_code(run())
/// }
/// ```
pub fn exit_code<E: AsRef<dyn Error + Send + Sync + 'static>>(result: Result<(), E>) -> ExitCode {
    let Err(e) = result else {
        return ExitCode::SUCCESS;
    };
    let e: &(dyn Error + 'static) = e.as_ref();
    eprintln!("Error: {}", chain(e));
    record_failure(e);
    ExitCode::from(exit_status(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peers_failure_under_anyhow_context_exits_with_exit_peer_failed() {
        let aborted = CommError::Aborted { culprit: 1, reason: "r".into(), reporter: 2, during: "d".into() };
        let e = anyhow::Error::from(aborted).context("synchronization at step 3 failed");
        assert_eq!(exit_status(AsRef::<dyn Error + Send + Sync>::as_ref(&e)), EXIT_PEER_FAILED);
        assert_eq!(exit_code(Err::<(), _>(e)), ExitCode::from(EXIT_PEER_FAILED));
        // Diverging calls are every rank's cause, not a lost peer: the ranks told of them exit 1 too.
        let told = CommError::Aborted {
            culprit: 1,
            reason: crate::shm::Cause::CallsDiffer.text().into(),
            reporter: 2,
            during: "d".into(),
        };
        assert_eq!(exit_status(&told), 1);
        let own = anyhow::anyhow!("the model did not learn");
        assert_eq!(exit_code(Err::<(), _>(own)), ExitCode::from(1));
        assert_eq!(exit_code(Ok::<(), anyhow::Error>(())), ExitCode::SUCCESS);
    }
}
