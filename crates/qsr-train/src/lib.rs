//! The qsr reference trainer: `qsr plan` (the round plan of a recipe), `qsr train` (K workers as threads,
//! local processes or an external launch), `qsr compare` and `qsr plot`. This crate owns no method logic:
//! it composes qsr-sched, qsr-comm, qsr-optim, qsr-models and qsr-data.

#![forbid(unsafe_code)]

pub mod agree;
pub mod checkpoint;
pub mod compare;
pub mod device;
pub mod launch;
pub mod plan_cmd;
pub mod plot;
mod procs;
pub mod recipe;
pub mod run_lock;
pub mod simulate;
pub mod train;
pub mod train_recipe;
