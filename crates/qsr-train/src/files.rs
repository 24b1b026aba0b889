//! Reading the files a user names or a run directory holds: only regular files (a FIFO would block
//! the read, a device such as `/dev/zero` never end it) and only up to a bound per kind of file, so
//! that no input makes `qsr` hang or allocate without limit (issue 43, N4).

use std::fs::File;
use std::io::Read;
use std::path::Path;

use anyhow::{Context, Result, bail};

/// The most bytes a recipe may have (the paper's recipes have about 1 KiB).
pub(crate) const RECIPE_BYTES: u64 = 1 << 20;
/// The most bytes a run's `summary.json` may have.
pub(crate) const SUMMARY_BYTES: u64 = 16 << 20;
/// The most bytes a run's `metrics.jsonl` may have (about 5 million records).
pub(crate) const METRICS_BYTES: u64 = 1 << 30;
/// The most bytes a checkpoint's `manifest.json` may have (a checksum per file: about 100 bytes each).
pub(crate) const MANIFEST_BYTES: u64 = 1 << 20;
/// The most bytes a checkpoint's `state.json` may have (the plan, the recipe's resume key, counters).
pub(crate) const STATE_BYTES: u64 = 16 << 20;

/// Opens `path` for reading if it is a regular file (links followed); `what` names it in errors.
pub(crate) fn open_regular(path: &Path, what: &str) -> Result<File> {
    let meta = std::fs::metadata(path).with_context(|| format!("cannot read {what} {}", path.display()))?;
    if !meta.is_file() {
        bail!(
            "{what} {} is not a regular file (it is a {}): qsr reads only regular files",
            path.display(),
            qsr_data::file_kind(meta.file_type())
        );
    }
    File::open(path).with_context(|| format!("cannot read {what} {}", path.display()))
}

/// Reads `path` whole if it is a regular file of at most `limit` bytes.
pub(crate) fn read_regular(path: &Path, limit: u64, what: &str) -> Result<Vec<u8>> {
    let file = open_regular(path, what)?;
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes).with_context(|| format!("cannot read {what} {}", path.display()))?;
    if bytes.len() as u64 > limit {
        bail!("{what} {} is larger than {limit} bytes, more than a {what} can be", path.display());
    }
    Ok(bytes)
}

/// [`read_regular`] as UTF-8 text.
pub(crate) fn read_text(path: &Path, limit: u64, what: &str) -> Result<String> {
    String::from_utf8(read_regular(path, limit, what)?)
        .with_context(|| format!("{what} {} is not UTF-8", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_within_the_bound_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let small = dir.path().join("r.toml");
        std::fs::write(&small, "x = 1\n").unwrap();
        assert_eq!(read_text(&small, 16, "recipe").unwrap(), "x = 1\n");
        let e = read_text(&small, 3, "recipe").unwrap_err().to_string();
        assert!(e.contains("larger than 3 bytes"), "{e}");
        let e = read_text(dir.path(), 16, "recipe").unwrap_err().to_string();
        assert!(e.contains("is not a regular file (it is a directory)"), "{e}");
        let e = read_text(Path::new("/dev/zero"), 16, "recipe").unwrap_err().to_string();
        assert!(e.contains("/dev/zero is not a regular file (it is a device)"), "{e}");
    }
}
