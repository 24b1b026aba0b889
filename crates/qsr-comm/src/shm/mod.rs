//! Collectives through shared memory for ranks on one host, documented on [`ShmComm`].

mod mapping;
mod protocol;
mod watch;

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::collective::tag_name;
use crate::inproc::{Rounding, check_root, op_name};
use crate::util::f32_bytes_mut;
use crate::{CallKind, Codec, Collective, CommError, CommStats, ReduceOp, SyncTag, bf16_round, split_range};
use qsr_kernels::WIRE_BLOCK;

use mapping::Mapping;
pub(crate) use mapping::pid_ns;
use watch::Watch;

/// Settings of the shared-memory backend. `Default`: 30 s timeout, 1 MiB slots, one stage up to
/// 4 KiB, `/dev/shm`.
#[derive(Debug, Clone)]
pub struct ShmConfig {
    /// A peer that makes no progress for this long is declared stalled (default 30 s).
    pub timeout: Duration,
    /// Bytes each rank stages per pipeline step, in each of its two halves (default 1 MiB; a
    /// multiple of 4 KiB in 4 KiB..=64 MiB). The mapping holds `2 * slot_bytes` per rank.
    pub slot_bytes: usize,
    /// All-reduces of at most this many f32 bytes take one stage instead of two: every rank
    /// reduces the whole buffer from every half, which costs K times the reads but one handoff
    /// fewer (default 4 KiB; measurements: docs/BENCHMARKS.md, section "All-reduce defaults"; 0 turns
    /// it off). All ranks must use the same value; it is checked in every call.
    pub one_stage_bytes: usize,
    /// Directory of the group files (default `/dev/shm`). The file is removed as soon as every
    /// member has mapped it; files of killed jobs are removed at the next start.
    pub dir: PathBuf,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            timeout: Duration::from_secs(30),
            slot_bytes: 1 << 20,
            one_stage_bytes: 4 << 10,
            dir: PathBuf::from("/dev/shm"),
        }
    }
}

impl ShmConfig {
    fn validate(&self) -> Result<(), CommError> {
        if self.timeout.is_zero() {
            return Err(CommError::InvalidArgument("shm timeout must be positive".into()));
        }
        if !self.slot_bytes.is_multiple_of(4096) || !(4096..=64 << 20).contains(&self.slot_bytes) {
            return Err(CommError::InvalidArgument(format!(
                "shm slot_bytes = {} is not a multiple of 4096 in 4096..={}",
                self.slot_bytes,
                64 << 20
            )));
        }
        Ok(())
    }
}

/// What a call is, as every member publishes it before its first stage of each pipeline step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Head {
    seq: u64,
    kind: CallKind,
    op: Option<(ReduceOp, Rounding)>,
    root: usize,
    len: u64,
    /// Whether an all-reduce takes the one-stage path (compared like the rest: ranks configured
    /// with different [`ShmConfig::one_stage_bytes`] fail instead of deadlocking).
    one_stage: bool,
    /// The sync the call belongs to ([`Collective::set_tag`]).
    tag: Option<SyncTag>,
}

/// Words of a published [`Head`].
pub(crate) const HEAD_WORDS: usize = 6;

/// A header's defaults; `ShmComm::call` fills in the sequence number and the tag.
const BLANK: Head = Head { seq: 0, kind: CallKind::Barrier, op: None, root: 0, len: 0, one_stage: false, tag: None };

fn kind_code(k: CallKind) -> u64 {
    match k {
        CallKind::AllReduce => 1,
        CallKind::Broadcast => 2,
        CallKind::Barrier => 3,
        CallKind::BroadcastBytes => 4,
    }
}

/// The payloads in the order of their codes in a header's op byte.
const PAYLOADS: [Rounding; 6] = [
    Rounding::F32,
    Rounding::Bf16,
    Rounding::Quantized(Codec::Int8),
    Rounding::Quantized(Codec::Fp8E4m3),
    Rounding::Quantized(Codec::Int4),
    Rounding::Quantized(Codec::Int2),
];

fn op_code(op: Option<(ReduceOp, Rounding)>) -> u64 {
    match op {
        None => 0,
        Some((op, wire)) => {
            let payload = PAYLOADS.iter().position(|&p| p == wire).unwrap_or(0) as u64;
            1 + u64::from(op.code()) + 2 * payload
        }
    }
}

impl Head {
    fn words(&self) -> [u64; HEAD_WORDS] {
        let call = kind_code(self.kind) | op_code(self.op) << 8 | u64::from(self.one_stage) << 16;
        let tag = self.tag.unwrap_or_default();
        let tagged = u64::from(self.tag.is_some()) << 24 | u64::from(tag.fragment) << 32;
        [self.seq, call | tagged, self.root as u64, self.len, tag.steps, tag.h]
    }

