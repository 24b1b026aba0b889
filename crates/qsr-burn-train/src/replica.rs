//! One replica's training loop: the Learner's own step, lr scheduler and optimizer, then the averager.

use burn::optim::GradientsAccumulator;
use burn::train::{Learner, LearnerModel, TrainLoader, TrainStep, TrainingError};
use burn::train::{TrainOutput, TrainingItem};
use qsr_optim::{Averager, AveragerStats, OptimError};

/// One training item as burn-train's events carry it.
pub(crate) type Item<M> = TrainingItem<<M as TrainStep>::Output>;

/// Why a replica stopped before the end.
pub(crate) enum Failure {
    /// burn-train's own error (data loading): kept as is for the Learner's result.
    Training(TrainingError),
    /// qsr's: the collective or the averager.
    Qsr(OptimError),
    /// The user's `with_shards` function could not build an epoch's loader.
    Shard(String),
    /// A replica's own state could not be saved (`with_checkpoints`).
    Save(String),
}

impl From<OptimError> for Failure {
    fn from(e: OptimError) -> Self {
        Failure::Qsr(e)
    }
}

/// A Learner (model, optimizer, lr scheduler) training on its shard, averaged with the other replicas.
pub(crate) struct Replica<M: LearnerModel> {
    pub(crate) learner: Learner<M>,
    pub(crate) avg: Averager,
    pub(crate) train: TrainLoader<M>,
    pub(crate) grad_accumulation: Option<usize>,
}

impl<M: LearnerModel> Replica<M> {
    /// One epoch over the shard: per batch the Learner's forward/backward, then (every
    /// `grad_accumulation` batches) its lr scheduler, the gradients averaged on the steps of gradient
    /// rules, its optimizer step, then the averager, which averages the parameters with every replica
    /// when a round of the sync rule ends. `report` sees each item as burn-train's own strategies
    /// report it, with the averager's totals after its step.
    pub(crate) fn train_epoch(&mut self, mut report: impl FnMut(Item<M>, &AveragerStats)) -> Result<(), Failure> {
        let train = self.train.clone();
        let mut iterator = train.iter();
        let mut accumulator = GradientsAccumulator::new();
        let mut accumulated = 0;
        let mut iteration = 0;
        while let Some(batch) = iterator.next() {
            let batch = batch.map_err(|e| Failure::Training(TrainingError::Dataset(e)))?;
            iteration += 1;
            let progress = iterator.progress();
            let TrainOutput { grads, item } = self.learner.train_step(batch);
            let grads = match self.grad_accumulation {
                None => Some(grads),
                Some(n) => {
                    accumulator.accumulate(&self.learner.model(), grads);
                    accumulated += 1;
                    (accumulated >= n || progress.is_completed()).then(|| {
                        accumulated = 0;
                        accumulator.grads()
                    })
                }
            };
            if let Some(grads) = grads {
                self.learner.lr_step();
                // Gradient rules (dp, post-local before its switch) average here; a no-op for the others.
                let grads = self.avg.average_grads(&self.learner.model(), grads)?;
                self.learner.optimizer_step(grads);
                self.after_optimizer_step()?;
            }
            let lr = Some(self.learner.lr_current());
            report(TrainingItem { item, progress, iteration: Some(iteration), lr }, self.avg.stats());
        }
        Ok(())
    }

    /// The averager's step with the lr this optimizer step used; the averaged parameters go back into
    /// the Learner (its optimizer state is keyed by parameter id, which loading a record keeps).
    fn after_optimizer_step(&mut self) -> Result<(), OptimError> {
        let updates = self.avg.stats().updates;
        let lr = self.learner.lr_current().base();
        let model = self.avg.step_with_lr(self.learner.model(), lr)?;
        // A streaming averager also writes mid-round, where an average lands.
        if self.avg.stats().updates > updates {
            self.learner.load_model(model.into_record());
        }
        Ok(())
    }

    /// Averages the steps since the last synchronization (the last round, cut at the run's end) and
    /// hands back the model every replica now shares; `early` for a run stopped before its last
    /// epoch (interrupted, or by early stopping), whose lr end says nothing of its schedule.
    pub(crate) fn finish(&mut self, early: bool) -> Result<M, OptimError> {
        let updates = self.avg.stats().updates;
        let model = self.learner.model();
        let model = if early {
            // Stopped on purpose before its last epoch: averaged, and no judgement of a schedule cut short.
            let model = if self.avg.unsynced_steps() > 0 { self.avg.average_now(model)? } else { model };
            self.avg.abandon();
            model
        } else {
            self.avg.finish(model)?
        };
        if self.avg.stats().updates > updates {
            self.learner.load_model(model.into_record());
        }
        Ok(self.learner.model())
    }
}
