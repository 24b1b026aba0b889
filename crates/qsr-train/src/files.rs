//! The trainer's files through the one door (`qsr-files`): only regular files are read (a FIFO would
//! block the read, a device such as `/dev/zero` never end it), each kind up to its bound here, so that
//! no input makes `qsr` hang or allocate without limit (issue 43, N4).

use std::fs::File;
use std::path::Path;

use anyhow::Result;

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
    Ok(qsr_files::open(path, what)?.0)
}

/// Reads `path` whole if it is a regular file of at most `limit` bytes.
pub(crate) fn read_regular(path: &Path, limit: u64, what: &str) -> Result<Vec<u8>> {
    Ok(qsr_files::read(path, limit, what)?)
}

/// [`read_regular`] as UTF-8 text.
pub(crate) fn read_text(path: &Path, limit: u64, what: &str) -> Result<String> {
    Ok(qsr_files::read_text(path, limit, what)?)
}

/// Writes `bytes` as the whole of `path` (a new file beside it, synced and renamed over it), then
/// syncs the directory so that the rename survives a crash.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8], what: &str) -> Result<()> {
    qsr_files::write_atomic(path, bytes, what)?;
    sync_dir(path.parent().unwrap_or(Path::new(".")));
    Ok(())
}

/// Makes the renames in `dir` durable; not every filesystem can sync a directory, which is harmless.
pub(crate) fn sync_dir(dir: &Path) {
    let _ = qsr_files::sync_dir(dir);
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
