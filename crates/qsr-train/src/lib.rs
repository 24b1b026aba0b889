//! The qsr reference trainer: `qsr plan` (the round plan of a recipe), `qsr train` (K workers as threads,
//! local processes or an external launch), `qsr compare`, `qsr plot`, `qsr simulate`,
//! `qsr device-check` and `qsr rendezvous`. This crate owns no method logic: it composes qsr-sched,
//! qsr-comm, qsr-elastic, qsr-optim, qsr-models and qsr-data.
//!
//! Every command of the `qsr` binary is one function here, taking its parsed arguments: [`run_plan`]
//! ([`PlanArgs`]), [`run_train`] ([`TrainArgs`], returning rank 0's [`Summary`]), [`run_compare`]
//! ([`CompareArgs`]), [`plot()`] ([`PlotArgs`]), [`run_simulate`] ([`SimulateArgs`]), [`device_check`]
//! ([`DeviceCheckArgs`]), [`rendezvous`] ([`RendezvousArgs`], the store of `qsr train --elastic`) and
//! [`launch`] ([`LaunchArgs`]: N ranks of any program, torchrun's face; each rank through [`exec_rank`]).
//! An error's exit status is [`exit_code`] ([`Exit`]). Recipes are in [`recipe`], the files of a
//! run directory's checkpoints in [`checkpoint`].
//!
//! `qsr train` is a pipeline, each stage a module that calls only the stages below it: the arguments
//! (`args`) → the resolved recipe and run directory (`recipe`, `run_dir`, `run_lock`) → the topology
//! (`topology`: threads, `--nproc` processes, an external launch, an elastic member) → the training
//! loop (`worker`) → records and checkpoints (`records`, `checkpoint`). Failure handling is `exit`
//! (statuses, root cause) and `fault` (fault injection for tests).

#![forbid(unsafe_code)]

// Private modules; their public items are re-exported once, below, at the crate root. Four modules have a
// `run` (the `qsr plan` / `train` / `compare` / `simulate` entry points), so those re-exports are renamed
// after their command.
mod args;
// Public for the reading side of a run's checkpoints; the writing protocol is crate-private.
pub mod checkpoint;
mod compare;
mod device_spec;
mod exit;
mod fault;
mod files;
mod launch_facts;
mod plan_cmd;
mod plot;
pub mod recipe;
mod records;
mod rendezvous;
mod run_dir;
mod run_lock;
mod simulate;
mod time_step;
mod topology;
mod worker;

pub use args::TrainArgs;
pub use compare::{CompareArgs, Row as CompareRow, run as run_compare};
pub use device_spec::{DeviceCheckArgs, device_check};
pub use exit::{Exit, exit_code};
pub use plan_cmd::{PlanArgs, run as run_plan};
pub use plot::{PlotArgs, plot};
pub use records::{LocalLevel, MembershipChange, Summary};
pub use rendezvous::{RendezvousArgs, rendezvous};
pub use simulate::{SimulateArgs, run as run_simulate};
pub use time_step::{StepModel, StepTiming, TimeStepArgs, time_step};
pub use topology::{ExecRankArgs, LaunchArgs, exec_rank, launch, run as run_train};