    /// The tag of published words.
    fn tag_of(w: [u64; HEAD_WORDS]) -> Option<SyncTag> {
        let fragment = (w[1] >> 32) as u32;
        ((w[1] >> 24) & 1 == 1).then_some(SyncTag { steps: w[4], h: w[5], fragment })
    }

    fn during(&self) -> String {
        format!("{} seq {} ({} bytes)", self.kind.name(), self.seq, self.len)
    }

    /// The first field in which a peer's published words differ from ours, as (field, ours, theirs).
    fn differs(&self, theirs: [u64; HEAD_WORDS]) -> Option<(&'static str, String, String)> {
        let ours = self.words();
        // First: ranks at different syncs usually differ in nothing else; this names the cause.
        if Head::tag_of(theirs) != self.tag {
            return Some(("sync", tag_name(self.tag), tag_name(Head::tag_of(theirs))));
        }
        let names = ["sequence number", "call", "root", "length (bytes)"];
        let i = (0..4).find(|&i| ours[i] != theirs[i])?;
        let field = |w: u64, at: u32| (w >> at) & 0xff;
        if i == 1 && field(ours[1], 0) == field(theirs[1], 0) && field(ours[1], 8) != field(theirs[1], 8) {
            let name = |w: u64| match field(w, 8) {
                0 => "none".to_string(),
                c => {
                    let op = if (c - 1) % 2 == 1 { ReduceOp::Mean } else { ReduceOp::Sum };
                    let payload = PAYLOADS.get((c as usize - 1) / 2).copied().unwrap_or(Rounding::F32);
                    op_name(Some((op, payload)))
                }
            };
            return Some(("reduce op", name(ours[1]), name(theirs[1])));
        }
        if i == 1 && field(ours[1], 0) == field(theirs[1], 0) {
            let path = |w: u64| if field(w, 16) != 0 { "one stage" } else { "two stages" }.to_string();
            return Some(("all-reduce path (shm one_stage_bytes)", path(ours[1]), path(theirs[1])));
        }
        let kind = |w: u64| match w & 0xff {
            1 => "all_reduce".to_string(),
            2 => "broadcast".into(),
            3 => "barrier".into(),
            4 => "broadcast_bytes".into(),
            c => format!("unknown call {c}"),
        };
        let show = |w: [u64; HEAD_WORDS]| if i == 1 { kind(w[1]) } else { w[i].to_string() };
        Some((names[i], show(ours), show(theirs)))
    }
}

/// Why a rank failed; the first failure any member sees (or is told of) is the group's abort word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cause {
    Exited = 1,
    Stalled = 2,
    Closed = 3,
    /// Its connection on another transport (the ring between hosts) was lost.
    Lost = 4,
    CallsDiffer = 5,
    Other = 6,
}

impl Cause {
    pub(crate) fn text(self) -> &'static str {
        match self {
            Cause::Exited => "its process exited",
            Cause::Stalled => "no progress within the timeout",
            Cause::Closed => "it closed its communicator",
            Cause::Lost => "connection lost",
            Cause::CallsDiffer => "different collective calls",
            Cause::Other => "it failed",
        }
    }

    pub(crate) fn from_code(c: u64) -> Option<Cause> {
        Some(match c {
            1 => Cause::Exited,
            2 => Cause::Stalled,
            3 => Cause::Closed,
            4 => Cause::Lost,
            5 => Cause::CallsDiffer,
            6 => Cause::Other,
            _ => return None,
        })
    }
}

/// A failure inside a call, before it becomes a [`CommError`].
enum Fail {
    /// Member `.0` (our index) failed for `.1`; we saw it ourselves.
    Peer(usize, Cause),
    /// Someone saw it first: (culprit, reason, reporter), ranks of the job.
    Aborted(usize, Cause, usize),
    CallsDiffer {
        peer: usize,
        field: &'static str,
        ours: String,
        theirs: String,
    },
}

/// The abort word naming job ranks `culprit` and `reporter`.
fn abort_word(culprit: usize, reason: Cause, reporter: usize) -> u64 {
    (reason as u64) << 48 | (reporter as u64) << 24 | (culprit as u64 + 1)
}

fn decode_abort(w: u64) -> Option<Fail> {
    let reason = Cause::from_code(w >> 48)?;
    let culprit = (w & 0xff_ffff) as usize;
    Some(Fail::Aborted(culprit.checked_sub(1)?, reason, ((w >> 24) & 0xff_ffff) as usize))
}

