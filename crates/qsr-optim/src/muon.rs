//! Muon's step on one weight matrix, as `torch.optim.Muon` (single-tensor path) computes it:
//! Nesterov momentum by `lerp`, the Newton-Schulz orthogonalization in bfloat16, the lr adjusted to the
//! matrix's shape, decoupled weight decay. The optimizer around it ([`crate::Optimizer`]) runs AdamW on
//! every other parameter.
//!
//! Rounding: the element-wise steps round as ATen's CPU kernels do (`lerp` as two branches of an fma,
//! `add_` with `alpha` as an fma); the matrix products accumulate in f32 and round to bf16 once per
//! product, as oneDNN's bf16 GEMM does, but in another order than its blocked kernels, so an entry can
//! land one bf16 step away from torch's (see the fixture test's tolerance).

use std::ops::Range;

use half::bf16;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// How Muon scales the lr of a matrix of `fan_out x fan_in` (torch's `adjust_lr_fn`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdjustLr {
    /// Keller Jordan's `sqrt(max(1, fan_out / fan_in))` (torch's default).
    #[default]
    Original,
    /// Moonshot's `0.2 * sqrt(max(fan_out, fan_in))`, which matches AdamW's update RMS, so Muon reuses
    /// AdamW's lr and weight decay.
    MatchRmsAdamw,
    /// Bernstein's `sqrt(fan_out / fan_in)`, unclamped.
    SpectralUnclamped,
}

impl AdjustLr {
    /// The lr a matrix of `fan_out x fan_in` steps with, from the schedule's `lr`.
    pub fn adjust(self, lr: f64, fan_out: usize, fan_in: usize) -> f64 {
        let (a, b) = (fan_out as f64, fan_in as f64);
        lr * match self {
            AdjustLr::Original => (a / b).max(1.0).sqrt(),
            AdjustLr::MatchRmsAdamw => 0.2 * a.max(b).sqrt(),
            AdjustLr::SpectralUnclamped => (a / b).sqrt(),
        }
    }
}

/// A matrix Muon updates: its elements in the flat buffer, row-major as stored (`rows x cols`), and
/// its shape as torch names a Linear weight's (`fan_out x fan_in`), which the lr adjustment reads.
/// burn stores a Linear weight as `[d_input, d_output]`: `rows = fan_in`, `cols = fan_out`.
#[derive(Debug, Clone, PartialEq)]
pub struct MuonMatrix {
    /// The matrix's elements in the flat parameter buffer.
    pub range: Range<usize>,
    /// Rows as stored.
    pub rows: usize,
    /// Columns as stored.
    pub cols: usize,
    /// Output features (torch's `A`).
    pub fan_out: usize,
    /// Input features (torch's `B`).
    pub fan_in: usize,
}

/// Muon's settings for one step, resolved from [`crate::OptimizerConfig`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct MuonStep {
    pub(crate) lr: f64,
    pub(crate) weight_decay: f64,
    pub(crate) momentum: f64,
    pub(crate) nesterov: bool,
    pub(crate) ns: NewtonSchulz,
    pub(crate) adjust: AdjustLr,
}

/// The Newton-Schulz iteration's coefficients `(a, b, c)`, steps and the norm's floor `eps`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NewtonSchulz {
    pub(crate) coefficients: [f64; 3],
    pub(crate) steps: u32,
    pub(crate) eps: f64,
}

impl MuonStep {
    /// Updates `p` (the matrix's parameters) from its gradient `g` and momentum buffer `buf`.
    pub(crate) fn update(&self, m: &MuonMatrix, p: &mut [f32], g: &[f32], buf: &mut [f32]) {
        // buf.lerp_(grad, 1 - momentum); update = grad.lerp(buf, momentum) if nesterov else buf
        let w = (1.0 - self.momentum) as f32;
        buf.iter_mut().zip(g).for_each(|(b, &g)| *b = lerp(*b, g, w));
        let mut update: Vec<f32> = if self.nesterov {
            let mu = self.momentum as f32;
            g.iter().zip(buf.iter()).map(|(&g, &b)| lerp(g, b, mu)).collect()
        } else {
            buf.to_vec()
        };
        self.ns.orthogonalize(&mut update, m.rows, m.cols);
        // param.mul_(1 - lr * weight_decay); param.add_(update, alpha=-adjusted_lr)
        let decay = (1.0 - self.lr * self.weight_decay) as f32;
        let alpha = -self.adjust.adjust(self.lr, m.fan_out, m.fan_in) as f32;
        p.iter_mut().zip(&update).for_each(|(p, &u)| *p = u.mul_add(alpha, *p * decay));
    }
}

/// ATen's `lerp(self, end, weight)` on f32: `fma(w, end - self, self)` for `|w| < 0.5`, else
/// `fma(w - 1, end - self, end)`.
fn lerp(start: f32, end: f32, weight: f32) -> f32 {
    let diff = end - start;
    if weight.abs() < 0.5 { diff.mul_add(weight, start) } else { diff.mul_add(weight - 1.0, end) }
}

