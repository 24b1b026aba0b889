//! Local SGD / Local AdamW: optimizers with PyTorch's exact update rules over per-worker state we own,
//! flat parameter buffers for burn modules, and the round driver that synchronizes at the steps
//! `qsr-sched` plans.
//!
//! Two ways in:
//! - [`Averager`]: keep your own burn optimizer, lr scheduler and loop; call [`Averager::step`] after each
//!   optimizer step with the lr it used, and the model is averaged over the workers whenever a round of
//!   the sync rule (QSR among them) ends; [`Averager::average_grads`] before the optimizer step serves
//!   the rules that average gradients (data parallel, post-local).
//! - [`Worker`]: our PyTorch-exact SGD / AdamW over flat state, driven step by step from a `qsr-sched`
//!   plan, with gradient accumulation, data-parallel rounds and optimizer-state averaging.

mod averager;
mod device;
mod error;
mod flat;
mod flat_state;
mod lr_watch;
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

pub use averager::{Averager, AveragerConfig, AveragerState, AveragerStats};
pub use device::{DEFAULT_DEVICE_GROUP_TIMEOUT, DeviceGroup, DeviceOptimizer};
pub use error::{LossError, OptimError};
pub use flat::{ParamEntry, ParamLayout, ParamRole};
pub use optim::{
    DecaySegment, Moments, OptimState, Optimizer, OptimizerConfig, OptimizerKind, clip_grad_norm,
    clip_grad_norm_per_tensor,
};
pub use outer::{OuterConfig, OuterUnit};
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