/// One rank of a group of processes (or threads) on one host that reduce through a shared mapping.
///
/// Setup ([`ShmComm::from_bootstrap`]) runs over any other collective of the same ranks, usually the
/// TCP ring the launch formed: the group's rank 0 creates `/dev/shm/qsr-shm-<pidns>-<pid>-<random>` (pages
/// reserved up front, so a full `/dev/shm` is an error naming the file), the others map it, and once
/// every member has, the file is removed: a job that dies after setup leaves nothing behind, and
/// files of jobs killed during setup are removed, by their dead creator's pid, at the next start.
///
/// A call moves the buffer in steps of [`ShmConfig::slot_bytes`] through two alternating halves per
/// rank. All-reduce: each rank copies its step into its half and publishes its stage counter; once
/// every counter has arrived, each rank reduces its `1/K` share of the step over all K halves in rank
/// order (qsr-kernels' `reduce_and_broadcast_serial`, the order of [`crate::InProcessGroup`], so the
/// two backends give the same bits) and writes the result into every half; after a second stage
/// every rank copies the result out. Broadcast: the root copies in, one stage, the others copy out.
/// The bf16 all-reduce keeps the TCP ring's per-segment order and rounding, so it gives the ring's
/// bits. Two halves make the next step's copy-in safe without a third stage.
///
/// Every step's stage publishes the call's header (sequence number, call, op, root, length), and every
/// rank compares all headers before touching data: a diverged call fails on every rank. A waiting rank
/// spins briefly, then yields, then sleeps in growing steps up to 1 ms, and while waiting it watches
/// every peer's process (a pidfd, which becomes readable when the process dies, zombie or not) and
/// the group's abort word: the first rank to see a peer die, close its communicator or make no
/// progress for the timeout writes the culprit there, and every other waiter fails naming the same
/// rank. After a failure the communicator is broken.
pub struct ShmComm {
    rank: usize,
    n: usize,
    /// The rank each member has in the job, for messages (identity unless built for a sub-group).
    names: Vec<usize>,
    cfg: ShmConfig,
    map: Mapping,
    watch: Vec<Watch>,
    /// Stages completed (every member's counter moves in lockstep with ours).
    phase: u64,
    /// Pipeline steps completed; the parity picks the half.
    steps: u64,
    seq: u64,
    /// The sync the next calls belong to ([`Collective::set_tag`]).
    tag: Option<SyncTag>,
    stats: CommStats,
    broken: Option<String>,
    /// The job rank and reason behind our failure, for a layer above that passes it on.
    failure: Option<(usize, Cause)>,
}

impl ShmComm {
    /// Forms one group of every rank of `boot` (which must all run on this host) and returns this
    /// rank's member; a collective call on `boot`. See [`ShmComm`] for the setup.
    pub fn from_bootstrap(boot: &mut dyn Collective, cfg: ShmConfig) -> Result<ShmComm, CommError> {
        let all: Vec<usize> = (0..boot.world_size()).collect();
        join(boot, &[all], cfg)
    }

    /// The configuration this communicator runs with.
    pub fn config(&self) -> &ShmConfig {
        &self.cfg
    }

    fn half(&self) -> usize {
        protocol::half(self.steps)
    }

    /// Publishes our next stage (with `head` for the half, when given) and waits for every member's.
    fn stage(&mut self, head: Option<&Head>) -> Result<(), Fail> {
        let me = self.map.ctrl(self.rank);
        if let Some(h) = head {
            protocol::write_head(&me.call[self.half()], h.words());
        }
        self.phase += 1;
        protocol::publish(&me.phase, self.phase);
        self.wait_all(self.phase)?;
        match head {
            Some(h) => self.check_heads(h),
            None => Ok(()),
        }
    }

    fn check_heads(&self, head: &Head) -> Result<(), Fail> {
        for q in (0..self.n).filter(|&q| q != self.rank) {
            let theirs = protocol::read_head(&self.map.ctrl(q).call[self.half()]);
            if let Some((field, ours, theirs)) = head.differs(theirs) {
                return Err(Fail::CallsDiffer { peer: q, field, ours, theirs });
            }
        }
        Ok(())
    }

