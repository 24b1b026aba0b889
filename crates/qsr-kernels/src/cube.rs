//! cubecl kernels for the same fused averaging as the host path, for K replicas that live on a device.
//!
//! # Layout: one allocation of `K * len` floats
//!
//! The K workers' flat parameter replicas are one device buffer, replica `j` at elements
//! `[j * len, (j + 1) * len)`. One binding then carries any K, so a sync is **one launch** for
//! K in `1..=`[`MAX_BUFFERS`] with no per-K signature (cubecl kernels take a fixed list of
//! arguments) and no per-replica binding limits to hit. K is a comptime parameter: the K-way loop
//! unrolls into K independent loads, one kernel per K (compiled once, then cached by cubecl).
//!
//! # Vectorization
//!
//! Each unit moves a `Vector<f32, N>`. N is the widest of 4, 2, 1 that divides `len` (and that
//! the device lists for f32 IO): replica `j` starts at `j * len`, so only an N dividing `len`
//! keeps every replica's vectors aligned. A tail split into a second launch does not work with
//! this layout (replica 1 is misaligned whenever replica 0 has a tail), so the line size is
//! chosen from the length instead: still one launch, scalar loads only when `len` is odd.
//! A caller that wants the 4-wide path for every model pads its replica stride to a multiple of 4.
//!
//! # Determinism
//!
//! Element `i` is `((b_0[i] + b_1[i]) + ... + b_{K-1}[i]) / K` in f32: rank order, left to right,
//! and a true division by K (not a multiply by `1/K`, which rounds differently for K = 3, 5, 6, 7).
//! Lanes of a vector are independent, so this is exactly [`crate::mean_into`]'s arithmetic and
//! results are bit-identical to the host path where the device's f32 add/div are IEEE-rounded
//! (Vulkan on lavapipe, CUDA without fast-math). For K = 1 there is no division, as on the host.
//!
//! # Runtimes
//!
//! cubecl 0.11's [`Client`] is not generic over the runtime: the same functions launch on
//! whichever runtime produced the client (wgpu here, CUDA behind the `cuda` feature).

use cubecl::prelude::*;
use cubecl::server::{Handle, ServerError};

/// Largest K the kernels are instantiated for: one comptime-unrolled kernel per K keeps the
/// number of compiled variants (and register pressure) bounded.
pub const MAX_BUFFERS: usize = 8;

const F32_BYTES: usize = core::mem::size_of::<f32>();

/// Why a cube launch was refused (before anything ran) or its result could not be read.
#[derive(Debug)]
pub enum KernelError {
    /// `k == 0`: there is no mean of zero buffers.
    NoBuffers,
    /// `k` above [`MAX_BUFFERS`].
    TooManyBuffers {
        /// The K asked for.
        k: usize,
        /// [`MAX_BUFFERS`].
        max: usize,
    },
    /// A device buffer's size does not match the `k` and `len` it was launched with.
    LengthMismatch {
        /// Which buffer.
        what: &'static str,
        /// Its size for `k` and `len`.
        expected_bytes: u64,
        /// Its actual size.
        actual_bytes: u64,
    },
    /// A host-side input slice does not have `len` elements (the roundtrip helpers).
    HostLengthMismatch {
        /// Which slice: an input's position, or K (one past the inputs) for `mean_into_host`'s output.
        index: usize,
        /// Elements it must have.
        expected: usize,
        /// Elements it has.
        actual: usize,
    },
    /// `k * len` elements cannot be addressed by the kernels' 32-bit indices.
    TooLarge {
        /// `k * len`.
        elements: usize,
    },
    /// The runtime reported a failure (compilation, launch or a device fault) when reading back.
    Server(ServerError),
    /// The runtime or device could not be opened.
    Unavailable(String),
    /// A device result differs from what it must be (the device check's own verification).
    Mismatch(String),
}

