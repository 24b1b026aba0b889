//! `--device` (documented on [`DeviceSpec`]) and `qsr device-check`.

use anyhow::{Result, bail};
use burn::tensor::Device;

/// A parsed `--device` value.
///
/// Which burn device the workers train on, checked before burn touches it.
///
/// With CUDA compiled in (feature `cuda`), a missing driver makes cudarc panic deep inside cubecl's
/// device thread; we probe libcuda, the GPU count and NVRTC first so the user gets one line naming
/// what is missing. The parsing and probing logic is plain code, tested without a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeviceSpec {
    /// burn's flex backend on the CPU.
    Cpu,
    /// burn's LibTorch backend on the CPU (feature `tch`, for `cargo xtask bench train`'s backend table):
    /// burn's autodiff over PyTorch's kernels.
    LibTorch,
    /// A CUDA GPU; `None` means "this process's local rank" (one GPU per process on a host).
    Cuda(Option<usize>),
    /// burn's wgpu backend on the first Vulkan adapter (feature `wgpu`; Mesa lavapipe on a machine
    /// without a GPU): the GPU code path where CI can run it.
    Wgpu,
}

impl DeviceSpec {
    /// Parses `cpu`, `flex`, `libtorch`, `wgpu`, `cuda` or `cuda:N`.
    pub(crate) fn parse(name: &str) -> Result<DeviceSpec> {
        match name {
            "cpu" | "flex" => Ok(DeviceSpec::Cpu),
            "libtorch" => Ok(DeviceSpec::LibTorch),
            "wgpu" => Ok(DeviceSpec::Wgpu),
            "cuda" => Ok(DeviceSpec::Cuda(None)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => match n.parse::<usize>() {
                    Ok(i) => Ok(DeviceSpec::Cuda(Some(i))),
                    Err(_) => bail!("--device {other}: `{n}` is not a GPU index (expected cuda:0, cuda:1, ...)"),
                },
                None => bail!("--device {other}: unknown device (expected cpu, libtorch, wgpu, cuda or cuda:N)"),
            },
        }
    }

    /// The GPU ordinal for a process with this local rank, if this is a GPU device.
    pub(crate) fn ordinal(self, local_rank: usize) -> Option<usize> {
        match self {
            DeviceSpec::Cpu | DeviceSpec::LibTorch | DeviceSpec::Wgpu => None,
            DeviceSpec::Cuda(i) => Some(i.unwrap_or(local_rank)),
        }
    }

    /// True for a CUDA device.
    pub(crate) fn is_gpu(self) -> bool {
        matches!(self, DeviceSpec::Cuda(_))
    }

    /// True for a cubecl device (CUDA, wgpu), where `driver.residency = "auto"` keeps the state.
    pub(crate) fn is_cube(self) -> bool {
        matches!(self, DeviceSpec::Cuda(_) | DeviceSpec::Wgpu)
    }

    /// Opens the (autodiff) device for a process with `local_rank`.
    pub(crate) fn open(self, local_rank: usize) -> Result<Device> {
        match self {
            DeviceSpec::Cpu => Ok(Device::flex().autodiff()),
            DeviceSpec::LibTorch => open_libtorch(),
            DeviceSpec::Wgpu => open_wgpu(),
            DeviceSpec::Cuda(i) => open_cuda(i.unwrap_or(local_rank)),
        }
    }
}

#[cfg(feature = "tch")]
#[allow(deprecated)] // burn 0.22 deprecates burn-tch; it stays here as the benchmark's comparison backend
fn open_libtorch() -> Result<Device> {
    Ok(Device::libtorch().autodiff())
}

#[cfg(not(feature = "tch"))]
fn open_libtorch() -> Result<Device> {
    bail!(
        "--device libtorch: this qsr binary was built without LibTorch (feature `tch`, built against a Python environment's PyTorch 2.9.0: see `cargo xtask bench train`)"
    )
}

#[cfg(feature = "wgpu-plain")]
fn open_wgpu() -> Result<Device> {
    Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice).autodiff())
}

#[cfg(not(feature = "wgpu-plain"))]
fn open_wgpu() -> Result<Device> {
    bail!("--device wgpu: this qsr binary was built without wgpu (feature `wgpu` of qsr-train)")
}

