//! Collective communication for qsr.
//!
//! Local SGD moves one model-sized buffer per round and data-parallel SGD one per step; this crate
//! moves those buffers. It is the only crate of the project that opens sockets or calls MPI, it
//! knows nothing of models, and it moves flat `[f32]` buffers (plus small byte payloads).
//!
//! Backends, all behind the object-safe [`Collective`] trait:
//! - [`InProcessGroup`]: K handles for K threads of one process (simulated workers); reduction
//!   straight from shared memory, no sockets.
//! - [`TcpComm`]: our own ring all-reduce over TCP, for processes on one or many hosts, with
//!   rendezvous at `MASTER_ADDR:MASTER_PORT`, a checked handshake, bounded frames and timeouts
//!   (see [`TcpComm`] for the wire protocol). Its ranks share a job token, `QSR_JOB_TOKEN`
//!   ([`TcpConfig::token`]): set the same secret on every rank of an external launch whose ports
//!   other hosts can reach, or any process that reaches them can register as a rank (see
//!   [`TcpComm`], "The job token").
//! - [`ShmComm`]: processes (or threads) on one host reduce through a shared mapping in `/dev/shm`,
//!   set up over another collective of the same ranks; [`connect`] picks it by itself when every rank
//!   of a launch runs on one host (`QSR_TRANSPORT` chooses otherwise, see [`Transport`]).
//! - `MpiComm` (cargo feature `mpi`): MPI_Allreduce and friends through rsmpi, for `mpirun`/`srun`.
//! - `NcclComm` (cargo feature `nccl`): NCCL on CUDA device buffers, bootstrapped over a host
//!   collective with [`share_unique_id`].
//!
//! [`detect`] finds rank, world size and master address from explicit arguments, torchrun,
//! Open MPI / PMI or SLURM variables; [`agree()`] checks that every rank was configured alike.
//!
//! Invariants every backend keeps:
//! - every rank ends a collective with bit-identical buffers (a fixed reduction order per backend);
//! - every call carries a sequence number, and ranks whose call sequences diverge get an error
//!   rather than silently mixing different buffers;
//! - after any failure the communicator is broken: later calls return [`CommError::Broken`].

#![forbid(unsafe_op_in_unsafe_fn)]

// Private modules; every public item is re-exported once, below, at the crate root.
mod agree;
mod bootstrap;
mod connect;
mod error;
mod hier;
mod inproc;
mod launch_env;
mod shm;
mod status;
mod tcp;
mod util;
mod wire;

#[cfg(feature = "mpi")]
mod mpi_backend;
#[cfg(feature = "nccl")]
mod nccl;

pub use agree::{KeyDiff, agree, differing_keys};
pub use bootstrap::{probe_library, share_unique_id};
pub use connect::{Transport, connect, host_id, over_ring, split, split_by_host};
pub use error::CommError;
pub use inproc::{DEFAULT_TIMEOUT, InProcessComm, InProcessGroup};
pub use launch_env::{
    DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, Explicit, LaunchEnv, Source, detect, detect_from_process_env, first_host,
};
pub use shm::{ShmComm, ShmConfig};
pub use tcp::{
    MAX_TIMEOUT_SECS, MasterListener, RingSeat, TcpComm, TcpConfig, Waiting, random_token, resolve, seconds,
};
pub use util::notice;
pub use wire::MAX_HOST_LEN;

#[cfg(feature = "mpi")]
pub use mpi_backend::MpiComm;
#[cfg(feature = "nccl")]
pub use nccl::{NcclComm, probe_libraries};

pub use qsr_kernels::Codec;
use serde::{Deserialize, Serialize};

/// The reduction applied by [`Collective::all_reduce`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    /// Element-wise sum over ranks.
    Sum,
    /// Element-wise sum divided by the world size (computed as `sum / K`, so `mean == sum / K`
    /// holds bit for bit).
    Mean,
}

impl ReduceOp {
    pub(crate) fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Mean => 1,
        }
    }
}

/// A codec's name in messages and settings: `int8`, `fp8`.
pub fn codec_name(codec: Codec) -> &'static str {
    match codec {
        Codec::Int8 => "int8",
        Codec::Fp8E4m3 => "fp8",
    }
}

