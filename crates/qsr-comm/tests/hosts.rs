//! Jobs over several (simulated) hosts, from threads of this process: each rank names its host as
//! `QSR_HOST_ID` would, and `over_ring` picks the ring, shared memory, or both (a shared-memory group
//! per host and a ring of host leaders).

mod common;

use qsr_comm::{Collective, ReduceOp, ShmConfig, Transport};

fn group(n: usize, host: fn(usize) -> String) -> Vec<Box<dyn Collective>> {
    common::on_threads(common::tcp_group(n, common::test_config()), move |boot| {
        let h = host(boot.rank());
        let shm = ShmConfig { slot_bytes: 64 << 10, ..ShmConfig::default() };
        qsr_comm::over_ring(boot, Transport::Auto, &h, shm).expect("transport setup")
    })
}

fn parity(r: usize) -> String {
    format!("node-{}", r % 2)
}

#[test]
fn the_transport_follows_the_hosts() {
    let backends = |n, host| group(n, host).iter().map(|c| c.backend()).collect::<Vec<_>>();
    assert_eq!(backends(3, |_| "one".into()), vec!["shm"; 3]);
    assert_eq!(backends(3, |r| format!("node-{r}")), vec!["tcp"; 3]);
    assert_eq!(backends(3, parity), vec!["shm+tcp"; 3]);
}

#[test]
fn matrix_over_mixed_hosts() {
    common::matrix(|n| group(n, parity), &[2, 3, 4, 5]);
}

#[test]
fn bf16_over_mixed_hosts_is_bit_identical_and_close() {
    let len = 30_001;
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let got = common::on_threads(group(4, parity), move |mut c| {
            let mut b = common::input(4, c.rank(), len);
            c.all_reduce_bf16(&mut b, op).unwrap();
            b
        });
        let inputs: Vec<Vec<f32>> = (0..4).map(|r| common::input(4, r, len)).collect();
        for (r, g) in got.iter().enumerate() {
            assert!(g.iter().zip(&got[0]).all(|(a, b)| a.to_bits() == b.to_bits()), "{op:?}: rank {r} differs");
        }
        for i in 0..len {
            let sum: f64 = inputs.iter().map(|x| f64::from(x[i])).sum();
            let abs: f64 = inputs.iter().map(|x| f64::from(x[i]).abs()).sum();
            let (want, scale) = if op == ReduceOp::Mean { (sum / 4.0, abs / 4.0) } else { (sum, abs) };
            // bf16 keeps 8 significant bits; each of the few roundings costs at most half an ulp of the scale.
            assert!((f64::from(got[0][i]) - want).abs() <= scale * 4.0 / 256.0 + 1e-30, "{op:?} element {i}");
        }
    }
}

#[test]
fn oversized_byte_broadcast_is_refused_on_every_rank_of_every_host() {
    let errors = common::on_threads(group(4, parity), |mut c| {
        let mut b = if c.rank() == 1 { vec![0u8; qsr_comm::MAX_BROADCAST_BYTES + 1] } else { Vec::new() };
        c.broadcast_bytes(&mut b, 1).unwrap_err().to_string()
    });
    for (r, e) in errors.iter().enumerate() {
        assert!(e.contains("more than the bound"), "rank {r}: {e}");
    }
}
