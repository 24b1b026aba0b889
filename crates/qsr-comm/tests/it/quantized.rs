//! int8 / fp8 / int4 / int2 all-reduce: every rank bit-identical, the TCP ring, shared memory and the
//! in-process group give the same bits, 0.266 (int4 0.141, int2 0.078) of f32's bytes, an error
//! bounded against the f32 result, mixed calls refused by name.

use std::time::Duration;

use qsr_comm::{Codec, Collective, CommStats, InProcessGroup, ReduceOp, ShmComm, ShmConfig, run_threads};

/// Results of a quantized all-reduce of seeded inputs on every rank of `comms`, with each rank's stats.
fn reduce<C: Collective + Send + 'static>(
    comms: Vec<C>,
    len: usize,
    op: ReduceOp,
    codec: Codec,
) -> Vec<(Vec<f32>, CommStats)> {
    crate::common::on_threads(comms, move |mut c| {
        let mut b = crate::common::input(7, c.rank(), len);
        c.all_reduce_quantized(&mut b, op, codec).unwrap();
        (b, *c.stats())
    })
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn shm_group(n: usize) -> Vec<ShmComm> {
    let dir = std::env::temp_dir().join(format!("qsr-shm-quant-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = ShmConfig { timeout: Duration::from_secs(20), slot_bytes: 8 << 10, dir, ..ShmConfig::default() };
    run_threads(n, |mut boot| ShmComm::from_bootstrap(&mut boot, cfg.clone()).expect("shm setup"))
}

#[test]
fn quantized_all_reduce_is_bit_identical_on_every_rank_and_across_backends() {
    let mut small_blocks = crate::common::test_config();
    small_blocks.chunk_bytes = 4096;
    for codec in [Codec::Int8, Codec::Fp8E4m3, Codec::Int4, Codec::Int2] {
        for k in [2, 3, 4] {
            // Lengths below one block, at block edges, and crossing many pipeline and shm steps.
            for len in [1, 63, 64, 65, 1001, 100_003] {
                for op in [ReduceOp::Sum, ReduceOp::Mean] {
                    let what = format!("{codec:?}, K = {k}, {len} values, {op:?}");
                    let tcp = reduce(crate::common::tcp_group(k, small_blocks.clone()), len, op, codec);
                    let inproc = reduce(InProcessGroup::new(k), len, op, codec);
                    for (r, ((t, _), (i, _))) in tcp.iter().zip(&inproc).enumerate() {
                        assert_eq!(bits(t), bits(&tcp[0].0), "{what}: TCP rank {r} differs from rank 0");
                        assert_eq!(bits(t), bits(i), "{what}: rank {r}: TCP and in-process differ");
                    }
                    if len == 100_003 {
                        let shm = reduce(shm_group(k), len, op, codec);
                        assert_eq!(bits(&shm[k - 1].0), bits(&tcp[0].0), "{what}: shared memory differs");
                    }
                }
            }
        }
    }
}

#[test]
fn quantized_payloads_move_0_266_of_f32s_bytes_int4_0_141_int2_0_078() {
    let (k, len) = (4, 64 * 1000);
    let f32_bytes =
        crate::common::on_threads(crate::common::tcp_group(k, crate::common::test_config()), move |mut c| {
            let mut b = crate::common::input(5, c.rank(), len);
            c.all_reduce(&mut b, ReduceOp::Mean).unwrap();
            c.stats().bytes_sent
        });
    // Per block of 64 values (256 bytes of f32): the codes, packed, and a 4-byte scale.
    for (codec, block_bytes, share) in [(Codec::Int8, 68, 0.27), (Codec::Int4, 36, 0.141), (Codec::Int2, 20, 0.079)] {
        let tcp = reduce(crate::common::tcp_group(k, crate::common::test_config()), len, ReduceOp::Mean, codec);
        let inproc = reduce(InProcessGroup::new(k), len, ReduceOp::Mean, codec);
        for r in 0..k {
            assert_eq!(tcp[r].1.bytes_sent * 256, f32_bytes[r] * block_bytes, "{codec:?}, rank {r}: TCP bytes");
            assert_eq!(inproc[r].1.bytes_sent, tcp[r].1.bytes_sent, "{codec:?}, rank {r}: in-process accounting");
            assert!(tcp[r].1.bytes_sent as f64 <= share * f32_bytes[r] as f64);
        }
    }
}

/// Each hop quantizes its partial sum (int8: at most half a step of `max |block| / 127`), and the
/// mean once more: the error stays within K half-steps of the largest partial sum's block, and is
/// not zero (it is quantized).
#[test]
fn quantized_mean_error_is_bounded_against_the_f32_mean() {
    // int4: codes -7..=7; int2: levels one scale (max / 1.5) apart.
    let codecs =
        [(Codec::Int8, 1.0 / 127.0), (Codec::Fp8E4m3, 1.0 / 16.0), (Codec::Int4, 1.0 / 7.0), (Codec::Int2, 1.0 / 1.5)];
    for (codec, step) in codecs {
        for k in [2, 4] {
            let len = 20_000;
            let got = reduce(InProcessGroup::new(k), len, ReduceOp::Mean, codec);
            let inputs: Vec<Vec<f32>> = (0..k).map(|r| crate::common::input(7, r, len)).collect();
            let mut worst = 0.0f64;
            for block in (0..len).step_by(64) {
                let end = (block + 64).min(len);
                // The largest |partial sum| of the block bounds every hop's scale.
                let big: f64 =
                    (block..end).map(|i| inputs.iter().map(|x| f64::from(x[i]).abs()).sum::<f64>()).fold(0.0, f64::max);
                for i in block..end {
                    let mean: f64 = inputs.iter().map(|x| f64::from(x[i])).sum::<f64>() / k as f64;
                    let err = (f64::from(got[0].0[i]) - mean).abs();
                    // fp8's relative step is 2^-3 of the value, at most 1/16 of the block's scale.
                    let bound = (k as f64 + 1.0) * 0.5 * step * big * if codec == Codec::Fp8E4m3 { 2.0 } else { 1.0 };
                    assert!(err <= bound + 1e-6, "{codec:?}, K = {k}, element {i}: error {err} above {bound}");
                    worst = worst.max(err);
                }
            }
            assert!(worst > 0.0, "{codec:?}, K = {k}: no rounding at all is not quantized");
        }
    }
}

#[test]
fn a_quantized_call_against_an_f32_call_fails_naming_the_reduce_op() {
    for tcp in [true, false] {
        let f = |mut c: Box<dyn Collective>| {
            let mut b = vec![1.0f32; 64];
            if c.rank() == 1 {
                c.all_reduce_quantized(&mut b, ReduceOp::Mean, Codec::Int8)
            } else {
                c.all_reduce(&mut b, ReduceOp::Mean)
            }
        };
        let comms = crate::common::boxed_group(2, tcp);
        let errors: Vec<String> = crate::common::on_threads(comms, f)
            .into_iter()
            .map(|r| r.expect_err("mixed payloads must fail").to_string())
            .collect();
        assert!(errors.iter().any(|e| e.contains("reduce op") && e.contains("int8")), "tcp {tcp}: {errors:?}");
    }
}

/// A non-finite value makes its block NaN after the all-reduce, on every backend: a diverged worker
/// stays visible rather than being quantized into numbers.
#[test]
fn a_non_finite_value_poisons_its_block_not_the_buffer() {
    let comms = InProcessGroup::new(2);
    let out = crate::common::on_threads(comms, |mut c| {
        let mut b = vec![0.5f32; 130];
        if c.rank() == 1 {
            b[70] = f32::INFINITY;
        }
        c.all_reduce_quantized(&mut b, ReduceOp::Mean, Codec::Int8).unwrap();
        b
    });
    assert!(out[0][64..128].iter().all(|x| x.is_nan()), "the block of the infinity");
    assert!(
        out[0][..64].iter().chain(&out[0][128..]).all(|&x| (x - 0.5).abs() < 1e-2),
        "the other blocks stay numbers"
    );
}

/// Regression: the TCP ring's header carried the padded wire length, so ranks whose buffers differed
/// inside one block of 64 values agreed and reduced padding against data. It carries the f32 length
/// now; the in-process group compared it already.
#[test]
fn quantized_calls_of_different_lengths_inside_one_block_fail_naming_the_length() {
    for tcp in [true, false] {
        let errors: Vec<String> = crate::common::on_threads(crate::common::boxed_group(2, tcp), |mut c| {
            let mut b = vec![1.0f32; if c.rank() == 0 { 64 } else { 63 }];
            c.all_reduce_quantized(&mut b, ReduceOp::Mean, Codec::Int8)
        })
        .into_iter()
        .map(|r| r.expect_err("different lengths must fail").to_string())
        .collect();
        assert!(errors.iter().any(|e| e.contains("length")), "tcp {tcp}: {errors:?}");
    }
}
