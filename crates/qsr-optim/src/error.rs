/// What a loss closure may fail with: any error (`?` converts it), a `String` or `&str` too.
pub type LossError = Box<dyn std::error::Error + Send + Sync>;

/// Errors of the optimizer and the round driver.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// A setting is invalid; `field` is its dotted recipe name (`optimizer.beta1`).
    #[error("invalid `{field}`: {reason}")]
    Config { field: String, reason: String },
    /// Buffers or state do not fit the model's parameter layout.
    #[error("parameter layout mismatch: {0}")]
    Layout(String),
    /// A collective failed (a peer died, stalled or diverged); the cause is the `source` (printed by
    /// `{:#}` in anyhow, or by walking `Error::source`), not repeated in this message.
    #[error("synchronization at step {step} failed")]
    Comm {
        step: u64,
        #[source]
        source: qsr_comm::CommError,
    },
    /// The ranks could not set up averaging together: they disagree on the settings (named in the
    /// source) or a collective failed.
    #[error("the ranks could not set up averaging")]
    Setup {
        #[source]
        source: qsr_comm::CommError,
    },
    /// The loss closure failed (e.g. the data loader reported an error); the closure's error is the
    /// source.
    #[error("the loss of step {step} failed")]
    Step {
        step: u64,
        #[source]
        source: LossError,
    },
    /// The plan has no steps left.
    #[error("the plan is finished (step {0})")]
    Finished(u64),
}
