//! Shared helpers for the integration tests (deterministic data without an RNG dependency).
#![allow(dead_code)]

use burn::tensor::{Device, Int, Tensor, TensorData};

/// SplitMix64-style generator: deterministic test data, independent of burn's global RNG.
pub(crate) struct Lcg(pub u64);

impl Lcg {
    pub(crate) fn next_f32(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0 // [-1, 1)
    }
}

/// Images `[n, c, h, w]` with values in [-1, 1).
pub(crate) fn images(n: usize, c: usize, h: usize, w: usize, seed: u64, device: &Device) -> Tensor<4> {
    let mut g = Lcg(seed);
    let v: Vec<f32> = (0..n * c * h * w).map(|_| g.next_f32()).collect();
    Tensor::from_data(TensorData::new(v, [n, c, h, w]), device)
}

/// A learnable batch: `n` images, labels `i % classes`, each image = its class prototype + noise.
pub(crate) fn class_batch(
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    classes: usize,
    seed: u64,
    device: &Device,
) -> (Tensor<4>, Tensor<1, Int>) {
    let mut g = Lcg(seed);
    let size = c * h * w;
    let protos: Vec<Vec<f32>> = (0..classes).map(|_| (0..size).map(|_| g.next_f32()).collect()).collect();
    let mut v = Vec::with_capacity(n * size);
    let mut labels = Vec::with_capacity(n);
    for i in 0..n {
        let k = i % classes;
        labels.push(k as i64);
        v.extend(protos[k].iter().map(|p| p + 0.5 * g.next_f32()));
    }
    (
        Tensor::from_data(TensorData::new(v, [n, c, h, w]), device),
        Tensor::from_data(TensorData::new(labels, [n]), device),
    )
}

pub(crate) fn all_finite(t: Tensor<2>) -> bool {
    t.into_data().try_to_vec::<f32>().map(|v| v.iter().all(|x| x.is_finite())).unwrap_or(false)
}
