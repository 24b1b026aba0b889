//! NCCL backend (cargo feature `nccl`), documented on [`NcclComm`].

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp as NcclOp};

use crate::bootstrap::{probe_library, share_unique_id};
use crate::collective::tag_name;
use crate::{CallKind, Collective, CommError, CommStats, MAX_BROADCAST_BYTES, ReduceOp, SyncTag};

/// One rank of an NCCL communicator on one GPU (cargo feature `nccl`): one process per GPU,
/// collectives on device buffers.
///
/// Bootstrap: rank 0 creates the NCCL unique id and sends it over the host [`Collective`] the launch
/// produced (our TCP rendezvous under `qsr train --nproc`, torchrun variables, mpirun or srun), see
/// [`share_unique_id`]; NCCL needs no launcher of its own.
///
/// Libraries: libcuda and libnccl are loaded at run time (cudarc's dynamic loading), so this builds
/// without a CUDA toolkit. They are probed before cudarc touches them, so a missing library is a
/// [`CommError::LibraryMissing`] naming it rather than a panic inside cudarc.
///
/// Host-slice calls wait for their copies (a stream synchronize after each download).
///
/// Two APIs:
/// - [`NcclComm::all_reduce_device`]: in place on a device buffer, `ncclAvg` for the mean, for
///   callers that hold cudarc buffers (qsr's device-resident workers stage through the host API
///   across processes today: burn's buffers are cubecl's, not cudarc's);
/// - the [`Collective`] impl on host slices (copy in, reduce, copy out), so the round driver and
///   trainer work unchanged. There the mean is NCCL's sum divided by K on the host, which keeps the
///   crate-wide `mean == sum / K` bit identity (`ncclAvg` pre-multiplies by `1/K`).
///
/// Before every host-slice collective the ranks compare the call's sync tag (whether it has one, its
/// steps, `H` and fragment) and its identity (sequence, kind, length, op, root) with one 18-element
/// `ncclMax` all-reduce over those 9 values and their negations: diverged call sequences become
/// [`CommError::CallsDiffer`] instead of a hang inside NCCL. (The MPI backend compares the same five
/// identity fields, not the tag.)
pub struct NcclComm {
    comm: Comm,
    stream: Arc<CudaStream>,
    rank: usize,
    n: usize,
    seq: u64,
    /// The sync the next calls belong to ([`Collective::set_tag`]).
    tag: Option<SyncTag>,
    stats: CommStats,
    broken: Option<String>,
    scratch: Option<CudaSlice<f32>>,
}

// SAFETY: an NCCL communicator and a CUDA stream may be used from any thread as long as calls are
// not concurrent; `&mut self` serialises them.
unsafe impl Send for NcclComm {}

fn device_err(what: &str, e: impl std::fmt::Debug) -> CommError {
    CommError::Device(format!("{what}: {e:?}"))
}

/// Loads libcuda and libnccl (with errors naming them) before cudarc's lazy loaders can panic.
pub fn probe_libraries() -> Result<(), CommError> {
    probe_library("cuda", &cudarc::get_lib_name_candidates("cuda"))?;
    probe_library("nccl", &cudarc::get_lib_name_candidates("nccl"))
}

impl NcclComm {
    /// Creates this rank's communicator on GPU `ordinal`, with the world of `bootstrap` (same rank,
    /// same size). Collective: every rank of `bootstrap` must call it.
    pub fn init(bootstrap: &mut dyn Collective, ordinal: usize) -> Result<NcclComm, CommError> {
        let rank = bootstrap.rank();
        let n = bootstrap.world_size();
        // A rank without the libraries still joins the id exchange, so the others fail too
        // instead of waiting in ncclCommInitRank.
        let probed = probe_libraries();
        let id = share_unique_id::<128>(bootstrap, || {
            probed.as_ref().map_err(|e| e.to_string())?;
            let id = Id::new().map_err(|e| format!("ncclGetUniqueId: {:?}", e.0))?;
            Ok(id.internal().map(|c| c as u8))
        })?;
        // Every rank opens its GPU, then all agree that all succeeded before any enters
        // ncclCommInitRank (which would wait forever for a rank that gave up).
        let local = probed.and_then(|()| {
            let count = CudaContext::device_count().map_err(|e| device_err("cuDeviceGetCount", e))?;
            if ordinal >= count.max(0) as usize {
                return Err(CommError::Device(format!("rank {rank}: GPU {ordinal} requested, this host has {count}")));
            }
            CudaContext::new(ordinal).map_err(|e| device_err("creating the CUDA context", e))
        });
        let mut failed = [if local.is_ok() { 0.0f32 } else { 1.0 }];
        bootstrap.all_reduce(&mut failed, ReduceOp::Sum)?;
        let ctx = local?;
        if failed[0] > 0.0 {
            return Err(CommError::Device(format!(
                "{} rank(s) could not open their GPU; see their logs",
                failed[0] as usize
            )));
        }
        let stream = ctx.default_stream();
        let comm = Comm::from_rank(stream.clone(), rank, n, Id::uninit(id.map(|b| b as core::ffi::c_char)))
            .map_err(|e| device_err("ncclCommInitRank", e.0))?;
        Ok(NcclComm {
            comm,
            stream,
            rank,
            n,
            seq: 0,
            tag: None,
            stats: CommStats::default(),
            broken: None,
            scratch: None,
        })
    }

