//! 2-D convolution (groups 1, dilation 1, any stride and padding) on contiguous NCHW `f32` buffers, as
//! im2col and one gemm per block of images, with its backward; stride-1 convolutions over large enough
//! images and channels run as one product per kernel tap over shifted views of the padded image,
//! without a column matrix (`shifted`).
//!
//! burn's flex backend runs the backward as a transposed convolution and a convolution over permuted
//! copies; here both gradients come from the same column matrix. Blocks of images are the rayon tasks,
//! their size fixed by the shapes (never by the thread count), each gemm runs on one thread, and the
//! weight and bias gradients add per-group partials in group order: results do not depend on threads.

use std::borrow::Cow;

use rayon::prelude::*;

use super::gemm::{Threads, gemm};
use super::kernels::vectorized;

/// Columns (output positions over the block's images) a block aims for: enough for gemm to run wide.
const COLUMNS_PER_BLOCK: usize = 256;

/// Most partial weight gradients the backward keeps (one per group of blocks).
const MAX_GROUPS: usize = 16;

/// The geometry of one convolution: input `[n, cin, h, w]`, weight `[cout, cin, kh, kw]`, output
/// `[n, cout, ho, wo]`, padding `[top, left, bottom, right]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ConvShape {
    pub n: usize,
    pub cin: usize,
    pub h: usize,
    pub w: usize,
    pub cout: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 4],
}

impl ConvShape {
    /// Output height and width (at least one kernel position must fit: checked by the caller).
    pub(super) fn out_hw(&self) -> [usize; 2] {
        let [top, left, bottom, right] = self.padding;
        let ho = (self.h + top + bottom - self.kernel[0]) / self.stride[0] + 1;
        let wo = (self.w + left + right - self.kernel[1]) / self.stride[1] + 1;
        [ho, wo]
    }

    /// Output positions per image.
    fn positions(&self) -> usize {
        let [ho, wo] = self.out_hw();
        ho * wo
    }

    /// Rows of the column matrix: one per input channel and kernel tap.
    fn taps(&self) -> usize {
        self.cin * self.kernel[0] * self.kernel[1]
    }

    fn images_per_block(&self) -> usize {
        COLUMNS_PER_BLOCK.div_ceil(self.positions()).clamp(1, self.n.max(1))
    }

    fn in_len(&self) -> usize {
        self.cin * self.h * self.w
    }

    fn out_len(&self) -> usize {
        self.cout * self.positions()
    }
}

/// For kernel offset `tap` along one axis: the output range whose input index `o * stride + tap - pad`
/// falls inside `0..len`.
fn valid_range(out: usize, len: usize, stride: usize, tap: usize, pad: usize) -> std::ops::Range<usize> {
    let first = pad.saturating_sub(tap).div_ceil(stride);
    let end = (len + pad).saturating_sub(tap).div_ceil(stride).min(out);
    first.min(end)..end
}

/// One output row's valid stretch of a column-matrix row: `len` columns from `column`, reading the
/// input from `input` every `step` elements.
struct Segment {
    column: usize,
    input: usize,
    len: usize,
    step: usize,
}

/// Visits every segment of a block's column matrix `[taps, images x positions]` in the order im2col
/// and col2im share; entries outside the visited segments are padding (zero).
#[inline(always)]
fn for_each_segment(s: &ConvShape, images: usize, mut f: impl FnMut(Segment)) {
    let ([kh, kw], [ho, wo], [sy, sx]) = (s.kernel, s.out_hw(), s.stride);
    let [top, left, ..] = s.padding;
    let columns = images * ho * wo;
    for ci in 0..s.cin {
        for a in 0..kh {
            let rows_y = valid_range(ho, s.h, sy, a, top);
            for b in 0..kw {
                let row = ((ci * kh + a) * kw + b) * columns;
                let xs = valid_range(wo, s.w, sx, b, left);
                for image in 0..images {
                    let plane = (image * s.cin + ci) * s.h * s.w;
                    for oy in rows_y.clone() {
                        let input = plane + (oy * sy + a - top) * s.w + xs.start * sx + b - left;
                        let column = row + image * ho * wo + oy * wo + xs.start;
                        f(Segment { column, input, len: xs.len(), step: sx });
                    }
                }
            }
        }
    }
}

