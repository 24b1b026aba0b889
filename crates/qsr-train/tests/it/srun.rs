//! `qsr train --comm tcp` under a real SLURM `srun` (scripts/slurm-single-node.sh starts a one-node
//! cluster here). Without a usable `srun`/`sinfo` the tests print a skip reason and pass, unless
//! `QSR_REQUIRE_SLURM=1` (CI), where that is a failure.
//!
//! Every wait is bounded, and a job's srun, SLURM job and task processes are cleaned up on drop, so a
//! failing test never leaves a hanging job behind. Tasks talk over loopback only (MASTER_ADDR=127.0.0.1)
//! on a port picked per job, so the two tests can run at the same time.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::common::{RECIPE, json, root};

const SETUP_HINT: &str = "run scripts/slurm-single-node.sh as root (apt-get install slurm-wlm munge)";

/// Waits for `child` at most `limit`; past that kills it and returns `None`.
fn wait_bounded(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("wait for child") {
            return Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs a short command with a time limit; `Err` says what went wrong, else its stdout.
/// Output goes to files so that a chatty command cannot block on a full pipe.
fn run_bounded(cmd: &mut Command, limit: Duration) -> Result<String, String> {
    let dir = tempfile::tempdir().unwrap();
    let (out, err) = (dir.path().join("out"), dir.path().join("err"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(File::create(&out).unwrap())
        .stderr(File::create(&err).unwrap())
        .spawn()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    let status = wait_bounded(&mut child, limit).ok_or_else(|| format!("{cmd:?} did not answer within {limit:?}"))?;
    let stdout = std::fs::read_to_string(&out).unwrap_or_default();
    if !status.success() {
        let stderr = std::fs::read_to_string(&err).unwrap_or_default();
        return Err(format!("{cmd:?} failed ({status}): {}", stderr.trim()));
    }
    Ok(stdout)
}

/// Why SLURM cannot run jobs here, if it cannot.
fn slurm_problem() -> Option<String> {
    if let Err(e) = run_bounded(Command::new("srun").arg("--version"), Duration::from_secs(10)) {
        return Some(e);
    }
    // sinfo asks slurmctld: it fails (or hangs, hence the bound) without a running cluster. A state
    // ending in '*' (not responding) or '~' (powered off) does not count.
    match run_bounded(Command::new("sinfo").args(["-h", "-o", "%t"]), Duration::from_secs(20)) {
        Err(e) => Some(e),
        Ok(states)
            if !states.lines().any(|s| {
                matches!(s.trim().trim_end_matches(['#', '!', '%', '@', '^', '-']), "idle" | "mix" | "alloc" | "comp")
            }) =>
        {
            Some(format!("no SLURM node takes jobs (sinfo states: {:?})", states.trim()))
        }
        Ok(_) => None,
    }
}

/// Whether to run: a skip is printed, or with `QSR_REQUIRE_SLURM=1` a failure raised.
fn slurm_usable(test: &str) -> bool {
    let Some(why) = slurm_problem() else { return true };
    if std::env::var("QSR_REQUIRE_SLURM").is_ok_and(|v| v == "1") {
        panic!("QSR_REQUIRE_SLURM=1 but SLURM is not usable: {why}; {SETUP_HINT}");
    }
    eprintln!("SKIP {test}: SLURM is not usable: {why}; {SETUP_HINT}");
    false
}

/// A port nobody listens on now, for this job's rendezvous (jobs of the two tests must differ).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One `srun ... qsr train` job, cleaned up (srun, SLURM job, task processes) when dropped.
struct Job {
    srun: Child,
    name: String,
    out: PathBuf,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl Job {
    fn start(tasks: usize, out: &Path, extra: &[&str]) -> Job {
        let logs = out.parent().unwrap();
        let (stdout, stderr) = (logs.join("srun.out"), logs.join("srun.err"));
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let name = format!("qsr-srun-test-{}-{nanos}", std::process::id());
        let mut c = Command::new("srun");
        // --overcommit: more tasks than CPUs (CI has 2 cores); --oversubscribe: share the node with the
        // other test's job; --kill-on-bad-exit=0: survivors of a killed task report it themselves;
        // --label: "N: " before each task's lines; --immediate: fail instead of queueing forever.
        c.args(["-n", &tasks.to_string(), "--overcommit", "--oversubscribe", "--kill-on-bad-exit=0", "--label"]);
        c.args(["--immediate=30", "--export=ALL", "--job-name", &name]);
        c.arg(env!("CARGO_BIN_EXE_qsr"));
        c.args(["train", "--recipe", RECIPE, "--comm", "tcp", "--quiet", "--out"]).arg(out).args(extra);
        c.current_dir(root());
        c.env("MASTER_ADDR", "127.0.0.1").env("MASTER_PORT", free_port().to_string()).env("QSR_JOB_TOKEN", &name);
        // Other launchers' variables would take precedence over SLURM's in rank detection.
        for v in
            ["RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"]
        {
            c.env_remove(v);
        }
        c.stdin(Stdio::null()).stdout(File::create(&stdout).unwrap()).stderr(File::create(&stderr).unwrap());
        let srun = c.spawn().unwrap_or_else(|e| panic!("cannot start srun: {e}"));
        Job { srun, name, out: out.to_path_buf(), stdout, stderr }
    }

    fn wait(&mut self, limit: Duration) -> Option<ExitStatus> {
        wait_bounded(&mut self.srun, limit)
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    fn logs(&self) -> String {
        format!("--- srun stdout:\n{}--- srun stderr:\n{}", self.stdout(), self.stderr())
    }

    /// This job's task processes by SLURM_PROCID: those running qsr with our `--out` (srun excluded).
    fn tasks(&self) -> BTreeMap<usize, u32> {
        let out = self.out.as_os_str().as_encoded_bytes();
        let mut found = BTreeMap::new();
        let Ok(procs) = std::fs::read_dir("/proc") else { return found };
        for entry in procs.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            if pid == self.srun.id() {
                continue;
            }
            // Processes come and go while we scan: unreadable ones are skipped.
            let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
            if !cmdline.split(|&b| b == 0).any(|arg| arg == out) {
                continue;
            }
            let Ok(environ) = std::fs::read(entry.path().join("environ")) else { continue };
            let procid = environ
                .split(|&b| b == 0)
                .find_map(|kv| kv.strip_prefix(b"SLURM_PROCID="))
                .and_then(|v| std::str::from_utf8(v).ok()?.parse::<usize>().ok());
            if let Some(rank) = procid {
                found.insert(rank, pid);
            }
        }
        found
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // Whatever happened: srun, then the SLURM job (its tasks), then any task that is still around.
        if self.srun.try_wait().ok().flatten().is_none() {
            let _ = self.srun.kill();
            let _ = self.srun.wait();
        }
        let _ = run_bounded(Command::new("scancel").args(["--name", &self.name]), Duration::from_secs(10));
        for pid in self.tasks().values() {
            let _ = run_bounded(Command::new("kill").args(["-KILL", &pid.to_string()]), Duration::from_secs(5));
        }
    }
}

#[test]
fn srun_two_tasks_train_with_world_size_two_and_sync_as_planned() {
    if !slurm_usable("srun_two_tasks_train_with_world_size_two_and_sync_as_planned") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    // 200 steps: well under a second of training.
    let mut job = Job::start(2, &run, &["--set", "schedule.total_steps=200"]);
    let status =
        job.wait(Duration::from_secs(90)).unwrap_or_else(|| panic!("srun did not finish within 90 s\n{}", job.logs()));
    assert!(status.success(), "srun failed ({status})\n{}", job.logs());
    let s = json(&run.join("summary.json"));
    assert_eq!(s["world_size"], 2, "{s}");
    assert_eq!(s["steps"], 200, "{s}");
    let plan = run_bounded(
        Command::new(env!("CARGO_BIN_EXE_qsr"))
            .args(["plan", "--recipe", RECIPE, "--total-steps", "200", "--format", "json"])
            .current_dir(root()),
        Duration::from_secs(30),
    )
    .unwrap();
    let plan: serde_json::Value = serde_json::from_str(&plan).unwrap();
    assert_eq!(s["syncs"], plan["rounds"], "{s}");
    assert_eq!(s["planned_syncs"], plan["rounds"], "{s}");
    let saved = std::fs::read_to_string(run.join("recipe.toml")).unwrap();
    assert!(saved.contains("workers = 2"), "{saved}");
    // Only rank 0 prints the summary line.
    let stdout = job.stdout();
    assert!(stdout.lines().any(|l| l.starts_with("0: ") && l.contains("syncs")), "{}", job.logs());
    assert!(!stdout.lines().any(|l| l.starts_with("1: ") && l.contains("syncs")), "{}", job.logs());
}

#[test]
fn srun_task_killed_mid_run_ends_the_job_and_survivors_name_it() {
    if !slurm_usable("srun_task_killed_mid_run_ends_the_job_and_survivors_name_it") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    // Far more steps than the test lets it run (about a minute of training): it is killed early.
    let mut job = Job::start(3, &run, &["--set", "schedule.total_steps=50000"]);
    // Kill only once training runs (metrics.jsonl has a record): then every rank is in the ring, not
    // in the rendezvous, where rank 0 would wait minutes for a missing rank.
    let deadline = Instant::now() + Duration::from_secs(60);
    let tasks = loop {
        if let Some(status) = job.srun.try_wait().unwrap() {
            panic!("srun ended ({status}) before rank 1 was killed\n{}", job.logs());
        }
        let training = std::fs::metadata(run.join("metrics.jsonl")).is_ok_and(|m| m.len() > 0);
        let tasks = if training { job.tasks() } else { BTreeMap::new() };
        if tasks.len() == 3 {
            break tasks;
        }
        assert!(Instant::now() < deadline, "3 training tasks not seen within 60 s (found {tasks:?})\n{}", job.logs());
        std::thread::sleep(Duration::from_millis(50));
    };
    run_bounded(Command::new("kill").args(["-KILL", &tasks[&1].to_string()]), Duration::from_secs(10)).unwrap();
    let killed = Instant::now();
    let status = job.wait(Duration::from_secs(45)).unwrap_or_else(|| {
        panic!("srun still running 45 s after rank 1 was killed (tasks left: {:?})\n{}", job.tasks(), job.logs())
    });
    eprintln!("srun ended {:.1} s after rank 1 was killed ({status})", killed.elapsed().as_secs_f64());
    assert!(!status.success(), "srun succeeded although rank 1 was killed\n{}", job.logs());
    let left = job.tasks();
    assert!(left.is_empty(), "tasks still running after srun ended: {left:?}\n{}", job.logs());
    let stderr = job.stderr();
    for rank in [0, 2] {
        let prefix = format!("{rank}: ");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with(&prefix) && l.contains("error")).collect();
        assert!(
            errors.iter().any(|l| l.contains("rank 1")),
            "rank {rank} did not name rank 1 in an error\n{}",
            job.logs()
        );
        for line in errors {
            eprintln!("{line}");
        }
    }
    assert!(!job.stdout().contains("syncs ("), "a summary was printed although rank 1 was killed\n{}", job.logs());
}
