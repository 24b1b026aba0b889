//! Shared-memory groups of threads, bootstrapped over the in-process group: the correctness matrix,
//! the same bits as the in-process group (f32) and the TCP ring (bf16), divergence, a member that
//! leaves or stalls, and the group file's cleanup.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use qsr_comm::{Collective, CommError, ReduceOp, ShmComm, ShmConfig, run_threads};

/// A directory of its own per test, so the cleanup assertions see only that test's files.
fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("qsr-shm-it-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Small slots, so that the matrix's large buffers cross many pipeline steps and both halves.
fn config(test: &str, timeout: Duration) -> ShmConfig {
    ShmConfig { timeout, slot_bytes: 64 << 10, dir: dir(test), ..ShmConfig::default() }
}

fn shm_group(n: usize, cfg: &ShmConfig) -> Vec<ShmComm> {
    run_threads(n, |mut boot| ShmComm::from_bootstrap(&mut boot, cfg.clone()).expect("shm setup"))
}

fn files(dir: &PathBuf) -> Vec<String> {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect()
}

#[test]
fn shm_matrix_world_sizes_1_2_3_4() {
    let cfg = config("matrix", Duration::from_secs(20));
    crate::common::matrix(|n| shm_group(n, &cfg), &[1, 2, 3, 4]);
    assert!(files(&cfg.dir).is_empty(), "group files left: {:?}", files(&cfg.dir));
}

/// Runs `call` on every member of `comms` over rank-seeded inputs of `len` and returns the results.
fn results<C: Collective + 'static>(
    comms: Vec<C>,
    len: usize,
    call: fn(&mut C, &mut Vec<f32>) -> Result<(), CommError>,
) -> Vec<Vec<f32>> {
    crate::common::on_threads(comms, move |mut c| {
        let mut b = crate::common::input(9, c.rank(), len);
        call(&mut c, &mut b).expect("collective");
        b
    })
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter().map(|x| x.iter().map(|f| f.to_bits()).collect()).collect()
}

#[test]
fn one_stage_and_two_stage_all_reduces_give_the_in_process_groups_bits() {
    let one = config("one-stage", Duration::from_secs(20));
    let two = ShmConfig { one_stage_bytes: 0, ..config("two-stage", Duration::from_secs(20)) };
    for len in [1, 5, 1000, one.one_stage_bytes / 4] {
        for op in [ReduceOp::Sum, ReduceOp::Mean] {
            let run = move |cfg: &ShmConfig| {
                crate::common::on_threads(shm_group(4, cfg), move |mut c| {
                    let mut b = crate::common::input(3, c.rank(), len);
                    c.all_reduce(&mut b, op).unwrap();
                    b
                })
            };
            let inproc = crate::common::on_threads(qsr_comm::InProcessGroup::new(4), move |mut c| {
                let mut b = crate::common::input(3, c.rank(), len);
                c.all_reduce(&mut b, op).unwrap();
                b
            });
            assert_eq!(bits(&run(&one)), bits(&inproc), "one stage, len {len} {op:?}");
            assert_eq!(bits(&run(&two)), bits(&inproc), "two stages, len {len} {op:?}");
        }
    }
}

#[test]
fn members_configured_with_different_one_stage_bytes_fail_instead_of_deadlocking() {
    let cfg = config("one-stage-differs", Duration::from_secs(10));
    let errors = run_threads(2, |mut boot| {
        let mine = ShmConfig { one_stage_bytes: if boot.rank() == 0 { 0 } else { 4096 }, ..cfg.clone() };
        let mut c = ShmComm::from_bootstrap(&mut boot, mine).unwrap();
        c.all_reduce(&mut [1.0; 4], ReduceOp::Sum).unwrap_err().to_string()
    });
    for e in errors {
        assert!(e.contains("in all-reduce path (shm one_stage_bytes)"), "{e}");
    }
}

#[test]
fn shm_gives_the_in_process_groups_f32_bits_and_the_tcp_rings_bf16_bits() {
    let cfg = config("bits", Duration::from_secs(20));
    let len = 100_003; // crosses six 64 KiB steps, not divisible by 3
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let sum = |c: &mut ShmComm, b: &mut Vec<f32>| c.all_reduce(b, ReduceOp::Sum);
        let mean = |c: &mut ShmComm, b: &mut Vec<f32>| c.all_reduce(b, ReduceOp::Mean);
        let shm = results(shm_group(3, &cfg), len, if op == ReduceOp::Sum { sum } else { mean });
        let inproc = crate::common::on_threads(qsr_comm::InProcessGroup::new(3), move |mut c| {
            let mut b = crate::common::input(9, c.rank(), len);
            c.all_reduce(&mut b, op).unwrap();
            b
        });
        assert_eq!(bits(&shm), bits(&inproc), "{op:?}: shm and the in-process group differ");

        let shm_bf16 = crate::common::on_threads(shm_group(3, &cfg), move |mut c| {
            let mut b = crate::common::input(9, c.rank(), len);
            c.all_reduce_bf16(&mut b, op).unwrap();
            b
        });
        let ring_bf16 =
            crate::common::on_threads(crate::common::tcp_group(3, crate::common::test_config()), move |mut c| {
                let mut b = crate::common::input(9, c.rank(), len);
                c.all_reduce_bf16(&mut b, op).unwrap();
                b
            });
        assert_eq!(bits(&shm_bf16), bits(&ring_bf16), "{op:?}: shm's bf16 all-reduce differs from the ring's");
    }
}