/// `x` rounded to bf16 (round to nearest even), as the f32 it stands for.
pub(crate) fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// Which collective a call is; carried in frames and compared across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum CallKind {
    AllReduce,
    Broadcast,
    Barrier,
    BroadcastBytes,
}

impl CallKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            CallKind::AllReduce => "all_reduce",
            CallKind::Broadcast => "broadcast",
            CallKind::Barrier => "barrier",
            CallKind::BroadcastBytes => "broadcast_bytes",
        }
    }
}

/// Cumulative traffic and time of one communicator, for the trainer's communication accounting.
///
/// Byte counts are payload bytes this rank put on / took off the wire (frame headers excluded).
/// The in-process group moves nothing over a wire; it reports what a ring all-reduce of the same
/// buffer would move, so simulated and real runs account communication the same way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct CommStats {
    /// Collective calls completed (successfully or not).
    pub calls: u64,
    /// Payload bytes this rank sent, headers excluded.
    pub bytes_sent: u64,
    /// Payload bytes this rank received, headers excluded.
    pub bytes_received: u64,
    /// Wall time spent inside collective calls.
    pub seconds: f64,
}

impl CommStats {
    /// The traffic between an earlier snapshot and now (per-round or per-call accounting).
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        CommStats {
            calls: self.calls.saturating_sub(earlier.calls),
            bytes_sent: self.bytes_sent.saturating_sub(earlier.bytes_sent),
            bytes_received: self.bytes_received.saturating_sub(earlier.bytes_received),
            seconds: (self.seconds - earlier.seconds).max(0.0),
        }
    }

    pub(crate) fn record(&mut self, sent: u64, received: u64, seconds: f64) {
        self.calls += 1;
        self.bytes_sent += sent;
        self.bytes_received += received;
        self.seconds += seconds;
    }
}

/// A group of ranks that reduce and broadcast flat buffers together.
///
/// Every rank must make the same sequence of calls with the same lengths, ops and roots; a rank
/// that diverges makes the call fail on every rank it reaches (never a silent mix of buffers).
/// Object safe: the trainer holds a `Box<dyn Collective>`.
pub trait Collective: Send {
    /// This process's (or thread's) rank, `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world_size(&self) -> usize;
    /// Replaces `buf` on every rank with the element-wise sum (or mean) over ranks; all ranks
    /// end with bit-identical buffers.
    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError>;
    /// [`all_reduce`](Self::all_reduce) with the payload carried as bf16: each hop adds in f32 what it
    /// received to its own f32 values and sends the partial sum rounded to bf16 (round to nearest
    /// even), and the result, rounded to bf16, is what every rank ends with, bit-identical; half the
    /// bytes of the f32 call. With one rank the buffer is unchanged. Backends without it refuse with
    /// [`CommError::Unsupported`] (the default).
    fn all_reduce_bf16(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let _ = (buf, op);
        Err(CommError::Unsupported { backend: self.backend(), what: "a bf16 all-reduce".into() })
    }
    /// Whether [`all_reduce_bf16`](Self::all_reduce_bf16) is offered (so a caller can refuse a bf16
    /// setting before training rather than at its first sync). Default false.
    fn supports_bf16(&self) -> bool {
        false
    }
    /// [`all_reduce`](Self::all_reduce) with the payload carried as one byte per value (`codec`: int8
    /// or fp8 e4m3) plus one f32 scale per block of [`qsr_kernels::WIRE_BLOCK`] values, 0.266 of the
    /// f32 call's bytes. Each hop decodes the partial sum it received, adds its own f32 values in f32
    /// and sends the sum quantized again; the rank that completes a segment divides by K for a mean
    /// and quantizes once more, and every rank ends with what those bytes decode to, bit-identical.
    /// What quantization drops is lost here: error feedback is the caller's, who knows what it sends
    /// from one call to the next. With one rank the buffer is unchanged. Backends without it refuse
    /// with [`CommError::Unsupported`] (the default).
    fn all_reduce_quantized(&mut self, buf: &mut [f32], op: ReduceOp, codec: Codec) -> Result<(), CommError> {
        let _ = (buf, op);
        let what = format!("an {} all-reduce", codec_name(codec));
        Err(CommError::Unsupported { backend: self.backend(), what })
    }
    /// Whether [`all_reduce_quantized`](Self::all_reduce_quantized) is offered. Default false.
    fn supports_quantized(&self) -> bool {
        false
    }
    /// Copies `root`'s `buf` into every other rank's `buf` (same length on every rank).
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError>;
    /// Copies `root`'s byte payload to every rank; non-roots' `bytes` are resized to match. For
    /// small payloads such as a job config or an NCCL unique id.
    fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<(), CommError>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&mut self) -> Result<(), CommError>;
    /// Cumulative traffic and time.
    fn stats(&self) -> &CommStats;
    /// Short backend name for logs ("inproc", "shm", "tcp", "shm+tcp", "mpi", "nccl").
    fn backend(&self) -> &'static str;
}