    /// The stream NCCL runs on (device buffers passed in must be ready on it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// All-reduces a device buffer in place (`Mean` is `ncclAvg`), asynchronously on [`Self::stream`].
    pub fn all_reduce_device(&mut self, buf: &mut CudaSlice<f32>, op: ReduceOp) -> Result<(), CommError> {
        self.usable()?;
        let t = Instant::now();
        let nccl_op = match op {
            ReduceOp::Sum => NcclOp::Sum,
            ReduceOp::Mean => NcclOp::Avg,
        };
        let r = self.comm.all_reduce_in_place(buf, &nccl_op).map(|_| ()).map_err(|e| device_err("ncclAllReduce", e.0));
        let bytes = crate::ring_allreduce_bytes(buf.len(), 4, self.n);
        self.finish(r, bytes, t)
    }

    fn usable(&self) -> Result<(), CommError> {
        match &self.broken {
            Some(why) => Err(CommError::Broken(why.clone())),
            None => Ok(()),
        }
    }

    fn finish(&mut self, r: Result<(), CommError>, bytes: u64, t: Instant) -> Result<(), CommError> {
        self.stats.record(bytes, bytes, t.elapsed().as_secs_f64());
        if let Err(e) = &r {
            self.broken = Some(e.to_string());
        }
        r
    }

    /// Compares this call's header with every rank's (max of values and of their negations).
    fn check_call(&mut self, kind: CallKind, len: usize, op: u8, root: usize) -> Result<(), CommError> {
        self.seq += 1;
        let tag = self.tag.unwrap_or_default();
        let call = [self.seq as i64, kind as i64, len as i64, i64::from(op), root as i64];
        let sync = [i64::from(self.tag.is_some()), tag.steps as i64, tag.h as i64, i64::from(tag.fragment)];
        let ours: Vec<i64> = sync.iter().chain(&call).copied().collect();
        let mut buf: Vec<i64> = ours.iter().copied().chain(ours.iter().map(|v| -v)).collect();
        let mut dev = self.stream.clone_htod(&buf).map_err(|e| device_err("copying the call header", e))?;
        self.comm.all_reduce_in_place(&mut dev, &NcclOp::Max).map_err(|e| device_err("ncclAllReduce (header)", e.0))?;
        self.stream
            .memcpy_dtoh(&dev, &mut buf)
            .and_then(|()| self.stream.synchronize())
            .map_err(|e| device_err("reading the call header", e))?;
        let w = ours.len();
        let differs = |i: usize| buf[i] != -buf[i + w];
        let diverged = |field, ours: String, theirs: String| CommError::CallsDiffer {
            me: self.rank,
            peer: usize::MAX,
            field,
            ours,
            theirs,
            during: kind.name().to_string(),
        };
        if (0..sync.len()).any(differs) {
            return Err(diverged("sync", tag_name(self.tag), "another on some rank".into()));
        }
        const FIELDS: [&str; 5] = ["sequence number", "call kind", "length", "op", "root"];
        for (i, field) in FIELDS.iter().enumerate() {
            let at = sync.len() + i;
            if differs(at) {
                let (max, min) = (buf[at], -buf[at + w]);
                let theirs = if ours[at] == max { min } else { max };
                return Err(diverged(field, ours[at].to_string(), format!("{theirs} on some rank")));
            }
        }
        Ok(())
    }

    /// A device buffer of at least `len` floats, reused across calls (taken out while in use).
    fn take_scratch(&mut self, len: usize) -> Result<CudaSlice<f32>, CommError> {
        match self.scratch.take() {
            Some(s) if s.len() >= len => Ok(s),
            _ => self.stream.alloc_zeros::<f32>(len.max(1)).map_err(|e| device_err("allocating the staging buffer", e)),
        }
    }