/// What `probe_cuda` (feature `cuda`) found.
#[cfg(feature = "cuda-plain")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CudaProbe {
    /// Number of GPUs the CUDA driver reports.
    pub gpus: usize,
    /// The probed GPU's name as the driver reports it (`unknown GPU` if it cannot say).
    pub name: String,
}

/// Checks that GPU `ordinal` can be used: libcuda loads, the driver initialises, the GPU exists,
/// and NVRTC (which compiles the kernels at run time) loads.
#[cfg(feature = "cuda-plain")]
fn probe_cuda(ordinal: usize) -> Result<CudaProbe> {
    use cudarc::driver::CudaContext;
    let hint = "is this a machine with an NVIDIA GPU and driver?";
    qsr_comm::probe_library("cuda", &cudarc::get_lib_name_candidates("cuda"))
        .map_err(|e| anyhow::anyhow!("--device cuda:{ordinal}: {e} ({hint})"))?;
    let gpus = CudaContext::device_count()
        .map_err(|e| anyhow::anyhow!("--device cuda:{ordinal}: the CUDA driver failed to initialise: {e:?}"))?;
    let gpus = gpus.max(0) as usize;
    check_ordinal(ordinal, gpus)?;
    qsr_comm::probe_library("nvrtc", &cudarc::get_lib_name_candidates("nvrtc")).map_err(|e| {
        anyhow::anyhow!("--device cuda:{ordinal}: {e} (NVRTC compiles qsr's kernels at run time: install the CUDA runtime or the nvidia-cuda-nvrtc wheel, and set CUDA_PATH to a directory with the CUDA headers)")
    })?;
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| anyhow::anyhow!("--device cuda:{ordinal}: cannot create a CUDA context: {e:?}"))?;
    let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
    Ok(CudaProbe { gpus, name })
}

/// `ordinal` must name one of the `gpus` GPUs the driver reports.
#[cfg(any(feature = "cuda-plain", test))]
fn check_ordinal(ordinal: usize, gpus: usize) -> Result<()> {
    if gpus == 0 {
        bail!("--device cuda:{ordinal}: the CUDA driver loaded but reports no GPU");
    }
    if ordinal >= gpus {
        bail!("--device cuda:{ordinal}: this machine has {gpus} GPU(s) (cuda:0 to cuda:{})", gpus - 1);
    }
    Ok(())
}

#[cfg(feature = "cuda-plain")]
fn open_cuda(ordinal: usize) -> Result<Device> {
    let probe = probe_cuda(ordinal)?;
    tracing::info!(gpu = ordinal, name = %probe.name, gpus = probe.gpus, "using CUDA");
    Ok(Device::cuda(ordinal).autodiff())
}

#[cfg(not(feature = "cuda-plain"))]
fn open_cuda(ordinal: usize) -> Result<Device> {
    bail!(
        "--device cuda:{ordinal}: this qsr binary was built without CUDA support (build it with `cargo xtask cuda`, or `--features cuda` where burn's CUDA build can download its LLVM)"
    )
}

/// `qsr device-check`: the fused-averaging kernels on a GPU, against the host path and a copy.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct DeviceCheckArgs {
    /// The GPU (cuda:N).
    #[arg(long, default_value = "cuda:0")]
    pub device: String,
    /// Replicas averaged in the bandwidth measurement.
    #[arg(long, default_value_t = 4)]
    pub k: usize,
    /// MiB per replica in the bandwidth measurement.
    #[arg(long, default_value_t = 256)]
    pub mib: usize,
    /// Timed launches per kernel (the median is reported).
    #[arg(long, default_value_t = 20)]
    pub repeats: usize,
}

/// Lengths for the correctness sweep: every line size (odd, 2 mod 4, multiple of 4), tiny to 4 M.
#[cfg(feature = "cuda-plain")]
const CHECK_LENGTHS: [usize; 9] = [1, 2, 3, 4, 6, 1023, 1024, 1_000_003, 4 << 20];

/// Runs the check; `Ok(true)` when every case matched and the bandwidth goal (0.85 of a copy) was met.
pub(crate) fn device_check(args: &DeviceCheckArgs, out: &mut dyn std::io::Write) -> Result<bool> {
    let ordinal = check_args(args).map_err(crate::exit::bad_input)?;
    check_on_gpu(args, ordinal, out)
}

