//! TCP backend under hostile or broken conditions: handshake refusals, garbage on the
//! rendezvous port, corrupt frames from a fake peer, different collective calls, a stalled rank.

use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use qsr_comm::{Collective, CommError, LaunchEnv, MasterListener, ReduceOp, Source, TcpComm, TcpConfig};

fn start_master(n: usize, cfg: TcpConfig) -> (String, std::thread::JoinHandle<Result<TcpComm, CommError>>) {
    let l = MasterListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (addr, std::thread::spawn(move || TcpComm::master(l, n, cfg)))
}

fn refused_field(e: &CommError) -> &'static str {
    match e {
        CommError::HandshakeRefused { field, .. } => field,
        other => panic!("expected a refusal, got: {other}"),
    }
}

#[test]
fn wrong_token_and_version_are_refused_and_rank0_keeps_waiting() {
    let cfg = crate::common::test_config();
    let (addr, master) = start_master(2, cfg.clone());

    let mut bad = cfg.clone();
    bad.token = "another-job".into();
    let e = TcpComm::worker(&addr, 1, 2, bad).err().expect("wrong token must be refused");
    assert_eq!(refused_field(&e), "job token");
    assert!(e.to_string().contains("job token differs"), "{e}");

    let mut bad = cfg.clone();
    bad.protocol_version = 99;
    let e = TcpComm::worker(&addr, 1, 2, bad).err().expect("wrong version must be refused");
    assert_eq!(refused_field(&e), "protocol version");
    assert!(e.to_string().contains("sent 99"), "{e}");

    // The legitimate rank still gets in, and the ring works.
    let mut w = TcpComm::worker(&addr, 1, 2, cfg).expect("valid worker");
    let mut m = master.join().unwrap().expect("master");
    let h = std::thread::spawn(move || {
        let mut b = vec![2.0f32; 5];
        w.all_reduce(&mut b, ReduceOp::Sum).map(|_| b)
    });
    let mut b = vec![1.0f32; 5];
    m.all_reduce(&mut b, ReduceOp::Sum).unwrap();
    assert_eq!(b, vec![3.0; 5]);
    assert_eq!(h.join().unwrap().unwrap(), vec![3.0; 5]);
}

/// Issue 56 D12: launches that disagree on the world size (nodes given different `--nproc`) can never
/// form: the rank that counts another size is refused, and rank 0 fails at once naming it instead of
/// waiting out the rendezvous timeout (300 s by default) for ranks that will never come.
#[test]
fn a_rank_of_another_world_size_fails_rank_zero_at_once_naming_both_sizes() {
    let mut cfg = crate::common::test_config();
    cfg.rendezvous_timeout = Duration::from_secs(60);
    let (addr, master) = start_master(2, cfg.clone());
    let e = TcpComm::worker(&addr, 1, 3, cfg).err().expect("wrong world size must be refused");
    assert_eq!(refused_field(&e), "world size");
    assert!(e.to_string().contains("this job has 2, rank 1 sent 3"), "{e}");
    let e = master.join().unwrap().err().expect("rank 0 fails");
    assert_eq!(refused_field(&e), "world size");
    let msg = e.to_string();
    // A rank 0 that went on waiting would end with the rendezvous timeout's error, not this refusal.
    assert!(msg.contains("this job has 2, rank 1 sent 3") && msg.contains("--nproc and --nnodes"), "{msg}");
}

#[test]
fn duplicate_rank_is_refused() {
    // World size 3: the winning rank 1 waits for rank 2, so the loser is refused while rank 0
    // is still collecting registrations, whichever of the two arrives first.
    let cfg = crate::common::test_config();
    let (addr, master) = start_master(3, cfg.clone());
    let (tx, rx) = std::sync::mpsc::channel();
    for _ in 0..2 {
        let (addr, cfg, tx) = (addr.clone(), cfg.clone(), tx.clone());
        std::thread::spawn(move || tx.send(TcpComm::worker(&addr, 1, 3, cfg)).unwrap());
    }
    let first = rx.recv_timeout(Duration::from_secs(15)).expect("one registration is answered at once");
    let err = first.err().expect("the first answer is the refusal");
    assert_eq!(refused_field(&err), "rank");
    assert!(err.to_string().contains("rank 1 is already registered from 127.0.0.1:"), "{err}");
    let third = std::thread::spawn(move || TcpComm::worker(&addr, 2, 3, cfg));
    let winner = rx.recv_timeout(Duration::from_secs(15)).unwrap().expect("winner joins the ring");
    let all = vec![master.join().unwrap().expect("master"), winner, third.join().unwrap().expect("rank 2")];
    let got = crate::common::on_threads(all, |mut c| {
        let mut b = vec![1.0f32; 3];
        c.all_reduce(&mut b, ReduceOp::Sum).unwrap();
        b
    });
    assert!(got.iter().all(|b| b == &vec![3.0; 3]));
}