    /// Waits until every member has completed stage `target`, watching for dead or stalled peers.
    fn wait_all(&self, target: u64) -> Result<(), Fail> {
        let start = Instant::now();
        let (mut last_change, mut last_watch) = (start, start);
        let (mut next, mut spins, mut nap) = (0, 0u32, Duration::from_micros(20));
        let mut beat = u64::MAX;
        loop {
            let before = next;
            next = protocol::first_behind(|q| &self.map.ctrl(q).phase, (self.n, self.rank), next, target);
            if next == self.n {
                return Ok(());
            }
            spins += 1;
            if spins < 128 {
                std::hint::spin_loop();
                continue;
            }
            if let Some(f) = decode_abort(protocol::read_abort(&self.map.header().abort)) {
                return Err(f);
            }
            if protocol::closed_behind(&self.map.ctrl(next).phase, &self.map.ctrl(next).closed, target) {
                return Err(Fail::Peer(next, Cause::Closed));
            }
            let now = Instant::now();
            let b = self.map.ctrl(next).beat.load(Ordering::Relaxed);
            if next != before || b != beat {
                last_change = now;
                beat = b;
            }
            if now - last_watch >= Duration::from_millis(1) {
                last_watch = now;
                // Only peers this stage still needs: one that published and then exited (its job
                // done) is no failure.
                let behind = |q: usize| q != self.rank && self.map.ctrl(q).phase.load(Ordering::Acquire) < target;
                if let Some(q) = (next..self.n).find(|&q| behind(q) && self.watch[q].exited()) {
                    return Err(Fail::Peer(q, Cause::Exited));
                }
            }
            if now - last_change >= self.cfg.timeout {
                return Err(Fail::Peer(next, Cause::Stalled));
            }
            if now - start < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(1));
            }
        }
    }

    /// Copies `src` into our current half.
    fn put(&self, src: &[u8]) {
        debug_assert!(src.len() <= self.cfg.slot_bytes);
        // SAFETY: our half is written only by us, and only between the stage at which every member
        // finished reading it (two steps ago) and our next publish; `src` fits in it.
        unsafe { copy(self.map.data(self.rank, self.half()), src.as_ptr(), src.len()) }
    }

    /// Copies the first `dst.len()` bytes of `rank`'s current half out.
    fn take(&self, rank: usize, dst: &mut [u8]) {
        // SAFETY: after the stage that completed the half, nobody writes it until we publish again.
        unsafe { copy(dst.as_mut_ptr(), self.map.data(rank, self.half()), dst.len()) }
    }

    /// Our share of an all-reduce step of `len` elements that starts at element `at` of `total`:
    /// reduced over every member's half and written back into every half.
    fn reduce_share(&self, at: usize, len: usize, total: usize, op: ReduceOp, wire: Rounding) {
        let share = match wire {
            // Whole blocks of the quantized payload (a step starts on a block: slots are 4 KiB multiples).
            Rounding::Quantized(_) => {
                let b = split_range(len.div_ceil(WIRE_BLOCK), self.n, self.rank);
                (b.start * WIRE_BLOCK).min(len)..(b.end * WIRE_BLOCK).min(len)
            }
            _ => split_range(len, self.n, self.rank),
        };
        let mut views: Vec<&mut [f32]> = (0..self.n)
            .map(|q| {
                // SAFETY: between the two stages of a step, elements `share` of every half are touched
                // only by this rank; the halves are distinct, so the views never alias.
                unsafe {
                    std::slice::from_raw_parts_mut(
                        (self.map.data(q, self.half()) as *mut f32).add(share.start),
                        share.len(),
                    )
                }
            })
            .collect();
        match wire {
            Rounding::F32 => qsr_kernels::reduce_and_broadcast_serial(&mut views, op == ReduceOp::Mean),
            Rounding::Bf16 => reduce_in_ring_order(&mut views, at + share.start, total, op),
            Rounding::Quantized(codec) => reduce_blocks_in_ring_order(&mut views, at + share.start, total, op, codec),
        }
    }

    /// The one-stage all-reduce: the whole buffer, from every member's half in rank order, into
    /// `out` (the order of `reduce_and_broadcast_serial`, so the bits are those of the two-stage path).
    fn reduce_all_into(&self, out: &mut [f32], op: ReduceOp) {
        let halves: Vec<&[f32]> = (0..self.n)
            .map(|q| {
                // SAFETY: after the stage, every half holds its owner's `out.len()` values and nobody
                // writes any half until every member has published its next stage.
                unsafe { std::slice::from_raw_parts(self.map.data(q, self.half()) as *const f32, out.len()) }
            })
            .collect();
        out.copy_from_slice(halves[0]);
        for h in &halves[1..] {
            out.iter_mut().zip(h.iter()).for_each(|(o, x)| *o += *x);
        }
        if op == ReduceOp::Mean && self.n > 1 {
            let k = self.n as f32;
            out.iter_mut().for_each(|o| *o /= k);
        }
    }

    /// Runs one call: numbering, the broken state, statistics and the conversion of failures.
    fn call(
        &mut self,
        head: Head,
        traffic: (u64, u64),
        body: impl FnOnce(&mut Self, &Head) -> Result<(), Fail>,
    ) -> Result<(), CommError> {
        if let Some(b) = &self.broken {
            return Err(CommError::Broken(b.clone()));
        }
        let head = Head { seq: self.seq, tag: self.tag, ..head };
        self.seq += 1;
        let start = Instant::now();
        let res = if self.n == 1 { Ok(()) } else { body(self, &head) };
        let (sent, received) = if self.n == 1 { (0, 0) } else { traffic };
        self.stats.record(sent, received, start.elapsed().as_secs_f64());
        res.map_err(|f| {
            let e = self.error(f, &head);
            self.broken = Some(e.to_string());
            e
        })
    }

    /// Fails the group because job rank `culprit` failed elsewhere (the layer above saw it): every
    /// member waiting now or calling later fails naming it, unless a failure was recorded first.
    pub(crate) fn abort(&mut self, culprit: usize, why: Cause) {
        let word = abort_word(culprit, why, self.names[self.rank]);
        protocol::record_abort(&self.map.header().abort, word);
        self.failure.get_or_insert((culprit, why));
        self.broken.get_or_insert_with(|| format!("rank {culprit} failed ({})", why.text()));
    }

    /// Waits from now on give up after `t` (a layer above waits longer where it waits for more).
    pub(crate) fn set_timeout(&mut self, t: Duration) {
        self.cfg.timeout = t;
    }

    /// The job rank and reason of the failure that broke this communicator, if any, else of one
    /// another member recorded in the abort word (its call failed where ours got through).
    pub(crate) fn failure(&self) -> Option<(usize, Cause)> {
        self.failure.or_else(|| match decode_abort(protocol::read_abort(&self.map.header().abort)) {
            Some(Fail::Aborted(c, why, _)) => Some((c, why)),
            _ => None,
        })
    }

    /// A handle that counts as progress of this member while it works on another transport.
    pub(crate) fn heartbeat(&self) -> mapping::Beat {
        self.map.beat(self.rank)
    }

    fn error(&mut self, f: Fail, head: &Head) -> CommError {
        let f = match f {
            Fail::Peer(q, why) => {
                let mine = abort_word(self.names[q], why, self.names[self.rank]);
                match protocol::record_abort(&self.map.header().abort, mine) {
                    first if first == mine => Fail::Peer(q, why),
                    first => decode_abort(first).unwrap_or(Fail::Peer(q, why)),
                }
            }
            Fail::CallsDiffer { peer, .. } => {
                // Every member sees a divergence and names the field itself; the abort word makes
                // the culprit a layer above passes on the same on every member.
                let word = abort_word(self.names[peer], Cause::CallsDiffer, self.names[self.rank]);
                protocol::record_abort(&self.map.header().abort, word);
                f
            }
            other => other,
        };
        let word = decode_abort(protocol::read_abort(&self.map.header().abort));
        self.failure = match (&f, word.as_ref()) {
            (Fail::Peer(q, why), _) => Some((self.names[*q], *why)),
            (Fail::Aborted(c, why, _), _) | (_, Some(Fail::Aborted(c, why, _))) => Some((*c, *why)),
            (Fail::CallsDiffer { peer, .. }, _) => Some((self.names[*peer], Cause::CallsDiffer)),
        };
        let during = head.during();
        match f {
            Fail::Peer(q, Cause::Stalled) => CommError::PeerTimeout {
                rank: self.names[q],
                addr: self.watch[q].describe(),
                during,
                timeout: self.cfg.timeout,
            },
            Fail::Peer(q, why) => CommError::PeerLost {
                rank: self.names[q],
                addr: self.watch[q].describe(),
                during,
                detail: why.text().into(),
            },
            Fail::Aborted(culprit, why, reporter) => {
                CommError::Aborted { culprit, reason: why.text().into(), reporter, during }
            }
            Fail::CallsDiffer { peer, field, ours, theirs } => CommError::CallsDiffer {
                me: self.names[self.rank],
                peer: self.names[peer],
                field,
                ours,
                theirs,
                during,
            },
        }
    }

    fn all_reduce_with(&mut self, buf: &mut [f32], op: ReduceOp, wire: Rounding) -> Result<(), CommError> {
        let total = buf.len();
        let bytes = wire.ring_bytes(total, self.n);
        let one_stage = wire == Rounding::F32 && total * 4 <= self.cfg.one_stage_bytes.min(self.cfg.slot_bytes);
        let head = Head { kind: CallKind::AllReduce, op: Some((op, wire)), len: total as u64 * 4, one_stage, ..BLANK };
        self.call(head, (bytes, bytes), |me, head| {
            if one_stage {
                me.put(f32_bytes(buf));
                me.stage(Some(head))?;
                me.reduce_all_into(buf, op);
                me.steps += 1;
                return Ok(());
            }
            let per = me.cfg.slot_bytes / 4;
            let mut at = 0;
            loop {
                let end = (at + per).min(total);
                me.put(f32_bytes(&buf[at..end]));
                me.stage(Some(head))?;
                me.reduce_share(at, end - at, total, op, wire);
                me.stage(None)?;
                me.take(me.rank, f32_bytes_mut(&mut buf[at..end]));
                me.steps += 1;
                at = end;
                if at >= total {
                    return Ok(());
                }
            }
        })
    }

    /// Broadcast of raw bytes (`kind` names the call in headers).
    fn broadcast_raw(&mut self, kind: CallKind, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        let len = buf.len() as u64;
        let traffic = if self.rank == root { (len, 0) } else { (0, len) };
        let head = Head { kind, root, len, ..BLANK };
        self.call(head, traffic, |me, head| {
            let per = me.cfg.slot_bytes;
            let mut at = 0;
            loop {
                let end = (at + per).min(buf.len());
                if me.rank == root {
                    me.put(&buf[at..end]);
                }
                me.stage(Some(head))?;
                if me.rank != root {
                    me.take(root, &mut buf[at..end]);
                }
                me.steps += 1;
                at = end;
                if at >= buf.len() {
                    return Ok(());
                }
            }
        })
    }
}

