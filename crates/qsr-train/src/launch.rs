//! `qsr train` (documented on [`run`]).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use burn::tensor::Device;
use qsr_comm::{Collective, Explicit, InProcessGroup, TcpComm, TcpConfig};
use qsr_optim::DeviceGroup;

use crate::args::{CommKind, TrainArgs};
use crate::device_spec::DeviceSpec;
use crate::exit::bad_input;
use crate::launch_facts::{LaunchFacts, agree};
use crate::procs;
use crate::run_dir::{Resume, prepare_run_dir, resolve};
use crate::run_lock::RunLock;
use crate::train::{Comms, Outcome, RunSpec, Summary, build_model, preflight, root_cause, run_worker};
use crate::train_recipe::TrainRecipe;

/// Parses and opens `--device` for a single process (local rank 0).
pub fn device(name: &str) -> Result<Device> {
    DeviceSpec::parse(name)?.open(0)
}

fn check_world(resume: &Resume, world: usize) -> Result<()> {
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
///
/// It resolves the recipe and the run directory, then runs the workers in one of three ways
/// that share the training code: K threads in this process (in-process collective), `--nproc N` local
/// child processes (TCP ring), or one worker of an externally launched job (torchrun-style env, mpirun,
/// srun; `--comm tcp|mpi`).
pub fn run(args: &TrainArgs) -> Result<Option<Summary>> {
    if args.spawned {
        // Before anything else: a worker must not outlive the `--nproc` launcher that started it.
        procs::die_with_launcher()?;
    }
    crate::fault::check().map_err(bad_input)?;
    let (recipe, run_dir, resume) = resolve(args).map_err(bad_input)?;
    let spec = DeviceSpec::parse(&args.device).map_err(bad_input)?;
    check_flags(args, &recipe, &spec, &|k| std::env::var(k).ok()).map_err(bad_input)?;
    if args.nproc.is_some() || args.comm.is_some() || args.elastic {
        // The launch's settings, refused before anything starts (a `--nproc` launcher's workers read them too).
        TcpConfig::from_env(&|k| std::env::var(k).ok())?;
        qsr_comm::Transport::from_env(&|k| std::env::var(k).ok())?;
    }
    if let Some(n) = args.nproc {
        if !args.elastic {
            check_world(&resume, recipe.train.workers).map_err(bad_input)?;
        }
        preflight(&recipe, n, n, spec.is_gpu()).map_err(bad_input)?;
        let _lock = RunLock::acquire(&run_dir).map_err(bad_input)?;
        prepare_run_dir(&run_dir, &recipe)?;
        let token = qsr_comm::random_token();
        let store = if args.elastic { Some(crate::elastic::launcher_store(n, &token)?) } else { None };
        let children = ChildArgs {
            comm: args.comm.unwrap_or(CommKind::Tcp),
            run_dir: &run_dir,
            resuming: resume.is_some(),
            store: store.as_ref().map(|s| s.local_addr().to_string()),
            args,
        };
        let command = |rank, port| children.command(rank, n, port, &token);
        return procs::launch(n, command, &run_dir, store.as_ref());
    }
    if args.elastic {
        return crate::elastic::train(args, spec, recipe, run_dir, resume);
    }
    if let Some(kind) = args.comm {
        return external(args, kind, spec, recipe, run_dir, resume);
    }
    check_world(&resume, recipe.train.workers).map_err(bad_input)?;
    preflight(&recipe, recipe.train.workers, recipe.train.workers, spec.is_gpu()).map_err(bad_input)?;
    let device = spec.open(0).map_err(bad_input)?;
    let _lock = RunLock::acquire(&run_dir).map_err(bad_input)?;
    prepare_run_dir(&run_dir, &recipe)?;
    let spec = RunSpec { recipe, device, run_dir, resume, progress: !args.quiet, halt_after: args.halt_after };
    let outcomes = simulated(&spec)?;
    Ok(outcomes.into_iter().find_map(|o| o.summary))
}

/// Refuses flags that do not go together, naming them, and a launcher's environment that the flags
/// would ignore.
fn check_flags(
    args: &TrainArgs,
    recipe: &TrainRecipe,
    spec: &DeviceSpec,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<()> {
    if args.elastic {
        check_elastic(args, recipe)?;
    }
    if args.comm == Some(CommKind::Nccl) && !spec.is_gpu() {
        bail!("--comm nccl needs a GPU device (--device cuda or cuda:N), not --device {}", args.device);
    }
    if let Some(n) = args.nproc {
        if args.comm == Some(CommKind::Mpi) {
            bail!("--nproc starts its workers itself; use mpirun for --comm mpi");
        }
        if n > 1 && args.comm == Some(CommKind::Nccl) && matches!(spec, DeviceSpec::Cuda(Some(_))) {
            bail!(
                "--nproc {n} --comm nccl needs one GPU per process: use --device cuda (GPU = local rank), not --device {}",
                args.device
            );
        }
    }
    let alone = args.comm.is_none() && args.nproc.is_none() && args.workers.is_none() && !args.elastic;
    if let Some((var, n)) = launched_world(env).filter(|_| alone) {
        bail!(
            "the environment describes a job of {n} ranks ({var}={n}), but --comm is not given, so every process would train the whole job alone: pass --comm tcp (or --comm mpi under mpirun/srun) to train as one rank of it, or --workers K to train K threads in this process anyway"
        );
    }
    Ok(())
}

/// A launcher's variable that gives this process a world of more than one rank (torchrun, Open MPI,
/// PMI, an srun step), with its value.
fn launched_world(env: &dyn Fn(&str) -> Option<String>) -> Option<(&'static str, usize)> {
    ["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"]
        .into_iter()
        .find_map(|var| Some((var, env(var)?.trim().parse::<usize>().ok().filter(|n| *n > 1)?)))
}

/// Refuses what elastic mode does not cover, naming the flag or key.
fn check_elastic(args: &TrainArgs, recipe: &TrainRecipe) -> Result<()> {
    if args.comm.is_some_and(|c| c != CommKind::Tcp) {
        bail!("--elastic re-forms our TCP ring and shared memory at every change: use --comm tcp");
    }
    if args.nproc.is_none() && args.rendezvous.is_none() {
        bail!("--elastic needs --nproc N (the launcher serves the store) or --rendezvous HOST:PORT (`qsr rendezvous`)");
    }
    if args.nproc.is_some() && args.rendezvous.is_some() {
        bail!("--nproc --elastic serves its own store: drop --rendezvous");
    }
    if recipe.sync.local.is_some() {
        bail!("--elastic re-forms one flat group: a recipe with [sync.local] cannot run elastic");
    }
    if args.halt_after.is_some() {
        bail!("--halt-after is not supported with --elastic");
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
    let nodes = simulated_nodes(&spec.recipe)?;
    let results: Vec<Result<Outcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .zip(groups)
            .zip(nodes)
            .map(|((comm, group), node)| {
                // Each replica gets its own BatchNorm state (a plain clone would share it).
                let replica = model.replica();
                let spec = spec.clone();
                s.spawn(move || {
                    let progress = spec.progress && comm.rank() == 0;
                    let spec = RunSpec { progress, ..spec };
                    let comms = Comms { world: Box::new(comm), node };
                    run_worker(&spec, comms, replica, Some(group))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a worker thread panicked")))).collect()
    });
    let mut outcomes = Vec::new();
    let mut errors = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(o) => outcomes.push(o),
            Err(e) => errors.push((rank, e)),
        }
    }
    // Report the failure that came first, not a rank that saw it happen.
    if let Some((rank, e)) = root_cause(errors) {
        return Err(e.context(format!("worker {rank} failed")));
    }
    Ok(outcomes)
}

/// Each simulated worker's node group, in rank order, for a two-level recipe: nodes of
/// `sync.local.workers_per_node` consecutive ranks, or one node (all simulated workers share a host).
fn simulated_nodes(recipe: &TrainRecipe) -> Result<Vec<Option<Box<dyn Collective>>>> {
    let k = recipe.train.workers;
    recipe.check_nodes(k)?;
    Ok(match &recipe.sync.local {
        Some(l) => {
            let n = l.workers_per_node.unwrap_or(k);
            (0..k / n).flat_map(|_| InProcessGroup::new(n)).map(|c| Some(Box::new(c) as Box<dyn Collective>)).collect()
        }
        None => (0..k).map(|_| None).collect(),
    })
}

/// A launch's collectives over our transports (`connect`), with the node's group of a two-level
/// recipe split from the same ring: by `sync.local.workers_per_node`, or by host.
fn connect_levels(env: &qsr_comm::LaunchEnv, recipe: &TrainRecipe) -> Result<Comms> {
    let var = |k: &str| std::env::var(k).ok();
    let (cfg, transport) = (TcpConfig::from_env(&var)?, qsr_comm::Transport::from_env(&var)?);
    let shm = qsr_comm::ShmConfig { timeout: cfg.timeout, ..qsr_comm::ShmConfig::default() };
    let host = qsr_comm::host_id(&var, &shm);
    let mut ring = TcpComm::from_launch(env, cfg)?;
    // Every rank must take the same path below: ranks whose recipes differ here refuse together
    // (the whole recipe is agreed on later, over the collectives this forms).
    let nodes = match &recipe.sync.local {
        None => "none (one level)".to_string(),
        Some(l) => l.workers_per_node.map_or("one node per host".into(), |n| format!("{n} workers per node")),
    };
    qsr_comm::agree(&mut ring, &serde_json::json!({ "sync.local": nodes }))?;
    let Some(local) = &recipe.sync.local else {
        return Ok(Comms::flat(qsr_comm::over_ring(ring, transport, &host, shm)?));
    };
    recipe.check_nodes(ring.world_size())?;
    let rank = ring.rank();
    let node = match local.workers_per_node {
        Some(n) => qsr_comm::split(&mut ring, (rank / n) as u32, rank as u32, transport, &host, shm.clone()),
        None => qsr_comm::split_by_host(&mut ring, transport, &host, shm.clone()),
    }
    .context("forming the node groups of [sync.local]")?;
    let world = qsr_comm::over_ring(ring, transport, &host, shm)?;
    Ok(Comms { world, node: Some(node) })
}

/// The command line of each `--nproc` worker: the run's saved (resolved) recipe, so that every
/// launch mode applies the same overrides.
struct ChildArgs<'a> {
    comm: CommKind,
    run_dir: &'a Path,
    resuming: bool,
    /// The elastic store's address (`--elastic`).
    store: Option<String>,
    args: &'a TrainArgs,
}

impl ChildArgs<'_> {
    fn command(&self, rank: usize, n: usize, port: u16, token: &str) -> Result<std::process::Command> {
        let exe = std::env::current_exe().context("cannot locate the qsr executable")?;
        let mut c = std::process::Command::new(exe);
        c.arg("train").arg("--comm").arg(self.comm.name());
        c.arg("--recipe").arg(self.run_dir.join("recipe.toml")).arg("--out").arg(self.run_dir);
        if self.resuming {
            c.arg("--resume").arg(self.run_dir);
        }
        if let Some(store) = &self.store {
            c.args(["--elastic", "--rendezvous", store, "--rank", &rank.to_string()]);
        } else {
            c.args(["--rank", &rank.to_string(), "--world-size", &n.to_string(), "--master-addr", "127.0.0.1"]);
            c.args(["--master-port", &port.to_string()]);
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
        Ok(c)
    }
}

/// One worker of a job launched by someone else (our `--nproc`, torchrun, mpirun, srun).
fn external(
    args: &TrainArgs,
    kind: CommKind,
    spec: DeviceSpec,
    mut recipe: TrainRecipe,
    run_dir: PathBuf,
    resume: Resume,
) -> Result<Option<Summary>> {
    let explicit = Explicit {
        rank: args.rank,
        world_size: args.world_size,
        local_rank: None,
        master_addr: args.master_addr.clone(),
        master_port: args.master_port,
    };
    let tcp = || -> Result<(TcpComm, usize)> {
        let env = qsr_comm::detect_from_process_env(&explicit)?;
        let cfg = TcpConfig::from_env(&|k| std::env::var(k).ok())?;
        Ok((TcpComm::from_launch(&env, cfg)?, env.local_rank))
    };
    if recipe.sync.local.is_some() && kind != CommKind::Tcp {
        return Err(bad_input(anyhow!(
            "[sync.local] splits the job into nodes over our collectives: use --comm tcp, not --comm {}",
            kind.name()
        )));
    }
    let (comms, local_rank) = match kind {
        CommKind::Tcp => {
            let env = qsr_comm::detect_from_process_env(&explicit)?;
            (connect_levels(&env, &recipe)?, env.local_rank)
        }
        CommKind::Mpi => {
            // The launcher's local rank (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID) picks the GPU.
            let local = qsr_comm::detect_from_process_env(&explicit).map_or(0, |e| e.local_rank);
            (Comms::flat(mpi_comm()?), local)
        }
        CommKind::Nccl => {
            let (mut bootstrap, local) = tcp()?;
            let ordinal = spec.ordinal(local).unwrap_or(local);
            (Comms::flat(nccl_comm(&mut bootstrap, ordinal)?), local)
        }
    };
    let (rank, world) = (comms.world.rank(), comms.world.world_size());
    recipe.train.workers = world;
    let member = Member { comms, local_rank, spec, recipe, run_dir, resume };
    member.train(args).with_context(|| format!("rank {rank} of {world}"))
}

/// This process's part of an external launch, once its collective is up.
struct Member {
    comms: Comms,
    local_rank: usize,
    spec: DeviceSpec,
    recipe: TrainRecipe,
    run_dir: PathBuf,
    resume: Resume,
}

impl Member {
    fn train(mut self, args: &TrainArgs) -> Result<Option<Summary>> {
        let (rank, world) = (self.comms.world.rank(), self.comms.world.world_size());
        let device = self.spec.open(self.local_rank).map_err(bad_input)?;
        check_world(&self.resume, world).map_err(bad_input)?;
        // Rank 0 owns the run directory (a `--nproc` launcher holds the lock for its workers).
        let owner = rank == 0 && !args.spawned;
        let lock = if owner { Some(RunLock::acquire(&self.run_dir)) } else { None };
        let unfit = preflight(&self.recipe, world, 1, self.spec.is_gpu()).err();
        let mut facts = LaunchFacts::new(&self.recipe, self.resume.as_ref().map(|(_, s)| s.step));
        match (lock.as_ref(), unfit) {
            (Some(Err(e)), _) => facts.refusal = Some(format!("{e:#}")),
            (_, Some(e)) if rank == 0 => facts.refusal = Some(format!("{e:#}")),
            (_, Some(e)) => return Err(bad_input(e)),
            _ => {}
        }
        agree(self.comms.world.as_mut(), &facts)?;
        if owner {
            prepare_run_dir(&self.run_dir, &self.recipe)?;
        }
        let model = build_model(&self.recipe, &device)?;
        let progress = !args.quiet && rank == 0;
        let spec = RunSpec {
            recipe: self.recipe,
            device,
            run_dir: self.run_dir,
            resume: self.resume,
            progress,
            halt_after: args.halt_after,
        };
        let outcome = run_worker(&spec, self.comms, model, None)?;
        Ok(if args.spawned { None } else { outcome.summary })
    }
}

#[cfg(feature = "nccl")]
fn nccl_comm(bootstrap: &mut TcpComm, ordinal: usize) -> Result<Box<dyn Collective>> {
    Ok(Box::new(qsr_comm::NcclComm::init(bootstrap, ordinal)?))
}

#[cfg(not(feature = "nccl"))]
fn nccl_comm(_bootstrap: &mut TcpComm, _ordinal: usize) -> Result<Box<dyn Collective>> {
    Err(bad_input(anyhow!(
        "--comm nccl: this qsr binary was built without NCCL support (build it with `cargo xtask cuda`)"
    )))
}

#[cfg(feature = "mpi")]
fn mpi_comm() -> Result<Box<dyn Collective>> {
    Ok(Box::new(qsr_comm::MpiComm::init()?))
}

#[cfg(not(feature = "mpi"))]
fn mpi_comm() -> Result<Box<dyn Collective>> {
    Err(bad_input(anyhow!("--comm mpi: this qsr binary was built without MPI support (rebuild with `--features mpi`)")))
}
