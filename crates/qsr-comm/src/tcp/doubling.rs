//! Recursive doubling for small all-reduces over TCP, documented on [`Doubling`].

use std::net::TcpListener;
use std::time::Duration;

use super::{TcpComm, ring_listener};
use crate::status::{read_status, reason_of, rename, status_word};
use crate::{Collective, CommError};

/// Largest world recursive doubling serves: each call carries one status word per rank.
pub(crate) const MAX_RANKS: usize = 64;

/// One rank's pairs for recursive doubling, formed over the ring on the first small all-reduce.
///
/// With `p` the largest power of two at most K: ranks `p..K` first fold into rank `r - p` (an
/// exchange on their pair), ranks `0..p` then take `log2(p)` levels, exchanging with rank
/// `r ^ 2^j` at level `j`, and each folded rank receives its partner's result. An exchange is one
/// hop (both send, both add: `a + b` and `b + a`, the same bits), so a call takes `log2(p)` hops,
/// two more when K is not a power of two, instead of the ring's `2 (K-1)`. Every rank ends with
/// the same bits, and `Mean` divides the sum by K on every rank.
///
/// Failures: every call carries one status word per rank after the data. A rank whose exchange
/// fails writes the culprit into its own word and still takes its remaining exchanges, so every
/// rank learns the culprit and fails naming it. Each stage waits a quarter of the timeout longer
/// than the one before (the fold's exchange the timeout, level `j` `1 + (j+1)/4` of it, the folded
/// rank's wait for the result `1 + (levels+1)/4`), so a stall one stage down is reported before a
/// rank waiting on its reporter gives up on it.
pub(crate) struct Doubling {
    rank: usize,
    n: usize,
    /// With `r + p` (ranks below `K - p`) or `r - p` (ranks from `p`).
    fold: Option<Pair>,
    /// Ranks below `p`: the pair of each level.
    levels: Vec<Pair>,
    /// `log2(p)`, also on ranks that fold (their wait depends on it).
    depth: usize,
    timeout: Duration,
    work: Vec<f32>,
}

/// A ring of two and the job ranks of its ranks 0 and 1.
struct Pair {
    comm: TcpComm,
    names: [usize; 2],
}

impl Pair {
    /// The exchange of one stage, waiting at most `timeout` without progress.
    fn exchange(&mut self, work: &mut [f32], timeout: Duration) -> Result<(), CommError> {
        self.comm.cfg.timeout = timeout;
        self.comm.exchange(work).map_err(|e| rename(e, &self.names))
    }

    /// The lower rank's result to the higher (a folded rank), waiting at most `timeout`.
    fn result(&mut self, work: &mut [f32], timeout: Duration) -> Result<(), CommError> {
        self.comm.cfg.timeout = timeout;
        self.comm.broadcast(work, 0).map_err(|e| rename(e, &self.names))
    }
}

/// The wait of stage `quarters` quarters of `timeout` past the first.
fn patience(timeout: Duration, quarters: usize) -> Duration {
    timeout.mul_f64(1.0 + 0.25 * quarters as f64)
}

impl Doubling {
    /// Forms this rank's pairs over `ring` (every rank of it calls this, in the same call).
    pub(crate) fn join(ring: &mut TcpComm) -> Result<Doubling, CommError> {
        let (rank, n) = (ring.rank(), ring.world_size());
        let p = 1usize << n.ilog2();
        let levels = p.trailing_zeros() as usize;
        let fold = if rank >= p { Some(rank - p) } else { (rank + p < n).then_some(rank + p) };
        let mut partners = vec![fold];
        partners.extend((0..levels).map(|j| (rank < p).then_some(rank ^ (1 << j))));
        let cfg = ring.config().clone();
        let listeners: Vec<Option<(TcpListener, u16)>> =
            partners.iter().map(|q| q.map(|_| ring_listener(&cfg)).transpose()).collect::<Result<_, _>>()?;
        let mut mine = (cfg.doubling_bytes as u64).to_le_bytes().to_vec();
        listeners.iter().for_each(|l| mine.extend(l.as_ref().map_or(0, |l| l.1).to_le_bytes()));
        let all = crate::util::all_gather_bytes(ring, &mine)?;
        check_alike(&all, &mine, rank)?;
        let port = |r: usize, slot: usize| u16::from_le_bytes([all[r][8 + 2 * slot], all[r][9 + 2 * slot]]);
        let mut pairs = Vec::new();
        for (slot, (q, l)) in partners.into_iter().zip(listeners).enumerate() {
            let (Some(q), Some((listener, _))) = (q, l) else { continue };
            let names = [rank.min(q), rank.max(q)];
            let table = names.iter().map(|&r| (ring.hosts()[r].clone(), port(r, slot))).collect();
            let comm = TcpComm::from_table(usize::from(rank == names[1]), 2, cfg.clone(), &listener, table)
                .map_err(|e| rename(e, &names))?;
            pairs.push((slot, Pair { comm, names }));
        }
        let fold = pairs.first().filter(|(slot, _)| *slot == 0).is_some();
        let mut pairs = pairs.into_iter().map(|(_, p)| p);
        let fold = if fold { pairs.next() } else { None };
        let (depth, timeout) = (levels, cfg.timeout);
        Ok(Doubling { rank, n, fold, levels: pairs.collect(), depth, timeout, work: Vec::new() })
    }