/// `len` bytes from `src` to `dst` in 2 KiB pieces: glibc copies blocks that size with vector
/// loops, while one large copy takes `rep movsb`, which AMD cores run at a fraction of the speed
/// when source and destination sit at nearby offsets within a page (4K aliasing: our page-aligned
/// halves against a heap buffer 16 bytes into its page). Measurements: docs/BENCHMARKS.md, section
/// "All-reduce defaults".
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes, not overlapping.
unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
    const PIECE: usize = 2048;
    let mut at = 0;
    while at < len {
        let k = PIECE.min(len - at);
        // SAFETY: `at + k <= len`, within both ranges the caller vouches for.
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), k) };
        at += k;
    }
}

fn f32_bytes(f: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding; the byte view covers exactly the same memory, borrowed shared.
    unsafe { std::slice::from_raw_parts(f.as_ptr().cast::<u8>(), std::mem::size_of_val(f)) }
}

/// The TCP ring's bf16 order for elements `at..at + len` of a `total`-element buffer: element `i` of
/// segment `s` (of `split_range(total, K, s)`) starts at rank `s`, and each next rank adds its f32
/// value to the bf16-rounded partial sum; a mean divides the last sum by K; the result is rounded
/// to bf16 and written to every view.
fn reduce_in_ring_order(views: &mut [&mut [f32]], at: usize, total: usize, op: ReduceOp) {
    let k = views.len();
    let len = views.first().map_or(0, |v| v.len());
    let mut i = 0;
    while i < len {
        let s = segment_of(at + i, total, k);
        let run = (split_range(total, k, s).end - (at + i)).min(len - i);
        for e in i..i + run {
            let mut sum = views[s][e];
            for j in 1..k {
                sum = bf16_round(sum) + views[(s + j) % k][e];
            }
            if op == ReduceOp::Mean {
                sum /= k as f32;
            }
            let out = bf16_round(sum);
            views.iter_mut().for_each(|v| v[e] = out);
        }
        i += run;
    }
}

