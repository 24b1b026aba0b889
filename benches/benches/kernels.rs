//! Fused average-and-broadcast of K = 4 worker buffers of 64 MiB against memcpy of the same bytes.
//!
//! Both move the same traffic: the fused pass reads 4 x 64 MiB and writes 4 x 64 MiB; the reference
//! copies 4 x 64 MiB into 4 other buffers (read 4 x 64, write 4 x 64). Throughput is reported over the
//! bytes read plus written, so the ratio of the two is the fraction of memory bandwidth achieved.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use rayon::prelude::*;

const K: usize = 4;
const LEN: usize = 64 * 1024 * 1024 / 4;

fn averaging(c: &mut Criterion) {
    let mut bufs: Vec<Vec<f32>> =
        (0..K).map(|k| (0..LEN).map(|i| ((i * 7 + k) % 1000) as f32 * 1e-3).collect()).collect();
    let mut dst: Vec<Vec<f32>> = (0..K).map(|_| vec![0.0f32; LEN]).collect();
    let mut g = c.benchmark_group("average_k4_64MiB");
    g.sample_size(20);
    g.throughput(Throughput::Bytes((2 * K * LEN * 4) as u64));
    g.bench_function("fused_average_and_broadcast", |b| {
        b.iter(|| {
            let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(|v| v.as_mut_slice()).collect();
            qsr_kernels::average_and_broadcast(black_box(&mut views));
        })
    });
    g.bench_function("memcpy_same_bytes_parallel", |b| {
        b.iter(|| {
            for (d, s) in dst.iter_mut().zip(&bufs) {
                d.par_chunks_mut(qsr_kernels::CHUNK)
                    .zip(s.par_chunks(qsr_kernels::CHUNK))
                    .for_each(|(d, s)| d.copy_from_slice(s));
            }
            black_box(&dst);
        })
    });
    g.bench_function("memcpy_same_bytes_single_thread", |b| {
        b.iter(|| {
            for (d, s) in dst.iter_mut().zip(&bufs) {
                d.copy_from_slice(s);
            }
            black_box(&dst);
        })
    });
    g.finish();
}

criterion_group!(benches, averaging);
criterion_main!(benches);
