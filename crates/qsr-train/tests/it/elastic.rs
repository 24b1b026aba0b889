//! `qsr train --elastic` end to end on digits: processes on loopback lose a worker (SIGKILL, SIGSTOP,
//! rank 0 among them), go on, and take restarted workers back.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{RECIPE, json, ok, refused};

const STEPS: &str = "schedule.total_steps=400";

/// `qsr` with a short comm timeout, so stalls are seen in seconds.
fn short_timeout_qsr() -> Command {
    let mut c = crate::common::qsr_cmd(&[]);
    c.env("QSR_COMM_TIMEOUT_SECS", "2").env("QSR_JOB_TOKEN", "elastic-cli-test");
    c
}

/// A standalone store (`qsr rendezvous`), its address, and the rest of its output.
fn rendezvous(workers: usize, min_workers: usize) -> (Store, String) {
    let mut child = short_timeout_qsr()
        .args(["rendezvous", "--listen", "127.0.0.1:0", "--workers", &workers.to_string()])
        .args(["--min-workers", &min_workers.to_string(), "--settle-secs", "2"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    out.read_line(&mut line).unwrap();
    let addr = line.split_whitespace().nth(2).expect("listening on ADDR").to_string();
    (Store { child, out }, addr)
}

/// A running `qsr rendezvous`.
struct Store {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl Drop for Store {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Store {
    /// Waits for it to exit after the job finished; returns its last line.
    fn finished(mut self) -> String {
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        assert!(self.child.wait().unwrap().success(), "qsr rendezvous failed");
        line
    }
}

/// One external elastic worker (launcher order `rank`, when given) of the run in `out`.
fn worker(store: &str, out: &Path, rank: Option<usize>, fault: Option<&str>) -> Child {
    worker_with(store, out, rank, fault, &[])
}

/// [`worker`] with `--set` settings.
fn worker_with(store: &str, out: &Path, rank: Option<usize>, fault: Option<&str>, sets: &[&str]) -> Child {
    let mut c = short_timeout_qsr();
    c.args(["train", "--recipe", RECIPE, "--set", STEPS, "--quiet", "--comm", "tcp", "--elastic"]);
    c.args(sets.iter().flat_map(|s| ["--set", s]));
    c.args(["--rendezvous", store, "--out", out.to_str().unwrap()]);
    if let Some(r) = rank {
        c.args(["--rank", &r.to_string()]);
    }
    if let Some(f) = fault {
        c.env("QSR_TEST_FAULT", f);
    }
    c.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap()
}

fn stderr_of(child: Child) -> (std::process::ExitStatus, String) {
    let out = child.wait_with_output().unwrap();
    (out.status, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Waits for `workers` (each must exit 0) and the store (it must report the job finished); returns
/// the run's summary.json.
fn job_finished(workers: Vec<Child>, store: Store, run: &Path) -> serde_json::Value {
    for w in workers {
        let (status, err) = stderr_of(w);
        assert!(status.success(), "{err}");
    }
    assert!(store.finished().contains("job finished"));
    json(&run.join("summary.json"))
}

fn membership(run: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|r| r["kind"] == "membership")
        .collect()
}

/// The latest checkpoint's model file.
fn final_model(run: &Path) -> Vec<u8> {
    let latest = std::fs::read_to_string(run.join("ckpt/LATEST")).unwrap();
    std::fs::read(run.join("ckpt").join(latest.trim()).join("model.safetensors")).unwrap()
}

fn nproc_elastic(run: &Path, fault: &str, sets: &[&str]) -> serde_json::Value {
    let out = short_timeout_qsr()
        .args(["train", "--recipe", RECIPE, "--set", STEPS, "--quiet", "--nproc", "4", "--elastic"])
        .args(sets.iter().flat_map(|s| ["--set", s]))
        .args(["--out", run.to_str().unwrap()])
        .env("QSR_TEST_FAULT", fault)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "elastic run failed:\n{err}");
    assert!(err.contains("went on without it"), "the launcher did not report the lost rank:\n{err}");
    json(&run.join("summary.json"))
}

#[test]
fn a_worker_killed_mid_round_costs_one_round_and_the_same_failure_gives_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    // Rank 2 dies as it starts step 101, in the middle of a round (the plan's h_base is 2).
    let s = nproc_elastic(&a, "kill:2:101", &[]);
    assert_eq!(s["world_size"], 3);
    assert_eq!(s["syncs"], s["planned_syncs"], "every planned sync happened once");
    let floor = 0.8; // what the non-elastic digits runs clear (train_cli.rs)
    assert!(s["final_test_accuracy"].as_f64().unwrap() > floor, "{s}");
    let m = &s["membership"][0];
    assert_eq!((m["generation"].as_u64(), m["world_size"].as_u64()), (Some(1), Some(3)));
    assert_eq!(m["lost"][0]["rank"], 2);
    assert_eq!(m["rounds_lost"], 1);
    assert!(m["steps_lost"].as_u64().unwrap() >= 1);
    assert!(m["reason"].as_str().unwrap().contains("rank 2"), "{m}");
    let records = membership(&a);
    assert_eq!(records.len(), 1);
    assert!(records[0]["step"].as_u64().unwrap() <= 101);
    nproc_elastic(&b, "kill:2:101", &[]);
    assert!(final_model(&a) == final_model(&b), "the same failure at the same step gave different parameters");
}

/// Issue 56 D6: a second worker lost while the next generation forms (rank 2 dies at step 101, rank 1
/// once the store formed generation 1 with it, before its ring): the survivors waited the whole
/// rendezvous timeout for rank 1 ("did not connect") or failed on its reset connection, though the
/// store had ended generation 1, and summary.json named only the second loss. The survivors now learn
/// from the store that generation 1 is over and form generation 2 with both of them (a survivor that
/// failed instead leaves a generation of 1), whose record names both victims.
#[test]
fn a_second_worker_lost_while_the_next_generation_forms_costs_seconds_and_both_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let s = nproc_elastic(&run, "kill:2:101,kill:1:1:formed", &[]);
    assert_eq!(s["syncs"], s["planned_syncs"], "every planned sync happened once");
    let m = s["membership"].as_array().unwrap();
    assert_eq!(m.len(), 1, "generation 1 never ran: {m:?}");
    assert_eq!((m[0]["generation"].as_u64(), m[0]["world_size"].as_u64()), (Some(2), Some(2)));
    let lost: Vec<(u64, &str)> = m[0]["lost"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["rank"].as_u64().unwrap(), l["reason"].as_str().unwrap()))
        .collect();
    assert_eq!(lost.len(), 2, "{lost:?}");
    assert!(lost[0].0 == 2 && lost[0].1.contains("generation 0, which ended while it formed"), "{lost:?}");
    assert_eq!(lost[1].0, 1, "{lost:?}");
}

/// Streaming with int8 payloads: two fragments, one syncing after every step of the early 2-step
/// rounds, each average applied a step later on the fragments' own group, so one is in flight when
/// rank 2 dies at step 101. The survivors drop what was in flight, re-form both groups and finish
/// every planned sync, as accurate as the plain run above. Rank 2 may die after its share of the
/// background all-reduce went out: then that average completes and the survivors lose no round, and
/// find the loss at the next collective (the store's answer after the round's sync).
#[test]
fn a_worker_killed_with_a_fragment_in_flight_leaves_a_streaming_run_that_finishes() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let streaming = ["sync.streaming.fragments=2", "sync.streaming.delay=1", "driver.wire=int8"];
    let s = nproc_elastic(&run, "kill:2:101", &streaming);
    assert_eq!(s["world_size"], 3);
    assert_eq!(s["syncs"], s["planned_syncs"], "every planned round happened once");
    assert!(s["final_test_accuracy"].as_f64().unwrap() > 0.8, "{s}");
    let m = &s["membership"][0];
    assert_eq!(m["lost"][0]["rank"], 2, "{m}");
    let completed_in_flight = m["reason"].as_str().unwrap().contains("sharing the store's answer");
    let lost = (m["rounds_lost"].as_u64(), m["steps_lost"].as_u64().unwrap() > 0);
    assert_eq!(lost, if completed_in_flight { (Some(0), false) } else { (Some(1), true) }, "{m}");
    // The last checkpoint has the survivors' streaming state, and no rank 3.
    let latest = std::fs::read_to_string(run.join("ckpt/LATEST")).unwrap();
    let step = run.join("ckpt").join(latest.trim());
    assert!(step.join("sync-rank2.safetensors").exists() && !step.join("sync-rank3.safetensors").exists());
}