/// The TCP ring's quantized order ([`Collective::all_reduce_quantized`]) for elements `at..at + len`
/// of a `total`-element buffer, `at` on a block boundary: block `b` of segment `s` (of
/// `split_range(blocks, K, s)`) starts at rank `s`, each next rank adds its f32 values to the
/// quantized partial sum, a mean divides the last sum by K, and every view gets the result quantized.
fn reduce_blocks_in_ring_order(views: &mut [&mut [f32]], at: usize, total: usize, op: ReduceOp, codec: Codec) {
    let k = views.len();
    let len = views.first().map_or(0, |v| v.len());
    let blocks = total.div_ceil(WIRE_BLOCK);
    let mut sum = [0.0f32; WIRE_BLOCK];
    for e in (0..len).step_by(WIRE_BLOCK) {
        let s = segment_of((at + e) / WIRE_BLOCK, blocks, k);
        let n = WIRE_BLOCK.min(len - e);
        let sum = &mut sum[..n];
        sum.copy_from_slice(&views[s][e..e + n]);
        for j in 1..k {
            codec.round_block(sum);
            sum.iter_mut().zip(&views[(s + j) % k][e..e + n]).for_each(|(a, x)| *a += x);
        }
        if op == ReduceOp::Mean {
            sum.iter_mut().for_each(|a| *a /= k as f32);
        }
        codec.round_block(sum);
        views.iter_mut().for_each(|v| v[e..e + n].copy_from_slice(sum));
    }
}

/// The `s` with `g` in `split_range(total, k, s)`.
fn segment_of(g: usize, total: usize, k: usize) -> usize {
    let (base, rem) = (total / k, total % k);
    let long = rem * (base + 1);
    if g < long { g / (base + 1) } else { rem + (g - long) / base }
}

impl Collective for ShmComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.n
    }

    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.all_reduce_with(buf, op, Rounding::F32)
    }

    fn supports_bf16(&self) -> bool {
        true
    }

    fn all_reduce_bf16(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.all_reduce_with(buf, op, Rounding::Bf16)
    }

    fn supports_quantized(&self) -> bool {
        true
    }

    fn all_reduce_quantized(&mut self, buf: &mut [f32], op: ReduceOp, codec: Codec) -> Result<(), CommError> {
        if self.n == 1 {
            return self.all_reduce(buf, op); // as the ring: nothing travels, the buffer stays
        }
        self.all_reduce_with(buf, op, Rounding::Quantized(codec))
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        check_root(root, self.n)?;
        self.broadcast_raw(CallKind::Broadcast, f32_bytes_mut(buf), root)
    }

    fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        check_root(root, self.n)?;
        let rank = self.rank;
        let res =
            crate::broadcast_sized(bytes, root, rank, |b, _| self.broadcast_raw(CallKind::BroadcastBytes, b, root));
        if let Err(e) = &res {
            self.broken.get_or_insert_with(|| e.to_string());
        }
        res
    }

    fn set_tag(&mut self, tag: Option<SyncTag>) {
        self.tag = tag;
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let head = Head { kind: CallKind::Barrier, ..BLANK };
        self.call(head, (0, 0), |me, head| {
            me.stage(Some(head))?;
            me.steps += 1;
            Ok(())
        })
    }

    fn stats(&self) -> &CommStats {
        &self.stats
    }

    fn backend(&self) -> &'static str {
        "shm"
    }
}

