//! K simulated workers in one process: one [`InProcessComm`] handle per thread, no sockets.
//!
//! A call runs in three steps under one mutex and condition variable:
//! 1. *gather*: each rank publishes its call (sequence number, kind, length, op, root) and a raw
//!    pointer to its buffer; the last to arrive checks that all calls agree. Disagreement fails
//!    the call on every rank; a rank that does not arrive within the timeout, or whose handle is
//!    dropped (its thread ended or panicked), fails the group for everyone instead of hanging.
//! 2. *work*: rank `r` reduces its own slice `split_range(len, K, r)` of the output, reading all
//!    K buffers in rank order `0..K` and writing the result into all K buffers. Slices of
//!    different ranks are disjoint, so no two threads touch the same element, and the fixed
//!    order makes every rank's result bit-identical and run-to-run deterministic.
//! 3. *release*: nobody returns (and so nobody reuses its buffer) until all ranks finished step 2.
//!
//! Safety argument for the raw pointers: a pointer is published only while its owner is inside
//! the call, holding the `&mut` borrow and not touching the buffer except through that pointer;
//! the work step starts only after the gather completed with all K ranks present, and the owner
//! leaves only after the release step, which waits (without timeout: the work step runs no user
//! code and cannot block) until every rank is done with every buffer.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use qsr_kernels::{Codec, WIRE_BLOCK};

use crate::collective::tag_name;
use crate::{CallKind, Collective, CommError, CommStats, ReduceOp, SyncTag, bf16_round, split_range};

/// How an all-reduce's payload travels (in a ring; here: how it is rounded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rounding {
    F32,
    Bf16,
    /// One byte per value and a scale per block of `qsr_kernels::WIRE_BLOCK` values.
    Quantized(Codec),
}

impl Rounding {
    /// Bytes one rank sends in a ring all-reduce of `len` values carried this way over `k` ranks.
    pub(crate) fn ring_bytes(self, len: usize, k: usize) -> u64 {
        match self {
            Rounding::F32 => crate::ring_allreduce_bytes(len, 4, k),
            Rounding::Bf16 => crate::ring_allreduce_bytes(len, 2, k),
            Rounding::Quantized(codec) => {
                crate::ring_allreduce_bytes(len.div_ceil(WIRE_BLOCK), codec.block_bytes() as u64, k)
            }
        }
    }

    /// How the TCP ring names the payload in an op's name (empty for f32).
    pub(crate) fn suffix(self) -> &'static str {
        match self {
            Rounding::F32 => "",
            Rounding::Bf16 => " (bf16 payload)",
            Rounding::Quantized(Codec::Int8) => " (int8 payload)",
            Rounding::Quantized(Codec::Fp8E4m3) => " (fp8 payload)",
            Rounding::Quantized(Codec::Int4) => " (int4 payload)",
            Rounding::Quantized(Codec::Int2) => " (int2 payload)",
        }
    }
}

/// Default time a rank waits for the others to enter the same collective.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Constructor of in-process groups.
pub struct InProcessGroup;

impl InProcessGroup {
    /// K handles, one per simulated worker; hand handle `r` to the thread of worker `r`.
    #[allow(clippy::new_ret_no_self)] // a group *is* its handles; there is no group object
    pub fn new(k: usize) -> Vec<InProcessComm> {
        Self::with_timeout(k, DEFAULT_TIMEOUT)
    }

    /// Like [`InProcessGroup::new`] with a custom timeout for waiting on the other ranks.
    pub fn with_timeout(k: usize, timeout: Duration) -> Vec<InProcessComm> {
        let shared = Arc::new(Shared {
            k,
            timeout,
            state: Mutex::new(State {
                gather_gen: 0,
                release_gen: 0,
                arrived: 0,
                finished: 0,
                slots: vec![None; k],
                failure: None,
            }),
            cv: Condvar::new(),
        });
        (0..k)
            .map(|rank| InProcessComm {
                rank,
                k,
                shared: Arc::clone(&shared),
                seq: 0,
                tag: None,
                stats: CommStats::default(),
            })
            .collect()
    }
}

