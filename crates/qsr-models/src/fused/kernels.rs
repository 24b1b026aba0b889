//! The fused ops' arithmetic on contiguous row-major `f32` buffers, one rayon task per fixed block of
//! rows. Every sum over rows adds per-block partials in block order, so results do not depend on the
//! thread count.

use rayon::prelude::*;

/// Rows one rayon task takes. Fixed, never derived from the thread count (see the module docs).
const ROWS_PER_TASK: usize = 32;

/// `e^x` as Cephes' `expf` computes it (range reduction by `ln 2`, a degree-7 polynomial; within 2 ulp
/// of the exact value), written without calls or branches so that the loops calling it vectorise where
/// libm's `expf` is one call per element. Inputs below -87.3 give about 1e-38 rather than 0.
#[inline(always)]
fn exp(x: f32) -> f32 {
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer without a rounding instruction.
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.3);
    // n = round(x / ln 2), also held as an integer in the low mantissa bits of `shifted`.
    let shifted = x * core::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // 2^n from n's bits: integer ops only (a float-to-int cast would keep the loop from vectorising).
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    e * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

/// The standard normal cdf `0.5 (1 + erf(x / sqrt 2))` from Abramowitz and Stegun's erfc 7.1.26 (a
/// degree-5 polynomial in `1 / (1 + p z)` times `e^-z^2`; within 5e-7 evaluated in f32) and [`exp`]: no calls or
/// branches, so the GELU loop vectorises where libm's `erff` is one call per element. The tail below 0
/// is computed directly, not as `1 - ..`, so small cdfs keep a relative accuracy (5e-4 down to -4).
#[inline(always)]
fn normal_cdf(x: f32) -> f32 {
    let z = x.abs() * core::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * z);
    let p = 1.061_405_4;
    let p = p * t - 1.453_152_1;
    let p = p * t + 1.421_413_7;
    let p = p * t - 0.284_496_74;
    let p = p * t + 0.254_829_6;
    // P(N > |x|) = erfc(z) / 2.
    let tail = 0.5 * p * t * exp(-z * z);
    if x < 0.0 { tail } else { 1.0 - tail }
}

/// Runs `f` compiled for the widest vector instructions this CPU has (AVX-512, or AVX2 with FMA,
/// chosen at run time by pulp), so that the loops inlined into it vectorise for them: the crate itself
/// is compiled for baseline x86-64, four lanes wide. Every path gives the same bits: Rust never fuses
/// a multiply and an add on its own, and the reductions here fix their own lanes.
#[inline(always)]
pub(crate) fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    struct Op<F>(F);
    impl<R, F: FnOnce() -> R> pulp::WithSimd for Op<F> {
        type Output = R;
        #[inline(always)]
        fn with_simd<S: pulp::Simd>(self, _: S) -> R {
            (self.0)()
        }
    }
    pulp::Arch::new().dispatch(Op(f))
}

/// Lanes of the partial sums below: enough for the compiler to keep them in vector registers.
const LANES: usize = 8;

/// The sum of `xs` in [`LANES`] interleaved partial sums (which vectorises; one running sum does not).
#[inline(always)]
fn sum(xs: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The largest of `xs` (`-inf` for none), in [`LANES`] interleaved partial maxima.
#[inline(always)]
fn max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = a.max(x);
        }
    }
    acc.iter().fold(tail, |m, &x| m.max(x))
}

/// Row `r` of block `b`, counted from the tensor's first row.
fn row_index(b: usize, r: usize) -> usize {
    b * ROWS_PER_TASK + r
}

// Each kernel splits its buffers into blocks for rayon and hands each block to a named function: kept out
// of line (`inline(never)`), so that a profile names the op instead of a rayon closure.

/// `softmax(scale * scores)` over the last axis of `[.., t, t]` scores where query `q` sees keys `0..=q`
/// only (the rest get probability 0).
pub(crate) fn causal_softmax(scores: &[f32], t: usize, scale: f32) -> Vec<f32> {
    let mut out = vec![0.0; scores.len()];
    let block = ROWS_PER_TASK * t;
    out.par_chunks_mut(block)
        .zip(scores.par_chunks(block))
        .enumerate()
        .for_each(|(b, (out, scores))| causal_softmax_block(b, out, scores, t, scale));
    out
}

