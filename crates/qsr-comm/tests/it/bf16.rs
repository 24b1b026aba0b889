//! bf16 all-reduce: every rank bit-identical, the TCP ring and the in-process group give the same bits,
//! half the bytes of f32, an error bounded against the f32 result, mixed calls refused by name.

use qsr_comm::{Collective, CommError, CommStats, InProcessGroup, ReduceOp};

/// Results of a bf16 all-reduce of seeded inputs on every rank of `comms`, with each rank's stats.
fn reduce<C: Collective + Send + 'static>(comms: Vec<C>, len: usize, op: ReduceOp) -> Vec<(Vec<f32>, CommStats)> {
    crate::common::on_threads(comms, move |mut c| {
        let mut b = crate::common::input(5, c.rank(), len);
        c.all_reduce_bf16(&mut b, op).unwrap();
        (b, *c.stats())
    })
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn bf16_all_reduce_is_bit_identical_on_every_rank_and_across_backends() {
    let mut small_blocks = crate::common::test_config();
    small_blocks.chunk_bytes = 4096;
    for k in [2, 3, 4] {
        for len in [1, 7, 1001, 100_003] {
            for op in [ReduceOp::Sum, ReduceOp::Mean] {
                let what = format!("K = {k}, {len} values, {op:?}");
                let tcp = reduce(crate::common::tcp_group(k, small_blocks.clone()), len, op);
                let inproc = reduce(InProcessGroup::new(k), len, op);
                for (r, ((t, _), (i, _))) in tcp.iter().zip(&inproc).enumerate() {
                    assert_eq!(bits(t), bits(&tcp[0].0), "{what}: TCP rank {r} differs from rank 0");
                    assert_eq!(bits(t), bits(i), "{what}: rank {r}: TCP and in-process differ");
                }
                // Every value is a bf16: its low 16 bits are zero.
                assert!(tcp[0].0.iter().all(|x| x.to_bits() & 0xffff == 0), "{what}");
            }
        }
    }
}

#[test]
fn bf16_moves_half_the_bytes_of_f32() {
    let (k, len) = (4, 40_000);
    let f32_bytes =
        crate::common::on_threads(crate::common::tcp_group(k, crate::common::test_config()), move |mut c| {
            let mut b = crate::common::input(5, c.rank(), len);
            c.all_reduce(&mut b, ReduceOp::Mean).unwrap();
            c.stats().bytes_sent
        });
    let tcp = reduce(crate::common::tcp_group(k, crate::common::test_config()), len, ReduceOp::Mean);
    let inproc = reduce(InProcessGroup::new(k), len, ReduceOp::Mean);
    for r in 0..k {
        assert_eq!(tcp[r].1.bytes_sent * 2, f32_bytes[r], "rank {r}: TCP bytes");
        assert_eq!(inproc[r].1.bytes_sent * 2, f32_bytes[r], "rank {r}: in-process accounting");
    }
}

/// Each of the K - 1 hops and the final value round to bf16 (unit roundoff 2^-8): the mean stays within
/// (K + 1) 2^-8 of the mean absolute input of the f32 mean, and for typical values much closer.
#[test]
fn bf16_mean_error_is_bounded_against_the_f32_mean() {
    for k in [2, 4] {
        let len = 50_000;
        let got = reduce(InProcessGroup::new(k), len, ReduceOp::Mean);
        let inputs: Vec<Vec<f32>> = (0..k).map(|r| crate::common::input(5, r, len)).collect();
        let mut worst = 0.0f64;
        for i in 0..len {
            let mean: f64 = inputs.iter().map(|x| f64::from(x[i])).sum::<f64>() / k as f64;
            let scale: f64 = inputs.iter().map(|x| f64::from(x[i]).abs()).sum::<f64>() / k as f64;
            let err = (f64::from(got[0].0[i]) - mean).abs();
            let bound = (k as f64 + 1.0) * 2f64.powi(-8) * scale;
            assert!(err <= bound, "K = {k}, element {i}: error {err} above {bound}");
            worst = worst.max(err / scale.max(1e-30));
        }
        assert!(worst > 0.0, "K = {k}: no rounding at all is not bf16");
    }
}

#[test]
fn a_bf16_call_against_an_f32_call_fails_naming_the_reduce_op() {
    for tcp in [true, false] {
        let f = |mut c: Box<dyn Collective>| {
            let mut b = vec![1.0f32; 64];
            if c.rank() == 1 { c.all_reduce_bf16(&mut b, ReduceOp::Mean) } else { c.all_reduce(&mut b, ReduceOp::Mean) }
        };
        let comms = crate::common::boxed_group(2, tcp);
        let errors: Vec<String> = crate::common::on_threads(comms, f)
            .into_iter()
            .map(|r| r.expect_err("mixed precisions must fail").to_string())
            .collect();
        // The rank that sees the difference names the field; every rank fails as calls that differ.
        assert!(errors.iter().any(|e| e.contains("reduce op") && e.contains("bf16")), "tcp {tcp}: {errors:?}");
        assert!(
            errors.iter().all(|e| e.contains("different collective calls") || e.contains("reduce op")),
            "tcp {tcp}: {errors:?}"
        );
    }
}

/// A backend without a bf16 all-reduce (MPI, NCCL) refuses it with an error naming itself.
#[test]
fn backends_without_bf16_refuse_it_by_name() {
    struct Plain(CommStats);
    impl Collective for Plain {
        fn rank(&self) -> usize {
            0
        }
        fn world_size(&self) -> usize {
            1
        }
        fn all_reduce(&mut self, _: &mut [f32], _: ReduceOp) -> Result<(), CommError> {
            Ok(())
        }
        fn broadcast(&mut self, _: &mut [f32], _: usize) -> Result<(), CommError> {
            Ok(())
        }
        fn broadcast_bytes(&mut self, _: &mut Vec<u8>, _: usize) -> Result<(), CommError> {
            Ok(())
        }
        fn barrier(&mut self) -> Result<(), CommError> {
            Ok(())
        }
        fn stats(&self) -> &CommStats {
            &self.0
        }
        fn backend(&self) -> &'static str {
            "mpi"
        }
    }
    assert!(!Plain(CommStats::default()).supports_bf16());
    assert!(InProcessGroup::new(1)[0].supports_bf16());
    let e = Plain(CommStats::default()).all_reduce_bf16(&mut [1.0], ReduceOp::Sum).unwrap_err();
    assert!(matches!(e, CommError::Unsupported { backend: "mpi", .. }), "{e}");
    assert!(e.to_string().contains("mpi does not support a bf16 all-reduce"), "{e}");
}