#[test]
fn rendezvous_times_out_with_a_message_naming_missing_ranks() {
    let mut cfg = crate::common::test_config();
    cfg.rendezvous_timeout = Duration::from_millis(500);
    let (addr, master) = start_master(3, cfg.clone());
    let mut bad = cfg.clone();
    bad.token = "wrong".into();
    assert!(TcpComm::worker(&addr, 2, 3, bad).is_err());
    let e = master.join().unwrap().err().expect("must time out");
    let msg = e.to_string();
    assert!(msg.contains("missing rank(s) [1, 2]") && msg.contains("job token"), "{msg}");
    // A worker with nobody listening gives up after its rendezvous timeout too.
    let dead = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let e = TcpComm::worker(&dead, 1, 2, cfg).err().expect("no master");
    assert!(matches!(e, CommError::Rendezvous(_)), "{e}");
}

#[test]
fn different_lengths_fail_on_every_rank() {
    let res = crate::common::on_threads(crate::common::tcp_group(3, crate::common::test_config()), |mut c| {
        let len = if c.rank() == 1 { 999 } else { 1000 };
        let mut b = vec![1.0; len];
        c.all_reduce(&mut b, ReduceOp::Sum).map_err(|e| e.to_string())
    });
    for (r, x) in res.iter().enumerate() {
        let msg = x.as_ref().expect_err("must fail");
        assert!(msg.contains("length") || msg.contains("different collective calls"), "rank {r}: {msg}");
    }
}

