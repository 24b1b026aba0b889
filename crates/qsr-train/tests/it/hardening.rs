//! Regression tests of the trainer's launch, run directory and inputs (issue 12): each test is named
//! after the defect it pins. Processes and loopback only; every wait is bounded.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::{RECIPE, json, ok, qsr, qsr_cmd, refused, root};

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
    let status = launcher.wait(Duration::from_secs(30)).expect("the launcher outlived kill");
    if signal == "TERM" {
        // It stopped its workers and says so with 128 + SIGTERM.
        assert_eq!(status.code(), Some(143), "{}", launcher.stderr());
    }
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
    assert_eq!(status.code(), Some(3), "a worker lost to a signal: the job failed for a lost peer");
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
    two_tcp_ranks_with(out, rank1_extra, &[])
}

/// [`two_tcp_ranks`] with extra environment variables for rank 1.
fn two_tcp_ranks_with(out: &Path, rank1_extra: &[&str], rank1_env: &[(&str, &str)]) -> [Output; 2] {
    let port = free_port();
    let extra = ["--set", "schedule.total_steps=400"];
    let children: Vec<Child> = (0..2)
        .map(|rank| {
            let mut c = tcp_rank(rank, &port, (RECIPE, out), &extra);
            if rank == 1 {
                c.args(rank1_extra).envs(rank1_env.iter().copied());
            }
            c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
        })
        .collect();
    let outs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    outs.try_into().unwrap()
}

/// A port nobody listens on now.
fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string()
}

/// Rank `rank` of 2 of an external `--comm tcp` launch with its rendezvous at `port`: `qsr train` of
/// `recipe` into `out`, quiet, with `extra` arguments.
fn tcp_rank(rank: usize, port: &str, (recipe, out): (&str, &Path), extra: &[&str]) -> Command {
    let r = rank.to_string();
    let mut args = vec!["train", "--recipe", recipe, "--out", s(out), "--quiet", "--comm", "tcp", "--rank", &r];
    args.extend(["--world-size", "2", "--master-addr", "127.0.0.1", "--master-port", port]);
    args.extend(extra);
    qsr_cmd(&args)
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

/// Issue 56 D12: a rank launched with another `QSR_TRANSPORT` made rank 0 exit 3 saying only
/// "rank 0 refused to start: vm/c43669c1.../27:1/4026531836"; both ranks now name the variable.
#[test]
fn ranks_launched_with_different_transports_fail_naming_qsr_transport() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    for (rank, o) in two_tcp_ranks_with(&out, &[], &[("QSR_TRANSPORT", "tcp")]).iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "rank {rank} trained");
        assert!(err.contains("`QSR_TRANSPORT`: rank 0 has \"auto\", rank 1 has \"tcp\""), "rank {rank}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// Issue 56 D12: ranks whose training sets differ in size (the same `data.path` on hosts that hold
/// different files) passed the agreement and failed at step 32 blaming "lr schedule, warmup and
/// run_steps". They are refused before training, naming the sizes.
#[test]
fn ranks_that_read_training_sets_of_different_sizes_are_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let (recipe, out) = (root().join(RECIPE), dir.path().join("run"));
    let children: Vec<Child> = [200, 160]
        .iter()
        .enumerate()
        .map(|(rank, &n)| {
            // Each rank its own working directory: `data.path = "mnist"` names another file on each.
            let host = dir.path().join(format!("host-{rank}"));
            std::fs::create_dir_all(host.join("mnist")).unwrap();
            write_idx(&host.join("mnist"), "train", n, 28, 28);
            write_idx(&host.join("mnist"), "t10k", 40, 28, 28);
            let sets = ["--set", "data.dataset=mnist", "--set", "data.path=mnist", "--set", "train.local_batch=8"];
            let mut c = tcp_rank(rank, &port, (s(&recipe), &out), &sets);
            c.current_dir(&host).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
        })
        .collect();
    for (rank, c) in children.into_iter().enumerate() {
        let o = c.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "rank {rank}: {err}");
        assert!(err.contains("`data.train_items`: rank 0 has 200, rank 1 has 160"), "rank {rank}: {err}");
    }
    assert!(!out.join("ckpt").exists(), "a checkpoint was written before the ranks agreed");
}

