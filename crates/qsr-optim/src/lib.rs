//! Local SGD / Local AdamW: optimizers with PyTorch's exact update rules over per-worker state we own,
//! flat parameter buffers for burn modules, and the round driver that synchronizes at the steps
//! `qsr-sched` plans.

pub mod device;
pub mod driver;
mod error;
pub mod flat;
pub mod optim;

pub use error::OptimError;
pub use flat::{ParamEntry, ParamLayout, ParamRole};
pub use optim::{OptimState, Optimizer, OptimizerConfig, OptimizerKind, clip_grad_norm};
pub use device::{DeviceGroup, DeviceOptimizer};
pub use driver::{BnPolicy, DriverConfig, DriverStats, Residency, StatePolicy, StepReport, SyncReport, Worker};
