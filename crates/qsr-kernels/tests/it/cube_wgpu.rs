//! The cubecl kernels on cubecl's wgpu runtime (Vulkan; Mesa lavapipe on a CPU-only machine) are
//! bit-identical to the host path `qsr_kernels::mean_into`, close to a naive f64 mean, write every
//! element of every output, and refuse bad arguments with errors.
//!
//! No Vulkan adapter: the tests print a skip reason and pass, unless `QSR_REQUIRE_GPU_RUNTIME=1`
//! (CI), where a missing runtime must fail loudly instead of passing vacuously.
#![cfg(feature = "wgpu")]

use std::sync::OnceLock;
use std::time::Instant;

use cubecl::client::Client;
use cubecl::device::WgpuDeviceKind;
use cubecl::prelude::CubeElement;
use qsr_kernels::cube::{self, KernelError, MAX_BUFFERS};

const LENGTHS: [usize; 12] = [0, 1, 2, 3, 4, 5, 6, 1023, 1024, 1_000_000, 1_000_002, 1_000_003];

fn require_runtime() -> bool {
    std::env::var("QSR_REQUIRE_GPU_RUNTIME").is_ok_and(|v| v == "1")
}

/// The wgpu client on a Vulkan adapter, once per test binary; `None` (with the reason printed)
/// where the machine has none and the runtime is not required.
fn client() -> Option<&'static Client> {
    static CLIENT: OnceLock<Result<Client, String>> = OnceLock::new();
    let client = CLIENT.get_or_init(|| {
        let device = cubecl::Device::vulkan(WgpuDeviceKind::default())
            .map_err(|e| format!("no Vulkan adapter for cubecl's wgpu runtime: {e}"))?;
        // Device creation can still panic inside wgpu (e.g. a broken ICD): report it the same way.
        let client = std::panic::catch_unwind(|| device.client())
            .map_err(|_| "creating the wgpu device panicked (see the panic message above)".to_string())?;
        let identity = &client.properties().identity;
        println!("cubecl runtime `{}`, wgpu adapter: {}", client.name(), identity.name);
        Ok(client)
    });
    match client {
        Ok(c) => Some(c),
        Err(reason) if require_runtime() => panic!(
            "QSR_REQUIRE_GPU_RUNTIME=1 but {reason}. On a CPU-only machine install Mesa lavapipe: \
             apt-get install -y mesa-vulkan-drivers libvulkan1"
        ),
        Err(reason) => {
            println!("SKIP cube_wgpu: {reason} (set QSR_REQUIRE_GPU_RUNTIME=1 to make this fail)");
            None
        }
    }
}

fn random_buffers(k: usize, len: usize, seed: u64) -> Vec<Vec<f32>> {
    qsr_kernels::random_replicas(k, len, seed)
}

fn host_mean(bufs: &[Vec<f32>]) -> Vec<f32> {
    let len = bufs[0].len();
    let views: Vec<&[f32]> = bufs.iter().map(|b| b.as_slice()).collect();
    let mut out = vec![f32::NAN; len];
    qsr_kernels::mean_into(&mut out, &views);
    out
}

/// `got` equals the host path bit for bit, and is within f32 summation error of the f64 mean.
fn check(what: &str, k: usize, len: usize, got: &[f32], host: &[f32], bufs: &[Vec<f32>]) {
    assert_eq!(got.len(), len, "{what} k {k} len {len}: wrong length");
    for i in 0..len {
        assert!(!got[i].is_nan(), "{what} k {k} len {len}: element {i} not written (NaN)");
        assert_eq!(
            got[i].to_bits(),
            host[i].to_bits(),
            "{what} k {k} len {len} i {i}: {} vs host {} (not bit-identical)",
            got[i],
            host[i]
        );
        let abs_sum: f64 = bufs.iter().map(|b| f64::from(b[i]).abs()).sum();
        let mean64 = bufs.iter().map(|b| f64::from(b[i])).sum::<f64>() / k as f64;
        let bound = (k as f64 + 1.0) * f64::from(f32::EPSILON) * abs_sum / k as f64;
        assert!(
            (f64::from(got[i]) - mean64).abs() <= bound,
            "{what} k {k} len {len} i {i}: {} vs f64 mean {mean64}",
            got[i]
        );
    }
}

