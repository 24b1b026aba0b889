//! Errors of model construction.

/// Why a model could not be built.
///
/// Every variant names the offending setting, so that a bad run configuration is reported against
/// the field the user wrote (for example `depth`), not as a panic deep inside burn.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// A field of the model configuration has a value the model cannot be built with.
    #[error("invalid model config for `{kind}`: field `{field}`: {reason}")]
    InvalidConfig {
        /// The model kind (`resnet`, `cifar-resnet`, `vit`, `cnn`, `mlp`).
        kind: &'static str,
        /// The name of the bad field, as written in the configuration.
        field: &'static str,
        /// What is wrong and which values are allowed.
        reason: String,
    },
    /// The input shape or class count does not fit the model.
    #[error("model `{kind}` cannot take this input: `{field}`: {reason}")]
    InvalidInput {
        /// The model kind.
        kind: &'static str,
        /// `input.channels`, `input.height`, `input.width` or `classes`.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
}

impl ModelError {
    /// The name of the field the error is about.
    pub fn field(&self) -> &'static str {
        match self {
            ModelError::InvalidConfig { field, .. } | ModelError::InvalidInput { field, .. } => field,
        }
    }

    pub(crate) fn config(kind: &'static str, field: &'static str, reason: impl Into<String>) -> Self {
        ModelError::InvalidConfig { kind, field, reason: reason.into() }
    }

    pub(crate) fn input(kind: &'static str, field: &'static str, reason: impl Into<String>) -> Self {
        ModelError::InvalidInput { kind, field, reason: reason.into() }
    }
}