#[test]
fn a_stopped_worker_is_expelled_and_refused_when_it_wakes() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let (store, addr) = rendezvous(4, 1);
    let mut workers: Vec<Child> = (0..4).map(|r| worker(&addr, &run, Some(r), Some("stop:1:101"))).collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    while membership(&run).is_empty() {
        assert!(Instant::now() < deadline, "the survivors never re-formed");
        std::thread::sleep(Duration::from_millis(100));
    }
    let stopped = workers.remove(1);
    rustix::process::kill_process(rustix::process::Pid::from_child(&stopped), rustix::process::Signal::CONT).unwrap();
    let (status, err) = stderr_of(stopped);
    assert!(!status.success(), "the expelled worker must not exit 0");
    assert!(err.contains("expelled") && err.contains("generation 0"), "{err}");
    let s = job_finished(workers, store, &run);
    assert_eq!(s["world_size"], 3);
    let lost = &s["membership"][0]["lost"][0];
    assert_eq!(lost["rank"], 1);
    assert!(lost["reason"].as_str().unwrap().contains("did not report"), "{lost}");
}

#[test]
fn a_killed_worker_restarted_rejoins_and_the_run_ends_with_four() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    // With --min-workers 4 the survivors wait for a replacement, so it joins whatever the timing.
    let (store, addr) = rendezvous(4, 4);
    let mut workers: Vec<Child> = (0..4).map(|r| worker(&addr, &run, Some(r), Some("kill:3:101"))).collect();
    let victim = workers.remove(3);
    let (status, _) = stderr_of(victim);
    assert!(!status.success(), "rank 3 should have been killed");
    workers.push(worker(&addr, &run, None, None));
    let s = job_finished(workers, store, &run);
    assert_eq!(s["world_size"], 4);
    assert_eq!(s["syncs"], s["planned_syncs"]);
    let m = &s["membership"][0];
    assert_eq!((m["lost"][0]["rank"].as_u64(), m["joined"][0].as_u64()), (Some(3), Some(3)), "{m}");
}

