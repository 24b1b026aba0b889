//! Jobs over several (simulated) hosts, from threads of this process: each rank names its host as
//! `QSR_HOST_ID` would, and `over_ring` picks the ring, shared memory, or both (a shared-memory group
//! per host and a ring of host leaders).

use qsr_comm::{Collective, ReduceOp, ShmConfig, Transport};

fn group(n: usize, host: fn(usize) -> String) -> Vec<Box<dyn Collective>> {
    crate::common::on_threads(crate::common::tcp_group(n, crate::common::test_config()), move |boot| {
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
    crate::common::matrix(|n| group(n, parity), &[2, 3, 4, 5]);
}

#[test]
fn bf16_over_mixed_hosts_is_bit_identical_and_close() {
    let len = 30_001;
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let got = crate::common::on_threads(group(4, parity), move |mut c| {
            let mut b = crate::common::input(4, c.rank(), len);
            c.all_reduce_bf16(&mut b, op).unwrap();
            b
        });
        let inputs: Vec<Vec<f32>> = (0..4).map(|r| crate::common::input(4, r, len)).collect();
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
    let errors = crate::common::on_threads(group(4, parity), |mut c| {
        let mut b = if c.rank() == 1 { vec![0u8; qsr_comm::MAX_BROADCAST_BYTES + 1] } else { Vec::new() };
        c.broadcast_bytes(&mut b, 1).unwrap_err().to_string()
    });
    for (r, e) in errors.iter().enumerate() {
        assert!(e.contains("more than the bound"), "rank {r}: {e}");
    }
}

/// Rank `r` of 4 splits by parity with key `3 - r` on the named hosts: each returns its group's
/// backend, rank and size, the group sum of `r + 1`, and the sum over the ring afterwards.
fn split_by_parity(host: fn(usize) -> String) -> Vec<(&'static str, usize, usize, f32, f32)> {
    crate::common::on_threads(crate::common::tcp_group(4, crate::common::test_config()), move |mut ring| {
        let r = ring.rank();
        let shm = ShmConfig { slot_bytes: 64 << 10, ..ShmConfig::default() };
        let mut sub =
            qsr_comm::split(&mut ring, (r % 2) as u32, (3 - r) as u32, Transport::Auto, &host(r), shm).expect("split");
        let mut b = [r as f32 + 1.0];
        sub.all_reduce(&mut b, ReduceOp::Sum).unwrap();
        let mut all = [r as f32 + 1.0];
        ring.all_reduce(&mut all, ReduceOp::Sum).unwrap();
        (sub.backend(), sub.rank(), sub.world_size(), b[0], all[0])
    })
}

#[test]
fn split_groups_ranks_by_color_orders_them_by_key_and_keeps_the_ring() {
    for (hosts, backend) in [(parity as fn(usize) -> String, "shm"), (|r| format!("node-{r}"), "tcp")] {
        let got = split_by_parity(hosts);
        for (r, &(b, rank, size, sum, all)) in got.iter().enumerate() {
            // Ranks 0 and 2 (sum 4) and ranks 1 and 3 (sum 6); the higher rank has the lower key.
            assert_eq!((b, size, sum, all), (backend, 2, if r % 2 == 0 { 4.0 } else { 6.0 }, 10.0), "rank {r}");
            assert_eq!(rank, usize::from(r < 2), "rank {r}");
        }
    }
}

#[test]
fn split_by_host_gives_each_node_its_shared_memory_beside_the_global_level() {
    let got = crate::common::on_threads(crate::common::tcp_group(4, crate::common::test_config()), |mut ring| {
        let (r, h) = (ring.rank(), parity(ring.rank()));
        let shm = ShmConfig { slot_bytes: 64 << 10, ..ShmConfig::default() };
        let mut node = qsr_comm::split_by_host(&mut ring, Transport::Auto, &h, shm.clone()).unwrap();
        let mut world = qsr_comm::over_ring(ring, Transport::Auto, &h, shm).unwrap();
        let (mut a, mut b) = ([r as f32], [r as f32]);
        node.all_reduce(&mut a, ReduceOp::Mean).unwrap();
        world.all_reduce(&mut b, ReduceOp::Mean).unwrap();
        (node.backend(), world.backend(), node.rank(), a[0], b[0])
    });
    for (r, &(node, world, rank, a, b)) in got.iter().enumerate() {
        assert_eq!((node, world, rank, b), ("shm", "shm+tcp", r / 2, 1.5), "rank {r}");
        assert_eq!(a, if r % 2 == 0 { 1.0 } else { 2.0 }, "rank {r}");
    }
}

#[test]
fn a_split_group_names_a_lost_member_by_its_rank_in_the_ring() {
    let got = crate::common::on_threads(crate::common::tcp_group(4, crate::common::test_config()), |mut ring| {
        let r = ring.rank();
        let shm = ShmConfig { slot_bytes: 64 << 10, ..ShmConfig::default() };
        let mut sub = qsr_comm::split(&mut ring, (r % 2) as u32, r as u32, Transport::Auto, "one", shm).unwrap();
        let mut b = [1.0f32];
        match r {
            2 => String::new(), // leaves its group (rank 1 of ranks 0 and 2) without a call
            0 => sub.all_reduce(&mut b, ReduceOp::Sum).unwrap_err().to_string(),
            _ => sub.all_reduce(&mut b, ReduceOp::Sum).map(|()| String::new()).unwrap(),
        }
    });
    assert!(got[0].contains("rank 2") && !got[0].contains("rank 1 "), "{}", got[0]);
}

/// Every transport accounts an all-reduce as the ring's bytes over all K ranks and a broadcast as
/// its payload, as the plans count them: the shared-memory-and-ring hierarchy and the ring's
/// recursive doubling too, whatever they move in fact.
#[test]
fn every_transport_accounts_calls_as_the_plans_count_them() {
    let ring = |len: u64| 2 * 3 * len * 4 / 4;
    for host in [parity as fn(usize) -> String, |_| "one".into(), |r| format!("node-{r}")] {
        let got = crate::common::on_threads(group(4, host), |mut c| {
            // The first small call over the ring also forms the pairs of recursive doubling.
            c.all_reduce(&mut vec![1.0; 1000], ReduceOp::Sum).unwrap();
            let mut deltas = Vec::new();
            for len in [1000usize, 100_000] {
                let before = *c.stats();
                c.all_reduce(&mut vec![1.0; len], ReduceOp::Sum).unwrap();
                deltas.push(c.stats().since(&before));
            }
            let before = *c.stats();
            let mut b = if c.rank() == 1 { vec![7u8; 10] } else { Vec::new() };
            c.broadcast_bytes(&mut b, 1).unwrap();
            (c.backend(), c.rank(), deltas, c.stats().since(&before))
        });
        for (backend, rank, deltas, bcast) in got {
            for (d, len) in deltas.iter().zip([1000u64, 100_000]) {
                assert_eq!((d.bytes_sent, d.bytes_received), (ring(len), ring(len)), "{backend} rank {rank} len {len}");
            }
            let want = if rank == 1 { (10, 0) } else { (0, 10) };
            assert!(bcast.bytes_sent >= want.0 && bcast.bytes_received >= want.1, "{backend} rank {rank}: {bcast:?}");
        }
    }
}

/// N2: a ring of one (a launch with `WORLD_SIZE=1`, an elastic job shrunk to one survivor) splits
/// into a group of one, as a streaming job's second lane asks; it panicked indexing its hosts.
#[test]
fn a_ring_of_one_splits_into_a_group_of_one() {
    use qsr_comm::{LaunchEnv, Source, TcpComm};
    let env = LaunchEnv {
        rank: 0,
        world_size: 1,
        local_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: 0,
        source: Source::Explicit,
    };
    let mut ring = TcpComm::from_launch(&env, crate::common::test_config()).expect("a ring of one");
    let shm = ShmConfig { slot_bytes: 64 << 10, ..ShmConfig::default() };
    let mut sub = qsr_comm::split(&mut ring, 0, 0, Transport::Auto, "one", shm).expect("split");
    let mut b = [3.0f32];
    sub.all_reduce(&mut b, ReduceOp::Mean).unwrap();
    assert_eq!((sub.rank(), sub.world_size(), b[0]), (0, 1, 3.0));
}