fn round(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

impl NewtonSchulz {
    /// `torch.optim._muon._zeropower_via_newtonschulz` of the `rows x cols` matrix `x`, in place: in
    /// bf16, on the orientation with fewer rows than columns, `x / max(|x|, eps)` then
    /// `X = a X + (b G + c G G) X` with `G = X X^T`, `steps` times.
    pub(crate) fn orthogonalize(&self, x: &mut [f32], rows: usize, cols: usize) {
        let wide = rows <= cols;
        let (r, c) = if wide { (rows, cols) } else { (cols, rows) };
        let mut m: Vec<f32> = if wide { x.to_vec() } else { transpose(x, rows, cols) };
        m.iter_mut().for_each(|v| *v = round(*v));
        // ortho_grad.div_(ortho_grad.norm().clamp(min=eps)): the norm accumulated in f32, rounded to bf16
        let norm = round(m.iter().fold(0.0f32, |s, &v| v.mul_add(v, s)).sqrt());
        let floor = round(self.eps as f32);
        let norm = if norm < floor { floor } else { norm };
        m.iter_mut().for_each(|v| *v = round(*v / norm));
        let [a, b, cc] = self.coefficients.map(|k| k as f32);
        for _ in 0..self.steps {
            let gram = product(&m, &transpose(&m, r, c), (r, c, r), |_, s| round(s));
            let update = product(&gram, &gram, (r, r, r), |i, s| round(b.mul_add(gram[i], cc * s)));
            m = product(&update, &m, (r, r, c), |i, s| round(a.mul_add(m[i], s)));
        }
        if wide {
            x.copy_from_slice(&m);
        } else {
            x.copy_from_slice(&transpose(&m, r, c));
        }
    }
}

/// `x` (`rows x cols`, row-major) transposed.
fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0; x.len()];
    for i in 0..rows {
        for j in 0..cols {
            t[j * rows + i] = x[i * cols + j];
        }
    }
    t
}

/// `finish(k, sum)` of each entry `k` of `a b` (`n x inner` by `inner x m`, row-major), the sums in f32.
fn product(
    a: &[f32],
    b: &[f32],
    (n, inner, m): (usize, usize, usize),
    finish: impl Fn(usize, f32) -> f32 + Sync,
) -> Vec<f32> {
    let mut out = vec![0.0f32; n * m];
    out.par_chunks_mut(m.max(1)).enumerate().for_each(|(i, row)| {
        row_product(&a[i * inner..(i + 1) * inner], b, row);
        row.iter_mut().enumerate().for_each(|(j, o)| *o = finish(i * m + j, *o));
    });
    out
}

/// `row += sum_k a[k] b[k, ..]`, each term one fused multiply-add, in order of `k`.
fn row_product(a: &[f32], b: &[f32], row: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_fma() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { row_product_fma(a, b, row) };
    }
    row_product_plain(a, b, row)
}

#[inline(always)]
fn row_product_plain(a: &[f32], b: &[f32], row: &mut [f32]) {
    let m = row.len();
    for (k, &aik) in a.iter().enumerate() {
        row.iter_mut().zip(&b[k * m..(k + 1) * m]).for_each(|(o, &bkj)| *o = aik.mul_add(bkj, *o));
    }
}

/// [`row_product_plain`] compiled with FMA instructions (otherwise each `mul_add` is a libm call).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn row_product_fma(a: &[f32], b: &[f32], row: &mut [f32]) {
    row_product_plain(a, b, row)
}

#[cfg(test)]
mod tests {
    use super::{AdjustLr, NewtonSchulz};

    fn ns() -> NewtonSchulz {
        NewtonSchulz { coefficients: [3.4445, -4.775, 2.0315], steps: 5, eps: 1e-7 }
    }

    /// Newton-Schulz leaves a matrix's singular values near 1 (between about 0.5 and 1.5 with these
    /// coefficients): its rows orthogonal, whichever way it is stored.
    #[test]
    fn newton_schulz_makes_the_rows_of_the_wide_orientation_nearly_orthonormal() {
        let (rows, cols) = (3, 5);
        let mut x: Vec<f32> = (0..rows * cols).map(|i| ((i * 7 % 11) as f32 - 5.0) / 3.0).collect();
        let mut tall = super::transpose(&x, rows, cols);
        ns().orthogonalize(&mut x, rows, cols);
        ns().orthogonalize(&mut tall, cols, rows);
        assert_eq!(super::transpose(&tall, cols, rows), x, "the stored orientation changes nothing");
        for i in 0..rows {
            for j in 0..rows {
                let dot: f32 = (0..cols).map(|k| x[i * cols + k] * x[j * cols + k]).sum();
                if i == j {
                    assert!((0.3..1.9).contains(&dot), "row {i}: squared norm {dot}");
                } else {
                    assert!(dot.abs() < 0.35, "rows {i}, {j}: {dot}");
                }
            }
        }
    }

    #[test]
    fn the_lr_adjustments_are_torchs() {
        assert_eq!(AdjustLr::Original.adjust(0.1, 4, 1), 0.2);
        assert_eq!(AdjustLr::Original.adjust(0.1, 1, 4), 0.1);
        assert!((AdjustLr::MatchRmsAdamw.adjust(1.0, 4, 100) - 2.0).abs() < 1e-12);
        assert_eq!(AdjustLr::SpectralUnclamped.adjust(1.0, 1, 4), 0.5);
    }
}
