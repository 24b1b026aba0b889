//! [`ConfigError`]: an invalid schedule or sync setting, named by its recipe key.

use std::fmt;

/// An invalid schedule or sync-rule setting. `field` is the dotted name of the setting as it appears in a
/// recipe (`schedule.warmup_steps`, `sync.h_base`), so a user can find it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub struct ConfigError {
    /// Dotted recipe name of the offending setting, e.g. `sync.h_base` or `schedule.decay_points[1]`.
    pub field: String,
    /// Why the value is refused, with the value itself (e.g. `must be at least 1 (got 0)`).
    pub reason: String,
}

impl ConfigError {
    pub(crate) fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self { field: field.into(), reason: reason.into() }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid `{}`: {}", self.field, self.reason)
    }
}

/// `Err` unless `value` is finite and strictly positive.
pub(crate) fn positive(field: &str, value: f64) -> Result<(), ConfigError> {
    if !value.is_finite() {
        return Err(ConfigError::new(field, format!("must be a finite number (got {value})")));
    }
    if value <= 0.0 {
        return Err(ConfigError::new(field, format!("must be > 0 (got {value})")));
    }
    Ok(())
}
