//! Recursive doubling, the TCP ring's path for small all-reduces: every world size (powers of two
//! and the folded others), the same bits on every rank, `Mean` exactly `Sum / K`, the cutover, and
//! failures named alike by every survivor.

use std::time::Duration;

use qsr_comm::{Collective, ReduceOp, TcpConfig};

fn cfg(doubling_bytes: usize) -> TcpConfig {
    TcpConfig { doubling_bytes, ..crate::common::test_config() }
}

/// Every rank's sum and mean of `len` seeded values, over rings of `n` with doubling at `cut`.
fn sums(n: usize, len: usize, cut: usize) -> Vec<(Vec<f32>, Vec<f32>)> {
    crate::common::on_threads(crate::common::tcp_group(n, cfg(cut)), move |mut c| {
        let mut s = crate::common::input(7, c.rank(), len);
        let mut m = s.clone();
        c.all_reduce(&mut s, ReduceOp::Sum).unwrap();
        c.all_reduce(&mut m, ReduceOp::Mean).unwrap();
        (s, m)
    })
}

#[test]
fn small_all_reduces_are_exact_and_bit_identical_for_every_world_size() {
    for n in 2..=9 {
        for len in [1, 3, 100, 4096] {
            let got = sums(n, len, 16 << 10);
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| crate::common::input(7, r, len)).collect();
            let sums: Vec<Vec<f32>> = got.iter().map(|g| g.0.clone()).collect();
            crate::common::check(&inputs, &sums, ReduceOp::Sum, &format!("n {n} len {len}"));
            for (r, (s, m)) in got.iter().enumerate() {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(s), bits(&got[0].0), "n {n} len {len}: rank {r}'s sum differs");
                let mean: Vec<f32> = s.iter().map(|x| x / n as f32).collect();
                assert_eq!(bits(m), bits(&mean), "n {n} len {len}: rank {r}'s mean is not sum / K");
            }
        }
    }
}

#[test]
fn the_cutover_sends_larger_buffers_around_the_ring() {
    // 5000 floats (20,000 bytes) exceed a 16 KiB cutover: the ring's result, bit for bit.
    let (ring, small) = (sums(5, 5000, 0), sums(5, 5000, 16 << 10));
    assert_eq!(ring[0].0.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), {
        small[0].0.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    });
    // Below it the order differs from the ring's (and the result stays within rounding of it).
    let (ring, doubled) = (sums(5, 999, 0), sums(5, 999, 16 << 10));
    let inputs: Vec<Vec<f32>> = (0..5).map(|r| crate::common::input(7, r, 999)).collect();
    crate::common::check(&inputs, &[doubled[0].0.clone()], ReduceOp::Sum, "doubling");
    crate::common::check(&inputs, &[ring[0].0.clone()], ReduceOp::Sum, "ring");
}

/// A ring of 3 whose rank 2 has another cutover than ranks 0 and 1.
fn odd_one_out(theirs: usize) -> Vec<String> {
    let listener = qsr_comm::MasterListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let workers: Vec<_> = (1..3)
        .map(|r| {
            let (addr, c) = (addr.clone(), cfg(if r == 2 { theirs } else { 16 << 10 }));
            std::thread::spawn(move || qsr_comm::TcpComm::worker(&addr, r, 3, c).unwrap())
        })
        .collect();
    let mut comms = vec![qsr_comm::TcpComm::master(listener, 3, cfg(16 << 10)).unwrap()];
    comms.extend(workers.into_iter().map(|w| w.join().unwrap()));
    crate::common::on_threads(comms, |mut c| {
        let mut b = vec![1.0f32; 250];
        c.all_reduce(&mut b, ReduceOp::Sum).unwrap_err().to_string()
    })
}

#[test]
fn ranks_with_different_cutovers_fail_instead_of_mixing_paths() {
    for (r, e) in odd_one_out(8 << 10).iter().enumerate() {
        assert!(e.contains("doubling_bytes differs"), "rank {r}: {e}");
    }
    // A rank that keeps the call on the ring meets the others' pairing request: calls that differ.
    for (r, e) in odd_one_out(0).iter().enumerate() {
        assert!(
            e.contains("different collective calls") || e.contains("differs") || e.contains("expected"),
            "rank {r}: {e}"
        );
    }
}

/// Rank `victim` of `n` leaves (drops its communicator) or stalls (sleeps past the timeout) before a
/// small all-reduce: every other rank fails naming it.
fn survivors_name(n: usize, victim: usize, stall: bool) -> Vec<String> {
    let timeout = Duration::from_millis(400);
    let cfg = TcpConfig { timeout, ..cfg(16 << 10) };
    crate::common::on_threads(crate::common::tcp_group(n, cfg), move |mut c| {
        let mut b = vec![1.0f32; 64];
        c.all_reduce(&mut b, ReduceOp::Sum).unwrap(); // the pairs form
        if c.rank() == victim {
            if stall {
                std::thread::sleep(timeout * 6);
            }
            return String::new();
        }
        let e = c.all_reduce(&mut b, ReduceOp::Sum).unwrap_err();
        format!("{:?} {e}", e.blamed_rank())
    })
}

#[test]
fn a_lost_or_stalled_rank_is_named_by_every_survivor() {
    for (n, victim) in [(4, 2), (5, 1), (5, 4), (7, 0), (8, 5)] {
        // Stalls take the timeouts: the folded rank (5, 4) and the deepest world are the cases.
        for stall in [false, true].into_iter().filter(|&s| !s || matches!((n, victim), (5, 4) | (8, 5) | (4, 2))) {
            for (r, e) in survivors_name(n, victim, stall).iter().enumerate().filter(|(r, _)| *r != victim) {
                assert!(e.starts_with(&format!("Some({victim})")), "n {n} stall {stall}: rank {r}: {e}");
            }
        }
    }
}
