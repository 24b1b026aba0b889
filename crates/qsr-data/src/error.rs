//! The error type of this crate, [`DataError`].

use std::path::PathBuf;

/// Errors of dataset readers, the sampler and the loaders.
///
/// One error type for everything that can go wrong reading data: every variant that concerns a file names it,
/// so that a user with a broken download sees which file and what is wrong instead of a panic.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// An I/O error (including a corrupt gzip stream) while reading `path`.
    #[error("{}: {source}", .path.display())]
    Io {
        /// File that could not be read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A directory that must exist does not.
    #[error("{}: missing directory ({what})", .path.display())]
    MissingDir {
        /// The directory that does not exist.
        path: PathBuf,
        /// What the directory should hold, e.g. `ImageFolder root` or `cifar10 directory`.
        what: String,
    },
    /// None of the candidate file names exists.
    #[error("{}: missing file ({what})", .path.display())]
    MissingFile {
        /// The first candidate path looked for.
        path: PathBuf,
        /// What file is missing and where else it was looked for.
        what: String,
    },
    /// The file does not start with the expected magic number.
    #[error("{}: wrong magic number {found:#010x}, expected {expected}", .path.display())]
    BadMagic {
        /// The file with the wrong header.
        path: PathBuf,
        /// The first four bytes of the file, read as a big-endian `u32`.
        found: u32,
        /// The magic number that was expected and what it means, e.g. `0x00000803 (IDX, ...)`.
        expected: String,
    },
    /// The file is shorter than its header (or record size) says.
    #[error("{}: truncated file: {detail}", .path.display())]
    Truncated {
        /// The truncated file.
        path: PathBuf,
        /// Why the file is too short, usually its size against what the header or record size requires.
        detail: String,
    },
    /// An image file and its label file disagree on the number of samples.
    #[error("{}: {images} images but {} has {labels} labels", .images_path.display(), .labels_path.display())]
    CountMismatch {
        /// The image file.
        images_path: PathBuf,
        /// The label file.
        labels_path: PathBuf,
        /// Number of images the image file holds.
        images: usize,
        /// Number of labels the label file holds.
        labels: usize,
    },
    /// A label is not below the number of classes.
    #[error("{}: label {label} of sample {index} is out of range (dataset has {classes} classes)", .path.display())]
    LabelOutOfRange {
        /// The file holding the label.
        path: PathBuf,
        /// 0-based index of the sample whose label is out of range.
        index: usize,
        /// The offending label.
        label: u64,
        /// Number of classes of the dataset; labels must be below it.
        classes: usize,
    },
    /// An image file that cannot be decoded.
    #[error("{}: unreadable image: {reason}", .path.display())]
    UnreadableImage {
        /// The image file.
        path: PathBuf,
        /// Why it cannot be decoded (usually the decoder's message).
        reason: String,
    },
    /// A directory that must hold samples holds none.
    #[error("{}: empty: {detail}", .path.display())]
    Empty {
        /// The empty directory.
        path: PathBuf,
        /// What was expected in it, e.g. `no class sub-folders`.
        detail: String,
    },
    /// A file whose content is otherwise malformed.
    #[error("{}: bad format: {detail}", .path.display())]
    Format {
        /// The malformed file.
        path: PathBuf,
        /// What is wrong with its content.
        detail: String,
    },
    /// A path that must be a regular file is a FIFO, a device, a directory or a socket (reading it
    /// would block, never end, or fail obscurely).
    #[error("{}: not a regular file (it is a {kind})", .path.display())]
    NotAFile {
        /// The path.
        path: PathBuf,
        /// What it is instead, e.g. `FIFO` or `device`.
        kind: &'static str,
    },
    /// A file larger than a reader holds in memory.
    #[error("{}: {bytes} bytes, more than the {limit} bytes {what}", .path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        bytes: u64,
        /// The most the reader takes.
        limit: u64,
        /// Which reader, and why it has a limit.
        what: &'static str,
    },
    /// Invalid sampler/loader/transform settings (not a data problem).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The prefetch thread ended without delivering a batch (it panicked or was shut down).
    #[error("prefetch worker stopped: {0}")]
    Prefetch(String),
}

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        DataError::Io { path: path.into(), source }
    }
    pub(crate) fn truncated(path: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        DataError::Truncated { path: path.into(), detail: detail.into() }
    }
    pub(crate) fn format(path: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        DataError::Format { path: path.into(), detail: detail.into() }
    }
}

/// Result alias of this crate.
pub type Result<T, E = DataError> = std::result::Result<T, E>;
