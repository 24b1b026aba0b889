//! The device check behind `qsr device-check` and `scripts/gpu-check.sh` ([`check_correctness`],
//! [`measure_bandwidth`]): the cubecl kernels on whatever runtime a [`Client`] belongs to (CUDA on a GPU,
//! wgpu/lavapipe in CI), checked against the host path on random data and timed against a plain copy of
//! the same bytes.

use std::time::{Duration, Instant};

use cubecl::prelude::*;
use cubecl::server::Handle;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::cube::{self, KernelError, MAX_BUFFERS};

/// One correctness case.
#[derive(Debug, Clone, PartialEq)]
pub struct CaseResult {
    /// Number of replicas K.
    pub k: usize,
    /// Floats per replica.
    pub len: usize,
    /// Vector width the kernels used for this length ([`cube::vector_size`]).
    pub vector_size: usize,
    /// Elements (over both kernels and all replicas) that differ from the host path's bits or were
    /// not written.
    pub mismatches: usize,
}

/// The fused kernel against a copy of the same bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Bandwidth {
    /// Number of replicas K.
    pub k: usize,
    /// Floats per replica.
    pub len: usize,
    /// Vector width of the launches ([`cube::vector_size`]).
    pub vector_size: usize,
    /// Timed launches of each kernel.
    pub repeats: usize,
    /// Median seconds per launch.
    pub fused_seconds: f64,
    /// The same average over K separate buffers (`average_and_broadcast_many`, what training launches).
    pub many_seconds: f64,
    /// Median seconds per launch of the reference copy.
    pub copy_seconds: f64,
    /// Bytes read + written per launch (the same for both).
    pub bytes: u64,
}

impl Bandwidth {
    /// Fused kernel's bandwidth over one slab, GB/s.
    pub fn fused_gbs(&self) -> f64 {
        self.bytes as f64 / self.fused_seconds / 1e9
    }
    /// Fused kernel's bandwidth over K separate buffers, GB/s.
    pub fn many_gbs(&self) -> f64 {
        self.bytes as f64 / self.many_seconds / 1e9
    }
    /// The reference copy's bandwidth, GB/s.
    pub fn copy_gbs(&self) -> f64 {
        self.bytes as f64 / self.copy_seconds / 1e9
    }
    /// Fused bandwidth as a fraction of the copy's (the goal: at least 0.85).
    pub fn ratio(&self) -> f64 {
        self.copy_seconds / self.fused_seconds
    }
}

/// Nonzero values spread over several binades, so additions round and their order matters.
pub fn random_replicas(k: usize, len: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..k)
        .map(|_| {
            (0..len)
                .map(|_| {
                    let x = rng.random_range(0.5f32..1.0) * 2f32.powi(rng.random_range(-6..6));
                    if rng.random_bool(0.5) { x } else { -x }
                })
                .collect()
        })
        .collect()
}

fn mismatches(got: &[f32], want: &[f32]) -> usize {
    got.iter().zip(want).filter(|(g, w)| g.is_nan() || g.to_bits() != w.to_bits()).count()
        + want.len().abs_diff(got.len())
}

/// Runs both kernels for every K in `1..=MAX_BUFFERS` and each of `lengths`; one result per case.
///
/// The device check's correctness half, on whatever runtime `client` belongs to (CUDA on a GPU,
/// wgpu/lavapipe in CI): all three kernels (mean into one output, average-and-broadcast over one slab
/// and over K separate buffers), every K in `1..=MAX_BUFFERS` and lengths that exercise every line size
/// (odd, 2 mod 4, multiples of 4), random nonzero values over several binades, outputs pre-filled with
/// NaN so an element the kernel skipped is caught; the result must equal [`crate::mean_into`] bit for
/// bit.
pub fn check_correctness(client: &Client, lengths: &[usize], seed: u64) -> Result<Vec<CaseResult>, KernelError> {
    let mut out = Vec::new();
    for k in 1..=MAX_BUFFERS {
        for &len in lengths {
            let bufs = random_replicas(k, len, seed ^ ((k as u64) << 32 | len as u64));
            let views: Vec<&[f32]> = bufs.iter().map(Vec::as_slice).collect();
            let mut want = vec![f32::NAN; len];
            crate::mean_into(&mut want, &views);

            let mut got = vec![f32::NAN; len];
            cube::mean_into_host(client, &mut got, &views)?;
            let mut bad = mismatches(&got, &want);

            let mut replicas = bufs.clone();
            let mut mviews: Vec<&mut [f32]> = replicas.iter_mut().map(Vec::as_mut_slice).collect();
            cube::average_and_broadcast_host(client, &mut mviews)?;
            bad += replicas.iter().map(|r| mismatches(r, &want)).sum::<usize>();

            // The separate-buffers kernel, the one device-resident training launches.
            if len > 0 {
                let handles: Vec<_> = bufs.iter().map(|b| client.create_from_slice(f32::as_bytes(b))).collect();
                cube::average_and_broadcast_many(client, &handles, len)?;
                for h in handles {
                    let got = f32::from_bytes(&client.read_one(h)?).to_vec();
                    bad += mismatches(&got, &want);
                }
            }
            out.push(CaseResult { k, len, vector_size: cube::vector_size(client, len), mismatches: bad });
        }
    }
    Ok(out)
}

