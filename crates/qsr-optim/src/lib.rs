//! Local SGD / Local AdamW for burn: K workers train their own replicas and average them at the
//! rounds of a sync rule (the Quadratic Synchronization Rule among them).
//!
//! **In your own burn loop** (your model, optimizer, lr scheduler and `DataLoader` stay) you need:
//! - [`try_run_workers`]: runs your `train(comm)` as threads, or as the ranks of a launch
//!   (`qsr-launch --nproc 4 -- ./your-program`), and returns every rank's value or the error of the
//!   rank that failed ([`run_workers`] for workers that return no `Result`);
//! - [`ShardedDataset`]: each rank's shard of your dataset, reshuffled per epoch;
//! - [`Averager`]: [`Averager::new`] gives every worker rank 0's weights; call [`Averager::step`]
//!   after each optimizer step, and it averages whenever a round ends and at the run's last step
//!   (its page has a complete example);
//! - [`AveragerConfig`]: the rule, e.g. [`AveragerConfig::qsr`]`(h_base, alpha)`, or alpha from a
//!   communication budget ([`AveragerConfig::qsr_for_budget`]), and your lr scheduler
//!   ([`AveragerConfig::schedule`]), whose lrs pick each round's `H` and which the averager judges
//!   before the first step;
//! - [`AveragerState`]: where the rounds stand, saved beside your checkpoint and given to
//!   [`Averager::restore`] to resume exactly.
//!
//! `examples/burn_qsr.rs` is a complete program.
//!
//! **The trainer's engine** (what `qsr train` runs; for a trainer of your own): [`Worker`], qsr's
//! PyTorch-exact SGD / AdamW (and Muon, to a stated tolerance) over flat state ([`Optimizer`], [`OptimizerConfig`]) driven step by step
//! from a `qsr-sched` plan, with gradient accumulation, data-parallel rounds, optimizer-state averaging,
//! device-resident state ([`DeviceGroup`]) and snapshots ([`Snapshot`]); [`check_sync`], the one
//! judge of sync settings both faces use; [`SyncState`], the sync engine's state and codec.

mod averager;
mod cpu;
mod device;
mod error;
mod exact;
mod flat;
mod flat_state;
mod lr_watch;
mod muon;
mod optim;
mod outer;
mod seeded;
mod settings;
mod snapshot;
mod state;
mod stream;
mod sync;
mod synchronizer;
mod worker;

/// Whether burn's operation fusion and autotune are compiled in (features `cuda` and `wgpu`; the
/// `-plain` features leave them out).
pub const FUSION: bool = cfg!(feature = "fusion");

pub use averager::{Averager, AveragerConfig, AveragerState, AveragerStats, Schedule};
pub use device::{DEFAULT_DEVICE_GROUP_TIMEOUT, DeviceGroup, DeviceOptimizer};
pub use error::{LossError, OptimError};
pub use flat::{ParamEntry, ParamLayout, ParamRole};
pub use muon::{AdjustLr, MuonMatrix};
pub use optim::{
    DecaySegment, Moments, OptimState, Optimizer, OptimizerConfig, OptimizerKind, clip_grad_norm,
    clip_grad_norm_per_tensor,
};
pub use outer::{OuterConfig, OuterUnit};
/// `qsr-comm`, re-exported so that a burn program needs no dependency of its own for
/// [`comm::Collective`] and the rest.
pub use qsr_comm as comm;
pub use qsr_comm::{run_workers, try_run_workers};
/// qsr-data's sampler over any burn `Dataset`, so a burn program needs no dependency of its own.
pub use qsr_data::ShardedDataset;
/// The rules an [`AveragerConfig`] takes, so a burn user needs no qsr-sched dependency to pick one.
pub use qsr_sched::SyncRule;
pub use seeded::seeded_init;
pub use settings::{Face, Refusal, SyncSettings, SyncVerdict, check_sync};
pub use snapshot::Snapshot;
pub use state::{OuterState, SyncState};
pub use stream::{InFlight, StreamState};
pub use sync::{
    BnPolicy, DriverConfig, DriverStats, Level, LocalStats, PhaseTimes, Residency, StatePolicy, StepReport, SyncBuffer,
    SyncReport, Wire,
};
pub use worker::Worker;
