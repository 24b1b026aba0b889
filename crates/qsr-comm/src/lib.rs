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
mod collective;
mod connect;
mod error;
mod exit;
mod first;
mod hier;
mod inproc;
mod launch_env;
mod shm;
mod status;
mod tcp;
mod util;
mod wire;
mod workers;

#[cfg(feature = "mpi")]
mod mpi_backend;
#[cfg(feature = "nccl")]
mod nccl;

pub use agree::{KeyDiff, agree, differing_keys};
pub use bootstrap::{probe_library, share_unique_id};
pub(crate) use collective::CallKind;
pub use collective::{Collective, CommStats, ReduceOp, SyncTag, codec_name};
pub use connect::{Transport, connect, host_id, over_ring, split, split_by_host};
pub use error::CommError;
pub use exit::{EXIT_PEER_FAILED, FAILURE_FILE, FailureRecord, exit_code, exit_status, record_failure};
pub use inproc::{DEFAULT_TIMEOUT, InProcessComm, InProcessGroup};
pub use launch_env::{
    DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, Explicit, LaunchEnv, Source, detect, detect_from_process_env, first_host,
};
pub use qsr_notice::{notice, notices_on_stderr};
pub use shm::{ShmComm, ShmConfig};
pub use tcp::{
    MAX_TIMEOUT_SECS, MasterListener, RingSeat, TcpComm, TcpConfig, WaitProgress, random_token, resolve, seconds,
};
pub use util::MAX_BROADCAST_BYTES;
pub(crate) use util::{bf16_round, broadcast_sized, ring_allreduce_bytes, split_range};
pub use wire::MAX_HOST_LEN;
pub use workers::{WorkerError, try_run_workers};

#[cfg(feature = "mpi")]
pub use mpi_backend::MpiComm;
#[cfg(feature = "nccl")]
pub use nccl::{NcclComm, probe_libraries};