/// The same with streaming int8 fragments: the replacement forms the pair of groups with the
/// survivors, takes their parameters and global values (nothing in flight), and the run ends with four.
#[test]
fn a_killed_streaming_worker_restarted_rejoins_and_the_run_ends_with_four() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let sets = ["sync.streaming.fragments=2", "sync.streaming.delay=1", "driver.wire=int8"];
    let (store, addr) = rendezvous(4, 4);
    let mut workers: Vec<Child> =
        (0..4).map(|r| worker_with(&addr, &run, Some(r), Some("kill:3:101"), &sets)).collect();
    assert!(!stderr_of(workers.remove(3)).0.success(), "rank 3 should have been killed");
    workers.push(worker_with(&addr, &run, None, None, &sets));
    let s = job_finished(workers, store, &run);
    assert_eq!((s["world_size"].as_u64(), s["syncs"].clone()), (Some(4), s["planned_syncs"].clone()), "{s}");
    let m = &s["membership"][0];
    assert_eq!((m["lost"][0]["rank"].as_u64(), m["joined"][0].as_u64()), (Some(3), Some(3)), "{m}");
    assert!(s["final_test_accuracy"].as_f64().unwrap() > 0.8, "{s}");
}

/// N2's elastic case: a streaming int8 job whose ranks 1-3 die right after the sync of step 100
/// (with `--min-workers 1`) goes on as a world of one and finishes every planned sync, where it
/// once crashed forming the fragments' groups over one rank.
#[test]
fn a_streaming_job_shrinking_to_one_survivor_finishes() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let sets = ["sync.streaming.fragments=2", "sync.streaming.delay=1", "driver.wire=int8"];
    let (store, addr) = rendezvous(4, 1);
    let mut workers: Vec<Child> = (0..4)
        .map(|r| {
            let fault = format!("kill:{r}:100:synced");
            worker_with(&addr, &run, Some(r), (r > 0).then_some(fault.as_str()), &sets)
        })
        .collect();
    for victim in workers.drain(1..) {
        assert!(!stderr_of(victim).0.success(), "ranks 1-3 should have been killed");
    }
    let s = job_finished(workers, store, &run);
    assert_eq!((s["world_size"].as_u64(), s["syncs"].clone()), (Some(1), s["planned_syncs"].clone()), "{s}");
    let m = &s["membership"][0];
    let lost: Vec<u64> = m["lost"].as_array().unwrap().iter().map(|l| l["rank"].as_u64().unwrap()).collect();
    assert_eq!((m["world_size"].as_u64(), lost), (Some(1), vec![1, 2, 3]), "{m}");
    // Found at the store's answer after the sync (nothing lost) or, should the survivor's send of it
    // have left before the victims died, at the landing of the average then in flight (one round).
    assert!(m["rounds_lost"].as_u64().unwrap() <= 1, "{m}");
    assert!(s["final_test_accuracy"].as_f64().unwrap() > 0.8, "{s}");
}

