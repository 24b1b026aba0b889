//! One round of a plan: its steps and what its synchronization all-reduces.

use serde::{Deserialize, Serialize};

/// What a synchronization all-reduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SyncMode {
    /// Data parallel: gradients are averaged before every optimizer step (rounds of length 1).
    Gradients,
    /// Local method: parameters are averaged after the round's last local step.
    Parameters,
}

/// One round: `len` optimizer steps starting at global step `start`, then one synchronization.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Round {
    /// 0-based position of the round in the run.
    pub index: u64,
    /// Global step (0-based) of the round's first step.
    pub start: u64,
    /// Optimizer steps in the round: the rule's `H`, except that the last round is clamped to end at the
    /// run's end. Always >= 1.
    pub len: u64,
    /// The scheduled lr of the round's first step (the one the rule decided `len` from).
    pub lr_start: f64,
    /// What the round's synchronization all-reduces: gradients (data parallel) or parameters.
    pub mode: SyncMode,
}

impl Round {
    /// One past the round's last step; the synchronization happens after step `end() - 1`.
    pub fn end(&self) -> u64 {
        self.start + self.len
    }
}
