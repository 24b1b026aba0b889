//! Fused average-and-broadcast of K = 4 worker buffers of 64 MiB against memcpy of the same bytes.
//!
//! Both move the same traffic: the fused pass reads 4 x 64 MiB and writes 4 x 64 MiB; the reference
//! copies 4 x 64 MiB into 4 other buffers (read 4 x 64, write 4 x 64). Throughput is reported over the
//! bytes read plus written, so the ratio of the two is the fraction of memory bandwidth achieved.
//!
//! And the block-scaled coding of streaming syncs: `Codec::round_block` (encode and decode in place,
//! what each hop of an in-memory quantized all-reduce does) of 4 Mi values, one thread, int8 and fp8,
//! beside a copy of the same buffer.

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

const CODED: usize = 4 * 1024 * 1024;

fn coding(c: &mut Criterion) {
    let values: Vec<f32> = (0..CODED).map(|i| ((i * 7919) % 2001) as f32 * 1e-3 - 1.0).collect();
    let mut buf = values.clone();
    let mut g = c.benchmark_group("round_block_4Mi");
    g.sample_size(20);
    g.throughput(Throughput::Elements(CODED as u64));
    for (name, codec) in [("int8", qsr_kernels::Codec::Int8), ("fp8", qsr_kernels::Codec::Fp8E4m3)] {
        g.bench_function(name, |b| {
            b.iter(|| {
                buf.copy_from_slice(&values);
                codec.round_block(black_box(&mut buf));
            })
        });
    }
    g.bench_function("copy_only", |b| {
        b.iter(|| {
            buf.copy_from_slice(black_box(&values));
            black_box(&buf);
        })
    });
    g.finish();
}

criterion_group!(benches, averaging, coding);
criterion_main!(benches);