#[inline(never)]
fn causal_softmax_block(b: usize, out: &mut [f32], scores: &[f32], t: usize, scale: f32) {
    vectorized(
        #[inline(always)]
        || {
            for (r, (y, x)) in out.chunks_mut(t).zip(scores.chunks(t)).enumerate() {
                let seen = row_index(b, r) % t + 1;
                let (y, x) = (&mut y[..seen], &x[..seen]);
                y.iter_mut().zip(x).for_each(|(y, &x)| *y = x * scale);
                let top = max(y);
                y.iter_mut().for_each(|y| *y = exp(*y - top));
                let inv = 1.0 / sum(y);
                y.iter_mut().for_each(|y| *y *= inv);
            }
        },
    )
}

/// The scores' gradient of [`causal_softmax`] from its output `y` and the output's gradient `g`:
/// `scale * y * (g - sum(g * y))` per row.
pub(crate) fn causal_softmax_backward(y: &[f32], g: &[f32], t: usize, scale: f32) -> Vec<f32> {
    let mut dx = vec![0.0; y.len()];
    let block = ROWS_PER_TASK * t;
    dx.par_chunks_mut(block)
        .zip(y.par_chunks(block).zip(g.par_chunks(block)))
        .enumerate()
        .for_each(|(b, (dx, (y, g)))| causal_softmax_backward_block(b, dx, y, g, t, scale));
    dx
}

#[inline(never)]
fn causal_softmax_backward_block(b: usize, dx: &mut [f32], y: &[f32], g: &[f32], t: usize, scale: f32) {
    vectorized(
        #[inline(always)]
        || {
            for (r, ((dx, y), g)) in dx.chunks_mut(t).zip(y.chunks(t)).zip(g.chunks(t)).enumerate() {
                let seen = row_index(b, r) % t + 1;
                let (dx, y, g) = (&mut dx[..seen], &y[..seen], &g[..seen]);
                dx.iter_mut().zip(y).zip(g).for_each(|((dx, &y), &g)| *dx = y * g);
                let dot = sum(dx);
                for ((dx, &y), &g) in dx.iter_mut().zip(y).zip(g) {
                    *dx = scale * y * (g - dot);
                }
            }
        },
    )
}

/// Layer norm over rows of `n`: `(x - mean) / sqrt(var + epsilon) * gamma + beta` with the biased
/// variance. Returns the output and each row's `[mean, 1 / sqrt(var + epsilon)]`.
pub(crate) fn layer_norm(x: &[f32], gamma: &[f32], beta: &[f32], epsilon: f32) -> (Vec<f32>, Vec<f32>) {
    let n = gamma.len();
    let mut out = vec![0.0; x.len()];
    let mut stats = vec![0.0; 2 * (x.len() / n)];
    let block = ROWS_PER_TASK * n;
    out.par_chunks_mut(block)
        .zip(x.par_chunks(block))
        .zip(stats.par_chunks_mut(2 * ROWS_PER_TASK))
        .for_each(|((out, x), stats)| layer_norm_block(out, stats, x, (gamma, beta), epsilon));
    (out, stats)
}

#[inline(never)]
fn layer_norm_block(out: &mut [f32], stats: &mut [f32], x: &[f32], (gamma, beta): (&[f32], &[f32]), epsilon: f32) {
    vectorized(
        #[inline(always)]
        || {
            let n = gamma.len();
            for ((y, x), s) in out.chunks_mut(n).zip(x.chunks(n)).zip(stats.chunks_mut(2)) {
                let mean = sum(x) / n as f32;
                y.iter_mut().zip(x).for_each(|(y, &x)| *y = (x - mean) * (x - mean));
                let rstd = 1.0 / (sum(y) / n as f32 + epsilon).sqrt();
                for (((y, &x), &g), &b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
                    *y = (x - mean) * rstd * g + b;
                }
                s.copy_from_slice(&[mean, rstd]);
            }
        },
    )
}

