//! The exit status of `qsr` (documented on [`Exit`]), and the error types that choose it.

use qsr_comm::CommError;
use qsr_elastic::ElasticError;

/// What a `qsr` process's exit status says; README.md and docs/RELIABILITY.md carry the same table.
///
/// | status | meaning |
/// |---|---|
/// | 0 | success: the run trained, evaluated, and did not diverge |
/// | 1 | a failure of this process while it ran (disk full, an unreadable file mid-run, a bug) |
/// | 2 | bad input, refused before training: command line, recipe, environment, data, checkpoint, a run directory in use |
/// | 3 | another rank failed (lost, stalled or aborted) and this one stopped because of it |
/// | 4 | training diverged (a loss not finite, or above the divergence limit twice): the run stopped, its last good checkpoint is kept |
/// | 5 | the elastic job's store failed (unreachable, stopped, closed) or expelled this worker |
/// | 6 | the run did not train: its final evaluation is no better than chance (a loss not below the loss of predicting every class alike, or a classifier's accuracy within 2 points of chance) |
/// | 128 + N | the `--nproc` launcher was interrupted by signal N (130 for SIGINT, 143 for SIGTERM) |
///
/// A `--nproc` launcher whose workers failed exits with the status of the one that failed first, or
/// 3 when that one was killed by a signal or stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exit {
    /// 0.
    Success = 0,
    /// 1.
    Failure = 1,
    /// 2.
    BadInput = 2,
    /// 3 ([`qsr_comm::EXIT_PEER_FAILED`]).
    PeerFailed = qsr_comm::EXIT_PEER_FAILED as isize,
    /// 4.
    Diverged = 4,
    /// 5.
    Store = 5,
    /// 6.
    NotTrained = 6,
}

pub(crate) use qsr_launch::{BadInput, Interrupted, WorkersFailed, bad_input, signal_name};

/// Training diverged ([`Exit::Diverged`]): an evaluation's loss was not finite or far above the
/// loss of a model that learned nothing, or the last training loss was not finite.
#[derive(Debug, thiserror::Error)]
#[error("training diverged{}: {why}", .step.map_or(String::new(), |s| format!(" at step {s}")))]
pub(crate) struct Diverged {
    /// Steps completed when it was seen (`None`: several runs, as `qsr compare` reports them).
    pub step: Option<u64>,
    /// What was seen, with the numbers.
    pub why: String,
}

/// The run finished but did not train ([`Exit::NotTrained`]): its final evaluation is no better than
/// a model that predicts every class alike.
#[derive(Debug, thiserror::Error)]
#[error("the run did not train: {why}")]
pub(crate) struct NotTrained {
    /// What the final evaluation saw, with the numbers and the settings to look at.
    pub why: String,
}

/// A rank could not write its part of a checkpoint because rank 0, failing, removed the unfinished
/// checkpoint meanwhile: a consequence of rank 0's failure (or of the rank that failed first), not a
/// cause of its own.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot write its part of the checkpoint of step {step}: rank 0 removed the unfinished checkpoint after a failure ({what})"
)]
pub(crate) struct CheckpointAbandoned {
    /// The checkpoint's step.
    pub step: u64,
    /// What the write reported.
    pub what: String,
}

/// Whether an error is the consequence of another rank's failure (lost, stalled, aborted, gone, or a
/// checkpoint abandoned by rank 0).
pub(crate) fn is_peer_failure(e: &anyhow::Error) -> bool {
    comm_errors(e).any(CommError::peer_failed) || e.chain().any(|c| c.is::<CheckpointAbandoned>())
}

/// The collective errors in `e`'s chain, those an elastic job's error wraps included.
pub(crate) fn comm_errors(e: &anyhow::Error) -> impl Iterator<Item = &CommError> {
    e.chain().filter_map(|c| {
        c.downcast_ref::<CommError>().or(match c.downcast_ref::<ElasticError>() {
            Some(ElasticError::Comm(inner)) => Some(inner),
            _ => None,
        })
    })
}

/// The elastic store's errors in `e`'s chain.
fn elastic_errors(e: &anyhow::Error) -> impl Iterator<Item = &ElasticError> {
    e.chain().filter_map(|c| c.downcast_ref::<ElasticError>())
}

