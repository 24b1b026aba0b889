//! The ring against a fake peer that speaks the wire protocol by hand: garbage and hostile messages
//! on the rendezvous port, corrupt frames after the handshakes. Here, beside `wire.rs`, rather than
//! in the integration tests, so the protocol is compiled once.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::wire::{self, CallHeader, Frame, Hello, Purpose, Reply};
use crate::{Collective, CommError, MasterListener, ReduceOp, TcpComm, TcpConfig};

/// Settings of these tests' rings: a known token, short timeouts.
fn config() -> TcpConfig {
    TcpConfig {
        timeout: Duration::from_secs(10),
        rendezvous_timeout: Duration::from_secs(20),
        hello_timeout: Duration::from_secs(2),
        token: "test-token".into(),
        ..TcpConfig::default()
    }
}

fn start_master(n: usize, cfg: TcpConfig) -> (String, std::thread::JoinHandle<Result<TcpComm, CommError>>) {
    let l = MasterListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (addr, std::thread::spawn(move || TcpComm::master(l, n, cfg)))
}

/// `f` on every item on a thread of its own; results in order.
fn on_threads<C: Send, T: Send>(items: Vec<C>, f: impl Fn(C) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let joins: Vec<_> = items.into_iter().map(|c| s.spawn(move || f(c))).collect();
        joins.into_iter().map(|j| j.join().expect("rank thread panicked")).collect()
    })
}

fn sum_on_ring(comms: Vec<TcpComm>) {
    let n = comms.len();
    let got = on_threads(comms, |mut c| {
        let mut b = vec![1.0f32; 5];
        c.all_reduce(&mut b, ReduceOp::Sum).unwrap();
        b
    });
    assert!(got.iter().all(|b| b == &vec![n as f32; 5]), "{got:?}");
}

#[test]
fn garbage_on_the_rendezvous_port_does_not_stall_rank0() {
    let mut cfg = config();
    cfg.hello_timeout = Duration::from_secs(1);
    let (addr, master) = start_master(3, cfg.clone());
    let start = Instant::now();
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    let mut keep = Vec::new();
    for i in 0..6 {
        let mut s = TcpStream::connect(&addr).unwrap();
        match i {
            0 => {} // silent: connects and says nothing
            1 => s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap(),
            2 => {
                // valid magic and version, absurd body length
                let mut b = wire::HELLO_MAGIC.to_vec();
                b.extend_from_slice(&wire::PROTOCOL_VERSION.to_le_bytes());
                b.extend_from_slice(&u32::MAX.to_le_bytes());
                s.write_all(&b).unwrap();
            }
            3 => {
                // a hello whose token length runs past the body
                let mut h = Hello {
                    version: wire::PROTOCOL_VERSION,
                    purpose: Purpose::Register,
                    world_size: 3,
                    rank: 1,
                    token: b"test-token".to_vec(),
                    host: String::new(),
                    port: 1,
                    generation: 0,
                }
                .encode();
                let at = wire::PREFIX_LEN + 9;
                h[at..at + 2].copy_from_slice(&900u16.to_le_bytes());
                s.write_all(&h).unwrap();
            }
            _ => {
                let mut b = vec![0u8; 4096];
                rng.fill_bytes(&mut b);
                let _ = s.write_all(&b);
            }
        }
        keep.push(s);
    }
    // Real ranks arrive while the garbage connections are still open.
    let comms = on_threads(vec![1usize, 2], move |r| TcpComm::worker(&addr, r, 3, cfg.clone()));
    let mut all = vec![master.join().unwrap().expect("master survives garbage")];
    all.extend(comms.into_iter().map(|c| c.expect("worker")));
    assert!(start.elapsed() < Duration::from_secs(8), "rendezvous took {:?}", start.elapsed());
    let got = on_threads(all, |mut c| {
        let mut b = vec![c.rank() as f32; 7];
        c.all_reduce(&mut b, ReduceOp::Sum).unwrap();
        b
    });
    assert!(got.iter().all(|b| b == &vec![3.0; 7]));
    drop(keep);
}

/// A fake rank 1 that completes the handshakes by hand, then speaks raw frames to rank 0.
struct FakePeer {
    to_rank0: TcpStream,
    _from_rank0: TcpStream,
}

fn read_msg(s: &mut TcpStream, magic: &[u8; 8]) -> Vec<u8> {
    let mut p = [0u8; wire::PREFIX_LEN];
    s.read_exact(&mut p).unwrap();
    let prefix = wire::decode_prefix(&p, magic, 1 << 20).unwrap();
    let mut body = vec![0u8; prefix.body_len];
    s.read_exact(&mut body).unwrap();
    body
}

