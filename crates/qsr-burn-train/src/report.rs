//! Rank 0's side of burn-train: events, validation, checkpoints and early stopping, in the order
//! burn-train's own single-device strategy uses them.

use std::sync::Arc;

use burn::tensor::Device;
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent,
    LearnerModel, LearningCheckpointer, SupervisedTrainingEventProcessor, TrainingComponents, TrainingError,
    TrainingItem, ValidLoader,
};

use qsr_optim::AveragerStats;

use crate::metric::Feeds;
use crate::replica::Item;

/// burn-train's reporting parts, owned by rank 0's replica.
pub(crate) struct Reporter<M: LearnerModel> {
    processor: SupervisedTrainingEventProcessor<M>,
    interrupter: Interrupter,
    valid: ValidLoader<M>,
    checkpointer: Option<LearningCheckpointer<M>>,
    early_stopping: Option<Box<dyn CloneEarlyStoppingStrategy>>,
    event_store: Arc<EventStoreClient>,
    /// The averager's counts for the strategy's metrics.
    feeds: Arc<Feeds>,
}

impl<M: LearnerModel> Reporter<M> {
    /// The parts `components` holds, validating on `device` (without autodiff).
    pub(crate) fn new(
        components: TrainingComponents<M>,
        valid: ValidLoader<M>,
        device: &Device,
        feeds: Arc<Feeds>,
    ) -> Self {
        Self {
            processor: components.event_processor,
            interrupter: components.interrupter,
            valid: valid.to_device(&device.clone().inner()),
            checkpointer: components.checkpointer,
            early_stopping: components.early_stopping,
            event_store: components.event_store,
            feeds,
        }
    }

    /// `epoch` starts with `total_items` to train and the averager at `stats`.
    pub(crate) fn start_epoch(&mut self, epoch: usize, total_items: usize, stats: &AveragerStats) {
        self.feeds.start_epoch(stats);
        let event = LearnerEvent::StartSplit { epoch_number: epoch, total_items };
        self.interrupter.fail_on_error(self.processor.process_train(event));
    }

    /// A training item, whose step left the averager at `stats`.
    pub(crate) fn item(&mut self, item: Item<M>, stats: &AveragerStats) {
        self.feeds.publish(stats);
        self.interrupter.fail_on_error(self.processor.process_train(LearnerEvent::ProcessedItem(item)));
    }

    /// The epoch's training ended, with its average (the mean or the final one): the averager at `stats`.
    pub(crate) fn end_training(&mut self, epoch: usize, stats: &AveragerStats) {
        self.feeds.end_epoch(stats);
        self.interrupter.fail_on_error(self.processor.process_train(LearnerEvent::EndSplit(epoch)));
    }

    /// Validation of `learner`'s model (the replicas' average), the epoch's end event, its checkpoint
    /// and early stopping: `true` when training should stop.
    pub(crate) fn end_epoch(&mut self, epoch: usize, learner: &Learner<M>) -> bool {
        self.validate(epoch, learner);
        self.interrupter.fail_on_error(self.processor.process_train(LearnerEvent::EndEpoch(epoch)));
        if self.checkpointer.is_some() || self.early_stopping.is_some() {
            self.interrupter.fail_on_error(self.processor.flush());
        }
        if self.interrupter.should_stop() {
            return true;
        }
        if let Some(checkpointer) = &mut self.checkpointer {
            checkpointer.checkpoint(learner, epoch, &self.event_store);
        }
        self.early_stopping.as_mut().is_some_and(|e| e.should_stop(epoch, &self.event_store))
    }

    fn validate(&mut self, epoch: usize, learner: &Learner<M>) {
        let model = learner.model().valid();
        let event = LearnerEvent::StartSplit { epoch_number: epoch, total_items: self.valid.num_items() };
        self.interrupter.fail_on_error(self.processor.process_valid(event));
        let mut iterator = self.valid.iter();
        let mut iteration = 0;
        while let Some(batch) = iterator.next() {
            let batch = match batch {
                Ok(batch) => batch,
                Err(e) => {
                    self.interrupter.fail(TrainingError::Dataset(e));
                    break;
                }
            };
            iteration += 1;
            let item = TrainingItem {
                item: InferenceStep::step(&model, batch),
                progress: iterator.progress(),
                iteration: Some(iteration),
                lr: None,
            };
            self.interrupter.fail_on_error(self.processor.process_valid(LearnerEvent::ProcessedItem(item)));
            if self.interrupter.should_stop() {
                break;
            }
        }
        self.interrupter.fail_on_error(self.processor.process_valid(LearnerEvent::EndSplit(epoch)));
    }

    pub(crate) fn into_processor(self) -> SupervisedTrainingEventProcessor<M> {
        self.processor
    }
}
