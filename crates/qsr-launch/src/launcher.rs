//! `qsr launch`: N ranks of any program, with the environment torchrun gives (documented on
//! [`LaunchArgs`]).

use std::ffi::OsString;
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::Args;

use crate::error::bad_input;
use crate::relay::Relay;
use crate::supervise;

/// `qsr launch --nproc N -- PROGRAM [ARGS...]`: starts N processes of PROGRAM on this host as the ranks
/// of one job, with torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
/// `GROUP_RANK`, `MASTER_ADDR`, `MASTER_PORT`) and a fresh `QSR_JOB_TOKEN`, so that
/// `qsr_comm::from_env()` in PROGRAM joins them. Each rank's intra-op threads are this host's cores
/// shared out (`RAYON_NUM_THREADS`, unless set).
///
/// Over several hosts, as torchrun: every host runs `qsr launch --nnodes M --node-rank R --nproc N
/// --master-addr HOST0 [--master-port P] -- PROGRAM`, host R starting ranks `R*N .. (R+1)*N` of
/// `M*N`; rank 0 (on host 0, at `HOST0`, which every host must reach) holds the rendezvous on
/// port P (default 29500). Every host must export the same `QSR_JOB_TOKEN`, the job's secret, and
/// the ranks' ring listeners bind `0.0.0.0` (unless `QSR_BIND_ADDR` says otherwise).
///
/// Each rank runs in a session and process group of its own (stdin closed) and dies with the launcher
/// (even by SIGKILL; what the rank itself started then lives on). SIGINT,
/// SIGTERM and SIGHUP are forwarded to every rank; when one rank fails, the others are stopped, with
/// whatever they started, and the rank that failed first is named. A rank that exits with
/// `qsr_comm::EXIT_PEER_FAILED` (3) says it only lost a peer, and is not blamed while another cause
/// exists (a program ends `main` with `qsr_comm::exit_code` to say so). The launcher exits 0 when
/// every rank did, else with the status of the rank that failed first (3 for one killed by a
/// signal), or 128 + N when it was interrupted by signal N. On a job over several hosts each
/// launcher stops its own ranks; the others' ranks learn of it from their collectives.
///
/// Every line a rank writes is shown prefixed with its rank (`[rank 1] ...`), on the launcher's
/// stdout or stderr as the rank wrote it; `--log-dir DIR` also keeps each rank's output as written,
/// in `DIR/rank-R.stdout.log` and `DIR/rank-R.stderr.log`.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Number of ranks to start (on this host).
    #[arg(long)]
    pub nproc: usize,
    /// Hosts of the job, each running its own `qsr launch` with the same flags but `--node-rank`.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This host's index in `0..nnodes`: it starts ranks `node_rank * nproc ..`.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Host 0's address, reachable from every host (default 127.0.0.1; required with `--nnodes` above 1).
    #[arg(long)]
    pub master_addr: Option<String>,
    /// Port of rank 0's rendezvous (default: a port free when the launcher looked, or 29500 over
    /// several hosts, where every host must know it).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Restarting failed ranks: refused above 0 (a rank's state is its program's: restart from its checkpoint).
    #[arg(long, default_value_t = 0)]
    pub max_restarts: u32,
    /// Also write each rank's output, unprefixed, to `rank-R.stdout.log` / `rank-R.stderr.log` in
    /// this directory (created if missing; files of an earlier launch are replaced).
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<std::path::PathBuf>,
    /// The program and its arguments, after `--`.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "PROGRAM")]
    pub command: Vec<OsString>,
}

/// The most processes `--nproc` starts on this host (`qsr train`, `qsr launch`): more than a host
/// runs as ranks, and far fewer than would exhaust its process table (issue 43, N6).
pub const MAX_NPROC: usize = 1024;

/// Refuses an `--nproc` of 0 or over [`MAX_NPROC`] as bad input, before anything starts.
pub fn check_nproc(n: usize) -> Result<()> {
    if !(1..=MAX_NPROC).contains(&n) {
        return Err(bad_input(anyhow::anyhow!(
            "--nproc {n}: must be in 1..={MAX_NPROC} processes on this host (a job of more ranks spans \
             hosts: start each host's ranks with its own launcher)"
        )));
    }
    Ok(())
}

/// The intra-op threads of each of `ranks` processes (or threads) sharing this process's: its
/// rayon pool (`RAYON_NUM_THREADS`, else a thread per core) divided among them, at least one.
pub fn threads_per_rank(ranks: usize) -> usize {
    (rayon::current_num_threads() / ranks.max(1)).max(1)
}

/// torchrun's port, the default rendezvous port of a job over several hosts.
const MULTI_NODE_PORT: u16 = 29500;

