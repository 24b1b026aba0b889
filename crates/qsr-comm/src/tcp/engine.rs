//! One ring collective over two non-blocking sockets, driven by `poll(2)` on the caller's thread.
//!
//! Sending to the right and receiving from the left progress together, syscall by syscall, so
//! neither direction waits for the other and messages larger than the socket buffers cannot
//! deadlock. Received data goes straight into the caller's buffer (all-gather, broadcast) or a
//! one-block staging buffer (reduce-scatter), and is sent straight from the caller's buffer.
//!
//! Liveness: a peer is blamed when nothing arrives from it (data, keepalive or heartbeat) and
//! nothing we write is accepted for `timeout`. A live peer that has nothing to send while it
//! waits emits a keepalive (forward) or heartbeat (reverse) every `timeout / 4`, so only the
//! peer that actually stopped is blamed. On any failure we tell both neighbours (an abort frame
//! forward after finishing the frame in flight, an abort message backward), so every rank
//! reports the same culprit quickly instead of blaming its own neighbour or waiting for its own
//! timeout.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use qsr_kernels::{Codec, WIRE_BLOCK};

use crate::CommError;
use crate::collective::tag_name;
use crate::util::f32_bytes_mut;
use crate::wire::{self, Back, CallHeader, Frame, Reason};

use super::Ring;
use super::plan::{Action, Plan, RecvBlock};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Left,
    Right,
}

/// A failure inside a call: the error to return and whom to tell.
pub(crate) struct Fail {
    pub err: CommError,
    /// Rank that a notice to the neighbours blames.
    pub culprit: usize,
    pub reason: Reason,
    /// Where the failure came from; that side already knows.
    pub from: Option<Side>,
}

/// Bytes in flight to the right: a frame head and optionally a payload range of the buffer.
struct Out {
    head: [u8; wire::CALL_HEADER_LEN],
    head_len: usize,
    head_off: usize,
    payload: std::ops::Range<usize>,
    pay_off: usize,
}

impl Out {
    fn small(bytes: &[u8]) -> Out {
        let mut head = [0u8; wire::CALL_HEADER_LEN];
        head[..bytes.len()].copy_from_slice(bytes);
        Out { head, head_len: bytes.len(), head_off: 0, payload: 0..0, pay_off: 0 }
    }
}

enum RState {
    Header { buf: [u8; wire::CALL_HEADER_LEN], got: usize },
    FrameHead { buf: [u8; wire::FRAME_LEN], got: usize },
    Payload { len: usize, got: usize },
    Done,
}

enum Step {
    Moved,
    Blocked,
    Idle,
}

/// Which directions are blocked: a direction is blocked after a syscall returned WouldBlock,
/// until `poll` says otherwise.
#[derive(Default)]
struct Blocked {
    left_read: bool,
    right_write: bool,
    right_read: bool,
    left_write: bool,
}

impl Blocked {
    /// Clears the flags of the directions `poll` reported ready (or failed: the next syscall
    /// reports the error).
    fn unblock(&mut self, fds: &[libc::pollfd; 2]) {
        let bad = libc::POLLERR | libc::POLLHUP | libc::POLLNVAL;
        if fds[0].revents & (libc::POLLIN | bad) != 0 {
            self.left_read = false;
        }
        if fds[0].revents & (libc::POLLOUT | bad) != 0 {
            self.left_write = false;
        }
        if fds[1].revents & (libc::POLLIN | bad) != 0 {
            self.right_read = false;
        }
        if fds[1].revents & (libc::POLLOUT | bad) != 0 {
            self.right_write = false;
        }
    }
}

/// Records a pump's outcome: sets `blocked` on `Blocked`; returns whether bytes moved.
fn note(step: Step, blocked: &mut bool) -> bool {
    match step {
        Step::Moved => true,
        Step::Blocked => {
            *blocked = true;
            false
        }
        Step::Idle => false,
    }
}

fn nb<T>(r: io::Result<T>) -> io::Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => Ok(None),
        Err(e) => Err(e),
    }
}

