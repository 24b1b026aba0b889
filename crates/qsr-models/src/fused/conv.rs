//! 2-D convolution (groups 1, dilation 1, any stride and padding) on contiguous NCHW `f32` buffers, as
//! im2col and one gemm per block of images, with its backward.
//!
//! burn's flex backend runs the backward as a transposed convolution and a convolution over permuted
//! copies; here both gradients come from the same column matrix. Blocks of images are the rayon tasks,
//! their size fixed by the shapes (never by the thread count), each gemm runs on one thread, and the
//! weight and bias gradients add per-group partials in group order: results do not depend on threads.

use std::borrow::Cow;

use rayon::prelude::*;

use super::gemm::{Threads, gemm};

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
    pub fn out_hw(&self) -> [usize; 2] {
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
    for_each_segment(s, images, |Segment { column, input, len, step }| {
        let src = &cols[column..column + len];
        if step == 1 {
            dx[input..input + len].iter_mut().zip(src).for_each(|(d, v)| *d += v);
        } else {
            dx[input..].iter_mut().step_by(step).zip(src).for_each(|(d, v)| *d += v);
        }
    });
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
        gemm(
            Threads::One,
            [s.cout, taps, columns],
            (&mut dw_t, [1, s.cout]),
            true,
            (&grouped, [columns, 1]),
            (&cols, [1, columns]),
        );
        for (d, row) in db.iter_mut().zip(grouped.chunks(columns)) {
            *d += row.iter().sum::<f32>();
        }
    }
    let dw = (0..s.cout * taps).map(|i| dw_t[(i % taps) * s.cout + i / taps]).collect();
    (dw, db)
}
