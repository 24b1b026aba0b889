//! `qsr simulate` end to end: the command's output, calibration from run directories, refusals (the
//! cost model itself is tested inside the crate, in src/simulate/tests.rs).

use crate::common::{ok, qsr};
use qsr_train::recipe::TrainRecipe;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

/// One ring all-reduce of `bytes` over `k` ranks, by hand: 2(k-1) hops, each a latency and a
/// 1/k share of the buffer.
fn ring_seconds(bytes: f64, k: f64, bits_per_second: f64, latency: f64) -> f64 {
    2.0 * (k - 1.0) * (latency + bytes / k * 8.0 / bits_per_second)
}

/// A small recipe of our own (the repository's may change): MLP [128] on digits, QSR, K = 4.
const DIGITS_MLP: &str = r#"
name = "digits-qsr"
[model]
kind = "mlp"
hidden = [128]
[data]
dataset = "digits"
[train]
workers = 4
local_batch = 16
[optimizer]
kind = "sgd"
momentum = 0.9
[schedule]
kind = "cosine"
total_steps = 880
warmup_steps = 44
lr_max = 0.2
lr_min = 1e-6
[sync]
rule = "qsr"
h_base = 2
alpha = 0.06
"#;

/// ViT-B's parameters and epoch over the paper's links: 25 Gbit/s, 0.1 ms.
const VIT_B_LINKS: [&str; 8] =
    ["--params", "86381800", "--bandwidth", "25gbit", "--latency", "0.1ms", "--steps-per-epoch", "312"];

#[test]
fn paper_scale_calibrated_on_the_data_parallel_time() {
    let recipes = ["--recipe", "recipes/imagenet-vit-b-dp.toml", "--recipe", "recipes/imagenet-vit-b-qsr-hbase4.toml"];
    let references = ["--reference", "imagenet-vit-b-dp=26.7", "--reference", "imagenet-vit-b-qsr-hbase4=20.2"];
    let out =
        ok(&[&["simulate"][..], &recipes, &VIT_B_LINKS, &["--dp-hours", "26.7"], &references, &["--json"]].concat());
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["rows"].as_array().unwrap();
    let dp = &rows[0]["prediction"];
    let qsr = &rows[1]["prediction"];
    // The calibration reproduces the data-parallel time exactly.
    assert!(close(dp["total_seconds"].as_f64().unwrap(), 26.7 * 3600.0));
    assert_eq!(dp["syncs"].as_u64(), Some(93_600));
    assert_eq!(qsr["syncs"].as_u64(), Some(9_711));
    let per = ring_seconds(86_381_800.0 * 4.0, 16.0, 25e9, 1e-4);
    let step = (26.7 * 3600.0 - 93_600.0 * per) / 93_600.0;
    assert!(close(v["step_seconds"].as_f64().unwrap(), step));
    assert!(close(qsr["total_seconds"].as_f64().unwrap(), 93_600.0 * step + 9_711.0 * per));
    assert!(qsr["total_seconds"].as_f64().unwrap() < dp["total_seconds"].as_f64().unwrap());

    let table = ok(&[
        "simulate",
        "--recipe",
        "recipes/imagenet-vit-b-dp.toml",
        "--recipe",
        "recipes/imagenet-vit-b-qsr-hbase4.toml",
        "--params",
        "86381800",
        "--bandwidth",
        "25gbit",
        "--dp-hours",
        "26.7",
        "--reference",
        "imagenet-vit-b-dp=26.7",
    ]);
    assert!(table.contains("pred/ref") && table.contains("26.70 h") && table.contains("1.000"), "{table}");
}

