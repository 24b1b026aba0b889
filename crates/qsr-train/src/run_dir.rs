//! A `qsr train` invocation's recipe, run directory and checkpoint (documented on [`resolve`]), and
//! what the run directory may hold when a run starts.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use qsr_comm::differing_keys;

use crate::args::TrainArgs;
use crate::checkpoint;
use crate::recipe::TrainRecipe;

fn default_run_dir(name: &str) -> PathBuf {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    PathBuf::from("runs").join(format!("{name}-{secs}"))
}

/// The checkpoint a run resumes from (its directory and state), if it resumes.
pub(crate) type Resume = Option<(PathBuf, checkpoint::CheckpointState)>;

/// The recipe, run directory and checkpoint a `qsr train` invocation works on.
pub(crate) fn resolve(args: &TrainArgs) -> Result<(TrainRecipe, PathBuf, Resume)> {
    let path = match (&args.recipe, &args.resume) {
        (Some(p), _) => p.clone(),
        (None, Some(run_dir)) => run_dir.join("recipe.toml"),
        (None, None) => bail!("--recipe FILE is required (or --resume RUN_DIR)"),
    };
    let mut recipe = TrainRecipe::load(&path, &args.sets)?;
    if let Some(n) = args.nproc {
        crate::args::check_nproc(n)?;
    }
    for (flag, k) in [("--workers", args.workers), ("--nproc", args.nproc)] {
        match k {
            Some(0) => bail!("{flag} must be at least 1"),
            Some(k) => recipe.train.workers = k,
            None => {}
        }
    }
    // The sync settings judged again for the workers the flags give (one worker trains alone).
    recipe.validate().with_context(|| format!("recipe {}", path.display()))?;
    recipe.check_nodes(recipe.train.workers).with_context(|| format!("recipe {}", path.display()))?;
    if let Some(run_dir) = &args.resume {
        let (dir, state) = checkpoint::latest(run_dir)?;
        check_resumable(&recipe, &path, &dir, &state)?;
        return Ok((recipe, run_dir.clone(), Some((dir, state))));
    }
    let run_dir = args.out.clone().unwrap_or_else(|| default_run_dir(&recipe.name));
    // Workers started into a running job's directory (launched children, elastic joiners) find its
    // checkpoints there by design.
    if !args.spawned && args.rendezvous.is_none() {
        refuse_old_run(&run_dir)?;
    }
    Ok((recipe, run_dir, None))
}

/// Refuses a fresh run into a directory whose checkpoints belong to another run: the two would mix,
/// and pruning (newest steps kept) would delete the new run's checkpoints as it wrote them.
pub(crate) fn refuse_old_run(run_dir: &Path) -> Result<()> {
    let latest = checkpoint::ckpt_root(run_dir).join("LATEST");
    let Ok(meta) = std::fs::symlink_metadata(&latest) else {
        return Ok(());
    };
    // Read only a regular file: a FIFO would block.
    let name = if meta.is_file() {
        qsr_files::read_text(&latest, 4096, "checkpoint pointer").unwrap_or_default()
    } else {
        String::new()
    };
    bail!(
        "{} already holds a run with checkpoints ({} names {}): continue it with --resume {}, or give another --out; nothing was changed",
        run_dir.display(),
        latest.display(),
        name.trim(),
        run_dir.display()
    )
}

/// Refuses a resume whose recipe changed more than a resume may change (naming the keys), or that has
/// nothing left to train.
fn check_resumable(recipe: &TrainRecipe, path: &Path, dir: &Path, state: &checkpoint::CheckpointState) -> Result<()> {
    let key = recipe.resume_key()?;
    if key != state.resume_key {
        let parse = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap_or_default();
        let diffs: Vec<String> = differing_keys(&parse(&state.resume_key), &parse(&key))
            .into_iter()
            .map(|d| format!("`{}` (checkpoint: {}, now: {})", d.key, d.left, d.right))
            .collect();
        bail!(
            "cannot resume from {}: recipe {} differs from the checkpointed run in {} (only train.steps, eval, checkpoint and data.prefetch may change)",
            dir.display(),
            path.display(),
            diffs.join(", ")
        );
    }
    let plan = recipe.plan()?;
    let end = plan.end_step();
    let round = *plan.cursor_at(state.step.min(end)).round();
    if state.step < end && round.start != state.step {
        // The checkpointed run ended there with a sync (a run always does): one more than the plan has.
        eprintln!(
            "qsr: resuming at step {} inside this plan's round {}..{} (the checkpointed run ended there, with a sync): this run makes one sync more than `qsr plan` shows for train.steps = {end}",
            state.step,
            round.start,
            round.end()
        );
    }
    if state.step == end {
        bail!(
            "nothing to resume: the run in {} already finished at step {end} (train.steps); to train longer, raise it, e.g. --set train.steps={}",
            dir.display(),
            end * 2
        );
    }
    if state.step > end {
        bail!(
            "cannot resume from {}: its step {} is past train.steps = {end}; set train.steps above {}",
            dir.display(),
            state.step,
            state.step
        );
    }
    Ok(())
}

/// Writes the resolved recipe, so that the run directory says what the run follows (on resume too:
/// a raised `train.steps` then holds for the next resume as well).
pub(crate) fn prepare_run_dir(run_dir: &Path, recipe: &TrainRecipe) -> Result<()> {
    std::fs::create_dir_all(run_dir).with_context(|| format!("cannot create run directory {}", run_dir.display()))?;
    crate::files::write_atomic(&run_dir.join("recipe.toml"), recipe.to_toml()?.as_bytes(), "run recipe")
}

/// Refuses to resume a checkpoint of another world size (elastic runs may: they re-shard).
pub(crate) fn check_world(resume: &Resume, world: usize) -> Result<()> {
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

/// The file rank 0 leaves in its run directory for [`check_shared`], removed once every rank looked.
const SHARED_MARKER: &str = ".qsr-shared-check";

/// Fails on every rank, as bad input naming the ranks, unless every rank's `run_dir` is rank 0's (the
/// same directory on shared storage, whatever path each host mounts it at): every rank writes its own
/// files into the run's checkpoints, and a rank writing elsewhere would fail at the first checkpoint,
/// after hours. Rank 0 writes a marker of this launch, every rank reads it back from its own `--out`.
pub(crate) fn check_shared(comm: &mut dyn qsr_comm::Collective, run_dir: &Path) -> Result<()> {
    let marker = run_dir.join(SHARED_MARKER);
    let mut token = Vec::new();
    if comm.rank() == 0 {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        token = format!("{}-{nanos}", std::process::id()).into_bytes();
        crate::files::write_atomic(&marker, &token, "shared run directory marker")?;
    }
    comm.broadcast_bytes(&mut token, 0).context("while the ranks compared their run directories")?;
    let seen = qsr_files::read(&marker, 64, "shared run directory marker").ok();
    let out = match seen == Some(token) {
        true => "rank 0's run directory".to_string(),
        false => format!("{}, which does not hold rank 0's run directory", run_dir.display()),
    };
    let agreed = qsr_comm::agree(comm, &serde_json::json!({ "--out": out }));
    if comm.rank() == 0 {
        let _ = std::fs::remove_file(&marker);
    }
    match agreed {
        Err(e @ qsr_comm::CommError::Disagree { .. }) => Err(crate::exit::bad_input(anyhow::anyhow!(e).context(
            "every rank writes its checkpoint files into the one run directory: give each rank's --out the \
             directory rank 0 uses, on storage every host shares",
        ))),
        other => Ok(other.context("while the ranks compared their run directories")?),
    }
}
