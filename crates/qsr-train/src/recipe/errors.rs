//! A recipe section's deserialization errors, named by their key: below the recipe's readers
//! (`train.rs`, `plan.rs`), which both report them.

use toml::Value;

/// Why `value` is not a `T`: the path of the key that failed inside it (empty when serde cannot say,
/// as under a flattened field) and serde's message.
pub(super) fn check<T: serde::de::DeserializeOwned>(value: &Value) -> Option<(String, String)> {
    let e = serde_path_to_error::deserialize::<_, T>(value.clone()).err()?;
    let path = e.path().to_string();
    let path = if path == "." { String::new() } else { path };
    let message = e.into_inner().message().trim().to_string();
    // A name given as a number (`outer.unit=1`) reads "invalid type: unit variant, expected string
    // only" (issue 56 D12): asked again as a string, serde lists the names.
    let message = match message.contains("unit variant").then(|| as_string_at(value, &path)).flatten() {
        Some(retry) => match serde_path_to_error::deserialize::<_, T>(retry) {
            Err(again) => format!("{} (a name, in quotes)", again.into_inner().message().trim()),
            Ok(_) => message,
        },
        None => message,
    };
    Some((path, message))
}

/// `value` with the number or bool at the dotted `path` replaced by its text.
pub(super) fn as_string_at(value: &Value, path: &str) -> Option<Value> {
    let mut copy = value.clone();
    let mut at = &mut copy;
    for key in path.split('.').filter(|k| !k.is_empty()) {
        at = at.as_table_mut()?.get_mut(key)?;
    }
    let text = match at {
        Value::Integer(i) => i.to_string(),
        Value::Float(f) => f.to_string(),
        Value::Boolean(b) => b.to_string(),
        _ => return None,
    };
    *at = Value::String(text);
    Some(copy)
}

/// A section's deserialization error naming its key when known: ``invalid `sync.streaming.fragments`:
/// ...``, else `[section] ...`.
pub(super) fn name_error(section: &str, (path, message): (String, String)) -> String {
    if path.is_empty() { format!("[{section}] {message}") } else { format!("invalid `{section}.{path}`: {message}") }
}