pub use qsr_kernels::Codec;

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
        // Named by rank: a panic says `thread 'rank 2' panicked`.
        let spawn = |c: InProcessComm| {
            std::thread::Builder::new().name(format!("rank {}", c.rank())).spawn_scoped(s, move || worker(c))
        };
        let joins: Vec<_> = InProcessGroup::new(k).into_iter().map(spawn).collect();
        joins
            .into_iter()
            .map(|j| j.expect("cannot start a worker thread").join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// The environment variable that sets how many threads [`run_workers`] runs without a launcher,
/// in place of the count the program gives: `QSR_WORKERS=8 cargo run ...`.
pub const WORKERS_ENV: &str = "QSR_WORKERS";

/// Runs `worker` for each rank this process holds: the one rank of a launched job when a launcher
/// started it (`qsr launch`, torchrun, mpirun, srun: the collective of [`from_env`]), else `threads`
/// ranks as threads of one in-process group ([`run_threads`]), or as many as [`WORKERS_ENV`] says when
/// set. Results come back in rank order. The same program then runs as threads (`cargo run`) and as
/// processes (`qsr launch --nproc 4 -- ...`); `T` crosses threads, so a worker's error type must be
/// `Send` (`anyhow::Error` is; `Box<dyn Error>` is not, `Box<dyn Error + Send + Sync>` is).
/// As threads, a rank that fails holds its own error in its slot, and the others' errors say that
/// the group broke, naming it: [`try_run_workers`] picks the cause out of them.
///
/// As threads, rank 0 runs alone until its first collective call (or its return), and the other
/// ranks start then: what rank 0 draws before it communicates from a RNG every thread shares
/// (burn's, which draws initial weights) depends on its seed alone, so a rerun starts rank 0, and
/// through qsr's initial broadcast every rank, from the same weights.
///
/// ```
/// let ranks = qsr_comm::run_workers(3, |comm| (comm.rank(), comm.world_size())).unwrap();
/// assert_eq!(ranks, [(0, 3), (1, 3), (2, 3)]); // no launcher here: three threads
/// ```
pub fn run_workers<T: Send>(
    threads: usize,
    worker: impl Fn(Box<dyn Collective>) -> T + Sync,
) -> Result<Vec<T>, CommError> {
    match unlaunched_threads(threads)? {
        Some(threads) => {
            let latch = std::sync::Arc::new(first::Latch::default());
            Ok(run_threads(threads, |c| match c.rank() {
                0 => {
                    let _open = first::OpenOnDrop(latch.clone());
                    worker(Box::new(first::FirstCall::new(c, latch.clone())))
                }
                _ => {
                    latch.wait();
                    worker(Box::new(c))
                }
            }))
        }
        None => Ok(vec![worker(from_env()?)]),
    }
}

/// How [`run_workers`] places ranks: `None` when a launcher started this process (it is one rank of
/// the launched job, [`from_env`]), else the ranks it runs as threads: `threads`, or as many as
/// [`WORKERS_ENV`] says when set (a bad value is refused naming it). For programs that place their
/// workers themselves (qsr-burn-train's `Replicas::from_env`).
pub fn unlaunched_threads(threads: usize) -> Result<Option<usize>, CommError> {
    if detect_from_process_env(&Explicit::default())?.source != Source::Single {
        return Ok(None);
    }
    thread_count(threads, std::env::var(WORKERS_ENV).ok().as_deref()).map(Some)
}

/// The threads [`run_workers`] runs: [`WORKERS_ENV`]'s value `from_env` when set, else `threads`.
fn thread_count(threads: usize, from_env: Option<&str>) -> Result<usize, CommError> {
    let invalid = |detail: String| CommError::Launch { var: WORKERS_ENV.into(), detail };
    let n = match from_env {
        Some(text) => {
            text.trim().parse::<usize>().map_err(|e| invalid(format!("{WORKERS_ENV}=`{text}` is not a count: {e}")))?
        }
        None => threads,
    };
    if !(1..=MAX_THREADS).contains(&n) {
        return Err(invalid(format!("{WORKERS_ENV}: {n} threads, where 1 to {MAX_THREADS} run")));
    }
    Ok(n)
}

/// The most threads [`run_workers`] starts: more is a typo, not a machine.
const MAX_THREADS: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 57: the thread count comes from `QSR_WORKERS` when set, and a bad value is refused
    /// naming the variable.
    #[test]
    fn the_workers_variable_sets_the_thread_count_or_is_refused_naming_it() {
        assert_eq!(thread_count(4, None).unwrap(), 4);
        assert_eq!(thread_count(4, Some("8")).unwrap(), 8);
        assert_eq!(thread_count(4, Some(" 2\n")).unwrap(), 2);
        for bad in ["", "four", "-1", "0", "100000"] {
            let e = thread_count(4, Some(bad)).unwrap_err().to_string();
            assert!(e.contains("QSR_WORKERS"), "{bad:?}: {e}");
        }
        assert!(thread_count(0, None).is_err(), "no threads at all");
    }

    /// Issue 57: rank 0 runs alone until it first communicates, so its draws from burn's shared RNG
    /// (initial weights) depend on its seed alone; a rank 0 that never communicates holds no one.
    #[test]
    fn threads_start_after_rank_0_first_communicates() {
        let events = std::sync::Mutex::new(Vec::new());
        let log = |e: String| events.lock().unwrap().push(e);
        run_workers(4, |mut comm| {
            let rank = comm.rank();
            log(format!("{rank} starts"));
            if rank == 0 {
                std::thread::sleep(std::time::Duration::from_millis(50));
                log("0 drew its weights".into());
            }
            comm.barrier().unwrap();
        })
        .unwrap();
        let events = events.into_inner().unwrap();
        assert_eq!(events[..2], ["0 starts", "0 drew its weights"], "{events:?}");
        assert_eq!(events.len(), 5, "{events:?}");
        let silent = run_workers(3, |comm| comm.rank()).unwrap();
        assert_eq!(silent, [0, 1, 2]);
    }

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
