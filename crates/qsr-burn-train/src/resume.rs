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
use burn::train::{Interrupter, Learner, LearnerModel, LearningCheckpointer};
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
    /// Rank `rank`'s files under `root` (`store` is what burn-train's checkpointer is called with; a
    /// file it cannot write fails the run through `interrupter`, where it would panic without one).
    pub(crate) fn new(root: &Path, rank: usize, store: Arc<EventStoreClient>, interrupter: &Interrupter) -> Self {
        let dir = root.join(format!("rank-{rank}"));
        let file = |name: &str| FileCheckpointer::new(&dir, name);
        let (model, optim, scheduler) = (file(PARTS[0]), file(PARTS[1]), file(PARTS[2]));
        let checkpointer = LearningCheckpointer::new(
            AsyncCheckpointer::new(model).with_interrupter(interrupter.clone()),
            AsyncCheckpointer::new(optim).with_interrupter(interrupter.clone()),
            AsyncCheckpointer::new(scheduler).with_interrupter(interrupter.clone()),
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
    /// `avg` (right after [`Averager::new`], on every rank). Every file is read before the ranks
    /// agree, so that none waits for one that failed alone; an error names the file.
    pub(crate) fn load(&self, learner: Learner<M>, avg: &mut Averager, epoch: usize) -> Result<Learner<M>, String> {
        let read = self.read(learner, epoch);
        if avg.any(read.is_err()).map_err(|e| e.to_string())? {
            // Where the ranks share the directory, the one whose file is missing is named on each.
            let mut dirs = (0..avg.world_size()).map(|r| self.root.join(format!("rank-{r}")));
            let other = || dirs.find_map(|d| missing(&d, epoch)).map(|f| format!("{} is missing", f.display()));
            let reason = read.err().or_else(other).unwrap_or_else(|| "another rank's saved state is unreadable".into());
            return Err(format!(
                "resuming after epoch {epoch}: {reason} (give `with_checkpoints` the directory the interrupted run \
                 saved into, and the same number of replicas)"
            ));
        }
        let (learner, state) = read?;
        avg.restore(state).map_err(|e| e.to_string())?;
        Ok(learner)
    }

    /// This rank's files after `epoch`, read: burn-train's loader panics on a file it cannot decode,
    /// which is caught and named here.
    fn read(&self, learner: Learner<M>, epoch: usize) -> Result<(Learner<M>, AveragerState), String> {
        if let Some(file) = missing(&self.dir, epoch) {
            return Err(format!("{} is missing", file.display()));
        }
        let state = AveragerState::load(&self.averager_path(epoch)).map_err(|e| e.to_string())?;
        let load = std::panic::AssertUnwindSafe(|| self.checkpointer.load_checkpoint(learner, epoch));
        let learner = std::panic::catch_unwind(load)
            .map_err(|_| format!("a file of {}'s epoch {epoch} cannot be decoded", self.dir.display()))?;
        Ok((learner, state))
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