/// Issue 59: `driver.wire = "int2"` prices each sync's ring at its packed payload, 16 bytes of codes
/// and a 4-byte scale per 64 parameters (MuLoCo's 2 bits): 9 % of f32's time on the wire here.
#[test]
fn an_int2_wire_is_priced_at_its_packed_bytes() {
    let comm = |wire: &str| {
        let recipe = ["simulate", "--recipe", "recipes/imagenet-vit-b-qsr-hbase4.toml"];
        let wire = format!("driver.wire={wire}");
        let out = ok(&[&recipe[..], &VIT_B_LINKS, &["--step-seconds", "0.5", "--set", &wire, "--json"]].concat());
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["rows"][0]["prediction"]["comm_seconds"].as_f64().unwrap()
    };
    let (f32_seconds, int2_seconds) = (comm("f32"), comm("int2"));
    assert!(close(f32_seconds, 9_711.0 * ring_seconds(86_381_800.0 * 4.0, 16.0, 25e9, 1e-4)));
    assert!(close(int2_seconds, 9_711.0 * ring_seconds((86_381_800f64 / 64.0).ceil() * 20.0, 16.0, 25e9, 1e-4)));
}

#[test]
fn run_directories_are_compared_with_their_measurement() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(run.join("recipe.toml"), DIGITS_MLP).unwrap();
    let r = TrainRecipe::load(&run.join("recipe.toml"), &[]).unwrap();
    let syncs = r.plan().unwrap().summary().rounds;
    let summary = serde_json::json!({
        "name": "digits-qsr", "rule": "qsr", "seed": 0, "world_size": 4, "steps": 880, "epochs": 40.0,
        "steps_per_epoch": 22, "final_test_accuracy": 0.9, "final_test_loss": 0.3, "syncs": syncs,
        "planned_syncs": syncs, "comm_percent": 10.0, "bytes_per_rank": 0, "comm_seconds": 8.0,
        "wall_seconds": 52.0, "steps_per_second": 16.9, "skipped_updates": 0
    });
    std::fs::write(run.join("summary.json"), summary.to_string()).unwrap();
    let run_s = run.to_str().unwrap();
    let out = ok(&[
        "simulate",
        "--run",
        run_s,
        "--step-seconds-from",
        run_s,
        "--bandwidth",
        "1gbit",
        "--params",
        "1000",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(close(v["step_seconds"].as_f64().unwrap(), (52.0 - 8.0) / 880.0));
    let row = &v["rows"][0];
    assert_eq!(row["measured_seconds"].as_f64(), Some(52.0));
    assert_eq!(row["prediction"]["syncs"].as_u64(), Some(syncs));
    assert_eq!(row["prediction"]["steps_per_epoch"].as_u64(), Some(22));
    // Without --params the model is built to count them: digits MLP [128] = 64*128+128 + 128*10+10.
    let out = ok(&["simulate", "--run", run_s, "--step-seconds", "0.01", "--bandwidth", "1gbit", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let per = ring_seconds(9_610.0 * 4.0, 4.0, 1e9, 0.0);
    assert!(close(v["rows"][0]["prediction"]["comm_seconds"].as_f64().unwrap(), syncs as f64 * per));
}

#[test]
fn refusals_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let recipe = dir.path().join("digits.toml");
    std::fs::write(&recipe, DIGITS_MLP).unwrap();
    let recipe = recipe.to_str().unwrap();
    let err = |args: &[&str]| {
        let out = qsr(args);
        assert!(!out.status.success(), "qsr {args:?} should fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = err(&["simulate", "--recipe", recipe, "--bandwidth", "1gbit"]);
    assert!(e.contains("--step-seconds") || e.contains("required"), "{e}");
    let e = err(&["simulate", "--recipe", recipe, "--bandwidth", "fast", "--step-seconds", "1"]);
    assert!(e.contains("bandwidth `fast`"), "{e}");
    let e = err(&["simulate", "--recipe", recipe, "--bandwidth", "1gbit", "--dp-hours", "1"]);
    assert!(e.contains("data-parallel recipe"), "{e}");
    let e =
        err(&["simulate", "--recipe", recipe, "--bandwidth", "1gbit", "--step-seconds", "1", "--reference", "nope=1"]);
    assert!(e.contains("no recipe named `nope`"), "{e}");
}

/// `--step-seconds-from` a two-level run takes both levels' communication out of the wall time, and
/// every row is priced on the recipe's nodes.
#[test]
fn step_seconds_from_a_two_level_run_leave_out_its_local_averages() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    let two_level = format!("{DIGITS_MLP}[sync.local]\nrule = \"constant\"\nh = 1\nworkers_per_node = 2\n");
    std::fs::write(run.join("recipe.toml"), &two_level).unwrap();
    let plan = TrainRecipe::load(&run.join("recipe.toml"), &[]).unwrap().plan().unwrap().summary();
    let local = plan.local.as_ref().unwrap().rounds;
    let summary = serde_json::json!({
        "name": "digits-qsr", "rule": "qsr", "seed": 0, "world_size": 4, "steps": 880, "epochs": 40.0,
        "steps_per_epoch": 22, "final_test_accuracy": 0.9, "final_test_loss": 0.3, "syncs": plan.rounds,
        "planned_syncs": plan.rounds, "comm_percent": 10.0, "bytes_per_rank": 0, "comm_seconds": 8.0,
        "wall_seconds": 52.0, "steps_per_second": 16.9, "skipped_updates": 0,
        "local": { "rule": "constant", "node_size": 2, "syncs": local, "planned_syncs": local,
                   "bytes_per_rank": 0, "comm_seconds": 4.0 }
    });
    std::fs::write(run.join("summary.json"), summary.to_string()).unwrap();
    let run_s = run.to_str().unwrap();
    let args = ["simulate", "--run", run_s, "--bandwidth", "1gbit", "--params", "1000"];
    let out = ok(&[&args[..], &["--step-seconds-from", run_s, "--intra-bandwidth", "8gbit", "--json"]].concat());
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(close(v["step_seconds"].as_f64().unwrap(), (52.0 - 8.0 - 4.0) / 880.0), "{v}");
    let p = &v["rows"][0]["prediction"];
    assert_eq!(p["local_syncs"].as_u64(), Some(local));
    // A local average of 1000 f32 in a node of 2 at 8 Gbit/s: 4000 B once over the link.
    assert!(close(p["local_comm_seconds"].as_f64().unwrap(), local as f64 * 32_000.0 / 8e9), "{p}");
    let e = String::from_utf8(qsr(&[&args[..], &["--step-seconds", "0.1", "--node-size", "8"]].concat()).stderr);
    assert!(e.unwrap().contains("nodes of 8 workers (--node-size) do not divide its 4 workers"));
    let flat_nodes = format!("{DIGITS_MLP}[sync.local]\nrule = \"constant\"\nh = 1\n");
    std::fs::write(run.join("recipe.toml"), flat_nodes).unwrap();
    let e = String::from_utf8(qsr(&[&args[..], &["--step-seconds", "0.1"]].concat()).stderr).unwrap();
    assert!(e.contains("averages inside nodes ([sync.local]): give --node-size"), "{e}");
}

/// `--dp-hours` calibrates on the same cluster the rows are priced on: with nodes, the data-parallel
/// row still reproduces the given hours exactly.
#[test]
fn dp_hours_calibrate_on_the_cluster_of_the_rows() {
    let out = ok(&[
        "simulate",
        "--recipe",
        "recipes/imagenet-vit-b-dp.toml",
        "--recipe",
        "recipes/imagenet-vit-b-qsr-hbase4.toml",
        "--params",
        "86381800",
        "--bandwidth",
        "25gbit",
        "--node-size",
        "8",
        "--intra-bandwidth",
        "400gbit",
        "--steps-per-epoch",
        "312",
        "--dp-hours",
        "26.7",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let dp = &v["rows"][0]["prediction"];
    assert!(close(dp["total_seconds"].as_f64().unwrap(), 26.7 * 3600.0), "{dp}");
}