impl Drop for ShmComm {
    fn drop(&mut self) {
        // Members of this process (threads) see it at once; other processes see our pid exit.
        protocol::close(&self.map.ctrl(self.rank).closed);
    }
}

/// Forms the shared-memory groups `groups` (ranks of `boot`, ascending; every rank of `boot` in
/// exactly one, its members on one host) and returns this rank's member. A collective call on
/// `boot`: every rank passes the same `groups`.
pub(crate) fn join(boot: &mut dyn Collective, groups: &[Vec<usize>], cfg: ShmConfig) -> Result<ShmComm, CommError> {
    cfg.validate()?;
    let me = boot.rank();
    let (gi, local) = groups
        .iter()
        .enumerate()
        .find_map(|(g, m)| m.iter().position(|&r| r == me).map(|i| (g, i)))
        .ok_or_else(|| CommError::InvalidArgument(format!("rank {me} is in no shared-memory group")))?;
    let n = groups[gi].len();
    let mapped = share_mapping(boot, groups, gi, local == 0, &cfg)?;
    if let Ok(m) = &mapped {
        m.ctrl(local).pid.store(u64::from(std::process::id()), Ordering::Release);
    }
    // Which ranks failed; also the barrier after which every member has mapped the file.
    let mut failed = vec![0f32; boot.world_size()];
    failed[me] = f32::from(u8::from(mapped.is_err()));
    boot.all_reduce(&mut failed, ReduceOp::Sum)?;
    let mut map = mapped?;
    if let Err(e) = map.unlink() {
        // The group works; only the file outlives us until the next start sweeps it.
        qsr_notice::notice(true, &e.to_string());
    }
    if let Some(r) = failed.iter().position(|&f| f != 0.0) {
        return Err(CommError::InvalidArgument(format!(
            "rank {r} could not map its shared-memory group (its log says why)"
        )));
    }
    let watch = (0..n).map(|q| Watch::new(map.ctrl(q).pid.load(Ordering::Acquire), q == local)).collect();
    Ok(ShmComm {
        rank: local,
        n,
        names: groups[gi].clone(),
        cfg,
        map,
        watch,
        phase: 0,
        steps: 0,
        seq: 0,
        tag: None,
        stats: CommStats::default(),
        broken: None,
        failure: None,
    })
}

