//! `qsr train --nproc N`: the trainer's worker processes, supervised by qsr-launch (which owns them:
//! they die with the launcher, signals are forwarded, the rank that failed first is named).

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};
use qsr_launch::Job;

use crate::args::{CommKind, TrainArgs};
use crate::exit::Exit;
use crate::records::Summary;
use crate::worker::intra_op_threads;

/// Where rank 0 of a `--nproc` launch writes its rendezvous port, in the run directory (removed once
/// read).
pub(super) const PORT_FILE: &str = ".rendezvous-port";

/// Starts `n` workers (`command(rank, port)`), waits for them, and returns rank 0's summary. Without
/// a `store`, rank 0 starts first and chooses the rendezvous port (written to [`PORT_FILE`]); the
/// others start with it (`port` is `None` for rank 0 and in elastic jobs). With an elastic `store`, a
/// failed worker does not stop the others: the run succeeds when the store says every worker of its
/// last generation finished.
pub(super) fn launch(
    n: usize,
    command: impl Fn(usize, Option<u16>) -> Result<Command>,
    run_dir: &Path,
    store: Option<&qsr_elastic::Store>,
) -> Result<Option<Summary>> {
    let port_file = (store.is_none() && n > 1).then(|| run_dir.join(PORT_FILE));
    // A finished elastic job whose workers diverged or did not train: the job's outcome is theirs.
    let outcomes = [(Exit::Diverged as u8, "diverged"), (Exit::NotTrained as u8, "did not train")];
    let result =
        qsr_launch::run_workers(n, command, Job { store, port_file: port_file.as_deref(), outcomes: &outcomes });
    if result.is_err() {
        // Every worker has stopped: a checkpoint one left unfinished (interrupted mid-commit, a full
        // disk) is garbage, and the next run in this directory would sweep it anyway (N5).
        let _ = crate::checkpoint::sweep(run_dir);
    }
    result?;
    let summary = crate::files::read_regular(&run_dir.join("summary.json"), crate::files::SUMMARY_BYTES, "run summary")
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    Ok(summary)
}

/// The command line of each `--nproc` worker: the run's saved (resolved) recipe, so that every
/// launch mode applies the same overrides.
pub(super) struct ChildArgs<'a> {
    pub(super) comm: CommKind,
    pub(super) run_dir: &'a Path,
    pub(super) resuming: bool,
    /// The elastic store's address (`--elastic`).
    pub(super) store: Option<String>,
    pub(super) args: &'a TrainArgs,
}

impl ChildArgs<'_> {
    /// Worker `rank`'s command; `port` is rank 0's rendezvous port, `None` for rank 0 itself (which
    /// chooses it and writes it to [`PORT_FILE`]).
    pub(super) fn command(&self, rank: usize, n: usize, port: Option<u16>, token: &str) -> Result<Command> {
        let exe = std::env::current_exe().context("cannot locate the qsr executable")?;
        let mut c = Command::new(exe);
        c.arg("train").arg("--comm").arg(self.comm.name());
        c.arg("--recipe").arg(self.run_dir.join("recipe.toml")).arg("--out").arg(self.run_dir);
        if self.resuming {
            c.arg("--resume").arg(self.run_dir);
        }
        if let Some(store) = &self.store {
            c.args(["--elastic", "--rendezvous", store, "--rank", &rank.to_string()]);
        } else {
            c.args(["--rank", &rank.to_string(), "--world-size", &n.to_string(), "--master-addr", "127.0.0.1"]);
            match port {
                Some(port) => {
                    c.args(["--master-port", &port.to_string()]);
                }
                None if n > 1 => {
                    c.arg("--port-file").arg(self.run_dir.join(PORT_FILE));
                    // The launcher's own MASTER_PORT, if any, is not this job's.
                    c.env_remove("MASTER_PORT");
                }
                None => {}
            }
        }
        c.args(["--device", &self.args.device]);
        if rank != 0 || self.args.quiet {
            c.arg("--quiet");
        }
        if let Some(h) = self.args.halt_after {
            c.args(["--halt-after", &h.to_string()]);
        }
        c.arg("--spawned");
        c.env("QSR_JOB_TOKEN", token);
        // The launcher's threads shared between its N workers, as for N threads of one process: each
        // child sizes its compute pool from its own global pool (`worker::intra_op_threads`).
        c.env("RAYON_NUM_THREADS", intra_op_threads(n).to_string());
        Ok(c)
    }
}
