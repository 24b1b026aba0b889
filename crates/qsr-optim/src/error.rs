//! The errors of the optimizers, the round driver and the averager ([`OptimError`]), and what a loss
//! closure may fail with ([`LossError`]).

/// What a loss closure may fail with: any error (`?` converts it), a `String` or `&str` too.
pub type LossError = Box<dyn std::error::Error + Send + Sync>;

/// Errors of the optimizer and the round driver.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// A setting is invalid; `field` is its dotted recipe name (`optimizer.beta1`).
    #[error("invalid `{field}`: {reason}")]
    Config {
        /// The setting: a dotted recipe key (`optimizer.beta1`, `driver.bucket_elems`), or, from an
        /// [`Averager`](crate::Averager), `rule` or `lr`.
        field: String,
        /// Why the value is refused, e.g. `must be > 0 (got 0)`.
        reason: String,
    },
    /// A [`DeviceGroup`](crate::DeviceGroup) failed or does not fit this worker: a peer left or never
    /// arrived, a worker panicked while averaging, or the group's rank and size differ from the collective's.
    #[error("device group: {0}")]
    DeviceGroup(String),
    /// Buffers or state do not fit the model's parameter layout.
    #[error("parameter layout mismatch: {0}")]
    Layout(String),
    /// A collective failed (a peer died, stalled or made another call); the cause is the `source` (printed by
    /// `{:#}` in anyhow, or by walking `Error::source`), not repeated in this message.
    #[error("synchronization at step {step} failed")]
    Comm {
        /// The step the synchronization belongs to: for a [`Worker`](crate::Worker), the 0-based index
        /// of the step whose sync failed (the cursor's next step for the initial broadcast and
        /// [`Worker::average_running_stats`](crate::Worker::average_running_stats)); for an
        /// [`Averager`](crate::Averager), the number of steps it had seen.
        step: u64,
        /// The collective's error (which rank died, stalled or disagreed, and how).
        #[source]
        source: qsr_comm::CommError,
    },
    /// The ranks reached different synchronizations: each sync's tag (its step, the round's `H` and
    /// fragment) travels with its collective call and differed between ranks, so they decided
    /// different rounds. Nothing was averaged across the two syncs. The source names both ranks'
    /// syncs (on a rank that only received the abort: the ranks that found it).
    #[error(
        "the ranks are at different synchronizations (this rank is at {tag}): every rank must compute the same H from the same lr at the same step; give every rank the same lr schedule, warmup and run_steps"
    )]
    SyncsDiffer {
        /// This rank's sync (boxed: it keeps the error small).
        tag: Box<qsr_comm::SyncTag>,
        /// The collective's error naming the ranks and their syncs.
        #[source]
        source: qsr_comm::CommError,
    },
    /// The ranks hold different parameters after a global parameter average, which leaves every rank
    /// the same bits: a collective that is not deterministic, or memory that changed under it
    /// (found by the fingerprint check, `driver.fingerprint`).
    #[error(
        "the ranks' parameters differ after the sync at step {step}: an average must leave every rank the same bits"
    )]
    ParametersDiffer {
        /// The step of the sync, as its face counts steps.
        step: u64,
    },
    /// The ranks could not set up averaging together: they disagree on the settings (named in the
    /// source) or a collective failed.
    #[error("the ranks could not set up averaging")]
    Setup {
        /// The collective's error; for a disagreement it names the differing settings.
        #[source]
        source: qsr_comm::CommError,
    },
    /// The loss closure failed (e.g. the data loader reported an error); the closure's error is the
    /// source.
    #[error("the loss of step {step} failed")]
    Step {
        /// The 0-based global step whose loss failed.
        step: u64,
        /// The error the loss closure returned.
        #[source]
        source: LossError,
    },
    /// A file of the optimizer's own (an [`AveragerState`](crate::AveragerState)) could not be
    /// written or read.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// What went wrong (for a file that is not a saved state: what did not parse).
        #[source]
        source: std::io::Error,
    },
    /// A file could not be read or written (the door's refusal, naming the file).
    #[error(transparent)]
    File(#[from] qsr_files::FileError),
    /// The plan has no steps left.
    #[error("the plan is finished (step {0})")]
    Finished(u64),
}

impl From<qsr_sched::ConfigError> for OptimError {
    /// A schedule setting the driver cannot run (a fragment count, a rule), under its recipe key.
    fn from(e: qsr_sched::ConfigError) -> Self {
        OptimError::Config { field: e.field, reason: e.reason }
    }
}

impl OptimError {
    /// A sync's failure at `step` (as the face counts it): [`OptimError::SyncsDiffer`] when the ranks
    /// made different calls in a tagged sync, else [`OptimError::Comm`].
    pub(crate) fn sync(step: u64, tag: Option<qsr_comm::SyncTag>, source: qsr_comm::CommError) -> Self {
        match tag {
            Some(tag) if at_other_syncs(&source) => OptimError::SyncsDiffer { tag: Box::new(tag), source },
            _ => OptimError::Comm { step, source },
        }
    }
}

/// Whether `e` says the ranks are at different syncs: found here (field `sync`), or an abort for
/// different collective calls (which, in a tagged sync, the tag differs in first).
fn at_other_syncs(e: &qsr_comm::CommError) -> bool {
    match e {
        qsr_comm::CommError::CallsDiffer { field, .. } => *field == "sync",
        other => other.calls_differ(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use qsr_comm::{CommError, SyncTag};

    /// Review: a length mismatch between ranks at the same sync was reported as ranks at different
    /// syncs, with the lr advice; only a differing tag (or its abort) is.
    #[test]
    fn only_a_differing_tag_is_reported_as_ranks_at_different_syncs() {
        let tag = Some(SyncTag { steps: 4, h: 4, fragment: 0 });
        let diverged = |field| CommError::CallsDiffer {
            me: 0,
            peer: 1,
            field,
            ours: "a".into(),
            theirs: "b".into(),
            during: "all_reduce seq 3".into(),
        };
        assert!(matches!(OptimError::sync(3, tag, diverged("sync")), OptimError::SyncsDiffer { .. }));
        assert!(matches!(OptimError::sync(3, tag, diverged("length (bytes)")), OptimError::Comm { step: 3, .. }));
        assert!(matches!(OptimError::sync(3, None, diverged("sync")), OptimError::Comm { .. }));
    }
}
