//! `qsr simulate`: the ring all-reduce cost model on hand-computed cases, the plan-driven prediction,
//! the calibration from a data-parallel wall time, and the command end to end.

use crate::common::{ok, qsr, root};
use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncMode, SyncRule};
use qsr_train::{
    Network, SyncPayload, TrainRecipe, parse_bandwidth, parse_duration, predict, recipe_payload, step_seconds_from_wall,
};

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

fn plan(rule: SyncRule, steps: u64) -> Plan {
    Plan::new(LrSchedule::new(ScheduleKind::Cosine, steps, steps / 10, 0.1, 1e-6), rule).unwrap()
}

#[test]
fn ring_allreduce_cost_hand_computed() {
    // K = 4, 40 MB, 1 Gbit/s, 0.2 ms: 2*3*0.2 ms + 2*3/4 * 320 Mbit / 1 Gbit/s = 1.2 ms + 480 ms.
    let net = Network::new(1e9, 0.2e-3).unwrap();
    assert!(close(net.allreduce_seconds(40e6, 4, 1), 0.4812));
    // K = 2, 1 MB, 8 Mbit/s, 10 ms: 2*1*10 ms + 2*1/2 * 8 Mbit / 8 Mbit/s = 0.02 + 1.
    let slow = Network::new(8e6, 0.01).unwrap();
    assert!(close(slow.allreduce_seconds(1e6, 2, 1), 1.02));
    // Three calls pay the latency three times, the bandwidth term once.
    assert!(close(slow.allreduce_seconds(1e6, 2, 3), 1.06));
    // K = 16, ViT-B in f32 (345,527,200 bytes) at 25 Gbit/s, no latency: 2*15/16 * 2,764,217,600 bit / 25e9.
    let fast = Network::new(25e9, 0.0).unwrap();
    assert!(close(fast.allreduce_seconds(86_381_800.0 * 4.0, 16, 1), 1.875 * 2_764_217_600.0 / 25e9));
    // One rank communicates nothing.
    assert_eq!(net.allreduce_seconds(40e6, 1, 1), 0.0);
    assert!(Network::new(0.0, 0.0).is_err());
    assert!(Network::new(1e9, -1.0).is_err());
}

#[test]
fn units_parse() {
    assert_eq!(parse_bandwidth("1gbit").unwrap(), 1e9);
    assert_eq!(parse_bandwidth("25Gbit/s").unwrap(), 25e9);
    assert_eq!(parse_bandwidth("10gbps").unwrap(), 1e10);
    assert_eq!(parse_bandwidth("100mbit").unwrap(), 1e8);
    assert_eq!(parse_bandwidth("3GB/s").unwrap(), 24e9);
    assert_eq!(parse_bandwidth("1e9").unwrap(), 1e9);
    assert!(parse_bandwidth("fast").is_err());
    assert!(parse_bandwidth("1parsec").is_err());
    assert!(parse_bandwidth("0gbit").is_err());
    assert!(close(parse_duration("0.2ms").unwrap(), 2e-4));
    assert!(close(parse_duration("50us").unwrap(), 5e-5));
    assert!(close(parse_duration("1.5").unwrap(), 1.5));
    assert!(close(parse_duration("2s").unwrap(), 2.0));
    assert!(parse_duration("-1ms").is_err());
    assert!(parse_duration("1 fortnight").is_err());
}

#[test]
fn constant_h_prediction_hand_computed() {
    // 16 steps of 0.1 s, H = 4 -> 4 syncs of 1000 f32 across K = 4 at 1 Mbit/s, no latency:
    // each 2*3/4 * 32,000 bit / 1e6 = 0.048 s. Total 1.6 + 0.192 = 1.792 s.
    let net = Network::new(1e6, 0.0).unwrap();
    let p = predict("h4", &plan(SyncRule::Constant { h: 4 }, 16), 0.1, &SyncPayload::params(1000), 4, net, Some(8));
    assert_eq!((p.steps, p.syncs, p.gradient_syncs), (16, 4, 0));
    assert!(close(p.compute_seconds, 1.6));
    assert!(close(p.comm_seconds, 0.192));
    assert!(close(p.total_seconds, 1.792));
    assert_eq!(p.epoch_seconds.len(), 2);
    assert!(close(p.epoch_seconds[0], 0.8 + 2.0 * 0.048));
    assert!(close(p.epoch_seconds[0] + p.epoch_seconds[1], p.total_seconds));
    assert!(close(p.mean_epoch_seconds().unwrap(), 0.896));
    assert!(close(p.comm_percent, 25.0));

    // Data parallel: one gradient all-reduce per step.
    let d = predict("dp", &plan(SyncRule::Dp, 16), 0.1, &SyncPayload::params(1000), 4, net, None);
    assert_eq!((d.syncs, d.gradient_syncs), (16, 16));
    assert!(close(d.total_seconds, 1.6 + 16.0 * 0.048));
    assert!(d.epoch_seconds.is_empty());
}

