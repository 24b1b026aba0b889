//! MPI backend (cargo feature `mpi`), documented on [`MpiComm`].

use std::thread::ThreadId;
use std::time::Instant;

use mpi::Threading;
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use crate::{CallKind, Collective, CommError, CommStats, MAX_BROADCAST_BYTES, ReduceOp};

/// One rank of an MPI world (cargo feature `mpi`): runs launched by `mpirun` or `srun` use the
/// system MPI's collectives through rsmpi.
///
/// Before every call the ranks compare (sequence number, kind, length, op, root) with one tiny
/// `MPI_Allreduce(MPI_MAX)` over the values and their negations (max and -min in one call): ranks
/// whose call sequences diverged get an error naming the field instead of MPI mixing buffers of
/// different lengths or hanging in mismatched collectives. The cost is one 80-byte all-reduce per
/// call, noise next to a model-sized buffer.
///
/// Failures of a peer process are MPI's business: with the default error handler the MPI runtime
/// aborts the whole job (mpirun/srun report which rank died).
///
/// Threading: MPI is initialised with `MPI_THREAD_SERIALIZED` when available, so the handle may
/// move between threads (calls are serialised by `&mut self`). If the library only provides
/// `FUNNELED` or less, calls from a thread other than the initialising one are refused. Drop the
/// handle (which finalises MPI) on the thread that created it.
pub struct MpiComm {
    world: SimpleCommunicator,
    rank: usize,
    n: usize,
    seq: u64,
    stats: CommStats,
    broken: Option<String>,
    scratch: Vec<f32>,
    init_thread: ThreadId,
    threading: Threading,
    // Last: finalises MPI when dropped, after the communicator.
    _universe: Universe,
}

// SAFETY: the raw MPI handles inside `SimpleCommunicator` are plain identifiers; MPI allows using
// them from any thread under MPI_THREAD_SERIALIZED, which we request, and `check_thread` refuses
// calls from other threads when the library provides less. `&mut self` serialises all calls.
unsafe impl Send for MpiComm {}

impl MpiComm {
    /// Initialises MPI (once per process) and returns this process's handle on MPI_COMM_WORLD.
    pub fn init() -> Result<MpiComm, CommError> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| CommError::Mpi("MPI is already initialised in this process".into()))?;
        let world = universe.world();
        let rank = world.rank() as usize;
        let n = world.size() as usize;
        Ok(MpiComm {
            world,
            rank,
            n,
            seq: 0,
            stats: CommStats::default(),
            broken: None,
            scratch: Vec::new(),
            init_thread: std::thread::current().id(),
            threading,
            _universe: universe,
        })
    }

    /// The thread support level the MPI library granted.
    pub fn threading(&self) -> Threading {
        self.threading
    }

    fn check_thread(&self) -> Result<(), CommError> {
        let serialized_ok = matches!(self.threading, Threading::Serialized | Threading::Multiple);
        if !serialized_ok && std::thread::current().id() != self.init_thread {
            return Err(CommError::Mpi(format!(
                "the MPI library provides only {:?}; call collectives from the thread that initialised MPI",
                self.threading
            )));
        }
        Ok(())
    }

    /// Compares the call's identity across ranks (see the module docs).
    fn agree(&mut self, kind: CallKind, len: usize, op: Option<ReduceOp>, root: usize) -> Result<u64, CommError> {
        if let Some(b) = &self.broken {
            return Err(CommError::Broken(b.clone()));
        }
        self.check_thread()?;
        let seq = self.seq;
        self.seq += 1;
        if self.n == 1 {
            return Ok(seq);
        }
        let kind_code = match kind {
            CallKind::AllReduce => 1i64,
            CallKind::Broadcast => 2,
            CallKind::Barrier => 3,
            CallKind::BroadcastBytes => 4,
        };
        let op_code = op.map_or(-1, |o| i64::from(o.code()));
        let fields: [(&'static str, i64); 5] = [
            ("sequence number", seq as i64),
            ("call", kind_code),
            ("length", len as i64),
            ("reduce op", op_code),
            ("root", root as i64),
        ];
        let mut probe = [0i64; 10];
        for (i, (_, v)) in fields.iter().enumerate() {
            probe[2 * i] = *v;
            probe[2 * i + 1] = -*v;
        }
        let mut out = [0i64; 10];
        self.world.all_reduce_into(&probe[..], &mut out[..], SystemOperation::max());
        for (i, (field, v)) in fields.iter().enumerate() {
            let (max, min) = (out[2 * i], -out[2 * i + 1]);
            if max != min {
                let e = format!(
                    "the ranks' calls differ in {field} during {} (this is rank {}, value {v}; values across ranks range {min}..={max})",
                    kind.name(),
                    self.rank
                );
                self.broken = Some(e.clone());
                return Err(CommError::Mpi(e));
            }
        }
        Ok(seq)
    }
}

impl Collective for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.n
    }

    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let start = Instant::now();
        self.agree(CallKind::AllReduce, buf.len(), Some(op), 0)?;
        if self.n > 1 && !buf.is_empty() {
            // rsmpi has no MPI_IN_PLACE: reduce from a copy into the caller's buffer.
            self.scratch.clear();
            self.scratch.extend_from_slice(buf);
            self.world.all_reduce_into(&self.scratch[..], buf, SystemOperation::sum());
            if op == ReduceOp::Mean {
                let k = self.n as f32;
                buf.iter_mut().for_each(|x| *x /= k);
            }
        }
        let bytes = (buf.len() * 4) as u64;
        let v = bytes * 2 * (self.n as u64 - 1) / self.n as u64;
        self.stats.record(v, v, start.elapsed().as_secs_f64());
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        crate::inproc::check_root(root, self.n)?;
        let start = Instant::now();
        self.agree(CallKind::Broadcast, buf.len(), None, root)?;
        if self.n > 1 && !buf.is_empty() {
            self.world.process_at_rank(root as i32).broadcast_into(buf);
        }
        let bytes = (buf.len() * 4) as u64;
        let (s, r) = if self.rank == root { (bytes, 0) } else { (0, bytes) };
        self.stats.record(s, r, start.elapsed().as_secs_f64());
        Ok(())
    }

    fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        crate::inproc::check_root(root, self.n)?;
        let start = Instant::now();
        self.agree(CallKind::BroadcastBytes, 0, None, root)?;
        if self.n > 1 {
            let mut len = bytes.len() as u64;
            self.world.process_at_rank(root as i32).broadcast_into(&mut len);
            if len > MAX_BROADCAST_BYTES as u64 {
                let e = format!("rank {root} broadcasts {len} bytes, more than the bound {MAX_BROADCAST_BYTES}");
                self.broken = Some(e.clone());
                return Err(CommError::InvalidArgument(e));
            }
            if self.rank != root {
                bytes.clear();
                bytes.resize(len as usize, 0);
            }
            if len > 0 {
                self.world.process_at_rank(root as i32).broadcast_into(&mut bytes[..]);
            }
        }
        let n = bytes.len() as u64;
        let (s, r) = if self.rank == root { (n, 0) } else { (0, n) };
        self.stats.record(s, r, start.elapsed().as_secs_f64());
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let start = Instant::now();
        self.agree(CallKind::Barrier, 0, None, 0)?;
        if self.n > 1 {
            self.world.barrier();
        }
        self.stats.record(0, 0, start.elapsed().as_secs_f64());
        Ok(())
    }

    fn stats(&self) -> &CommStats {
        &self.stats
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }
}
