//! Which bytes go where in one ring collective: pure functions, unit-tested without sockets.
//!
//! A call is a sequence of *blocks* (sub-chunks of ring segments). Rank r sends its block list to
//! rank r+1 and receives rank r-1's block list, so the i-th block rank r-1 sends is the i-th block
//! rank r receives: both derive the same list from the call header.
//!
//! All-reduce with n ranks (segment c = `split_range(len, n, c)`; all arithmetic mod n):
//! - receive, reduce-scatter step s = 0..n-1: segment r-s-1, added to our copy; at the last
//!   step it is complete (our *owned* segment r+1) and, for a mean, divided by n;
//! - receive, all-gather step t = 0..n-1: segment r-t, final value, copied in place;
//! - send: our own segment r first, then every received segment except the last one, each block
//!   forwarded as soon as it has been received and processed. So the send of block i overlaps
//!   the receive of block i+1, within a step and across steps.
//!
//! Segment c is summed in the fixed order x_c, x_{c+1}, ..., x_{c-1} (each rank adds its own value
//! to the partial sum it received), then its final value travels as bytes: every rank ends with
//! bit-identical results, independent of timing.
//!
//! Broadcast from root: the root sends the whole buffer; every other rank receives it and
//! forwards each block, except the root's left neighbour, which only receives.

use std::ops::Range;