fn fake_rank1(master: &str, token: &str) -> FakePeer {
    let own = TcpListener::bind("127.0.0.1:0").unwrap();
    let hello = |purpose, port| Hello {
        version: wire::PROTOCOL_VERSION,
        purpose,
        world_size: 2,
        rank: 1,
        token: token.as_bytes().to_vec(),
        host: "127.0.0.1".into(),
        port,
        generation: 0,
    };
    let mut reg = TcpStream::connect(master).unwrap();
    reg.write_all(&hello(Purpose::Register, own.local_addr().unwrap().port()).encode()).unwrap();
    let Reply::Accepted { table } = Reply::decode_body(&read_msg(&mut reg, &wire::REPLY_MAGIC), 2).unwrap() else {
        panic!("registration refused")
    };
    let mut to_rank0 = TcpStream::connect((table[0].0.as_str(), table[0].1)).unwrap();
    to_rank0.write_all(&hello(Purpose::Ring, 0).encode()).unwrap();
    let (mut from_rank0, _) = own.accept().unwrap();
    let _ = read_msg(&mut from_rank0, &wire::HELLO_MAGIC);
    from_rank0.write_all(&Reply::Accepted { table: vec![] }.encode()).unwrap();
    assert!(matches!(Reply::decode_body(&read_msg(&mut to_rank0, &wire::REPLY_MAGIC), 0), Ok(Reply::Accepted { .. })));
    FakePeer { to_rank0, _from_rank0: from_rank0 }
}

fn rank0_against_fake(bytes_after_setup: impl FnOnce(&mut TcpStream)) -> CommError {
    let cfg = config();
    let (addr, master) = start_master(2, cfg.clone());
    let mut fake = fake_rank1(&addr, &cfg.token);
    let mut m = master.join().unwrap().expect("master");
    bytes_after_setup(&mut fake.to_rank0);
    let start = Instant::now();
    let mut b = vec![1.0f32; 1000];
    let e = m.all_reduce(&mut b, ReduceOp::Sum).expect_err("corrupt stream must fail");
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    // Broken afterwards.
    assert!(matches!(m.all_reduce(&mut b, ReduceOp::Sum), Err(CommError::Broken(_))));
    e
}

fn header(len: u64) -> CallHeader {
    CallHeader {
        kind: wire::KIND_ALL_REDUCE,
        op: 0,
        chunk: 128, // the default 512 KiB in 4 KiB units
        root: 0,
        seq: 0,
        len,
        sender: 1,
        tag: None,
    }
}

#[test]
fn hostile_frame_length_is_rejected_without_allocation() {
    let e = rank0_against_fake(|s| {
        s.write_all(&header(4000).encode()).unwrap();
        s.write_all(&Frame::Data { len: u32::MAX, block: 0 }.encode()).unwrap();
    });
    let msg = e.to_string();
    assert!(matches!(e, CommError::Protocol { .. }), "{msg}");
    assert!(
        msg.contains("rank 1") && msg.contains("4294967295 bytes") && msg.contains("expected block 0 with 2000 bytes"),
        "{msg}"
    );
}

#[test]
fn header_mismatch_and_garbage_header_are_rejected() {
    let e = rank0_against_fake(|s| s.write_all(&header(4004).encode()).unwrap());
    assert!(
        matches!(&e, CommError::CallsDiffer { peer: 1, field: "length (bytes)", ours, theirs, .. } if ours == "4000" && theirs == "4004"),
        "{e}"
    );
    let e = rank0_against_fake(|s| s.write_all(&[0x5au8; 64]).unwrap());
    assert!(e.to_string().contains("bad magic in call header"), "{e}");
    let e = rank0_against_fake(|s| {
        s.write_all(&header(4000).encode()).unwrap();
        s.write_all(&Frame::Abort { culprit: 77, reason: 1 }.encode()).unwrap();
    });
    assert!(e.to_string().contains("names rank 77 of 2"), "{e}");
    // A peer that vanishes mid-stream is named.
    let e = rank0_against_fake(|s| {
        s.write_all(&header(4000).encode()).unwrap();
        s.shutdown(std::net::Shutdown::Both).unwrap();
    });
    assert!(matches!(e, CommError::PeerLost { rank: 1, .. }), "{e}");
}

#[test]
fn rank_whose_registration_closed_can_register_again() {
    // Rank 1 registers, then goes away before the table is sent (restarted, or it gave up on a
    // stalled connection): its next registration replaces the closed one instead of being refused,
    // and the ring is not built with the closed one should rank 2 complete the count first.
    let cfg = config();
    let (addr, master) = start_master(3, cfg.clone());
    let mut gone = TcpStream::connect(&addr).unwrap();
    let hello = Hello {
        version: wire::PROTOCOL_VERSION,
        purpose: Purpose::Register,
        world_size: 3,
        rank: 1,
        token: cfg.token.as_bytes().to_vec(),
        host: "127.0.0.1".into(),
        port: 1,
        generation: 0,
    };
    gone.write_all(&hello.encode()).unwrap();
    drop(gone);
    std::thread::sleep(Duration::from_millis(200));
    let comms = on_threads(vec![1usize, 2], move |r| TcpComm::worker(&addr, r, 3, cfg.clone()));
    let mut all = vec![master.join().unwrap().expect("master")];
    all.extend(comms.into_iter().map(|c| c.expect("worker")));
    sum_on_ring(all);
}
