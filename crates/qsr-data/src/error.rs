//! One error type for everything that can go wrong reading data: every variant that concerns a file names it,
//! so that a user with a broken download sees which file and what is wrong instead of a panic.

use std::path::PathBuf;

/// Errors of dataset readers, the sampler and the loaders.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// An I/O error (including a corrupt gzip stream) while reading `path`.
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A directory that must exist does not.
    #[error("{}: missing directory ({what})", .path.display())]
    MissingDir { path: PathBuf, what: String },
    /// None of the candidate file names exists.
    #[error("{}: missing file ({what})", .path.display())]
    MissingFile { path: PathBuf, what: String },
    /// The file does not start with the expected magic number.
    #[error("{}: wrong magic number {found:#010x}, expected {expected}", .path.display())]
    BadMagic {
        path: PathBuf,
        found: u32,
        expected: String,
    },
    /// The file is shorter than its header (or record size) says.
    #[error("{}: truncated file: {detail}", .path.display())]
    Truncated { path: PathBuf, detail: String },
    /// An image file and its label file disagree on the number of samples.
    #[error("{}: {images} images but {} has {labels} labels", .images_path.display(), .labels_path.display())]
    CountMismatch {
        images_path: PathBuf,
        labels_path: PathBuf,
        images: usize,
        labels: usize,
    },
    /// A label is not below the number of classes.
    #[error("{}: label {label} of sample {index} is out of range (dataset has {classes} classes)", .path.display())]
    LabelOutOfRange {
        path: PathBuf,
        index: usize,
        label: u64,
        classes: usize,
    },
    /// An image file that cannot be decoded.
    #[error("{}: unreadable image: {reason}", .path.display())]
    UnreadableImage { path: PathBuf, reason: String },
    /// A directory that must hold samples holds none.
    #[error("{}: empty: {detail}", .path.display())]
    Empty { path: PathBuf, detail: String },
    /// A file whose content is otherwise malformed.
    #[error("{}: bad format: {detail}", .path.display())]
    Format { path: PathBuf, detail: String },
    /// Invalid sampler/loader/transform settings (not a data problem).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The prefetch thread ended without delivering a batch (it panicked or was shut down).
    #[error("prefetch worker stopped: {0}")]
    Prefetch(String),
}

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        DataError::Io {
            path: path.into(),
            source,
        }
    }
    pub(crate) fn truncated(path: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        DataError::Truncated {
            path: path.into(),
            detail: detail.into(),
        }
    }
    pub(crate) fn format(path: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        DataError::Format {
            path: path.into(),
            detail: detail.into(),
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = DataError> = std::result::Result<T, E>;