/// Gradients of [`layer_norm`]: `(dx, dgamma, dbeta)` from the input, gamma, the row statistics it
/// returned and the output's gradient `g`.
pub(crate) fn layer_norm_backward(
    x: &[f32],
    gamma: &[f32],
    stats: &[f32],
    g: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let n = gamma.len();
    let mut dx = vec![0.0; x.len()];
    let block = ROWS_PER_TASK * n;
    // Per block: the partial sums of g * x_hat and of g over its rows, added in block order below.
    let partials: Vec<(Vec<f32>, Vec<f32>)> = dx
        .par_chunks_mut(block)
        .zip(x.par_chunks(block).zip(g.par_chunks(block)))
        .zip(stats.par_chunks(2 * ROWS_PER_TASK))
        .map(|((dx, (x, g)), stats)| layer_norm_backward_block(dx, x, g, gamma, stats))
        .collect();
    let (mut dgamma, mut dbeta) = (vec![0.0; n], vec![0.0; n]);
    for (pg, pb) in &partials {
        dgamma.iter_mut().zip(pg).for_each(|(a, b)| *a += b);
        dbeta.iter_mut().zip(pb).for_each(|(a, b)| *a += b);
    }
    (dx, dgamma, dbeta)
}

/// One block's `dx`, and its partial `dgamma` and `dbeta`.
#[inline(never)]
fn layer_norm_backward_block(
    dx: &mut [f32],
    x: &[f32],
    g: &[f32],
    gamma: &[f32],
    stats: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    vectorized(
        #[inline(always)]
        || {
            let n = gamma.len();
            let (mut dgamma, mut dbeta) = (vec![0.0; n], vec![0.0; n]);
            let (mut x_hat, mut dx_hat) = (vec![0.0; n], vec![0.0; n]);
            for (((dx, x), g), s) in dx.chunks_mut(n).zip(x.chunks(n)).zip(g.chunks(n)).zip(stats.chunks(2)) {
                let (mean, rstd) = (s[0], s[1]);
                for j in 0..n {
                    x_hat[j] = (x[j] - mean) * rstd;
                    dx_hat[j] = g[j] * gamma[j];
                    dgamma[j] += g[j] * x_hat[j];
                    dbeta[j] += g[j];
                    dx[j] = dx_hat[j] * x_hat[j];
                }
                let (mean_dx_hat, mean_dot) = (sum(&dx_hat) / n as f32, sum(dx) / n as f32);
                for j in 0..n {
                    dx[j] = rstd * (dx_hat[j] - mean_dx_hat - x_hat[j] * mean_dot);
                }
            }
            (dgamma, dbeta)
        },
    )
}

/// Mean cross-entropy of rows of `v` logits against `targets` (each `< v`), with label smoothing
/// `smoothing` (the target distribution `(1 - smoothing) one_hot + smoothing / v`). Returns the loss
/// and each row's log-sum-exp.
pub(crate) fn cross_entropy(logits: &[f32], targets: &[usize], v: usize, smoothing: f32) -> (f32, Vec<f32>) {
    let rows = targets.len();
    let mut lse = vec![0.0; rows];
    let partials: Vec<f32> = lse
        .par_chunks_mut(ROWS_PER_TASK)
        .zip(logits.par_chunks(ROWS_PER_TASK * v).zip(targets.par_chunks(ROWS_PER_TASK)))
        .map(|(lse, (x, t))| cross_entropy_block(lse, x, t, smoothing))
        .collect();
    (partials.iter().sum::<f32>() / rows as f32, lse)
}

/// One block's log-sum-exps and the sum of its rows' losses.
#[inline(never)]
fn cross_entropy_block(lse: &mut [f32], logits: &[f32], targets: &[usize], smoothing: f32) -> f32 {
    vectorized(
        #[inline(always)]
        || {
            let v = logits.len() / targets.len();
            let mut exps = vec![0.0; v];
            let mut loss = 0.0f32;
            for ((lse, x), &t) in lse.iter_mut().zip(logits.chunks(v)).zip(targets) {
                let top = max(x);
                exps.iter_mut().zip(x).for_each(|(e, &x)| *e = exp(x - top));
                *lse = top + sum(&exps).ln();
                let mean = sum(x) / v as f32;
                loss += *lse - (1.0 - smoothing) * x[t] - smoothing * mean;
            }
            loss
        },
    )
}

