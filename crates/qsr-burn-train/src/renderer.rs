//! [`EpochLines`]: a burn-train renderer that prints one line per epoch.

use std::collections::BTreeMap;

use burn::train::LearnerSummary;
use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::{MetricDefinition, MetricId};
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation, MetricsRendererTraining,
};

/// A burn-train renderer printing one line per epoch to stdout, with each metric's value over the
/// epoch on both splits: `epoch 3/20  train: Loss 0.412  valid: Accuracy 93.10 % | Loss 0.251`. burn-train's CLI renderer
/// prints a line per batch; with K replicas and long runs this keeps logs readable. Install it with
/// `SupervisedTraining::renderer(Box::new(EpochLines::default()))`.
#[derive(Debug, Default)]
pub struct EpochLines {
    names: BTreeMap<String, String>,
    train: BTreeMap<String, String>,
    valid: BTreeMap<String, String>,
    split: String,
    epoch: (usize, usize),
}

impl EpochLines {
    fn record(&mut self, state: MetricState, valid: bool) {
        let entry = match state {
            MetricState::Generic(entry) | MetricState::Numeric(entry, _) => entry,
        };
        let split = if valid { &mut self.valid } else { &mut self.train };
        split.insert(key(&entry.metric_id), epoch_value(&entry.serialized_entry.formatted).to_string());
    }

    /// `Name value | Name value` of one split.
    fn values(&self, split: &BTreeMap<String, String>) -> String {
        let named =
            split.iter().map(|(id, v)| format!("{} {v}", self.names.get(id).map_or(id.as_str(), String::as_str)));
        named.collect::<Vec<_>>().join(" | ")
    }
}

/// The epoch's value of burn-train's `epoch 93.10 % - batch 100.00 %` (the last batch's is noise).
fn epoch_value(formatted: &str) -> &str {
    let epoch = formatted.split(" - batch").next().unwrap_or(formatted);
    epoch.strip_prefix("epoch ").unwrap_or(epoch)
}

fn key(id: &MetricId) -> String {
    format!("{id:?}")
}

impl MetricsRendererTraining for EpochLines {
    fn update_train(&mut self, state: MetricState) {
        self.record(state, false);
    }

    fn update_valid(&mut self, state: MetricState) {
        self.record(state, true);
    }

    fn on_train_end(&mut self, _summary: Option<LearnerSummary>) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl MetricsRendererEvaluation for EpochLines {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
}

impl TrainingProgressLogger for EpochLines {
    fn start(&mut self, total_epochs: usize, starting_epoch: usize, _items: Option<usize>, _label: Option<&str>) {
        self.epoch = (starting_epoch, total_epochs);
    }

    /// Called when `epoch` ends: the next one is under way.
    fn update_epoch(&mut self, epoch: usize) {
        self.epoch.0 = epoch + 1;
    }

    fn start_split(&mut self, split: &str, _total_items: usize) {
        split.clone_into(&mut self.split);
    }

    fn update_split(&mut self, _items_processed: usize) {}

    fn end_split(&mut self) {
        if self.split != "valid" {
            return;
        }
        let (train, valid) = (self.values(&self.train), self.values(&self.valid));
        let train = if train.is_empty() { String::new() } else { format!("  train: {train}") };
        println!("epoch {}/{}{train}  valid: {valid}", self.epoch.0, self.epoch.1);
    }

    fn end(&mut self) {}

    fn log_event_training(&mut self, _event: String) {}
}

impl EvaluationProgressLogger for EpochLines {
    fn start_global_progress(&mut self, _total_tests: usize) {}
    fn start_test(&mut self, _name: &str, _total_items: usize) {}
    fn update_test_progress(&mut self, _items_processed: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRenderer for EpochLines {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names.insert(key(&definition.metric_id), definition.name.to_string());
    }
}

#[cfg(test)]
mod tests {
    /// The Learner trial: the line showed the last batch's value ("batch 100.00 %").
    #[test]
    fn an_epoch_line_shows_the_epochs_value_not_the_last_batchs() {
        assert_eq!(super::epoch_value("epoch 93.10 % - batch 100.00 %"), "93.10 %");
        assert_eq!(super::epoch_value("epoch 0.36 - batch 8.73e-2"), "0.36");
        assert_eq!(super::epoch_value("0.5"), "0.5");
    }
}