#[cube(launch_unchecked)]
fn copy_kernel<N: Size>(src: &[Vector<f32, N>], dst: &mut [Vector<f32, N>], total: usize) {
    let i = ABSOLUTE_POS;
    if i < total {
        dst[i] = src[i];
    }
}

/// Copies `total` floats from `src` to `dst` with line size `n`, one unit per vector.
fn launch_copy(client: &Client, src: &Handle, dst: &Handle, total: usize, n: usize) {
    let vectors = total / n;
    let dim = CubeDim::new(client, vectors);
    let count = cubecl::calculate_cube_count_elemwise(client, vectors, dim);
    // SAFETY: both buffers hold `total` floats (allocated by the caller for exactly that), and the
    // kernel touches `i < vectors` only.
    unsafe {
        copy_kernel::launch_unchecked(
            client,
            count,
            dim,
            n,
            BufferArg::from_raw_parts(src.clone(), vectors),
            BufferArg::from_raw_parts(dst.clone(), vectors),
            vectors,
        );
    }
}

use crate::cube::sync;

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64()
}

/// Times the fused average-and-broadcast of `k` replicas of `len` floats against a copy of the
/// same `k * len` floats, `repeats` launches each (interleaved, so clock changes hit both alike).
///
/// The device check's bandwidth half: the fused average-and-broadcast over K replicas of `len` floats
/// moves `2 K len` floats (K reads, K writes per element), timed on one slab and on K separate buffers
/// (training's kernel). The reference moves the same bytes as a copy of the `K len` floats into a
/// second buffer, with the same line size and grid. Medians over repeats, after a warm-up launch that
/// compiles both kernels.
pub fn measure_bandwidth(
    client: &Client,
    k: usize,
    len: usize,
    repeats: usize,
    seed: u64,
) -> Result<Bandwidth, KernelError> {
    let total = k * len;
    let data: Vec<f32> = random_replicas(1, total, seed).remove(0);
    let replicas = client.create_from_slice(f32::as_bytes(&data));
    let dst = client.empty(total * 4);
    let separate: Vec<Handle> =
        (0..k).map(|j| client.create_from_slice(f32::as_bytes(&data[j * len..(j + 1) * len]))).collect();
    let n = cube::vector_size(client, len);
    // Warm-up: compiles the kernels and faults in the pages.
    cube::average_and_broadcast(client, &replicas, k, len)?;
    cube::average_and_broadcast_many(client, &separate, len)?;
    launch_copy(client, &replicas, &dst, total, n);
    sync(client)?;
    let (mut fused, mut many, mut copy) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        cube::average_and_broadcast(client, &replicas, k, len)?;
        sync(client)?;
        fused.push(t.elapsed());
        let t = Instant::now();
        cube::average_and_broadcast_many(client, &separate, len)?;
        sync(client)?;
        many.push(t.elapsed());
        let t = Instant::now();
        launch_copy(client, &replicas, &dst, total, n);
        sync(client)?;
        copy.push(t.elapsed());
    }
    // The reference must have moved the bytes: after the last copy nothing wrote the replicas, so
    // the copy equals them. (Reading back also surfaces a failed launch.)
    let averaged = client.read_one(replicas.clone())?;
    let copied = client.read_one(dst)?;
    if averaged[..] != copied[..] {
        return Err(KernelError::Mismatch("the reference copy kernel did not copy its input".into()));
    }
    // And the fused kernel averaged: every replica equals replica 0.
    let v = f32::from_bytes(&averaged);
    if let Some(j) = (1..k).find(|&j| v[j * len..(j + 1) * len] != v[..len]) {
        return Err(KernelError::Mismatch(format!("replica {j} differs from replica 0 after averaging")));
    }
    // The separate buffers started from the same replicas and were averaged as often: same bits.
    for (j, h) in separate.into_iter().enumerate() {
        if client.read_one(h)?[..] != averaged[j * len * 4..(j + 1) * len * 4] {
            return Err(KernelError::Mismatch(format!("separate buffer {j} differs from the slab's replica {j}")));
        }
    }
    Ok(Bandwidth {
        k,
        len,
        vector_size: n,
        repeats: repeats.max(1),
        fused_seconds: median(fused),
        many_seconds: median(many),
        copy_seconds: median(copy),
        bytes: (2 * total * 4) as u64,
    })
}
