//! Our transports across real processes: the parent test is rank 0, children re-exec this test
//! binary (`child_process_entry`) as ranks 1..n; every rank forms the TCP ring on 127.0.0.1, then
//! the transport under test over it (the ring itself, or a shared-memory group). Covers the
//! correctness matrix, a rank killed in the middle of a large all-reduce, and a rank stopped with
//! SIGSTOP, for each transport.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use qsr_comm::{Collective, CommError, MasterListener, ReduceOp, ShmConfig, TcpComm, TcpConfig, Transport};

const LOOP_FLOATS: usize = 2 << 20; // 8 MiB per all-reduce in the fault tests

fn hash(v: &[f32]) -> u64 {
    // FNV-1a over the bit patterns: equal hashes <=> (practically) bit-identical results.
    v.iter()
        .flat_map(|x| x.to_bits().to_le_bytes())
        .fold(0xcbf29ce484222325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100000001b3))
}

fn child_config(timeout_ms: u64) -> TcpConfig {
    TcpConfig { timeout: Duration::from_millis(timeout_ms), ..crate::common::test_config() }
}

/// The transport under test over the ring `boot`: "tcp", the ring itself; "shm", a shared-memory
/// group of every rank; "mixed-a", hosts (as `QSR_HOST_ID` would name them) of the even and of the
/// odd ranks, so rank 2 is a member of rank 0's host; "mixed-b", hosts of ranks 0-1 and 2-3, so rank
/// 2 leads its host. Group files go to a directory of the job's own ([`group_dir`]).
fn connect(boot: TcpComm, transport: &str, master: &str) -> Box<dyn Collective> {
    let timeout = boot.config().timeout;
    let r = boot.rank();
    let (t, host, backend) = match transport {
        "tcp" => (Transport::Tcp, "one", "tcp"),
        "shm" => (Transport::Shm, "one", "shm"),
        "mixed-a" => (Transport::Auto, if r.is_multiple_of(2) { "node-a" } else { "node-b" }, "shm+tcp"),
        "mixed-b" => (Transport::Auto, if r < 2 { "node-a" } else { "node-b" }, "shm+tcp"),
        other => panic!("unknown transport {other}"),
    };
    let dir = group_dir(master);
    std::fs::create_dir_all(&dir).expect("group directory");
    let shm = ShmConfig { timeout, dir, ..ShmConfig::default() };
    let c = qsr_comm::over_ring(boot, t, host, shm).expect("transport setup");
    assert_eq!(c.backend(), backend);
    c
}

/// The matrix every rank runs; returns (case name, result) pairs.
fn run_matrix(c: &mut dyn Collective) -> Result<Vec<(String, Vec<f32>)>, CommError> {
    let n = c.world_size();
    let mut out = Vec::new();
    for (li, len) in crate::common::lengths(n).into_iter().enumerate() {
        for op in [ReduceOp::Sum, ReduceOp::Mean] {
            let mut b = crate::common::input(li as u64, c.rank(), len);
            c.all_reduce(&mut b, op)?;
            out.push((format!("len {len} {op:?}"), b));
        }
        let mut b = crate::common::input(50 + li as u64, c.rank(), len);
        c.broadcast(&mut b, n - 1)?;
        out.push((format!("len {len} broadcast"), b));
    }
    c.barrier()?;
    Ok(out)
}

/// Runs all-reduces until one fails; returns the error and how long after the last success.
fn run_loop(c: &mut dyn Collective, mut on_iter: impl FnMut(usize)) -> Option<CommError> {
    let mut b = crate::common::input(5, c.rank(), LOOP_FLOATS);
    for i in 0..100_000 {
        if let Err(e) = c.all_reduce(&mut b, ReduceOp::Mean) {
            return Some(e);
        }
        on_iter(i);
    }
    None
}

/// Entry point of the child processes (a no-op when the test runner runs it normally).
#[test]
fn child_process_entry() {
    let Ok(mode) = std::env::var("QSR_CHILD_MODE") else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} missing"));
    let rank: usize = var("QSR_CHILD_RANK").parse().unwrap();
    let n: usize = var("QSR_CHILD_N").parse().unwrap();
    let timeout_ms: u64 = var("QSR_CHILD_TIMEOUT_MS").parse().unwrap();
    let transport = var("QSR_CHILD_TRANSPORT");
    let mut c = match TcpComm::worker(&var("QSR_CHILD_MASTER"), rank, n, child_config(timeout_ms)) {
        Ok(c) => connect(c, &transport, &var("QSR_CHILD_MASTER")),
        Err(e) => {
            println!("QSR setup-error {e}");
            std::process::exit(2);
        }
    };
    match mode.as_str() {
        "matrix" => match run_matrix(c.as_mut()) {
            Ok(cases) => {
                for (i, (_, v)) in cases.iter().enumerate() {
                    println!("QSR case {i} {:016x}", hash(v));
                }
                println!("QSR done");
                std::process::exit(0);
            }
            Err(e) => {
                println!("QSR error {e}");
                std::process::exit(1);
            }
        },
        "loop" => {
            let err = run_loop(c.as_mut(), |i| println!("QSR iter {i}"));
            match err {
                Some(e) => {
                    let blamed = e.blamed_rank().map(|r| r.to_string()).unwrap_or_else(|| "none".into());
                    println!("QSR error {blamed} {e}");
                    // A real program returns through its stack and drops the communicator, whose Drop
                    // lets the abort notice reach the other neighbour before the sockets close;
                    // `process::exit` would skip that and reset the connections.
                    drop(c);
                    std::process::exit(0);
                }
                None => std::process::exit(3),
            }
        }
        other => panic!("unknown mode {other}"),
    }
}