/// The process exit status for an error (the table on [`Exit`]).
pub(crate) fn exit_code(e: &anyhow::Error) -> u8 {
    if let Some(i) = e.chain().find_map(|c| c.downcast_ref::<Interrupted>()) {
        return (128 + i.signal).clamp(129, 255) as u8;
    }
    if let Some(w) = e.chain().find_map(|c| c.downcast_ref::<WorkersFailed>()) {
        return w.status;
    }
    let status = if e.chain().any(|c| c.is::<Diverged>()) {
        Exit::Diverged
    } else if e.chain().any(|c| c.is::<NotTrained>()) {
        Exit::NotTrained
    } else if e.chain().any(|c| c.is::<BadInput>())
        || comm_errors(e).any(|c| {
            matches!(c, CommError::Launch { .. } | CommError::Disagree { .. } | CommError::HandshakeRefused { .. })
        })
        || elastic_errors(e).any(|c| matches!(c, ElasticError::Mismatch { .. }))
    {
        Exit::BadInput
    } else if is_peer_failure(e) {
        Exit::PeerFailed
    } else if elastic_errors(e).any(|c| matches!(c, ElasticError::Store { .. } | ElasticError::Expelled { .. })) {
        Exit::Store
    } else {
        Exit::Failure
    };
    status as u8
}

/// The error to report when several workers of one process failed: a failure of a worker's own
/// (data, disk, ...) before one that only saw another worker fail, and the blamed worker's own error
/// before the error of a worker blaming it.
pub(crate) fn root_cause(errors: Vec<(usize, anyhow::Error)>) -> Option<(usize, anyhow::Error)> {
    let blamed = |e: &anyhow::Error| comm_errors(e).find_map(qsr_comm::CommError::blamed_rank);
    let own = errors.iter().position(|(_, e)| !is_peer_failure(e));
    let via_blame =
        || errors.iter().find_map(|(_, e)| blamed(e)).and_then(|r| errors.iter().position(|(rank, _)| *rank == r));
    let pick = own.or_else(via_blame).unwrap_or(0);
    errors.into_iter().nth(pick)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CI (a full disk, 4 workers): rank 2's write failed with "No space left on device", rank 0 removed
    /// the unfinished checkpoint, and rank 1, still writing into it, failed with "No such file or
    /// directory", which was reported as the cause. A write into an abandoned checkpoint is a peer's
    /// failure; the full disk is the root cause.
    #[test]
    fn a_write_into_a_checkpoint_rank_0_abandoned_is_not_the_root_cause() {
        let abandoned = CheckpointAbandoned { step: 22, what: "No such file or directory".into() };
        let errors = vec![
            (1, anyhow::Error::new(abandoned).context("checkpoint at step 22")),
            (2, anyhow::anyhow!("No space left on device (os error 28)")),
        ];
        let (rank, e) = root_cause(errors).unwrap();
        assert_eq!(rank, 2, "{e:#}");
        let abandoned = anyhow::Error::new(CheckpointAbandoned { step: 22, what: String::new() });
        assert_eq!(exit_code(&abandoned), Exit::PeerFailed as u8);
    }

    #[test]
    fn each_kind_of_error_has_its_exit_status() {
        let peer = CommError::PeerLost { rank: 1, addr: "a".into(), during: "d".into(), detail: "x".into() };
        let lost = CommError::PeerLost { rank: 2, addr: "b".into(), during: "d".into(), detail: "x".into() };
        let store = ElasticError::Store { addr: "s".into(), detail: "closed".into() };
        let cases: Vec<(anyhow::Error, u8)> = vec![
            (anyhow::anyhow!("disk full"), 1),
            (bad_input(anyhow::anyhow!("recipe x: bad key")), 2),
            (anyhow::Error::from(CommError::Launch { var: "WORLD_SIZE".into(), detail: "x".into() }), 2),
            (anyhow::Error::from(peer).context("rank 2 of 4"), 3),
            (anyhow::Error::new(Diverged { step: Some(4), why: "loss NaN".into() }), 4),
            (anyhow::Error::from(store), 5),
            (anyhow::Error::new(NotTrained { why: "accuracy 9.17 %".into() }).context("rank 0"), 6),
            (anyhow::Error::from(ElasticError::Expelled { generation: 0, current: 1 }), 5),
            // A peer lost while an elastic generation formed is still a peer failure.
            (anyhow::Error::from(ElasticError::from(lost)).context("forming generation 2"), 3),
            (anyhow::Error::from(ElasticError::Mismatch { peer: "store".into(), detail: "`seed`".into() }), 2),
            (anyhow::Error::new(Interrupted { signal: 2, name: "SIGINT", stopped: 4, resumable: true }), 130),
            (anyhow::Error::new(WorkersFailed { status: 4, message: "rank 1 diverged".into() }), 4),
        ];
        for (e, code) in cases {
            assert_eq!(exit_code(&e), code, "{e:#}");
        }
    }

    #[test]
    fn bad_input_keeps_the_whole_message_and_is_not_wrapped_twice() {
        let e = bad_input(anyhow::anyhow!("inner").context("outer"));
        assert_eq!(format!("{e:#}"), "outer: inner");
        let twice = bad_input(e);
        assert_eq!(twice.chain().filter(|c| c.is::<BadInput>()).count(), 1);
    }
}