/// Issue 56 D12: ranks given different `--out` directories trained until the first checkpoint (step
/// 220) and failed there; every rank now checks that its `--out` holds rank 0's run directory before
/// training, and a rank whose `--out` is the same directory under another path (a host's own mount)
/// trains.
#[test]
fn ranks_writing_into_different_run_directories_are_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let run = |outs: [&Path; 2]| -> Vec<Output> {
        let port = free_port();
        let children: Vec<Child> = (0..2)
            .map(|rank| {
                let extra = ["--set", "schedule.total_steps=100"];
                tcp_rank(rank, &port, (RECIPE, outs[rank]), &extra)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        children.into_iter().map(|c| c.wait_with_output().unwrap()).collect()
    };
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    for (rank, o) in run([&a, &b]).iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "rank {rank}: {err}");
        assert!(err.contains("which does not hold rank 0's run directory") && err.contains("--out"), "{err}");
    }
    assert!(!a.join("ckpt").exists() && !b.join("ckpt").exists(), "a checkpoint was written");
    // The same directory through a link (as a host may mount it elsewhere) is rank 0's.
    let link = dir.path().join("mounted");
    std::os::unix::fs::symlink(&a, &link).unwrap();
    for o in run([&a, &link]) {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    assert!(!a.join(".qsr-shared-check").exists(), "the marker is left behind");
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
        // After the run, the checkpoint directory's entries (the tmpfs goes with the namespace).
        let script = format!(
            "mount -t tmpfs -o size=160k tmpfs {m} && {{ {q} train --recipe {RECIPE} --workers 4 --out {m}/run --quiet --set schedule.total_steps=200 --set eval.every_epochs=1; rc=$?; echo left: $(ls {m}/run/ckpt) >&2; exit $rc; }}",
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
        // [N5] The unfinished checkpoint is removed, complete ones kept.
        let left = err.lines().find_map(|l| l.strip_prefix("left:")).unwrap_or_else(|| panic!("no listing: {err}"));
        assert!(!left.contains("tmp-step-"), "attempt {attempt}: {left}");
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

// Issue 30: reliability at the edges. Each test is named after the behaviour it pins (D-items of the
// issue in brackets).

/// Runs `qsr args` with extra environment `env`; kills it if it runs past `limit` (the defects these
/// pin were hangs) and fails the test then.
fn qsr_within(args: &[&str], env: &[(&str, &str)], limit: Duration) -> Output {
    let mut c = qsr_cmd(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let dir = tempfile::tempdir().unwrap();
    let (out_path, err_path) = (dir.path().join("out"), dir.path().join("err"));
    let mut child = c
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let mut status = None;
    wait_until(limit, || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    let Some(status) = status else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("qsr {args:?} still ran after {limit:?}: {}", std::fs::read_to_string(&err_path).unwrap_or_default());
    };
    Output { status, stdout: std::fs::read(&out_path).unwrap(), stderr: std::fs::read(&err_path).unwrap() }
}

/// [`qsr_within`] for a command that must be refused as bad input (status 2); returns stderr.
fn refused_within(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = qsr_within(args, env, Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "qsr {args:?} {env:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn a_stopped_worker_is_named_by_the_launcher_as_the_rank_that_failed() {
    // [D7] The others time out waiting for the stopped rank and exit as peers of a failure.
    let dir = tempfile::tempdir().unwrap();
    let args = ["train", "--recipe", RECIPE, "--nproc", "3", "--quiet", "--set", "schedule.total_steps=4000"];
    let out_dir = dir.path().join("run");
    let out = qsr_within(
        &[&args[..], &["--out", s(&out_dir)]].concat(),
        &[("QSR_TEST_FAULT", "stop:1:50"), ("QSR_COMM_TIMEOUT_SECS", "2")],
        Duration::from_secs(120),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(last.contains("rank 1 was stopped"), "the launcher blamed another rank: {err}");
}

#[test]
fn huge_timeouts_are_refused_naming_the_setting_not_a_panic() {
    // [D8]
    let err = refused_within(&["rendezvous", "--workers", "2", "--settle-secs", "1e300"], &[]);
    assert!(err.contains("--settle-secs") && err.contains("(0, 604800]"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let train = ["train", "--recipe", RECIPE, "--nproc", "2", "--quiet", "--out", s(dir.path())];
    for var in ["QSR_COMM_TIMEOUT_SECS", "QSR_RENDEZVOUS_TIMEOUT_SECS"] {
        for bad in ["1e300", "-1", "inf", "soon"] {
            let err = refused_within(&train, &[(var, bad)]);
            assert!(err.contains(&format!("{var}={bad}")) && err.contains("seconds"), "{err}");
        }
    }
}

#[test]
fn an_empty_test_set_is_refused_before_training() {
    // [D10] A run that cannot evaluate has no result to report.
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("mnist");
    std::fs::create_dir_all(&data).unwrap();
    write_idx(&data, "train", 64, 28, 28);
    write_idx(&data, "t10k", 0, 28, 28);
    let path = format!("data.path={}", s(&data));
    let sets = ["--set", "data.dataset=mnist", "--set", &path, "--set", "train.local_batch=8"];
    let run = dir.path().join("run");
    let err =
        refused(&[&["train", "--recipe", RECIPE, "--out", s(&run), "--quiet", "--workers", "2"][..], &sets].concat());
    assert!(err.contains("test split of mnist is empty"), "{err}");
    assert!(!run.join("metrics.jsonl").exists());
}

#[test]
fn a_launchers_environment_without_comm_is_refused_naming_the_variable() {
    // [D11] Each process would otherwise train the whole job alone.
    let dir = tempfile::tempdir().unwrap();
    let args = ["train", "--recipe", RECIPE, "--quiet", "--out", s(dir.path())];
    let env: [&[(&str, &str)]; 3] = [
        &[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29999")],
        &[("OMPI_COMM_WORLD_SIZE", "3")],
        &[("PMI_SIZE", "4"), ("PMI_RANK", "0")],
    ];
    for e in env {
        let err = refused_within(&args, e);
        let (var, n) = e.iter().find(|(k, _)| k.ends_with("SIZE")).unwrap();
        assert!(err.contains(&format!("a job of {n} ranks ({var}={n})")) && err.contains("--comm tcp"), "{err}");
    }
}

#[test]
fn compare_refuses_no_rules_and_a_rule_named_twice() {
    // [D12]
    let dir = tempfile::tempdir().unwrap();
    let base = ["compare", "--recipe", RECIPE, "--seeds", "1", "--out", s(dir.path())];
    let err = refused(&[&base[..], &["--rules", ""]].concat());
    assert!(err.contains("--rules") && err.contains("names no rule"), "{err}");
    let err = refused(&[&base[..], &["--rules", "dp,qsr,dp"]].concat());
    assert!(err.contains("--rules names `dp` twice"), "{err}");
    assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none(), "nothing may be written");
}

#[test]
fn plot_draws_losses_near_the_largest_double_without_hanging() {
    // [D13]
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    ok(&["train", "--recipe", RECIPE, "--out", s(&run), "--quiet", "--workers", "2", "--set", "train.steps=44"]);
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let huge: Vec<String> = text
        .lines()
        .enumerate()
        .map(|(i, l)| {
            let mut r: serde_json::Value = serde_json::from_str(l).unwrap();
            r["loss"] = serde_json::json!(if i % 2 == 0 { 1.79e308 } else { -1.79e308 });
            r.to_string()
        })
        .collect();
    std::fs::write(run.join("metrics.jsonl"), huge.join("\n") + "\n").unwrap();
    let out = qsr_within(&["plot", s(&run), "--out", s(&dir.path().join("plots"))], &[], Duration::from_secs(60));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn plan_json_names_each_key_once() {
    // [D14]
    let out = ok(&["plan", "--recipe", RECIPE, "--format", "json"]);
    for key in ["rule", "sync", "schedule", "rounds"] {
        assert_eq!(out.matches(&format!("\n  \"{key}\":")).count(), 1, "`{key}` at the top level: {out}");
    }
}

#[test]
fn simulate_refuses_a_world_of_zero_nodes_that_do_not_divide_it_and_negative_references() {
    // [D15]
    let base = ["simulate", "--recipe", RECIPE, "--bandwidth", "1gbit", "--step-seconds", "0.1", "--params", "1000"];
    let err = refused(&[&base[..], &["--world-size", "0"]].concat());
    assert!(err.contains("--world-size must be at least 1"), "{err}");
    let err = refused(&[&base[..], &["--world-size", "4", "--node-size", "3"]].concat());
    assert!(err.contains("nodes of 3 workers (--node-size) do not divide its 4 workers"), "{err}");
    let err = refused(&[&base[..], &["--reference", "digits-mlp-qsr=-2"]].concat());
    assert!(err.contains("--reference digits-mlp-qsr=-2") && err.contains("positive number of hours"), "{err}");
}

#[test]
fn an_overlong_advertise_host_is_refused_at_once_naming_the_variable() {
    // [D16] It used to retry its registration until the rendezvous timeout.
    let dir = tempfile::tempdir().unwrap();
    let long = "h".repeat(5000);
    let args = ["train", "--recipe", RECIPE, "--quiet", "--out", s(dir.path())];
    for launch in [&["--nproc", "2"][..], &["--comm", "tcp", "--rank", "1", "--world-size", "2"]] {
        let err = refused_within(&[&args[..], launch].concat(), &[("QSR_ADVERTISE_HOST", &long)]);
        assert!(err.contains("QSR_ADVERTISE_HOST has 5000 bytes"), "{err}");
    }
    let err = refused_within(&[&args[..], &["--nproc", "2"]].concat(), &[("QSR_ADVERTISE_HOST", "bad host")]);
    assert!(err.contains("QSR_ADVERTISE_HOST") && err.contains("' '"), "{err}");
}

#[test]
fn errors_of_the_local_level_are_labelled_sync_local() {
    // [D19]
    let dir = tempfile::tempdir().unwrap();
    let train = ["train", "--recipe", RECIPE, "--workers", "4", "--quiet", "--out", s(dir.path())];
    let err = refused(&[&train[..], &["--set", "sync.local.rule=bogus"]].concat());
    assert!(err.contains("[sync.local] unknown variant `bogus`"), "{err}");
    let err = refused(&[&train[..], &["--set", "sync.local.rule=qsr", "--set", "sync.local.h_base=2"]].concat());
    assert!(err.contains("[sync.local] missing field `alpha`"), "{err}");
    let recipe = dir.path().join("local.toml");
    let text = std::fs::read_to_string(root().join(RECIPE)).unwrap() + "\n[sync.local]\nrule = \"bogus\"\n";
    std::fs::write(&recipe, text).unwrap();
    let err = refused(&["plan", "--recipe", s(&recipe)]);
    assert!(err.contains("[sync.local] unknown variant `bogus`"), "{err}");
}

fn mkfifo(path: &Path) {
    assert!(Command::new("mkfifo").arg(path).status().unwrap().success());
}

#[test]
fn a_fifo_as_latest_or_as_data_is_refused_not_waited_on() {
    // [D20]
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    halted_run(&run);
    std::fs::remove_file(run.join("ckpt/LATEST")).unwrap();
    mkfifo(&run.join("ckpt/LATEST"));
    let err = refused_within(&["train", "--resume", s(&run), "--quiet", "--workers", "2"], &[]);
    assert!(err.contains("LATEST is not a regular file (it is a FIFO)"), "{err}");
    let fifo = dir.path().join("text.fifo");
    mkfifo(&fifo);
    let path = format!("data.path={}", s(&fifo));
    let text = ["--set", "data.dataset=text", "--set", &path];
    let t = dir.path().join("t");
    let args = ["train", "--recipe", "recipes/shakespeare-char-qsr.toml", "--quiet", "--out", s(&t)];
    let err = refused_within(&[&args[..], &text].concat(), &[]);
    assert!(err.contains("not a regular file (it is a FIFO)"), "{err}");
}

/// Issue 56 D4: `ckpt/step-N/manifest.json` was read unbounded: /dev/zero grew `--resume` by about
/// 2 GB/s, a FIFO blocked it silently, and a sparse 3 GB manifest cost 3 GB of memory. Each is refused
/// at once, naming the manifest; a state.json replaced by a link to /dev/zero is refused too.
#[test]
fn a_manifest_that_is_dev_zero_a_fifo_or_sparse_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    halted_run(&run);
    let latest = std::fs::read_to_string(run.join("ckpt/LATEST")).unwrap();
    let step = run.join("ckpt").join(latest.trim());
    let manifest = step.join("manifest.json");
    let saved = std::fs::read(&manifest).unwrap();
    let resume = ["train", "--resume", s(&run), "--quiet", "--workers", "2"];
    let replace = |how: &dyn Fn(&Path)| {
        std::fs::remove_file(&manifest).unwrap();
        how(&manifest);
    };
    replace(&|p| std::os::unix::fs::symlink("/dev/zero", p).unwrap());
    let err = refused_within(&resume, &[]);
    assert!(err.contains("manifest.json is not a regular file (it is a device)"), "{err}");
    replace(&|p| mkfifo(p));
    let err = refused_within(&resume, &[]);
    assert!(err.contains("manifest.json is not a regular file (it is a FIFO)"), "{err}");
    replace(&|p| std::fs::File::create(p).unwrap().set_len(3 << 30).unwrap());
    let err = refused_within(&resume, &[]);
    assert!(err.contains("manifest.json is larger than"), "{err}");
    replace(&|p| std::fs::write(p, &saved).unwrap());
    let state = step.join("state.json");
    std::fs::remove_file(&state).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &state).unwrap();
    let err = refused_within(&resume, &[]);
    assert!(err.contains("state.json is a symbolic link, not a regular file"), "{err}");
}

#[test]
fn dev_zero_as_a_data_file_is_refused_before_reading_it() {
    // [D21] It used to be read until memory ran out.
    let dir = tempfile::tempdir().unwrap();
    let args = ["train", "--recipe", "recipes/shakespeare-char-qsr.toml", "--quiet", "--out", s(dir.path())];
    let err =
        refused_within(&[&args[..], &["--set", "data.dataset=text", "--set", "data.path=/dev/zero"]].concat(), &[]);
    assert!(err.contains("/dev/zero: not a regular file (it is a device)"), "{err}");
    // An IDX file is read no further than its header says: a header that promises more than the file
    // has is refused before its data is read, whatever its size.
    let data = dir.path().join("mnist");
    std::fs::create_dir_all(&data).unwrap();
    write_idx(&data, "train", 64, 28, 28);
    write_idx(&data, "t10k", 16, 28, 28);
    let mut header = vec![0, 0, 8, 3];
    for d in [4_000_000u32, 28, 28] {
        header.extend(d.to_be_bytes());
    }
    std::fs::write(data.join("train-images-idx3-ubyte"), header).unwrap();
    let path = format!("data.path={}", s(&data));
    let sets = ["--set", "data.dataset=mnist", "--set", &path, "--set", "train.local_batch=8"];
    let err =
        refused(&[&["train", "--recipe", RECIPE, "--out", s(&dir.path().join("r")), "--quiet"][..], &sets].concat());
    assert!(err.contains("truncated file") && err.contains("file has 0"), "{err}");
}

#[test]
fn extending_a_run_that_ended_inside_a_round_says_it_makes_one_sync_more_than_the_plan() {
    // [D22] A run always ends on a sync; a longer plan has that step inside a round.
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    ok(&["train", "--recipe", RECIPE, "--set", "train.steps=45", "--workers", "2", "--quiet", "--out", s(&run)]);
    let out = qsr(&["train", "--resume", s(&run), "--set", "train.steps=90", "--workers", "2", "--quiet"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("resuming at step 45 inside this plan's round 44..46"), "{err}");
    assert!(err.contains("one sync more than `qsr plan` shows"), "{err}");
    let plan = ok(&["plan", "--recipe", RECIPE, "--run-steps", "90", "--format", "json"]);
    let rounds = serde_json::from_str::<serde_json::Value>(&plan).unwrap()["rounds"].as_u64().unwrap();
    assert_eq!(json(&run.join("summary.json"))["syncs"].as_u64(), Some(rounds + 1));
}

#[test]
fn a_checkpoint_that_is_a_symlink_into_another_run_is_refused() {
    // [D23]
    let dir = tempfile::tempdir().unwrap();
    let (run, other) = (dir.path().join("run"), dir.path().join("other"));
    halted_run(&run);
    halted_run(&other);
    let name = std::fs::read_to_string(run.join("ckpt/LATEST")).unwrap();
    let step = run.join("ckpt").join(name.trim());
    std::fs::remove_dir_all(&step).unwrap();
    std::os::unix::fs::symlink(other.join("ckpt").join(name.trim()), &step).unwrap();
    let err = refused(&["train", "--resume", s(&run), "--quiet", "--workers", "2"]);
    assert!(err.contains("which is a symbolic link, not a checkpoint directory of this run"), "{err}");
    std::fs::remove_file(&step).unwrap();
    std::fs::remove_file(run.join("ckpt/LATEST")).unwrap();
    std::os::unix::fs::symlink(other.join("ckpt/LATEST"), run.join("ckpt/LATEST")).unwrap();
    let err = refused(&["train", "--resume", s(&run), "--quiet", "--workers", "2"]);
    assert!(err.contains("LATEST is not a regular file (it is a symbolic link)"), "{err}");
}

#[test]
fn a_diverging_run_stops_at_the_evaluation_that_sees_it_with_exit_status_4() {
    // [no silent exit 0] An lr far past the edge of stability.
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let args = ["train", "--recipe", RECIPE, "--workers", "2", "--quiet", "--out", s(&run)];
    let out = qsr(&[&args[..], &["--set", "schedule.lr_max=50", "--set", "eval.every_epochs=1"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("training diverged at step"), "{err}");
    let summary = json(&run.join("summary.json"));
    assert!(summary["diverged"].as_str().unwrap().contains("the loss at the start"), "{summary}");
    assert!(!run.join("ckpt/LATEST").exists(), "a diverged state is not checkpointed");
    // The same through `qsr compare`: the table marks the rule, the exit status says so.
    let cmp = dir.path().join("cmp");
    let out = qsr(&[
        "compare",
        "--recipe",
        RECIPE,
        "--rules",
        "qsr",
        "--seeds",
        "1",
        "--out",
        s(&cmp),
        "--set",
        "schedule.lr_max=50",
    ]);
    assert_eq!(out.status.code(), Some(4), "{}", String::from_utf8_lossy(&out.stderr));
    let table = std::fs::read_to_string(cmp.join("compare.md")).unwrap();
    assert!(table.contains("**diverged in 1 of 1 seeds**"), "{table}");
}

#[test]
fn the_readme_compare_with_an_outer_optimizer_trains_digits() {
    // [D18] DiLoCo's momentum 0.9 drove QSR on digits to chance; `+outer` defaults to momentum 0.5.
    let dir = tempfile::tempdir().unwrap();
    let out = s(dir.path());
    ok(&["compare", "--recipe", "recipes/digits-qsr.toml", "--rules", "qsr+outer", "--seeds", "1", "--out", out]);
    let rows = json(&dir.path().join("compare.json"));
    assert_eq!(rows[0]["outer"]["momentum"], 0.5);
    assert!(rows[0]["accuracy_mean"].as_f64().unwrap() > 0.9, "{rows}");
}

#[test]
fn a_diverging_elastic_job_ends_with_status_4_not_a_hang() {
    // Every worker stops at the evaluation that saw it and tells the store the job finished.
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let args = ["train", "--recipe", RECIPE, "--nproc", "2", "--elastic", "--quiet", "--out", s(&run)];
    let out = qsr_within(
        &[&args[..], &["--set", "schedule.lr_max=50", "--set", "eval.every_epochs=1"]].concat(),
        &[("QSR_COMM_TIMEOUT_SECS", "2")],
        Duration::from_secs(120),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    // Both ranks diverge at the same evaluation; the launcher names whichever it sees exit first.
    let named = err.contains("rank 0 diverged") || err.contains("rank 1 diverged");
    assert!(err.contains("training diverged") && named, "{err}");
}

#[test]
fn an_elastic_launch_whose_last_worker_dies_ends_instead_of_waiting_forever() {
    // Rank 1 is stopped and expelled; rank 0 goes on alone and is killed: nobody holds the training
    // state, and the launcher must stop the stopped worker and fail, not wait for it.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = long_run(&out, "2");
    args.push("--elastic".into());
    let mut c = qsr_cmd(&strs(&args));
    c.env("QSR_TEST_FAULT", "stop:1:20").env("QSR_COMM_TIMEOUT_SECS", "2");
    let file = std::fs::File::create(dir.path().join("stderr")).unwrap();
    let child = c.stdout(Stdio::null()).stderr(file).spawn().unwrap();
    let mut launcher = Background { child, stderr: dir.path().join("stderr") };
    let membership = || std::fs::read_to_string(out.join("metrics.jsonl")).is_ok_and(|t| t.contains("membership"));
    assert!(wait_until(Duration::from_secs(60), membership), "rank 1 was never expelled: {}", launcher.stderr());
    let rank0 = processes_with(s(&out)).into_iter().find(|(_, c)| c.contains("--spawned") && c.contains("--rank 0 "));
    kill(rank0.expect("rank 0 runs").0, "KILL");
    let status = launcher.wait(Duration::from_secs(60)).expect("the launcher must end once nobody holds the job");
    assert_eq!(status.code(), Some(3), "{}", launcher.stderr());
    assert!(launcher.stderr().contains("rank 0 was killed by signal 9"), "{}", launcher.stderr());
    assert!(wait_until(Duration::from_secs(30), || processes_with(s(&out)).is_empty()), "workers left behind");
}

// Issue 43: streaming and the edges a new attack found (N-items in brackets).

/// Makes a FIFO at `path`.
fn fifo(path: &Path) {
    assert!(Command::new("mkfifo").arg(path).status().unwrap().success(), "mkfifo {}", path.display());
}

/// [N4] Every file qsr reads is a regular file of bounded size: a FIFO named as a recipe (train,
/// plan, compare), a resumed run's recipe.toml, a plotted metrics.jsonl or a simulated run's
/// summary.json hung, and `--recipe /dev/zero` grew memory at 1 GB/s. Each is refused at once as bad
/// input, naming the file.
#[test]
fn files_that_are_not_regular_are_refused_at_once_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str| dir.path().join(name);
    let recipe = at("recipe.toml");
    fifo(&recipe);
    let (train, compare) = (at("t"), at("c"));
    for args in [
        &["train", "--recipe", s(&recipe), "--workers", "2", "--out", s(&train)][..],
        &["plan", "--recipe", s(&recipe)],
        &["compare", "--recipe", s(&recipe), "--out", s(&compare)],
        &["plan", "--recipe", "/dev/zero"],
    ] {
        let err = refused_within(args, &[]);
        assert!(err.contains("is not a regular file (it is a"), "{args:?}: {err}");
    }
    let run = at("run");
    halted_run(&run);
    std::fs::remove_file(run.join("recipe.toml")).unwrap();
    fifo(&run.join("recipe.toml"));
    let err = refused_within(&["train", "--resume", s(&run), "--workers", "2", "--quiet"], &[]);
    assert!(err.contains("recipe.toml is not a regular file (it is a FIFO)"), "{err}");
    let plotted = at("plotted");
    std::fs::create_dir(&plotted).unwrap();
    fifo(&plotted.join("metrics.jsonl"));
    let err = refused_within(&["plot", s(&plotted), "--out", s(&at("plots"))], &[]);
    assert!(err.contains("metrics.jsonl is not a regular file (it is a FIFO)"), "{err}");
    let simulated = at("simulated");
    std::fs::create_dir(&simulated).unwrap();
    std::fs::copy(root().join(RECIPE), simulated.join("recipe.toml")).unwrap();
    fifo(&simulated.join("summary.json"));
    let err =
        refused_within(&["simulate", "--run", s(&simulated), "--bandwidth", "1gbit", "--step-seconds", "0.1"], &[]);
    assert!(err.contains("summary.json is not a regular file (it is a FIFO)"), "{err}");
}

/// [N6] `qsr launch --nproc 4294967295` spawned about 32,400 processes before the host refused more;
/// `--nproc` is bounded for `qsr launch` as for `qsr train`, refused before anything starts.
#[test]
fn an_nproc_beyond_one_host_is_refused_before_anything_starts() {
    for args in [
        &["launch", "--nproc", "4294967295", "--", "/bin/true"][..],
        &["train", "--recipe", RECIPE, "--nproc", "100000", "--quiet"],
    ] {
        let err = refused_within(args, &[]);
        assert!(err.contains("must be in 1..=1024 processes on this host"), "{args:?}: {err}");
    }
}

/// [N5] A `--nproc` launcher interrupted (SIGINT, SIGTERM) while rank 0 commits a streaming
/// checkpoint left `ckpt/tmp-step-<N>` behind; it sweeps what its stopped workers left unfinished.
#[test]
fn an_interrupted_launcher_leaves_no_unfinished_checkpoint() {
    for (signal, code) in [("INT", 130), ("TERM", 143)] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        let sets = ["sync.rule=constant", "sync.h=2", "sync.streaming.fragments=2", "eval.every_epochs=1"];
        let mut args = vec!["train", "--recipe", RECIPE, "--nproc", "2", "--out", s(&out), "--quiet"];
        args.extend(sets.iter().flat_map(|x| ["--set", x]));
        let stderr = std::fs::File::create(dir.path().join("stderr")).unwrap();
        // Rank 0 stops (SIGSTOP) as it commits step 44's checkpoint, its files written.
        let mut child = qsr_cmd(&args)
            .env("QSR_TEST_FAULT", "stop:0:44:commit")
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let tmp = out.join("ckpt/tmp-step-44");
        let log = || std::fs::read_to_string(dir.path().join("stderr")).unwrap_or_default();
        let stopped = wait_until(Duration::from_secs(60), || tmp.join("state.json").exists());
        std::thread::sleep(Duration::from_millis(300));
        kill(child.id(), signal);
        let mut status = None;
        wait_until(Duration::from_secs(30), || {
            status = child.try_wait().unwrap();
            status.is_some()
        });
        let _ = child.kill();
        assert!(stopped, "{signal}: rank 0 never reached the commit of step 44: {}", log());
        assert_eq!(status.and_then(|s| s.code()), Some(code), "{signal}: {}", log());
        let left: Vec<String> = std::fs::read_dir(out.join("ckpt"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(left.iter().all(|n| !n.starts_with("tmp-step-")), "{signal}: {left:?}");
    }
}

/// N7: bad input exits 2 before any worker starts (it exited 1, some of it after starting workers).
#[test]
fn bad_input_to_train_compare_and_rendezvous_exits_2_before_any_worker_starts() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let out = out.to_str().unwrap();
    // digits-mlp has 4 tensors: the recipe alone cannot know it, the launcher checks the model.
    for launch in [["--workers", "2"], ["--nproc", "2"]] {
        let mut args = vec!["train", "--recipe", RECIPE, "--quiet", "--out", out];
        args.extend(launch);
        args.extend(["--set", "sync.streaming.fragments=5"]);
        let e = refused(&args);
        assert!(e.contains("invalid `sync.streaming.fragments`: must be 1..=4"), "{e}");
        assert!(!e.contains("worker 0") && !e.contains("rank 0"), "a worker started: {e}");
    }
    let compare = ["compare", "--recipe", RECIPE, "--out", out];
    let e = refused(&[&compare[..], &["--workers", "0"]].concat());
    assert!(e.contains("--workers must be at least 1"), "{e}");
    let e = refused(&[&compare[..], &["--seeds", "4294967296"]].concat());
    assert!(e.contains("--seeds 4294967296: must be 1..=1000"), "{e}");
    let e = refused(&["compare", "--recipe", RECIPE, "--out", "/etc/hostname"]);
    assert!(e.contains("--out /etc/hostname: exists and is not a directory"), "{e}");
    let e = refused(&["rendezvous", "--listen", "999.1.1.1:1", "--workers", "2"]);
    assert!(e.contains("--listen 999.1.1.1:1: not an address to listen on"), "{e}");
}

/// N7: `qsr compare` of a streaming recipe under the default rules (dp among them) ran into a
/// refusal of `dp` with streaming; dp is now the baseline without `[sync.streaming]`.
#[test]
fn compare_runs_a_streaming_recipe_against_data_parallel_without_streaming() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cmp");
    let args = ["compare", "--recipe", RECIPE, "--rules", "dp,qsr", "--seeds", "1", "--out", out.to_str().unwrap()];
    ok(&[&args[..], &["--set", "sync.streaming.fragments=2", "--set", "schedule.total_steps=60"]].concat());
    let recipe = |rule: &str| std::fs::read_to_string(out.join(format!("{rule}-seed0/recipe.toml"))).unwrap();
    assert!(!recipe("dp").contains("[sync.streaming]"), "{}", recipe("dp"));
    assert!(recipe("qsr").contains("[sync.streaming]"), "{}", recipe("qsr"));
}

/// N10: recipe values are refused naming their key, a section given as an array is refused (it was
/// read by position), and `qsr plot` of a run without records is refused (it drew empty charts).
#[test]
fn bad_values_name_their_key_and_empty_metrics_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let train = ["train", "--recipe", RECIPE, "--quiet", "--out", out.to_str().unwrap()];
    let e = refused(&[&train[..], &["--set", "sync.streaming.fragments=-1"]].concat());
    assert!(e.contains("invalid `sync.streaming.fragments`: invalid value: integer `-1`"), "{e}");
    let e = refused(&[&train[..], &["--set", "sync.streaming=[1,2]"]].concat());
    assert!(e.contains("`sync.streaming` must be a table"), "{e}");
    let e = refused(&[&train[..], &["--set", "train=[1,2]"]].concat());
    assert!(e.contains("`train` must be a table"), "{e}");
    let run = dir.path().join("empty");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(run.join("metrics.jsonl"), "").unwrap();
    let e = refused(&["plot", run.to_str().unwrap()]);
    assert!(e.contains("no metrics records"), "{e}");
}

/// Issue 56 D12: flags that made no sense were accepted or refused with the wrong words: a store for
/// a hundred million workers, a job of no host.
#[test]
fn a_store_past_a_rings_size_and_a_job_of_no_host_are_refused_naming_why() {
    let err = crate::common::refused(&["rendezvous", "--workers", "100000000", "--listen", "127.0.0.1:0"]);
    assert!(err.contains("at most 65536 workers"), "{err}");
    let err = crate::common::refused(&["launch", "--nnodes", "0", "--nproc", "2", "--", "true"]);
    assert!(err.contains("--nnodes 0: a job needs at least one host"), "{err}");
}

/// Issue 56 D10: SIGINT to `qsr train --workers 4` (threads) killed it at once: status 130 and no
/// word, no `--resume` hint, a checkpoint sometimes half written. The workers stop together at a
/// sync with a checkpoint, say so with the hint, leave nothing unfinished, and the run resumes to
/// its end.
#[test]
fn a_threaded_run_interrupted_by_sigint_stops_at_a_sync_and_resumes() {
    interrupted_run_resumes(&["--workers", "4"], ("INT", 2, "SIGINT"));
}

/// Issue 56 D10, for processes: the workers of `qsr train --nproc` died of their launcher's forwarded
/// SIGTERM wherever they were. They now stop together at their next sync with a checkpoint, and the
/// run continues with `--resume` to the end.
#[test]
fn an_nproc_run_whose_launcher_gets_sigterm_stops_at_a_sync_and_resumes() {
    let err = interrupted_run_resumes(&["--nproc", "2"], ("TERM", 15, "SIGTERM"));
    // The workers stopped themselves at a sync (they used to die of the forwarded signal).
    assert!(err.contains("rank 0 of 2: interrupted by signal 15 (SIGTERM)"), "{err}");
}

/// A long digits run with `workers` flags, given `signal` once its first checkpoint exists: it must
/// exit 128 + the signal with the `--resume` hint, leave no unfinished checkpoint, and resume to its
/// 3000 steps. Returns what it printed when interrupted.
fn interrupted_run_resumes(workers: &[&str], (signal, number, name): (&str, i32, &str)) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let args = ["train", "--recipe", RECIPE, "--out", s(&out), "--quiet"];
    let long = ["--set", "schedule.total_steps=200000", "--set", "train.steps=3000"];
    let mut run = Background::start(&[&args[..], workers, &long].concat(), dir.path().join("stderr"));
    assert!(wait_until(Duration::from_secs(60), || out.join("ckpt/LATEST").exists()), "no checkpoint came");
    kill(run.child.id(), signal);
    let status = run.wait(Duration::from_secs(60)).expect("the run did not stop at its next sync");
    let err = run.stderr();
    assert_eq!(status.code(), Some(128 + number), "{err}");
    assert!(err.contains(&format!("interrupted by signal {number} ({name})")) && err.contains("--resume"), "{err}");
    let left: Vec<_> = std::fs::read_dir(out.join("ckpt")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.iter().all(|n| !n.to_string_lossy().starts_with("tmp-")), "{left:?}");
    ok(&[&["train", "--resume", s(&out), "--quiet"][..], workers].concat());
    assert_eq!(json(&out.join("summary.json"))["steps"], 3000);
    err
}
