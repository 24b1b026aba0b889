//! The ring all-reduce cost model on hand-computed cases, the plan-driven prediction and the
//! calibration from a data-parallel wall time (the command end to end is in tests/it/simulate.rs).

use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncMode, SyncRule};

use super::model::{Nodes, step_seconds_from_wall};
use super::*;
use crate::recipe::TrainRecipe;

/// A shipped recipe (CARGO_MANIFEST_DIR read at run time, as the integration tests' `root()` does).
fn recipe(name: &str) -> std::path::PathBuf {
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| env!("CARGO_MANIFEST_DIR").into(), std::path::PathBuf::from);
    manifest.join("../../recipes").join(name)
}

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

/// `µs`, a unit `parse_duration` lists, was refused: `µ` is not ASCII, so the unit was split after it
/// and `200µ` read as the number.
#[test]
fn a_duration_in_microseconds_written_with_mu_parses() {
    assert!(close(parse_duration("200µs").unwrap(), 2e-4));
    assert!(close(parse_duration("200us").unwrap(), 2e-4));
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
    let base = recipe("imagenet-vit-b-qsr-hbase4.toml");
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
    let base = recipe("imagenet-vit-b-qsr-hbase4.toml");
    let f32_payload = recipe_payload(&TrainRecipe::load(&base, &[]).unwrap(), 1_000_000, 0);
    let bf16 = recipe_payload(&TrainRecipe::load(&base, &["driver.wire=bf16".to_string()]).unwrap(), 1_000_000, 0);
    assert_eq!((bf16.bytes_per_element, bf16.parameter_encoding), (4, qsr_sched::Encoding::BF16));
    assert_eq!(bf16.local_encoding, qsr_sched::Encoding::BF16, "node averages stay bf16");
    let net = Network::new(1e9, 0.0).unwrap();
    let (a, b) = (f32_payload.seconds(SyncMode::Parameters, 4, &net), bf16.seconds(SyncMode::Parameters, 4, &net));
    assert!(close(b * 2.0, a), "bf16 {b} s vs f32 {a} s");
    assert!(close(bf16.seconds(SyncMode::Gradients, 4, &net), f32_payload.seconds(SyncMode::Gradients, 4, &net)));
}

#[test]
fn two_level_prediction_hand_computed() {
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

/// Two nodes of two workers: every local round's end averages the node in f32 whatever the wire,
/// blocking the workers; the fragments cross the nodes.
#[test]
fn streaming_predictions_count_node_averages_in_f32() {
    let p = plan(SyncRule::Constant { h: 8 }, 64).with_local(SyncRule::Constant { h: 2 }).unwrap();
    let int8 = recipe("digits-qsr.toml");
    let int8 = recipe_payload(&TrainRecipe::load(&int8, &["driver.wire=int8".to_string()]).unwrap(), 1_000_000, 0);
    assert_eq!(
        (int8.parameter_encoding, int8.local_encoding),
        (qsr_sched::Encoding::quantized(64), qsr_sched::Encoding::F32)
    );
    let payload = SyncPayload {
        parameter_encoding: int8.parameter_encoding,
        local_encoding: int8.local_encoding,
        ..SyncPayload::params(1_000_000)
    };
    let st = qsr_sched::StreamingConfig { fragments: 2, delay: 1, mix: 1.0 };
    let fragments = qsr_sched::FragmentPlan::new(p.clone(), 2).unwrap();
    let (inter, intra) = (Network::new(1e10, 0.0).unwrap(), Network::new(1e9, 0.0).unwrap());
    let cluster = Cluster { inter, nodes: Some(Nodes { size: 2, intra }) };
    let s = streaming::predict_streaming("s", (&fragments, &st), 0.1, &payload, 4, (cluster, Some(16)));
    assert_eq!(s.local_syncs, 24, "every other step of 64 but the 8 global rounds' ends");
    let f32_average = intra.allreduce_seconds(4e6, 2, 1);
    assert!(close(s.local_comm_seconds, 24.0 * f32_average), "{} vs {}", s.local_comm_seconds, 24.0 * f32_average);
    assert!(s.comm_seconds >= s.local_comm_seconds);
}

/// A streaming recipe's fragments overlap the steps: where every average arrives before it is due, the
/// run costs its compute plus what the last step waits for (its own fragment, sent then, and the final
/// f32 average); where the link is the bottleneck the workers wait, but less than for plain QSR's
/// blocking syncs.
#[test]
fn streaming_predictions_hide_what_arrives_in_time() {
    let p = plan(SyncRule::Constant { h: 8 }, 64);
    let payload = SyncPayload::params(1_000_000);
    let st = qsr_sched::StreamingConfig { fragments: 4, delay: 2, mix: 1.0 };
    let fragments = qsr_sched::FragmentPlan::new(p.clone(), 4).unwrap();
    let step = 0.1;
    // 1M f32 over K = 4 at 10 Gbit/s: 4.8 ms for the whole model, 1.2 ms a fragment: all hidden.
    let fast = Network::new(1e10, 0.0).unwrap();
    let s = streaming::predict_streaming("s", (&fragments, &st), step, &payload, 4, (fast.into(), Some(16)));
    let end = fast.allreduce_seconds(1e6, 4, 1) + fast.allreduce_seconds(4e6, 4, 1);
    assert!(close(s.comm_seconds, end), "{} vs {end}", s.comm_seconds);
    assert_eq!((s.syncs, s.steps), (8, 64));
    assert!(close(s.epoch_seconds.iter().sum::<f64>(), s.total_seconds));
    // At 100 Mbit/s a fragment takes 0.12 s, 0.2 s of two steps hide it; the whole model's 0.48 s at
    // every plain sync is paid in full.
    let slow = Network::new(1e8, 0.0).unwrap();
    let s = streaming::predict_streaming("s", (&fragments, &st), step, &payload, 4, (slow.into(), Some(16)));
    let plain = predict("p", &p, step, &payload, 4, slow, Some(16));
    let end = slow.allreduce_seconds(1e6, 4, 1) + slow.allreduce_seconds(4e6, 4, 1);
    assert!(close(s.comm_seconds, end), "{} vs {end}", s.comm_seconds);
    assert!(close(plain.comm_seconds, 8.0 * slow.allreduce_seconds(4e6, 4, 1)));
    // At 10 Mbit/s a fragment takes 1.2 s: the link is the bottleneck and the workers wait.
    let crawl = Network::new(1e7, 0.0).unwrap();
    let s = streaming::predict_streaming("s", (&fragments, &st), step, &payload, 4, (crawl.into(), Some(16)));
    let plain = predict("p", &p, step, &payload, 4, crawl, Some(16));
    assert!(
        s.comm_seconds > 1.0 && s.comm_seconds < plain.comm_seconds,
        "{} vs {}",
        s.comm_seconds,
        plain.comm_seconds
    );
}