impl core::fmt::Display for KernelError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::NoBuffers => write!(f, "mean of zero buffers (k == 0)"),
            Self::TooManyBuffers { k, max } => write!(f, "k = {k} buffers, at most {max} are supported"),
            Self::LengthMismatch { what, expected_bytes, actual_bytes } => {
                write!(f, "{what}: device buffer has {actual_bytes} bytes, k and len need {expected_bytes}")
            }
            Self::HostLengthMismatch { index, expected, actual } => {
                write!(f, "host buffer {index} has {actual} elements, expected {expected}")
            }
            Self::TooLarge { elements } => write!(f, "{elements} elements exceed 32-bit kernel indexing"),
            Self::Server(e) => write!(f, "cubecl runtime error: {e:?}"),
            Self::Unavailable(why) => write!(f, "device unavailable: {why}"),
            Self::Mismatch(what) => write!(f, "device result mismatch: {what}"),
        }
    }
}

impl std::error::Error for KernelError {}

impl From<ServerError> for KernelError {
    fn from(e: ServerError) -> Self {
        Self::Server(e)
    }
}

/// Mean of the K replicas in `data` written back to all K, in place: K reads and K writes per
/// element, the minimum, instead of a mean into a temporary and K copies.
///
/// `len` is the replica length in vectors; unit `i` owns vector `i` of every replica.
#[cube(launch_unchecked)]
fn average_and_broadcast_kernel<N: Size>(data: &mut [Vector<f32, N>], len: usize, #[comptime] k: usize) {
    let i = ABSOLUTE_POS;
    // The grid may be rounded up (and spread over y/z for large buffers): idle units exit here.
    if i < len {
        let mut acc = data[i];
        #[unroll]
        for j in 1..k {
            acc += data[j * len + i];
        }
        if comptime!(k > 1) {
            acc /= Vector::<f32, N>::new(comptime!(k as f32));
        }
        #[unroll]
        for j in 0..k {
            data[j * len + i] = acc;
        }
    }
}

/// Mean of the K replicas in `input` into `output` (`len` vectors), same arithmetic as above.
#[cube(launch_unchecked)]
fn mean_into_kernel<N: Size>(
    input: &[Vector<f32, N>],
    output: &mut [Vector<f32, N>],
    len: usize,
    #[comptime] k: usize,
) {
    let i = ABSOLUTE_POS;
    if i < len {
        let mut acc = input[i];
        #[unroll]
        for j in 1..k {
            acc += input[j * len + i];
        }
        if comptime!(k > 1) {
            acc /= Vector::<f32, N>::new(comptime!(k as f32));
        }
        output[i] = acc;
    }
}

/// The client of CUDA GPU `index`. Creating it initialises the driver: callers probe libcuda first
/// (a missing driver panics inside cudarc), and a panic here is turned into an error all the same.
#[cfg(feature = "cuda")]
pub fn cuda_client(index: usize) -> Result<Client, KernelError> {
    let device =
        cubecl::Device::cuda(index).map_err(|e| KernelError::Unavailable(format!("CUDA device {index}: {e:?}")))?;
    std::panic::catch_unwind(|| device.client()).map_err(|_| {
        KernelError::Unavailable(format!("creating the client of CUDA device {index} panicked (see above)"))
    })
}

/// The same average-and-broadcast over K **separate** buffers (one per replica, as burn allocates
/// each worker's flat parameter tensor), still one launch: the kernel takes [`MAX_BUFFERS`] buffer
/// arguments and K (comptime) says how many are real; the unused slots are bound to distinct
/// one-vector dummies that the kernel never touches. Same arithmetic as the slab kernel.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn average_and_broadcast_many_kernel<N: Size>(
    b0: &mut [Vector<f32, N>],
    b1: &mut [Vector<f32, N>],
    b2: &mut [Vector<f32, N>],
    b3: &mut [Vector<f32, N>],
    b4: &mut [Vector<f32, N>],
    b5: &mut [Vector<f32, N>],
    b6: &mut [Vector<f32, N>],
    b7: &mut [Vector<f32, N>],
    len: usize,
    #[comptime] k: usize,
) {
    let i = ABSOLUTE_POS;
    if i < len {
        let mut acc = b0[i];
        if comptime!(k > 1) {
            acc += b1[i];
        }
        if comptime!(k > 2) {
            acc += b2[i];
        }
        if comptime!(k > 3) {
            acc += b3[i];
        }
        if comptime!(k > 4) {
            acc += b4[i];
        }
        if comptime!(k > 5) {
            acc += b5[i];
        }
        if comptime!(k > 6) {
            acc += b6[i];
        }
        if comptime!(k > 7) {
            acc += b7[i];
        }
        if comptime!(k > 1) {
            acc /= Vector::<f32, N>::new(comptime!(k as f32));
        }
        b0[i] = acc;
        if comptime!(k > 1) {
            b1[i] = acc;
        }
        if comptime!(k > 2) {
            b2[i] = acc;
        }
        if comptime!(k > 3) {
            b3[i] = acc;
        }
        if comptime!(k > 4) {
            b4[i] = acc;
        }
        if comptime!(k > 5) {
            b5[i] = acc;
        }
        if comptime!(k > 6) {
            b6[i] = acc;
        }
        if comptime!(k > 7) {
            b7[i] = acc;
        }
    }
}

