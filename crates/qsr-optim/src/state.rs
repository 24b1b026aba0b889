//! The sync engine's state, one type for every face: what continues a run beside a replica's
//! parameters and optimizer state. The [`Averager`](crate::Averager)'s saved state, the
//! [`Worker`](crate::Worker)'s [`Snapshot`](crate::Snapshot) and the trainer's checkpoint hold it.

use serde::{Deserialize, Serialize};

use crate::outer::InnerRound;
use crate::stream::StreamState;

/// The sync engine's state: DiLoCo's outer optimizer, a streaming worker's averages in flight and
/// error-feedback residual, and the inner steps since the last global parameter sync. Serialized
/// with serde (the [`AveragerState`](crate::AveragerState) JSON carries its fields at its top level).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SyncState {
    /// The outer optimizer's global parameters and momentum.
    #[serde(default)]
    pub(crate) outer: Option<OuterState>,
    /// Streaming: the averages in flight and the error-feedback residual.
    #[serde(default)]
    pub(crate) stream: Option<StreamState>,
    /// The steps and their summed lr since the last global sync, for an outer step per inner step.
    #[serde(default)]
    pub(crate) inner_round: InnerRound,
}

impl SyncState {
    /// The outer optimizer's state, if syncs are outer steps.
    pub fn outer(&self) -> Option<&OuterState> {
        self.outer.as_ref()
    }

    /// The streaming state, if syncs stream.
    pub fn stream(&self) -> Option<&StreamState> {
        self.stream.as_ref()
    }
}

/// DiLoCo's outer optimizer state: the last global parameters and the momentum buffer (saved as the
/// pair `[global, momentum]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "(Vec<f32>, Vec<f32>)", into = "(Vec<f32>, Vec<f32>)")]
pub struct OuterState {
    /// The global parameters after the last outer step.
    pub global: Vec<f32>,
    /// The outer momentum buffer.
    pub momentum: Vec<f32>,
}

impl From<(Vec<f32>, Vec<f32>)> for OuterState {
    fn from((global, momentum): (Vec<f32>, Vec<f32>)) -> Self {
        Self { global, momentum }
    }
}

impl From<OuterState> for (Vec<f32>, Vec<f32>) {
    fn from(state: OuterState) -> Self {
        (state.global, state.momentum)
    }
}
