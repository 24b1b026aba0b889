//! Averages K = 4 flat buffers (seeded random values, 4 Mi elements each) in place with the host fused kernel
//! [`qsr_kernels::average_and_broadcast`], checks every buffer bit for bit against a naive mean summed in rank
//! order, then times a few more passes and prints the bandwidth (bytes read + written; informational only, it
//! depends on the machine and its load).
//!
//! ```sh
//! cargo run --release -p qsr-kernels --example fused_average
//! ```

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const K: usize = 4;
const LEN: usize = 4 << 20;
const TIMED_PASSES: usize = 5;

fn main() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut buffers: Vec<Vec<f32>> =
        (0..K).map(|_| (0..LEN).map(|_| rng.random_range(-1.0f32..1.0)).collect()).collect();

    // The naive mean: element i is ((b_0[i] + b_1[i]) + ...) / K in f32, the order the kernel guarantees.
    let naive: Vec<f32> = (0..LEN)
        .map(|i| {
            let mut s = buffers[0][i];
            for b in &buffers[1..] {
                s += b[i];
            }
            s / K as f32
        })
        .collect();

    let mut views: Vec<&mut [f32]> = buffers.iter_mut().map(|b| b.as_mut_slice()).collect();
    qsr_kernels::average_and_broadcast(&mut views);
    for (k, b) in buffers.iter().enumerate() {
        let mismatches = b.iter().zip(&naive).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        assert_eq!(mismatches, 0, "buffer {k}: {mismatches} elements differ from the naive mean");
    }
    println!("K = {K} buffers x {LEN} f32: all {K} equal the naive mean bit for bit");

    let t0 = Instant::now();
    for _ in 0..TIMED_PASSES {
        let mut views: Vec<&mut [f32]> = buffers.iter_mut().map(|b| b.as_mut_slice()).collect();
        qsr_kernels::average_and_broadcast(&mut views);
    }
    let secs = t0.elapsed().as_secs_f64() / TIMED_PASSES as f64;
    let bytes = 2.0 * (K * LEN * std::mem::size_of::<f32>()) as f64;
    println!(
        "fused average_and_broadcast: {:.2} ms per pass, {:.1} GB/s read + write ({} rayon threads; informational)",
        secs * 1e3,
        bytes / secs / 1e9,
        rayon::current_num_threads()
    );
}