#[test]
fn rank_zero_killed_under_a_standalone_store_leaves_a_run_that_finishes_and_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let (store, addr) = rendezvous(4, 1);
    let workers: Vec<Child> = (0..4).map(|r| worker(&addr, &run, Some(r), Some("kill:0:101"))).collect();
    let mut statuses = Vec::new();
    for w in workers {
        statuses.push(stderr_of(w));
    }
    assert!(!statuses[0].0.success(), "rank 0 should have been killed");
    for (status, err) in &statuses[1..] {
        assert!(status.success(), "{err}");
    }
    assert!(store.finished().contains("job finished"));
    let s = json(&run.join("summary.json"));
    assert_eq!((s["world_size"].as_u64(), s["membership"][0]["lost"][0]["rank"].as_u64()), (Some(3), Some(0)));
    // Old rank 1, now rank 0, kept writing checkpoints after the loss, with three optimizer files.
    let latest = std::fs::read_to_string(run.join("ckpt/LATEST")).unwrap();
    assert_eq!(latest.trim(), "step-400");
    let state = json(&run.join("ckpt/step-400/state.json"));
    assert_eq!(state["world_size"], 3);
    assert!(run.join("ckpt/step-400/optim-rank2.safetensors").exists());
    assert!(!run.join("ckpt/step-400/optim-rank3.safetensors").exists());
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let evals = text.lines().filter(|l| l.contains("\"kind\":\"eval\"")).count();
    assert!(evals >= 2, "evaluations before and after the loss: {text}");
}

/// An elastic resume at another world size is a membership change (N9: none was recorded).
#[test]
fn a_resume_at_another_world_size_needs_elastic_and_records_the_membership_change() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = run.to_str().unwrap();
    ok(&["train", "--recipe", RECIPE, "--set", STEPS, "--quiet", "--nproc", "4", "--out", out, "--halt-after", "200"]);
    let e = refused(&["train", "--resume", out, "--nproc", "3", "--quiet"]);
    assert!(e.contains("with 3 workers") && e.contains("4 workers"), "{e}");
    ok(&["train", "--resume", out, "--nproc", "3", "--elastic", "--quiet"]);
    let s = json(&run.join("summary.json"));
    assert_eq!(s["world_size"], 3);
    let changes = membership(&run);
    assert_eq!(changes.len(), 1, "{changes:?}");
    let m = &changes[0]["membership"];
    assert_eq!((m["world_size"].as_u64(), m["joined"].as_array().map(Vec::len)), (Some(3), Some(0)), "{m}");
    assert_eq!(m["lost"][0]["rank"], 3, "{m}");
    assert!(m["reason"].as_str().unwrap().contains("written by 4 workers"), "{m}");
    assert!(changes[0]["step"].as_u64().unwrap() >= 200, "at the checkpoint the halt left: {m}");
    assert!(s["final_test_accuracy"].as_f64().unwrap() > 0.8, "{s}");
}