/// The GPU ordinal `args` name, or which flag is wrong.
fn check_args(args: &DeviceCheckArgs) -> Result<usize> {
    let spec = DeviceSpec::parse(&args.device)?;
    let Some(ordinal) = spec.ordinal(0) else {
        bail!("--device {}: device-check runs on a GPU (cuda:N)", args.device);
    };
    if args.k == 0 || args.k > 8 || args.mib == 0 {
        bail!("--k must be in 1..=8 and --mib at least 1 (got k {}, mib {})", args.k, args.mib);
    }
    // The kernels index K * len floats with 32 bits.
    if args.k.saturating_mul(args.mib).saturating_mul(1 << 18) > u32::MAX as usize {
        bail!("--k {} x --mib {} exceeds the kernels' 2^32 floats (16 GiB)", args.k, args.mib);
    }
    Ok(ordinal)
}

#[cfg(feature = "cuda-plain")]
fn check_on_gpu(args: &DeviceCheckArgs, ordinal: usize, out: &mut dyn std::io::Write) -> Result<bool> {
    use qsr_kernels::{check_correctness, measure_bandwidth};
    let probe = probe_cuda(ordinal)?;
    let client = qsr_kernels::cube::cuda_client(ordinal)?;
    writeln!(out, "device-check on cuda:{ordinal} ({}, {} GPU(s) visible)", probe.name, probe.gpus)?;
    let cases = check_correctness(&client, &CHECK_LENGTHS, 2024)?;
    let bad: Vec<_> = cases.iter().filter(|c| c.mismatches > 0).collect();
    writeln!(
        out,
        "correctness: {} cases (k 1..=8 x {} lengths, random data, NaN-filled outputs) vs host path: {} mismatching",
        cases.len(),
        CHECK_LENGTHS.len(),
        bad.len()
    )?;
    for c in &bad {
        writeln!(out, "  MISMATCH k {} len {} (line size {}): {} elements", c.k, c.len, c.vector_size, c.mismatches)?;
    }
    let len = args.mib * (1 << 20) / 4;
    let b = measure_bandwidth(&client, args.k, len, args.repeats, 7)?;
    writeln!(out, "| kernel | K x MiB | line | median ms | GB/s (read+write) |")?;
    writeln!(out, "|---|---|---|---|---|")?;
    writeln!(
        out,
        "| fused average-and-broadcast | {} x {} | {} | {:.3} | {:.0} |",
        b.k,
        args.mib,
        b.vector_size,
        b.fused_seconds * 1e3,
        b.fused_gbs()
    )?;
    writeln!(
        out,
        "| fused, K separate buffers (training) | {} x {} | {} | {:.3} | {:.0} |",
        b.k,
        args.mib,
        b.vector_size,
        b.many_seconds * 1e3,
        b.many_gbs()
    )?;
    writeln!(
        out,
        "| device copy, same bytes | {} x {} | {} | {:.3} | {:.0} |",
        b.k,
        args.mib,
        b.vector_size,
        b.copy_seconds * 1e3,
        b.copy_gbs()
    )?;
    let dtod = memcpy_dtod_seconds(ordinal, b.k * len, args.repeats)?;
    writeln!(
        out,
        "| cuMemcpyDtoD, same bytes | {} x {} | - | {:.3} | {:.0} |",
        b.k,
        args.mib,
        dtod * 1e3,
        b.bytes as f64 / dtod / 1e9
    )?;
    let ratio = dtod / b.fused_seconds;
    let many = dtod / b.many_seconds;
    writeln!(
        out,
        "fused / cuMemcpyDtoD bandwidth: {ratio:.3} slab, {many:.3} separate buffers (goal >= 0.85); fused / copy kernel: {:.3}; one launch per sync",
        b.ratio()
    )?;
    Ok(bad.is_empty() && ratio >= 0.85 && many >= 0.85)
}

