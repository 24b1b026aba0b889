//! Regression tests of the trainer's launch, run directory and inputs (issue 12): each test is named
//! after the defect it pins. Processes and loopback only; every wait is bounded.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const RECIPE: &str = "recipes/digits-mlp-qsr.toml";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn qsr_cmd(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_qsr"));
    c.args(args).current_dir(root()).env_remove("QSR_JOB_TOKEN");
    for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
        c.env_remove(v);
    }
    c
}

fn qsr(args: &[&str]) -> Output {
    qsr_cmd(args).output().expect("run qsr")
}

fn ok(args: &[&str]) -> String {
    let out = qsr(args);
    assert!(out.status.success(), "qsr {args:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command that must fail cleanly (exit status 1, not a panic or an abort); returns stderr.
fn refused(args: &[&str]) -> String {
    let out = qsr(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "qsr {args:?} should fail with status 1, got {:?}: {err}", out.status);
    assert!(!err.contains("panicked"), "qsr {args:?} panicked: {err}");
    err
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Polls `cond` every 50 ms for up to `limit`.
fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    cond()
}

/// Pids of live `qsr` processes whose command line contains `needle` (a unique run directory).
fn processes_with(needle: &str) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else { continue };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        let zombie = std::fs::read_to_string(e.path().join("stat"))
            .is_ok_and(|st| st.split(") ").nth(1).is_some_and(|r| r.starts_with('Z')));
        if cmd.contains(needle) && !zombie {
            out.push((pid, cmd));
        }
    }
    out
}

fn kill(pid: u32, signal: &str) {
    let st = Command::new("kill").args([&format!("-{signal}"), &pid.to_string()]).status().unwrap();
    assert!(st.success(), "kill -{signal} {pid}");
}

/// A long `--nproc` run in the background (stderr to a file), killed on drop whatever happens.
struct Background {
    child: Child,
    stderr: PathBuf,
}

impl Background {
    fn start(args: &[&str], stderr: PathBuf) -> Self {
        let file = std::fs::File::create(&stderr).unwrap();
        let child = qsr_cmd(args).stdout(Stdio::null()).stderr(file).spawn().unwrap();
        Self { child, stderr }
    }