/// The column matrix `[taps, images x positions]` of a block's images (zeros where padding).
fn im2col(x: &[f32], s: &ConvShape, images: usize) -> Vec<f32> {
    let mut cols = vec![0.0; s.taps() * images * s.positions()];
    for_each_segment(s, images, |Segment { column, input, len, step }| {
        let dst = &mut cols[column..column + len];
        if step == 1 {
            dst.copy_from_slice(&x[input..input + len]);
        } else {
            dst.iter_mut().zip(x[input..].iter().step_by(step)).for_each(|(d, v)| *d = *v);
        }
    });
    cols
}

/// Adds each column entry back to the input position it came from.
fn col2im(cols: &[f32], s: &ConvShape, images: usize, dx: &mut [f32]) {
    vectorized(
        #[inline(always)]
        || {
            for_each_segment(s, images, |Segment { column, input, len, step }| {
                let src = &cols[column..column + len];
                if step == 1 {
                    dx[input..input + len].iter_mut().zip(src).for_each(|(d, v)| *d += v);
                } else {
                    dx[input..].iter_mut().step_by(step).zip(src).for_each(|(d, v)| *d += v);
                }
            })
        },
    )
}

/// `[images, c, p]` to `[c, images x p]` (or back with `inverse`); one image needs no copy.
fn regroup(src: &[f32], images: usize, c: usize, p: usize, inverse: bool) -> Cow<'_, [f32]> {
    if images == 1 {
        return Cow::Borrowed(src);
    }
    let mut dst = vec![0.0; src.len()];
    for image in 0..images {
        for ch in 0..c {
            let (planar, grouped) = ((image * c + ch) * p, ch * images * p + image * p);
            let (from, to) = if inverse { (grouped, planar) } else { (planar, grouped) };
            dst[to..to + p].copy_from_slice(&src[from..from + p]);
        }
    }
    Cow::Owned(dst)
}

/// Input channels from which a convolution may run as shifted products: each tap's product sums over
/// them, too few to keep gemm busy below this.
const SHIFTED_MIN_CHANNELS: usize = 16;

/// Whether the convolution runs as shifted products (below): stride 1, padding below the kernel on
/// every side (the input gradient pads the output gradient by `kernel - 1 - padding`), images of at
/// least a block's worth of positions (smaller ones go several to a block through im2col) and
/// [`SHIFTED_MIN_CHANNELS`].
fn shifted(s: &ConvShape) -> bool {
    let [top, left, bottom, right] = s.padding;
    let fits = top.max(bottom) < s.kernel[0] && left.max(right) < s.kernel[1];
    s.stride == [1, 1] && fits && s.positions() >= COLUMNS_PER_BLOCK && s.cin >= SHIFTED_MIN_CHANNELS
}

/// `x` `[c, h, w]` inside zero padding `[top, left, bottom, right]`, followed by `extra` zeros.
fn pad(x: &[f32], [c, h, w]: [usize; 3], [top, left, bottom, right]: [usize; 4], extra: usize) -> Vec<f32> {
    let (hp, wp) = (h + top + bottom, w + left + right);
    let mut out = vec![0.0; c * hp * wp + extra];
    for (plane, x) in out.chunks_exact_mut(hp * wp).zip(x.chunks_exact(h * w)) {
        for (row, x) in plane[top * wp..].chunks_exact_mut(wp).zip(x.chunks_exact(w)) {
            row[left..left + w].copy_from_slice(x);
        }
    }
    out
}

/// One image's convolution without a column matrix: on the padded input `[cin, hp, wp]`, the output
/// at `(y, x)` over the padded width is `sum over taps (a, b) of W_ab x input[.., (y + a) wp + x + b]`,
/// so each tap is one product whose right operand is the padded planes read from offset `a wp + b`
/// (row stride `hp wp`, column stride 1). The `kw - 1` columns past `wo` in each row are computed and
/// dropped.
fn shifted_forward(out: &mut [f32], x: &[f32], weight: &[f32], bias: &[f32], s: &ConvShape) {
    let ([kh, kw], [ho, wo], [top, left, bottom, right]) = (s.kernel, s.out_hw(), s.padding);
    let (hp, wp) = (s.h + top + bottom, s.w + left + right);
    let q = ho * wp;
    let xp = pad(x, [s.cin, s.h, s.w], s.padding, kw - 1);
    let mut wide: Vec<f32> = bias.iter().flat_map(|&b| std::iter::repeat_n(b, q)).collect();
    for (a, b) in (0..kh).flat_map(|a| (0..kw).map(move |b| (a, b))) {
        let lhs = (&weight[a * kw + b..], [s.taps(), kh * kw]);
        let rhs = (&xp[a * wp + b..], [hp * wp, 1]);
        gemm(Threads::One, [s.cout, q, s.cin], (&mut wide, [q, 1]), true, lhs, rhs);
    }
    for (out, wide) in out.chunks_exact_mut(wo).zip(wide.chunks_exact(wp)) {
        out.copy_from_slice(&wide[..wo]);
    }
}

