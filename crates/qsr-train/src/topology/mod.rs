//! `qsr train`'s topology stage (documented on [`run`]).

use anyhow::{Context, Result, bail};
use qsr_comm::TcpConfig;
use qsr_optim::{Face, Residency, SyncSettings, check_sync};

use crate::args::{CommKind, TrainArgs};
use crate::device_spec::DeviceSpec;
use crate::exit::bad_input;
use crate::recipe::TrainRecipe;
use crate::records::Summary;
use crate::run_dir::{check_world, prepare_run_dir, resolve};
use crate::run_lock::RunLock;
use crate::worker::{RunSpec, preflight};
use processes::ChildArgs;
pub(crate) use qsr_launch::{ExecRankArgs, LaunchArgs, exec_rank, launch};

mod elastic;
mod external;
mod processes;
pub(crate) mod threads;

/// Runs `qsr train`; returns rank 0's summary where this process has it.
///
/// It resolves the recipe and the run directory, then runs the workers in one of three ways
/// that share the training code: K threads in this process (in-process collective), `--nproc N` local
/// child processes (TCP ring), or one worker of an externally launched job (torchrun-style env, mpirun,
/// srun; `--comm tcp|mpi`).
pub(crate) fn run(args: &TrainArgs) -> Result<Option<Summary>> {
    if args.spawned {
        // Before anything else: a worker must not outlive the `--nproc` launcher that started it.
        qsr_launch::die_with_launcher()?;
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
        let store = if args.elastic { Some(elastic::launcher_store(n, &token)?) } else { None };
        let children = ChildArgs {
            comm: args.comm.unwrap_or(CommKind::Tcp),
            run_dir: &run_dir,
            resuming: resume.is_some(),
            store: store.as_ref().map(|s| s.local_addr().to_string()),
            args,
        };
        let command = |rank, port| children.command(rank, n, port, &token);
        return processes::launch(n, command, &run_dir, store.as_ref());
    }
    if args.elastic {
        return elastic::train(args, spec, recipe, run_dir, resume);
    }
    if let Some(kind) = args.comm {
        return external::external(args, kind, spec, recipe, run_dir, resume);
    }
    check_world(&resume, recipe.train.workers).map_err(bad_input)?;
    preflight(&recipe, recipe.train.workers, recipe.train.workers, spec.is_gpu()).map_err(bad_input)?;
    let device = spec.open(0).map_err(bad_input)?;
    let _lock = RunLock::acquire(&run_dir).map_err(bad_input)?;
    prepare_run_dir(&run_dir, &recipe)?;
    let spec = RunSpec { recipe, device, run_dir, resume, progress: !args.quiet, halt_after: args.halt_after };
    threads::run(&spec)
}

/// Judges the sync settings again with the residency `driver.residency = "auto"` takes on `spec`
/// (device-resident on a GPU or wgpu), so a setting only host-resident workers can run is refused
/// before anything starts, as the recipe's own check refuses it on the CPU.
pub(crate) fn check_residency(recipe: &TrainRecipe, spec: &DeviceSpec) -> Result<()> {
    if recipe.driver.residency != Residency::Auto || !spec.is_cube() {
        return Ok(());
    }
    let settings = SyncSettings { residency: Residency::Device, ..recipe.sync_settings()? };
    match check_sync(&settings, Face::Recipe).refusals.into_iter().next() {
        Some(r) => bail!("{r} (driver.residency = \"auto\" keeps the state on this device)"),
        None => Ok(()),
    }
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
    check_residency(recipe, spec).with_context(|| format!("--device {}", args.device))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn digits(sets: &[&str]) -> TrainRecipe {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../recipes/digits-mlp-qsr.toml");
        TrainRecipe::load(&path, &sets.iter().map(ToString::to_string).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn a_setting_that_auto_residency_cannot_run_on_a_gpu_is_refused_before_start() {
        // Accepted on the CPU, where `auto` is host-resident; refused for a cube device, naming the key.
        let streaming = digits(&["sync.streaming.fragments=2"]);
        assert!(check_residency(&streaming, &DeviceSpec::Cpu).is_ok());
        for spec in [DeviceSpec::Wgpu, DeviceSpec::Cuda(Some(0))] {
            let e = format!("{:#}", check_residency(&streaming, &spec).unwrap_err());
            assert!(e.contains("invalid `sync.streaming`") && e.contains("\"auto\""), "{e}");
        }
        // Pinned to the host, the same settings run anywhere.
        let host = digits(&["sync.streaming.fragments=2", "driver.residency=host"]);
        assert!(check_residency(&host, &DeviceSpec::Wgpu).is_ok());
        assert!(check_residency(&digits(&[]), &DeviceSpec::Wgpu).is_ok());
    }
}
