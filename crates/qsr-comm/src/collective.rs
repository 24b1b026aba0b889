//! The [`Collective`] trait every backend implements, with what its calls take and report: a leaf
//! below the backends, the hierarchy and `connect`.

use qsr_kernels::Codec;
use serde::{Deserialize, Serialize};

use crate::error::CommError;

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

/// A codec's name in messages and settings: `int8`, `fp8`, `int4`, `int2`.
pub fn codec_name(codec: Codec) -> &'static str {
    match codec {
        Codec::Int8 => "int8",
        Codec::Fp8E4m3 => "fp8",
        Codec::Int4 => "int4",
        Codec::Int2 => "int2",
    }
}

/// Which synchronization of a training run a collective call belongs to: set with
/// [`Collective::set_tag`], carried in the call's header and compared across ranks like its length,
/// so ranks at different syncs (a rank whose `H` came from another lr) fail at that call instead of
/// averaging one step's parameters with another's.
///
/// ```
/// use qsr_comm::SyncTag;
/// let tag = SyncTag { steps: 10, h: 10, fragment: 0 };
/// assert_eq!(tag.to_string(), "the sync after step 10 (a round of H = 10)");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct SyncTag {
    /// Optimizer steps taken when the sync runs (the sync follows step `steps`, counted from 1).
    pub steps: u64,
    /// The length `H` of the round it ends (1 for data parallel's gradient all-reduce).
    pub h: u64,
    /// The streaming fragment it carries, from 1; 0 for a sync of the whole model.
    pub fragment: u32,
}

impl SyncTag {
    /// The sync of a whole model after `steps` optimizer steps, ending a round of `h`.
    ///
    /// ```
    /// let tag = qsr_comm::SyncTag::new(10, 4).fragment(2);
    /// assert_eq!(tag.to_string(), "the sync after step 10 (a round of H = 4, fragment 2)");
    /// ```
    pub fn new(steps: u64, h: u64) -> Self {
        Self { steps, h, fragment: 0 }
    }

    /// The same sync carrying streaming fragment `fragment` (from 1).
    pub fn fragment(self, fragment: u32) -> Self {
        Self { fragment, ..self }
    }
}

impl std::fmt::Display for SyncTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the sync after step {} (a round of H = {}", self.steps, self.h)?;
        match self.fragment {
            0 => write!(f, ")"),
            p => write!(f, ", fragment {p})"),
        }
    }
}

/// A call's tag in messages: the tag, or `no sync` for an untagged call.
pub(crate) fn tag_name(tag: Option<SyncTag>) -> String {
    tag.map_or_else(|| "no sync (an untagged call)".into(), |t| t.to_string())
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
    /// Tags the calls that follow with the sync they belong to (`None`: untagged) until the next
    /// `set_tag`. Backends that carry a call header (in-process, shm, TCP, NCCL) compare tags across
    /// ranks with the rest of the header, at no extra round trip except NCCL's header all-reduce,
    /// and fail with [`CommError::CallsDiffer`] (field `sync`) when they differ. MPI compares each call's
    /// identity (sequence, kind, length, op, root) but not its tag (the default does nothing).
    fn set_tag(&mut self, tag: Option<SyncTag>) {
        let _ = tag;
    }
    /// Cumulative traffic and time.
    fn stats(&self) -> &CommStats;
    /// Short backend name for logs ("inproc", "shm", "tcp", "shm+tcp", "mpi", "nccl").
    fn backend(&self) -> &'static str;
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
    fn set_tag(&mut self, tag: Option<SyncTag>) {
        (**self).set_tag(tag)
    }
    fn stats(&self) -> &CommStats {
        (**self).stats()
    }
    fn backend(&self) -> &'static str {
        (**self).backend()
    }
}
