//! Each replica's own state at the end of every epoch, so that a resumed run continues exactly.
//!
//! burn-train's checkpoint holds one Learner (rank 0's, with the averaged model): enough to start
//! again, not to continue a round in which every replica has its own parameters and optimizer state.
//! Each rank saves its Learner (model, optimizer, lr scheduler) through burn-train's own checkpointer
//! into `<dir>/rank-<r>/`, beside its averager's state (the rounds, the syncs, the sync's own state).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::train::checkpoint::{AsyncCheckpointer, CheckpointingAction, CheckpointingStrategy, FileCheckpointer};
use burn::train::metric::store::EventStoreClient;
use burn::train::{Learner, LearnerModel, LearningCheckpointer};
use qsr_optim::{Averager, AveragerState};

/// The checkpoint names of a replica's Learner parts, as burn-train's file checkpointer writes them.
const PARTS: [&str; 3] = ["model", "optim", "scheduler"];

/// One rank's files under the strategy's checkpoint directory.
pub(crate) struct ReplicaFiles<M: LearnerModel> {
    root: PathBuf,
    dir: PathBuf,
    checkpointer: LearningCheckpointer<M>,
    store: Arc<EventStoreClient>,
}

/// Saves every epoch: which of them a run resumes from is burn-train's choice (`.checkpoint(epoch)`).
struct EveryEpoch;

impl CheckpointingStrategy for EveryEpoch {
    fn checkpointing(&mut self, _epoch: usize, _store: &EventStoreClient) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}

impl<M: LearnerModel> ReplicaFiles<M> {
    /// Rank `rank`'s files under `root` (`store` is what burn-train's checkpointer is called with).
    pub(crate) fn new(root: &Path, rank: usize, store: Arc<EventStoreClient>) -> Self {
        let dir = root.join(format!("rank-{rank}"));
        let file = |name: &str| FileCheckpointer::new(&dir, name);
        let (model, optim, scheduler) = (file(PARTS[0]), file(PARTS[1]), file(PARTS[2]));
        let checkpointer = LearningCheckpointer::new(
            AsyncCheckpointer::new(model),
            AsyncCheckpointer::new(optim),
            AsyncCheckpointer::new(scheduler),
            Box::new(EveryEpoch),
        );
        Self { root: root.to_path_buf(), dir, checkpointer, store }
    }

    fn averager_path(&self, epoch: usize) -> PathBuf {
        averager_path(&self.dir, epoch)
    }

    /// Saves the replica as it stands after `epoch` (every rank at the same point: a streaming
    /// averager's state waits for its averages in flight).
    pub(crate) fn save(&mut self, learner: &Learner<M>, avg: &mut Averager, epoch: usize) -> Result<(), String> {
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("cannot create {}: {e}", self.dir.display()))?;
        avg.state().and_then(|s| s.save(&self.averager_path(epoch))).map_err(|e| e.to_string())?;
        self.checkpointer.checkpoint(learner, epoch, &self.store);
        Ok(())
    }

    /// The replica saved after `epoch`: its Learner's parts loaded into `learner`, its rounds into
    /// `avg` (right after [`Averager::new`], on every rank). An error names the first file missing;
    /// the ranks agree first, so that none waits for one that failed alone.
    pub(crate) fn load(&self, learner: Learner<M>, avg: &mut Averager, epoch: usize) -> Result<Learner<M>, String> {
        let mine = missing(&self.dir, epoch);
        if avg.any(mine.is_some()).map_err(|e| e.to_string())? {
            // Where the ranks share the directory, the one whose file is missing is named on each.
            let dirs = (0..avg.world_size()).map(|r| self.root.join(format!("rank-{r}")));
            let first = mine.or_else(|| dirs.into_iter().find_map(|d| missing(&d, epoch)));
            return Err(match first {
                Some(file) => format!(
                    "resuming after epoch {epoch}: {} is missing (give `with_checkpoints` the directory the \
                     interrupted run saved into, and the same number of replicas)",
                    file.display()
                ),
                None => format!("resuming after epoch {epoch}: another rank's saved state is missing"),
            });
        }
        let state = AveragerState::load(&self.averager_path(epoch)).map_err(|e| e.to_string())?;
        avg.restore(state).map_err(|e| e.to_string())?;
        Ok(self.checkpointer.load_checkpoint(learner, epoch))
    }
}

fn averager_path(dir: &Path, epoch: usize) -> PathBuf {
    dir.join(format!("averager-{epoch}.safetensors"))
}

/// The first file of a replica's state after `epoch` missing from `dir`.
fn missing(dir: &Path, epoch: usize) -> Option<PathBuf> {
    let parts = PARTS.iter().map(|p| dir.join(format!("{p}-{epoch}.bpk")));
    parts.chain([averager_path(dir, epoch)]).find(|f| !f.is_file())
}
