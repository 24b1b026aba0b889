//! `qsr launch` with a program that is not qsr (a shell script standing in for a user's binary): every
//! rank gets torchrun's environment; a rank killed with SIGKILL stops the others and whatever they
//! started, and is named; killing the launcher kills the ranks.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn qsr_launch(nproc: usize, script: &str, dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_qsr"));
    c.args(["launch", "--nproc", &nproc.to_string(), "--", "sh", "-c", script]).arg(dir);
    c
}

/// Waits until `names` all exist in `dir` (the ranks wrote them), or fails after 60 s.
fn wait_for_files(dir: &Path, names: &[String]) -> Vec<String> {
    let start = Instant::now();
    loop {
        let texts: Option<Vec<String>> =
            names.iter().map(|n| std::fs::read_to_string(dir.join(n)).ok().filter(|t| t.ends_with('\n'))).collect();
        if let Some(t) = texts {
            return t.into_iter().map(|s| s.trim().to_string()).collect();
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the ranks never wrote {names:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether process `pid` is gone (or a zombie nobody reaped: it runs no more).
fn gone(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_or(true, |st| st.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z')))
}

/// Waits for `child` to exit within `limit` (a hang guard, not a speed test), killing it otherwise.
fn exit_within(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|r| format!("{prefix}-{r}")).collect()
}

#[test]
fn launch_gives_four_ranks_torchruns_environment() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"echo "$RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $QSR_JOB_TOKEN" > "$0/env-$RANK""#;
    let out = qsr_launch(4, script, dir.path()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines = wait_for_files(dir.path(), &names("env", 4));
    let first: Vec<&str> = lines[0].split(' ').collect();
    for (rank, line) in lines.iter().enumerate() {
        let f: Vec<&str> = line.split(' ').collect();
        assert_eq!(f[..5], [rank.to_string().as_str(), &rank.to_string(), "4", "4", "127.0.0.1"], "{line}");
        assert!(f[5].parse::<u16>().is_ok_and(|p| p > 0), "MASTER_PORT: {line}");
        assert_eq!((f[5], f[6]), (first[5], first[6]), "every rank has the same port and job token");
        assert!(f[6].len() >= 16, "QSR_JOB_TOKEN: {line}");
    }
}

#[test]
fn a_rank_killed_by_sigkill_stops_the_others_and_their_children_and_is_named() {
    let dir = tempfile::tempdir().unwrap();
    // Each rank starts a child of its own (as a data loader or a helper would) and waits for it.
    let script = r#"sleep 300 & echo $! > "$0/child-$RANK"; echo $$ > "$0/pid-$RANK"; wait"#;
    let mut launcher = qsr_launch(4, script, dir.path()).stderr(Stdio::piped()).spawn().unwrap();
    let pids = wait_for_files(dir.path(), &names("pid", 4));
    let children = wait_for_files(dir.path(), &names("child", 4));
    assert!(Command::new("kill").args(["-9", &pids[2]]).status().unwrap().success());
    let status = exit_within(&mut launcher, Duration::from_secs(30));
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut launcher.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(i32::from(qsr_comm::EXIT_PEER_FAILED)), "{stderr}");
    assert!(stderr.contains("rank 2 was killed by signal 9 (SIGKILL)"), "{stderr}");
    for pid in pids.iter().chain(&children) {
        assert!(gone(pid), "process {pid} outlived the job");
    }
}

#[test]
fn killing_the_launcher_kills_its_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let mut launcher = qsr_launch(2, r#"echo $$ > "$0/pid-$RANK"; exec sleep 300"#, dir.path()).spawn().unwrap();
    let pids = wait_for_files(dir.path(), &names("pid", 2));
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    let start = Instant::now();
    while !pids.iter().all(|p| gone(p)) {
        assert!(start.elapsed() < Duration::from_secs(30), "ranks {pids:?} outlived their launcher");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_program_that_does_not_exist_is_named() {
    let out = Command::new(env!("CARGO_BIN_EXE_qsr"))
        .args(["launch", "--nproc", "2", "--", "/nonexistent/my-binary"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("cannot run /nonexistent/my-binary"), "{stderr}");
}

/// Regression (review): ranks in a background process group of the terminal's session were stopped by
/// job control when they read stdin or set terminal modes; each rank now has a session of its own and
/// no stdin, so a read ends at once.
#[test]
fn a_rank_that_reads_stdin_gets_end_of_file_and_leads_its_own_session() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"read line; echo "$? $$ $(cut -d" " -f6 /proc/$$/stat)" > "$0/read-$RANK""#;
    let out = qsr_launch(2, script, dir.path()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for line in wait_for_files(dir.path(), &names("read", 2)) {
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f[0], "1", "read did not end at end of file: {line}");
        assert_eq!(f[1], f[2], "the rank does not lead its own session: {line}");
    }
}

/// N11: a process a rank started in a session of its own (`setsid`, out of reach of the rank's
/// group) is stopped with the job when a rank fails; it outlived the launcher.
#[test]
fn what_a_rank_started_with_setsid_stops_with_a_failed_job() {
    let dir = tempfile::tempdir().unwrap();
    let script =
        r#"setsid sleep 300 & echo $! > "$0/escaped-$RANK"; [ "$RANK" = 1 ] && sleep 0.5 && exit 1; sleep 300"#;
    let mut launcher = qsr_launch(2, script, dir.path()).stderr(Stdio::piped()).spawn().unwrap();
    let escaped = wait_for_files(dir.path(), &names("escaped", 2));
    let status = exit_within(&mut launcher, Duration::from_secs(30));
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut launcher.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("rank 1 failed (exit status 1"), "{stderr}");
    assert!(stderr.contains("that a rank started and left running"), "{stderr}");
    for pid in &escaped {
        assert!(gone(pid), "process {pid} (setsid) outlived the job:\n{stderr}");
    }
}

/// N11: once a rank finished, the launcher says which ranks it still waits for (it waited silently).
#[test]
fn the_launcher_names_the_ranks_it_waits_for_after_one_finished() {
    let dir = tempfile::tempdir().unwrap();
    let out = qsr_launch(2, r#"[ "$RANK" = 0 ] && exit 0; sleep 6"#, dir.path()).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("rank(s) [0] finished 5 s ago; waiting for rank(s) [1], still running"), "{stderr}");
}

/// N10: a rank exiting 3 ("lost a peer") when no other rank failed is not said to have lost one;
/// and an interrupted `qsr launch` does not point at `--resume`, which only `qsr train` has.
#[test]
fn a_lone_exit_3_is_not_blamed_on_a_peer_and_an_interrupt_names_no_resume() {
    let dir = tempfile::tempdir().unwrap();
    let out = qsr_launch(2, r#"[ "$RANK" = 1 ] && exit 3; sleep 2"#, dir.path()).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("rank 1 exited with status 3, which says it lost a peer, but no other rank failed"),
        "{stderr}"
    );
    let mut launcher = qsr_launch(2, r#"echo $$ > "$0/pid-$RANK"; exec sleep 300"#, dir.path())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_files(dir.path(), &names("pid", 2));
    assert!(Command::new("kill").args(["-INT", &launcher.id().to_string()]).status().unwrap().success());
    let status = exit_within(&mut launcher, Duration::from_secs(30));
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut launcher.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted by signal 2 (SIGINT)") && !stderr.contains("--resume"), "{stderr}");
}

/// A rank of the launched jobs below, run by them under `qsr launch`: a linear model, burn's SGD and
/// an Averager (QSR, h_base 2, alpha 0.1), ending `main`-like with `qsr_comm::exit_code`.
/// `QSR_TEST_SCENARIO=lrs`: the lr depends on the rank (H = 4 on rank 0, H = 2 on rank 1);
/// `panic`: rank 1 panics at its third step; `sum`: one all-reduce of `rank + 1`, printed.
#[test]
#[ignore = "a rank of a launched job; the launch tests below run it"]
fn launched_rank() {
    let Ok(scenario) = std::env::var("QSR_TEST_SCENARIO") else {
        return;
    };
    let code = qsr_comm::exit_code(launched_rank_run(&scenario));
    std::process::exit(if code == std::process::ExitCode::SUCCESS { 0 } else { rank_status(code) });
}

/// The status an `ExitCode` stands for (it has no accessor): 1 or `EXIT_PEER_FAILED`.
fn rank_status(code: std::process::ExitCode) -> i32 {
    let peer = std::process::ExitCode::from(qsr_comm::EXIT_PEER_FAILED);
    if code == peer { i32::from(qsr_comm::EXIT_PEER_FAILED) } else { 1 }
}

fn launched_rank_run(scenario: &str) -> anyhow::Result<()> {
    use burn::optim::{GradientsParams, SgdConfig};
    use burn::tensor::{Device, Tensor};
    let mut comm = qsr_comm::from_env()?;
    let rank = comm.rank();
    if scenario == "late" {
        // Rank 1 fails for a cause of its own after rank 0 gave up waiting for it.
        if rank == 1 {
            std::thread::sleep(std::time::Duration::from_secs(3));
            anyhow::bail!("rank 1 failed late, for a reason of its own");
        }
        return Ok(comm.all_reduce(&mut [1.0], qsr_comm::ReduceOp::Sum)?);
    }
    if scenario == "sum" {
        let mut x = [rank as f32 + 1.0];
        comm.all_reduce(&mut x, qsr_comm::ReduceOp::Sum)?;
        println!("rank {rank} of {}: sum {} over {}", comm.world_size(), x[0], comm.backend());
        return Ok(());
    }
    let device = Device::flex().autodiff();
    let mut model = burn::nn::LinearConfig::new(4, 1).init(&device);
    let lr = if scenario == "lrs" && rank == 0 { 0.05 } else { 0.1 }; // H = max(2, (0.1 / lr)^2)
    let mut avg = qsr_optim::Averager::new(&mut model, qsr_optim::AveragerConfig::qsr(2, 0.1), comm)?;
    let mut optim = SgdConfig::new().init();
    for step in 0..8 {
        assert!(!(scenario == "panic" && rank == 1 && step == 2), "rank 1 fails for a reason of its own");
        let loss = model.forward(Tensor::<2>::ones([8, 4], &device)).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr, model, grads);
        let stepped = avg.step_with_lr(model, lr).map_err(anyhow::Error::from);
        model = stepped.inspect_err(|e| eprintln!("rank {rank} stopped: {e:#}"))?;
    }
    eprintln!("rank {rank} never failed");
    Ok(())
}

fn launch_rank_job(scenario: &str, extra: &[&str]) -> (std::process::Output, String) {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_qsr"))
        .args(["launch", "--nproc", "2"])
        .args(extra)
        .arg("--")
        .arg(exe)
        .args(["--exact", "launch::launched_rank", "--ignored", "--nocapture", "--test-threads", "1"])
        .env("QSR_TEST_SCENARIO", scenario)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    (out, text)
}

/// Issue 46: under `qsr launch`, ranks whose lrs differ stop at their first sync, each naming its
/// own sync (step and H) and the likely cause; the ranks' report names both.
#[test]
fn ranks_with_different_lrs_fail_at_the_first_sync_under_launch() {
    let (out, text) = launch_rank_job("lrs", &[]);
    assert!(!out.status.success(), "{text}");
    let (h4, h2) = ("the sync after step 4 (a round of H = 4)", "the sync after step 2 (a round of H = 2)");
    for (rank, mine) in [(0, h4), (1, h2)] {
        let start = format!("[rank {rank}] rank {rank} stopped: ");
        let line = text.lines().find(|l| l.starts_with(&start)).unwrap_or_else(|| {
            panic!("rank {rank} printed no error:\n{text}");
        });
        assert!(line.contains(&format!("this rank is at {mine}")), "{line}");
        assert!(line.contains("same lr schedule, warmup and run_steps"), "{line}");
        assert!(line.contains(h4) && line.contains(h2), "rank {rank} does not name both syncs: {line}");
    }
    assert!(!text.contains("never failed"), "{text}");
}

/// Issue 46: a rank that fails for a reason of its own (a panic) is the one the launcher blames; the
/// rank that only lost it exits with EXIT_PEER_FAILED through `qsr_comm::exit_code` and is counted as
/// stopped. Each rank's lines carry its rank, and `--log-dir` keeps each rank's output as written.
#[test]
fn the_launcher_blames_the_rank_that_failed_not_the_one_that_lost_it() {
    let logs = tempfile::tempdir().unwrap();
    let (out, text) = launch_rank_job("panic", &["--log-dir", logs.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(101), "{text}");
    assert!(text.contains("rank 1 failed (exit status 101"), "{text}");
    assert!(text.contains("(1 of 2 workers failed, 1 stopped because of it)"), "{text}");
    assert!(text.contains("[rank 1] thread '") && text.contains("rank 1 fails for a reason of its own"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("[rank 0] rank 0 stopped: ")), "{text}");
    let rank1 = std::fs::read_to_string(logs.path().join("rank-1.stderr.log")).unwrap();
    assert!(rank1.contains("rank 1 fails for a reason of its own") && !rank1.contains("[rank 1]"), "{rank1}");
    let rank0 = std::fs::read_to_string(logs.path().join("rank-0.stderr.log")).unwrap();
    assert!(rank0.contains("rank 0 stopped: "), "{rank0}");
    assert!(logs.path().join("rank-0.stdout.log").exists());
}

/// Two "hosts": network namespaces joined by a veth pair, removed on drop.
struct TwoHosts {
    names: [String; 2],
}

impl TwoHosts {
    const ADDRS: [&str; 2] = ["10.200.46.1", "10.200.46.2"];

    /// `None` when this machine cannot make them (not root, no `ip`).
    fn new() -> Option<TwoHosts> {
        let id = std::process::id();
        let hosts = TwoHosts { names: [format!("qsr46a-{id}"), format!("qsr46b-{id}")] };
        let [a, b] = &hosts.names;
        let (va, vb) = (format!("q46a{}", id % 100_000), format!("q46b{}", id % 100_000));
        let steps: Vec<Vec<String>> = vec![
            vec!["netns".into(), "add".into(), a.clone()],
            vec!["netns".into(), "add".into(), b.clone()],
            vec![
                "link".into(),
                "add".into(),
                va.clone(),
                "type".into(),
                "veth".into(),
                "peer".into(),
                "name".into(),
                vb.clone(),
            ],
            vec!["link".into(), "set".into(), va.clone(), "netns".into(), a.clone()],
            vec!["link".into(), "set".into(), vb.clone(), "netns".into(), b.clone()],
        ];
        let mut steps = steps;
        for ((ns, dev), addr) in [(a, &va), (b, &vb)].into_iter().zip(Self::ADDRS) {
            steps.push(vec![
                "-n".into(),
                ns.clone(),
                "addr".into(),
                "add".into(),
                format!("{addr}/24"),
                "dev".into(),
                dev.clone(),
            ]);
            steps.push(vec!["-n".into(), ns.clone(), "link".into(), "set".into(), dev.clone(), "up".into()]);
            steps.push(vec!["-n".into(), ns.clone(), "link".into(), "set".into(), "lo".into(), "up".into()]);
        }
        for step in steps {
            let ok = Command::new("ip").args(&step).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
            if !ok {
                return None;
            }
        }
        Some(hosts)
    }

    /// `qsr launch` of host `node` of the job, running `launched_rank` with `scenario`.
    fn launch(&self, node: usize, scenario: &str) -> Child {
        let exe = std::env::current_exe().unwrap();
        Command::new("ip")
            .args(["netns", "exec", &self.names[node], env!("CARGO_BIN_EXE_qsr"), "launch", "--nnodes", "2"])
            .args(["--node-rank", &node.to_string(), "--nproc", "2", "--master-addr", Self::ADDRS[0], "--"])
            .arg(exe)
            .args(["--exact", "launch::launched_rank", "--ignored", "--nocapture", "--test-threads", "1"])
            .env("QSR_TEST_SCENARIO", scenario)
            .env("QSR_HOST_ID", format!("host-{node}"))
            .env("QSR_JOB_TOKEN", "issue-46-two-hosts")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in &self.names {
            let _ = Command::new("ip").args(["netns", "delete", ns]).status();
        }
    }
}

/// Issue 46: `qsr launch --nnodes 2 --node-rank R --master-addr H` on two hosts of two ranks each (two
/// network namespaces, each host its own QSR_HOST_ID) forms one job of 4 ranks, torchrun's numbering:
/// shared memory inside each host and the ring between them. Needs root (`QSR_REQUIRE_NETNS=1` in CI
/// makes a machine without it fail instead of skip).
#[test]
fn a_job_over_two_hosts_of_two_ranks_each() {
    let Some(hosts) = TwoHosts::new() else {
        assert!(
            std::env::var_os("QSR_REQUIRE_NETNS").is_none(),
            "cannot make network namespaces (root and `ip` needed)"
        );
        eprintln!("skipped: cannot make network namespaces (root and `ip` needed)");
        return;
    };
    let launchers = [hosts.launch(0, "sum"), hosts.launch(1, "sum")];
    let mut text = String::new();
    for mut launcher in launchers {
        let status = exit_within(&mut launcher, Duration::from_secs(120));
        let out = launcher.wait_with_output().unwrap();
        let host = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(status.success(), "{host}");
        text += &host;
    }
    for rank in 0..4 {
        let (prefix, line) = (format!("[rank {rank}] "), format!("rank {rank} of 4: sum 10 over shm+tcp"));
        let found = text.lines().any(|l| l.starts_with(&prefix) && l.ends_with(&line));
        assert!(found, "no `{prefix}...{line}` in:\n{text}");
    }
}

/// Issue 46: what a job over several hosts cannot do is refused before anything starts, naming the flag.
#[test]
fn launch_flags_that_cannot_work_are_refused_naming_them() {
    let refused = |args: &[&str], token: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_qsr"));
        c.arg("launch").args(args).args(["--", "/bin/true"]).env_remove("QSR_JOB_TOKEN");
        if let Some(t) = token {
            c.env("QSR_JOB_TOKEN", t);
        }
        let out = c.output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let e = refused(&["--nproc", "2", "--max-restarts", "3"], None);
    assert!(e.contains("--max-restarts 3: qsr launch restarts no ranks"), "{e}");
    let e = refused(&["--nproc", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "10.0.0.1"], Some("t"));
    assert!(e.contains("--node-rank 2: must be in 0..--nnodes 2"), "{e}");
    let e = refused(&["--nproc", "2", "--nnodes", "2", "--node-rank", "1"], Some("t"));
    assert!(e.contains("--nnodes 2: give --master-addr"), "{e}");
    let e = refused(&["--nproc", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1"], None);
    assert!(e.contains("export the same QSR_JOB_TOKEN on every host"), "{e}");
}

/// Pins what a review suspected could break: a rank still computing when the failure window closes
/// is stopped by the launcher and is neither blamed (as "killed by signal 15") nor counted as failed.
#[test]
fn a_rank_the_launcher_stopped_is_not_blamed_for_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"[ "$RANK" = 1 ] && exit 7; sleep 300"#;
    let mut launcher = qsr_launch(2, script, dir.path()).stderr(Stdio::piped()).spawn().unwrap();
    let status = exit_within(&mut launcher, Duration::from_secs(30));
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut launcher.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(7), "{stderr}");
    assert!(stderr.contains("rank 1 failed (exit status 7"), "{stderr}");
    assert!(stderr.contains("(1 of 2 workers failed)"), "{stderr}");
    assert!(!stderr.contains("rank 0 was killed"), "{stderr}");
}

/// D3: a launcher SIGKILLed before it read rank 0's port leaves `RUN/.rendezvous-port`; the next
/// `--nproc` launch in that directory used to hand its ranks that dead port and fail after the whole
/// rendezvous timeout. It trains now, with the timeout short enough that the old failure would show.
#[test]
fn a_launch_into_a_directory_with_a_stale_rendezvous_port_trains() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(run.join(".rendezvous-port"), "36189").unwrap();
    let args = ["train", "--recipe", crate::common::RECIPE, "--nproc", "2", "--quiet", "--out", run.to_str().unwrap()];
    let out = crate::common::qsr_cmd(&[&args[..], &["--set", "schedule.total_steps=60"]].concat())
        .env("QSR_RENDEZVOUS_TIMEOUT_SECS", "20")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!run.join(".rendezvous-port").exists(), "the port file is gone once read");
}

/// Issue 56 D12: nodes that disagree on `--nproc` (one launcher counts 2 ranks, the other 4): node 1
/// failed at once, node 0 waited out the rendezvous timeout (300 s). Rank 0 now fails as soon as a rank
/// of another size registers, naming the flags, and both launchers exit within seconds.
#[test]
fn launchers_that_disagree_on_nproc_both_fail_at_once() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let mut text = String::new();
    for mut launcher in [node_launch("0", "1", &port, "sum"), node_launch("1", "2", &port, "sum")] {
        let status = exit_within(&mut launcher, Duration::from_secs(60));
        let out = launcher.wait_with_output().unwrap();
        let host = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(!status.success(), "{host}");
        text += &host;
    }
    // Rank 0 names whichever of node 1's ranks registered first.
    let named = |r: u32| text.contains(&format!("world size differs: this job has 2, rank {r} sent 4: the launches"));
    assert!(named(2) || named(3), "{text}");
    assert!(text.contains("--nproc and --nnodes"), "{text}");
}

/// `qsr launch --nnodes 2 --node-rank NODE --nproc NPROC` of the test's own `launched_rank` with
/// `scenario`, its rendezvous on this host's `port`.
fn node_launch(node: &str, nproc: &str, port: &str, scenario: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_qsr"))
        .args(["launch", "--nnodes", "2", "--node-rank", node, "--nproc", nproc, "--master-addr", "127.0.0.1"])
        .args(["--master-port", port, "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "launch::launched_rank", "--ignored", "--nocapture", "--test-threads", "1"])
        .env("QSR_TEST_SCENARIO", scenario)
        .env("QSR_JOB_TOKEN", "issue-56-d11")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Issue 56 D11: when a rank of node 1 failed, node 0's launcher said "rank 0 exited with status 3,
/// which says it lost a peer, but no other rank failed", though its rank named the peer. Each rank
/// leaves a failure record for its launcher, which now names the lost rank and its node.
#[test]
fn a_launcher_whose_ranks_lost_a_rank_of_another_node_names_it() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let launchers = [node_launch("0", "1", &port, "panic"), node_launch("1", "1", &port, "panic")];
    let outs: Vec<String> = launchers
        .into_iter()
        .map(|mut l| {
            exit_within(&mut l, Duration::from_secs(60));
            let out = l.wait_with_output().unwrap();
            String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
        })
        .collect();
    let node0 = "rank 0 stopped after losing rank 1, which runs on another node: that node's launcher says why";
    assert!(outs[0].contains(node0), "{}", outs[0]);
    assert!(outs[1].contains("rank 1 failed"), "{}", outs[1]);
}

/// Issue 56 D11: on one node, a culprit that failed more than the launcher's 500 ms window after the
/// rank that lost it was not named. The launcher now waits for a rank its failed ranks blame and names
/// its failure.
#[test]
fn a_culprit_that_fails_after_the_rank_that_lost_it_is_named() {
    let out = Command::new(env!("CARGO_BIN_EXE_qsr"))
        .args(["launch", "--nproc", "2", "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "launch::launched_rank", "--ignored", "--nocapture", "--test-threads", "1"])
        .env("QSR_TEST_SCENARIO", "late")
        .env("QSR_TRANSPORT", "tcp")
        .env("QSR_COMM_TIMEOUT_SECS", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("error: rank 1 failed (exit status 1"), "{text}");
    assert!(text.contains("1 of 2 workers failed, 1 stopped because of it"), "{text}");
}

/// Issue 56 D12, for programs that join with `qsr_comm::from_env`: ranks launched with different
/// `QSR_TRANSPORT` agree on it before they form their groups, so every rank fails naming the variable
/// instead of taking different collectives.
#[test]
fn a_programs_ranks_with_different_transports_fail_naming_qsr_transport() {
    // Rank 1 keeps the TCP ring; rank 0 would take shared memory.
    let exec = r#"[ "$RANK" = 1 ] && export QSR_TRANSPORT=tcp; exec "$@""#;
    let out = Command::new(env!("CARGO_BIN_EXE_qsr"))
        .args(["launch", "--nproc", "2", "--", "sh", "-c", exec, "sh"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "launch::launched_rank", "--ignored", "--nocapture", "--test-threads", "1"])
        .env("QSR_TEST_SCENARIO", "sum")
        .env_remove("QSR_TRANSPORT")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("`QSR_TRANSPORT`: rank 0 has \"auto\", rank 1 has \"tcp\""), "{text}");
    assert!(!text.contains("sum 3 over"), "a rank finished its all-reduce: {text}");
}
