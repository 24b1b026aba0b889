//! Local SGD / Local AdamW with the Quadratic Synchronization Rule inside burn-train's `Learner`.
//!
//! [`LocalTrainingStrategy`] is a burn-train `SupervisedLearningStrategy`: K replicas of the Learner
//! (the model with **the Learner's own optimizer and lr scheduler**) each train on their own slice of
//! the training data, and a [`qsr_optim::Averager`] averages their parameters whenever a round of the
//! sync rule ends. With QSR each round's `H = max(h_base, floor((alpha / lr)^2))` comes from the lr the
//! Learner's scheduler gave the round's first step. Data parallel (`SyncRule::Dp`) and post-local
//! average gradients before the Learner's optimizer step instead. Replicas run as threads of one process
//! ([`Replicas::Threads`]) or one per process under torchrun / mpirun / srun ([`Replicas::Launched`],
//! over qsr's TCP ring or MPI).
//!
//! A burn-train program changes in two places (the complete program is `examples/learner_digits.rs`):
//!
//! ```text
//! + let rule = SyncRule::Qsr { h_base: 2, alpha: 0.06 };
//! + let strategy = Arc::new(LocalTrainingStrategy::new(Replicas::Threads(vec![device.clone(); 4]), AveragerConfig::new(rule, 0)));
//!   let result = SupervisedTraining::new(dir, train_loader, valid_loader)
//!       .metric_train_numeric(AccuracyMetric::new())
//! +     .metric_train_numeric(strategy.syncs_metric())
//!       .num_epochs(epochs)
//! +     .with_training_strategy(TrainingStrategy::Custom(strategy.clone()))
//!       .launch(Learner::new(model, optimizer, scheduler));
//! + println!("{} synchronizations", strategy.stats().map_or(0, |s| s.syncs));
//! ```
//!
//! `AveragerConfig::new(rule, 0)`: the rule and the steps of your lr warmup (0 here), during which the
//! power rules keep rounds of `h_base`. As processes, build the program once and start its ranks with
//! the launcher (`qsr launch --nproc 2 -- target/release/examples/learner_digits`, or `qsr-launch`,
//! which builds without burn); [`Replicas::Launched`] takes each rank's place from the variables it sets.
//!
//! [`Replicas::from_env`] picks threads or launched processes from the environment, and
//! [`LocalTrainingStrategy::with_checkpoints`] makes a resumed run continue every replica exactly.
//! Validation, burn-train's checkpoints and early stopping see the replicas' average, and
//! [`syncs_metric`](LocalTrainingStrategy::syncs_metric) / [`traffic_metric`](LocalTrainingStrategy::traffic_metric)
//! put the run's synchronizations and megabytes sent beside burn-train's own metrics.
//!
//! How the strategy treats data (contiguous slices, or each rank's [`Shard`] through
//! [`LocalTrainingStrategy::with_shards`]), events, checkpoints and stopping is on
//! [`LocalTrainingStrategy`].
//! This crate is the only one of qsr's that depends on burn-train.

#![forbid(unsafe_code)]

mod horizon;
mod metric;
mod renderer;
mod replica;
mod report;
mod resume;
mod shard;
mod strategy;

pub use metric::AveragerMetric;
pub use qsr_optim::{AveragerConfig, AveragerStats};
pub use qsr_sched::SyncRule;
pub use renderer::EpochLines;
pub use shard::Shard;
pub use strategy::{LocalTrainingStrategy, Replicas};
