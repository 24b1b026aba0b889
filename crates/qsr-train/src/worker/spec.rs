//! What a worker is given: its run, its collectives; and what it returns.

use std::path::PathBuf;

use burn::tensor::Device;
use qsr_comm::Collective;

use crate::checkpoint::CheckpointState;
use crate::recipe::TrainRecipe;

/// Everything a worker needs besides its collective and its model replica.
#[derive(Clone)]
pub(crate) struct RunSpec {
    /// The resolved recipe every worker trains.
    pub recipe: TrainRecipe,
    /// The device this worker computes on.
    pub device: Device,
    /// The run directory (rank 0 writes metrics, summary and the shared checkpoint files; every rank
    /// writes its optimizer state into the checkpoint).
    pub run_dir: PathBuf,
    /// Continue from this checkpoint.
    pub resume: Option<(PathBuf, CheckpointState)>,
    /// Show a progress bar (rank 0).
    pub progress: bool,
    /// Stop after the first checkpoint at or past this step (for tests of resumption).
    pub halt_after: Option<u64>,
}

/// A worker's collectives: every worker's, and for a two-level run (`[sync.local]`) its node's.
pub(crate) struct Comms {
    /// All workers: global syncs, the initial broadcast, evaluation and checkpoint barriers.
    pub world: Box<dyn Collective>,
    /// The worker's node, for the local averages of a two-level run.
    pub node: Option<Box<dyn Collective>>,
    /// A second collective of all workers for streaming fragments' all-reduces, which then run on a
    /// thread while the worker steps (`[sync.streaming]`); without it they run between steps.
    pub fragments: Option<Box<dyn Collective>>,
}

impl Comms {
    /// The collective of a flat run.
    pub(crate) fn flat(world: Box<dyn Collective>) -> Self {
        Comms { world, node: None, fragments: None }
    }
}
