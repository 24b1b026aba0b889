//! Checkpoints at synchronization points, written atomically and verified on load.
//!
//! Layout of `RUN_DIR/ckpt/`:
//! - `step-<N>/model.safetensors`: the averaged trainable parameters and rank 0's BatchNorm statistics,
//!   one tensor per module path (readable by any safetensors tool); in a streaming run, whose ranks
//!   differ between a fragment's syncs, rank 0's own parameters (the run's last step averages them all);
//! - `step-<N>/optim-rank<r>.safetensors`: each rank's optimizer moments (state stays per worker);
//! - `step-<N>/sync-rank<r>.safetensors`: each rank's sync state (qsr-optim's `SyncState`, in its own
//!   codec: the outer optimizer's global parameters and momentum, a streaming worker's averages in
//!   flight and error-feedback residual, the inner round), with a streaming worker's own parameters,
//!   where syncs are outer steps or stream (`[outer]`, streaming or quantized syncs; since format 3;
//!   formats 1 and 2 wrote `outer.safetensors` and, since 2, `stream-rank<r>.safetensors`, still read);
//! - `step-<N>/state.json`: the `qsr-sched` cursor (with its plan), world size and the recipe's resume key;
//! - `step-<N>/manifest.json`: the SHA-256 of every file above;
//! - `LATEST`: the name of the newest complete checkpoint.
//!
//! A checkpoint is built in `tmp-step-<N>/` (every file fsynced), then renamed into place, then `LATEST`
//! is replaced through a temp file and a rename, so a crash at any point leaves the previous checkpoint
//! intact and `LATEST` pointing at a complete one.
//!
//! Public here is the reading side, for a library user who inspects or loads a run's checkpoints:
//! [`latest`], [`verify`], [`load_model`], [`load_optim`], [`load_outer`], [`load_stream`] and [`CheckpointState`]; the
//! trainer alone writes them.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use qsr_optim::{InFlight, OptimState, ParamLayout, StreamState, SyncState};
use qsr_sched::Cursor;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// What `state.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct CheckpointState {
    /// Version of the checkpoint layout ([`FORMAT`]); a checkpoint of another version is refused.
    pub format: u32,
    /// Steps completed when the checkpoint was taken.
    pub step: u64,
    /// The number of workers that wrote it; a resume must have the same.
    pub world_size: usize,
    /// The trainer's position in the plan, serialized with the plan.
    pub cursor: Cursor,
    /// The recipe with the settings a resume may change blanked out; must match on resume.
    pub resume_key: String,
    /// The run's counters up to this step, so that a resumed run continues them.
    #[serde(default)]
    pub counters: Counters,
}

/// Cumulative counters of a run (rank 0's view), carried across resumes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Counters {
    /// Synchronizations completed.
    pub syncs: u64,
    /// Bytes this rank sent for synchronizations.
    pub bytes: u64,
    /// Seconds spent in synchronizations.
    pub comm_seconds: f64,
    /// Seconds of training (excluding time between a stop and its resume).
    pub wall_seconds: f64,
    /// Updates skipped for non-finite gradients.
    pub skipped_updates: u64,
    /// Local averages inside the node (two-level runs).
    #[serde(default)]
    pub local_syncs: u64,
    /// Bytes this rank sent for local averages.
    #[serde(default)]
    pub local_bytes: u64,
    /// Seconds spent in local averages.
    #[serde(default)]
    pub local_comm_seconds: f64,
}

impl Counters {
    /// These counters followed by a later segment's.
    pub(crate) fn then(&self, later: &Counters) -> Counters {
        Counters {
            syncs: self.syncs + later.syncs,
            bytes: self.bytes + later.bytes,
            comm_seconds: self.comm_seconds + later.comm_seconds,
            wall_seconds: self.wall_seconds + later.wall_seconds,
            skipped_updates: self.skipped_updates + later.skipped_updates,
            local_syncs: self.local_syncs + later.local_syncs,
            local_bytes: self.local_bytes + later.local_bytes,
            local_comm_seconds: self.local_comm_seconds + later.local_comm_seconds,
        }
    }
}

/// The checkpoint layout version this build writes (`state.json`'s `format`). Version 2 added the
/// streaming workers' `stream-rank<r>.safetensors`; version 3 replaced it and `outer.safetensors` by
/// each rank's `sync-rank<r>.safetensors`. Versions 1 and 2 still load.
pub(crate) const FORMAT: u32 = 3;