/// Where the job's rendezvous is, its secret, and this host's ranks.
struct Job {
    addr: String,
    port: u16,
    token: String,
    world: usize,
    ranks: std::ops::Range<usize>,
}

/// The job `args` describe, refusing what cannot work, named by its flag.
fn job(args: &LaunchArgs, env: &dyn Fn(&str) -> Option<String>) -> Result<Job> {
    check_nproc(args.nproc)?;
    if args.max_restarts > 0 {
        bail!(
            "--max-restarts {}: qsr launch restarts no ranks: a program's ranks hold state (model, optimizer, data order) that only the program can restore, so restart the job from its own checkpoint; `qsr train --elastic` replaces lost workers itself",
            args.max_restarts
        );
    }
    if args.nnodes == 0 {
        bail!("--nnodes 0: a job needs at least one host");
    }
    if args.node_rank >= args.nnodes {
        bail!("--node-rank {}: must be in 0..--nnodes {}", args.node_rank, args.nnodes);
    }
    let world = args.nnodes.checked_mul(args.nproc).filter(|w| *w <= 1 << 16);
    let world =
        world.ok_or_else(|| anyhow::anyhow!("--nnodes {} x --nproc {}: too many ranks", args.nnodes, args.nproc))?;
    let first = args.node_rank * args.nproc;
    let ranks = first..first + args.nproc;
    if args.nnodes == 1 {
        let port = match args.master_port {
            Some(p) => p,
            None => free_port()?,
        };
        let addr = args.master_addr.clone().unwrap_or_else(|| "127.0.0.1".into());
        return Ok(Job { addr, port, token: qsr_comm::random_token(), world, ranks });
    }
    let Some(addr) = args.master_addr.clone() else {
        bail!("--nnodes {}: give --master-addr, host 0's address that every host reaches", args.nnodes);
    };
    let Some(token) = env("QSR_JOB_TOKEN").filter(|t| !t.is_empty()) else {
        bail!(
            "--nnodes {}: export the same QSR_JOB_TOKEN on every host (e.g. `openssl rand -hex 16` on one, copied to the others), so that only this job's ranks can join its ports",
            args.nnodes
        );
    };
    Ok(Job { addr, port: args.master_port.unwrap_or(MULTI_NODE_PORT), token, world, ranks })
}

/// Runs `qsr launch`.
pub fn launch(args: &LaunchArgs) -> Result<()> {
    let env = |k: &str| std::env::var(k).ok();
    let job = job(args, &env).map_err(bad_input)?;
    let shim = std::env::current_exe().context("cannot locate the qsr executable")?;
    let threads = env("RAYON_NUM_THREADS").is_none().then(|| threads_per_rank(args.nproc));
    // Over several hosts the ring listeners must be reachable from the others.
    let bind_any = args.nnodes > 1 && env("QSR_BIND_ADDR").is_none();
    let relay = Relay::new(args.log_dir.as_deref()).map_err(bad_input)?;
    let first = job.ranks.start;
    supervise::launch_program(
        job.ranks.clone(),
        |rank| {
            let mut c = Command::new(&shim);
            c.arg("exec-rank").arg("--").args(&args.command);
            c.env("RANK", rank.to_string())
                .env("LOCAL_RANK", (rank - first).to_string())
                .env("GROUP_RANK", args.node_rank.to_string())
                .env("WORLD_SIZE", job.world.to_string())
                .env("LOCAL_WORLD_SIZE", args.nproc.to_string())
                .env("MASTER_ADDR", &job.addr)
                .env("MASTER_PORT", job.port.to_string())
                .env("QSR_JOB_TOKEN", &job.token);
            if bind_any {
                c.env("QSR_BIND_ADDR", "0.0.0.0");
            }
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
pub struct ExecRankArgs {
    /// The program and its arguments, after `--`.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "PROGRAM")]
    pub command: Vec<OsString>,
}

/// Runs `qsr exec-rank`: returns only when PROGRAM could not be started.
pub fn exec_rank(args: &ExecRankArgs) -> Result<()> {
    use std::os::unix::process::CommandExt;
    supervise::die_with_launcher()?;
    // A session of its own: a process group the launcher stops whole, and no controlling terminal
    // whose job control could stop a rank that reads it or sets its modes.
    rustix::process::setsid().context("cannot start a session for this rank")?;
    let Some((program, rest)) = args.command.split_first() else {
        bail!("exec-rank needs a program");
    };
    let error = Command::new(program).args(rest).exec();
    Err(bad_input(anyhow::Error::new(error).context(format!("cannot run {}", program.to_string_lossy()))))
}