/// Replaces each of the K buffers in `buffers` (separate allocations of `len` f32 each, in rank
/// order) with their element-wise mean, in one launch; K reads and K writes per element.
///
/// # Errors
/// As [`average_and_broadcast`], with each buffer checked to hold `len` floats.
pub fn average_and_broadcast_many(client: &Client, buffers: &[Handle], len: usize) -> Result<(), KernelError> {
    let k = buffers.len();
    check_common(k, len)?;
    for b in buffers {
        check_size("average_and_broadcast_many buffer", b, len)?;
    }
    if k == 1 || len == 0 {
        return Ok(());
    }
    let n = vector_size(client, len);
    let vectors = len / n;
    let (count, dim) = grid(client, vectors);
    let mut args: Vec<Handle> = buffers.to_vec();
    while args.len() < MAX_BUFFERS {
        args.push(client.empty(n * F32_BYTES));
    }
    // SAFETY (for `from_raw_parts` and the launch): the K real buffers hold `len` floats each
    // (checked above) and the kernel indexes them below `vectors`; the dummies hold one vector and
    // are never indexed (K is comptime).
    let arg = |j: usize| {
        let vecs = if j < k { vectors } else { 1 };
        unsafe { BufferArg::from_raw_parts(args[j].clone(), vecs) }
    };
    unsafe {
        average_and_broadcast_many_kernel::launch_unchecked(
            client,
            count,
            dim,
            n,
            arg(0),
            arg(1),
            arg(2),
            arg(3),
            arg(4),
            arg(5),
            arg(6),
            arg(7),
            vectors,
            k,
        );
    }
    Ok(())
}

/// Waits until everything queued on `client` so far has run (and reports a device fault).
pub fn sync(client: &Client) -> Result<(), KernelError> {
    cubecl::future::block_on(client.sync())?;
    Ok(())
}

fn check_k(k: usize) -> Result<(), KernelError> {
    match k {
        0 => Err(KernelError::NoBuffers),
        k if k > MAX_BUFFERS => Err(KernelError::TooManyBuffers { k, max: MAX_BUFFERS }),
        _ => Ok(()),
    }
}

fn check_size(what: &'static str, handle: &Handle, elements: usize) -> Result<(), KernelError> {
    let expected_bytes = (elements * F32_BYTES) as u64;
    let actual_bytes = handle.size_in_used();
    if actual_bytes != expected_bytes {
        return Err(KernelError::LengthMismatch { what, expected_bytes, actual_bytes });
    }
    Ok(())
}

/// The line size for a replica of `len` floats: the widest of 4, 2, 1 dividing `len` that the
/// device lists for f32 IO (see the module docs for why a divisor of `len`).
pub fn vector_size(client: &Client, len: usize) -> usize {
    let supported: Vec<usize> = client.io_optimized_vector_sizes(F32_BYTES).collect();
    [4usize, 2].into_iter().find(|&n| len.is_multiple_of(n) && supported.contains(&n)).unwrap_or(1)
}

/// Grid for one unit per vector: [`CubeDim::new`] picks a cube size for the device, and the cube
/// count is spread over y/z when x alone would exceed the device limit.
fn grid(client: &Client, units: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(client, units);
    (cubecl::calculate_cube_count_elemwise(client, units, dim), dim)
}

fn check_common(k: usize, len: usize) -> Result<(), KernelError> {
    check_k(k)?;
    let elements = k.checked_mul(len).ok_or(KernelError::TooLarge { elements: usize::MAX })?;
    if elements > u32::MAX as usize {
        return Err(KernelError::TooLarge { elements });
    }
    Ok(())
}

