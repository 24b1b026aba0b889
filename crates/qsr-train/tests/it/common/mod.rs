//! Helpers shared by the `qsr` end-to-end tests: run the binary from the repository root (without
//! a launcher's environment), read JSON.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The small recipe most trainer tests run: an MLP on digits under QSR.
pub(crate) const RECIPE: &str = "recipes/digits-mlp-qsr.toml";

/// The repository root (recipes are named relative to it). `cargo test` sets CARGO_MANIFEST_DIR at run
/// time too: preferred, since a target dir shared by two checkouts may hand this one the other's
/// fresh-looking binary, whose compile-time path points into the other checkout.
pub(crate) fn root() -> PathBuf {
    let manifest =
        std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| env!("CARGO_MANIFEST_DIR").into(), PathBuf::from);
    manifest.join("../..")
}

/// `qsr args` in the repository root, without the job token or a launcher's variables of the
/// environment the tests run in.
pub(crate) fn qsr_cmd(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_qsr"));
    c.args(args).current_dir(root()).env_remove("QSR_JOB_TOKEN");
    for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
        c.env_remove(v);
    }
    c
}

/// Runs `qsr args` ([`qsr_cmd`]).
pub(crate) fn qsr(args: &[&str]) -> Output {
    qsr_cmd(args).output().expect("run qsr")
}

/// Runs `qsr args`, asserts success, returns stdout.
pub(crate) fn ok(args: &[&str]) -> String {
    let out = qsr(args);
    assert!(out.status.success(), "qsr {args:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command that must be refused as bad input (exit status 2, not a panic or an abort);
/// returns stderr.
pub(crate) fn refused(args: &[&str]) -> String {
    let out = qsr(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "qsr {args:?} should fail with status 2, got {:?}: {err}", out.status);
    assert!(!err.contains("panicked"), "qsr {args:?} panicked: {err}");
    err
}

/// A JSON file's contents.
pub(crate) fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// The `eval` records of a run's metrics.jsonl in step order, as (epoch, accuracy).
pub(crate) fn evals(run: &Path) -> Vec<(f64, f64)> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let records = text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
    let evals = records.filter(|r| r["kind"] == "eval");
    evals.map(|r| (r["epoch"].as_f64().unwrap(), r["accuracy"].as_f64().unwrap())).collect()
}