/// One image's input gradient the same way: the output gradient padded by `kernel - 1 - padding`
/// (`[cout, h + kh - 1, w + kw - 1]`) read from offset `(kh - 1 - a) wq + kw - 1 - b` for tap `(a, b)`,
/// times `W_ab` transposed.
fn shifted_input_grad(dx: &mut [f32], g: &[f32], weight: &[f32], s: &ConvShape) {
    let ([kh, kw], [ho, wo], [top, left, bottom, right]) = (s.kernel, s.out_hw(), s.padding);
    let (hq, wq) = (s.h + kh - 1, s.w + kw - 1);
    let q = s.h * wq;
    let gp = pad(g, [s.cout, ho, wo], [kh - 1 - top, kw - 1 - left, kh - 1 - bottom, kw - 1 - right], kw - 1);
    let mut wide = vec![0.0; s.cin * q];
    for (a, b) in (0..kh).flat_map(|a| (0..kw).map(move |b| (a, b))) {
        let lhs = (&weight[a * kw + b..], [kh * kw, s.taps()]);
        let rhs = (&gp[(kh - 1 - a) * wq + kw - 1 - b..], [hq * wq, 1]);
        gemm(Threads::One, [s.cin, q, s.cout], (&mut wide, [q, 1]), true, lhs, rhs);
    }
    for (dx, wide) in dx.chunks_exact_mut(s.w).zip(wide.chunks_exact(wq)) {
        dx.copy_from_slice(&wide[..s.w]);
    }
}

/// The convolution of `x` by `weight` plus `bias` (one value per output channel).
pub(crate) fn conv2d(x: &[f32], weight: &[f32], bias: &[f32], s: &ConvShape) -> Vec<f32> {
    let mut out = vec![0.0; s.n * s.out_len()];
    if out.is_empty() {
        return out;
    }
    let images = s.images_per_block();
    out.par_chunks_mut(images * s.out_len())
        .zip(x.par_chunks(images * s.in_len()))
        .for_each(|(out, x)| conv2d_block(out, x, weight, bias, s));
    out
}

fn conv2d_block(out: &mut [f32], x: &[f32], weight: &[f32], bias: &[f32], s: &ConvShape) {
    if shifted(s) {
        for (out, x) in out.chunks_exact_mut(s.out_len()).zip(x.chunks_exact(s.in_len())) {
            shifted_forward(out, x, weight, bias, s);
        }
        return;
    }
    let (images, p, taps) = (out.len() / s.out_len(), s.positions(), s.taps());
    let cols = im2col(x, s, images);
    let columns = images * p;
    let mut grouped: Vec<f32> = bias.iter().flat_map(|&b| std::iter::repeat_n(b, columns)).collect();
    gemm(
        Threads::One,
        [s.cout, columns, taps],
        (&mut grouped, [columns, 1]),
        true,
        (weight, [taps, 1]),
        (&cols, [columns, 1]),
    );
    out.copy_from_slice(&regroup(&grouped, images, s.cout, p, true));
}

/// Gradients of the input (when `input_grad`), the weight and the bias from the output gradient `g`.
pub(crate) fn conv2d_backward(
    x: &[f32],
    weight: &[f32],
    g: &[f32],
    s: &ConvShape,
    input_grad: bool,
) -> (Option<Vec<f32>>, Vec<f32>, Vec<f32>) {
    if s.n == 0 {
        return (input_grad.then(Vec::new), vec![0.0; s.cout * s.taps()], vec![0.0; s.cout]);
    }
    let images = s.images_per_block();
    let blocks = s.n.div_ceil(images);
    let group = blocks.div_ceil(MAX_GROUPS) * images;
    let mut dx = vec![0.0; if input_grad { s.n * s.in_len() } else { 0 }];
    let dx_chunks: Vec<&mut [f32]> = if input_grad {
        dx.chunks_mut(group * s.in_len()).collect()
    } else {
        (0..s.n.div_ceil(group)).map(|_| <&mut [f32]>::default()).collect()
    };
    let partials: Vec<(Vec<f32>, Vec<f32>)> = dx_chunks
        .into_par_iter()
        .zip(x.par_chunks(group * s.in_len()).zip(g.par_chunks(group * s.out_len())))
        .map(|(dx, (x, g))| conv2d_backward_group(dx, x, g, weight, s))
        .collect();
    let (mut dw, mut db) = (vec![0.0; s.cout * s.taps()], vec![0.0; s.cout]);
    for (pw, pb) in partials {
        dw.iter_mut().zip(pw).for_each(|(d, p)| *d += p);
        db.iter_mut().zip(pb).for_each(|(d, p)| *d += p);
    }
    (input_grad.then_some(dx), dw, db)
}