/// Replaces each of the K replicas in `buffers` (one device buffer of `k * len` f32, replica `j` at
/// `[j * len, (j + 1) * len)`) with their element-wise mean, in one launch.
///
/// Asynchronous like any cubecl launch: the result is ordered before later reads of `buffers`.
/// `k == 1` and `len == 0` launch nothing (the mean of one buffer is itself).
///
/// # Errors
/// `k == 0`, `k >` [`MAX_BUFFERS`], a buffer whose size is not `k * len` floats, or more
/// than `u32::MAX` elements.
pub fn average_and_broadcast(client: &Client, buffers: &Handle, k: usize, len: usize) -> Result<(), KernelError> {
    check_common(k, len)?;
    check_size("average_and_broadcast buffers", buffers, k * len)?;
    if k == 1 || len == 0 {
        return Ok(());
    }
    let n = vector_size(client, len);
    let vectors = len / n;
    let (count, dim) = grid(client, vectors);
    // SAFETY: the buffer holds exactly `k * len` floats (checked above) and every index the
    // kernel forms is `j * vectors + i` with `j < k` and `i < vectors` (guarded in the kernel).
    unsafe {
        average_and_broadcast_kernel::launch_unchecked(
            client,
            count,
            dim,
            n,
            BufferArg::from_raw_parts(buffers.clone(), k * vectors),
            vectors,
            k,
        );
    }
    Ok(())
}

/// Writes the element-wise mean of the K replicas in `inputs` (`k * len` f32, layout as in
/// [`average_and_broadcast`]) into `output` (`len` f32), in one launch. `inputs` is not modified.
///
/// # Errors
/// As [`average_and_broadcast`], plus an `output` whose size is not `len` floats.
pub fn mean_into(client: &Client, output: &Handle, inputs: &Handle, k: usize, len: usize) -> Result<(), KernelError> {
    check_common(k, len)?;
    check_size("mean_into inputs", inputs, k * len)?;
    check_size("mean_into output", output, len)?;
    if len == 0 {
        return Ok(());
    }
    let n = vector_size(client, len);
    let vectors = len / n;
    let (count, dim) = grid(client, vectors);
    // SAFETY: sizes checked above; the kernel reads `j * vectors + i < k * vectors` and writes
    // `i < vectors`, both guarded by `i < vectors`.
    unsafe {
        mean_into_kernel::launch_unchecked(
            client,
            count,
            dim,
            n,
            BufferArg::from_raw_parts(inputs.clone(), k * vectors),
            BufferArg::from_raw_parts(output.clone(), vectors),
            vectors,
            k,
        );
    }
    Ok(())
}

fn concat(buffers: &[&[f32]]) -> Result<(usize, Vec<f32>), KernelError> {
    let len = buffers.first().map_or(0, |b| b.len());
    let mut flat = Vec::with_capacity(buffers.len() * len);
    for (index, b) in buffers.iter().enumerate() {
        if b.len() != len {
            return Err(KernelError::HostLengthMismatch { index, expected: len, actual: b.len() });
        }
        flat.extend_from_slice(b);
    }
    Ok((len, flat))
}

fn read_f32(client: &Client, handle: Handle) -> Result<Vec<f32>, KernelError> {
    let bytes = client.read_one(handle)?;
    Ok(f32::from_bytes(&bytes).to_vec())
}

/// Host roundtrip of [`average_and_broadcast`], for tests and benchmarks: uploads the buffers as
/// one `K * len` allocation, launches, and copies the result back into every buffer.
///
/// # Errors
/// As [`average_and_broadcast`], or buffers of different lengths.
pub fn average_and_broadcast_host(client: &Client, buffers: &mut [&mut [f32]]) -> Result<(), KernelError> {
    let k = buffers.len();
    check_k(k)?;
    let (len, flat) = {
        let views: Vec<&[f32]> = buffers.iter().map(|b| &**b).collect();
        concat(&views)?
    };
    if len == 0 {
        return Ok(());
    }
    let handle = client.create_from_slice(f32::as_bytes(&flat));
    average_and_broadcast(client, &handle, k, len)?;
    let out = read_f32(client, handle)?;
    for (j, b) in buffers.iter_mut().enumerate() {
        b.copy_from_slice(&out[j * len..(j + 1) * len]);
    }
    Ok(())
}

