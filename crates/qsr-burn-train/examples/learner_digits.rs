//! QSR through burn-train's `Learner`: an MLP on the embedded digits, burn's SGD (momentum 0.9) and
//! cosine lr scheduler owned by the Learner, K = 4 replicas as threads averaged whenever a QSR round
//! ends. Prints the synchronizations next to the planned rounds and the test accuracy; exits non-zero if
//! they differ. `--fashion-mnist [DIR]` trains on Fashion-MNIST instead (Debian's `dataset-fashion-mnist`
//! puts it in /usr/share/datasets/fashion-mnist).
//!
//! ```sh
//! cargo run --release -p qsr-burn-train --example learner_digits        # 4 replicas as threads
//! cargo run --release -p qsr-burn-train --example learner_digits -- --fashion-mnist
//! # 2 processes over qsr's TCP ring, one replica each: build once, then launch the ranks (torchrun's
//! # variables; `cargo install --path crates/qsr-launch` gives the launcher without burn in 41 s)
//! cargo build --release -p qsr-burn-train --example learner_digits
//! qsr-launch --nproc 2 -- target/release/examples/learner_digits
//! ```

// tests/learner.rs runs this program's parts, reaching them as `pub` items.
#![allow(unreachable_pub)]

use std::path::Path;
use std::sync::Arc;

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{SgdConfig, momentum::MomentumConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::metric::store::EventStoreClient;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{
    ClassificationOutput, EarlyStoppingStrategy, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
    TrainingStrategy,
};
use qsr_burn_train::{AveragerConfig, EpochLines, LocalTrainingStrategy, Replicas, Shard, SyncRule};
use qsr_data::{ImageSet, ShardedDataset, Split};
use qsr_sched::{LrSchedule, Plan, ScheduleKind};

const BATCH: usize = 16;

/// What to train on: the data and how long.
pub struct Task {
    /// The training split.
    pub train: ImageSet,
    /// The test split (the Learner's validation set, and the accuracy reported).
    pub test: ImageSet,
    /// Epochs over each replica's slice.
    pub epochs: usize,
    /// Peak learning rate of the cosine schedule.
    pub lr: f64,
    /// Steps the cosine schedule lasts; `None`: a replica's steps in the run, as it should.
    pub schedule_steps: Option<usize>,
}

impl Task {
    /// sklearn's digits (embedded), 20 epochs at lr 0.2.
    pub fn digits() -> Self {
        Task {
            train: qsr_data::digits(Split::Train),
            test: qsr_data::digits(Split::Test),
            epochs: 20,
            lr: 0.2,
            schedule_steps: None,
        }
    }

    /// Fashion-MNIST from `dir`, 2 epochs at lr 0.05. The digits' 0.2 is past the edge of stability on
    /// 784 inputs: its accuracy then hangs on the CPU's rounding (73.6% on one machine, 61.3% on another).
    pub fn fashion_mnist(dir: &str) -> Result<Self, qsr_data::DataError> {
        let train = qsr_data::fashion_mnist(dir, Split::Train)?;
        Ok(Task { train, test: qsr_data::fashion_mnist(dir, Split::Test)?, epochs: 2, lr: 0.05, schedule_steps: None })
    }

    /// Pixels per image and classes.
    fn dims(&self) -> (usize, usize) {
        let (h, w) = self.train.info.size.unwrap_or((1, 1));
        (self.train.info.channels * h * w, self.train.info.classes)
    }
}

/// The model: a user's own burn module with burn-train's two step traits.
#[derive(Module, Debug)]
pub struct Mlp {
    fc1: Linear,
    act: Relu,
    fc2: Linear,
}

impl Mlp {
    fn new((inputs, classes): (usize, usize), device: &Device) -> Self {
        Self {
            fc1: LinearConfig::new(inputs, 64).init(device),
            act: Relu::new(),
            fc2: LinearConfig::new(64, classes).init(device),
        }
    }

    fn classify(&self, batch: DigitBatch) -> ClassificationOutput {
        let logits = self.fc2.forward(self.act.forward(self.fc1.forward(batch.images)));
        let loss = CrossEntropyLossConfig::new().init(&logits.device()).forward(logits.clone(), batch.labels.clone());
        ClassificationOutput::new(loss, logits, batch.labels)
    }
}

impl TrainStep for Mlp {
    type Input = DigitBatch;
    type Output = ClassificationOutput;
    fn step(&self, batch: DigitBatch) -> TrainOutput<ClassificationOutput> {
        let output = self.classify(batch);
        TrainOutput::new(self, output.loss.backward(), output)
    }
}

impl InferenceStep for Mlp {
    type Input = DigitBatch;
    type Output = ClassificationOutput;
    fn step(&self, batch: DigitBatch) -> ClassificationOutput {
        self.classify(batch)
    }
}

/// One image's pixels and its class.
#[derive(Clone, Debug)]
pub struct Digit {
    pixels: Vec<u8>,
    label: u16,
}

/// A batch of images, pixels scaled to [0, 1].
#[derive(Clone, Debug)]
pub struct DigitBatch {
    images: Tensor<2>,
    labels: Tensor<1, Int>,
}

/// Flattens images of `dim` pixels with values up to `pixel_max`.
#[derive(Clone)]
struct DigitBatcher {
    dim: usize,
    pixel_max: f32,
}

impl DigitBatcher {
    fn of(set: &ImageSet) -> Self {
        let (h, w) = set.info.size.unwrap_or((1, 1));
        DigitBatcher { dim: set.info.channels * h * w, pixel_max: f32::from(set.info.pixel_max) }
    }
}

impl Batcher<Digit, DigitBatch> for DigitBatcher {
    fn batch(&self, items: Vec<Digit>, device: &Device) -> DigitBatch {
        let pixels: Vec<f32> =
            items.iter().flat_map(|d| d.pixels.iter().map(|&p| f32::from(p) / self.pixel_max)).collect();
        let labels: Vec<i64> = items.iter().map(|d| i64::from(d.label)).collect();
        DigitBatch {
            images: Tensor::from_data(TensorData::new(pixels, [items.len(), self.dim]), device),
            labels: Tensor::from_data(TensorData::new(labels, [items.len()]), device),
        }
    }
}

fn digits(set: &ImageSet) -> Vec<Digit> {
    let dim = DigitBatcher::of(set).dim;
    (0..set.labels.len())
        .map(|i| Digit { pixels: set.images[i * dim..(i + 1) * dim].to_vec(), label: set.labels[i] })
        .collect()
}

/// What a run reports: this process's rank, the synchronizations, the planned rounds, the test accuracy.
pub struct Outcome {
    /// This process's rank (0 for threads).
    pub rank: usize,
    /// Synchronizations rank 0's averager made.
    pub syncs: u64,
    /// Rounds qsr-sched plans for the Learner's schedule.
    pub planned: u64,
    /// Accuracy of the Learner's final (averaged) model on the test split.
    pub accuracy: f64,
    /// The final model's parameters, flat.
    pub weights: Vec<f32>,
}

/// Trains on the embedded digits with `replicas` (`k` of them in all) and `rule`, through burn-train's
/// Learner.
pub fn run(replicas: Replicas, k: usize, rule: SyncRule) -> Result<Outcome, Box<dyn std::error::Error>> {
    run_task(&Task::digits(), replicas, k, rule)
}

/// [`run`] on `task`.
pub fn run_task(
    task: &Task,
    replicas: Replicas,
    k: usize,
    rule: SyncRule,
) -> Result<Outcome, Box<dyn std::error::Error>> {
    run_config(task, replicas, k, AveragerConfig::new(rule, 0))
}

/// [`run_task`] with the averager's whole config (streaming, the wire, the outer step).
pub fn run_config(
    task: &Task,
    replicas: Replicas,
    k: usize,
    config: AveragerConfig,
) -> Result<Outcome, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    run_session(task, replicas, k, config, &Session { dir: dir.path(), resume_after: None, stop_after: None })
}