/// Children that are killed when the test ends, however it ends.
struct Children {
    procs: Vec<(usize, Child)>,
    lines: mpsc::Receiver<(usize, String)>,
}

impl Drop for Children {
    fn drop(&mut self) {
        for (_, c) in &mut self.procs {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn_children(mode: &str, transport: &str, n: usize, master: &str, timeout_ms: u64) -> Children {
    let exe = std::env::current_exe().unwrap();
    let (tx, rx) = mpsc::channel();
    let mut procs = Vec::new();
    for rank in 1..n {
        let mut child = Command::new(&exe)
            .args(["--exact", "processes::child_process_entry", "--nocapture", "--test-threads=1"])
            .env("QSR_CHILD_MODE", mode)
            .env("QSR_CHILD_TRANSPORT", transport)
            .env("QSR_CHILD_RANK", rank.to_string())
            .env("QSR_CHILD_N", n.to_string())
            .env("QSR_CHILD_MASTER", master)
            .env("QSR_CHILD_TIMEOUT_MS", timeout_ms.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn child");
        let out = child.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                // The harness may print "test child_process_entry ... " on the same line first.
                if let Some(at) = line.find("QSR ")
                    && tx.send((rank, line[at + 4..].to_string())).is_err()
                {
                    break;
                }
            }
        });
        procs.push((rank, child));
    }
    Children { procs, lines: rx }
}

/// The directory of the group files of the job whose rank 0 listens at `master`: one per job, so
/// that a test checking for leftovers sees only its own job's files, not those of a job another
/// test is setting up at the same moment.
fn group_dir(master: &str) -> std::path::PathBuf {
    std::path::Path::new("/dev/shm").join(format!("qsr-test-{}", master.replace([':', '.'], "-")))
}

/// The job at `master` left no shared-memory file behind (then its directory is removed).
fn assert_no_group_file_left(master: &str) {
    let dir = group_dir(master);
    let left: Vec<String> = std::fs::read_dir(&dir)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left in {}: {left:?}", dir.display());
    let _ = std::fs::remove_dir(&dir);
}

#[test]
fn process_matrix_tcp_world_sizes_2_3_5() {
    process_matrix("tcp", &[2, 3, 5]);
}

#[test]
fn process_matrix_shm_world_sizes_2_4() {
    process_matrix("shm", &[2, 4]);
}

/// Hosts {0, 2} and {1} at 3 ranks (a host of one), {0, 2} and {1, 3} at 4, then {0, 1} and {2, 3}.
#[test]
fn process_matrix_mixed_hosts() {
    process_matrix("mixed-a", &[3, 4]);
    process_matrix("mixed-b", &[4]);
}

fn process_matrix(transport: &str, sizes: &[usize]) {
    for &n in sizes {
        let listener = MasterListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let mut kids = spawn_children("matrix", transport, n, &addr, 10_000);
        let boot = TcpComm::master(listener, n, child_config(10_000)).expect("rank 0 setup");
        let mut c = connect(boot, transport, &addr);
        let cases = run_matrix(c.as_mut()).expect("rank 0 matrix");
        // f64 reference on rank 0's results (bit-identity is checked via the children's hashes).
        let mut i = 0;
        for (li, len) in crate::common::lengths(n).into_iter().enumerate() {
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| crate::common::input(li as u64, r, len)).collect();
            crate::common::check(&inputs, &[cases[i].1.clone()], ReduceOp::Sum, &format!("n {n} {}", cases[i].0));
            crate::common::check(
                &inputs,
                &[cases[i + 1].1.clone()],
                ReduceOp::Mean,
                &format!("n {n} {}", cases[i + 1].0),
            );
            assert_eq!(cases[i + 2].1, crate::common::input(50 + li as u64, n - 1, len), "n {n} {}", cases[i + 2].0);
            i += 3;
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut done = 0;
        let mut seen = 0;
        while done < n - 1 {
            let (rank, line) = kids.lines.recv_timeout(deadline - Instant::now()).expect("children report in time");
            let parts: Vec<&str> = line.split_whitespace().collect();
            match parts.as_slice() {
                ["case", idx, h] => {
                    let idx: usize = idx.parse().unwrap();
                    assert_eq!(
                        *h,
                        format!("{:016x}", hash(&cases[idx].1)),
                        "n {n}: rank {rank} differs from rank 0 in {}",
                        cases[idx].0
                    );
                    seen += 1;
                }
                ["done"] => done += 1,
                _ => panic!("n {n}: rank {rank}: {line}"),
            }
        }
        assert_eq!(seen, cases.len() * (n - 1));
        for (rank, child) in &mut kids.procs {
            assert!(child.wait().unwrap().success(), "n {n}: child rank {rank} failed");
        }
        assert_no_group_file_left(&addr);
    }
}

/// Starts a 4-rank loop (rank 0 here, 1..3 children), waits until the victim (rank 2) is busy,
/// applies `fault` to it, and checks that every survivor fails naming rank 2 within `bound`.
fn fault_test(transport: &str, timeout_ms: u64, bound: Duration, fault: impl FnOnce(&mut Child)) {
    let n = 4;
    let victim = 2;
    let listener = MasterListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let mut kids = spawn_children("loop", transport, n, &addr, timeout_ms);
    let boot = TcpComm::master(listener, n, child_config(timeout_ms)).expect("rank 0 setup");
    let mut c = connect(boot, transport, &addr);
    let rank0 = std::thread::spawn(move || {
        let e = run_loop(c.as_mut(), |_| {});
        (e, Instant::now())
    });
    // Wait until the victim has completed a few all-reduces: it is in the middle of the next.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (rank, line) = kids.lines.recv_timeout(deadline - Instant::now()).expect("victim makes progress");
        assert!(!line.starts_with("error") && !line.starts_with("setup-error"), "rank {rank}: {line}");
        if rank == victim && line == "iter 3" {
            break;
        }
    }
    let fault_at = Instant::now();
    let child = &mut kids.procs.iter_mut().find(|(r, _)| *r == victim).unwrap().1;
    fault(child);
    let mut errors = Vec::new();
    while errors.len() < n - 2 {
        let left = (fault_at + bound + Duration::from_secs(5)).saturating_duration_since(Instant::now());
        let (rank, line) = kids.lines.recv_timeout(left).expect("every survivor reports an error in time");
        if line.starts_with("error") {
            errors.push((rank, line, fault_at.elapsed()));
        }
    }
    let (e, at) = rank0.join().unwrap();
    let e = e.expect("rank 0 fails");
    errors.push((
        0,
        format!("error {} {e}", e.blamed_rank().map(|r| r.to_string()).unwrap_or_default()),
        at.duration_since(fault_at),
    ));
    for (rank, line, took) in errors {
        eprintln!("survivor rank {rank} after {took:?}: {line}");
        assert_eq!(crate::common::repeated_phrase(&line), None, "rank {rank}: {line}");
        assert!(line.starts_with(&format!("error {victim} ")), "rank {rank} must blame rank {victim}: {line}");
        assert!(line.contains(&format!("rank {victim}")), "rank {rank}: message must name rank {victim}: {line}");
        assert!(took <= bound, "rank {rank} took {took:?} (bound {bound:?}): {line}");
    }
    // A killed or stopped job leaves no group file (it was removed once every rank had mapped it).
    assert_no_group_file_left(&addr);
}