/// Host roundtrip of [`mean_into`], for tests and benchmarks. `output` must be as long as every
/// input. Its current contents are uploaded as the device output, so an element the kernel failed
/// to write comes back unchanged (tests pre-fill NaN to catch that).
///
/// # Errors
/// As [`mean_into`], or inputs/output of different lengths.
pub fn mean_into_host(client: &Client, output: &mut [f32], inputs: &[&[f32]]) -> Result<(), KernelError> {
    let k = inputs.len();
    check_k(k)?;
    let (len, flat) = concat(inputs)?;
    if output.len() != len {
        return Err(KernelError::HostLengthMismatch { index: k, expected: len, actual: output.len() });
    }
    if len == 0 {
        return Ok(());
    }
    let input = client.create_from_slice(f32::as_bytes(&flat));
    let out = client.create_from_slice(f32::as_bytes(output));
    mean_into(client, &out, &input, k, len)?;
    output.copy_from_slice(&read_f32(client, out)?);
    Ok(())
}

/// Counts the kernels cubecl launches in the whole process while it is alive, on any runtime and
/// from any thread (burn's fusion launches from its own server thread), per kernel name.
///
/// Sync the device before starting and before reading, so that queued work lands on the right side.
/// One count at a time: a second one replaces the first until dropped.
pub struct LaunchCount {
    tally: std::sync::Arc<Tally>,
    _observation: cubecl::logging::LaunchObservation,
}

/// One kernel's launches in a [`LaunchCount`].
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTally {
    /// The kernel's name, shortened as cubecl's profiling log shortens it.
    pub name: String,
    /// Launches counted.
    pub launches: u64,
    /// Seconds the kernels ran, summed ([`LaunchCount::start_timed`]; 0 otherwise).
    pub seconds: f64,
}

#[derive(Default)]
struct Tally {
    timed: bool,
    per_kernel: std::sync::Mutex<std::collections::HashMap<&'static str, (u64, f64)>>,
}

impl cubecl::logging::LaunchObserver for Tally {
    fn launched(&self, kernel: &'static str) {
        let mut per_kernel = self.per_kernel.lock().unwrap_or_else(|e| e.into_inner());
        per_kernel.entry(kernel).or_default().0 += 1;
    }

    fn timing(&self) -> cubecl::logging::TimingRequest {
        match self.timed {
            true => cubecl::logging::TimingRequest::Resolved,
            false => cubecl::logging::TimingRequest::None,
        }
    }

    fn timed(&self, kernel: &'static str, duration: cubecl::logging::Duration, _: cubecl::logging::TimingMethod) {
        let mut per_kernel = self.per_kernel.lock().unwrap_or_else(|e| e.into_inner());
        per_kernel.entry(kernel).or_default().1 += duration.as_secs_f64();
    }
}

impl LaunchCount {
    /// Starts counting.
    pub fn start() -> LaunchCount {
        Self::install(Tally::default())
    }

    /// Starts counting and timing each kernel. Each launch then waits for its kernel, so kernels run
    /// one at a time: right for where a step's device time goes, not for the step's time.
    pub fn start_timed() -> LaunchCount {
        Self::install(Tally { timed: true, ..Tally::default() })
    }

    fn install(tally: Tally) -> LaunchCount {
        let tally = std::sync::Arc::new(tally);
        let _observation = cubecl::logging::LaunchObservation::new(tally.clone());
        LaunchCount { tally, _observation }
    }

    /// Kernels launched since the start.
    pub fn launches(&self) -> u64 {
        self.tally.per_kernel.lock().unwrap_or_else(|e| e.into_inner()).values().map(|v| v.0).sum()
    }

    /// Each kernel launched since the start, the longest-running (then the most launched) first.
    pub fn kernels(&self) -> Vec<KernelTally> {
        let short = cubecl::config::TypeNameFormatLevel::Short;
        let per_kernel = self.tally.per_kernel.lock().unwrap_or_else(|e| e.into_inner());
        let mut all: Vec<KernelTally> = per_kernel
            .iter()
            .map(|(name, &(launches, seconds))| KernelTally {
                name: cubecl::config::type_name_format(name, short),
                launches,
                seconds,
            })
            .collect();
        all.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then(b.launches.cmp(&a.launches)));
        all
    }
}
