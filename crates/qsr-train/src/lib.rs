//! The qsr reference trainer: `qsr plan` (the round plan of a recipe), `qsr train` (K workers as threads,
//! local processes or an external launch), `qsr compare` and `qsr plot`. This crate owns no method logic:
//! it composes qsr-sched, qsr-comm, qsr-optim, qsr-models and qsr-data.
//!
//! Every command of the `qsr` binary is one function here, taking its parsed arguments: [`run_plan`]
//! ([`PlanArgs`]), [`run_train`] ([`TrainArgs`]), [`run_compare`] ([`CompareArgs`]), [`plot()`]
//! ([`PlotArgs`]), [`run_simulate`] ([`SimulateArgs`]), [`device_check`] ([`DeviceCheckArgs`]) and
//! [`rendezvous`] ([`RendezvousArgs`], the store of `qsr train --elastic`).
//! Recipes are [`TrainRecipe`] (training) and [`load_plan`] (the `[schedule]` and `[sync]` sections
//! only); run directories hold checkpoints ([`checkpoint`]) under a [`RunLock`].

#![forbid(unsafe_code)]

// Private modules; their public items are re-exported once, below, at the crate root. Four modules have a
// `run` (the `qsr plan` / `train` / `compare` / `simulate` entry points) and two a `Row`, so those
// re-exports are renamed after their command.
mod args;
mod launch_facts;
// The one public module: its free functions (`begin`, `commit`, `latest`, `verify`, `write_file`, ...) name
// steps of the checkpoint protocol and would read ambiguously at the crate root.
pub mod checkpoint;
mod compare;
mod device_spec;
mod elastic;
mod exit;
mod fault;
mod launch;
mod plan_cmd;
mod plan_recipe;
mod plot;
mod procs;
mod run_dir;
mod run_lock;
mod simulate;
mod task;
mod train;
mod train_recipe;

pub use args::{CommKind, TrainArgs};
pub use compare::{CompareArgs, PlotArgs, Row as CompareRow, mean_ci, plot, rule_from_spec, run as run_compare, t95};
#[cfg(feature = "cuda")]
pub use device_spec::probe_cuda;
pub use device_spec::{CHECK_LENGTHS, CudaProbe, DeviceCheckArgs, DeviceSpec, check_ordinal, device_check};
pub use elastic::{RendezvousArgs, rendezvous};
pub use exit::{
    BadInput, Diverged, EXIT_PEER_FAILED, Exit, Interrupted, WorkersFailed, bad_input, exit_code, is_peer_failure,
};
pub use launch::{device, run as run_train, simulated};
pub use launch_facts::{LaunchFacts, agree};
pub use plan_cmd::{Format, PlanArgs, PlanReport, run as run_plan, write_csv};
pub use plan_recipe::{LocalSync, PlanOverrides, PlanRecipe, SyncSection, load_plan, plan_from_table, read_table};
pub use plot::{PALETTE, RunSeries, plan_png, runs_png};
pub use run_dir::{Resume, resolve};
pub use run_lock::{LOCK_FILE, RunLock};
pub use simulate::{
    Cluster, Network, Nodes, Prediction, Report, Row as SimulateRow, SimulateArgs, SyncPayload, parse_bandwidth,
    parse_duration, predict, recipe_payload, render, run as run_simulate, simulate, step_seconds_from_wall,
};
pub use train::{
    Comms, LocalLevel, MembershipChange, Outcome, Record, RunSpec, Summary, TrainModel, build_model, input_spec,
    preflight, root_cause, run_worker,
};
pub use train_recipe::{
    CheckpointConfig, DataConfig, EvalConfig, MAX_PREFETCH, TrainConfig, TrainRecipe, apply_sets, open_corpus,
    open_dataset,
};