/// The first version whose sync state is `sync-rank<r>.safetensors`.
pub(crate) const SYNC_STATE_FORMAT: u32 = 3;

/// `sync-rank<r>.safetensors`: rank `rank`'s sync state.
pub(crate) fn sync_file(rank: usize) -> String {
    format!("sync-rank{rank}.safetensors")
}

/// Loads a `sync-rank<r>.safetensors` for a model of `len` parameters: the sync state and a
/// streaming rank's own parameters.
pub(crate) fn load_sync(file: &Path, len: usize) -> Result<(SyncState, Option<Vec<f32>>)> {
    let hint = "the recipe has an [outer] section, streams or quantizes its syncs: was the checkpoint written without?";
    let bytes = read_tensors(file, SYNC_VECTORS * len, hint)?;
    SyncState::from_safetensors(&bytes, len).with_context(|| format!("checkpoint file {}", file.display()))
}

/// The oldest layout version this build reads.
const OLDEST_FORMAT: u32 = 1;

/// Reads a checkpoint's safetensors file of at most `floats` f32 values beside its header; `hint`
/// says what a missing file may mean.
fn read_tensors(file: &Path, floats: usize, hint: &str) -> Result<Vec<u8>> {
    let limit = 4 * floats as u64 + HEADER_BYTES;
    qsr_files::read(file, limit, "checkpoint file").with_context(|| hint.to_string())
}

/// The most bytes a checkpoint file's safetensors header may have (names, shapes and offsets of its
/// tensors, and the metadata: about 100 bytes a tensor).
const HEADER_BYTES: u64 = 16 << 20;

