//! `qsr train`: resolves the recipe and the run directory, then runs the workers in one of three ways
//! that share the training code: K threads in this process (in-process collective), `--nproc N` local
//! child processes (TCP ring), or one worker of an externally launched job (torchrun-style env, mpirun,
//! srun; `--comm tcp|mpi`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use burn::tensor::Device;
use qsr_comm::{Collective, Explicit, InProcessGroup, TcpComm, TcpConfig};
use qsr_optim::DeviceGroup;

use crate::checkpoint;
use crate::device::DeviceSpec;
use crate::train::{Outcome, RunSpec, Summary, build_model, run_worker};
use crate::train_recipe::TrainRecipe;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CommKind {
    /// Our TCP ring (rendezvous at MASTER_ADDR:MASTER_PORT).
    Tcp,
    /// The system MPI (under mpirun / srun; feature `mpi`).
    Mpi,
    /// NCCL, one GPU per process, bootstrapped over the TCP rendezvous (feature `nccl`).
    Nccl,
}

impl CommKind {
    fn name(self) -> &'static str {
        match self {
            CommKind::Tcp => "tcp",
            CommKind::Mpi => "mpi",
            CommKind::Nccl => "nccl",
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct TrainArgs {
    /// TOML recipe (not needed with --resume, which uses the run's saved recipe).
    #[arg(long)]
    pub recipe: Option<PathBuf>,
    /// Override a recipe key, e.g. `--set sync.h_base=4` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Run directory (default runs/<recipe name>-<unix time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue the run in this directory from its latest checkpoint.
    #[arg(long, value_name = "RUN_DIR")]
    pub resume: Option<PathBuf>,
    /// K simulated workers in this process (overrides train.workers).
    #[arg(long, conflicts_with_all = ["nproc", "comm"])]
    pub workers: Option<usize>,
    /// Spawn N local worker processes joined by the TCP ring (or NCCL with `--comm nccl`).
    #[arg(long)]
    pub nproc: Option<usize>,
    /// Run as one worker of an externally launched job (rank/world from flags or the launcher's env);
    /// with --nproc, the collective the spawned workers use.
    #[arg(long, value_enum)]
    pub comm: Option<CommKind>,
    #[arg(long, requires = "comm")]
    pub rank: Option<usize>,
    #[arg(long, requires = "comm")]
    pub world_size: Option<usize>,
    #[arg(long, requires = "comm")]
    pub master_addr: Option<String>,
    #[arg(long, requires = "comm")]
    pub master_port: Option<u16>,
    /// Compute device: `cpu` (burn's flex backend), `cuda:N`, or `cuda` (GPU = local rank; needs a
    /// binary built with CUDA support).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Stop after the first checkpoint at or past this step (to test resumption).
    #[arg(long, hide = true)]
    pub halt_after: Option<u64>,
    /// Set by `--nproc` on the processes it spawns: the parent reports, not the children.
    #[arg(long, hide = true)]
    pub spawned: bool,
}

/// Parses and opens `--device` for a single process (local rank 0).
pub fn device(name: &str) -> Result<Device> {
    DeviceSpec::parse(name)?.open(0)
}

fn default_run_dir(name: &str) -> PathBuf {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    PathBuf::from("runs").join(format!("{name}-{secs}"))
}

/// The recipe, run directory and checkpoint a `qsr train` invocation works on.
pub fn resolve(args: &TrainArgs) -> Result<(TrainRecipe, PathBuf, Option<(PathBuf, checkpoint::CheckpointState)>)> {
    if let Some(run_dir) = &args.resume {
        let saved = run_dir.join("recipe.toml");
        let path = args.recipe.clone().unwrap_or(saved);
        let mut recipe = TrainRecipe::load(&path, &args.sets)?;
        if let Some(k) = args.workers {
            recipe.train.workers = k;
        }
        let (dir, state) = checkpoint::latest(run_dir)?;
        if recipe.resume_key()? != state.resume_key {
            bail!(
                "cannot resume {}: recipe {} differs from the checkpointed run in more than train.steps, eval and checkpoint settings",
                run_dir.display(),
                path.display()
            );
        }
        return Ok((recipe, run_dir.clone(), Some((dir, state))));
    }
    let path = args.recipe.as_ref().ok_or_else(|| anyhow!("--recipe FILE is required (or --resume RUN_DIR)"))?;
    let mut recipe = TrainRecipe::load(path, &args.sets)?;
    if let Some(k) = args.workers {
        if k == 0 {
            bail!("--workers must be at least 1");
        }
        recipe.train.workers = k;
    }
    if let Some(n) = args.nproc {
        if n == 0 {
            bail!("--nproc must be at least 1");
        }
        recipe.train.workers = n;
    }
    let run_dir = args.out.clone().unwrap_or_else(|| default_run_dir(&recipe.name));
    Ok((recipe, run_dir, None))
}

fn check_world(resume: &Option<(PathBuf, checkpoint::CheckpointState)>, world: usize) -> Result<()> {
    if let Some((dir, state)) = resume
        && state.world_size != world
    {
        bail!(
            "cannot resume from {} with {world} workers: it was written by a run of {} workers",
            dir.display(),
            state.world_size
        );
    }
    Ok(())
}

/// Runs `qsr train`; returns rank 0's summary where this process has it.
pub fn run(args: &TrainArgs) -> Result<Option<Summary>> {
    let (recipe, run_dir, resume) = resolve(args)?;
    let spec = DeviceSpec::parse(&args.device)?;
    if args.comm == Some(CommKind::Nccl) && !spec.is_gpu() {
        bail!("--comm nccl needs a GPU device (--device cuda or cuda:N), not --device {}", args.device);
    }
    if let Some(n) = args.nproc {
        if args.comm == Some(CommKind::Mpi) {
            bail!("--nproc starts its workers itself; use mpirun for --comm mpi");
        }
        if n > 1 && args.comm == Some(CommKind::Nccl) && matches!(spec, DeviceSpec::Cuda(Some(_))) {
            bail!("--nproc {n} --comm nccl needs one GPU per process: use --device cuda (GPU = local rank), not --device {}", args.device);
        }
        check_world(&resume, recipe.train.workers)?;
        prepare_run_dir(&run_dir, &recipe, resume.is_some())?;
        return spawn_processes(args, n, &run_dir, resume.is_some());
    }
    if let Some(kind) = args.comm {
        return external(args, kind, spec, recipe, run_dir, resume);
    }
    let device = spec.open(0)?;
    check_world(&resume, recipe.train.workers)?;
    prepare_run_dir(&run_dir, &recipe, resume.is_some())?;
    let spec = RunSpec { recipe, device, run_dir, resume, progress: !args.quiet, halt_after: args.halt_after };
    let outcomes = simulated(&spec)?;
    Ok(outcomes.into_iter().find_map(|o| o.summary))
}

fn prepare_run_dir(run_dir: &Path, recipe: &TrainRecipe, resuming: bool) -> Result<()> {
    std::fs::create_dir_all(run_dir).with_context(|| format!("cannot create run directory {}", run_dir.display()))?;
    if !resuming {
        checkpoint::write_atomic(&run_dir.join("recipe.toml"), recipe.to_toml()?.as_bytes())?;
    }
    Ok(())
}

/// K workers as threads of this process, joined by the in-process collective.
pub fn simulated(spec: &RunSpec) -> Result<Vec<Outcome>> {
    let k = spec.recipe.train.workers;
    let model = build_model(&spec.recipe, &spec.device)?;
    let comms = InProcessGroup::new(k);
    // Used by device-resident workers (GPU): their syncs average on the device.
    let groups = DeviceGroup::new(k);
    let results: Vec<Result<Outcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .zip(groups)
            .map(|(comm, group)| {
                // Each replica gets its own BatchNorm state (a plain clone would share it).
                let replica = model.deep_clone();
                let spec = spec.clone();
                s.spawn(move || {
                    let progress = spec.progress && comm.rank() == 0;
                    let spec = RunSpec { progress, ..spec };
                    run_worker(&spec, Box::new(comm), replica, Some(group))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a worker thread panicked"))))
            .collect()
    });
    // Report the first real error (other ranks then fail with "peer gone" errors).
    let mut outcomes = Vec::new();
    let mut errors = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(o) => outcomes.push(o),
            Err(e) => errors.push((rank, e)),
        }
    }
    if let Some((rank, e)) = errors.into_iter().min_by_key(|(_, e)| format!("{e:#}").contains("peer")) {
        return Err(e.context(format!("worker {rank} failed")));
    }
    Ok(outcomes)
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("cannot find a free loopback port")?;
    Ok(l.local_addr()?.port())
}

/// `--nproc N`: N child processes of this binary, one worker each, over the TCP ring on loopback.
fn spawn_processes(args: &TrainArgs, n: usize, run_dir: &Path, resuming: bool) -> Result<Option<Summary>> {
    let exe = std::env::current_exe().context("cannot locate the qsr executable")?;
    let port = free_port()?;
    let token = qsr_comm::tcp::random_token();
    let mut children: Vec<(usize, Child)> = Vec::new();
    for rank in 0..n {
        let mut c = Command::new(&exe);
        c.arg("train").arg("--comm").arg(args.comm.unwrap_or(CommKind::Tcp).name());
        if resuming {
            c.arg("--resume").arg(run_dir);
        } else {
            c.arg("--recipe").arg(run_dir.join("recipe.toml")).arg("--out").arg(run_dir);
        }
        c.args(["--rank", &rank.to_string(), "--world-size", &n.to_string(), "--master-addr", "127.0.0.1"]);
        c.args(["--master-port", &port.to_string(), "--device", &args.device]);
        if rank != 0 || args.quiet {
            c.arg("--quiet");
        }
        if let Some(h) = args.halt_after {
            c.args(["--halt-after", &h.to_string()]);
        }
        c.arg("--spawned");
        c.env("QSR_JOB_TOKEN", &token);
        let child = c.spawn().with_context(|| format!("cannot start worker process {rank}"))?;
        children.push((rank, child));
    }
    // Wait for all; if one fails, the others fail within the collective timeout. Stop them sooner.
    let mut failed: Option<(usize, std::process::ExitStatus)> = None;
    let mut running = children;
    while !running.is_empty() {
        let mut still = Vec::new();
        for (rank, mut child) in running {
            match child.try_wait()? {
                Some(status) if !status.success() => {
                    failed.get_or_insert((rank, status));
                }
                Some(_) => {}
                None => still.push((rank, child)),
            }
        }
        if failed.is_some() {
            for (_, c) in still.iter_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            break;
        }
        running = still;
        std::thread::sleep(Duration::from_millis(50));
    }
    if let Some((rank, status)) = failed {
        bail!("worker process {rank} failed ({status})");
    }
    let summary = std::fs::read(run_dir.join("summary.json")).ok().and_then(|b| serde_json::from_slice(&b).ok());
    Ok(summary)
}

/// One worker of a job launched by someone else (our `--nproc`, torchrun, mpirun, srun).
fn external(
    args: &TrainArgs,
    kind: CommKind,
    spec: DeviceSpec,
    mut recipe: TrainRecipe,
    run_dir: PathBuf,
    resume: Option<(PathBuf, checkpoint::CheckpointState)>,
) -> Result<Option<Summary>> {
    let explicit = Explicit {
        rank: args.rank,
        world_size: args.world_size,
        local_rank: None,
        master_addr: args.master_addr.clone(),
        master_port: args.master_port,
    };
    let tcp = || -> Result<(TcpComm, usize)> {
        let env = qsr_comm::launch::detect_from_process_env(&explicit)?;
        let cfg = TcpConfig::from_env(&|k| std::env::var(k).ok())?;
        Ok((TcpComm::from_launch(&env, cfg)?, env.local_rank))
    };
    let (comm, local_rank): (Box<dyn Collective>, usize) = match kind {
        CommKind::Tcp => {
            let (c, local) = tcp()?;
            (Box::new(c), local)
        }
        CommKind::Mpi => {
            // The launcher's local rank (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID) picks the GPU.
            let local = qsr_comm::launch::detect_from_process_env(&explicit).map_or(0, |e| e.local_rank);
            (mpi_comm()?, local)
        }
        CommKind::Nccl => {
            let (mut bootstrap, local) = tcp()?;
            let ordinal = spec.ordinal(local).unwrap_or(local);
            (nccl_comm(&mut bootstrap, ordinal)?, local)
        }
    };
    let device = spec.open(local_rank)?;
    let world = comm.world_size();
    recipe.train.workers = world;
    check_world(&resume, world)?;
    if comm.rank() == 0 {
        prepare_run_dir(&run_dir, &recipe, resume.is_some())?;
    }
    let model = build_model(&recipe, &device)?;
    let spec = RunSpec { recipe, device, run_dir, resume, progress: !args.quiet && comm.rank() == 0, halt_after: args.halt_after };
    let outcome = run_worker(&spec, comm, model, None)?;
    Ok(if args.spawned { None } else { outcome.summary })
}

#[cfg(feature = "nccl")]
fn nccl_comm(bootstrap: &mut TcpComm, ordinal: usize) -> Result<Box<dyn Collective>> {
    Ok(Box::new(qsr_comm::nccl::NcclComm::init(bootstrap, ordinal)?))
}

#[cfg(not(feature = "nccl"))]
fn nccl_comm(_bootstrap: &mut TcpComm, _ordinal: usize) -> Result<Box<dyn Collective>> {
    bail!("--comm nccl: this qsr binary was built without NCCL support (build it with `cargo xtask cuda`)")
}

#[cfg(feature = "mpi")]
fn mpi_comm() -> Result<Box<dyn Collective>> {
    Ok(Box::new(qsr_comm::MpiComm::init()?))
}

#[cfg(not(feature = "mpi"))]
fn mpi_comm() -> Result<Box<dyn Collective>> {
    bail!("--comm mpi: this qsr binary was built without MPI support (rebuild with `--features mpi`)")
}
