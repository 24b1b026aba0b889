//! The launcher of qsr jobs, without burn: `qsr-launch --nproc N -- PROGRAM` (and the trainer's
//! `qsr launch`, the same code) starts N ranks of any program with torchrun's environment, so that
//! `qsr_comm::from_env()` in it joins them; over several hosts each runs its own launcher
//! (`--nnodes`, `--node-rank`, `--master-addr`). It forwards signals, stops every rank when one
//! fails and names the rank that failed first (a rank's failure record, `qsr_comm::FailureRecord`,
//! names the peer it lost, on this host or another), prefixes each rank's output lines and keeps
//! them in `--log-dir`. The trainer's `qsr train --nproc` supervises its workers with
//! [`run_workers`].
//!
//! ```sh
//! cargo install --path crates/qsr-launch      # about a minute from an empty target dir
//! qsr-launch --nproc 4 -- ./target/release/examples/burn_qsr
//! ```

// Tests write their fixtures with std; the code under test opens paths through qsr-files.
#![cfg_attr(test, allow(clippy::disallowed_methods))]

mod adopted;
mod error;
mod launcher;
mod relay;
mod supervise;

pub use error::{BadInput, Interrupted, WorkersFailed, bad_input, exit_status, signal_name};
pub use launcher::{ExecRankArgs, LaunchArgs, MAX_NPROC, check_nproc, exec_rank, launch, threads_per_rank};
pub use supervise::{Job, die_with_launcher, run_workers};