/// A streaming checkpoint written by 3 workers (an average in flight: the delay reaches past the
/// round's end) resumed by 4 under `--elastic`: the new rank 3 starts from rank 0's parameters and
/// averages in flight (the same on every rank), so the ranks' fragment syncs stay in step.
#[test]
fn a_streaming_run_resumed_with_more_workers_gives_the_new_rank_the_averages_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = run.to_str().unwrap();
    let streaming = ["--set", "sync.streaming.fragments=2", "--set", "sync.streaming.delay=1", "--set", STEPS];
    let first = ["train", "--recipe", RECIPE, "--quiet", "--nproc", "3", "--out", out, "--halt-after", "200"];
    ok(&[&first[..], &streaming].concat());
    let latest = std::fs::read_to_string(run.join("ckpt/LATEST")).unwrap();
    assert!(!run.join("ckpt").join(latest.trim()).join("sync-rank3.safetensors").exists());
    ok(&["train", "--resume", out, "--nproc", "4", "--elastic", "--quiet"]);
    let s = json(&run.join("summary.json"));
    assert_eq!((s["world_size"].as_u64(), s["syncs"].clone()), (Some(4), s["planned_syncs"].clone()));
    let changes = membership(&run);
    assert_eq!(changes.len(), 1, "N9: the resume by 4 is a membership change: {changes:?}");
    assert_eq!(changes[0]["membership"]["joined"], serde_json::json!([3]), "{changes:?}");
    assert!(s["final_test_accuracy"].as_f64().unwrap() > 0.8, "{s}");
}

#[test]
fn elastic_mode_refuses_what_it_does_not_cover() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r");
    let out = out.to_str().unwrap();
    let e = refused(&["train", "--recipe", RECIPE, "--comm", "tcp", "--elastic", "--out", out]);
    assert!(e.contains("--rendezvous"), "{e}");
    let e = refused(&["train", "--recipe", RECIPE, "--workers", "2", "--elastic", "--out", out]);
    assert!(e.contains("--elastic") && e.contains("--workers"), "{e}");
    let local = ["--set", "sync.local.rule=constant", "--set", "sync.local.h=1"];
    let e = refused(&[&["train", "--recipe", RECIPE, "--nproc", "2", "--elastic", "--out", out][..], &local].concat());
    assert!(e.contains("[sync.local]"), "{e}");
    let e = refused(&["rendezvous", "--workers", "2", "--min-workers", "3", "--listen", "127.0.0.1:0"]);
    assert!(e.contains("min_workers"), "{e}");
}

#[test]
fn a_worker_started_while_the_job_runs_is_admitted_at_a_sync() {
    admitted_at_a_sync(&[]);
}

/// The same with streaming int8 fragments: the survivors wait for the averages in flight at the
/// admitting sync and share them with the new worker (`Worker::share_in_flight`; that every rank then
/// holds them is qsr-optim's averages_in_flight_shared_after_adopt_reach_every_rank).
#[test]
fn a_worker_started_while_a_streaming_job_runs_is_admitted_at_a_sync() {
    admitted_at_a_sync(&["sync.streaming.fragments=2", "sync.streaming.delay=1", "driver.wire=int8"]);
}