/// The most model-sized vectors a rank's sync state holds: the outer step's global parameters and
/// momentum, the residual, the rank's own parameters and the averages in flight with what was sent.
const SYNC_VECTORS: usize = 16;

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Serializes tensors with metadata. safetensors writes its metadata map in hash order, so files of
/// identical states are byte-identical only with at most one metadata entry: keep it that way.
fn tensors_to_bytes(named: &[(String, Vec<usize>, Vec<u8>)], meta: BTreeMap<String, String>) -> Result<Vec<u8>> {
    debug_assert!(meta.len() <= 1, "more than one metadata entry makes checkpoint bytes depend on hash order");
    let views: Vec<(String, TensorView<'_>)> = named
        .iter()
        .map(|(n, shape, bytes)| Ok((n.clone(), TensorView::new(Dtype::F32, shape.clone(), bytes)?)))
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    let meta: std::collections::HashMap<String, String> = meta.into_iter().collect();
    Ok(safetensors::serialize(views, Some(meta))?)
}

/// `model.safetensors`: parameters and running statistics by module path.
pub(crate) fn model_bytes(layout: &ParamLayout, params: &[f32], running: &[f32], step: u64) -> Result<Vec<u8>> {
    let mut named = Vec::new();
    for e in &layout.trainable {
        named.push((e.path.clone(), e.shape.clone(), f32_bytes(&params[e.range.clone()])));
    }
    for e in &layout.running {
        named.push((e.path.clone(), e.shape.clone(), f32_bytes(&running[e.range.clone()])));
    }
    tensors_to_bytes(&named, BTreeMap::from([("step".into(), step.to_string())]))
}

/// `optim-rank<r>.safetensors`: one rank's optimizer moments.
pub(crate) fn optim_bytes(state: &OptimState) -> Result<Vec<u8>> {
    let mut named = Vec::new();
    if !state.first_moment.is_empty() {
        named.push(("first_moment".to_string(), vec![state.first_moment.len()], f32_bytes(&state.first_moment)));
    }
    if !state.second_moment.is_empty() {
        named.push(("second_moment".to_string(), vec![state.second_moment.len()], f32_bytes(&state.second_moment)));
    }
    tensors_to_bytes(&named, BTreeMap::from([("step".into(), state.step.to_string())]))
}

/// Loads a format 1 or 2 checkpoint's `outer.safetensors` (the outer optimizer's global parameters and
/// momentum, the same on every rank) for a model of `len` parameters: (global parameters, momentum).
pub(crate) fn load_outer(file: &Path, len: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    let hint = "the recipe has an [outer] section: was the checkpoint written without it?";
    let bytes = read_tensors(file, 2 * len, hint)?;
    let st =
        SafeTensors::deserialize(&bytes).map_err(|e| anyhow!("{} is not a safetensors file: {e}", file.display()))?;
    Ok((read_f32(&st, "global", len, file)?, read_f32(&st, "momentum", len, file)?))
}

fn read_f32(st: &SafeTensors<'_>, name: &str, len: usize, file: &Path) -> Result<Vec<f32>> {
    let t = st.tensor(name).map_err(|_| anyhow!("{}: tensor `{name}` is missing", file.display()))?;
    if t.dtype() != Dtype::F32 || t.data().len() != len * 4 {
        bail!(
            "{}: tensor `{name}` has {} bytes of {:?}, expected {len} f32",
            file.display(),
            t.data().len(),
            t.dtype()
        );
    }
    Ok(t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// Loads a format 2 checkpoint's `stream-rank<r>.safetensors`: a streaming worker's own parameters
/// and streaming state (`in_flight.<i>` a mean, `in_flight.<i>.sent` the fragment's values when sent,
/// their fragments and steps the metadata entry `in_flight`; the worker checks the fragments' sizes
/// when it restores them).
pub(crate) fn load_stream(file: &Path, layout: &ParamLayout) -> Result<(Vec<f32>, StreamState)> {
    let hint = "the recipe streams or quantizes its syncs: was the checkpoint written without?";
    let bytes = read_tensors(file, SYNC_VECTORS * layout.len(), hint)?;
    let st =
        SafeTensors::deserialize(&bytes).map_err(|e| anyhow!("{} is not a safetensors file: {e}", file.display()))?;
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| anyhow!("{}: {e}", file.display()))?;
    let listed = meta.metadata().as_ref().and_then(|m| m.get("in_flight")).map_or("[]", String::as_str);
    let mut in_flight: Vec<InFlight> =
        serde_json::from_str(listed).with_context(|| format!("{}: metadata `in_flight`", file.display()))?;
    if in_flight.len() > qsr_sched::MAX_FRAGMENTS as usize {
        bail!("{}: {} averages in flight, more than fragments can be", file.display(), in_flight.len());
    }
    for (i, f) in in_flight.iter_mut().enumerate() {
        let name = format!("in_flight.{i}");
        let t = st.tensor(&name).map_err(|_| anyhow!("{}: tensor `{name}` is missing", file.display()))?;
        f.mean = read_f32(&st, &name, (t.data().len() / 4).min(layout.len()), file)?;
        // Absent in checkpoints written before landings kept the local steps.
        let sent = format!("{name}.sent");
        if st.tensor(&sent).is_ok() {
            f.sent = read_f32(&st, &sent, f.mean.len(), file)?;
        }
    }
    let residual =
        if st.tensor("residual").is_ok() { Some(read_f32(&st, "residual", layout.len(), file)?) } else { None };
    Ok((read_f32(&st, "params", layout.len(), file)?, StreamState { in_flight, residual }))
}

/// Loads `model.safetensors` against the layout of the model being resumed.
pub(crate) fn load_model(file: &Path, layout: &ParamLayout) -> Result<(Vec<f32>, Vec<f32>)> {
    let bytes = read_tensors(file, layout.len() + layout.running_len(), "the model's parameters")?;
    let st =
        SafeTensors::deserialize(&bytes).map_err(|e| anyhow!("{} is not a safetensors file: {e}", file.display()))?;
    let mut params = vec![0.0; layout.len()];
    for e in &layout.trainable {
        params[e.range.clone()].copy_from_slice(&read_f32(&st, &e.path, e.range.len(), file)?);
    }
    let mut running = vec![0.0; layout.running_len()];
    for e in &layout.running {
        running[e.range.clone()].copy_from_slice(&read_f32(&st, &e.path, e.range.len(), file)?);
    }
    Ok((params, running))
}

/// Loads one rank's optimizer state; `template` gives the moment sizes this optimizer needs.
pub(crate) fn load_optim(file: &Path, template: &OptimState) -> Result<OptimState> {
    let floats = template.first_moment.len() + template.second_moment.len();
    let bytes = read_tensors(file, floats, "this rank's optimizer state")?;
    let st =
        SafeTensors::deserialize(&bytes).map_err(|e| anyhow!("{} is not a safetensors file: {e}", file.display()))?;
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| anyhow!("{}: {e}", file.display()))?;
    let step = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("step"))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("{}: metadata `step` is missing", file.display()))?;
    let moment = |name: &str, len: usize| if len == 0 { Ok(Vec::new()) } else { read_f32(&st, name, len, file) };
    Ok(OptimState {
        step,
        first_moment: moment("first_moment", template.first_moment.len())?,
        second_moment: moment("second_moment", template.second_moment.len())?,
    })
}