#[test]
fn kernels_match_host_path_bit_for_bit() {
    let Some(client) = client() else { return };
    let sizes: Vec<usize> = client.io_optimized_vector_sizes(4).collect();
    println!("f32 IO vector sizes offered: {sizes:?}");
    let start = Instant::now();
    let mut device_time = std::time::Duration::ZERO;
    let mut first = true;
    for k in 1..=MAX_BUFFERS {
        for &len in &LENGTHS {
            let bufs = random_buffers(k, len, (k as u64) << 32 | len as u64);
            let host = host_mean(&bufs);
            let views: Vec<&[f32]> = bufs.iter().map(|b| b.as_slice()).collect();

            let t = Instant::now();
            let mut out = vec![f32::NAN; len];
            cube::mean_into_host(client, &mut out, &views).unwrap();
            device_time += t.elapsed();
            if first && len > 0 {
                println!("first launch (kernel compile + upload + run + read): {:?}", t.elapsed());
                first = false;
            }
            check("mean_into", k, len, &out, &host, &bufs);

            let mut replicas = bufs.clone();
            let mut mviews: Vec<&mut [f32]> = replicas.iter_mut().map(|b| b.as_mut_slice()).collect();
            let t = Instant::now();
            cube::average_and_broadcast_host(client, &mut mviews).unwrap();
            device_time += t.elapsed();
            for (j, r) in replicas.iter().enumerate() {
                check(&format!("average_and_broadcast replica {j}"), k, len, r, &host, &bufs);
            }
        }
        println!("k = {k} done at {:?}", start.elapsed());
    }
    for &len in &LENGTHS {
        println!("len {len}: line size {}", cube::vector_size(client, len));
    }
    println!(
        "all k x lengths: {:?} in total, {device_time:?} of it in the cube roundtrips (upload, launch, read)",
        start.elapsed()
    );
}

/// The device-level API on a buffer the caller owns: one allocation of K replicas, averaged in
/// place, then a mean of the (now equal) replicas into a NaN-filled output.
#[test]
fn device_handles_in_place_then_mean() {
    let Some(client) = client() else { return };
    let (k, len) = (5, 4 * 1000 + 4);
    let bufs = random_buffers(k, len, 7);
    let host = host_mean(&bufs);
    let flat: Vec<f32> = bufs.concat();
    let replicas = client.create_from_slice(f32::as_bytes(&flat));
    cube::average_and_broadcast(client, &replicas, k, len).unwrap();
    let out = client.create_from_slice(f32::as_bytes(&vec![f32::NAN; len]));
    cube::mean_into(client, &out, &replicas, k, len).unwrap();

    let all = f32::from_bytes(&client.read_one(replicas).unwrap()).to_vec();
    for j in 0..k {
        check(&format!("in place replica {j}"), k, len, &all[j * len..(j + 1) * len], &host, &bufs);
    }
    // The mean of K copies of m is m only up to rounding of (m + ... + m) / K, so compare the
    // mean of the averaged replicas with the host path on the same data.
    let averaged: Vec<Vec<f32>> = (0..k).map(|_| host.clone()).collect();
    let want = host_mean(&averaged);
    let got = f32::from_bytes(&client.read_one(out).unwrap()).to_vec();
    check("mean of averaged", k, len, &got, &want, &averaged);
}