fn admitted_at_a_sync(sets: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let (store, addr) = rendezvous(4, 1);
    // A longer run, so that the new worker's start-up (a fraction of a second) ends well before it.
    let long = |c: &mut Command| {
        c.args(["--set", "schedule.total_steps=4000"]).args(sets.iter().flat_map(|s| ["--set", s]));
    };
    let mut workers: Vec<Child> = (0..4)
        .map(|r| {
            let mut c = short_timeout_qsr();
            c.args(["train", "--recipe", RECIPE, "--quiet", "--comm", "tcp", "--elastic", "--rendezvous", &addr]);
            c.args(["--out", run.to_str().unwrap(), "--rank", &r.to_string()]).env("QSR_TEST_FAULT", "kill:3:101");
            long(&mut c);
            c.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap()
        })
        .collect();
    assert!(!stderr_of(workers.remove(3)).0.success());
    let deadline = Instant::now() + Duration::from_secs(60);
    while membership(&run).is_empty() {
        assert!(Instant::now() < deadline, "the survivors never re-formed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut c = short_timeout_qsr();
    c.args(["train", "--recipe", RECIPE, "--quiet", "--comm", "tcp", "--elastic", "--rendezvous", &addr]);
    c.args(["--out", run.to_str().unwrap()]);
    long(&mut c);
    workers.push(c.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap());
    let s = job_finished(workers, store, &run);
    assert_eq!(s["world_size"], 4, "{s}");
    let grow = &s["membership"][1];
    assert_eq!((grow["generation"].as_u64(), grow["joined"][0].as_u64()), (Some(2), Some(3)), "{grow}");
    assert_eq!((grow["rounds_lost"].as_u64(), grow["steps_lost"].as_u64()), (Some(0), Some(0)));
    assert!(grow["reason"].as_str().unwrap().contains("admitting 1 new worker"), "{grow}");
    assert!(s["final_test_accuracy"].as_f64().unwrap() > 0.8, "{s}");
}

#[test]
fn a_worker_lost_before_the_first_generation_formed_fails_the_launch() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = short_timeout_qsr()
        .args(["train", "--recipe", RECIPE, "--set", STEPS, "--quiet", "--nproc", "4", "--elastic"])
        .args(["--out", run.to_str().unwrap()])
        .env("QSR_TEST_FAULT", "kill:1:join")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the others must not wait for the first generation forever:\n{err}");
    assert!(err.contains("rank 1 was killed") && err.contains("SIGKILL"), "{err}");
}

/// A loopback port nothing listens on, which nothing else takes while the returned socket lives: bound and
/// never listened on, so a connection is refused at once. A port bound and released at once was
/// taken by another test's store, which answered "job token differs".
fn closed_port() -> (socket2::Socket, u16) {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into()).unwrap();
    let port = socket.local_addr().unwrap().as_socket().unwrap().port();
    (socket, port)
}

/// Stderr lines of `child` with the seconds since `t0` each arrived, and the exit status.
fn timed_stderr(mut child: Child, t0: Instant) -> (std::process::ExitStatus, Vec<(f64, String)>) {
    let err = BufReader::new(child.stderr.take().unwrap());
    let lines = err.lines().map_while(Result::ok).map(|l| (t0.elapsed().as_secs_f64(), l)).collect();
    (child.wait().unwrap(), lines)
}

#[test]
fn a_worker_with_no_store_listening_says_so_at_once_and_gives_up_at_the_rendezvous_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let (_held, port) = closed_port();
    let store = format!("127.0.0.1:{port}");
    let t0 = Instant::now();
    let mut c = short_timeout_qsr();
    c.env("QSR_RENDEZVOUS_TIMEOUT_SECS", "4");
    c.args(["train", "--recipe", RECIPE, "--quiet", "--comm", "tcp", "--elastic", "--rendezvous", &store]);
    c.args(["--out", dir.path().join("run").to_str().unwrap()]);
    let (status, lines) = timed_stderr(c.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap(), t0);
    let waits: Vec<f64> = lines
        .iter()
        .filter(|(_, l)| l.contains(&format!("waiting for the elastic store at {store}")))
        .map(|l| l.0)
        .collect();
    let all = lines.iter().map(|l| format!("{:.1} {}", l.0, l.1)).collect::<Vec<_>>().join("\n");
    assert!(waits.first().is_some_and(|t| *t < 2.0), "no line at once:\n{all}");
    assert!(waits.len() >= 3, "the line must repeat while it waits:\n{all}");
    assert_eq!(status.code(), Some(5), "a store that never answered is the store's failure:\n{all}");
    assert!(all.contains("cannot connect within the rendezvous timeout of 4s"), "{all}");
}

