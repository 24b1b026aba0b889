//! `qsr time-step`, and the CPU dry run of `scripts/gpu-check.sh`'s step comparison: the script times
//! `qsr time-step` and the PyTorch peer and prints their ratio, so that a session lent a GPU gets the
//! table in one run.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use crate::common::{qsr, root};

#[test]
fn time_step_reports_the_rate_of_its_median_step_and_every_phase() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("cnn.json");
    // `--profile 1` runs a step past the timed ones (it failed with "the plan is finished").
    let args = ["time-step", "--model", "cnn", "--steps", "3", "--warmup", "1", "--profile", "1"];
    let out = qsr(&[&args[..], &["--json", json.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!((t["model"].as_str(), t["unit"].as_str(), t["batch"].as_u64()), (Some("cnn"), Some("images"), Some(64)));
    let rate = t["per_second"].as_f64().unwrap();
    let step_ms = t["step_ms_median"].as_f64().unwrap();
    assert!((rate * step_ms / 1e3 - 64.0).abs() < 1e-6, "{t}");
    for phase in ["forward", "backward", "gradients", "optimizer", "write_back"] {
        let ms = t["phases_ms"][phase].as_f64().unwrap();
        assert!(ms.is_finite() && ms > 0.0, "{phase}: {ms} ms");
    }
    // The CPU backend launches no cubecl kernels: nothing counted, nothing profiled.
    assert!(t["launches_per_step"].is_null() && t["kernels"] == serde_json::json!([]), "{t}");
    assert_eq!(t["fusion"], false, "the CPU build has no burn fusion");
}

#[test]
fn time_step_refuses_zero_steps_and_unbounded_counts_and_batches() {
    for (args, message) in [
        (["--steps", "0"], "--steps must be in 1..=1000000, got 0"),
        // Unbounded counts reserved memory for every step's time (and overflowed the plan's length).
        (["--steps", "18446744073709551615"], "--steps must be in 1..=1000000, got 18446744073709551615"),
        (["--warmup", "18446744073709551615"], "--warmup must be at most 1000000"),
        (["--profile", "18446744073709551615"], "--profile must be at most 1000000"),
        (["--batch", "0"], "--batch must be in 1..=65536, got 0"),
        (["--batch", "100000000"], "--batch must be in 1..=65536, got 100000000"),
    ] {
        let out = qsr(&["time-step", args[0], args[1]]);
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains(message), "{out:?}");
    }
}

/// Issue 56 D7: `--width 65536 --heads 1` aborted with a 48 GiB allocation (exit 134, a backtrace);
/// `--layers 100000` and `--threads 100000` were accepted and ran for minutes.
#[test]
fn time_step_refuses_a_gpt_beyond_its_memory_bound_and_threads_beyond_sense() {
    for (args, message) in [
        (&["--width", "65536", "--heads", "1"][..], "lower --layers, --width or --context"),
        (&["--layers", "100000"], "lower --layers, --width or --context"),
        (&["--threads", "100000"], "--threads must be in 1..="),
        (&["--threads", "0"], "--threads must be in 1..="),
    ] {
        let out = qsr(&[&["time-step"][..], args].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(message) && !err.contains("panicked"), "{args:?}: {err}");
    }
}

/// A stand-in for the PyTorch peer: it writes a fixed rate to the `--json` path it is given.
const FAKE_PEER: &str = r#"#!/usr/bin/env bash
while [ $# -gt 0 ]; do
    if [ "$1" = --json ]; then echo '{"per_second": 100.0, "unit": "x", "step_ms_median": 1.0}' > "$2"; fi
    shift
done
"#;

#[test]
fn gpu_check_dry_run_prints_the_step_ratios_against_the_peer() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    // Both builds of the comparison: the same binary here.
    for build in ["qsr", "qsr-plain"] {
        std::fs::copy(env!("CARGO_BIN_EXE_qsr"), work.join(build)).unwrap();
    }
    let peer = dir.path().join("peer");
    std::fs::write(&peer, FAKE_PEER).unwrap();
    std::fs::set_permissions(&peer, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new("bash")
        .arg("scripts/gpu-check.sh")
        .current_dir(root())
        .env("WORK", &work)
        .env("RESULTS", dir.path().join("results"))
        .env("DEVICE", "cpu")
        .env("SECTIONS", "steps")
        .env("STEP_STEPS", "1")
        .env("STEP_WARMUP", "0")
        .env("GPT2", "--layers 12 --heads 2 --width 32 --context 16 --batch 1")
        .env("PYTHON", &peer)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for (case, unit) in [("gpt-medium", "tokens/s"), ("gpt2-small", "tokens/s"), ("resnet20", "images/s")] {
        let rate = |build: &str| {
            let json = std::fs::read(work.join(format!("steps/{case}-{build}.json"))).unwrap();
            serde_json::from_slice::<serde_json::Value>(&json).unwrap()["per_second"].as_f64().unwrap()
        };
        let (plain, fused) = (rate("qsr-plain"), rate("qsr"));
        let row = format!(
            "| {case} | 100 {unit} | {plain:.0} {unit} | {:.2} | {fused:.0} {unit} | {:.2} | - -> - |",
            plain / 100.0,
            fused / 100.0
        );
        assert!(stdout.contains(&row), "no row `{row}` in:\n{stdout}");
    }
    let table = std::fs::read_to_string(dir.path().join("results/gpu-check.md")).unwrap();
    assert!(
        table.contains("| one training step | PyTorch eager | burn plain | ratio | burn fusion + autotune |"),
        "{table}"
    );
}
