//! One worker of a job launched by someone else (our `--nproc`, torchrun, mpirun, srun).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow};
use qsr_comm::{Collective, Explicit, LaunchEnv, MasterListener, TcpComm, TcpConfig};

use crate::args::{CommKind, TrainArgs};
use crate::device_spec::DeviceSpec;
use crate::exit::bad_input;
use crate::launch_facts::{LaunchFacts, agree};
use crate::recipe::TrainRecipe;
use crate::records::Summary;
use crate::run_dir::{Resume, check_shared, check_world, prepare_run_dir};
use crate::run_lock::RunLock;
use crate::worker::{Comms, RunSpec, build_model, in_pool, intra_op_threads, preflight, run_worker};

/// A launch's collectives over our transports (`connect`), with the node's group of a two-level
/// recipe split from the same ring: by `sync.local.workers_per_node`, or by host.
fn connect_levels(env: &LaunchEnv, recipe: &TrainRecipe, port_file: Option<&Path>) -> Result<Comms> {
    let var = |k: &str| std::env::var(k).ok();
    let (cfg, transport) = (TcpConfig::from_env(&var)?, qsr_comm::Transport::from_env(&var)?);
    let shm = qsr_comm::ShmConfig { timeout: cfg.timeout, ..qsr_comm::ShmConfig::default() };
    let host = qsr_comm::host_id(&var, &shm);
    let mut ring = ring(env, cfg, port_file)?;
    // Every rank must take the same path below: ranks whose recipes or transports differ here refuse
    // together (the whole recipe is agreed on later, over the collectives this forms).
    let nodes = match &recipe.sync.local {
        None => "none (one level)".to_string(),
        Some(l) => l.workers_per_node.map_or("one node per host".into(), |n| format!("{n} workers per node")),
    };
    let streaming = recipe.sync.streaming.is_some();
    let paths =
        serde_json::json!({ "sync.local": nodes, "sync.streaming": streaming, "QSR_TRANSPORT": transport.name() });
    qsr_comm::agree(&mut ring, &paths)?;
    // Streaming fragments all-reduce on a group of their own, on a thread beside the steps.
    let rank = ring.rank();
    let fragments = match streaming {
        true => Some(
            qsr_comm::split(&mut ring, 0, rank as u32, transport, &host, shm.clone())
                .context("forming the streaming fragments' group of [sync.streaming]")?,
        ),
        false => None,
    };
    let Some(local) = &recipe.sync.local else {
        return Ok(Comms { world: qsr_comm::over_ring(ring, transport, &host, shm)?, node: None, fragments });
    };
    recipe.check_nodes(ring.world_size())?;
    let node = match local.workers_per_node {
        Some(n) => qsr_comm::split(&mut ring, (rank / n) as u32, rank as u32, transport, &host, shm.clone()),
        None => qsr_comm::split_by_host(&mut ring, transport, &host, shm.clone()),
    }
    .context("forming the node groups of [sync.local]")?;
    let world = qsr_comm::over_ring(ring, transport, &host, shm)?;
    Ok(Comms { world, node: Some(node), fragments })
}

/// This rank's TCP ring. Rank 0 of a `--nproc` launch (`--port-file`) binds its rendezvous port
/// itself (port 0: the kernel picks a free one) and writes the number for the launcher, which starts
/// the other ranks with it: no port is released between being chosen and being bound.
fn ring(env: &LaunchEnv, cfg: TcpConfig, port_file: Option<&Path>) -> Result<TcpComm> {
    let Some(path) = port_file.filter(|_| env.rank == 0 && env.world_size > 1) else {
        return Ok(TcpComm::from_launch(env, cfg)?);
    };
    let host = if env.master_addr.contains(':') { format!("[{}]", env.master_addr) } else { env.master_addr.clone() };
    let listener = MasterListener::bind(&format!("{host}:0"))?;
    let port = listener.local_addr()?.port();
    crate::files::write_atomic(path, port.to_string().as_bytes(), "rendezvous port file")
        .with_context(|| format!("cannot hand the rendezvous port to the launcher ({})", path.display()))?;
    Ok(TcpComm::master(listener, env.world_size, cfg)?)
}

/// One worker of a job launched by someone else (our `--nproc`, torchrun, mpirun, srun).
pub(super) fn external(
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
        Ok((ring(&env, cfg, args.port_file.as_deref())?, env.local_rank))
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
            (connect_levels(&env, &recipe, args.port_file.as_deref())?, env.local_rank)
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
        // Every rank of the launch arms alike, so the ranks check a signal together at their syncs:
        // a launcher's forwarded SIGTERM stops them there with a checkpoint (issue 56, D10).
        crate::worker::interrupt::arm()?;
        if owner {
            prepare_run_dir(&self.run_dir, &self.recipe)?;
        }
        check_shared(self.comms.world.as_mut(), &self.run_dir)?;
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
        // One worker in this process: all of the process's threads, in a pool the worker runs inside.
        let summary = in_pool(rank, intra_op_threads(1), || run_worker(&spec, self.comms, model, None))?;
        Ok(if args.spawned { None } else { summary })
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