    fn host_all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.check_call(CallKind::AllReduce, buf.len(), op.code(), 0)?;
        if buf.is_empty() {
            return Ok(());
        }
        let mut dev = self.take_scratch(buf.len())?;
        let result = (|| {
            let mut view = dev.slice_mut(..buf.len());
            self.stream.memcpy_htod(&*buf, &mut view).map_err(|e| device_err("copying to the GPU", e))?;
            self.comm.all_reduce_in_place(&mut view, &NcclOp::Sum).map_err(|e| device_err("ncclAllReduce", e.0))?;
            self.stream
                .memcpy_dtoh(&view, buf)
                .and_then(|()| self.stream.synchronize())
                .map_err(|e| device_err("copying from the GPU", e))
        })();
        self.scratch = Some(dev);
        result?;
        if op == ReduceOp::Mean {
            let k = self.n as f32;
            buf.iter_mut().for_each(|x| *x /= k);
        }
        Ok(())
    }

    fn host_broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        self.check_call(CallKind::Broadcast, buf.len(), 0, root)?;
        if buf.is_empty() {
            return Ok(());
        }
        let mut dev = self.stream.clone_htod(&*buf).map_err(|e| device_err("copying to the GPU", e))?;
        self.comm.broadcast_in_place(&mut dev, root as i32).map_err(|e| device_err("ncclBroadcast", e.0))?;
        self.stream
            .memcpy_dtoh(&dev, buf)
            .and_then(|()| self.stream.synchronize())
            .map_err(|e| device_err("copying from the GPU", e))?;
        Ok(())
    }

    fn host_broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        // The length travels first (non-roots do not know it), bounded like every backend's.
        let mut len = [bytes.len() as u64];
        self.check_call(CallKind::BroadcastBytes, 0, 0, root)?;
        let mut dev = self.stream.clone_htod(&len).map_err(|e| device_err("copying to the GPU", e))?;
        self.comm.broadcast_in_place(&mut dev, root as i32).map_err(|e| device_err("ncclBroadcast", e.0))?;
        self.stream
            .memcpy_dtoh(&dev, &mut len)
            .and_then(|()| self.stream.synchronize())
            .map_err(|e| device_err("copying from the GPU", e))?;
        let len = len[0] as usize;
        if len > MAX_BROADCAST_BYTES {
            return Err(CommError::Protocol {
                peer: format!("rank {root}"),
                detail: format!("broadcast of {len} bytes exceeds the {MAX_BROADCAST_BYTES}-byte limit"),
            });
        }
        if len == 0 {
            bytes.clear();
            return Ok(());
        }
        bytes.resize(len, 0);
        let mut dev = self.stream.clone_htod(bytes.as_slice()).map_err(|e| device_err("copying to the GPU", e))?;
        self.comm.broadcast_in_place(&mut dev, root as i32).map_err(|e| device_err("ncclBroadcast", e.0))?;
        self.stream
            .memcpy_dtoh(&dev, bytes.as_mut_slice())
            .and_then(|()| self.stream.synchronize())
            .map_err(|e| device_err("copying from the GPU", e))?;
        Ok(())
    }

    fn check_root(&self, root: usize) -> Result<(), CommError> {
        if root >= self.n {
            return Err(CommError::InvalidArgument(format!("root {root} >= world size {}", self.n)));
        }
        Ok(())
    }
}

impl Collective for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.n
    }
    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.usable()?;
        let t = Instant::now();
        let r = self.host_all_reduce(buf, op);
        let bytes = crate::ring_allreduce_bytes(buf.len(), 4, self.n);
        self.finish(r, bytes, t)
    }
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        self.usable()?;
        self.check_root(root)?;
        let t = Instant::now();
        let r = self.host_broadcast(buf, root);
        let bytes = (buf.len() * 4) as u64;
        self.finish(r, bytes, t)
    }
    fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        self.usable()?;
        self.check_root(root)?;
        let t = Instant::now();
        let r = self.host_broadcast_bytes(bytes, root);
        let n = bytes.len() as u64;
        self.finish(r, n, t)
    }
    fn set_tag(&mut self, tag: Option<SyncTag>) {
        self.tag = tag;
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.usable()?;
        let t = Instant::now();
        let r = self.check_call(CallKind::Barrier, 0, 0, 0);
        self.finish(r, 0, t)
    }
    fn stats(&self) -> &CommStats {
        &self.stats
    }
    fn backend(&self) -> &'static str {
        "nccl"
    }
}