/// `RUN_DIR/ckpt`: the directory of a run's checkpoints and `LATEST`.
pub(crate) fn ckpt_root(run_dir: &Path) -> PathBuf {
    run_dir.join("ckpt")
}

/// `RUN_DIR/ckpt/tmp-step-<N>`: where the checkpoint of step N is built before it is renamed into place.
pub(crate) fn tmp_dir(run_dir: &Path, step: u64) -> PathBuf {
    ckpt_root(run_dir).join(format!("tmp-step-{step}"))
}

/// Rank 0, while no rank writes a checkpoint (at the start of a run, or when it takes rank 0's duties
/// over in an elastic job): removes what a process killed while committing left in `ckpt/` (its
/// `tmp-step-<N>` directories and temp files); complete checkpoints and `LATEST` are untouched.
pub(crate) fn sweep(run_dir: &Path) -> Result<()> {
    let root = ckpt_root(run_dir);
    let Ok(entries) = fs::read_dir(&root) else {
        return Ok(());
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let path = e.path();
        let done = if name.starts_with("tmp-step-") && e.file_type().is_ok_and(|t| t.is_dir()) {
            fs::remove_dir_all(&path)
        } else if name.starts_with('.') && name.ends_with(".tmp") {
            fs::remove_file(&path)
        } else {
            continue;
        };
        done.with_context(|| format!("cannot remove the unfinished checkpoint {}", path.display()))?;
    }
    Ok(())
}

/// Rank 0, before the others write: a fresh temp directory.
pub(crate) fn begin(run_dir: &Path, step: u64) -> Result<PathBuf> {
    let tmp = tmp_dir(run_dir, step);
    if tmp.exists() {
        fs::remove_dir_all(&tmp).with_context(|| format!("cannot clear {}", tmp.display()))?;
    }
    fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    Ok(tmp)
}

/// Any rank: writes one file into the checkpoint being built.
pub(crate) fn write_file(tmp: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    crate::files::write_atomic(&tmp.join(name), bytes, "checkpoint file")
}

/// The SHA-256 of a regular file, streamed (a checkpoint's model may be larger than memory allows twice).
fn sha256_file(path: &Path) -> Result<String> {
    let mut file = crate::files::open_regular(path, "checkpoint file")?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(format!("{:x}", hasher.finalize()))
}

/// Rank 0, after every rank wrote: checksums, rename into place, point `LATEST` at it, prune old ones.
pub(crate) fn commit(run_dir: &Path, step: u64, keep: usize) -> Result<PathBuf> {
    let tmp = tmp_dir(run_dir, step);
    let mut sums = BTreeMap::new();
    let mut names: Vec<String> = fs::read_dir(&tmp)?.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
    names.sort();
    for name in names {
        sums.insert(name.clone(), sha256_file(&tmp.join(&name))?);
    }
    let manifest = serde_json::to_string_pretty(&sums)?;
    crate::files::write_atomic(&tmp.join("manifest.json"), manifest.as_bytes(), "checkpoint manifest")?;
    crate::files::sync_dir(&tmp);
    let name = format!("step-{step}");
    let dest = ckpt_root(run_dir).join(&name);
    if dest.exists() {
        fs::remove_dir_all(&dest).with_context(|| format!("cannot replace {}", dest.display()))?;
    }
    fs::rename(&tmp, &dest).with_context(|| format!("cannot rename {} to {}", tmp.display(), dest.display()))?;
    crate::files::sync_dir(&ckpt_root(run_dir));
    crate::files::write_atomic(&ckpt_root(run_dir).join("LATEST"), name.as_bytes(), "checkpoint pointer")?;
    prune(run_dir, keep.max(1))?;
    Ok(dest)
}