/// The buffer of a call: f32s (all-reduce), f32s travelling as bf16, or bytes; all transfers use
/// its byte view (for bf16: the wire copy).
pub(crate) enum Buf<'a> {
    F32(&'a mut [f32]),
    /// The f32 values, reduced in f32, and their bf16 wire copy (little-endian), 2 bytes per value.
    Bf16 {
        master: &'a mut [f32],
        wire: &'a mut [u8],
    },
    /// The f32 values (padded to whole blocks of `WIRE_BLOCK`), reduced in f32, and their
    /// quantized wire copy: per block its scale and the packed codes (`Codec::block_bytes`); `len`
    /// values are the buffer's, the rest padding.
    Quantized {
        master: &'a mut [f32],
        wire: &'a mut [u8],
        codec: Codec,
        len: usize,
    },
    Bytes(&'a mut [u8]),
}

impl Buf<'_> {
    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Buf::F32(f) => f32_bytes_mut(f),
            Buf::Bf16 { wire, .. } | Buf::Quantized { wire, .. } => wire,
            Buf::Bytes(b) => b,
        }
    }
}

/// The bf16 of little-endian wire bytes `b`, as f32.
pub(crate) fn bf16_at(b: &[u8]) -> f32 {
    half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Writes `x` rounded to bf16 into two little-endian wire bytes.
pub(crate) fn put_bf16(x: f32, out: &mut [u8]) {
    out.copy_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes());
}

pub(crate) struct Call<'a> {
    pub ring: &'a mut Ring,
    pub rank: usize,
    pub n: usize,
    pub timeout: Duration,
    pub buf: Buf<'a>,
    pub scratch: &'a mut Vec<f32>,
    pub plan: Plan,
    pub header: CallHeader,
    pub during: String,
    pub sent: u64,
    pub received: u64,
    out: Option<Out>,
    header_queued: bool,
    send_idx: usize,
    rstate: RState,
    recv_idx: usize,
    last_left: Instant,
    last_right: Instant,
    last_fwd_write: Instant,
    last_back_write: Instant,
    heartbeat: Duration,
    /// Called when bytes moved (at most once per wait) and when the call completes, for a layer above
    /// that reports progress.
    pub progress: Option<&'a (dyn Fn() + Send + Sync)>,
}

