//! Running a worker that returns a `Result` on every rank, and the one error the ranks give back.

use std::error::Error;
use std::fmt;

use crate::{Collective, EXIT_PEER_FAILED, exit_status, record_failure, run_workers};

/// The error of [`try_run_workers`]: one rank's, printed on one line (a `main` that returns it shows
/// `Error: rank 2 of 4: ...`, not a block per cause). The worker's own error, with its chain of
/// causes, is [`WorkerError::error`].
pub struct WorkerError {
    /// The rank and the world size, when the ranks were threads of this process.
    rank: Option<(usize, usize)>,
    /// Whether the rank stopped only because another failed ([`exit_status`]).
    lost_peer: bool,
    error: anyhow::Error,
}

impl WorkerError {
    /// The rank whose error it is, when the ranks were threads (a launched process is one rank,
    /// which its launcher names).
    pub fn rank(&self) -> Option<usize> {
        self.rank.map(|(rank, _)| rank)
    }

    /// Whether the rank stopped only because another rank failed: every rank did, none for a reason
    /// of its own in this process (a launched rank that lost a peer, say).
    pub fn lost_peer(&self) -> bool {
        self.lost_peer
    }

    /// The worker's own error, to downcast or to walk its causes.
    pub fn error(&self) -> &anyhow::Error {
        &self.error
    }
}

impl fmt::Display for WorkerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some((rank, k)) = self.rank {
            write!(f, "rank {rank} of {k}: ")?;
        }
        if self.lost_peer {
            f.write_str("stopped because another rank failed: ")?;
        }
        write!(f, "{:#}", self.error)
    }
}

impl fmt::Debug for WorkerError {
    // A `main` returning it prints this: the same one line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Error for WorkerError {}

/// [`run_workers`] for a worker that returns a `Result`: every rank's value in rank order, or one
/// error, the cause: that of the first rank that failed for a reason of its own rather than because
/// another failed ([`exit_status`]), named by its rank when the ranks are threads. A `main` that
/// ends with it reports the rank that failed, whichever it was, on one line. Under a launcher the
/// rank's [`FailureRecord`](crate::FailureRecord) is left for the launcher (`qsr launch`), which so
/// names the rank that failed first even when every rank's `main` exits with status 1; a rank that
/// only lost a peer says so in one line.
///
/// ```
/// let result = qsr_comm::try_run_workers(3, |mut comm| -> anyhow::Result<usize> {
///     anyhow::ensure!(comm.rank() != 2, "rank 2's data is missing");
///     comm.all_reduce(&mut [1.0], qsr_comm::ReduceOp::Sum)?; // ranks 0 and 1 lose rank 2 here
///     Ok(comm.rank())
/// });
/// let e = result.unwrap_err();
/// assert_eq!(e.to_string(), "rank 2 of 3: rank 2's data is missing");
/// assert_eq!((e.rank(), e.lost_peer()), (Some(2), false));
/// ```
pub fn try_run_workers<T: Send, E: Into<anyhow::Error> + Send>(
    threads: usize,
    worker: impl Fn(Box<dyn Collective>) -> Result<T, E> + Sync,
) -> Result<Vec<T>, WorkerError> {
    let results =
        run_workers(threads, worker).map_err(|e| WorkerError { rank: None, lost_peer: false, error: e.into() })?;
    let k = results.len();
    let (mut values, mut cause, mut consequence) = (Vec::with_capacity(k), None, None);
    for (rank, result) in results.into_iter().enumerate() {
        let error: anyhow::Error = match result {
            Ok(value) => {
                values.push(value);
                continue;
            }
            Err(e) => e.into(),
        };
        let lost_peer = exit_status(AsRef::<dyn Error + Send + Sync>::as_ref(&error)) == EXIT_PEER_FAILED;
        let slot = if lost_peer { &mut consequence } else { &mut cause };
        slot.get_or_insert(WorkerError { rank: (k > 1).then_some((rank, k)), lost_peer, error });
    }
    let Some(error) = cause.or(consequence) else {
        return Ok(values);
    };
    // A launched rank's `main` may exit 1 whatever the cause: its record tells the launcher.
    record_failure(&error);
    Err(error)
}