#[test]
fn rounds_crossing_epochs_split_compute_and_charge_the_sync_to_the_last_step() {
    // H = 3 over 8 steps with 4 steps per epoch: rounds [0,3) [3,6) [6,8). Sync cost 1 s (no latency,
    // K = 2, 1 element of 4 bytes at 32 bit/s: 2*1/2 * 32 / 32), steps 0.5 s.
    let net = Network::new(32.0, 0.0).unwrap();
    let p = predict("h3", &plan(SyncRule::Constant { h: 3 }, 8), 0.5, &SyncPayload::params(1), 2, net, Some(4));
    assert_eq!(p.syncs, 3);
    // Epoch 0: steps 0..4 (2 s) + the sync after step 2 (1 s); epoch 1: steps 4..8 (2 s) + syncs after 5 and 7.
    assert!(close(p.epoch_seconds[0], 3.0), "{:?}", p.epoch_seconds);
    assert!(close(p.epoch_seconds[1], 4.0), "{:?}", p.epoch_seconds);
}

#[test]
fn qsr_prediction_follows_the_plan() {
    let qsr = Plan::new(
        LrSchedule::new(ScheduleKind::Cosine, 93_600, 10_000, 0.008, 1e-6),
        SyncRule::Qsr { h_base: 4, alpha: 0.0175 },
    )
    .unwrap();
    let net = Network::new(25e9, 1e-4).unwrap();
    let payload = SyncPayload::params(86_381_800);
    let p = predict("qsr", &qsr, 0.5, &payload, 16, net, Some(312));
    assert_eq!(p.syncs, 9_711, "the paper's round count");
    let per = net.allreduce_seconds(86_381_800.0 * 4.0, 16, 1);
    assert!(close(p.comm_seconds, 9_711.0 * per));
    assert!(close(p.total_seconds, 93_600.0 * 0.5 + 9_711.0 * per));
    assert_eq!(p.epoch_seconds.len(), 300);
    assert!(close(p.epoch_seconds.iter().sum::<f64>(), p.total_seconds));
}

#[test]
fn bucketing_pays_latency_per_call() {
    let net = Network::new(8e3, 0.5).unwrap();
    let payload = SyncPayload { bucket_elements: Some(300), ..SyncPayload::params(1000) };
    // 1000 / 300 -> 4 calls; K = 2: 4 * 2 * 0.5 + 1 * 32,000 / 8,000.
    let p = predict("b", &plan(SyncRule::Constant { h: 10 }, 10), 0.0, &payload, 2, net, None);
    assert!(close(p.comm_seconds, 4.0 + 4.0));
}

#[test]
fn calibration_from_a_data_parallel_wall_time_round_trips() {
    let dp = plan(SyncRule::Dp, 1000);
    let net = Network::new(1e9, 2e-4).unwrap();
    let payload = SyncPayload::params(10_000_000);
    let step = step_seconds_from_wall(&dp, 700.0, &payload, 4, net).unwrap();
    let per = net.allreduce_seconds(40e6, 4, 1);
    assert!(close(step, (700.0 - 1000.0 * per) / 1000.0));
    assert!(close(predict("dp", &dp, step, &payload, 4, net, None).total_seconds, 700.0));
    // A wall time below the communication alone is refused.
    let err = step_seconds_from_wall(&dp, 100.0, &payload, 4, net).unwrap_err();
    assert!(format!("{err}").contains("faster than assumed"), "{err}");
}

#[test]
fn payload_follows_the_state_policy() {
    let base = root().join("recipes/imagenet-vit-b-qsr-hbase4.toml");
    let r = TrainRecipe::load(&base, &[]).unwrap();
    let p = recipe_payload(&r, 100, 0);
    assert_eq!((p.gradient_elements, p.parameter_elements, p.bytes_per_element), (100, 100, 4));
    let sets =
        ["driver.state.average_first_moment=true".to_string(), "driver.state.average_second_moment=true".to_string()];
    let r = TrainRecipe::load(&base, &sets).unwrap();
    let p = recipe_payload(&r, 100, 0);
    assert_eq!((p.gradient_elements, p.parameter_elements), (100, 300));
}