/// The exit status with which a rank says it stopped only because another rank failed (a peer died,
/// stalled or aborted): launchers (`qsr launch`, `qsr train --nproc`) then name the rank that failed
/// first instead of this one. qsr's trainer exits with it; a program run under `qsr launch` should too
/// when a [`CommError`] tells it a peer failed (nothing here exits for it).
pub const EXIT_PEER_FAILED: u8 = 3;

/// The collective of this process's launch, for library users: our collectives ([`connect`]: shared
/// memory among ranks of one host, the TCP ring between hosts, as `QSR_TRANSPORT` says) when a
/// launcher started several processes (torchrun's `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`,
/// Open MPI's or PMI's mpirun, SLURM's srun; see [`detect`] and [`TcpConfig::from_env`] for the
/// variables read, `QSR_JOB_TOKEN` among them), MPI itself under mpirun when built with the `mpi`
/// feature, or a group of one for a plain process. A partial launch environment is an error naming
/// the missing variable.
pub fn from_env() -> Result<Box<dyn Collective>, CommError> {
    let env = detect_from_process_env(&Explicit::default())?;
    #[cfg(feature = "mpi")]
    if matches!(env.source, Source::OpenMpi | Source::Pmi) && env.world_size > 1 {
        return Ok(Box::new(MpiComm::init()?));
    }
    if env.world_size == 1 {
        return Ok(Box::new(InProcessGroup::new(1).remove(0)));
    }
    let var = |k: &str| std::env::var(k).ok();
    connect(&env, TcpConfig::from_env(&var)?, Transport::from_env(&var)?)
}

/// Runs `worker` on `k` threads of this process, each with its handle of one in-process group (rank
/// `0..k`), and returns their results in rank order: K simulated workers in one call. A panic in a
/// worker is resumed on the caller's thread. `T` crosses threads: a worker's error type must be `Send`
/// (`anyhow::Error`, or `Box<dyn Error + Send + Sync>`; not `Box<dyn Error>`).
pub fn run_threads<T: Send>(k: usize, worker: impl Fn(InProcessComm) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let worker = &worker;
        let joins: Vec<_> = InProcessGroup::new(k).into_iter().map(|c| s.spawn(move || worker(c))).collect();
        joins.into_iter().map(|j| j.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    })
}

/// Runs `worker` for each rank this process holds: the one rank of a launched job when a launcher
/// started it (`qsr launch`, torchrun, mpirun, srun: the collective of [`from_env`]), else `threads`
/// ranks as threads of one in-process group ([`run_threads`]). Results come back in rank order. The
/// same program then runs as threads (`cargo run`) and as processes (`qsr launch --nproc 4 -- ...`);
/// `T` crosses threads, so a worker's error type must be `Send` (`anyhow::Error` is; `Box<dyn Error>`
/// is not, `Box<dyn Error + Send + Sync>` is).
///
/// ```
/// let ranks = qsr_comm::run_workers(3, |comm| (comm.rank(), comm.world_size())).unwrap();
/// assert_eq!(ranks, [(0, 3), (1, 3), (2, 3)]); // no launcher here: three threads
/// ```
pub fn run_workers<T: Send>(
    threads: usize,
    worker: impl Fn(Box<dyn Collective>) -> T + Sync,
) -> Result<Vec<T>, CommError> {
    if detect_from_process_env(&Explicit::default())?.source == Source::Single {
        Ok(run_threads(threads, |c| worker(Box::new(c))))
    } else {
        Ok(vec![worker(from_env()?)])
    }
}

