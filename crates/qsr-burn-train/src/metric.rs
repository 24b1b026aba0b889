//! The averager's synchronizations and traffic as burn-train metrics ([`AveragerMetric`]).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use burn::tensor::TensorReadError;
use burn::train::metric::{
    Metric, MetricAttributes, MetricMetadata, MetricName, Numeric, NumericAttributes, NumericEntry, SerializedEntry,
};
use qsr_optim::AveragerStats;

/// Readings a metric has not consumed yet: at most this many (a metric made but never registered, or
/// registered on the validation split, whose items take none, stays bounded).
const QUEUE: usize = 1 << 16;

/// What rank 0's averager had done: synchronizations and payload bytes sent.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Counts {
    syncs: u64,
    bytes_sent: u64,
}

impl From<&AveragerStats> for Counts {
    fn from(stats: &AveragerStats) -> Self {
        Counts { syncs: stats.syncs, bytes_sent: stats.comm.bytes_sent }
    }
}

/// One reading: the run's totals, and the totals when the epoch began.
type Reading = (Counts, Counts);

/// One metric's readings, oldest first: `false` after a training item, `true` at the end of the
/// epoch's training (after its last average).
type Queue = Mutex<VecDeque<(Reading, bool)>>;

/// Where rank 0 publishes a reading per training item, to every metric made by the strategy. burn-train
/// processes events on its own thread, after the step that made them: each metric takes the readings
/// in item order, so every item shows the counts of its own step.
#[derive(Debug, Default)]
pub(crate) struct Feeds {
    queues: Mutex<Vec<Weak<Queue>>>,
    epoch_start: Mutex<Counts>,
}

impl Feeds {
    fn subscribe(&self) -> Arc<Queue> {
        let queue = Arc::new(Mutex::new(VecDeque::new()));
        lock(&self.queues).push(Arc::downgrade(&queue));
        queue
    }

    /// An epoch begins with the averager at `stats`.
    pub(crate) fn start_epoch(&self, stats: &AveragerStats) {
        *lock(&self.epoch_start) = stats.into();
    }

    /// A training item was trained, leaving the averager at `stats`: before burn-train sees the item.
    pub(crate) fn publish(&self, stats: &AveragerStats) {
        self.push(stats, false);
    }

    /// The epoch's training ended (and its average) with the averager at `stats`: before burn-train
    /// sees the end of the training split.
    pub(crate) fn end_epoch(&self, stats: &AveragerStats) {
        self.push(stats, true);
    }

    fn push(&self, stats: &AveragerStats, end: bool) {
        let reading = ((Counts::from(stats), *lock(&self.epoch_start)), end);
        lock(&self.queues).retain(|queue| {
            let Some(queue) = queue.upgrade() else { return false };
            let mut queue = lock(&queue);
            if queue.len() == QUEUE {
                queue.pop_front();
            }
            queue.push_back(reading);
            true
        });
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Which of the averager's counts a metric shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Counter {
    Syncs,
    MegabytesSent,
}

/// A burn-train numeric metric of rank 0's averager: the run's synchronizations
/// ([`LocalTrainingStrategy::syncs_metric`](crate::LocalTrainingStrategy::syncs_metric)) or megabytes
/// of parameters sent ([`traffic_metric`](crate::LocalTrainingStrategy::traffic_metric)), after each
/// training item and at each epoch's end, with the epoch's own share: `Synchronizations 42 (9 this
/// epoch)`. Register it on the training split (`.metric_train_numeric(strategy.syncs_metric())`);
/// burn-train's renderers show it, its logs keep it, and its value is the run's total so far (what a
/// plot of it against steps shows).
#[derive(Debug, Clone)]
pub struct AveragerMetric {
    counter: Counter,
    queue: Arc<Queue>,
    reading: Reading,
}

impl AveragerMetric {
    pub(crate) fn new(feeds: &Feeds, syncs: bool) -> Self {
        let counter = if syncs { Counter::Syncs } else { Counter::MegabytesSent };
        Self { counter, queue: feeds.subscribe(), reading: Reading::default() }
    }

    fn of(&self, counts: Counts) -> f64 {
        match self.counter {
            Counter::Syncs => counts.syncs as f64,
            Counter::MegabytesSent => counts.bytes_sent as f64 / 1e6,
        }
    }

    fn total(&self) -> f64 {
        self.of(self.reading.0)
    }

    fn entry(&self, serialized: NumericEntry) -> SerializedEntry {
        let (total, epoch) = (self.total(), self.total() - self.of(self.reading.1));
        let formatted = match self.counter {
            Counter::Syncs => format!("{total} ({epoch} this epoch)"),
            Counter::MegabytesSent => format!("{total:.2} MB ({epoch:.2} MB this epoch)"),
        };
        SerializedEntry::new(formatted, serialized.serialize())
    }
}

impl Metric for AveragerMetric {
    type Input = ();