    fn wait(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let mut status = None;
        wait_until(limit, || {
            status = self.child.try_wait().unwrap();
            status.is_some()
        });
        status
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Arguments of a run long enough to be killed while it trains.
fn long_run(out: &Path, nproc: &str) -> Vec<String> {
    [
        "train",
        "--recipe",
        RECIPE,
        "--nproc",
        nproc,
        "--out",
        s(out),
        "--quiet",
        "--set",
        "schedule.total_steps=200000",
        "--set",
        "train.steps=200000",
    ]
    .map(String::from)
    .to_vec()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn launcher_workers_die_with_it(signal: &str) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join(format!("run-{signal}"));
    let args = long_run(&out, "3");
    let mut launcher = Background::start(&strs(&args), dir.path().join("stderr"));
    let workers = || processes_with(s(&out)).into_iter().filter(|(_, c)| c.contains("--spawned")).count();
    assert!(wait_until(Duration::from_secs(60), || workers() == 3), "3 workers never started: {}", launcher.stderr());
    kill(launcher.child.id(), signal);
    assert!(launcher.wait(Duration::from_secs(30)).is_some(), "the launcher outlived kill -{signal}");
    assert!(
        wait_until(Duration::from_secs(30), || workers() == 0),
        "workers outlived their launcher (kill -{signal}): {:?}",
        processes_with(s(&out))
    );
}

#[test]
fn killing_the_nproc_launcher_with_sigterm_stops_its_workers() {
    launcher_workers_die_with_it("TERM");
}

#[test]
fn killing_the_nproc_launcher_with_sigkill_stops_its_workers() {
    launcher_workers_die_with_it("KILL");
}

#[test]
fn the_nproc_launcher_names_the_rank_that_failed_first() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let args = long_run(&out, "3");
    let mut launcher = Background::start(&strs(&args), dir.path().join("stderr"));
    let rank2 =
        || processes_with(s(&out)).into_iter().find(|(_, c)| c.contains("--spawned") && c.contains("--rank 2 "));
    assert!(wait_until(Duration::from_secs(60), || rank2().is_some()), "rank 2 never started: {}", launcher.stderr());
    // Let the ring form, so the other ranks are mid-training when rank 2 dies.
    assert!(
        wait_until(Duration::from_secs(60), || out.join("metrics.jsonl").exists()),
        "no training: {}",
        launcher.stderr()
    );
    kill(rank2().unwrap().0, "KILL");
    let status = launcher.wait(Duration::from_secs(60)).expect("the launcher must end after a worker dies");
    assert_eq!(status.code(), Some(1));
    let err = launcher.stderr();
    assert!(err.contains("rank 2 was killed by signal 9 (SIGKILL)"), "{err}");
    // Lines of different workers never merge.
    assert!(!err.contains("error: error:"), "{err}");
    for line in err.lines().filter(|l| l.starts_with("error:")) {
        assert_eq!(line.matches("error:").count(), 1, "{line}");
    }
}

/// Two ranks of an external `--comm tcp` launch; rank 1 gets extra arguments.
fn two_tcp_ranks(out: &Path, rank1_extra: &[&str]) -> [Output; 2] {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let children: Vec<Child> = (0..2)
        .map(|rank| {
            let r = rank.to_string();
            let mut args = vec![
                "train",
                "--recipe",
                RECIPE,
                "--out",
                s(out),
                "--quiet",
                "--set",
                "schedule.total_steps=400",
                "--comm",
                "tcp",
            ];
            args.extend(["--rank", &r, "--world-size", "2", "--master-addr", "127.0.0.1", "--master-port", &port]);
            if rank == 1 {
                args.extend(rank1_extra);
            }
            qsr_cmd(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
        })
        .collect();
    let outs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    outs.try_into().unwrap()
}

#[test]
fn ranks_launched_with_different_recipes_refuse_before_the_first_collective() {
    for (extra, key) in [
        (["--set", "seed=7"], "`seed`"),
        (["--set", "schedule.lr_max=0.3"], "`schedule.lr_max`"),
        (["--set", "sync.h_base=4"], "`sync.h_base`"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        for (rank, o) in two_tcp_ranks(&out, &extra).iter().enumerate() {
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(!o.status.success(), "rank {rank} trained with {extra:?}");
            assert!(
                err.contains("configured differently") && err.contains(key) && err.contains("rank 1"),
                "rank {rank}, {extra:?}: {err}"
            );
        }
        assert!(!out.join("ckpt").exists(), "a checkpoint was written before the ranks agreed");
    }
    // The same recipe trains.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    for o in two_tcp_ranks(&out, &[]) {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    assert_eq!(json(&out.join("summary.json"))["world_size"], 2);
}

#[test]
fn resume_with_nproc_applies_set_overrides() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    ok(&[
        "train",
        "--recipe",
        RECIPE,
        "--nproc",
        "2",
        "--out",
        s(&run),
        "--quiet",
        "--set",
        "schedule.total_steps=300",
        "--set",
        "eval.every_epochs=1",
        "--halt-after",
        "60",
    ]);
    assert!(!run.join("summary.json").exists());
    ok(&["train", "--resume", s(&run), "--nproc", "2", "--quiet", "--set", "train.steps=200"]);
    let summary = json(&run.join("summary.json"));
    assert_eq!(summary["steps"], 200, "{summary}");
    // The run directory's recipe says what the run followed.
    assert!(std::fs::read_to_string(run.join("recipe.toml")).unwrap().contains("steps = 200"));
}

#[test]
fn a_second_run_on_a_locked_run_directory_is_refused_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let args = long_run(&out, "2");
    let mut first = Background::start(&strs(&args), dir.path().join("stderr"));
    let pid = first.child.id().to_string();
    assert!(wait_until(Duration::from_secs(60), || std::fs::read_to_string(out.join("lock"))
        .is_ok_and(|l| l.contains(&pid))));
    for mode in [["--workers", "2"], ["--nproc", "2"]] {
        let err = refused(&[
            "train",
            "--recipe",
            RECIPE,
            "--out",
            s(&out),
            "--quiet",
            mode[0],
            mode[1],
            "--set",
            "schedule.total_steps=100",
        ]);
        assert!(err.contains("is in use by pid") && err.contains(&pid), "{mode:?}: {err}");
    }
    // A lock left by a dead process is stale: the next run takes it.
    kill(first.child.id(), "KILL");
    first.wait(Duration::from_secs(30)).unwrap();
    assert!(wait_until(Duration::from_secs(30), || processes_with(s(&out)).is_empty()));
    ok(&[
        "train",
        "--recipe",
        RECIPE,
        "--out",
        s(&out),
        "--quiet",
        "--workers",
        "2",
        "--set",
        "schedule.total_steps=100",
    ]);
}

/// Writes an IDX image file of `n` images of `h` x `w` and its label file.
fn write_idx(dir: &Path, prefix: &str, n: usize, h: usize, w: usize) {
    let mut img = vec![0, 0, 8, 3];
    for d in [n, h, w] {
        img.extend((d as u32).to_be_bytes());
    }
    img.extend((0..n * h * w).map(|i| (i * 7 % 251) as u8));
    std::fs::write(dir.join(format!("{prefix}-images-idx3-ubyte")), img).unwrap();
    let mut lab = vec![0, 0, 8, 1];
    lab.extend((n as u32).to_be_bytes());
    lab.extend((0..n).map(|i| (i % 10) as u8));
    std::fs::write(dir.join(format!("{prefix}-labels-idx1-ubyte")), lab).unwrap();
}

#[test]
fn test_images_of_another_size_are_refused_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("mnist");
    std::fs::create_dir_all(&data).unwrap();
    write_idx(&data, "train", 200, 28, 28);
    write_idx(&data, "t10k", 50, 20, 20);
    let path = format!("data.path={}", s(&data));
    let out = dir.path().join("run");
    let args = [
        "train",
        "--recipe",
        RECIPE,
        "--out",
        s(&out),
        "--quiet",
        "--workers",
        "2",
        "--set",
        "data.dataset=mnist",
        "--set",
        &path,
    ];
    let err = refused(&[&args[..], &["--set", "train.local_batch=8"]].concat());
    assert!(err.contains("test images") && err.contains("(1, 20, 20)") && err.contains("(1, 28, 28)"), "{err}");
}

