//! The arguments of `qsr train` (documented on [`TrainArgs`]).

use std::path::PathBuf;

/// The collective of an external or `--nproc` launch (`--comm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum CommKind {
    /// Our collectives: rendezvous and the TCP ring at MASTER_ADDR:MASTER_PORT, then shared memory
    /// when every rank runs on one host (`QSR_TRANSPORT=tcp` keeps the ring, see `qsr_comm::Transport`).
    Tcp,
    /// The system MPI (under mpirun / srun; feature `mpi`).
    Mpi,
    /// NCCL, one GPU per process, bootstrapped over the TCP rendezvous (feature `nccl`).
    Nccl,
}

impl CommKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            CommKind::Tcp => "tcp",
            CommKind::Mpi => "mpi",
            CommKind::Nccl => "nccl",
        }
    }
}

/// Arguments of `qsr train`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct TrainArgs {
    /// TOML recipe (not needed with --resume, which uses the run's saved recipe).
    #[arg(long)]
    pub recipe: Option<PathBuf>,
    /// Override a recipe key, e.g. `--set sync.h_base=4` (repeatable); `--set KEY=` drops it.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Run directory (default `runs/<recipe name>-<unix time>`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue the run in this directory from its latest checkpoint.
    #[arg(long, value_name = "RUN_DIR")]
    pub resume: Option<PathBuf>,
    /// K simulated workers in this process (overrides train.workers).
    #[arg(long, conflicts_with_all = ["nproc", "comm"])]
    pub workers: Option<usize>,
    /// Spawn N local worker processes joined by shared memory (or NCCL with `--comm nccl`).
    #[arg(long)]
    pub nproc: Option<usize>,
    /// Run as one worker of an externally launched job (rank/world from flags or the launcher's env);
    /// with --nproc, the collective the spawned workers use.
    #[arg(long, value_enum)]
    pub comm: Option<CommKind>,
    /// This worker's rank (overrides the launcher's env, e.g. RANK).
    #[arg(long, requires = "comm")]
    pub rank: Option<usize>,
    /// Number of workers in the job (overrides the launcher's env, e.g. WORLD_SIZE).
    #[arg(long, requires = "comm")]
    pub world_size: Option<usize>,
    /// Rendezvous address of rank 0 (overrides MASTER_ADDR; default 127.0.0.1).
    #[arg(long, requires = "comm")]
    pub master_addr: Option<String>,
    /// Rendezvous port of rank 0 (overrides MASTER_PORT; default 29500).
    #[arg(long, requires = "comm")]
    pub master_port: Option<u16>,
    /// Compute device: `cpu` (burn's flex backend), `cuda:N`, or `cuda` (GPU = local rank; needs a
    /// binary built with CUDA support).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Elastic mode: a lost or stalled worker costs the round in flight, not the run (the survivors
    /// go on from the last completed sync), and restarted or new workers join at a sync. With
    /// --nproc the launcher serves the store; otherwise give --rendezvous (`qsr rendezvous`).
    #[arg(long, conflicts_with = "workers")]
    pub elastic: bool,
    /// The elastic job's store, `host:port` of `qsr rendezvous` (with --comm tcp --elastic).
    #[arg(long, requires = "elastic", value_name = "HOST:PORT")]
    pub rendezvous: Option<String>,
    /// Stop after the first checkpoint at or past this step (to test resumption).
    #[arg(long, hide = true)]
    pub halt_after: Option<u64>,
    /// Set by `--nproc` on the processes it spawns: the parent reports, not the children.
    #[arg(long, hide = true)]
    pub spawned: bool,
    /// Set by `--nproc` on its rank 0: bind the rendezvous port on the master address, write its
    /// number to this file, and let the launcher start the other ranks with it.
    #[arg(long, hide = true, requires = "spawned", value_name = "FILE")]
    pub port_file: Option<std::path::PathBuf>,
}

pub(crate) use qsr_launch::check_nproc;