struct Shared {
    k: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

struct State {
    gather_gen: u64,
    release_gen: u64,
    arrived: usize,
    finished: usize,
    slots: Vec<Option<Slot>>,
    failure: Option<Failure>,
}

#[derive(Clone)]
enum Failure {
    CallsDiffer { peer: usize, field: &'static str, rank0: String, theirs: String, during: String },
    Group { culprit: Option<usize>, detail: String },
}

impl Failure {
    fn to_error(&self, me: usize) -> CommError {
        match self {
            Failure::CallsDiffer { peer, field, rank0, theirs, during } => CommError::CallsDiffer {
                me: 0,
                peer: *peer,
                field,
                ours: rank0.clone(),
                theirs: theirs.clone(),
                during: format!("{during} (seen by rank {me})"),
            },
            Failure::Group { culprit, detail } => CommError::Group { culprit: *culprit, detail: detail.clone() },
        }
    }
}

/// One rank's published call. The pointer is stored as an address so the slot is `Send`.
#[derive(Clone, Copy)]
struct Slot {
    seq: u64,
    kind: CallKind,
    /// The reduction, and whether its payload is carried as bf16.
    op: Option<(ReduceOp, Rounding)>,
    root: usize,
    addr: usize,
    len: usize,
    /// The sync the call belongs to ([`Collective::set_tag`]).
    tag: Option<SyncTag>,
}

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    // A panic while holding this lock can only come from a bug here (no user code runs under it);
    // the state stays consistent at every unlock point, so continue with it.
    shared.state.lock().unwrap_or_else(|p| p.into_inner())
}

/// One simulated worker's handle.
pub struct InProcessComm {
    rank: usize,
    k: usize,
    shared: Arc<Shared>,
    seq: u64,
    tag: Option<SyncTag>,
    stats: CommStats,
}

impl InProcessComm {
    /// Gather step: publish `slot`, wait for all ranks, validate. Returns every rank's slot.
    fn gather(&mut self, slot: Slot) -> Result<Vec<Slot>, CommError> {
        let shared = &*self.shared;
        let mut st = lock(shared);
        if let Some(f) = &st.failure {
            return Err(CommError::Broken(f.to_error(self.rank).to_string()));
        }
        st.slots[self.rank] = Some(slot);
        st.arrived += 1;
        let my_gen = st.gather_gen;
        if st.arrived == shared.k {
            if let Some(f) = validate(&st.slots) {
                let err = f.to_error(self.rank);
                st.failure = Some(f);
                shared.cv.notify_all();
                return Err(err);
            }
            st.gather_gen += 1;
            shared.cv.notify_all();
        } else {
            let start = Instant::now();
            loop {
                if st.gather_gen != my_gen {
                    break;
                }
                if let Some(f) = &st.failure {
                    return Err(f.to_error(self.rank));
                }
                let waited = start.elapsed();
                if waited >= shared.timeout {
                    let missing: Vec<usize> = (0..shared.k).filter(|&j| st.slots[j].is_none()).collect();
                    let f = Failure::Group {
                        culprit: missing.first().copied(),
                        detail: format!(
                            "rank {} waited {:?} in {} (seq {}) for rank(s) {:?}, which never arrived",
                            self.rank,
                            shared.timeout,
                            slot.kind.name(),
                            slot.seq,
                            missing
                        ),
                    };
                    let err = f.to_error(self.rank);
                    st.failure = Some(f);
                    // Withdraw our pointer: the gather can no longer complete, nobody will use it.
                    st.slots[self.rank] = None;
                    shared.cv.notify_all();
                    return Err(err);
                }
                st = shared.cv.wait_timeout(st, shared.timeout - waited).unwrap_or_else(|p| p.into_inner()).0;
            }
        }
        Ok(st.slots.iter().map(|s| s.unwrap_or(slot)).collect())
    }