/// The logits' gradient of [`cross_entropy`] for the loss's gradient `g`:
/// `g / rows * (softmax(x) - target distribution)`.
pub(crate) fn cross_entropy_backward(
    logits: &[f32],
    targets: &[usize],
    lse: &[f32],
    v: usize,
    smoothing: f32,
    g: f32,
) -> Vec<f32> {
    let mut dx = vec![0.0; logits.len()];
    let g = g / targets.len() as f32;
    let block = ROWS_PER_TASK * v;
    dx.par_chunks_mut(block)
        .zip(logits.par_chunks(block))
        .zip(targets.par_chunks(ROWS_PER_TASK).zip(lse.par_chunks(ROWS_PER_TASK)))
        .for_each(|((dx, x), (t, lse))| cross_entropy_backward_block(dx, x, t, lse, smoothing, g));
    dx
}

/// One block of [`cross_entropy_backward`], `g` already divided by the rows.
#[inline(never)]
fn cross_entropy_backward_block(dx: &mut [f32], x: &[f32], targets: &[usize], lse: &[f32], smoothing: f32, g: f32) {
    vectorized(
        #[inline(always)]
        || {
            let v = x.len() / targets.len();
            let floor = smoothing / v as f32;
            for (((dx, x), &t), &lse) in dx.chunks_mut(v).zip(x.chunks(v)).zip(targets).zip(lse) {
                for (dx, &x) in dx.iter_mut().zip(x) {
                    *dx = g * (exp(x - lse) - floor);
                }
                dx[t] -= g * (1.0 - smoothing);
            }
        },
    )
}

/// Elements one rayon task takes in the elementwise kernels.
const ELEMS_PER_TASK: usize = 16 * 1024;

/// GELU with the exact (erf) form, `x * cdf(x)`: returns the output and the normal cdf of each input,
/// which the backward reuses instead of evaluating erf again.
pub(crate) fn gelu(x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![0.0; x.len()];
    let mut cdf = vec![0.0; x.len()];
    out.par_chunks_mut(ELEMS_PER_TASK)
        .zip(cdf.par_chunks_mut(ELEMS_PER_TASK))
        .zip(x.par_chunks(ELEMS_PER_TASK))
        .for_each(|((out, cdf), x)| gelu_block(out, cdf, x));
    (out, cdf)
}

#[inline(never)]
fn gelu_block(out: &mut [f32], cdf: &mut [f32], x: &[f32]) {
    vectorized(
        #[inline(always)]
        || {
            for ((y, c), &x) in out.iter_mut().zip(cdf.iter_mut()).zip(x) {
                *c = normal_cdf(x);
                *y = x * *c;
            }
        },
    )
}

/// The input's gradient of [`gelu`]: `g * (cdf(x) + x * pdf(x))`.
pub(crate) fn gelu_backward(x: &[f32], cdf: &[f32], g: &[f32]) -> Vec<f32> {
    let mut dx = vec![0.0; x.len()];
    let chunks = x.par_chunks(ELEMS_PER_TASK).zip(cdf.par_chunks(ELEMS_PER_TASK)).zip(g.par_chunks(ELEMS_PER_TASK));
    dx.par_chunks_mut(ELEMS_PER_TASK).zip(chunks).for_each(|(dx, ((x, cdf), g))| gelu_backward_block(dx, x, cdf, g));
    dx
}

#[inline(never)]
fn gelu_backward_block(dx: &mut [f32], x: &[f32], cdf: &[f32], g: &[f32]) {
    vectorized(
        #[inline(always)]
        || {
            let inv_sqrt_2pi = 1.0 / (2.0 * core::f32::consts::PI).sqrt();
            for (((dx, &x), &c), &g) in dx.iter_mut().zip(x).zip(cdf).zip(g) {
                *dx = g * (c + x * inv_sqrt_2pi * exp(-0.5 * x * x));
            }
        },
    )
}