/// The group file of every group, made by each group's rank 0 and announced to its members over
/// `boot` (a collective call): this rank's mapping, or why it has none. The outer error is a failure
/// of `boot` itself, on which no rank can go on.
fn share_mapping(
    boot: &mut dyn Collective,
    groups: &[Vec<usize>],
    gi: usize,
    creator: bool,
    cfg: &ShmConfig,
) -> Result<Result<Mapping, CommError>, CommError> {
    let n = groups[gi].len();
    let made = creator.then(|| {
        let swept = mapping::sweep(&cfg.dir);
        if !swept.is_empty() {
            qsr_notice::notice(false, &format!("removed shared-memory files of dead jobs: {}", swept.join(", ")));
        }
        Mapping::create(&cfg.dir, n, cfg.slot_bytes)
    });
    // Each group's rank 0 tells its members the file name (or why it has none).
    let mut mine = Vec::new();
    for (g, members) in groups.iter().enumerate() {
        let mut msg = match (&made, g == gi) {
            (Some(Ok((_, name))), true) => name.clone().into_bytes(),
            (Some(Err(e)), true) => format!("!{e}").into_bytes(),
            _ => Vec::new(),
        };
        boot.broadcast_bytes(&mut msg, members[0])?;
        if g == gi {
            mine = msg;
        }
    }
    Ok(match made {
        Some(r) => r.map(|(m, _)| m),
        None => match String::from_utf8_lossy(&mine).strip_prefix('!') {
            Some(why) => Err(CommError::InvalidArgument(format!(
                "rank {} could not create the shared-memory group: {why}",
                groups[gi][0]
            ))),
            None => Mapping::open(&cfg.dir, &String::from_utf8_lossy(&mine), n, cfg.slot_bytes),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_of_inverts_split_range() {
        for total in [0usize, 1, 3, 7, 10, 101] {
            for k in 1..=6 {
                for s in 0..k {
                    for g in split_range(total, k, s) {
                        assert_eq!(segment_of(g, total, k), s, "total {total} k {k} g {g}");
                    }
                }
            }
        }
    }

    #[test]
    fn heads_name_the_first_differing_field() {
        let h = Head { seq: 3, kind: CallKind::AllReduce, op: Some((ReduceOp::Sum, Rounding::F32)), len: 8, ..BLANK };
        let bf16 = Head { op: Some((ReduceOp::Sum, Rounding::Bf16)), ..h };
        assert_eq!(h.differs(h.words()), None);
        let (field, ours, theirs) = h.differs(bf16.words()).unwrap();
        assert_eq!((field, ours.as_str(), theirs.as_str()), ("reduce op", "sum", "sum (bf16 payload)"));
        let b = Head { kind: CallKind::Barrier, op: None, ..h };
        assert_eq!(h.differs(b.words()).unwrap().0, "call");
        assert_eq!(h.differs(Head { len: 4, ..h }.words()).unwrap(), ("length (bytes)", "8".into(), "4".into()));
        assert_eq!(h.differs(Head { seq: 4, ..h }.words()).unwrap().0, "sequence number");
        let tagged = Head { tag: Some(SyncTag { steps: 12, h: 6, fragment: 2 }), ..h };
        assert_eq!(Head::tag_of(tagged.words()), tagged.tag);
        let (field, ours, theirs) = tagged.differs(h.words()).unwrap();
        assert_eq!((field, theirs.as_str()), ("sync", "no sync (an untagged call)"));
        assert_eq!(ours, "the sync after step 12 (a round of H = 6, fragment 2)");
        let one = Head { one_stage: true, ..h };
        assert_eq!(
            h.differs(one.words()).unwrap(),
            ("all-reduce path (shm one_stage_bytes)", "two stages".into(), "one stage".into())
        );
    }

    /// Regression: each member named the peer it compared against, so a layer above passed on
    /// different culprits for one divergence; the abort word now settles it.
    #[test]
    fn diverged_members_pass_on_the_same_culprit() {
        let dir = std::env::temp_dir().join(format!("qsr-shm-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = ShmConfig { dir: dir.clone(), ..ShmConfig::default() };
        let culprits = crate::run_threads(3, |mut boot| {
            let mut c = ShmComm::from_bootstrap(&mut boot, cfg.clone()).unwrap();
            let len = if c.rank() == 2 { 3 } else { 4 };
            assert!(c.all_reduce(&mut vec![0.0; len], ReduceOp::Sum).is_err());
            c.failure()
        });
        assert!(culprits[0].is_some() && culprits.iter().all(|c| *c == culprits[0]), "{culprits:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Regression: members waited for a leader working on the ring between hosts only a fixed
    /// time; a member's heartbeat now counts as progress, and without beats the timeout holds.
    #[test]
    fn a_beating_member_is_waited_for_past_the_timeout() {
        let dir = std::env::temp_dir().join(format!("qsr-shm-beat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = ShmConfig { timeout: Duration::from_millis(200), dir: dir.clone(), ..ShmConfig::default() };
        for beating in [true, false] {
            let results = crate::run_threads(2, |mut boot| {
                let mut c = ShmComm::from_bootstrap(&mut boot, cfg.clone()).unwrap();
                if c.rank() == 0 {
                    let beat = c.heartbeat();
                    for _ in 0..60 {
                        std::thread::sleep(Duration::from_millis(10));
                        if beating {
                            beat.bump();
                        }
                    }
                }
                c.barrier().map_err(|e| e.blamed_rank())
            });
            if beating {
                assert_eq!(results, vec![Ok(()), Ok(())], "600 ms of beats are progress");
            } else {
                assert_eq!(results[1], Err(Some(0)), "600 ms of silence outlast the 200 ms timeout");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Regression: a waiting rank watched every peer's process, so a peer that had already
    /// published the stage and then exited (its part done) was blamed while the stage still waited
    /// for a slower rank. Here rank 1's watch reports a dead process while rank 1 has published.
    #[test]
    fn a_peer_that_published_is_not_blamed_for_exiting() {
        let dir = std::env::temp_dir().join(format!("qsr-shm-published-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let cfg = ShmConfig { dir: dir.clone(), ..ShmConfig::default() };
        let results = crate::run_threads(3, |mut boot| {
            let mut c = ShmComm::from_bootstrap(&mut boot, cfg.clone()).unwrap();
            match c.rank() {
                // Rank 0 enters after rank 1 published (a thread of a loaded machine may wait its
                // turn for milliseconds, and an unpublished dead peer is rightly blamed), rank 2 later.
                0 => {
                    c.watch[1] = Watch::Proc(dead);
                    std::thread::sleep(Duration::from_millis(100));
                }
                2 => std::thread::sleep(Duration::from_millis(300)),
                _ => {}
            }
            c.barrier().map_err(|e| e.to_string())
        });
        assert_eq!(results, vec![Ok(()), Ok(()), Ok(())]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn abort_words_round_trip() {
        let w = abort_word(5, Cause::Stalled, 2);
        assert!(matches!(decode_abort(w), Some(Fail::Aborted(5, Cause::Stalled, 2))));
        assert!(decode_abort(0).is_none());
    }
}