impl<'a> Call<'a> {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        ring: &'a mut Ring,
        rank: usize,
        n: usize,
        timeout: Duration,
        buf: Buf<'a>,
        scratch: &'a mut Vec<f32>,
        plan: Plan,
        header: CallHeader,
        during: String,
    ) -> Self {
        let now = Instant::now();
        Call {
            ring,
            rank,
            n,
            timeout,
            buf,
            scratch,
            plan,
            header,
            during,
            sent: 0,
            received: 0,
            out: None,
            header_queued: false,
            send_idx: 0,
            rstate: RState::Header { buf: [0; wire::CALL_HEADER_LEN], got: 0 },
            recv_idx: 0,
            last_left: now,
            last_right: now,
            last_fwd_write: now,
            last_back_write: now,
            heartbeat: (timeout / 4).max(Duration::from_millis(5)),
            progress: None,
        }
    }

    fn left_rank(&self) -> usize {
        (self.rank + self.n - 1) % self.n
    }
    fn right_rank(&self) -> usize {
        (self.rank + 1) % self.n
    }

    fn lost(&self, side: Side, detail: String) -> Fail {
        let (rank, addr) = match side {
            Side::Left => (self.left_rank(), self.ring.left_addr.clone()),
            Side::Right => (self.right_rank(), self.ring.right_addr.clone()),
        };
        Fail {
            err: CommError::PeerLost { rank, addr, during: self.during.clone(), detail },
            culprit: rank,
            reason: Reason::Lost,
            from: Some(side),
        }
    }

    fn protocol(&self, side: Side, detail: String) -> Fail {
        let (rank, addr) = match side {
            Side::Left => (self.left_rank(), &self.ring.left_addr),
            Side::Right => (self.right_rank(), &self.ring.right_addr),
        };
        Fail {
            err: CommError::Protocol { peer: format!("rank {rank} ({addr}) during {}", self.during), detail },
            culprit: rank,
            reason: Reason::Protocol,
            from: None,
        }
    }

    fn aborted(&self, side: Side, culprit: u64, reason: u64) -> Fail {
        let reporter = match side {
            Side::Left => self.left_rank(),
            Side::Right => self.right_rank(),
        };
        if culprit >= self.n as u64 {
            return self.protocol(side, format!("abort notice names rank {culprit} of {}", self.n));
        }
        let reason = Reason::from_code(reason);
        Fail {
            err: CommError::Aborted {
                culprit: culprit as usize,
                reason: reason.describe().into(),
                reporter,
                during: self.during.clone(),
            },
            culprit: culprit as usize,
            reason,
            from: Some(side),
        }
    }

    fn send_done(&self) -> bool {
        self.header_queued && self.out.is_none() && self.send_idx == self.plan.send.len()
    }
    fn recv_done(&self) -> bool {
        matches!(self.rstate, RState::Done)
    }

    /// Runs the call to completion; on failure notifies the neighbours before returning.
    pub(crate) fn run(&mut self) -> Result<(), CommError> {
        match self.drive() {
            Ok(()) => Ok(()),
            Err(f) => {
                self.notify(&f);
                Err(f.err)
            }
        }
    }

    fn drive(&mut self) -> Result<(), Fail> {
        let mut blocked = Blocked::default();
        loop {
            let mut any = false;
            loop {
                let moved = self.pump_all(&mut blocked)?;
                if self.send_done() && self.recv_done() {
                    // A call that never had to wait still moved bytes: its watchers hear so.
                    if let Some(p) = self.progress {
                        p();
                    }
                    return Ok(());
                }
                any |= moved;
                if !moved {
                    break;
                }
            }
            if let (true, Some(p)) = (any, self.progress) {
                p();
            }
            let now = Instant::now();
            self.check_liveness(now)?;
            if self.queue_idle_traffic(now) {
                continue;
            }
            self.wait_ready(now, &mut blocked)?;
        }
    }

    /// One pass over the four directions that are not blocked; returns whether any moved.
    fn pump_all(&mut self, blocked: &mut Blocked) -> Result<bool, Fail> {
        let mut moved = false;
        if !blocked.left_read {
            moved |= note(self.pump_recv()?, &mut blocked.left_read);
        }
        if !blocked.right_write {
            moved |= note(self.pump_send()?, &mut blocked.right_write);
        }
        if !blocked.right_read {
            moved |= note(self.pump_back_in()?, &mut blocked.right_read);
        }
        if !blocked.left_write {
            moved |= note(self.pump_back_out(), &mut blocked.left_write);
        }
        Ok(moved)
    }

    /// Liveness: blame the right first when we are blocked writing to it (a live peer always
    /// drains its left socket), else whoever we are waiting on.
    fn check_liveness(&self, now: Instant) -> Result<(), Fail> {
        let right_dead = !self.send_done() && now.duration_since(self.last_right) >= self.timeout;
        let left_dead = !self.recv_done() && now.duration_since(self.last_left) >= self.timeout;
        if right_dead && (self.out.is_some() || !left_dead) {
            return Err(self.timed_out(Side::Right));
        }
        if left_dead {
            return Err(self.timed_out(Side::Left));
        }
        Ok(())
    }

    /// Queues a keepalive forward and/or a heartbeat backward when one is due; returns whether
    /// anything was queued.
    fn queue_idle_traffic(&mut self, now: Instant) -> bool {
        let mut queued = false;
        // Keepalive forward while we owe the right more frames but have none ready.
        if !self.send_done()
            && self.out.is_none()
            && self.header_queued
            && now.duration_since(self.last_fwd_write) >= self.heartbeat
        {
            self.out = Some(Out::small(&Frame::KeepAlive.encode()));
            queued = true;
        }
        // Heartbeat backward while we still expect frames from the left.
        if !self.recv_done()
            && !self.ring.back_pending()
            && !self.ring.left_back_broken
            && now.duration_since(self.last_back_write) >= self.heartbeat
        {
            self.ring.back_out.clear();
            self.ring.back_off = 0;
            self.ring.back_out.extend_from_slice(&Back::Heartbeat.encode());
            self.last_back_write = now;
            queued = true;
        }
        queued
    }

    /// How long `poll` may sleep: until the next heartbeat or the earliest liveness deadline.
    fn poll_wait(&self, now: Instant) -> Duration {
        let mut wait = self.heartbeat;
        if !self.recv_done() {
            wait = wait.min((self.last_left + self.timeout).saturating_duration_since(now));
        }
        if !self.send_done() {
            wait = wait.min((self.last_right + self.timeout).saturating_duration_since(now));
        }
        wait
    }

    /// The poll set: the left socket, then the right one (fd -1 when there is nothing to wait for).
    fn poll_fds(&self) -> [libc::pollfd; 2] {
        let want_write = self.out.is_some() || !self.header_queued || self.next_block_ready();
        let left_events = (if self.recv_done() { 0 } else { libc::POLLIN })
            | (if self.ring.back_pending() { libc::POLLOUT } else { 0 });
        let right_events =
            (if self.ring.right_closed { 0 } else { libc::POLLIN }) | (if want_write { libc::POLLOUT } else { 0 });
        [
            libc::pollfd {
                fd: if left_events != 0 { self.ring.left.as_raw_fd() } else { -1 },
                events: left_events,
                revents: 0,
            },
            libc::pollfd {
                fd: if right_events != 0 { self.ring.right.as_raw_fd() } else { -1 },
                events: right_events,
                revents: 0,
            },
        ]
    }

    /// Sleeps in `poll` until a socket is ready or a deadline is due, and unblocks the directions
    /// that became ready.
    fn wait_ready(&self, now: Instant, blocked: &mut Blocked) -> Result<(), Fail> {
        let wait = self.poll_wait(now);
        let mut fds = self.poll_fds();
        let ms = wait.as_micros().div_ceil(1000).clamp(1, i32::MAX as u128) as i32;
        // SAFETY: `fds` is a valid array of two pollfd structs for the duration of the call.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(Fail {
                    err: CommError::io("poll", e),
                    culprit: self.rank,
                    reason: Reason::Other,
                    from: None,
                });
            }
        }
        blocked.unblock(&fds);
        Ok(())
    }

    fn timed_out(&self, side: Side) -> Fail {
        let (rank, addr) = match side {
            Side::Left => (self.left_rank(), self.ring.left_addr.clone()),
            Side::Right => (self.right_rank(), self.ring.right_addr.clone()),
        };
        Fail {
            err: CommError::PeerTimeout { rank, addr, during: self.during.clone(), timeout: self.timeout },
            culprit: rank,
            reason: Reason::Timeout,
            from: Some(side),
        }
    }

    fn next_block_ready(&self) -> bool {
        self.plan.send.get(self.send_idx).is_some_and(|b| b.after <= self.recv_idx)
    }

    /// Reads from the left: call header, frame heads, payloads.
    fn pump_recv(&mut self) -> Result<Step, Fail> {
        let state = std::mem::replace(&mut self.rstate, RState::Done);
        let (state, step) = self.recv_step(state)?;
        self.rstate = state;
        Ok(step)
    }

    fn read_left(&mut self, dst: &mut [u8]) -> Result<Option<usize>, Fail> {
        match nb((&self.ring.left).read(dst)) {
            Ok(None) => Ok(None),
            Ok(Some(0)) => Err(self.lost(Side::Left, "connection closed (peer exited or crashed)".into())),
            Ok(Some(k)) => {
                self.last_left = Instant::now();
                Ok(Some(k))
            }
            Err(e) => Err(self.lost(Side::Left, e.to_string())),
        }
    }

    fn recv_step(&mut self, state: RState) -> Result<(RState, Step), Fail> {
        match state {
            RState::Done => Ok((RState::Done, Step::Idle)),
            RState::Header { buf, got } => self.recv_header(buf, got),
            RState::FrameHead { buf, got } => self.recv_frame_head(buf, got),
            RState::Payload { len, got } => self.recv_payload(len, got),
        }
    }

    /// Reads the call header (or an abort notice standing in its place) and checks it against ours.
    fn recv_header(&mut self, mut buf: [u8; wire::CALL_HEADER_LEN], mut got: usize) -> Result<(RState, Step), Fail> {
        let Some(k) = self.read_left(&mut buf[got..])? else {
            return Ok((RState::Header { buf, got }, Step::Blocked));
        };
        got += k;
        // An abort notice may stand where the header would be.
        if got >= wire::FRAME_LEN && buf[..4] == wire::TAG_ABORT {
            return match Frame::decode(&buf[..wire::FRAME_LEN]) {
                Ok(Frame::Abort { culprit, reason }) => Err(self.aborted(Side::Left, u64::from(culprit), reason)),
                _ => Err(self.protocol(Side::Left, "malformed abort frame".into())),
            };
        }
        if got < wire::CALL_HEADER_LEN {
            return Ok((RState::Header { buf, got }, Step::Moved));
        }
        let theirs = CallHeader::decode(&buf).map_err(|e| self.protocol(Side::Left, e.to_string()))?;
        self.check_header(&theirs)?;
        let next = self.next_recv_state();
        Ok((next, Step::Moved))
    }

    /// Reads a frame head: keepalives are skipped, aborts fail the call, a data frame must be the
    /// block we expect next.
    fn recv_frame_head(&mut self, mut buf: [u8; wire::FRAME_LEN], mut got: usize) -> Result<(RState, Step), Fail> {
        let Some(k) = self.read_left(&mut buf[got..])? else {
            return Ok((RState::FrameHead { buf, got }, Step::Blocked));
        };
        got += k;
        if got < wire::FRAME_LEN {
            return Ok((RState::FrameHead { buf, got }, Step::Moved));
        }
        match Frame::decode(&buf).map_err(|e| self.protocol(Side::Left, e.to_string()))? {
            Frame::KeepAlive => Ok((RState::FrameHead { buf: [0; wire::FRAME_LEN], got: 0 }, Step::Moved)),
            Frame::Abort { culprit, reason } => Err(self.aborted(Side::Left, u64::from(culprit), reason)),
            Frame::Data { len, block } => {
                let expect = &self.plan.recv[self.recv_idx];
                if block != self.recv_idx as u64 || len as usize != expect.range.len() {
                    return Err(self.protocol(
                        Side::Left,
                        format!(
                            "data frame for block {block} with {len} bytes, expected block {} with {} bytes",
                            self.recv_idx,
                            expect.range.len()
                        ),
                    ));
                }
                Ok((RState::Payload { len: len as usize, got: 0 }, Step::Moved))
            }
        }
    }

    /// Reads payload bytes of the current block; a complete block is applied to the buffer.
    fn recv_payload(&mut self, len: usize, mut got: usize) -> Result<(RState, Step), Fail> {
        let block = self.plan.recv[self.recv_idx].clone();
        if got == len {
            // Held until our own bytes are out (an exchange reduces into what it sends).
            return self.apply_when_sent(block, len, got);
        }
        let k = match self.read_payload(&block, len, got)? {
            None => return Ok((RState::Payload { len, got }, Step::Blocked)),
            Some(0) => {
                return Err(self.lost(Side::Left, "connection closed (peer exited or crashed)".into()));
            }
            Some(k) => k,
        };
        self.last_left = Instant::now();
        self.received += k as u64;
        got += k;
        if got < len {
            return Ok((RState::Payload { len, got }, Step::Moved));
        }
        self.apply_when_sent(block, len, got).map(|(s, _)| (s, Step::Moved))
    }

    /// Applies a complete block, unless the plan reduces after sending and our sends are not done.
    fn apply_when_sent(&mut self, block: RecvBlock, len: usize, got: usize) -> Result<(RState, Step), Fail> {
        if self.plan.reduce_after_send && !self.send_done() {
            return Ok((RState::Payload { len, got }, Step::Idle));
        }
        self.apply(&block);
        self.recv_idx += 1;
        Ok((self.next_recv_state(), Step::Moved))
    }

    /// One non-blocking read of payload bytes `got..len` of `block`: straight into the buffer
    /// (copy) or into the staging buffer (reduce).
    fn read_payload(&mut self, block: &RecvBlock, len: usize, got: usize) -> Result<Option<usize>, Fail> {
        let read = match block.action {
            Action::Copy => {
                let range = block.range.start + got..block.range.end;
                // Split borrows: the buffer and the stream live in different fields.
                let dst = &mut self.buf.bytes()[range];
                nb((&self.ring.left).read(dst))
            }
            Action::Reduce | Action::ReduceMean => {
                // f32 words enough for `len` bytes (bf16 blocks may be 2 bytes short of a word).
                let words = len.div_ceil(4);
                if self.scratch.len() < words {
                    self.scratch.resize(words, 0.0);
                }
                let dst = &mut f32_bytes_mut(&mut self.scratch[..words])[got..len];
                nb((&self.ring.left).read(dst))
            }
        };
        read.map_err(|e| self.lost(Side::Left, e.to_string()))
    }

    fn next_recv_state(&self) -> RState {
        if self.recv_idx == self.plan.recv.len() {
            RState::Done
        } else {
            RState::FrameHead { buf: [0; wire::FRAME_LEN], got: 0 }
        }
    }

    /// Applies a fully received reduce block from the staging buffer.
    fn apply(&mut self, block: &RecvBlock) {
        if block.action == Action::Copy {
            return;
        }
        let mean = block.action == Action::ReduceMean;
        let k = self.n as f32;
        let finish = |sum: f32| if mean { sum / k } else { sum };
        match &mut self.buf {
            Buf::F32(f) => {
                let (lo, hi) = (block.range.start / 4, block.range.end / 4);
                let src = &self.scratch[..hi - lo];
                f[lo..hi].iter_mut().zip(src).for_each(|(d, s)| *d = finish(*d + *s));
            }
            Buf::Bf16 { master, wire } => {
                // f32 accumulation of the received bf16 partial sum; the result goes on as bf16.
                let (lo, hi) = (block.range.start / 2, block.range.end / 2);
                let src = &f32_bytes_mut(self.scratch)[..(hi - lo) * 2];
                let out = &mut wire[block.range.clone()];
                for (i, d) in master[lo..hi].iter_mut().enumerate() {
                    *d = finish(*d + bf16_at(&src[2 * i..]));
                    put_bf16(*d, &mut out[2 * i..2 * i + 2]);
                }
            }
            Buf::Quantized { master, wire, codec, len } => {
                // The received partial sum decoded, our f32 values added, the sum quantized again.
                let bytes = codec.block_bytes();
                let (lo, hi) = (block.range.start / bytes, block.range.end / bytes);
                let src = &f32_bytes_mut(self.scratch)[..(hi - lo) * bytes];
                let mut got = [0.0f32; WIRE_BLOCK];
                for (i, g) in (lo..hi).enumerate() {
                    codec.get_block(&src[i * bytes..(i + 1) * bytes], &mut got);
                    let d = &mut master[g * WIRE_BLOCK..(g + 1) * WIRE_BLOCK];
                    d.iter_mut().zip(&got).for_each(|(d, s)| *d = finish(*d + *s));
                    // The padding stays zero (int2 has no zero level: a decoded pad is not 0), so a
                    // partial block's scale is its values' alone, as in the in-process group.
                    d[len.saturating_sub(g * WIRE_BLOCK).min(WIRE_BLOCK)..].fill(0.0);
                    codec.put_block(d, &mut wire[g * bytes..(g + 1) * bytes]);
                }
            }
            Buf::Bytes(_) => {}
        }
    }

    fn check_header(&self, theirs: &CallHeader) -> Result<(), Fail> {
        let ours = &self.header;
        let left = self.left_rank();
        let kind_name = |k: u8| match k {
            wire::KIND_ALL_REDUCE => "all_reduce".to_string(),
            wire::KIND_BROADCAST => "broadcast".into(),
            wire::KIND_BARRIER => "barrier".into(),
            wire::KIND_BROADCAST_BYTES => "broadcast_bytes".into(),
            wire::KIND_BROADCAST_LEN => "broadcast_bytes length".into(),
            k => format!("kind {k}"),
        };
        let op_name = wire::op_label;
        let diff: Option<(&'static str, String, String)> = if theirs.sender as usize != left {
            Some(("sender rank", left.to_string(), theirs.sender.to_string()))
        } else if theirs.tag != ours.tag {
            // Ranks at different syncs usually differ in nothing else; this names the cause.
            Some(("sync", tag_name(ours.tag), tag_name(theirs.tag)))
        } else if theirs.seq != ours.seq {
            Some(("sequence number", ours.seq.to_string(), theirs.seq.to_string()))
        } else if theirs.kind != ours.kind {
            Some(("call", kind_name(ours.kind), kind_name(theirs.kind)))
        } else if theirs.op != ours.op {
            // Before the length: a bf16 call against an f32 one differs in both, and the op says why.
            Some(("reduce op", op_name(ours.op), op_name(theirs.op)))
        } else if theirs.len != ours.len {
            Some(("length (bytes)", ours.len.to_string(), theirs.len.to_string()))
        } else if theirs.root != ours.root {
            Some(("root", ours.root.to_string(), theirs.root.to_string()))
        } else if theirs.chunk != ours.chunk {
            Some(("block size (TcpConfig::chunk_bytes / 4096)", ours.chunk.to_string(), theirs.chunk.to_string()))
        } else {
            None
        };
        match diff {
            None => Ok(()),
            Some((field, o, t)) => Err(Fail {
                err: CommError::CallsDiffer {
                    me: self.rank,
                    peer: left,
                    field,
                    ours: o,
                    theirs: t,
                    during: self.during.clone(),
                },
                culprit: left,
                reason: Reason::CallsDiffer,
                from: None,
            }),
        }
    }

    /// Writes to the right: header, data frames (head + payload in one writev), keepalives.
    fn pump_send(&mut self) -> Result<Step, Fail> {
        if self.out.is_none() {
            if !self.header_queued {
                self.out = Some(Out::small(&self.header.encode()));
                self.header_queued = true;
            } else if self.next_block_ready() {
                let range = self.plan.send[self.send_idx].range.clone();
                let head = Frame::Data { len: range.len() as u32, block: self.send_idx as u64 }.encode();
                let mut out = Out::small(&head);
                out.payload = range;
                self.out = Some(out);
                self.send_idx += 1;
            } else {
                return Ok(Step::Idle);
            }
        }
        let Some(out) = self.out.as_mut() else {
            return Ok(Step::Idle);
        };
        let bytes = self.buf.bytes();
        let head = &out.head[out.head_off..out.head_len];
        let payload = &bytes[out.payload.start + out.pay_off..out.payload.end];
        let res = (&self.ring.right).write_vectored(&[IoSlice::new(head), IoSlice::new(payload)]);
        match nb(res) {
            Ok(None) => Ok(Step::Blocked),
            Ok(Some(0)) => Err(self.lost(Side::Right, "connection closed".into())),
            Ok(Some(mut k)) => {
                let now = Instant::now();
                self.last_right = now;
                self.last_fwd_write = now;
                let h = k.min(out.head_len - out.head_off);
                out.head_off += h;
                k -= h;
                out.pay_off += k;
                self.sent += k as u64;
                if out.head_off == out.head_len && out.pay_off == out.payload.len() {
                    self.out = None;
                }
                Ok(Step::Moved)
            }
            Err(e) => Err(self.lost(Side::Right, e.to_string())),
        }
    }

    /// Reads reverse-channel messages from the right: heartbeats and abort notices.
    fn pump_back_in(&mut self) -> Result<Step, Fail> {
        if self.ring.right_closed {
            return Ok(Step::Idle);
        }
        let got = self.ring.back_got;
        let res = nb((&self.ring.right).read(&mut self.ring.back_in[got..]));
        match res {
            Ok(None) => Ok(Step::Blocked),
            Ok(Some(0)) | Err(_) if self.send_done() => {
                // The right has everything it needs from us and has gone; only the next call
                // (if any) cares, and it will fail on its first write.
                self.ring.right_closed = true;
                Ok(Step::Idle)
            }
            Ok(Some(0)) => Err(self.lost(Side::Right, "connection closed (peer exited or crashed)".into())),
            Err(e) => Err(self.lost(Side::Right, e.to_string())),
            Ok(Some(k)) => {
                self.last_right = Instant::now();
                self.ring.back_got += k;
                if self.ring.back_got == wire::BACK_LEN {
                    self.ring.back_got = 0;
                    match Back::decode(&self.ring.back_in) {
                        Ok(Back::Heartbeat) => {}
                        Ok(Back::Abort { culprit, reason }) => {
                            return Err(self.aborted(Side::Right, u64::from(culprit), u64::from(reason)));
                        }
                        Err(e) => return Err(self.protocol(Side::Right, e.to_string())),
                    }
                }
                Ok(Step::Moved)
            }
        }
    }

    /// Writes pending reverse-channel bytes to the left (best effort: a dead left is detected by
    /// the read side).
    fn pump_back_out(&mut self) -> Step {
        if !self.ring.back_pending() {
            return Step::Idle;
        }
        let ring = &mut *self.ring;
        match nb((&ring.left).write(&ring.back_out[ring.back_off..])) {
            Ok(None) => Step::Blocked,
            Ok(Some(k)) => {
                ring.back_off += k;
                if ring.back_off == ring.back_out.len() {
                    ring.back_out.clear();
                    ring.back_off = 0;
                }
                self.last_back_write = Instant::now();
                Step::Moved
            }
            Err(_) => {
                ring.back_out.clear();
                ring.back_off = 0;
                ring.left_back_broken = true;
                Step::Idle
            }
        }
    }

    /// Tells the neighbours about a failure: an abort frame forward (after completing the frame
    /// in flight, so the stream stays parseable) and an abort message backward. Bounded by a
    /// short deadline; a dead or stalled culprit is not written to.
    fn notify(&mut self, f: &Fail) {
        let (mut fwd, mut back) = self.notice_targets(f);
        let abort_frame = Frame::Abort { culprit: f.culprit as u32, reason: f.reason as u64 }.encode();
        let mut abort_queued = false;
        if back {
            self.ring
                .back_out
                .extend_from_slice(&Back::Abort { culprit: f.culprit as u32, reason: f.reason as u32 }.encode());
        }
        let deadline = Instant::now() + self.timeout.min(Duration::from_secs(2));
        loop {
            if fwd && self.out.is_none() && !abort_queued {
                self.out = Some(Out::small(&abort_frame));
                abort_queued = true;
            }
            let fwd_pending = fwd && (self.out.is_some() || !abort_queued);
            let back_pending = back && self.ring.back_pending();
            if !fwd_pending && !back_pending {
                return;
            }
            let mut moved = false;
            if fwd_pending {
                match self.pump_send() {
                    Ok(Step::Moved) => moved = true,
                    Ok(_) => {}
                    Err(_) => fwd = false,
                }
            }
            if back_pending {
                match self.pump_back_out() {
                    Step::Moved => moved = true,
                    Step::Idle if self.ring.left_back_broken => back = false,
                    _ => {}
                }
            }
            if moved {
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                tracing::warn!(rank = self.rank, "could not deliver the abort notice before the deadline");
                return;
            }
            self.wait_writable(fwd, back, deadline - now);
        }
    }

    /// Whom a failure notice goes to: (forward to the right, backward to the left). Not to the
    /// side it came from, nor to a dead or stalled culprit, nor over a broken reverse channel.
    fn notice_targets(&self, f: &Fail) -> (bool, bool) {
        let skip_culprit = matches!(f.reason, Reason::Lost | Reason::Timeout);
        let skip = |r: usize| skip_culprit && r == f.culprit;
        let fwd = f.from != Some(Side::Right) && !skip(self.right_rank());
        let back = f.from != Some(Side::Left) && !skip(self.left_rank()) && !self.ring.left_back_broken;
        if self.n == 2 && f.from.is_some() {
            // Both neighbours are the same rank, which told us (or died): nothing to tell.
            return (false, false);
        }
        (fwd, back)
    }

    /// Waits (at most `left`, capped at 100 ms) until a socket we still notify can take bytes.
    fn wait_writable(&self, fwd: bool, back: bool, left: Duration) {
        let mut fds = [
            libc::pollfd { fd: if back { self.ring.left.as_raw_fd() } else { -1 }, events: libc::POLLOUT, revents: 0 },
            libc::pollfd { fd: if fwd { self.ring.right.as_raw_fd() } else { -1 }, events: libc::POLLOUT, revents: 0 },
        ];
        let ms = left.as_millis().clamp(1, 100) as i32;
        // SAFETY: valid pollfd array for the duration of the call.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
    }
}

pub(crate) fn set_nonblocking(s: &TcpStream) -> io::Result<()> {
    s.set_nonblocking(true)
}
