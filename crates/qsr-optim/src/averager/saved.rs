//! Where an [`Averager`](super::Averager) stands, saved beside the model and the optimizer: its rounds
//! and the sync engine's [`SyncState`], in the sync state's codec (a JSON state of the first format
//! still loads).

use std::path::Path;

use qsr_comm::CommStats;
use serde::{Deserialize, Serialize};

use super::config::RoundSpan;
use crate::error::OptimError;
use crate::lr_watch::LrWatch;
use crate::state::SyncState;

/// Where an [`Averager`](super::Averager) stands: its step, rounds and sync state (outer, streaming), saved beside the
/// model and the optimizer so that a resumed run continues its rounds exactly ([`Averager::state`](super::Averager::state),
/// [`Averager::restore`](super::Averager::restore)). It records the settings the ranks agreed on; restoring it under other
/// settings (rule, world size, model) is refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AveragerState {
    /// The averager's own rounds (its fields at the top level, as the first format had them).
    #[serde(flatten)]
    pub(super) rounds: Rounds,
    /// The sync engine's state (outer, streaming, inner round), its fields at the top level.
    #[serde(flatten)]
    pub(super) sync: SyncState,
}

/// The averager's part of its state: the settings, its counters and rounds, the lrs' course.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Rounds {
    pub(super) settings: serde_json::Value,
    pub(super) steps: u64,
    pub(super) syncs: u64,
    pub(super) synced_at: u64,
    pub(super) rounds_after_warmup: u64,
    pub(super) round: Option<RoundSpan>,
    /// The lrs' course, so that the warnings of wrong plans judge the whole run.
    #[serde(default)]
    pub(super) lr_watch: LrWatch,
    /// The syncs' calls and bytes so far, so that a resumed run's totals count the whole run (their
    /// seconds are not kept: they are each process's own; a state of an older format has none).
    #[serde(default)]
    pub(super) traffic: CommStats,
}

impl AveragerState {
    /// The most bytes a saved state may have: an outer step's two f32 copies of a 2-billion-parameter
    /// model.
    pub const STATE_BYTES: u64 = 16 << 30;

    /// Writes the state to `path` as safetensors (the sync state's tensors in its own codec, the
    /// rounds in its metadata), through a new file beside it and a rename, so a crash of the process
    /// never leaves half a file and a link at `path` is replaced, not followed.
    pub fn save(&self, path: &Path) -> Result<(), OptimError> {
        let io = |e: std::io::Error| OptimError::Io { path: path.to_path_buf(), source: e };
        let rounds = serde_json::to_value(&self.rounds).map_err(|e| io(std::io::Error::other(e)))?;
        let bytes = self.sync.encode(None, Some(rounds))?;
        Ok(qsr_files::write_atomic(path, &bytes, "averager state")?)
    }

    /// Reads a state [`save`](Self::save) wrote, or a JSON state of the first format: a regular file
    /// of at most [`STATE_BYTES`](Self::STATE_BYTES).
    pub fn load(path: &Path) -> Result<Self, OptimError> {
        let invalid = |e: String| OptimError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        };
        let bytes = qsr_files::read(path, Self::STATE_BYTES, "averager state")?;
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{') {
            return serde_json::from_slice(&bytes).map_err(|e| invalid(e.to_string()));
        }
        let decoded = SyncState::decode(&bytes, None).map_err(|e| invalid(e.to_string()))?;
        let rounds = decoded.owner.ok_or_else(|| invalid("not an averager's state: no rounds".into()))?;
        let rounds = serde_json::from_value(rounds).map_err(|e| invalid(format!("its rounds: {e}")))?;
        Ok(Self { rounds, sync: decoded.state })
    }

    /// Steps the averager had seen.
    pub fn steps(&self) -> u64 {
        self.rounds.steps
    }
}
