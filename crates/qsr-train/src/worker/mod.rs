//! The training loop: one worker from its model replica and collectives to the end of the plan. The
//! same code runs under every topology (threads, processes, an external launch, an elastic member).
//!
//! Layers, top down: `run` (the loop) → `segment` (records, evaluations, checkpoints around the
//! steps) → `outcome` (a run that did not train, an average that lost) → `task` (images or text: data,
//! steps, evaluation) and `model` (building the network) → `spec` (what a worker is given and returns).

pub(crate) mod interrupt;
mod model;
mod outcome;
mod pool;
mod run;
pub(crate) mod segment;
mod spec;
pub(crate) mod task;

pub(crate) use model::{TrainModel, build_model, preflight};
pub(crate) use pool::{in_pool, intra_op_threads};
pub(crate) use run::{resume, run_worker, set_up_syncs};
pub(crate) use spec::{Comms, RunSpec};