#[test]
fn huge_sizes_are_refused_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    for (set, needle) in [
        ("data.prefetch=1000000000", "data.prefetch"),
        ("model.hidden=[1000000000]", "model.hidden"),
        ("model.hidden=[1048576, 1048576]", "memory is available"),
        ("train.local_batch=1000000000", "train.local_batch"),
    ] {
        let err = refused(&["train", "--recipe", RECIPE, "--out", s(&out), "--quiet", "--workers", "2", "--set", set]);
        assert!(err.contains(needle), "{set}: {err}");
    }
    // Validated before K workers are built.
    let err = refused(&["train", "--recipe", RECIPE, "--out", s(&out), "--quiet", "--workers", "5000"]);
    assert!(err.contains("train.local_batch") && err.contains("5000 workers"), "{err}");
}

#[test]
fn a_full_disk_is_reported_as_the_root_cause_not_a_dropped_handle() {
    if !Command::new("unshare").args(["-m", "true"]).status().is_ok_and(|s| s.success()) {
        assert!(std::env::var("CI").is_err(), "CI runs as root and must be able to mount a small tmpfs");
        eprintln!("SKIP: cannot create a mount namespace (needs root) for a small tmpfs");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("small");
    std::fs::create_dir_all(&mnt).unwrap();
    for attempt in 0..3 {
        let script = format!(
            "mount -t tmpfs -o size=160k tmpfs {m} && exec {q} train --recipe {RECIPE} --workers 4 --out {m}/run --quiet --set schedule.total_steps=200 --set eval.every_epochs=1",
            m = s(&mnt),
            q = env!("CARGO_BIN_EXE_qsr")
        );
        let out = Command::new("unshare").args(["-m", "sh", "-c", &script]).current_dir(root()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "attempt {attempt}: {err}");
        assert!(
            err.contains("No space left on device") && !err.contains("dropped its handle"),
            "attempt {attempt}: {err}"
        );
    }
}

#[test]
fn counters_continue_after_a_resume() {
    let dir = tempfile::tempdir().unwrap();
    let (straight, resumed) = (dir.path().join("straight"), dir.path().join("resumed"));
    let set = ["--set", "schedule.total_steps=200", "--set", "eval.every_epochs=1", "--quiet", "--workers", "2"];
    ok(&[&["train", "--recipe", RECIPE, "--out", s(&straight)][..], &set].concat());
    ok(&[&["train", "--recipe", RECIPE, "--out", s(&resumed), "--halt-after", "60"][..], &set].concat());
    ok(&["train", "--resume", s(&resumed), "--quiet", "--workers", "2"]);
    let records = |run: &Path| -> Vec<(String, u64, u64, u64)> {
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .map(|r| {
                (
                    r["kind"].as_str().unwrap().into(),
                    r["step"].as_u64().unwrap(),
                    r["syncs"].as_u64().unwrap(),
                    r["bytes"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    assert_eq!(records(&straight), records(&resumed));
    let (a, b) = (json(&straight.join("summary.json")), json(&resumed.join("summary.json")));
    assert_eq!((&a["syncs"], &a["bytes_per_rank"]), (&b["syncs"], &b["bytes_per_rank"]));
    assert!(b["bytes_per_rank"].as_u64().unwrap() > 0);
}

/// A 2-worker run of 200 steps stopped at its first checkpoint past step 60 (an evaluation every epoch,
/// so it stops well before the end).
fn halted_run(run: &Path) {
    let args =
        ["--workers", "2", "--set", "schedule.total_steps=200", "--set", "eval.every_epochs=1", "--halt-after", "60"];
    ok(&[&["train", "--recipe", RECIPE, "--out", s(run), "--quiet"][..], &args].concat());
    assert!(!run.join("summary.json").exists(), "the run must stop before its end");
}

#[test]
fn latest_pointing_outside_the_run_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    halted_run(&run);
    let other = dir.path().join("other/ckpt/step-5");
    std::fs::create_dir_all(&other).unwrap();
    for target in ["../../other/ckpt/step-5".to_string(), s(&other).to_string(), "step-5/../../x".into()] {
        std::fs::write(run.join("ckpt/LATEST"), &target).unwrap();
        let err = refused(&["train", "--resume", s(&run), "--quiet", "--workers", "2"]);
        assert!(err.contains("LATEST") && err.contains("step-<N>"), "{target}: {err}");
    }
}

#[test]
fn resuming_a_finished_run_or_below_its_step_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    ok(&[
        "train",
        "--recipe",
        RECIPE,
        "--out",
        s(&run),
        "--quiet",
        "--workers",
        "2",
        "--set",
        "schedule.total_steps=100",
    ]);
    let err = refused(&["train", "--resume", s(&run), "--quiet", "--workers", "2"]);
    assert!(err.contains("already finished at step 100") && err.contains("train.steps"), "{err}");
    let err = refused(&["train", "--resume", s(&run), "--quiet", "--workers", "2", "--set", "train.steps=50"]);
    assert!(err.contains("past train.steps = 50"), "{err}");
    // Raising train.steps continues the run.
    ok(&["train", "--resume", s(&run), "--quiet", "--workers", "2", "--set", "train.steps=150"]);
    assert_eq!(json(&run.join("summary.json"))["steps"], 150);
}

#[test]
fn a_refused_resume_names_the_changed_key() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    halted_run(&run);
    let err = refused(&["train", "--resume", s(&run), "--quiet", "--workers", "2", "--set", "optimizer.momentum=0.8"]);
    assert!(err.contains("`optimizer.momentum` (checkpoint: 0.9, now: 0.8)"), "{err}");
}

#[test]
fn malformed_set_values_and_unknown_dp_keys_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    for bad in ["name=\"abc", "model.hidden=[1, 2", "name='x"] {
        let err = refused(&["train", "--recipe", RECIPE, "--out", s(&out), "--quiet", "--set", bad]);
        assert!(err.contains("not a valid TOML value"), "{bad}: {err}");
    }
    for extra in ["h = 4", "typo_key = 3"] {
        let recipe = dir.path().join("dp.toml");
        let text = std::fs::read_to_string(root().join(RECIPE))
            .unwrap()
            .replace("rule = \"qsr\"\nh_base = 2\nalpha = 0.06", &format!("rule = \"dp\"\n{extra}"));
        std::fs::write(&recipe, text).unwrap();
        let err = refused(&["plan", "--recipe", s(&recipe)]);
        assert!(err.contains(extra.split(' ').next().unwrap()), "{extra}: {err}");
        let err = refused(&["train", "--recipe", s(&recipe), "--out", s(&out), "--quiet"]);
        assert!(err.contains(extra.split(' ').next().unwrap()), "{extra}: {err}");
    }
    let err = refused(&["plan", "--recipe", RECIPE, "--total-steps", "1000000000000000000"]);
    assert!(err.contains("schedule.total_steps") && err.contains("at most"), "{err}");
}

#[test]
fn checkpoints_of_identical_states_are_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt_files = |run: &Path| -> Vec<(String, Vec<u8>)> {
        let latest = std::fs::read_to_string(run.join("ckpt/LATEST")).unwrap();
        let ck = run.join("ckpt").join(latest.trim());
        let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(&ck)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".safetensors"))
            .map(|n| (n.clone(), std::fs::read(ck.join(&n)).unwrap()))
            .collect();
        v.sort();
        v
    };
    let runs: Vec<PathBuf> = (0..3).map(|i| dir.path().join(format!("r{i}"))).collect();
    for r in &runs {
        ok(&[
            "train",
            "--recipe",
            RECIPE,
            "--out",
            s(r),
            "--quiet",
            "--workers",
            "2",
            "--set",
            "schedule.total_steps=100",
        ]);
    }
    let first = ckpt_files(&runs[0]);
    assert_eq!(first.len(), 3, "model + 2 optimizer files");
    for r in &runs[1..] {
        assert!(ckpt_files(r) == first, "checkpoint files of {} differ from {}", r.display(), runs[0].display());
    }
}