    /// Release step: wait until every rank finished its work step.
    fn release(&self) {
        let shared = &*self.shared;
        let mut st = lock(shared);
        st.finished += 1;
        if st.finished == shared.k {
            st.finished = 0;
            st.arrived = 0;
            st.slots.iter_mut().for_each(|s| *s = None);
            st.release_gen += 1;
            shared.cv.notify_all();
        } else {
            let my_gen = st.release_gen;
            while st.release_gen == my_gen {
                st = shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        }
    }

    fn run<F>(
        &mut self,
        kind: CallKind,
        op: Option<(ReduceOp, Rounding)>,
        root: usize,
        addr: usize,
        len: usize,
        work: F,
    ) -> Result<(), CommError>
    where
        F: FnOnce(&[Slot]),
    {
        let start = Instant::now();
        let seq = self.seq;
        self.seq += 1;
        let slot = Slot { seq, kind, op, root, addr, len, tag: self.tag };
        let result = self.gather(slot).map(|slots| {
            work(&slots);
            self.release();
        });
        let bytes = (len * 4) as u64;
        let (sent, recv) = match kind {
            CallKind::AllReduce => {
                let v = op.map_or(Rounding::F32, |(_, r)| r).ring_bytes(len, self.k);
                (v, v)
            }
            CallKind::Broadcast if self.rank == root => (bytes, 0),
            CallKind::Broadcast => (0, bytes),
            _ => (0, 0),
        };
        self.stats.record(sent, recv, start.elapsed().as_secs_f64());
        result
    }
}

/// A call's reduction as the TCP ring names it: `sum`, `mean (bf16 payload)`, `none`.
pub(crate) fn op_name(op: Option<(ReduceOp, Rounding)>) -> String {
    let Some((op, wire)) = op else { return "none".into() };
    let name = if op == ReduceOp::Mean { "mean" } else { "sum" };
    format!("{name}{}", wire.suffix())
}

/// Checks that all K published calls agree; the message compares each rank with rank 0.
fn validate(slots: &[Option<Slot>]) -> Option<Failure> {
    let first = slots.first().copied().flatten()?;
    for (j, s) in slots.iter().enumerate().skip(1) {
        let Some(s) = s else { continue };
        let during = format!("{} seq {}", first.kind.name(), first.seq);
        let diff = |field: &'static str, a: String, b: String| Failure::CallsDiffer {
            peer: j,
            field,
            rank0: a,
            theirs: b,
            during: during.clone(),
        };
        // First: ranks at different syncs usually differ in nothing else, and this names the cause.
        if s.tag != first.tag {
            return Some(diff("sync", tag_name(first.tag), tag_name(s.tag)));
        }
        if s.seq != first.seq {
            return Some(diff("sequence number", first.seq.to_string(), s.seq.to_string()));
        }
        if s.kind != first.kind {
            return Some(diff("call", first.kind.name().into(), s.kind.name().into()));
        }
        if s.op != first.op {
            return Some(diff("reduce op", op_name(first.op), op_name(s.op)));
        }
        if s.root != first.root {
            return Some(diff("root", first.root.to_string(), s.root.to_string()));
        }
        if s.kind != CallKind::BroadcastBytes && s.len != first.len {
            return Some(diff("length", first.len.to_string(), s.len.to_string()));
        }
    }
    None
}

/// Work step of all_reduce for the slice `range` owned by this rank: the fused reduce-and-broadcast of
/// qsr-kernels over every rank's buffer, restricted to `range`.
fn reduce_slice(slots: &[Slot], range: std::ops::Range<usize>, op: ReduceOp) {
    let n = range.len();
    let mut views: Vec<&mut [f32]> = slots
        .iter()
        .map(|s| {
            // SAFETY: see the module docs: `s.addr` points to `s.len >= range.end` live f32s whose owner
            // waits in this call; elements in `range` are touched only by this thread, and the K slots
            // are distinct buffers, so the K slices never alias.
            unsafe { std::slice::from_raw_parts_mut((s.addr as *mut f32).add(range.start), n) }
        })
        .collect();
    qsr_kernels::reduce_and_broadcast_serial(&mut views, op == ReduceOp::Mean);
}

/// The bf16 work step for the slice `split_range(len, K, rank)`: the TCP ring's order and rounding
/// for its segment `rank`, so both backends give the same bits. The partial sum starts at rank `rank`
/// and each next rank adds its f32 value to the bf16-rounded partial it "received"; a mean divides the
/// last sum by K; every rank gets the result rounded to bf16. One rank: unchanged.
fn reduce_slice_bf16(slots: &[Slot], rank: usize, op: ReduceOp) {
    let k = slots.len();
    if k == 1 {
        return;
    }
    let range = split_range(slots[rank].len, k, rank);
    let view = |r: usize| {
        // SAFETY: as in `reduce_slice`: elements of `range` are touched only by this thread, each slot a
        // distinct live buffer of at least `range.end` f32s whose owner waits in this call.
        unsafe { std::slice::from_raw_parts_mut((slots[r].addr as *mut f32).add(range.start), range.len()) }
    };
    let mut views: Vec<&mut [f32]> = (0..k).map(|j| view((rank + j) % k)).collect();
    for i in 0..range.len() {
        let mut sum = views[0][i];
        for v in &views[1..] {
            sum = bf16_round(sum) + v[i];
        }
        if op == ReduceOp::Mean {
            sum /= k as f32;
        }
        let out = bf16_round(sum);
        views.iter_mut().for_each(|v| v[i] = out);
    }
}

/// The quantized work step for segment `rank` of the buffer's blocks of [`WIRE_BLOCK`] values: the
/// TCP ring's order and rounding ([`Collective::all_reduce_quantized`]), so both give the same bits.
/// Per block: the partial sum starts at rank `rank`; each next rank adds its f32 values to the
/// quantized partial it "received"; a mean divides the last sum by K; every rank gets the result
/// quantized once more. One rank: unchanged.
fn reduce_slice_quantized(slots: &[Slot], rank: usize, op: ReduceOp, codec: Codec) {
    let k = slots.len();
    if k == 1 {
        return;
    }
    let len = slots[rank].len;
    let blocks = split_range(len.div_ceil(WIRE_BLOCK), k, rank);
    let range = (blocks.start * WIRE_BLOCK).min(len)..(blocks.end * WIRE_BLOCK).min(len);
    let view = |r: usize| {
        // SAFETY: as in `reduce_slice`: elements of `range` are touched only by this thread, each slot a
        // distinct live buffer of at least `range.end` f32s whose owner waits in this call.
        unsafe { std::slice::from_raw_parts_mut((slots[r].addr as *mut f32).add(range.start), range.len()) }
    };
    let mut views: Vec<&mut [f32]> = (0..k).map(|j| view((rank + j) % k)).collect();
    let mut sum = [0.0f32; WIRE_BLOCK];
    for at in (0..range.len()).step_by(WIRE_BLOCK) {
        let n = WIRE_BLOCK.min(range.len() - at);
        let sum = &mut sum[..n];
        sum.copy_from_slice(&views[0][at..at + n]);
        for v in &views[1..] {
            codec.round_block(sum);
            sum.iter_mut().zip(&v[at..at + n]).for_each(|(s, x)| *s += x);
        }
        if op == ReduceOp::Mean {
            sum.iter_mut().for_each(|s| *s /= k as f32);
        }
        codec.round_block(sum);
        views.iter_mut().for_each(|v| v[at..at + n].copy_from_slice(sum));
    }
}

impl Collective for InProcessComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.k
    }

    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let (k, rank) = (self.k, self.rank);
        let addr = buf.as_mut_ptr() as usize;
        self.run(CallKind::AllReduce, Some((op, Rounding::F32)), 0, addr, buf.len(), |slots| {
            reduce_slice(slots, split_range(slots[rank].len, k, rank), op)
        })
    }

    fn supports_bf16(&self) -> bool {
        true
    }

    fn all_reduce_bf16(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let rank = self.rank;
        let addr = buf.as_mut_ptr() as usize;
        self.run(CallKind::AllReduce, Some((op, Rounding::Bf16)), 0, addr, buf.len(), |slots| {
            reduce_slice_bf16(slots, rank, op)
        })
    }

    fn supports_quantized(&self) -> bool {
        true
    }

    fn all_reduce_quantized(&mut self, buf: &mut [f32], op: ReduceOp, codec: Codec) -> Result<(), CommError> {
        let rank = self.rank;
        let addr = buf.as_mut_ptr() as usize;
        self.run(CallKind::AllReduce, Some((op, Rounding::Quantized(codec))), 0, addr, buf.len(), |slots| {
            reduce_slice_quantized(slots, rank, op, codec)
        })
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        check_root(root, self.k)?;
        let rank = self.rank;
        let addr = buf.as_mut_ptr() as usize;
        let len = buf.len();
        self.run(CallKind::Broadcast, None, root, addr, len, |slots| {
            if rank != root {
                // SAFETY: root's buffer is only read during the work step; ours is written only
                // by us through the pointer we published (lengths were validated equal).
                let src = unsafe { std::slice::from_raw_parts(slots[root].addr as *const f32, len) };
                // SAFETY: as above: this rank's own buffer, of the validated length, written only here.
                let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut f32, len) };
                dst.copy_from_slice(src);
            }
        })
    }

    fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        check_root(root, self.k)?;
        let rank = self.rank;
        let addr = bytes.as_ptr() as usize;
        let len = bytes.len();
        let start = Instant::now();
        let seq = self.seq;
        self.seq += 1;
        let slot = Slot { seq, kind: CallKind::BroadcastBytes, op: None, root, addr, len, tag: self.tag };
        let result = self.gather(slot).map(|slots| {
            if rank != root {
                let s = slots[root];
                // SAFETY: root's Vec is not modified during the work step; we only resize our own.
                let src = unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.len) };
                bytes.clear();
                bytes.extend_from_slice(src);
            }
            self.release();
        });
        let n = bytes.len() as u64;
        let (sent, recv) = if rank == root { (n, 0) } else { (0, n) };
        self.stats.record(sent, recv, start.elapsed().as_secs_f64());
        result
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.run(CallKind::Barrier, None, 0, 0, 0, |_| {})
    }

    fn set_tag(&mut self, tag: Option<SyncTag>) {
        self.tag = tag;
    }

    fn stats(&self) -> &CommStats {
        &self.stats
    }

    fn backend(&self) -> &'static str {
        "inproc"
    }
}