/// One group's input gradient (written to `dx` unless it is empty) and its weight and bias partials.
fn conv2d_backward_group(dx: &mut [f32], x: &[f32], g: &[f32], weight: &[f32], s: &ConvShape) -> (Vec<f32>, Vec<f32>) {
    if shifted(s) {
        return shifted_backward_group(dx, x, g, weight, s);
    }
    let (per_block, p, taps) = (s.images_per_block(), s.positions(), s.taps());
    // dW accumulates column-major (dW^T, `taps x cout`): gemm then reads the column matrix in place
    // instead of packing its `taps x columns` strided rows at every block (a third of ResNet-20's step).
    let (mut dw_t, mut db) = (vec![0.0; s.cout * taps], vec![0.0; s.cout]);
    for (first, x) in x.chunks(per_block * s.in_len()).enumerate() {
        let images = x.len() / s.in_len();
        let columns = images * p;
        let g = &g[first * per_block * s.out_len()..][..images * s.out_len()];
        let grouped = regroup(g, images, s.cout, p, false);
        if !dx.is_empty() {
            let mut d_cols = vec![0.0; taps * columns];
            let d = (&mut d_cols[..], [columns, 1]);
            gemm(Threads::One, [taps, columns, s.cout], d, false, (weight, [1, taps]), (&grouped, [columns, 1]));
            col2im(&d_cols, s, images, &mut dx[first * per_block * s.in_len()..][..images * s.in_len()]);
        }
        let cols = im2col(x, s, images);
        let d = (&mut dw_t[..], [1, s.cout]);
        gemm(Threads::One, [s.cout, taps, columns], d, true, (&grouped, [columns, 1]), (&cols, [1, columns]));
        for (d, row) in db.iter_mut().zip(grouped.chunks(columns)) {
            *d += row.iter().sum::<f32>();
        }
    }
    let dw = (0..s.cout * taps).map(|i| dw_t[(i % taps) * s.cout + i / taps]).collect();
    (dw, db)
}

/// [`conv2d_backward_group`] as shifted products, image by image: the input gradient by
/// [`shifted_input_grad`], and for each tap `(a, b)` the weight gradient `dW_ab` (`[cout, cin]`, kept
/// per tap) as the output gradient over the padded width (zeros past `wo`) times the padded input
/// read from offset `a wp + b`, transposed.
fn shifted_backward_group(dx: &mut [f32], x: &[f32], g: &[f32], weight: &[f32], s: &ConvShape) -> (Vec<f32>, Vec<f32>) {
    let ([kh, kw], [ho, wo], [top, left, bottom, right]) = (s.kernel, s.out_hw(), s.padding);
    let (hp, wp, taps) = (s.h + top + bottom, s.w + left + right, s.taps());
    let q = ho * wp;
    let (mut dw_taps, mut db) = (vec![0.0; s.cout * taps], vec![0.0; s.cout]);
    for (image, (x, g)) in x.chunks_exact(s.in_len()).zip(g.chunks_exact(s.out_len())).enumerate() {
        if !dx.is_empty() {
            shifted_input_grad(&mut dx[image * s.in_len()..][..s.in_len()], g, weight, s);
        }
        let xp = pad(x, [s.cin, s.h, s.w], s.padding, kw - 1);
        let gw = pad(g, [s.cout, ho, wo], [0, 0, 0, wp - wo], 0);
        for (tap, dw) in dw_taps.chunks_exact_mut(s.cout * s.cin).enumerate() {
            let rhs = (&xp[(tap / kw) * wp + tap % kw..], [1, hp * wp]);
            gemm(Threads::One, [s.cout, s.cin, q], (dw, [s.cin, 1]), true, (&gw, [q, 1]), rhs);
        }
        for (d, plane) in db.iter_mut().zip(g.chunks_exact(s.positions())) {
            *d += plane.iter().sum::<f32>();
        }
    }
    // [kh kw, cout, cin] to the weight's [cout, cin, kh, kw].
    let dw = (0..s.cout * taps).map(|i| dw_taps[(i % (kh * kw)) * s.cout * s.cin + i / (kh * kw)]).collect();
    (dw, db)
}