/// The shape of attention's head layout: `[batch, time, heads, head width]`.
pub(crate) type Heads = [usize; 4];

/// Splits rows `[b, t, parts * h * d]` into `parts` buffers `[b, h, t, d]` (attention's q, k, v from
/// the fused projection, or one gradient), one rayon task per (batch, head).
pub(crate) fn split_heads(x: &[f32], [b, t, h, d]: Heads, parts: usize) -> Vec<Vec<f32>> {
    let mut out = vec![vec![0.0; b * h * t * d]; parts];
    for (part, buf) in out.iter_mut().enumerate() {
        buf.par_chunks_mut(t * d)
            .enumerate()
            .for_each(|(bh, dst)| split_head_block(dst, x, [b, t, h, d], parts, (part, bh)));
    }
    out
}

#[inline(never)]
fn split_head_block(dst: &mut [f32], x: &[f32], [_, t, h, d]: Heads, parts: usize, (part, bh): (usize, usize)) {
    vectorized(
        #[inline(always)]
        || {
            let (batch, head) = (bh / h, bh % h);
            let row = parts * h * d;
            for (ti, dst) in dst.chunks_mut(d).enumerate() {
                let start = (batch * t + ti) * row + part * h * d + head * d;
                dst.copy_from_slice(&x[start..start + d]);
            }
        },
    )
}

/// The inverse of [`split_heads`]: `parts` buffers `[b, h, t, d]` into rows `[b, t, parts * h * d]`,
/// one rayon task per block of rows.
pub(crate) fn merge_heads(parts: &[&[f32]], [b, t, h, d]: Heads) -> Vec<f32> {
    let row = parts.len() * h * d;
    let mut out = vec![0.0; b * t * row];
    out.par_chunks_mut(ROWS_PER_TASK * row)
        .enumerate()
        .for_each(|(block, out)| merge_head_block(out, parts, [b, t, h, d], block * ROWS_PER_TASK));
    out
}

#[inline(never)]
fn merge_head_block(out: &mut [f32], parts: &[&[f32]], [_, t, h, d]: Heads, first_row: usize) {
    vectorized(
        #[inline(always)]
        || {
            let row = parts.len() * h * d;
            for (r, out) in out.chunks_mut(row).enumerate() {
                let (batch, ti) = ((first_row + r) / t, (first_row + r) % t);
                for (part, src) in parts.iter().enumerate() {
                    for head in 0..h {
                        let from = ((batch * h + head) * t + ti) * d;
                        let to = part * h * d + head * d;
                        out[to..to + d].copy_from_slice(&src[from..from + d]);
                    }
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_is_within_two_ulp_of_libm_over_the_range_the_kernels_use() {
        let mut worst = 0.0f32;
        for i in 0..=200_000 {
            let x = -87.0 + 175.0 * i as f32 / 200_000.0;
            let (ours, exact) = (super::exp(x), (x as f64).exp() as f32);
            worst = worst.max((ours - exact).abs() / (exact * f32::EPSILON));
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert!(super::exp(f32::NEG_INFINITY) < 1e-37);
    }

    #[test]
    fn normal_cdf_is_within_5e7_of_libms_erfc_and_keeps_small_tails_relative() {
        let mut worst = 0.0f64;
        for i in 0..=400_000 {
            let x = -12.0 + 24.0 * i as f64 / 400_000.0;
            let exact = 0.5 * libm::erfc(-x / std::f64::consts::SQRT_2);
            let ours = super::normal_cdf(x as f32) as f64;
            worst = worst.max((ours - exact).abs());
            if x >= -4.0 {
                assert!((ours - exact).abs() <= 5e-4 * exact, "cdf({x}) = {ours}, exact {exact}");
            }
        }
        assert!(worst <= 5e-7, "worst absolute error {worst}");
        assert_eq!(super::normal_cdf(f32::INFINITY), 1.0);
        assert_eq!(super::normal_cdf(f32::NEG_INFINITY), 0.0);
    }
}
