//! What a run writes about itself: `metrics.jsonl` records and `summary.json`.

use std::fs::{self, File};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::checkpoint::Counters;

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Record {
    /// `sync`, `eval`, or `membership` (an elastic run's change of workers, at the step it continues from).
    pub kind: String,
    /// Steps completed.
    pub step: u64,
    /// Epochs completed: `step / steps_per_epoch` (fractional).
    pub epoch: f64,
    /// Learning rate of the last step completed.
    pub lr: f64,
    /// Length of the round that just ended (sync) or is under way (eval).
    pub h: u64,
    /// Rank 0's mean training loss since the previous sync record, over the steps whose loss was
    /// finite (sync; `null` when none was); test loss (eval).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    /// Top-1 test accuracy as a fraction in `[0, 1]` (eval records only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accuracy: Option<f64>,
    /// Top-1 accuracy and mean loss on the `eval.train_items` training images (eval records of runs
    /// that set it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train: Option<Fit>,
    /// Synchronizations so far (counted across resumes).
    pub syncs: u64,
    /// Bytes rank 0 sent for synchronizations so far.
    pub bytes: u64,
    /// Seconds rank 0 spent in synchronizations so far.
    pub comm_seconds: f64,
    /// Seconds of training so far (across resumes, excluding the time between a stop and its resume).
    pub wall_seconds: f64,
    /// Local averages inside rank 0's node so far (two-level runs; `syncs` counts the global ones).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub local_syncs: u64,
    /// Bytes rank 0 sent for local averages so far.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub local_bytes: u64,
    /// The change of a `membership` record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub membership: Option<MembershipChange>,
}

/// A change of an elastic run's workers (`qsr train --elastic`): a `membership` record of
/// `metrics.jsonl` and an entry of `summary.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct MembershipChange {
    /// The generation that formed (0 is the first; one more per change).
    pub generation: u64,
    /// Workers in it.
    pub world_size: usize,
    /// Workers of the previous generation left out, by their rank there, with the store's reason.
    pub lost: Vec<qsr_elastic::Lost>,
    /// Ranks of the workers that joined.
    pub joined: Vec<usize>,
    /// What the survivors saw: the failure that ended the round, or the admission of new workers.
    pub reason: String,
    /// Rounds abandoned: 1 when a round was under way, 0 when the change came at a sync.
    pub rounds_lost: u64,
    /// Steps trained again because the round they belonged to was abandoned.
    pub steps_lost: u64,
}

/// JSON writes a float that is not finite as `null`; read it back as NaN.
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The local level of a two-level run in `summary.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct LocalLevel {
    /// The local rule's name.
    pub rule: String,
    /// Workers in rank 0's node.
    pub node_size: usize,
    /// Local averages performed (counted across resumes).
    pub syncs: u64,
    /// Local averages in the plan.
    pub planned_syncs: u64,
    /// Bytes rank 0 sent for local averages over the run.
    pub bytes_per_rank: u64,
    /// Seconds rank 0 spent in local averages over the run.
    pub comm_seconds: f64,
}

/// Top-1 accuracy and mean loss of one evaluation (the training images of `eval.train_items`, the
/// workers' own models before the last average).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub(crate) struct Fit {
    /// Top-1 accuracy as a fraction in `[0, 1]`.
    pub accuracy: f64,
    /// Mean loss (`null` in the file when it is not finite).
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
}

/// `summary.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Summary {
    /// The recipe's `name`.
    pub name: String,
    /// The sync rule's name (`dp`, `constant`, `qsr`, ...).
    pub rule: String,
    /// The recipe's `seed`.
    pub seed: u64,
    /// K: the number of workers.
    pub world_size: usize,
    /// Steps of the whole run (the plan's end step, including steps done before a resume).
    pub steps: u64,
    /// `steps / steps_per_epoch`.
    pub epochs: f64,
    /// Steps per epoch: `floor(N / (K * train.local_batch))` for N training images.
    pub steps_per_epoch: usize,
    /// Top-1 accuracy of the final evaluation, as a fraction in `[0, 1]`: of the test images' class, or
    /// of the next token of the validation windows (language models).
    pub final_test_accuracy: f64,
    /// Mean loss of the final evaluation: on the test split, or per token on the validation windows
    /// (`null` in the file when it is not finite: a diverged run's).
    #[serde(deserialize_with = "nan_if_null")]
    pub final_test_loss: f64,
    /// The final evaluation on the `eval.train_items` training images, where the recipe sets it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_train: Option<Fit>,
    /// Global synchronizations performed (counted across resumes).
    pub syncs: u64,
    /// Global synchronizations in the plan (its rounds).
    pub planned_syncs: u64,
    /// The local level of a two-level run (`[sync.local]`), counted apart from the global one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<LocalLevel>,
    /// The plan's `100 * rounds / steps`: data parallel is 100.
    pub comm_percent: f64,
    /// Bytes rank 0 sent for synchronizations over the run.
    pub bytes_per_rank: u64,
    /// Seconds rank 0 spent in synchronizations over the run.
    pub comm_seconds: f64,
    /// Seconds of training over the run (excluding the time between a stop and its resume).
    pub wall_seconds: f64,
    /// Steps this process ran divided by its own wall time (this segment only after a resume).
    pub steps_per_second: f64,
    /// Updates skipped for non-finite gradients.
    pub skipped_updates: u64,
    /// Language models: the unigram entropy of the training tokens in nats, the loss of a predictor that
    /// ignores the context, which `final_test_loss` (the validation loss) should fall well below.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unigram_entropy: Option<f64>,
    /// The changes of workers of an elastic run, in order (`world_size` is the last generation's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub membership: Vec<MembershipChange>,
    /// Why the run diverged, when it did (`qsr` then exits with status 4; the final evaluation is
    /// the one that saw it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diverged: Option<String>,
    /// Why the run did not train, when its final evaluation was no better than chance (`qsr` then
    /// exits with status 6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_trained: Option<String>,
    /// The workers' own models, evaluated as the final model is one step before the run's last
    /// average (when that step ends a round of local steps): beside `final_test_accuracy`, what the
    /// last average cost; `qsr` warns when it lost more than 5 points (0.1 nats for text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers_before_last_average: Option<Fit>,
}

