//! A linear layer `y = x W + b` over rows, on contiguous `f32` buffers: the forward as one product
//! onto the bias, the backward as two products and a column sum.
//!
//! burn builds the layer from a matmul and an add, each a graph node and a new buffer (flex copies
//! every new buffer once more to align it); here the output starts as the bias and the product adds
//! onto it, and the gradients are written where they are returned. Each product may split its output
//! over the pool (never its sum) and the bias gradient adds partial sums over blocks of rows fixed by
//! the shape: results do not depend on threads.

use rayon::prelude::*;

use super::gemm::{Threads, gemm};
use super::kernels::vectorized;

/// Rows per rayon task: of the output the forward fills with the bias, of the bias gradient's sums.
const ROWS_PER_TASK: usize = 64;

/// The geometry of one linear layer: input `[rows, d_input]`, weight `[d_input, d_output]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LinearShape {
    pub rows: usize,
    pub d_input: usize,
    pub d_output: usize,
}

/// `x W + b`, `[rows, d_output]`.
pub(crate) fn forward(x: &[f32], weight: &[f32], bias: &[f32], s: LinearShape) -> Vec<f32> {
    let mut y = vec![0.0; s.rows * s.d_output];
    if s.d_output == 0 {
        return y;
    }
    y.par_chunks_mut(ROWS_PER_TASK * s.d_output)
        .for_each(|rows| rows.chunks_exact_mut(s.d_output).for_each(|row| row.copy_from_slice(bias)));
    let [din, dout] = [s.d_input, s.d_output];
    gemm(Threads::Pool, [s.rows, dout, din], (&mut y, [dout, 1]), true, (x, [din, 1]), (weight, [dout, 1]));
    y
}

/// The gradients of `x` (when `need_dx`), `W` and `b` from the output's gradient `g` `[rows, d_output]`:
/// `g W^T`, `x^T g` and `g`'s column sums.
pub(crate) fn backward(
    x: &[f32],
    weight: &[f32],
    g: &[f32],
    s: LinearShape,
    need_dx: bool,
) -> (Option<Vec<f32>>, Vec<f32>, Vec<f32>) {
    let [rows, din, dout] = [s.rows, s.d_input, s.d_output];
    let dx = need_dx.then(|| {
        let mut dx = vec![0.0; rows * din];
        gemm(Threads::Pool, [rows, din, dout], (&mut dx, [din, 1]), false, (g, [dout, 1]), (weight, [1, dout]));
        dx
    });
    let mut dw = vec![0.0; din * dout];
    gemm(Threads::Pool, [din, dout, rows], (&mut dw, [dout, 1]), false, (x, [1, din]), (g, [dout, 1]));
    (dx, dw, column_sums(g, dout))
}

/// The sum of each column of `g` (rows of `columns`): partial sums over blocks of [`ROWS_PER_TASK`]
/// rows (one task each, reading rows whole), added in block order.
fn column_sums(g: &[f32], columns: usize) -> Vec<f32> {
    if columns == 0 {
        return Vec::new();
    }
    let partials: Vec<Vec<f32>> =
        g.par_chunks(ROWS_PER_TASK * columns).map(|rows| partial_sums(rows, columns)).collect();
    let mut sums = vec![0.0; columns];
    for partial in &partials {
        sums.iter_mut().zip(partial).for_each(|(s, p)| *s += p);
    }
    sums
}

#[inline(never)]
fn partial_sums(rows: &[f32], columns: usize) -> Vec<f32> {
    vectorized(
        #[inline(always)]
        || {
            let mut sums = vec![0.0; columns];
            for row in rows.chunks_exact(columns) {
                sums.iter_mut().zip(row).for_each(|(s, v)| *s += v);
            }
            sums
        },
    )
}