/// `driver.wire = "bf16"` halves the bytes of a parameter sync, so its modelled time on a
/// bandwidth-bound link; gradient all-reduces stay f32.
#[test]
fn bf16_wire_halves_the_parameter_sync_payload() {
    let base = root().join("recipes/imagenet-vit-b-qsr-hbase4.toml");
    let f32_payload = recipe_payload(&TrainRecipe::load(&base, &[]).unwrap(), 1_000_000, 0);
    let bf16 = recipe_payload(&TrainRecipe::load(&base, &["driver.wire=bf16".to_string()]).unwrap(), 1_000_000, 0);
    assert_eq!((bf16.bytes_per_element, bf16.parameter_bytes_per_element), (4, 2));
    let net = Network::new(1e9, 0.0).unwrap();
    let (a, b) = (f32_payload.seconds(SyncMode::Parameters, 4, &net), bf16.seconds(SyncMode::Parameters, 4, &net));
    assert!(close(b * 2.0, a), "bf16 {b} s vs f32 {a} s");
    assert!(close(bf16.seconds(SyncMode::Gradients, 4, &net), f32_payload.seconds(SyncMode::Gradients, 4, &net)));
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

#[test]
fn paper_scale_calibrated_on_the_data_parallel_time() {
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
        "--latency",
        "0.1ms",
        "--steps-per-epoch",
        "312",
        "--dp-hours",
        "26.7",
        "--reference",
        "imagenet-vit-b-dp=26.7",
        "--reference",
        "imagenet-vit-b-qsr-hbase4=20.2",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["rows"].as_array().unwrap();
    let dp = &rows[0]["prediction"];
    let qsr = &rows[1]["prediction"];
    // The calibration reproduces the data-parallel time exactly.
    assert!(close(dp["total_seconds"].as_f64().unwrap(), 26.7 * 3600.0));
    assert_eq!(dp["syncs"].as_u64(), Some(93_600));
    assert_eq!(qsr["syncs"].as_u64(), Some(9_711));
    let per = Network::new(25e9, 1e-4).unwrap().allreduce_seconds(86_381_800.0 * 4.0, 16, 1);
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
    let per = Network::new(1e9, 0.0).unwrap().allreduce_seconds(9_610.0 * 4.0, 4, 1);
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

#[test]
fn two_level_prediction_hand_computed() {
    use qsr_train::{Cluster, Nodes};
    // K = 4 in 2 nodes of 2; 1000 f32 = 32 kbit. Inside a node at 32 kbit/s a 2-rank ring moves the
    // buffer once: 1 s. Between the 2 nodes at 8 kbit/s: 4 s. No latency.
    let cluster = Cluster {
        inter: Network::new(8e3, 0.0).unwrap(),
        nodes: Some(Nodes { size: 2, intra: Network::new(32e3, 0.0).unwrap() }),
    };
    let flat = plan(SyncRule::Constant { h: 4 }, 16);
    let two = flat.clone().with_local(SyncRule::Constant { h: 1 }).unwrap();
    let payload = SyncPayload::params(1000);
    // 4 global syncs, each 1 s inside the nodes + 4 s between them; 12 local averages of 1 s.
    let p = predict("two", &two, 0.1, &payload, 4, cluster, Some(8));
    assert_eq!((p.syncs, p.local_syncs), (4, 12));
    assert!(close(p.local_comm_seconds, 12.0) && close(p.comm_seconds, 4.0 * 5.0 + 12.0), "{p:?}");
    assert!(close(p.total_seconds, 1.6 + 32.0));
    // Each epoch of 8 steps: 0.8 s compute, 2 global syncs (10 s), 6 local averages (6 s).
    assert!(p.epoch_seconds.iter().all(|&e| close(e, 16.8)), "{:?}", p.epoch_seconds);
    // The flat plan on the same cluster pays the global syncs only.
    let f = predict("flat", &flat, 0.1, &payload, 4, cluster, None);
    assert_eq!(f.local_syncs, 0);
    assert!(close(f.comm_seconds, 20.0));
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
