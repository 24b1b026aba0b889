//! Whole resume, checked on the examples users copy: a run interrupted after an epoch and started
//! again ends with the same bits as the run that was never interrupted.
//!
//! Each example saves after every epoch into `DIR/epoch-E` (`DIR/rank-R/epoch-E` for ranks) and
//! resumes from its latest save. The check runs it to the end into `whole/`, copies `whole/` into
//! `resumed/` without the saves after epoch [`RESUME_AFTER`] (the state an interruption there leaves),
//! runs it again on `resumed/`, and compares every file of the two trees: models, optimizer and
//! scheduler states (burnpack files, by their contents) and an averager's state (byte for byte).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{Totals, target_dir};

/// The epoch after which the interrupted run stops (the examples train 4).
const RESUME_AFTER: u64 = 2;

/// (package, example, run as 2 ranks under `qsr launch`).
const RESUMED_EXAMPLES: [(&str, &str, bool); 2] = [("qsr-optim", "burn_plain", false), ("qsr-optim", "burn_qsr", true)];

/// Runs the check on each built example of [`RESUMED_EXAMPLES`].
pub(crate) fn run() -> Result<Totals> {
    let mut totals = Totals::default();
    for (package, example, launched) in RESUMED_EXAMPLES {
        let dir = target_dir().join("resume-check").join(example);
        check(example, launched, &dir)
            .with_context(|| format!("{package}/{example} resumed after epoch {RESUME_AFTER}"))?;
        println!("example {package}/{example} resumed after epoch {RESUME_AFTER} equals the whole run ... ok");
        totals.passed += 1;
    }
    Ok(totals)
}

fn check(example: &str, launched: bool, dir: &Path) -> Result<()> {
    let (whole, resumed) = (dir.join("whole"), dir.join("resumed"));
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("cannot remove {}", dir.display()))?;
    }
    let first = run_example(example, launched, &whole)?;
    if first.contains("resuming") {
        bail!("the first run resumed from a save it should not have found");
    }
    copy_until(&whole, &resumed)?;
    let second = run_example(example, launched, &resumed)?;
    let said = format!("resuming after epoch {RESUME_AFTER}");
    if second.matches(&said).count() != if launched { 2 } else { 1 } {
        bail!("the second run did not say `{said}` on every rank");
    }
    let (a, b) = (files(&whole)?, files(&resumed)?);
    if a != b {
        bail!("the runs saved different files: {a:?} and {b:?}");
    }
    for name in &a {
        let read =
            |root: &Path| std::fs::read(root.join(name)).with_context(|| format!("cannot read {}", name.display()));
        let (x, y) = (read(&whole)?, read(&resumed)?);
        let same = if name.extension().is_some_and(|e| e == "bpk") {
            burnpack(&x).with_context(|| format!("{} of the whole run", name.display()))?
                == burnpack(&y).with_context(|| format!("{} of the resumed run", name.display()))?
        } else {
            x == y
        };
        if !same {
            bail!("{} differs between the whole run and the resumed one", name.display());
        }
    }
    if a.len() < 4 * 3 {
        bail!("the runs saved {} files, fewer than a model, optimizer and scheduler per epoch", a.len());
    }
    Ok(())
}

/// A burnpack file's contents in an order of their own: its metadata (each tensor's name, dtype, shape
/// and parameter id, the scalars) without the tensors' places in the file, and each tensor's bytes by
/// name. burn writes an optimizer's tensors in the order of a hash map, so two equal states can be two
/// files. The format: a 10-byte header (magic "BURN", u16 version, u32 metadata size, little-endian),
/// CBOR metadata, then the tensors' bytes from the next 256-byte boundary (burn-pack's docs).
fn burnpack(bytes: &[u8]) -> Result<(ciborium::Value, BTreeMap<String, Vec<u8>>)> {
    use ciborium::Value;
    let header = bytes.get(..10).context("shorter than a burnpack header")?;
    if header[..4] != 0x4255_524E_u32.to_le_bytes() {
        bail!("not a burnpack file (no BURN magic)");
    }
    let size = u32::from_le_bytes(header[6..10].try_into()?) as usize;
    let meta = bytes.get(10..10 + size).context("shorter than its metadata")?;
    let mut meta: Value = ciborium::de::from_reader(meta).context("unreadable CBOR metadata")?;
    let data = (10 + size).div_ceil(256) * 256;
    let tensors = meta.as_map_mut().and_then(|m| m.iter_mut().find(|(k, _)| k.as_text() == Some("tensors")));
    let Some((_, Value::Map(tensors))) = tensors else { bail!("metadata without a tensors map") };
    let mut contents = BTreeMap::new();
    for (name, descriptor) in tensors.iter_mut() {
        let name = name.as_text().context("a tensor name that is not text")?.to_string();
        let fields = descriptor.as_map_mut().with_context(|| format!("tensor {name}: no descriptor"))?;
        let at = fields.iter().position(|(k, _)| k.as_text() == Some("data_offsets"));
        let (_, offsets) = fields.remove(at.with_context(|| format!("tensor {name}: no data_offsets"))?);
        let range: Vec<usize> = offsets
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_integer().and_then(|i| usize::try_from(i).ok()))
            .collect();
        let [start, end] = range[..] else { bail!("tensor {name}: data_offsets is not a pair") };
        let tensor =
            bytes.get(data + start..data + end).with_context(|| format!("tensor {name}: past the file's end"))?;
        contents.insert(name, tensor.to_vec());
    }
    Ok((meta, contents))
}

/// Runs `example` with `ckpt` as its argument, alone or as 2 ranks, and returns its stdout.
fn run_example(example: &str, launched: bool, ckpt: &Path) -> Result<String> {
    let binary = target_dir().join("release/examples").join(example);
    let mut c = if launched {
        let mut c = Command::new(target_dir().join("release/qsr"));
        c.args(["launch", "--nproc", "2", "--"]).arg(binary);
        c
    } else {
        Command::new(binary)
    };
    c.arg(ckpt);
    eprintln!("xtask: {c:?}");
    let out = c.output().with_context(|| format!("cannot start {c:?}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!("{c:?} failed ({})", out.status);
    }
    Ok(stdout)
}

/// Copies the tree `from` into `to`, leaving out the saves of epochs after [`RESUME_AFTER`].
fn copy_until(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to).with_context(|| format!("cannot create {}", to.display()))?;
    for entry in std::fs::read_dir(from).with_context(|| format!("cannot read {}", from.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        let epoch = name.to_str().and_then(|n| n.strip_prefix("epoch-")?.parse::<u64>().ok());
        if epoch.is_some_and(|e| e > RESUME_AFTER) {
            continue;
        }
        let (src, dst) = (entry.path(), to.join(&name));
        if entry.file_type()?.is_dir() {
            copy_until(&src, &dst)?;
        } else {
            std::fs::copy(&src, &dst).with_context(|| format!("cannot copy {}", src.display()))?;
        }
    }
    Ok(())
}

/// The files under `root`, as sorted paths relative to it.
fn files(root: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut dirs = vec![PathBuf::new()];
    while let Some(rel) = dirs.pop() {
        let dir = root.join(&rel);
        for entry in std::fs::read_dir(&dir).with_context(|| format!("cannot read {}", dir.display()))? {
            let entry = entry?;
            let path = rel.join(entry.file_name());
            if entry.file_type()?.is_dir() { dirs.push(path) } else { out.push(path) }
        }
    }
    out.sort();
    Ok(out)
}