#[test]
fn stalled_rank_is_named_by_everyone_within_the_timeout() {
    let mut cfg = crate::common::test_config();
    cfg.timeout = Duration::from_millis(1500);
    cfg.socket_buffer = Some(64 << 10);
    let start = Instant::now();
    let res = crate::common::on_threads(crate::common::tcp_group(4, cfg), |mut c| {
        if c.rank() == 2 {
            // Alive, connected, but never enters the collective.
            std::thread::sleep(Duration::from_secs(4));
            return None;
        }
        let t = Instant::now();
        let mut b = vec![1.0f32; 4 << 20];
        let e = c.all_reduce(&mut b, ReduceOp::Sum).expect_err("must time out");
        Some((e, t.elapsed()))
    });
    for (r, x) in res.into_iter().enumerate() {
        let Some((e, took)) = x else { continue };
        assert_eq!(e.blamed_rank(), Some(2), "rank {r}: {e}");
        assert!(e.to_string().contains("rank 2"), "rank {r}: {e}");
        assert_eq!(crate::common::repeated_phrase(&e.to_string()), None, "rank {r}: {e}");
        assert!(took < Duration::from_millis(3500), "rank {r} took {took:?}");
    }
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn different_block_sizes_are_refused_by_name() {
    // Ranks that disagree on TcpConfig::chunk_bytes would disagree on every frame length.
    let cfg = crate::common::test_config();
    let (addr, master) = start_master(2, cfg.clone());
    let mut other = cfg.clone();
    other.chunk_bytes = 64 << 10;
    let w = std::thread::spawn(move || TcpComm::worker(&addr, 1, 2, other));
    let comms = vec![master.join().unwrap().unwrap(), w.join().unwrap().unwrap()];
    let res = crate::common::on_threads(comms, |mut c| {
        let mut b = vec![1.0f32; 100];
        c.all_reduce(&mut b, ReduceOp::Sum)
    });
    // The rank that reads the other's header names the field; the other may learn of the failure
    // from its abort notice first.
    let msgs: Vec<String> = res.into_iter().map(|r| r.expect_err("must refuse").to_string()).collect();
    assert!(msgs.iter().any(|m| m.contains("block size")), "{msgs:?}");
    assert!(msgs.iter().all(|m| m.contains("block size") || m.contains("different collective calls")), "{msgs:?}");
}

/// Runs `f` on a thread and waits at most `limit` for its answer (so a test of "at once" cannot
/// hang for a rendezvous timeout).
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

fn sum_on_ring(comms: Vec<TcpComm>) {
    let n = comms.len();
    let got = crate::common::on_threads(comms, |mut c| {
        let mut b = vec![1.0f32; 5];
        c.all_reduce(&mut b, ReduceOp::Sum).unwrap();
        b
    });
    assert!(got.iter().all(|b| b == &vec![n as f32; 5]), "{got:?}");
}

#[test]
fn idle_connections_do_not_starve_real_ranks() {
    // More idle connections than rank 0 reads hellos from at once, all still within their hello
    // timeout when the real ranks arrive.
    let mut cfg = crate::common::test_config();
    cfg.hello_timeout = Duration::from_secs(30);
    let (addr, master) = start_master(3, cfg.clone());
    let idle: Vec<TcpStream> = (0..300).map(|_| TcpStream::connect(&addr).expect("idle connect")).collect();
    let comms = crate::common::on_threads(vec![1usize, 2], move |r| TcpComm::worker(&addr, r, 3, cfg.clone()));
    let mut all = vec![master.join().unwrap().expect("master")];
    all.extend(comms.into_iter().map(|c| c.expect("a real rank gets in despite the idle connections")));
    sum_on_ring(all);
    drop(idle);
}

#[test]
fn real_rank_retries_after_rank0_closed_its_connection() {
    // A rank 0 that sheds the first connection (as under a flood), then listens on the same port.
    let cfg = crate::common::test_config();
    let first = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = first.local_addr().unwrap().to_string();
    let worker = {
        let (addr, cfg) = (addr.clone(), cfg.clone());
        std::thread::spawn(move || TcpComm::worker(&addr, 1, 2, cfg))
    };
    drop(first.accept().unwrap());
    drop(first);
    let m = TcpComm::master(MasterListener::bind(&addr).unwrap(), 2, cfg).expect("master");
    let w = worker.join().unwrap().expect("rank 1 retries and joins");
    sum_on_ring(vec![m, w]);
}

#[test]
fn late_duplicate_rank_is_refused_after_the_ring_formed() {
    let cfg = crate::common::test_config();
    let (addr, master) = start_master(2, cfg.clone());
    let w = TcpComm::worker(&addr, 1, 2, cfg.clone()).expect("rank 1");
    let m = master.join().unwrap().expect("master");
    // A second copy of rank 1: answered by rank 0, not left to wait for its rendezvous timeout.
    let late = within(Duration::from_secs(15), move || TcpComm::worker(&addr, 1, 2, cfg).map(|_| ()))
        .expect("the late rank is answered before its rendezvous timeout");
    let e = late.expect_err("a late duplicate must be refused");
    assert_eq!(refused_field(&e), "rank");
    let msg = e.to_string();
    assert!(msg.contains("rank 1 already joined from 127.0.0.1:") && msg.contains("ring has formed"), "{msg}");
    assert_eq!(crate::common::repeated_phrase(&msg), None, "{msg}");
    sum_on_ring(vec![m, w]);
}

#[test]
fn master_port_zero_is_refused_at_once() {
    let env = LaunchEnv {
        rank: 0,
        world_size: 2,
        local_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: 0,
        source: Source::Explicit,
    };
    let res =
        within(Duration::from_secs(10), move || TcpComm::from_launch(&env, crate::common::test_config()).map(|_| ()))
            .expect("refused at once, not after the rendezvous timeout");
    let e = res.expect_err("port 0 must be refused");
    assert!(matches!(&e, CommError::Launch { var, .. } if var == "MASTER_PORT"), "{e}");
    assert!(e.to_string().contains("MASTER_PORT=0 cannot be used"), "{e}");
}

#[test]
fn handshake_refusals_state_each_fact_once() {
    let mut cfg = crate::common::test_config();
    cfg.rendezvous_timeout = Duration::from_secs(3);
    let (addr, master) = start_master(2, cfg.clone());
    let mut msgs = Vec::new();
    let mut bad = cfg.clone();
    bad.token = "another-job".into();
    msgs.push(TcpComm::worker(&addr, 1, 2, bad).err().expect("token"));
    let mut bad = cfg.clone();
    bad.protocol_version = 99;
    msgs.push(TcpComm::worker(&addr, 1, 2, bad).err().expect("version"));
    msgs.push(TcpComm::worker(&addr, 1, 3, cfg).err().expect("world size"));
    msgs.push(master.join().unwrap().err().expect("rank 0 fails"));
    for e in msgs {
        let msg = e.to_string();
        eprintln!("{msg}");
        assert_eq!(crate::common::repeated_phrase(&msg), None, "{msg}");
    }
}

#[test]
fn a_hello_of_another_generation_is_refused_naming_it() {
    let gen1 = TcpConfig { generation: 1, rendezvous_timeout: Duration::from_secs(5), ..TcpConfig::default() };
    let listener = MasterListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let master = std::thread::spawn(move || TcpComm::master(listener, 2, gen1).err());
    let stale = TcpConfig { generation: 0, rendezvous_timeout: Duration::from_secs(5), ..TcpConfig::default() };
    let err = TcpComm::worker(&addr, 1, 2, stale).err().expect("refused");
    let msg = err.to_string();
    assert!(msg.contains("generation 0") && msg.contains("is over"), "{msg}");
    assert!(master.join().unwrap().is_some());
}