    /// Sets the hook every pair calls while bytes move.
    pub(crate) fn set_progress(&mut self, f: &std::sync::Arc<dyn Fn() + Send + Sync>) {
        self.fold.iter_mut().chain(&mut self.levels).for_each(|p| p.comm.progress = Some(f.clone()));
    }

    /// Tags every pair's calls with the ring's tag.
    pub(crate) fn set_tag(&mut self, tag: Option<crate::SyncTag>) {
        self.fold.iter_mut().chain(&mut self.levels).for_each(|p| p.comm.tag = tag);
    }

    /// The sum (or mean) of `buf` over all ranks, into `buf` on every rank.
    pub(crate) fn all_reduce(&mut self, buf: &mut [f32], mean: bool) -> Result<(), CommError> {
        let (len, me) = (buf.len(), self.rank);
        let mut work = std::mem::take(&mut self.work);
        work.clear();
        work.extend_from_slice(buf);
        work.resize(len + self.n, 0.0);
        let mut own: Option<CommError> = None;
        let mut note = |r: Result<(), CommError>, work: &mut [f32]| {
            if let (Err(e), None) = (r, &own) {
                work[len + me] = status_word(e.blamed_rank().unwrap_or(me), reason_of(&e));
                own = Some(e);
            }
        };
        let t = self.timeout;
        if let Some(f) = &mut self.fold {
            note(f.exchange(&mut work, t), &mut work);
        }
        for (j, l) in self.levels.iter_mut().enumerate() {
            note(l.exchange(&mut work, patience(t, j + 1)), &mut work);
        }
        if let Some(f) = &mut self.fold {
            // The rank below p sends the total to its folded partner.
            note(f.result(&mut work, patience(t, self.depth + 1)), &mut work);
        }
        let status = (0..self.n).find_map(|r| read_status(work[len + r]).map(|s| (r, s)));
        let res = match (own, status) {
            (Some(e), _) => Err(e),
            (None, Some((reporter, (culprit, why)))) => Err(CommError::Aborted {
                culprit,
                reason: why.text().into(),
                reporter,
                during: format!("all_reduce ({} bytes, recursive doubling)", len * 4),
            }),
            (None, None) => {
                let k = self.n as f32;
                buf.iter_mut().zip(&work).for_each(|(b, w)| *b = if mean { w / k } else { *w });
                Ok(())
            }
        };
        self.work = work;
        res
    }
}

/// Every rank sent a request of our length with our cutover (else the ranks would take different
/// paths for the same call).
fn check_alike(all: &[Vec<u8>], mine: &[u8], rank: usize) -> Result<(), CommError> {
    for (r, b) in all.iter().enumerate() {
        if b.len() != mine.len() {
            return Err(CommError::Protocol {
                peer: format!("rank {r}"),
                detail: format!("a recursive-doubling request of {} bytes, expected {}", b.len(), mine.len()),
            });
        }
        if b[..8] != mine[..8] {
            let (theirs, ours) = (u64::from_le_bytes(b[..8].try_into().unwrap_or_default()), &mine[..8]);
            let ours = u64::from_le_bytes(ours.try_into().unwrap_or_default());
            return Err(CommError::InvalidArgument(format!(
                "TcpConfig::doubling_bytes differs: rank {r} has {theirs}, rank {rank} has {ours}; every rank must use the same"
            )));
        }
    }
    Ok(())
}