/// Median seconds of a driver device-to-device copy of `floats` f32 (the copy engine's reference).
#[cfg(feature = "cuda-plain")]
fn memcpy_dtod_seconds(ordinal: usize, floats: usize, repeats: usize) -> Result<f64> {
    use cudarc::driver::CudaContext;
    let e = |what: &str, err: cudarc::driver::DriverError| anyhow::anyhow!("cuda:{ordinal}: {what}: {err:?}");
    let ctx = CudaContext::new(ordinal).map_err(|x| e("context", x))?;
    let stream = ctx.default_stream();
    let src = stream.alloc_zeros::<f32>(floats).map_err(|x| e("allocating the copy source", x))?;
    let mut dst = stream.alloc_zeros::<f32>(floats).map_err(|x| e("allocating the copy target", x))?;
    stream.memcpy_dtod(&src, &mut dst).map_err(|x| e("warm-up copy", x))?;
    stream.synchronize().map_err(|x| e("synchronize", x))?;
    let mut times = Vec::with_capacity(repeats.max(1));
    for _ in 0..repeats.max(1) {
        let t = std::time::Instant::now();
        stream.memcpy_dtod(&src, &mut dst).map_err(|x| e("copy", x))?;
        stream.synchronize().map_err(|x| e("synchronize", x))?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

#[cfg(not(feature = "cuda-plain"))]
fn check_on_gpu(_args: &DeviceCheckArgs, ordinal: usize, _out: &mut dyn std::io::Write) -> Result<bool> {
    // A build without CUDA is refused like a bad flag (exit status 2), as `qsr train` refuses it.
    open_cuda(ordinal).map(|_| false).map_err(crate::exit::bad_input)
}

/// Parses and opens `--device` for a single process (local rank 0).
pub(crate) fn device(name: &str) -> Result<Device> {
    DeviceSpec::parse(name)?.open(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_spelling() {
        assert_eq!(DeviceSpec::parse("cpu").unwrap(), DeviceSpec::Cpu);
        assert_eq!(DeviceSpec::parse("flex").unwrap(), DeviceSpec::Cpu);
        assert_eq!(DeviceSpec::parse("libtorch").unwrap(), DeviceSpec::LibTorch);
        assert_eq!(DeviceSpec::parse("wgpu").unwrap(), DeviceSpec::Wgpu);
        assert_eq!(DeviceSpec::parse("cuda").unwrap(), DeviceSpec::Cuda(None));
        assert_eq!(DeviceSpec::parse("cuda:3").unwrap(), DeviceSpec::Cuda(Some(3)));
    }

    #[test]
    fn bad_spellings_name_the_flag() {
        for bad in ["cuda:x", "cuda:", "cuda:-1", "gpu", "tpu:0"] {
            let e = DeviceSpec::parse(bad).unwrap_err().to_string();
            assert!(e.starts_with(&format!("--device {bad}:")), "{e}");
        }
    }

    #[cfg(not(feature = "tch"))]
    #[test]
    fn libtorch_without_its_feature_is_refused_naming_the_flag_and_feature() {
        let e = DeviceSpec::LibTorch.open(0).unwrap_err().to_string();
        assert!(e.starts_with("--device libtorch:") && e.contains("feature `tch`"), "{e}");
        assert_eq!(DeviceSpec::LibTorch.ordinal(1), None);
    }

    #[test]
    fn bare_cuda_follows_the_local_rank() {
        assert_eq!(DeviceSpec::Cuda(None).ordinal(2), Some(2));
        assert_eq!(DeviceSpec::Cuda(Some(0)).ordinal(2), Some(0));
        assert_eq!(DeviceSpec::Cpu.ordinal(2), None);
    }

    #[test]
    fn ordinals_are_checked_against_the_driver_count() {
        check_ordinal(0, 1).unwrap();
        check_ordinal(7, 8).unwrap();
        let e = check_ordinal(1, 1).unwrap_err().to_string();
        assert!(e.contains("has 1 GPU(s)") && e.contains("cuda:0 to cuda:0"), "{e}");
        assert!(check_ordinal(0, 0).unwrap_err().to_string().contains("reports no GPU"));
    }

    #[cfg(not(feature = "cuda-plain"))]
    #[test]
    fn a_cpu_build_refuses_cuda_with_the_fix() {
        let e = DeviceSpec::Cuda(Some(0)).open(0).unwrap_err().to_string();
        assert!(e.contains("built without CUDA support") && e.contains("cargo xtask cuda"), "{e}");
    }

    /// This is the path a CUDA build takes on a machine without a driver (CI, this machine).
    #[cfg(feature = "cuda-plain")]
    #[test]
    fn a_cuda_build_without_a_driver_says_so() {
        if qsr_comm::probe_library("cuda", &cudarc::get_lib_name_candidates("cuda")).is_ok() {
            return; // a GPU machine: nothing to check here
        }
        let e = DeviceSpec::Cuda(Some(0)).open(0).unwrap_err().to_string();
        assert!(e.contains("cannot load the cuda shared library") && e.contains("LD_LIBRARY_PATH"), "{e}");
    }
}