fn prune(run_dir: &Path, keep: usize) -> Result<()> {
    let mut steps: Vec<u64> = fs::read_dir(ckpt_root(run_dir))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok()?.strip_prefix("step-")?.parse().ok())
        .collect();
    steps.sort_unstable();
    for s in steps.iter().rev().skip(keep) {
        let _ = fs::remove_dir_all(ckpt_root(run_dir).join(format!("step-{s}")));
    }
    Ok(())
}

/// The newest complete checkpoint of a run, verified against its manifest.
pub(crate) fn latest(run_dir: &Path) -> Result<(PathBuf, CheckpointState)> {
    let latest = ckpt_root(run_dir).join("LATEST");
    let meta = fs::symlink_metadata(&latest)
        .with_context(|| format!("{} has no checkpoint ({} is missing)", run_dir.display(), latest.display()))?;
    // A FIFO would block the read, a device never end it, a link lead outside the run.
    if !meta.is_file() {
        bail!(
            "{} is not a regular file (it is a {}): it must name a checkpoint `step-<N>`",
            latest.display(),
            kind(&meta)
        );
    }
    let name = crate::files::read_text(&latest, 256, "checkpoint pointer")?;
    let name = name.trim();
    // LATEST names a checkpoint of this run, never a path elsewhere.
    if !name.strip_prefix("step-").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())) {
        bail!(
            "{} is corrupt: it must name a checkpoint `step-<N>` inside {}, not `{name}`",
            latest.display(),
            ckpt_root(run_dir).display()
        );
    }
    let dir = ckpt_root(run_dir).join(name);
    match fs::symlink_metadata(&dir) {
        Ok(m) if m.is_dir() => {}
        Ok(m) => bail!(
            "{} names {}, which is a {}, not a checkpoint directory of this run",
            latest.display(),
            dir.display(),
            kind(&m)
        ),
        Err(e) => bail!("{} names {}, which cannot be read: {e}", latest.display(), dir.display()),
    }
    verify(&dir)?;
    let state_path = dir.join("state.json");
    let bytes = crate::files::read_regular(&state_path, crate::files::STATE_BYTES, "checkpoint state")?;
    let state: CheckpointState = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not a valid checkpoint state", state_path.display()))?;
    if !(OLDEST_FORMAT..=FORMAT).contains(&state.format) {
        bail!(
            "{}: checkpoint format {} is not supported (expected {OLDEST_FORMAT}..={FORMAT})",
            state_path.display(),
            state.format
        );
    }
    Ok((dir, state))
}

/// What a file system entry is, in words.
fn kind(m: &fs::Metadata) -> &'static str {
    qsr_data::file_kind(m.file_type())
}

/// Checks every file of a checkpoint against `manifest.json`.
pub(crate) fn verify(dir: &Path) -> Result<()> {
    let manifest = dir.join("manifest.json");
    if fs::symlink_metadata(&manifest).is_err() {
        bail!("checkpoint {} is incomplete: no manifest", dir.display());
    }
    // Bounded, and only a regular file: /dev/zero or a FIFO in its place must not grow or block a resume.
    let bytes = crate::files::read_regular(&manifest, crate::files::MANIFEST_BYTES, "checkpoint manifest")?;
    let sums: BTreeMap<String, String> =
        serde_json::from_slice(&bytes).with_context(|| format!("{} is corrupt", manifest.display()))?;
    if !sums.contains_key("state.json") || !sums.contains_key("model.safetensors") {
        bail!("{} does not list state.json and model.safetensors", manifest.display());
    }
    for (name, want) in &sums {
        if name.contains('/') || name.contains("..") {
            bail!("{} lists an invalid file name `{name}`", manifest.display());
        }
        let path = dir.join(name);
        match fs::symlink_metadata(&path) {
            Ok(m) if m.is_file() => {}
            Ok(m) => bail!("checkpoint file {} is a {}, not a regular file", path.display(), kind(&m)),
            Err(e) => bail!("checkpoint {} is incomplete: {}: {e}", dir.display(), path.display()),
        }
        let got = sha256_file(&path)?;
        if &got != want {
            bail!(
                "checkpoint file {} is corrupt: SHA-256 {got} does not match the manifest's {want}",
                dir.join(name).display()
            );
        }
    }
    Ok(())
}