/// A boxed collective is a collective, so generic code can take `Box<dyn Collective>`.
impl<C: Collective + ?Sized> Collective for Box<C> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world_size(&self) -> usize {
        (**self).world_size()
    }
    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        (**self).all_reduce(buf, op)
    }
    fn all_reduce_bf16(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        (**self).all_reduce_bf16(buf, op)
    }
    fn supports_bf16(&self) -> bool {
        (**self).supports_bf16()
    }
    fn all_reduce_quantized(&mut self, buf: &mut [f32], op: ReduceOp, codec: Codec) -> Result<(), CommError> {
        (**self).all_reduce_quantized(buf, op, codec)
    }
    fn supports_quantized(&self) -> bool {
        (**self).supports_quantized()
    }
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        (**self).broadcast(buf, root)
    }
    fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        (**self).broadcast_bytes(bytes, root)
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        (**self).barrier()
    }
    fn stats(&self) -> &CommStats {
        (**self).stats()
    }
    fn backend(&self) -> &'static str {
        (**self).backend()
    }
}

/// Bytes one rank sends (and receives) in a ring all-reduce of `len` elements over `k` ranks: `2 (k-1)/k`
/// of the buffer. Every backend accounts its all-reduce traffic with this (as qsr-sched plans it), so
/// simulated, TCP and NCCL runs report comparable bytes.
/// Elements are `elem_bytes` bytes on the wire (4 for f32, 2 for bf16).
pub(crate) fn ring_allreduce_bytes(len: usize, elem_bytes: u64, k: usize) -> u64 {
    if k <= 1 {
        return 0;
    }
    (len as u64 * elem_bytes) * 2 * (k as u64 - 1) / k as u64
}

/// Largest payload `broadcast_bytes` accepts (a bound on what a peer can make us allocate).
pub const MAX_BROADCAST_BYTES: usize = 256 << 20;

/// `broadcast_bytes` over a raw byte broadcast `raw(buf, is_length)`: the length first (even when
/// too large, so that every rank checks it against [`MAX_BROADCAST_BYTES`] and fails alike), then
/// the payload into `bytes`, resized on non-roots. A payload over the bound is
/// `CommError::InvalidArgument` on every rank; the caller marks itself broken on any error.
pub(crate) fn broadcast_sized(
    bytes: &mut Vec<u8>,
    root: usize,
    rank: usize,
    mut raw: impl FnMut(&mut [u8], bool) -> Result<(), CommError>,
) -> Result<(), CommError> {
    let mut len = (bytes.len() as u64).to_le_bytes();
    raw(&mut len, true)?;
    let len = u64::from_le_bytes(len);
    if len > MAX_BROADCAST_BYTES as u64 {
        let e = format!("rank {root} broadcasts {len} bytes, more than the bound {MAX_BROADCAST_BYTES}");
        return Err(CommError::InvalidArgument(e));
    }
    if rank != root {
        bytes.clear();
        bytes.resize(len as usize, 0);
    }
    raw(bytes, false)
}

/// Balanced split of `len` elements into `parts` contiguous ranges: the first `len % parts` ranges
/// get one extra element. Shared by the in-process and ring backends.
pub(crate) fn split_range(len: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    let base = len / parts;
    let rem = len % parts;
    let start = i * base + i.min(rem);
    let size = base + usize::from(i < rem);
    start..start + size
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_range_covers_everything_once() {
        for len in [0usize, 1, 2, 3, 7, 10, 1000, 1001] {
            for parts in 1..=7 {
                let mut next = 0;
                for i in 0..parts {
                    let r = split_range(len, parts, i);
                    assert_eq!(r.start, next, "len {len} parts {parts} i {i}");
                    next = r.end;
                    assert!(r.len() <= len / parts + 1);
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn stats_since_subtracts() {
        let mut s = CommStats::default();
        s.record(10, 20, 1.5);
        let snap = s;
        s.record(1, 2, 0.5);
        let d = s.since(&snap);
        assert_eq!((d.calls, d.bytes_sent, d.bytes_received), (1, 1, 2));
        assert!((d.seconds - 0.5).abs() < 1e-12);
        let json = serde_json::to_string(&s).unwrap();
        assert!(json.contains("\"bytes_sent\":11"), "{json}");
    }
}
