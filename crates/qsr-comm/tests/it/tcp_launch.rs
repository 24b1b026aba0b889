//! What a rank's log says during a launch: child processes (this test binary re-executed, entry
//! `launch_child_entry`) run `TcpComm::from_launch` as one rank, with stderr captured as a
//! launcher would keep it.

use std::io::Read;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use qsr_comm::{LaunchEnv, Source, TcpComm, TcpConfig};

/// Entry point of the child processes (a no-op when the test runner runs it normally).
#[test]
fn launch_child_entry() {
    let Ok(addr) = std::env::var("QSR_LAUNCH_ADDR") else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} missing"));
    let env = LaunchEnv {
        rank: var("QSR_LAUNCH_RANK").parse().unwrap(),
        world_size: 2,
        local_rank: 0,
        master_addr: addr,
        master_port: var("QSR_LAUNCH_PORT").parse().unwrap(),
        source: Source::Explicit,
    };
    let cfg = TcpConfig {
        token: var("QSR_LAUNCH_TOKEN"),
        rendezvous_timeout: Duration::from_millis(var("QSR_LAUNCH_WAIT_MS").parse().unwrap()),
        ..crate::common::test_config()
    };
    match TcpComm::from_launch(&env, cfg) {
        Ok(_) => println!("QSR ok"),
        Err(e) => println!("QSR error {e}"),
    }
    std::process::exit(0);
}

/// A port nobody listens on.
fn dead_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Rank 1 of 2 looking for rank 0 at `addr:port` for `wait_ms`; returns (stdout, stderr).
fn rank1(addr: &str, port: u16, token: &str, wait_ms: u64) -> (String, String) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "tcp_launch::launch_child_entry", "--nocapture", "--test-threads=1"])
        .env("QSR_LAUNCH_ADDR", addr)
        .env("QSR_LAUNCH_RANK", "1")
        .env("QSR_LAUNCH_PORT", port.to_string())
        .env("QSR_LAUNCH_TOKEN", token)
        .env("QSR_LAUNCH_WAIT_MS", wait_ms.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let reader = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = reader(Box::new(child.stdout.take().unwrap()));
    let err = reader(Box::new(child.stderr.take().unwrap()));
    let limit = Instant::now() + Duration::from_millis(wait_ms) + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > limit {
            let _ = child.kill();
            panic!("the child rank did not give up within its rendezvous timeout");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (out.join().unwrap(), err.join().unwrap())
}

#[test]
fn open_launch_without_token_warns_naming_qsr_job_token() {
    let port = dead_port();
    let runs = crate::common::on_threads(
        vec![("0.0.0.0", ""), ("127.0.0.1", ""), ("0.0.0.0", "secret")],
        move |(addr, token)| rank1(addr, port, token, 1000),
    );
    let (_, open) = &runs[0];
    assert!(open.contains("QSR_JOB_TOKEN is not set and MASTER_ADDR=0.0.0.0 is not a loopback address"), "{open}");
    for (what, (_, err)) in ["loopback", "token set"].iter().zip(&runs[1..]) {
        assert!(!err.contains("QSR_JOB_TOKEN"), "{what}: {err}");
    }
}

#[test]
fn rank_waiting_for_rank0_says_what_it_waits_for() {
    let port = dead_port();
    let (out, err) = rank1("127.0.0.1", port, "t", 2000);
    assert!(
        err.contains(&format!("rank 1: waiting for rank 0 at 127.0.0.1:{port} (")) && err.contains(" of 2.0 s): "),
        "{err}"
    );
    assert!(
        out.contains("could not connect to rank 0") && out.contains("the rendezvous completed without this rank"),
        "{out}"
    );
    assert_eq!(crate::common::repeated_phrase(&out), None, "{out}");
}
