//! Batch normalization over `[n, c, spatial...]` in place of its layout: per-channel statistics read
//! each image's channel plane where it lies, with no transposed copy (burn's default transposes the
//! input to `[c, n * spatial]` for the statistics, forward and backward).
//!
//! Sums are per channel, in a fixed order: each plane in 16 f32 lanes (so they vectorize), the planes'
//! sums in f64. The same bits at any thread count.

use rayon::prelude::*;

use super::kernels::vectorized;

/// `n` images of `c` channels of `plane` values each, `[n, c, plane]` row-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BnShape {
    pub(crate) n: usize,
    pub(crate) c: usize,
    pub(crate) plane: usize,
}

impl BnShape {
    /// Channel `ch`'s planes, one per image.
    fn planes<'a>(&self, x: &'a [f32], ch: usize) -> impl Iterator<Item = &'a [f32]> {
        let (c, plane) = (self.c, self.plane);
        (0..self.n).map(move |i| &x[(i * c + ch) * plane..][..plane])
    }

    /// Planes per rayon task of the elementwise passes: about 16K values each.
    fn planes_per_task(&self) -> usize {
        (16_384 / self.plane.max(1)).max(1)
    }

    /// Values per rayon task of the elementwise passes (at least 1, for empty planes).
    fn task_len(&self) -> usize {
        (self.planes_per_task() * self.plane).max(1)
    }

    fn count(&self) -> f64 {
        (self.n * self.plane) as f64
    }
}

/// `sum(f(a[i], b[i]))` over one plane in 16 f32 lanes, in a fixed order; the lanes added in f64.
/// Callers run it inside [`vectorized`], once per channel.
#[inline(always)]
fn lane_sum(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f64 {
    const LANES: usize = 16;
    let mut acc = [0.0f32; LANES];
    let (whole, rest) = (a.len() / LANES * LANES, a.len() % LANES);
    for (ca, cb) in a[..whole].chunks_exact(LANES).zip(b[..whole].chunks_exact(LANES)) {
        for i in 0..LANES {
            acc[i] += f(ca[i], cb[i]);
        }
    }
    for i in 0..rest {
        acc[i] += f(a[whole + i], b[whole + i]);
    }
    acc.iter().map(|&v| f64::from(v)).sum()
}

/// Per channel: the mean, then the biased variance (two passes, as burn's), `[mean.., variance..]`.
pub(crate) fn stats(x: &[f32], s: BnShape) -> Vec<f32> {
    let per_channel: Vec<(f32, f32)> = (0..s.c)
        .into_par_iter()
        .map(|ch| {
            vectorized(
                #[inline(always)]
                || {
                    let sum: f64 = s.planes(x, ch).map(|p| lane_sum(p, p, |v, _| v)).sum();
                    let mean = (sum / s.count()) as f32;
                    let squares: f64 = s.planes(x, ch).map(|p| lane_sum(p, p, |v, _| (v - mean) * (v - mean))).sum();
                    (mean, (squares / s.count()) as f32)
                },
            )
        })
        .collect();
    per_channel.iter().map(|p| p.0).chain(per_channel.iter().map(|p| p.1)).collect()
}

/// Each channel's `1 / sqrt(variance + epsilon)`.
fn inv_std(stats: &[f32], c: usize, epsilon: f32) -> Vec<f32> {
    stats[c..].iter().map(|&v| 1.0 / (v + epsilon).sqrt()).collect()
}

/// `(x - mean) / sqrt(variance + epsilon) * gamma + beta`, per channel.
pub(crate) fn apply(x: &[f32], gamma: &[f32], beta: &[f32], stats: &[f32], epsilon: f32, s: BnShape) -> Vec<f32> {
    let inv = inv_std(stats, s.c, epsilon);
    let mut out = vec![0.0; x.len()];
    let (per, block) = (s.planes_per_task(), s.task_len());
    out.par_chunks_mut(block).zip(x.par_chunks(block)).enumerate().for_each(|(task, (o, x))| {
        vectorized(
            #[inline(always)]
            || {
                for (i, (o, x)) in o.chunks_mut(s.plane).zip(x.chunks(s.plane)).enumerate() {
                    let ch = (task * per + i) % s.c;
                    let (scale, mean) = (inv[ch] * gamma[ch], stats[ch]);
                    o.iter_mut().zip(x).for_each(|(o, &x)| *o = (x - mean) * scale + beta[ch]);
                }
            },
        )
    });
    out
}

/// Gradients of the input, gamma and beta from the output's gradient `g`, the statistics being the
/// batch's own (so the input's gradient includes their dependence on it).
pub(crate) fn backward(
    x: &[f32],
    gamma: &[f32],
    stats: &[f32],
    epsilon: f32,
    g: &[f32],
    s: BnShape,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let inv = inv_std(stats, s.c, epsilon);
    // Per channel: sum of g (beta's gradient) and of g * x_hat (gamma's).
    let sums: Vec<(f32, f32)> = (0..s.c)
        .into_par_iter()
        .map(|ch| {
            vectorized(
                #[inline(always)]
                || {
                    let (mean, inv) = (stats[ch], inv[ch]);
                    let (mut sum_g, mut sum_gx) = (0.0f64, 0.0f64);
                    for (gp, xp) in s.planes(g, ch).zip(s.planes(x, ch)) {
                        sum_g += lane_sum(gp, gp, |g, _| g);
                        sum_gx += lane_sum(gp, xp, |g, x| g * ((x - mean) * inv));
                    }
                    (sum_g as f32, sum_gx as f32)
                },
            )
        })
        .collect();
    let count = s.count() as f32;
    let mut dx = vec![0.0; x.len()];
    let (per, block) = (s.planes_per_task(), s.task_len());
    let blocks = dx.par_chunks_mut(block).zip(x.par_chunks(block).zip(g.par_chunks(block)));
    blocks.enumerate().for_each(|(task, (d, (x, g)))| {
        vectorized(
            #[inline(always)]
            || {
                for (i, (d, (x, g))) in d.chunks_mut(s.plane).zip(x.chunks(s.plane).zip(g.chunks(s.plane))).enumerate()
                {
                    let ch = (task * per + i) % s.c;
                    let (mean, inv) = (stats[ch], inv[ch]);
                    let (mean_g, mean_gx, scale) = (sums[ch].0 / count, sums[ch].1 / count, gamma[ch] * inv);
                    for ((d, &x), &g) in d.iter_mut().zip(x).zip(g) {
                        *d = scale * (g - mean_g - (x - mean) * inv * mean_gx);
                    }
                }
            },
        )
    });
    let dgamma = sums.iter().map(|p| p.1).collect();
    let dbeta = sums.iter().map(|p| p.0).collect();
    (dx, dgamma, dbeta)
}