#[test]
fn a_fresh_run_into_a_directory_with_checkpoints_is_refused_and_changes_nothing() {
    // It used to train over the old run: pruning kept the old run's later steps and deleted the new
    // run's checkpoints, so LATEST named a checkpoint that no longer existed.
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run_s = run.to_str().unwrap();
    ok(&["train", "--recipe", RECIPE, "--set", "schedule.total_steps=400", "--quiet", "--out", run_s]);
    let before = std::fs::read(run.join("metrics.jsonl")).unwrap();
    let err = refused(&["train", "--recipe", RECIPE, "--set", "schedule.total_steps=200", "--quiet", "--out", run_s]);
    assert!(err.contains("already holds a run") && err.contains("step-400") && err.contains("--resume"), "{err}");
    assert_eq!(std::fs::read(run.join("metrics.jsonl")).unwrap(), before);
    assert_eq!(std::fs::read_to_string(run.join("ckpt/LATEST")).unwrap().trim(), "step-400");
}

#[test]
fn a_compare_rerun_into_its_directory_leaves_each_seed_resumable() {
    // It used to train among the earlier compare's checkpoints: LATEST named one that pruning deleted.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cmp");
    let args = ["compare", "--recipe", RECIPE, "--seeds", "1", "--rules", "qsr", "--out", out.to_str().unwrap()];
    ok(&[&args[..], &["--set", "schedule.total_steps=400"]].concat());
    ok(&[&args[..], &["--set", "schedule.total_steps=200"]].concat());
    let seed = out.join("qsr-seed0");
    assert_eq!(std::fs::read_to_string(seed.join("ckpt/LATEST")).unwrap().trim(), "step-200");
    let err = refused(&["train", "--resume", seed.to_str().unwrap(), "--quiet"]);
    assert!(err.contains("nothing to resume"), "the rerun's checkpoint must be whole: {err}");
}