#[test]
fn a_first_generation_short_of_workers_says_how_many_of_how_many_joined() {
    let dir = tempfile::tempdir().unwrap();
    let (store, addr) = rendezvous(2, 1);
    let t0 = Instant::now();
    let mut c = short_timeout_qsr();
    c.env("QSR_RENDEZVOUS_TIMEOUT_SECS", "4");
    c.args(["train", "--recipe", RECIPE, "--quiet", "--comm", "tcp", "--elastic", "--rendezvous", &addr]);
    c.args(["--out", dir.path().join("run").to_str().unwrap()]);
    let (status, lines) = timed_stderr(c.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap(), t0);
    let all = lines.iter().map(|l| format!("{:.1} {}", l.0, l.1)).collect::<Vec<_>>().join("\n");
    let first = lines.iter().find(|(_, l)| l.contains("1 of 2 workers have joined the first generation"));
    assert!(first.is_some_and(|(t, l)| *t < 3.0 && l.contains(&addr)), "{all}");
    assert_eq!(status.code(), Some(5), "{all}");
    assert!(all.contains("did not form within the rendezvous timeout"), "{all}");
    drop(store);
}

/// Worker `rank` of a two-worker job at `store` long enough to be interrupted while it trains.
fn long_worker(store: &str, run: &Path, rank: usize) -> Child {
    let mut c = short_timeout_qsr();
    c.args(["train", "--recipe", RECIPE, "--set", "schedule.total_steps=40000", "--set", "train.workers=2"]);
    c.args(["--quiet", "--comm", "tcp", "--elastic", "--rendezvous", store, "--out", run.to_str().unwrap()]);
    c.args(["--rank", &rank.to_string()]).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap()
}

/// Waits up to a minute for `path` to exist.
fn wait_for(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !path.exists() {
        assert!(Instant::now() < deadline, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_stopped_store_fails_its_workers_at_the_comm_timeout_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let (mut store, addr) = rendezvous(2, 1);
    let workers = vec![long_worker(&addr, &run, 0), long_worker(&addr, &run, 1)];
    wait_for(&run.join("metrics.jsonl"));
    let pid = rustix::process::Pid::from_child(&store.child);
    rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();
    for w in workers {
        let (status, err) = stderr_of(w);
        assert_eq!(status.code(), Some(5), "{err}");
        assert!(err.contains(&addr) && err.contains("the store stopped answering: nothing for 2s"), "{err}");
        assert!(!err.contains("os error 11"), "{err}");
    }
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    let _ = store.child.wait();
}

#[test]
fn elastic_workers_started_by_hand_hold_their_run_directory_against_other_runs() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let (mut store, addr) = rendezvous(2, 1);
    let mut job = vec![long_worker(&addr, &run, 0), long_worker(&addr, &run, 1)];
    wait_for(&run.join("ckpt/LATEST"));
    // A second elastic job on the same directory, and a --nproc run: both refused as bad input.
    let (other, other_addr) = rendezvous(1, 1);
    let (status, err) = stderr_of(long_worker(&other_addr, &run, 0));
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("is in use by elastic job") && err.contains(&addr), "{err}");
    drop(other);
    // A resume (not refused for the checkpoints the job wrote) meets the lock.
    let out = short_timeout_qsr()
        .args(["train", "--resume", run.to_str().unwrap(), "--quiet", "--nproc", "2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("is in use by elastic job"), "{err}");
    for w in &mut job {
        let _ = w.kill();
        let _ = w.wait();
    }
    let _ = store.child.kill();
    let _ = store.child.wait();
}

#[test]
fn a_resumed_worker_and_a_fresh_one_refuse_to_form_a_first_generation_together() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = run.to_str().unwrap();
    ok(&["train", "--recipe", RECIPE, "--set", STEPS, "--quiet", "--nproc", "2", "--out", out, "--halt-after", "200"]);
    let (store, addr) = rendezvous(2, 1);
    let recipe = run.join("recipe.toml");
    let mut resumed = short_timeout_qsr();
    resumed.args(["train", "--resume", out, "--comm", "tcp", "--elastic", "--rendezvous", &addr, "--rank", "0"]);
    let mut fresh = short_timeout_qsr();
    fresh.args(["train", "--recipe", recipe.to_str().unwrap(), "--out", out, "--comm", "tcp", "--elastic"]);
    fresh.args(["--rendezvous", &addr, "--rank", "1"]);
    let children: Vec<Child> = [resumed, fresh]
        .into_iter()
        .map(|mut c| c.arg("--quiet").stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap())
        .collect();
    for c in children {
        let (status, err) = stderr_of(c);
        assert_eq!(status.code(), Some(2), "{err}");
        assert!(err.contains("`start_step`"), "the ranks must name the differing start: {err}");
    }
    drop(store);
    // Nothing was trained over the checkpoint.
    assert_eq!(std::fs::read_to_string(run.join("ckpt/LATEST")).unwrap().trim(), "step-220");
}

/// Sync records of a run, by step.
fn sync_steps(run: &Path) -> Vec<u64> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|r| r["kind"] == "sync")
        .map(|r| r["step"].as_u64().unwrap())
        .collect()
}

