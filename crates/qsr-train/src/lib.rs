//! The qsr reference trainer: `qsr plan` (the round plan of a recipe), `qsr train` (K workers as threads,
//! local processes or an external launch), `qsr compare`, `qsr plot`, `qsr simulate`,
//! `qsr device-check` and `qsr rendezvous`. This crate owns no method logic: it composes qsr-sched,
//! qsr-comm, qsr-elastic, qsr-optim, qsr-models and qsr-data.
//!
//! Its public face is small: the `qsr` binary's [`Cli`] and [`run`] (every command is a crate-private
//! function taking its parsed arguments: `run_plan`, `run_train`, `run_compare`, `plot`,
//! `run_simulate`, `device_check`, `time_step`, `rendezvous`, `launch` and `exec_rank`; an error's
//! exit status is `exit_code`), and [`recipe`] for programs that read recipes ([`recipe::TrainRecipe`],
//! [`recipe::load_plan`]).
//!
//! `qsr train` is a pipeline, each stage a module that calls only the stages below it: the arguments
//! (`args`) → the resolved recipe and run directory (`recipe`, `run_dir`, `run_lock`) → the topology
//! (`topology`: threads, `--nproc` processes, an external launch, an elastic member) → the training
//! loop (`worker`) → records and checkpoints (`records`, `checkpoint`). Failure handling is `exit`
//! (statuses, root cause) and `fault` (fault injection for tests).

// Tests write their fixtures with std; the code under test opens paths through qsr-files.
#![cfg_attr(test, allow(clippy::disallowed_methods))]
#![forbid(unsafe_code)]

// Private modules; their public items are re-exported once, below, at the crate root. Four modules have a
// `run` (the `qsr plan` / `train` / `compare` / `simulate` entry points), so those re-exports are renamed
// after their command.
mod args;
mod checkpoint;
mod cli;
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
mod rendezvous_cmd;
mod run_dir;
mod run_lock;
mod simulate;
mod time_step;
mod topology;
mod worker;

pub use cli::{Cli, run};

pub(crate) use args::TrainArgs;
pub(crate) use compare::{CompareArgs, run as run_compare};
pub(crate) use device_spec::{DeviceCheckArgs, device_check};
pub(crate) use exit::{Exit, exit_code};
pub(crate) use plan_cmd::{PlanArgs, run as run_plan};
pub(crate) use plot::{PlotArgs, plot};
pub(crate) use rendezvous_cmd::{RendezvousArgs, rendezvous};
pub(crate) use simulate::{SimulateArgs, run as run_simulate};
pub(crate) use time_step::{TimeStepArgs, time_step};
pub(crate) use topology::{ExecRankArgs, LaunchArgs, exec_rank, launch, run as run_train};
