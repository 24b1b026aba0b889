//! The fused host averaging equals a naive f64 mean, is bit-identical across buffers, and is
//! deterministic regardless of thread count.

use qsr_kernels::{CHUNK, average_and_broadcast, mean_into, sum_into};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn random_buffers(k: usize, len: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..k).map(|_| (0..len).map(|_| rng.random_range(-3.0f32..3.0)).collect()).collect()
}

fn f64_mean(bufs: &[Vec<f32>], i: usize) -> f64 {
    bufs.iter().map(|b| f64::from(b[i])).sum::<f64>() / bufs.len() as f64
}

const LENGTHS: [usize; 7] = [0, 1, 7, 1023, 1025, CHUNK + 3, 3 * CHUNK + 1_001];

#[test]
fn average_and_broadcast_matches_f64_mean_for_k_1_to_8() {
    for k in 1..=8 {
        for &len in &LENGTHS {
            let original = random_buffers(k, len, (k * 1_000 + len) as u64);
            let mut bufs = original.clone();
            let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            average_and_broadcast(&mut views);
            for i in 0..len {
                let want = f64_mean(&original, i);
                let got = f64::from(bufs[0][i]);
                assert!((got - want).abs() <= 1e-6 * (1.0 + want.abs()), "k {k} len {len} i {i}: {got} vs {want}");
                for b in &bufs[1..] {
                    assert_eq!(b[i].to_bits(), bufs[0][i].to_bits(), "k {k} len {len} i {i}: not bit-identical");
                }
            }
        }
    }
}

#[test]
fn mean_into_and_sum_into_match_f64() {
    for k in 1..=8 {
        for &len in &LENGTHS {
            let inputs = random_buffers(k, len, (k * 7 + len) as u64);
            let views: Vec<&[f32]> = inputs.iter().map(|b| b.as_slice()).collect();
            let mut mean = vec![f32::NAN; len];
            let mut sum = vec![f32::NAN; len];
            mean_into(&mut mean, &views);
            sum_into(&mut sum, &views);
            for i in 0..len {
                let want = f64_mean(&inputs, i);
                assert!((f64::from(mean[i]) - want).abs() <= 1e-6 * (1.0 + want.abs()), "k {k} len {len} i {i}");
                let want_sum = want * k as f64;
                assert!((f64::from(sum[i]) - want_sum).abs() <= 1e-5 * (1.0 + want_sum.abs()), "k {k} len {len} i {i}");
            }
        }
    }
}

#[test]
fn the_result_does_not_depend_on_the_thread_count() {
    let original = random_buffers(5, 4 * CHUNK + 17, 42);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let mut bufs = original.clone();
        pool.install(|| {
            let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            average_and_broadcast(&mut views);
        });
        bufs.swap_remove(0)
    };
    let one = run(1);
    let three = run(3);
    assert!(one.iter().zip(&three).all(|(a, b)| a.to_bits() == b.to_bits()));
    // Equal to mean_into, too: the same summation order.
    let views: Vec<&[f32]> = original.iter().map(|b| b.as_slice()).collect();
    let mut mean = vec![0.0; one.len()];
    mean_into(&mut mean, &views);
    assert!(one.iter().zip(&mean).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
#[should_panic(expected = "buffer 1 has 3 elements")]
fn mismatched_lengths_are_a_loud_programming_error() {
    let mut a = vec![0.0f32; 4];
    let mut b = vec![0.0f32; 3];
    average_and_broadcast(&mut [a.as_mut_slice(), b.as_mut_slice()]);
}
