//! What every rank of a job agrees on before its first training collective: the binary's version, the
//! resolved recipe, where the run starts, and whether rank 0 may use the run directory.
//!
//! Ranks launched with different recipes (a `--set` on one rank only, an edited file on one host) would
//! otherwise train different models and only fail hundreds of collectives later, if at all. Rank 0
//! broadcasts its [`LaunchFacts`]; every rank compares them with its own; one all-reduce tells every rank
//! which ranks differ; the first differing rank broadcasts the keys that differ, so every rank refuses
//! with the same message.

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};
use qsr_comm::{Collective, ReduceOp};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::train_recipe::TrainRecipe;

/// What one rank was launched with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LaunchFacts {
    /// The `qsr` version (`CARGO_PKG_VERSION`).
    pub version: String,
    /// The resolved recipe, as JSON (every key, after `--set` and launch overrides).
    pub recipe: Value,
    /// The checkpoint step this rank resumes from (`None`: a fresh run).
    pub resume_step: Option<u64>,
    /// Rank 0 only: why the run cannot start (the run directory is locked by another run, ...).
    pub refusal: Option<String>,
}

impl LaunchFacts {
    /// The facts of this process for `recipe`.
    pub fn new(recipe: &TrainRecipe, resume_step: Option<u64>) -> Result<Self> {
        Ok(Self { version: env!("CARGO_PKG_VERSION").to_string(), recipe: serde_json::to_value(recipe)?, resume_step, refusal: None })
    }

    /// The keys in which `other` (rank `rank`) differs from these facts (rank 0's), one line each.
    pub fn differences(&self, other: &LaunchFacts, rank: usize) -> Vec<String> {
        let mut out = Vec::new();
        if self.version != other.version {
            out.push(format!("qsr version: rank 0 runs {}, rank {rank} runs {}", self.version, other.version));
        }
        if self.resume_step != other.resume_step {
            let at = |s: Option<u64>| s.map_or_else(|| "a fresh run".to_string(), |s| format!("the checkpoint at step {s}"));
            out.push(format!("start: rank 0 starts from {}, rank {rank} from {}", at(self.resume_step), at(other.resume_step)));
        }
        for d in differing_keys(&self.recipe, &other.recipe) {
            out.push(format!("`{}`: rank 0 has {}, rank {rank} has {}", d.key, d.left, d.right));
        }
        out
    }
}

/// One setting that differs between two recipes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyDiff {
    /// Dotted key, e.g. `schedule.lr_max`.
    pub key: String,
    /// The value on the left side (`absent` when missing), as TOML-like text.
    pub left: String,
    pub right: String,
}

/// The dotted keys whose values differ between two JSON trees (recipes), sorted.
pub fn differing_keys(left: &Value, right: &Value) -> Vec<KeyDiff> {
    let (mut l, mut r) = (BTreeMap::new(), BTreeMap::new());
    flatten("", left, &mut l);
    flatten("", right, &mut r);
    let keys: std::collections::BTreeSet<&String> = l.keys().chain(r.keys()).collect();
    let text = |v: Option<&Value>| v.map_or_else(|| "absent".to_string(), Value::to_string);
    keys.into_iter()
        .filter(|k| l.get(*k) != r.get(*k))
        .map(|k| KeyDiff { key: k.clone(), left: text(l.get(k)), right: text(r.get(k)) })
        .collect()
}

/// Leaves of a JSON tree by dotted path (arrays and scalars are leaves; `null` means absent).
fn flatten(prefix: &str, v: &Value, out: &mut BTreeMap<String, Value>) {
    match v {
        Value::Object(map) => {
            for (k, child) in map {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                flatten(&key, child, out);
            }
        }
        Value::Null => {}
        leaf => {
            out.insert(prefix.to_string(), leaf.clone());
        }
    }
}

/// Makes every rank agree on rank 0's [`LaunchFacts`] before the first training collective: `Ok` on
/// every rank, or the same error (naming the differing ranks and keys) on every rank.
pub fn agree(comm: &mut dyn Collective, mine: &LaunchFacts) -> Result<()> {
    let (rank, k) = (comm.rank(), comm.world_size());
    let during = "while the ranks compared their launch settings";
    let mut bytes = if rank == 0 { serde_json::to_vec(mine)? } else { Vec::new() };
    comm.broadcast_bytes(&mut bytes, 0).context(during)?;
    let first: LaunchFacts = serde_json::from_slice(&bytes).context("rank 0 sent launch settings this rank cannot read")?;
    if let Some(why) = &first.refusal {
        bail!("rank 0 refused to start: {why}");
    }
    let diffs = if rank == 0 { Vec::new() } else { first.differences(mine, rank) };
    let mut flags = vec![0.0f32; k];
    flags[rank] = if diffs.is_empty() { 0.0 } else { 1.0 };
    comm.all_reduce(&mut flags, ReduceOp::Sum).context(during)?;
    let differing: Vec<usize> = (0..k).filter(|&r| flags[r] > 0.0).collect();
    let Some(&reporter) = differing.first() else {
        return Ok(());
    };
    let mut detail = if rank == reporter { diffs.join("; ").into_bytes() } else { Vec::new() };
    comm.broadcast_bytes(&mut detail, reporter).context(during)?;
    let ranks = differing.iter().map(usize::to_string).collect::<Vec<_>>().join(", ");
    let who = if differing.len() == 1 { format!("rank {ranks} differs") } else { format!("ranks {ranks} differ") };
    bail!("the ranks were launched with different settings ({who} from rank 0); rank {reporter}: {}", String::from_utf8_lossy(&detail))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn differing_keys_names_nested_keys_and_absent_ones() {
        let a = json!({"seed": 0, "sync": {"rule": "qsr", "h_base": 2}, "train": {"steps": null}});
        let b = json!({"seed": 7, "sync": {"rule": "qsr", "h_base": 2}, "train": {"steps": 100}});
        let d = differing_keys(&a, &b);
        let keys: Vec<&str> = d.iter().map(|d| d.key.as_str()).collect();
        assert_eq!(keys, ["seed", "train.steps"]);
        assert_eq!((d[1].left.as_str(), d[1].right.as_str()), ("absent", "100"));
    }
}