    fn name(&self) -> MetricName {
        Arc::new(match self.counter {
            Counter::Syncs => "Synchronizations".into(),
            Counter::MegabytesSent => "Traffic".into(),
        })
    }

    fn attributes(&self) -> MetricAttributes {
        let unit = (self.counter == Counter::MegabytesSent).then(|| "MB".to_string());
        NumericAttributes { unit, higher_is_better: false }.into()
    }

    /// The next item's reading (past an epoch's end a compute did not take: a metric on another split).
    fn update(&mut self, _: &(), _: &MetricMetadata) -> Result<SerializedEntry, TensorReadError> {
        let mut queue = lock(&self.queue);
        while let Some((reading, end)) = queue.pop_front() {
            self.reading = reading;
            if !end {
                break;
            }
        }
        drop(queue);
        Ok(self.entry(NumericEntry::Value(self.total())))
    }

    /// The epoch's end, with the average that ended its training.
    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        let mut queue = lock(&self.queue);
        if let Some(&(reading, true)) = queue.front() {
            self.reading = reading;
            queue.pop_front();
        }
        drop(queue);
        Ok(self.entry(NumericEntry::Final(self.total())))
    }

    /// Keeps the last reading: the counts are the run's, not the epoch's.
    fn clear(&mut self) {}
}

impl Numeric for AveragerMetric {
    fn value(&self) -> Option<NumericEntry> {
        Some(NumericEntry::Value(self.total()))
    }

    fn running_value(&self) -> Option<NumericEntry> {
        self.value()
    }

    fn final_value(&self) -> NumericEntry {
        NumericEntry::Final(self.total())
    }
}

#[cfg(test)]
mod tests {
    use burn::train::metric::{Metric, MetricMetadata};
    use qsr_optim::AveragerStats;

    use super::{AveragerMetric, Feeds};

    fn stats(syncs: u64, bytes_sent: u64) -> AveragerStats {
        let comm = qsr_comm::CommStats { bytes_sent, ..Default::default() };
        AveragerStats { syncs, comm, ..Default::default() }
    }

    /// burn-train's processor runs behind the training loop: each item must show its own step's
    /// counts, not the latest, and the epoch's share counts from the epoch's start.
    #[test]
    fn each_item_shows_the_counts_of_its_own_step() {
        let feeds = Feeds::default();
        let (mut syncs, mut traffic) = (AveragerMetric::new(&feeds, true), AveragerMetric::new(&feeds, false));
        feeds.start_epoch(&stats(3, 3_000_000));
        feeds.publish(&stats(3, 3_000_000));
        feeds.publish(&stats(5, 5_500_000));
        let progress = burn::data::dataloader::Progress::new(1, 1, None);
        let meta = MetricMetadata { progress, iteration: Some(1), lr: None };
        assert_eq!(syncs.update(&(), &meta).unwrap().formatted, "3 (0 this epoch)");
        assert_eq!(syncs.update(&(), &meta).unwrap().formatted, "5 (2 this epoch)");
        // The epoch's last average, published after its last item, and the next epoch's first item,
        // both before burn-train computes the epoch's value.
        feeds.end_epoch(&stats(6, 6_000_000));
        feeds.start_epoch(&stats(6, 6_000_000));
        feeds.publish(&stats(7, 7_000_000));
        assert_eq!(syncs.compute().unwrap().serialized, "6,final");
        assert_eq!(syncs.update(&(), &meta).unwrap().formatted, "7 (1 this epoch)");
        assert_eq!(traffic.update(&(), &meta).unwrap().formatted, "3.00 MB (0.00 MB this epoch)");
        assert_eq!(traffic.update(&(), &meta).unwrap().formatted, "5.50 MB (2.50 MB this epoch)");
        // Updated without a compute (a metric of the validation split): past the epoch's end.
        assert_eq!(traffic.update(&(), &meta).unwrap().formatted, "7.00 MB (1.00 MB this epoch)");
        // No reading left: the last one stays.
        assert_eq!(syncs.update(&(), &meta).unwrap().serialized, "7");
    }

    /// A metric made and dropped unregistered stops being fed; one kept unregistered stays bounded.
    #[test]
    fn a_metric_never_registered_holds_a_bounded_queue() {
        let feeds = Feeds::default();
        drop(AveragerMetric::new(&feeds, true));
        let kept = AveragerMetric::new(&feeds, true);
        for step in 0..(super::QUEUE as u64 + 10) {
            feeds.publish(&stats(step, 0));
        }
        assert_eq!(feeds.queues.lock().unwrap().len(), 1, "the dropped metric's queue is gone");
        assert_eq!(kept.queue.lock().unwrap().len(), super::QUEUE);
    }
}