use crate::split_range;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// Add the received f32s into the buffer.
    Reduce,
    /// Add, then divide by the world size (the last reduce-scatter step of a mean).
    ReduceMean,
    /// The bytes were received in place; nothing to do.
    Copy,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RecvBlock {
    pub range: Range<usize>,
    pub action: Action,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SendBlock {
    pub range: Range<usize>,
    /// The block may be sent once this many received blocks have been processed.
    pub after: usize,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    pub send: Vec<SendBlock>,
    pub recv: Vec<RecvBlock>,
    /// Received blocks are reduced into the buffer only once all of ours are sent (an exchange
    /// sends the very range it reduces into).
    pub reduce_after_send: bool,
}

/// Smallest block the pipeline splits a segment into (smaller costs more in syscalls than it
/// gains in overlap).
const MIN_BLOCK: usize = 16 << 10;

/// Byte ranges of `seg` (an element range of f32s, or a byte range when `elem == 1`) in blocks
/// of at most `chunk` bytes. A segment is split into at least ~4 blocks when it is large enough,
/// so even a 1 MiB all-reduce pipelines its steps.
fn blocks(seg: Range<usize>, elem: usize, chunk: usize, out: &mut Vec<Range<usize>>) {
    let (start, end) = (seg.start * elem, seg.end * elem);
    let target = ((end - start) / 4).max(MIN_BLOCK).min(chunk);
    let chunk = (target / elem).max(1) * elem;
    let mut lo = start;
    while lo < end {
        let hi = (lo + chunk).min(end);
        out.push(lo..hi);
        lo = hi;
    }
}

/// Plan of an all-reduce of `len` f32s on rank `rank` of `n` (n >= 2).
pub(crate) fn all_reduce(rank: usize, n: usize, len: usize, mean: bool, chunk: usize) -> Plan {
    all_reduce_of(rank, n, len, mean, chunk, 4)
}

/// [`all_reduce`] of elements of `elem` bytes on the wire (4: f32, 2: bf16); ranges are byte ranges.
pub(crate) fn all_reduce_of(rank: usize, n: usize, len: usize, mean: bool, chunk: usize, elem: usize) -> Plan {
    let seg = |c: usize| split_range(len, n, c % n);
    let mut recv = Vec::new();
    let mut tmp = Vec::new();
    for s in 0..n - 1 {
        tmp.clear();
        blocks(seg(rank + 2 * n - s - 1), elem, chunk, &mut tmp);
        let action = if s == n - 2 && mean { Action::ReduceMean } else { Action::Reduce };
        recv.extend(tmp.iter().map(|r| RecvBlock { range: r.clone(), action }));
    }
    for t in 0..n - 1 {
        tmp.clear();
        blocks(seg(rank + n - t), elem, chunk, &mut tmp);
        recv.extend(tmp.iter().map(|r| RecvBlock { range: r.clone(), action: Action::Copy }));
    }
    // The last all-gather segment is not forwarded: its next hop is the rank that owns it.
    tmp.clear();
    blocks(seg(rank + 2), elem, chunk, &mut tmp);
    let forwarded = recv.len() - tmp.len();
    let mut send = Vec::new();
    tmp.clear();
    blocks(seg(rank), elem, chunk, &mut tmp);
    send.extend(tmp.iter().map(|r| SendBlock { range: r.clone(), after: 0 }));
    send.extend(recv[..forwarded].iter().enumerate().map(|(i, b)| SendBlock { range: b.range.clone(), after: i + 1 }));
    Plan { send, recv, reduce_after_send: false }
}

/// Plan of an exchange between the two ranks of a ring of two (a level of recursive doubling):
/// each sends its whole buffer of `len` f32s in one block and adds the other's into it once its own
/// is sent, so one side computes `a + b` and the other `b + a`, the same bits, in one hop instead of
/// two. One block, because a rank reads nothing after it until its own send is done; the caller
/// keeps exchanges small (at most `TcpConfig::chunk_bytes`).
pub(crate) fn exchange(len: usize) -> Plan {
    let range = 0..len * 4;
    Plan {
        send: vec![SendBlock { range: range.clone(), after: 0 }],
        recv: vec![RecvBlock { range, action: Action::Reduce }],
        reduce_after_send: true,
    }
}

/// Plan of a broadcast of `bytes` bytes from `root` on rank `rank` of `n` (n >= 2).
pub(crate) fn broadcast(rank: usize, n: usize, root: usize, bytes: usize, chunk: usize) -> Plan {
    let mut all = Vec::new();
    blocks(0..bytes, 1, chunk, &mut all);
    if rank == root {
        let send = all.into_iter().map(|range| SendBlock { range, after: 0 }).collect();
        return Plan { send, recv: Vec::new(), reduce_after_send: false };
    }
    let recv: Vec<RecvBlock> = all.iter().map(|r| RecvBlock { range: r.clone(), action: Action::Copy }).collect();
    let send = if (rank + 1) % n == root {
        Vec::new()
    } else {
        all.into_iter().enumerate().map(|(i, range)| SendBlock { range, after: i + 1 }).collect()
    };
    Plan { send, recv, reduce_after_send: false }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulates the ring with exact f64 bookkeeping of *which ranks' values* each block holds,
    /// checking that every rank's send list equals its right neighbour's receive list and that the
    /// plan yields the full reduction everywhere.
    #[test]
    fn all_reduce_plan_is_consistent_and_complete() {
        for n in 2..=6 {
            for len in [0usize, 1, 2, 3, 5, 7, 64, 1000, 1003] {
                for chunk in [4usize, 12, 4096] {
                    let plans: Vec<Plan> = (0..n).map(|r| all_reduce(r, n, len, true, chunk)).collect();
                    for r in 0..n {
                        let right = &plans[(r + 1) % n];
                        let sent: Vec<_> = plans[r].send.iter().map(|b| b.range.clone()).collect();
                        let got: Vec<_> = right.recv.iter().map(|b| b.range.clone()).collect();
                        assert_eq!(sent, got, "n {n} len {len} chunk {chunk} rank {r}");
                        for b in &plans[r].send {
                            assert!(b.after <= plans[r].recv.len());
                            assert!(b.range.len() <= chunk.max(4) && b.range.len() % 4 == 0);
                        }
                    }
                    // Simulate: bitmask of contributing ranks per element, per rank.
                    let mut state: Vec<Vec<u64>> = (0..n).map(|r| vec![1u64 << r; len]).collect();
                    let mut recv_done = vec![0usize; n];
                    let mut sent = vec![0usize; n];
                    let mut inflight: Vec<std::collections::VecDeque<Vec<u64>>> = vec![Default::default(); n];
                    let mut progress = true;
                    while progress {
                        progress = false;
                        for r in 0..n {
                            let p = &plans[r];
                            while sent[r] < p.send.len() && p.send[sent[r]].after <= recv_done[r] {
                                let b = &p.send[sent[r]].range;
                                inflight[(r + 1) % n].push_back(state[r][b.start / 4..b.end / 4].to_vec());
                                sent[r] += 1;
                                progress = true;
                            }
                            while let Some(data) = inflight[r].pop_front() {
                                let b = &p.recv[recv_done[r]];
                                let dst = &mut state[r][b.range.start / 4..b.range.end / 4];
                                match b.action {
                                    Action::Copy => dst.copy_from_slice(&data),
                                    _ => dst.iter_mut().zip(&data).for_each(|(d, s)| {
                                        assert_eq!(*d & *s, 0, "element reduced twice");
                                        *d |= *s
                                    }),
                                }
                                recv_done[r] += 1;
                                progress = true;
                            }
                        }
                    }
                    let full = (1u64 << n) - 1;
                    for r in 0..n {
                        assert_eq!(recv_done[r], plans[r].recv.len(), "deadlock n {n} len {len}");
                        assert!(state[r].iter().all(|&m| m == full), "n {n} len {len} rank {r}");
                    }
                }
            }
        }
    }

    #[test]
    fn broadcast_plan_chain() {
        for n in 2..=5 {
            for root in 0..n {
                let plans: Vec<Plan> = (0..n).map(|r| broadcast(r, n, root, 10, 4)).collect();
                for r in 0..n {
                    let sent: Vec<_> = plans[r].send.iter().map(|b| b.range.clone()).collect();
                    let got: Vec<_> = plans[(r + 1) % n].recv.iter().map(|b| b.range.clone()).collect();
                    assert_eq!(sent, got);
                }
                assert_eq!(plans[root].recv.len(), 0);
                assert_eq!(plans[(root + n - 1) % n].send.len(), 0);
                assert_eq!(plans[(root + 1) % n].recv.len(), 3); // 4 + 4 + 2 bytes
            }
        }
    }
}