/// Where a run keeps its files, and which part of the run it is.
pub struct Session<'a> {
    /// burn-train's directory (logs, checkpoints); the replicas' own states go into its `replicas/`.
    pub dir: &'a Path,
    /// Continue after this epoch, from the checkpoints in `dir` (burn-train's `.checkpoint(epoch)`).
    pub resume_after: Option<usize>,
    /// Stop after this epoch, as early stopping would: a run cut short, to resume.
    pub stop_after: Option<usize>,
}

/// Early stopping after a given epoch.
#[derive(Clone)]
struct StopAfter(usize);

impl EarlyStoppingStrategy for StopAfter {
    fn should_stop(&mut self, epoch: usize, _store: &EventStoreClient) -> bool {
        epoch >= self.0
    }
}

/// [`run_config`] in `session`.
pub fn run_session(
    task: &Task,
    replicas: Replicas,
    k: usize,
    config: AveragerConfig,
    session: &Session<'_>,
) -> Result<Outcome, Box<dyn std::error::Error>> {
    let rule = config.rule.clone();
    let device = Device::flex().autodiff();
    device.seed(42); // the Learner's model is built once, here; the strategy gives every replica its weights
    // At least 1: burn's scheduler refuses 0 (the strategy then names an empty slice).
    let steps = (task.epochs * (task.train.labels.len() / k).div_ceil(BATCH)).max(1);
    let loader = |set: &ImageSet| {
        DataLoaderBuilder::new(DigitBatcher::of(set)).batch_size(BATCH).build(InMemDataset::new(digits(set)))
    };
    // Each replica's shard of the training set, strided over a fresh permutation every epoch.
    let (train, batcher) = (Arc::new(InMemDataset::new(digits(&task.train))), DigitBatcher::of(&task.train));
    let shards = move |s: Shard| {
        let shard = ShardedDataset::new(Arc::clone(&train), s.rank, s.world_size, 7)?;
        shard.set_epoch(s.epoch as u64);
        Ok::<_, qsr_data::DataError>(DataLoaderBuilder::new(batcher.clone()).batch_size(BATCH).build(shard))
    };
    let optim = SgdConfig::new().with_momentum(Some(MomentumConfig::new().with_momentum(0.9))).init();
    let sched = CosineAnnealingLrSchedulerConfig::new(task.lr, task.schedule_steps.unwrap_or(steps)).init()?;
    let learner = Learner::new(Mlp::new(task.dims(), &device), optim, sched);

    let strategy = LocalTrainingStrategy::new(replicas, config).with_shards(shards);
    let strategy = Arc::new(strategy.with_checkpoints(session.dir.join("replicas")));
    let mut training = SupervisedTraining::new(session.dir, loader(&task.train), loader(&task.test))
        .metric_train_numeric(LossMetric::new())
        .metric_train_numeric(strategy.syncs_metric())
        .metric_train_numeric(strategy.traffic_metric())
        .metric_valid_numeric(AccuracyMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .num_epochs(task.epochs)
        .with_default_checkpointers()
        .renderer(Box::new(EpochLines::default()))
        .with_application_logger(None)
        .with_training_strategy(TrainingStrategy::Custom(strategy.clone()));
    if let Some(epoch) = session.resume_after {
        training = training.checkpoint(epoch);
    }
    if let Some(epoch) = session.stop_after {
        training = training.early_stopping(StopAfter(epoch));
    }
    let result = training.launch(learner);
    if let Some(error) = result.error {
        return Err(error.to_string().into());
    }
    let stats = strategy.stats().ok_or("the strategy did not run")?;
    let plan = Plan::from_parts(LrSchedule::new(ScheduleKind::Cosine, steps as u64, 0, task.lr, 0.0), rule, None)?;
    let accuracy = accuracy(&result.model, &task.test);
    let layout = qsr_optim::ParamLayout::of(&result.model);
    let mut weights = vec![0.0; layout.len()];
    layout.read_params(&result.model, &mut weights)?;
    let rank = std::env::var("RANK").ok().and_then(|r| r.parse().ok()).unwrap_or(0);
    Ok(Outcome { rank, syncs: stats.syncs, planned: plan.summary().rounds, accuracy, weights })
}

fn accuracy(model: &Mlp, test: &ImageSet) -> f64 {
    let batch = DigitBatcher::of(test).batch(digits(test), &Device::flex());
    let predicted = model.classify(batch.clone()).output.argmax(1).squeeze_dim::<1>(1);
    let correct: i64 = predicted.equal(batch.labels).int().sum().into_scalar();
    correct as f64 / test.labels.len() as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rule = SyncRule::Qsr { h_base: 2, alpha: 0.06 };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let task = match args.first().map(String::as_str) {
        None => Task::digits(),
        Some("--fashion-mnist") => {
            let dir = args.get(1).map_or(qsr_data::FASHION_MNIST_DEFAULT_DIR, String::as_str);
            Task::fashion_mnist(dir)
                .map_err(|e| format!("{e} (apt-get install dataset-fashion-mnist, or give its folder)"))?
        }
        Some(other) => return Err(format!("unknown argument `{other}` (expected --fashion-mnist [DIR])").into()),
    };
    // 4 threads, or one replica per process under a launcher.
    let replicas = Replicas::from_env(Device::flex().autodiff(), 4)?;
    let k = replicas.count();
    let outcome = run_task(&task, replicas, k, rule)?;
    if outcome.rank == 0 {
        println!(
            "syncs {} (plan: {} rounds), test accuracy {:.2}%",
            outcome.syncs,
            outcome.planned,
            100.0 * outcome.accuracy
        );
    }
    if outcome.syncs != outcome.planned {
        return Err(format!("{} synchronizations, the plan has {} rounds", outcome.syncs, outcome.planned).into());
    }
    Ok(())
}
