//! The matrix product under the fused ops: the `gemm` crate (flex's own) on slices, with strides.

/// How many threads one product may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Threads {
    /// The calling thread only (the caller already runs one product per rayon task).
    One,
    /// The current rayon pool, for products of at least [`PARALLEL_WORK`] multiply-adds. gemm runs its
    /// blocks of the sum over `k` one after another and splits only the output among threads, so the
    /// result has the same bits at any thread count (tests/it/fused.rs checks 1 and 2).
    Pool,
}

/// Multiply-adds from which a [`Threads::Pool`] product is split (flex's threshold, 192^3).
const PARALLEL_WORK: usize = 192 * 192 * 192;

/// `dst = (read_dst ? dst : 0) + lhs x rhs` for `m x k` by `k x n` matrices, each given with its
/// (row, column) strides. gemm packs whichever operand the microkernel cannot read in place; a
/// destination laid out column-major (`[1, m]`) keeps it from transposing the problem, which decides
/// which operand that is.
#[allow(unsafe_code)]
pub(crate) fn gemm(
    threads: Threads,
    [m, n, k]: [usize; 3],
    (dst, dst_strides): (&mut [f32], [usize; 2]),
    read_dst: bool,
    lhs: (&[f32], [usize; 2]),
    rhs: (&[f32], [usize; 2]),
) {
    let last = |[rs, cs]: [usize; 2], rows: usize, cols: usize| (rows - 1) * rs + (cols - 1) * cs;
    if m * n == 0 {
        return;
    }
    assert!(last(dst_strides, m, n) < dst.len(), "gemm: destination too short");
    if k == 0 {
        // An empty sum: gemm would leave the destination as it is.
        if !read_dst {
            (0..m).for_each(|i| (0..n).for_each(|j| dst[i * dst_strides[0] + j * dst_strides[1]] = 0.0));
        }
        return;
    }
    assert!(last(lhs.1, m, k) < lhs.0.len() && last(rhs.1, k, n) < rhs.0.len(), "gemm: operand too short");
    let parallelism = match threads {
        Threads::Pool if m * n * k >= PARALLEL_WORK => gemm::Parallelism::Rayon(rayon::current_num_threads()),
        _ => gemm::Parallelism::None,
    };
    // SAFETY: the asserts above keep every index gemm reads or writes inside the slices.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dst_strides[1] as isize,
            dst_strides[0] as isize,
            read_dst,
            lhs.0.as_ptr(),
            lhs.1[1] as isize,
            lhs.1[0] as isize,
            rhs.0.as_ptr(),
            rhs.1[1] as isize,
            rhs.1[0] as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}