#[test]
fn bad_arguments_are_errors_and_empty_is_a_no_op() {
    let Some(client) = client() else { return };
    let buf = client.create_from_slice(f32::as_bytes(&[1.0f32; 12]));
    let out = client.create_from_slice(f32::as_bytes(&[f32::NAN; 4]));

    assert!(matches!(cube::average_and_broadcast(client, &buf, 0, 12), Err(KernelError::NoBuffers)));
    assert!(matches!(cube::mean_into(client, &out, &buf, 0, 4), Err(KernelError::NoBuffers)));
    assert!(matches!(
        cube::average_and_broadcast(client, &buf, MAX_BUFFERS + 1, 1),
        Err(KernelError::TooManyBuffers { k: 9, max: 8 })
    ));
    // 12 floats are 3 replicas of 4, not 2 of 4 nor 3 of 5.
    assert!(matches!(cube::average_and_broadcast(client, &buf, 2, 4), Err(KernelError::LengthMismatch { .. })));
    assert!(matches!(cube::average_and_broadcast(client, &buf, 3, 5), Err(KernelError::LengthMismatch { .. })));
    assert!(matches!(cube::mean_into(client, &out, &buf, 3, 3), Err(KernelError::LengthMismatch { .. })));
    assert!(matches!(cube::mean_into(client, &out, &buf, 2, 6), Err(KernelError::LengthMismatch { .. })));
    cube::mean_into(client, &out, &buf, 3, 4).unwrap();
    assert_eq!(f32::from_bytes(&client.read_one(out).unwrap()), &[1.0f32; 4]);

    // Host helpers: K out of range, ragged inputs, wrong output length.
    let a = [1.0f32, 2.0];
    let b = [3.0f32];
    let mut o = [0.0f32; 2];
    assert!(matches!(cube::mean_into_host(client, &mut o, &[]), Err(KernelError::NoBuffers)));
    assert!(matches!(cube::mean_into_host(client, &mut o, &[&a[..]; 9]), Err(KernelError::TooManyBuffers { .. })));
    assert!(matches!(
        cube::mean_into_host(client, &mut o, &[&a, &b]),
        Err(KernelError::HostLengthMismatch { index: 1, .. })
    ));
    assert!(matches!(
        cube::mean_into_host(client, &mut o[..1], &[&a, &a]),
        Err(KernelError::HostLengthMismatch { .. })
    ));
    let (mut x, mut y) = ([1.0f32, 2.0], [3.0f32]);
    assert!(matches!(
        cube::average_and_broadcast_host(client, &mut [&mut x, &mut y]),
        Err(KernelError::HostLengthMismatch { .. })
    ));
    assert!(matches!(cube::average_and_broadcast_host(client, &mut []), Err(KernelError::NoBuffers)));

    // Length 0 launches nothing, on the device API too.
    let empty = client.create_from_slice(&[]);
    cube::average_and_broadcast(client, &empty, 4, 0).unwrap();
    cube::mean_into(client, &empty, &empty, 4, 0).unwrap();
    let (mut none, src): ([f32; 0], [f32; 0]) = ([], []);
    cube::mean_into_host(client, &mut none, &[&src, &src]).unwrap();
}

/// The device check that `qsr device-check` runs on a GPU, run here on this runtime: the same
/// correctness sweep passes, and the bandwidth measurement verifies both of its kernels' results.
#[test]
fn device_check_passes_on_this_runtime() {
    use qsr_kernels::{check_correctness, measure_bandwidth};
    let Some(client) = client() else { return };
    let lengths = [1, 2, 3, 4, 6, 1023, 4096];
    let cases = check_correctness(client, &lengths, 99).unwrap();
    assert_eq!(cases.len(), MAX_BUFFERS * lengths.len());
    let bad: Vec<_> = cases.iter().filter(|c| c.mismatches > 0).collect();
    assert!(bad.is_empty(), "{bad:?}");
    assert!(cases.iter().any(|c| c.vector_size == 4) && cases.iter().any(|c| c.vector_size == 1));
    for k in [3, 4] {
        let len = 1 << 16;
        let b = measure_bandwidth(client, k, len, 3, 1).unwrap();
        assert_eq!(b.bytes, (2 * k * len * 4) as u64);
        assert!(b.fused_seconds > 0.0 && b.many_seconds > 0.0 && b.copy_seconds > 0.0 && b.ratio().is_finite());
        println!(
            "k {k}: fused {:.2} GB/s, separate buffers {:.2} GB/s, copy {:.2} GB/s ({:.2}x)",
            b.fused_gbs(),
            b.many_gbs(),
            b.copy_gbs(),
            b.ratio()
        );
    }
}

/// The separate-buffers kernel (one allocation per replica, as burn gives each worker's flat
/// parameters) matches the host path bit for bit for every K and line size.
#[test]
fn separate_buffers_match_host_path_bit_for_bit() {
    let Some(client) = client() else { return };
    for k in 1..=MAX_BUFFERS {
        for len in [1usize, 2, 3, 4, 6, 1023, 4096, 100_003] {
            let bufs = random_buffers(k, len, 31 * k as u64 + len as u64);
            let host = host_mean(&bufs);
            let handles: Vec<_> = bufs.iter().map(|b| client.create_from_slice(f32::as_bytes(b))).collect();
            cube::average_and_broadcast_many(client, &handles, len).unwrap();
            for (j, h) in handles.into_iter().enumerate() {
                let got = f32::from_bytes(&client.read_one(h).unwrap()).to_vec();
                check(&format!("many replica {j}"), k, len, &got, &host, &bufs);
            }
        }
    }
    let h = client.create_from_slice(f32::as_bytes(&[1.0f32; 5]));
    assert!(matches!(
        cube::average_and_broadcast_many(client, &[h.clone(), h], 4),
        Err(KernelError::LengthMismatch { .. })
    ));
}
