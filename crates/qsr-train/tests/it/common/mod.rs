//! Helpers shared by the `qsr` end-to-end tests: run the binary from the repository root, read JSON.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository root (recipes are named relative to it).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `qsr args` in the repository root.
pub fn qsr(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qsr")).args(args).current_dir(root()).output().expect("run qsr")
}

/// Runs `qsr args`, asserts success, returns stdout.
pub fn ok(args: &[&str]) -> String {
    let out = qsr(args);
    assert!(out.status.success(), "qsr {args:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `qsr args`, asserts it fails without a panic, returns stderr.
pub fn refused(args: &[&str]) -> String {
    let out = qsr(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "qsr {args:?} should fail");
    assert!(!err.contains("panicked"), "qsr {args:?} panicked: {err}");
    err
}

/// A JSON file's contents.
pub fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}