#[test]
fn rank_zero_killed_right_after_a_sync_leaves_that_syncs_record_in_the_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    // Step 100 ends a round (H = 2 there) without an evaluation: the survivors go on from it, and
    // rank 0 dies before it writes the record.
    let s = nproc_elastic(&run, "kill:0:100:synced", &[]);
    let steps = sync_steps(&run);
    assert!(steps.contains(&100), "the record of the sync at step 100 is missing");
    assert_eq!(steps.len() as u64, s["planned_syncs"].as_u64().unwrap(), "{steps:?}");
    assert!(steps.windows(2).all(|w| w[0] < w[1]), "records out of order or twice: {steps:?}");
    assert_eq!(membership(&run)[0]["step"], 100);
}

#[test]
fn rank_zero_killed_while_committing_a_checkpoint_leaves_no_partial_checkpoint_behind() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    // The first checkpoint, at the evaluation of epoch 5 (step 110).
    let s = nproc_elastic(&run, "kill:0:110:commit", &[]);
    assert_eq!(s["syncs"], s["planned_syncs"]);
    let leftovers: Vec<String> = std::fs::read_dir(run.join("ckpt"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("tmp-") || n.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "left in ckpt/: {leftovers:?}");
    assert_eq!(std::fs::read_to_string(run.join("ckpt/LATEST")).unwrap().trim(), "step-400");
}

#[test]
fn the_launcher_kills_expelled_workers_at_the_end_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = short_timeout_qsr()
        .args(["train", "--recipe", RECIPE, "--set", STEPS, "--quiet", "--nproc", "4", "--elastic"])
        .args(["--out", run.to_str().unwrap()])
        .env("QSR_TEST_FAULT", "stop:1:101")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("rank 1 (pid") && err.contains("was expelled from the elastic job and is stopped: killing it"),
        "{err}"
    );
    assert!(!err.contains("waiting up to"), "the launcher must not wait for a stopped worker: {err}");
}

/// N3: `qsr rendezvous` that no worker reaches gives up at `QSR_RENDEZVOUS_TIMEOUT_SECS` (it served
/// on), naming the timeout and what it waited for.
#[test]
fn a_store_that_no_worker_reaches_gives_up_at_the_rendezvous_timeout() {
    let t0 = Instant::now();
    let mut c = short_timeout_qsr();
    c.env("QSR_RENDEZVOUS_TIMEOUT_SECS", "3");
    c.args(["rendezvous", "--listen", "127.0.0.1:0", "--workers", "2"]);
    let (status, lines) = timed_stderr(c.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap(), t0);
    let all = lines.iter().map(|l| format!("{:.1} {}", l.0, l.1)).collect::<Vec<_>>().join("\n");
    assert_eq!(status.code(), Some(5), "{all}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{all}");
    assert!(all.contains("did not form within the rendezvous timeout of 3s"), "{all}");
    assert!(all.contains("0 of 2 workers have joined the first generation"), "{all}");
}
