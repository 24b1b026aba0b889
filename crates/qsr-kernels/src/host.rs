//! The host path of fused averaging: the K workers' buffers reduced in L1-sized tiles on rayon's
//! threads, the mean written back to every buffer (what the cubecl kernels do on a device).

use rayon::prelude::*;

use crate::CHUNK;

/// Elements reduced at once: the accumulator tile stays in L1 while the K inputs stream through.
const TILE: usize = 1024;

fn check_lengths(len: usize, lens: impl Iterator<Item = usize>, what: &str) {
    for (k, l) in lens.enumerate() {
        assert_eq!(l, len, "{what}: buffer {k} has {l} elements, buffer 0 has {len}");
    }
}

/// Sums `inputs` element-wise into `acc` (overwriting it), in input order.
#[inline]
fn reduce_tile(acc: &mut [f32], inputs: &[&[f32]]) {
    acc.copy_from_slice(inputs[0]);
    for inp in &inputs[1..] {
        for (a, x) in acc.iter_mut().zip(inp.iter()) {
            *a += *x;
        }
    }
}

#[inline]
fn scale(acc: &mut [f32], k: usize) {
    if k > 1 {
        let k = k as f32;
        for a in acc.iter_mut() {
            *a /= k;
        }
    }
}

/// Replaces every buffer with the element-wise sum (or, with `mean`, the mean) of all of them, on the
/// calling thread, one L1-sized tile at a time. The building block of [`average_and_broadcast`] and of
/// qsr-comm's in-process all-reduce, where each worker thread reduces its own slice.
///
/// # Panics
/// If the buffers differ in length.
pub fn reduce_and_broadcast_serial(buffers: &mut [&mut [f32]], mean: bool) {
    let k = buffers.len();
    if k == 0 || (k == 1 && !mean) {
        return;
    }
    let n = buffers[0].len();
    check_lengths(n, buffers.iter().map(|b| b.len()), "reduce_and_broadcast");
    let mut acc = [0f32; TILE];
    let mut start = 0;
    while start < n {
        let end = (start + TILE).min(n);
        let acc = &mut acc[..end - start];
        {
            let inputs: Vec<&[f32]> = buffers.iter().map(|b| &b[start..end]).collect();
            reduce_tile(acc, &inputs);
        }
        if mean {
            scale(acc, k);
        }
        for b in buffers.iter_mut() {
            b[start..end].copy_from_slice(acc);
        }
        start = end;
    }
}

/// Replaces every buffer with the element-wise mean of all of them, in one pass over memory, chunks in
/// parallel on rayon.
///
/// # Panics
/// If the buffers differ in length (a programming error: every worker has the same layout).
pub fn average_and_broadcast(buffers: &mut [&mut [f32]]) {
    let k = buffers.len();
    if k <= 1 {
        return;
    }
    let len = buffers[0].len();
    check_lengths(len, buffers.iter().map(|b| b.len()), "average_and_broadcast");
    // Transpose into per-chunk groups of K disjoint mutable slices, so chunks run in parallel.
    let mut groups: Vec<Vec<&mut [f32]>> = (0..len.div_ceil(CHUNK)).map(|_| Vec::with_capacity(k)).collect();
    for buf in buffers.iter_mut() {
        for (c, chunk) in buf.chunks_mut(CHUNK).enumerate() {
            groups[c].push(chunk);
        }
    }
    groups.par_iter_mut().for_each(|group| reduce_and_broadcast_serial(group, true));
}

fn reduce_into(out: &mut [f32], inputs: &[&[f32]], mean: bool) {
    let k = inputs.len();
    assert!(k > 0, "reduce of zero buffers");
    check_lengths(out.len(), inputs.iter().map(|b| b.len()), "mean_into");
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
        let base = c * CHUNK;
        let mut start = 0;
        while start < out.len() {
            let end = (start + TILE).min(out.len());
            let tile: Vec<&[f32]> = inputs.iter().map(|b| &b[base + start..base + end]).collect();
            let o = &mut out[start..end];
            reduce_tile(o, &tile);
            if mean {
                scale(o, k);
            }
            start = end;
        }
    });
}

/// Writes the element-wise mean of `inputs` into `out`.
///
/// # Panics
/// If `inputs` is empty or lengths differ.
pub fn mean_into(out: &mut [f32], inputs: &[&[f32]]) {
    reduce_into(out, inputs, true)
}

/// Writes the element-wise sum of `inputs` into `out`.
///
/// # Panics
/// If `inputs` is empty or lengths differ.
pub fn sum_into(out: &mut [f32], inputs: &[&[f32]]) {
    reduce_into(out, inputs, false)
}
