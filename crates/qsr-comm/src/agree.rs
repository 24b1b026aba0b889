//! Agreement on settings before the first collective (documented on [`agree`]).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::{Collective, CommError, ReduceOp};

/// One setting that differs between two JSON trees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyDiff {
    /// Dotted key, e.g. `schedule.lr_max`.
    pub key: String,
    /// The value on the left side as JSON text (`absent` when missing).
    pub left: String,
    /// The value on the right side as JSON text (`absent` when missing).
    pub right: String,
}

/// The dotted keys whose values differ between two JSON trees, sorted; `null` counts as absent.
pub fn differing_keys(left: &Value, right: &Value) -> Vec<KeyDiff> {
    let (mut l, mut r) = (BTreeMap::new(), BTreeMap::new());
    flatten("", left, &mut l);
    flatten("", right, &mut r);
    let keys: BTreeSet<&String> = l.keys().chain(r.keys()).collect();
    let text = |v: Option<&Value>| v.map_or_else(|| "absent".to_string(), Value::to_string);
    keys.into_iter()
        .filter(|k| l.get(*k) != r.get(*k))
        .map(|k| KeyDiff { key: k.clone(), left: text(l.get(k)), right: text(r.get(k)) })
        .collect()
}

/// Leaves of a JSON tree by dotted path (arrays and scalars are leaves).
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

/// Makes every rank check its `settings` against rank 0's: `Ok` on every rank, or on every rank the
/// same [`CommError::Disagree`] naming the differing ranks and, for the first of them, the keys.
///
/// Call it before the first collective: every rank compares what it was configured with against rank
/// 0's, so that ranks launched with different settings fail at once, naming the settings, instead of
/// training different things and failing (or not) hundreds of collectives later.
///
/// Rank 0 broadcasts its settings as JSON; each rank lists the dotted keys in which its own differ
/// ([`differing_keys`]); one all-reduce of mismatch flags tells every rank which ranks differ; the
/// first of them broadcasts its list, so every rank returns the same error.
///
/// ```
/// use qsr_comm::{Collective, InProcessGroup, agree};
/// use serde_json::json;
///
/// let handles = InProcessGroup::new(2);
/// let results: Vec<_> = std::thread::scope(|s| {
///     let joins: Vec<_> = handles
///         .into_iter()
///         .map(|mut comm| {
///             s.spawn(move || {
///                 let seed = if comm.rank() == 1 { 7 } else { 0 };
///                 agree(&mut comm, &json!({ "seed": seed, "sync": { "rule": "qsr" } }))
///             })
///         })
///         .collect();
///     joins.into_iter().map(|j| j.join().unwrap()).collect()
/// });
/// for r in results {
///     assert!(r.unwrap_err().to_string().contains("`seed`: rank 0 has 0, rank 1 has 7"));
/// }
/// ```
pub fn agree(comm: &mut dyn Collective, settings: &Value) -> Result<(), CommError> {
    let (rank, k) = (comm.rank(), comm.world_size());
    let mut bytes = if rank == 0 { serde_json::to_vec(settings).unwrap_or_default() } else { Vec::new() };
    comm.broadcast_bytes(&mut bytes, 0)?;
    let first: Value = serde_json::from_slice(&bytes)
        .map_err(|e| CommError::Protocol { peer: "rank 0".into(), detail: format!("settings are not JSON: {e}") })?;
    // Compared as every rank reads rank 0's, through the same text and parser: serde_json's parser
    // (without `float_roundtrip`) may read a float one unit in the last place off, alike on every rank.
    let own: Value =
        serde_json::to_vec(settings).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
    let diffs: Vec<String> = differing_keys(&first, &own)
        .into_iter()
        .map(|d| format!("`{}`: rank 0 has {}, rank {rank} has {}", d.key, d.left, d.right))
        .collect();
    let mut flags = vec![0.0f32; k];
    flags[rank] = if diffs.is_empty() { 0.0 } else { 1.0 };
    comm.all_reduce(&mut flags, ReduceOp::Sum)?;
    let ranks: Vec<usize> = (0..k).filter(|&r| flags[r] > 0.0).collect();
    let Some(&reporter) = ranks.first() else {
        return Ok(());
    };
    let mut detail = if rank == reporter { diffs.join("; ").into_bytes() } else { Vec::new() };
    comm.broadcast_bytes(&mut detail, reporter)?;
    Err(CommError::Disagree { ranks, detail: String::from_utf8_lossy(&detail).into_owned() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::InProcessGroup;
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

    /// Every rank gets the same error naming every differing rank and the first one's keys; equal
    /// settings agree.
    #[test]
    fn every_rank_reports_the_same_disagreement() {
        let settings = |rank: usize| match rank {
            1 => json!({"sync": {"h_base": 4}, "seed": 0}),
            3 => json!({"sync": {"h_base": 2}, "seed": 1}),
            _ => json!({"sync": {"h_base": 2}, "seed": 0}),
        };
        let run = |settings: &(dyn Fn(usize) -> Value + Sync)| -> Vec<Result<(), CommError>> {
            std::thread::scope(|s| {
                let joins: Vec<_> = InProcessGroup::new(4)
                    .into_iter()
                    .map(|mut c| {
                        s.spawn(move || {
                            let mine = settings(c.rank());
                            agree(&mut c, &mine)
                        })
                    })
                    .collect();
                joins.into_iter().map(|j| j.join().unwrap()).collect()
            })
        };
        let errors: Vec<String> = run(&settings).into_iter().map(|r| r.unwrap_err().to_string()).collect();
        assert!(errors.iter().all(|e| e == &errors[0]), "{errors:?}");
        assert!(
            errors[0].contains("ranks 1, 3 differ from rank 0")
                && errors[0].contains("`sync.h_base`: rank 0 has 2, rank 1 has 4"),
            "{}",
            errors[0]
        );
        assert!(run(&|_| json!({"seed": 0})).into_iter().all(|r| r.is_ok()));
    }
}