fn kill(child: &mut Child) {
    child.kill().expect("kill victim")
}

fn stop(child: &mut Child) {
    // SAFETY: plain kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGSTOP) };
    assert_eq!(rc, 0);
}

// Death is seen at once (EOF / reset on the ring, the pidfd in shared memory), long before the 5 s
// no-progress timeout; a stopped rank is named once the 3 s timeout has passed. Verdicts race by
// half a timeout (a host's T against the leaders' ring's 1.5 T; members wait 2 T for a stopped
// leader), so the timeout leaves that race 1.5 s on a loaded 2-core machine.
const KILL: (u64, Duration) = (5_000, Duration::from_millis(7_000));
const STOP: (u64, Duration) = (3_000, Duration::from_millis(7_500));

#[test]
fn killed_rank_is_named_by_every_survivor_tcp() {
    fault_test("tcp", KILL.0, KILL.1, kill);
}

#[test]
fn stopped_rank_is_named_by_every_survivor_after_the_timeout_tcp() {
    fault_test("tcp", STOP.0, STOP.1, stop);
}

#[test]
fn killed_rank_is_named_by_every_survivor_shm() {
    fault_test("shm", KILL.0, KILL.1, kill);
}

#[test]
fn stopped_rank_is_named_by_every_survivor_after_the_timeout_shm() {
    fault_test("shm", STOP.0, STOP.1, stop);
}

#[test]
fn killed_member_of_another_ranks_host_is_named_by_every_survivor_mixed() {
    fault_test("mixed-a", KILL.0, KILL.1, kill);
}

#[test]
fn killed_host_leader_is_named_by_every_survivor_mixed() {
    fault_test("mixed-b", KILL.0, KILL.1, kill);
}

#[test]
fn stopped_member_is_named_by_every_survivor_after_the_timeout_mixed() {
    fault_test("mixed-a", STOP.0, STOP.1, stop);
}

#[test]
fn stopped_host_leader_is_named_by_every_survivor_after_the_timeout_mixed() {
    fault_test("mixed-b", STOP.0, STOP.1, stop);
}