/// Every member's error when member `r` runs `odd` and the others `even`.
fn diverge(
    odd_rank: usize,
    even: fn(&mut ShmComm) -> Result<(), CommError>,
    odd: fn(&mut ShmComm) -> Result<(), CommError>,
) -> Vec<String> {
    let cfg = config("diverge", Duration::from_secs(10));
    crate::common::on_threads(shm_group(3, &cfg), move |mut c| {
        let r = if c.rank() == odd_rank { odd(&mut c) } else { even(&mut c) };
        let e = r.expect_err("a diverged call fails on every rank");
        // The communicator is broken afterwards.
        assert!(matches!(c.barrier(), Err(CommError::Broken(_))));
        e.to_string()
    })
}

#[test]
fn diverged_calls_fail_on_every_member_naming_the_field() {
    let ten = |c: &mut ShmComm| c.all_reduce(&mut [1.0; 10], ReduceOp::Sum);
    let eleven = |c: &mut ShmComm| c.all_reduce(&mut [1.0; 11], ReduceOp::Sum);
    let bf16 = |c: &mut ShmComm| c.all_reduce_bf16(&mut [1.0; 10], ReduceOp::Sum);
    let barrier = |c: &mut ShmComm| c.barrier();
    for (errors, field) in [
        (diverge(1, ten, eleven), "length (bytes)"),
        (diverge(2, ten, bf16), "reduce op"),
        (diverge(0, ten, barrier), "call"),
    ] {
        for (r, e) in errors.iter().enumerate() {
            assert!(e.contains(&format!(" in {field}: ")), "rank {r}: {e}");
        }
    }
}

/// Ranks 0 and 1 all-reduce while rank 2 runs `victim` (then drops its member); both must fail
/// naming rank 2 within `bound`.
fn survivors_name_rank_2(test: &str, timeout: Duration, bound: Duration, victim: fn()) {
    let cfg = config(test, timeout);
    let out = crate::common::on_threads(shm_group(3, &cfg), move |mut c| {
        if c.rank() == 2 {
            victim();
            return None;
        }
        let start = Instant::now();
        let mut b = vec![1.0f32; 1 << 20];
        let e = c.all_reduce(&mut b, ReduceOp::Sum).expect_err("rank 2 is gone");
        Some((e.blamed_rank(), e.to_string(), start.elapsed()))
    });
    for (r, res) in out.into_iter().enumerate().take(2) {
        let (blamed, msg, took) = res.unwrap();
        assert_eq!(blamed, Some(2), "rank {r}: {msg}");
        assert!(msg.contains("rank 2"), "rank {r}: {msg}");
        assert!(took <= bound, "rank {r} took {took:?}: {msg}");
        assert_eq!(crate::common::repeated_phrase(&msg), None, "rank {r}: {msg}");
    }
}

#[test]
fn member_that_closes_its_communicator_is_named_at_once() {
    survivors_name_rank_2("closed", Duration::from_secs(10), Duration::from_secs(2), || {});
}

#[test]
fn stalled_member_is_named_after_the_timeout() {
    survivors_name_rank_2("stalled", Duration::from_millis(300), Duration::from_millis(1500), || {
        std::thread::sleep(Duration::from_secs(2))
    });
}

#[test]
fn group_file_is_gone_once_every_member_mapped_it_and_dead_jobs_files_are_swept() {
    let cfg = config("sweep", Duration::from_secs(10));
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let ns = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata("/proc/self/ns/pid").unwrap());
    let stale = format!("qsr-shm-{ns}-{dead}-0123456789abcdef");
    std::fs::write(cfg.dir.join(&stale), vec![0u8; 4096]).unwrap();
    let group = shm_group(2, &cfg);
    assert!(files(&cfg.dir).is_empty(), "left behind: {:?}", files(&cfg.dir));
    let sums = crate::common::on_threads(group, |mut c| {
        let mut b = vec![c.rank() as f32 + 1.0; 5];
        c.all_reduce(&mut b, ReduceOp::Sum).unwrap();
        b
    });
    assert_eq!(sums, vec![vec![3.0; 5]; 2]);
}

#[test]
fn oversized_byte_broadcast_is_refused_on_every_member() {
    let cfg = config("bytes", Duration::from_secs(10));
    let errors = crate::common::on_threads(shm_group(2, &cfg), |mut c| {
        let mut b = if c.rank() == 0 { vec![0u8; qsr_comm::MAX_BROADCAST_BYTES + 1] } else { Vec::new() };
        c.broadcast_bytes(&mut b, 0).unwrap_err().to_string()
    });
    for e in errors {
        assert!(e.contains("more than the bound"), "{e}");
    }
}

#[test]
fn bad_slot_size_is_refused_naming_it() {
    let cfg = ShmConfig { slot_bytes: 1000, ..config("slot", Duration::from_secs(1)) };
    let errors = run_threads(2, |mut boot| ShmComm::from_bootstrap(&mut boot, cfg.clone()).err().unwrap().to_string());
    assert!(errors.iter().all(|e| e.contains("slot_bytes = 1000")), "{errors:?}");
}