impl Record {
    /// A `kind` record at `step` with the run's counters `c`, and no loss, accuracy or membership.
    pub(crate) fn counted(kind: &str, step: u64, epoch: f64, lr: f64, h: u64, c: Counters) -> Record {
        Record {
            kind: kind.into(),
            step,
            epoch,
            lr,
            h,
            loss: None,
            accuracy: None,
            train: None,
            syncs: c.syncs,
            bytes: c.bytes,
            comm_seconds: c.comm_seconds,
            wall_seconds: c.wall_seconds,
            local_syncs: c.local_syncs,
            local_bytes: c.local_bytes,
            membership: None,
        }
    }
}

/// The membership records of a run's `metrics.jsonl`, in order (none outside elastic runs).
pub(crate) fn membership_changes(run_dir: &Path) -> Vec<MembershipChange> {
    let Ok(file) = crate::files::open_regular(&run_dir.join("metrics.jsonl"), "metrics file") else {
        return Vec::new();
    };
    BufReader::new(file)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str::<Record>(&l).ok()?.membership)
        .collect()
}

/// `metrics.jsonl` of rank 0; on resume, records past the checkpoint are dropped first.
pub(crate) struct Metrics {
    file: File,
}

impl Metrics {
    pub(crate) fn open(run_dir: &Path, resume_at: Option<u64>) -> Result<Self> {
        let path = run_dir.join("metrics.jsonl");
        if let Some(step) = resume_at
            && path.exists()
        {
            let kept: Vec<String> = BufReader::new(crate::files::open_regular(&path, "metrics file")?)
                .lines()
                .map_while(Result::ok)
                .filter(|l| serde_json::from_str::<Record>(l).is_ok_and(|r| r.step <= step))
                .collect();
            let mut text = kept.join("\n");
            if !text.is_empty() {
                text.push('\n');
            }
            crate::files::write_atomic(&path, text.as_bytes(), "metrics file")?;
        } else if resume_at.is_none() && path.exists() {
            fs::remove_file(&path).with_context(|| format!("cannot replace {}", path.display()))?;
        }
        let file = qsr_files::append(&path, "metrics file")?;
        Ok(Self { file })
    }

    /// Appends a record as one write, so that a process killed while writing leaves no half line.
    pub(crate) fn write(&mut self, r: &Record) -> Result<()> {
        let mut line = serde_json::to_string(r)?;
        line.push('\n');
        self.file.write_all(line.as_bytes())?;
        Ok(())
    }

    /// Appends those of `records` the file lacks (by kind and step).
    pub(crate) fn restore<'a>(&mut self, run_dir: &Path, records: impl Iterator<Item = &'a Record>) -> Result<()> {
        let have: Vec<(String, u64)> =
            BufReader::new(crate::files::open_regular(&run_dir.join("metrics.jsonl"), "metrics file")?)
                .lines()
                .map_while(Result::ok)
                .filter_map(|l| serde_json::from_str::<Record>(&l).ok())
                .map(|r| (r.kind, r.step))
                .collect();
        for r in records {
            if !have.iter().any(|(kind, step)| *kind == r.kind && *step == r.step) {
                self.write(r)?;
            }
        }
        Ok(())
    }
}
