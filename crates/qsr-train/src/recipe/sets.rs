//! `--set key=value` overrides of a recipe's keys, and switching a `[sync]` table's rule, which
//! `--set sync.rule=...` and `--sync` share.

use anyhow::{Result, anyhow, bail};
use toml::{Table, Value};

/// Applies `key=value` overrides (dotted keys, TOML values; a bare word is a string); `key=` with no
/// value drops the recipe's key (`--set sync.alpha= --set sync.budget=0.1`: budget and alpha are one
/// knob, and a recipe holding one refuses the other beside it).
pub(crate) fn apply_sets(root: &mut Table, sets: &[String]) -> Result<()> {
    for set in sets {
        let (key, raw) = set.split_once('=').ok_or_else(|| anyhow!("--set {set}: expected key=value"))?;
        let key = key.trim();
        if raw.trim().is_empty() {
            remove_key(root, key);
            continue;
        }
        let value = parse_value(raw.trim()).map_err(|why| anyhow!("--set {set}: {why}"))?;
        let parts: Vec<&str> = key.split('.').collect();
        if parts.iter().any(|p| p.is_empty()) {
            bail!("--set {set}: `{key}` is not a dotted key");
        }
        let mut table = &mut *root;
        for (i, part) in parts[..parts.len() - 1].iter().enumerate() {
            let entry = table.entry(part.to_string()).or_insert_with(|| Value::Table(Table::new()));
            table = entry
                .as_table_mut()
                .ok_or_else(|| anyhow!("--set {set}: `{}` is not a table", parts[..=i].join(".")))?;
        }
        match (key, value.as_str()) {
            // Switching the rule drops the old rule's settings, as `--sync` does.
            ("sync.rule", Some(rule)) => switch_rule(table, rule),
            // A new alpha was not chosen from the budget a resolved recipe records.
            ("sync.alpha", _) => {
                table.remove("from_budget");
                table.insert("alpha".into(), value);
            }
            _ => {
                table.insert(parts[parts.len() - 1].to_string(), value);
            }
        }
    }
    Ok(())
}

/// Removes the dotted `key` from `root`, if it is there.
fn remove_key(root: &mut Table, key: &str) {
    let (path, last) = key.rsplit_once('.').unwrap_or(("", key));
    let mut table = root;
    for part in path.split('.').filter(|p| !p.is_empty()) {
        match table.get_mut(part).and_then(Value::as_table_mut) {
            Some(t) => table = t,
            None => return,
        }
    }
    table.remove(last);
}

/// A TOML value, or a bare word as a string (`--set data.path=/data/x`). Text that starts like a TOML
/// string, array or table must parse as one: `name="abc` is an error, not the literal `"abc`.
fn parse_value(raw: &str) -> Result<Value, String> {
    match format!("v = {raw}").parse::<Table>() {
        Ok(mut t) => t.remove("v").ok_or_else(|| format!("`{raw}` is not a single value")),
        Err(e) if raw.starts_with(['"', '\'', '[', '{']) => {
            Err(format!("`{raw}` is not a valid TOML value: {}", e.message().trim()))
        }
        Err(_) => Ok(Value::String(raw.to_string())),
    }
}

/// Keys each sync rule accepts, so switching the rule from the command line keeps what still applies.
fn rule_keys(rule: &str) -> &'static [&'static str] {
    match rule {
        "constant" => &["h"],
        "post-local" => &["switch_step", "h"],
        "power" => &["h_base", "alpha", "power"],
        "qsr" => &["h_base", "alpha", "from_budget"],
        "exponential" => &["h_base", "scaler", "h_max"],
        _ => &[],
    }
}

/// Makes `rule` the `[sync]` table's rule, dropping the settings of the old rule that the new one does
/// not take (`--sync` and `--set sync.rule=...`: a qsr recipe switched to dp keeps no `alpha`). A
/// budget stays: under another rule it is refused, naming both keys, not dropped.
pub(super) fn switch_rule(sync: &mut Table, rule: &str) {
    let old = sync.get("rule").and_then(Value::as_str).map(str::to_string);
    if old.as_deref() != Some(rule) {
        let keep = rule_keys(rule);
        sync.retain(|k, _| keep.contains(&k) || k == "local" || k == "streaming" || k == "budget");
        if rule == "power" && !sync.contains_key("power") && old.as_deref() == Some("qsr") {
            sync.insert("power".into(), Value::Float(2.0));
        }
    }
    sync.insert("rule".into(), Value::String(rule.to_string()));
}