pub(crate) fn check_root(root: usize, k: usize) -> Result<(), CommError> {
    if root >= k {
        return Err(CommError::InvalidArgument(format!("root {root} >= world size {k}")));
    }
    Ok(())
}

impl Drop for InProcessComm {
    /// A dropped handle (thread finished or unwound by a panic) can never join another call, so
    /// fail the group now: ranks waiting for it get an error at once instead of a timeout.
    fn drop(&mut self) {
        let mut st = lock(&self.shared);
        if st.failure.is_none() && self.k > 1 {
            let how = if std::thread::panicking() { "panicked" } else { "dropped its handle" };
            st.failure = Some(Failure::Group {
                culprit: Some(self.rank),
                detail: format!(
                    "rank {r} {how} (its worker ended: rank {r}'s own result, or its panic, says why); it can no \
                     longer take part in collectives",
                    r = self.rank
                ),
            });
            self.shared.cv.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_names_field_and_rank() {
        let s = Slot {
            seq: 3,
            kind: CallKind::AllReduce,
            op: Some((ReduceOp::Sum, Rounding::F32)),
            root: 0,
            addr: 0,
            len: 10,
            tag: None,
        };
        let mut other = s;
        other.len = 11;
        match validate(&[Some(s), Some(s), Some(other)]) {
            Some(Failure::CallsDiffer { peer: 2, field: "length", rank0, theirs, .. }) => {
                assert_eq!((rank0.as_str(), theirs.as_str()), ("10", "11"))
            }
            _ => panic!("length mismatch not detected"),
        }
        let mut other = s;
        other.op = Some((ReduceOp::Mean, Rounding::F32));
        assert!(matches!(
            validate(&[Some(s), Some(other)]),
            Some(Failure::CallsDiffer { peer: 1, field: "reduce op", .. })
        ));
        assert!(validate(&[Some(s), Some(s)]).is_none());
    }

    #[test]
    fn validate_names_the_syncs_of_ranks_at_different_rounds() {
        let tag = |steps, h| Some(SyncTag { steps, h, fragment: 0 });
        let s = Slot { seq: 3, kind: CallKind::AllReduce, op: None, root: 0, addr: 0, len: 10, tag: tag(10, 10) };
        let other = Slot { tag: tag(12, 12), ..s };
        match validate(&[Some(s), Some(other)]) {
            Some(Failure::CallsDiffer { peer: 1, field: "sync", rank0, theirs, .. }) => {
                assert_eq!(rank0, "the sync after step 10 (a round of H = 10)");
                assert_eq!(theirs, "the sync after step 12 (a round of H = 12)");
            }
            _ => panic!("different syncs not detected"),
        }
        assert!(validate(&[Some(s), Some(s)]).is_none());
    }
}
