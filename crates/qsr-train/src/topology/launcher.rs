//! `qsr launch`: N ranks of any program, with the environment torchrun gives (documented on
//! [`LaunchArgs`]).

use std::ffi::OsString;
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::Args;

use super::processes;
use super::relay::Relay;
use crate::exit::bad_input;
use crate::worker::intra_op_threads;

/// `qsr launch --nproc N -- PROGRAM [ARGS...]`: starts N processes of PROGRAM on this host as the ranks
/// of one job, with torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
/// `MASTER_ADDR`, `MASTER_PORT`) and a fresh `QSR_JOB_TOKEN`, so that `qsr_comm::from_env()` in
/// PROGRAM joins them. Each rank's intra-op threads are this host's cores shared out
/// (`RAYON_NUM_THREADS`, unless set).
///
/// Each rank runs in a session and process group of its own (stdin closed) and dies with the launcher
/// (even by SIGKILL; what the rank itself started then lives on). SIGINT,
/// SIGTERM and SIGHUP are forwarded to every rank; when one rank fails, the others are stopped, with
/// whatever they started, and the rank that failed first is named. A rank that exits with
/// `qsr_comm::EXIT_PEER_FAILED` (3) says it only lost a peer, and is not blamed while another cause
/// exists (a program ends `main` with `qsr_comm::exit_code` to say so). The launcher exits 0 when
/// every rank did, else with the status of the rank that failed first (3 for one killed by a
/// signal), or 128 + N when it was interrupted by signal N.
///
/// Every line a rank writes is shown prefixed with its rank (`[rank 1] ...`), on the launcher's
/// stdout or stderr as the rank wrote it; `--log-dir DIR` also keeps each rank's output as written,
/// in `DIR/rank-R.stdout.log` and `DIR/rank-R.stderr.log`.
#[derive(Debug, Args)]
pub(crate) struct LaunchArgs {
    /// Number of ranks to start.
    #[arg(long)]
    pub nproc: usize,
    /// Port of rank 0's rendezvous (default: a port free when the launcher looked).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Also write each rank's output, unprefixed, to `rank-R.stdout.log` / `rank-R.stderr.log` in
    /// this directory (created if missing; files of an earlier launch are replaced).
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<std::path::PathBuf>,
    /// The program and its arguments, after `--`.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "PROGRAM")]
    pub command: Vec<OsString>,
}

/// Runs `qsr launch`.
pub(crate) fn launch(args: &LaunchArgs) -> Result<()> {
    crate::args::check_nproc(args.nproc)?;
    let port = match args.master_port {
        Some(p) => p,
        None => free_port()?,
    };
    let token = qsr_comm::random_token();
    let shim = std::env::current_exe().context("cannot locate the qsr executable")?;
    let threads = std::env::var_os("RAYON_NUM_THREADS").is_none().then(|| intra_op_threads(args.nproc));
    let n = args.nproc;
    let relay = Relay::new(args.log_dir.as_deref()).map_err(bad_input)?;
    processes::launch_program(
        n,
        |rank| {
            let mut c = Command::new(&shim);
            c.arg("exec-rank").arg("--").args(&args.command);
            c.env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("QSR_JOB_TOKEN", &token);
            if let Some(t) = threads {
                c.env("RAYON_NUM_THREADS", t.to_string());
            }
            Ok(c)
        },
        &relay,
    )
}

/// A port nobody listened on a moment ago (rank 0 binds it; torchrun picks its port the same way).
fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("cannot find a free port for MASTER_PORT")?;
    Ok(listener.local_addr()?.port())
}

/// `qsr exec-rank -- PROGRAM [ARGS...]`, what `qsr launch` runs as each rank: asks to die with the
/// launcher, starts a session of its own, then becomes PROGRAM (same process, so both hold for it).
#[derive(Debug, Args)]
pub(crate) struct ExecRankArgs {
    /// The program and its arguments, after `--`.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "PROGRAM")]
    pub command: Vec<OsString>,
}

/// Runs `qsr exec-rank`: returns only when PROGRAM could not be started.
pub(crate) fn exec_rank(args: &ExecRankArgs) -> Result<()> {
    use std::os::unix::process::CommandExt;
    processes::die_with_launcher()?;
    // A session of its own: a process group the launcher stops whole, and no controlling terminal
    // whose job control could stop a rank that reads it or sets its modes.
    rustix::process::setsid().context("cannot start a session for this rank")?;
    let Some((program, rest)) = args.command.split_first() else {
        bail!("exec-rank needs a program");
    };
    let error = Command::new(program).args(rest).exec();
    Err(bad_input(anyhow::Error::new(error).context(format!("cannot run {}", program.to_string_lossy()))))
}
