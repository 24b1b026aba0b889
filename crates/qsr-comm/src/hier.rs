//! Jobs spread over several hosts with several ranks on some: shared memory inside each host, a TCP
//! ring between one leader per host. Documented on [`HostsComm`].

use std::time::Instant;

use crate::shm::{Cause, ShmComm};
use crate::status::{read_status, reason_of, rename, status_word};
use crate::tcp::ring_listener;
use crate::{Collective, CommError, CommStats, ReduceOp, TcpComm};

/// One rank of a job whose hosts each hold one or more ranks.
///
/// All-reduce: the ranks of a host sum through their shared-memory group; each host's leader (its
/// lowest rank) sums the host sums over the leaders' TCP ring; each leader broadcasts the total to
/// its host; a mean divides by K on every rank. The order is fixed (rank order inside a host, the
/// ring's order between hosts), so every rank ends bit-identical and `Mean` is `Sum / K` exactly.
/// Broadcast: inside the root's host, over the leaders' ring, then inside every other host.
///
/// Failures: a host that saw a failure (a dead, closed or stalled member) still joins the
/// leaders' all-reduce, carrying the culprit's job rank in a status word appended to the buffer, so
/// every leader fails naming the same rank and writes it into its host's abort word, where the
/// waiting members read it. The leaders' ring waits 1.5 times the timeout, so that a host whose
/// member stalled reports it before another host's leader blames the waiting leader, and members
/// wait twice the timeout for their leader's result. A failure
/// seen outside an all-reduce's exchange between hosts reaches the other hosts as the loss of that
/// host's leader.
pub(crate) struct HostsComm {
    rank: usize,
    n: usize,
    /// Our host's group; its rank 0 is the host's leader.
    local: ShmComm,
    /// The ring of leaders (on leaders only), and the job rank of each of its ranks.
    leaders: Option<(TcpComm, Vec<usize>)>,
    /// Leader index (host number) of every job rank, and the job rank of each leader.
    host_of: Vec<usize>,
    leader_ranks: Vec<usize>,
    stats: CommStats,
    broken: Option<String>,
    scratch: Vec<f32>,
}

/// Builds the hierarchy of `groups` (ranks by host, ordered by first rank) over the ring `boot`,
/// `local` being this rank's host group (from `shm::join` over the same groups).
pub(crate) fn join(boot: &mut TcpComm, groups: &[Vec<usize>], local: ShmComm) -> Result<HostsComm, CommError> {
    let leader_ranks: Vec<usize> = groups.iter().map(|g| g[0]).collect();
    let mut host_of = vec![0; boot.world_size()];
    for (h, g) in groups.iter().enumerate() {
        g.iter().for_each(|&r| host_of[r] = h);
    }
    let mut cfg = boot.config().clone();
    cfg.timeout = cfg.timeout.mul_f64(1.5);
    let me = leader_ranks.iter().position(|&r| r == boot.rank());
    let listener = me.map(|_| ring_listener(&cfg)).transpose()?;
    let port = listener.as_ref().map_or(0, |l| l.1);
    let ports = crate::util::all_gather_bytes(boot, &port.to_le_bytes())?;
    let leaders = match (me, listener) {
        (Some(sub), Some((l, _))) => {
            let table = leader_ranks
                .iter()
                .map(|&r| {
                    let p = ports[r].get(..2).map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
                    (boot.hosts()[r].clone(), p)
                })
                .collect();
            let mut ring = TcpComm::from_table(sub, leader_ranks.len(), cfg, &l, table)?;
            // Our members wait while we talk to the other hosts: moving bytes counts as progress.
            let beat = local.heartbeat();
            ring.set_progress(Box::new(move || beat.bump()));
            Some((ring, leader_ranks.clone()))
        }
        _ => None,
    };
    Ok(HostsComm {
        rank: boot.rank(),
        n: boot.world_size(),
        local,
        leaders,
        host_of,
        leader_ranks,
        stats: CommStats::default(),
        broken: None,
        scratch: Vec::new(),
    })
}

impl HostsComm {
    fn is_leader(&self) -> bool {
        self.leaders.is_some()
    }

    /// Runs one call: the broken state and the statistics. `traffic` is what the call accounts, as
    /// every backend does: a ring all-reduce's bytes over all K ranks, a broadcast's payload, so that
    /// the counts compare with the other backends' and with the plans (not the sum over both
    /// transports, which counts the host's shared memory too).
    fn call(
        &mut self,
        traffic: (u64, u64),
        body: impl FnOnce(&mut Self) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        if let Some(b) = &self.broken {
            return Err(CommError::Broken(b.clone()));
        }
        let start = Instant::now();
        let res = body(self);
        self.stats.record(traffic.0, traffic.1, start.elapsed().as_secs_f64());
        if let Err(e) = &res {
            self.broken = Some(e.to_string());
        }
        res
    }

    /// What a broadcast of `len` bytes from `root` accounts on this rank.
    fn broadcast_traffic(&self, root: usize, len: usize) -> (u64, u64) {
        if self.rank == root { (len as u64, 0) } else { (0, len as u64) }
    }

    /// The leaders' sum of `buf` and of every host's status (appended to an f32 buffer; in a call
    /// of its own before a bf16 one, whose rounding would garble it); a failure anywhere becomes
    /// this leader's error and its host's abort word.
    fn leaders_sum(&mut self, buf: &mut [f32], bf16: bool, mine: Option<(usize, Cause)>) -> Result<(), CommError> {
        let hosts = self.leader_ranks.len();
        let host = self.host_of[self.rank];
        let (ring, names) = self.leaders.as_mut().expect("leaders only");
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        if !bf16 {
            scratch.extend_from_slice(buf);
        }
        let at = scratch.len();
        scratch.resize(at + hosts, 0.0);
        if let Some((c, why)) = mine {
            scratch[at + host] = status_word(c, why);
        }
        let res = ring.all_reduce(&mut scratch, ReduceOp::Sum).map_err(|e| rename(e, names)).and_then(|()| {
            let status = scratch[at..].iter().enumerate().find_map(|(h, &w)| read_status(w).map(|s| (h, s)));
            match status {
                None => Ok(()),
                Some((h, (culprit, why))) => Err(CommError::Aborted {
                    culprit,
                    reason: why.text().into(),
                    reporter: self.leader_ranks[h],
                    during: "all_reduce between hosts".into(),
                }),
            }
        });
        let res = match res {
            Ok(()) if bf16 => ring.all_reduce_bf16(buf, ReduceOp::Sum).map_err(|e| rename(e, names)),
            Ok(()) => {
                buf.copy_from_slice(&scratch[..at]);
                Ok(())
            }
            Err(e) => Err(e),
        };
        self.scratch = scratch;
        if let Err(e) = &res {
            self.local.abort(e.blamed_rank().unwrap_or(self.rank), reason_of(e));
        }
        res
    }

    fn all_reduce_with(&mut self, buf: &mut [f32], op: ReduceOp, bf16: bool) -> Result<(), CommError> {
        let bytes = crate::ring_allreduce_bytes(buf.len(), if bf16 { 2 } else { 4 }, self.n);
        self.call((bytes, bytes), |me| {
            let local = if bf16 {
                me.local.all_reduce_bf16(buf, ReduceOp::Sum)
            } else {
                me.local.all_reduce(buf, ReduceOp::Sum)
            };
            if me.is_leader() {
                // A failed host still joins, so that every other host learns whom to blame; so does
                // one where only a member's call failed (it left the culprit in the abort word).
                let mine = match &local {
                    Err(e) => Some(me.local.failure().unwrap_or((me.rank, reason_of(e)))),
                    Ok(()) => me.local.failure(),
                };
                let between = me.leaders_sum(buf, bf16, mine);
                local?;
                between?;
            } else {
                local?;
            }
            me.patiently(|c| c.broadcast(buf, 0))?;
            if op == ReduceOp::Mean {
                let k = me.n as f32;
                buf.iter_mut().for_each(|x| *x = if bf16 { crate::bf16_round(*x / k) } else { *x / k });
            }
            Ok(())
        })
    }

    /// Runs a local step that waits for the leader while it talks to the other hosts: the ring gives
    /// up after 1.5 timeouts without progress (and the leader's heartbeat shows its progress), so
    /// members wait 2 timeouts without a beat, and the leaders' verdict arrives before they would
    /// blame their own leader.
    fn patiently<T>(&mut self, step: impl FnOnce(&mut ShmComm) -> Result<T, CommError>) -> Result<T, CommError> {
        let timeout = self.local.config().timeout;
        self.local.set_timeout(timeout * 2);
        let res = step(&mut self.local);
        self.local.set_timeout(timeout);
        res
    }

    /// The local index of job rank `r` in its host's group (groups hold ascending job ranks).
    fn local_index(&self, r: usize) -> usize {
        (0..r).filter(|&q| self.host_of[q] == self.host_of[r]).count()
    }

    /// A broadcast in three steps: inside the root's host, between leaders, inside the other hosts.
    fn broadcast_with(
        &mut self,
        root: usize,
        mut step: impl FnMut(&mut dyn Collective, usize) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        crate::inproc::check_root(root, self.n)?;
        let home = self.host_of[root];
        let mine = self.host_of[self.rank];
        let local = if mine == home {
            let at = self.local_index(root);
            step(&mut self.local, at)
        } else {
            Ok(())
        };
        if self.is_leader() {
            // The leaders first learn whether the root's host (or any other) failed, so that a
            // failure there is named the same everywhere instead of timing out the ring.
            let failed = match &local {
                Err(e) => Some(self.local.failure().unwrap_or((self.rank, reason_of(e)))),
                Ok(()) => self.local.failure(),
            };
            self.leaders_sum(&mut [], false, failed)?;
            local?;
            let (ring, names) = self.leaders.as_mut().expect("a leader");
            if let Err(e) = step(ring, home) {
                let e = rename(e, names);
                self.local.abort(e.blamed_rank().unwrap_or(self.rank), reason_of(&e));
                return Err(e);
            }
        } else {
            local?;
        }
        if mine != home {
            self.patiently(|c| step(c, 0))?;
        }
        Ok(())
    }
}

impl Collective for HostsComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.n
    }

    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.all_reduce_with(buf, op, false)
    }

    fn supports_bf16(&self) -> bool {
        true
    }

    /// Hierarchical bf16: each host's bf16 sum, the leaders' bf16 ring sum of those, and for a mean
    /// the division by K rounded to bf16 again.
    fn all_reduce_bf16(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.all_reduce_with(buf, op, true)
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        let traffic = self.broadcast_traffic(root, buf.len() * 4);
        self.call(traffic, |me| me.broadcast_with(root, |c, r| c.broadcast(buf, r)))
    }

    fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        // Every rank accounts the root's payload, as the other backends do.
        let mut payload = 0;
        self.call((0, 0), |me| {
            // The length first, so that every rank applies the bound, not only the root's host.
            let mut len = (bytes.len() as u64).to_le_bytes().to_vec();
            me.broadcast_with(root, |c, r| c.broadcast_bytes(&mut len, r))?;
            let len = <[u8; 8]>::try_from(len.as_slice()).map(u64::from_le_bytes).map_err(|_| CommError::Protocol {
                peer: format!("rank {root}"),
                detail: format!("a broadcast length of {} bytes", len.len()),
            })?;
            if len > crate::MAX_BROADCAST_BYTES as u64 {
                let bound = crate::MAX_BROADCAST_BYTES;
                return Err(CommError::InvalidArgument(format!(
                    "rank {root} broadcasts {len} bytes, more than the bound {bound}"
                )));
            }
            payload = len as usize;
            me.broadcast_with(root, |c, r| c.broadcast_bytes(bytes, r))
        })?;
        let (sent, received) = self.broadcast_traffic(root, payload);
        self.stats.bytes_sent += sent;
        self.stats.bytes_received += received;
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let mut one = [1.0f32];
        self.all_reduce(&mut one, ReduceOp::Sum)?;
        if one[0] != self.n as f32 {
            let e = format!("barrier counted {} ranks, expected {}", one[0], self.n);
            self.broken = Some(e.clone());
            return Err(CommError::Protocol { peer: "the hosts".into(), detail: e });
        }
        Ok(())
    }

    fn set_tag(&mut self, tag: Option<crate::SyncTag>) {
        self.local.set_tag(tag);
        if let Some((ring, _)) = &mut self.leaders {
            ring.set_tag(tag);
        }
    }

    fn stats(&self) -> &CommStats {
        &self.stats
    }

    fn backend(&self) -> &'static str {
        "shm+tcp"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_ranks_become_job_ranks() {
        let e = CommError::PeerTimeout {
            rank: 1,
            addr: "a".into(),
            during: "d".into(),
            timeout: std::time::Duration::from_secs(1),
        };
        assert_eq!(rename(e, &[0, 4]).blamed_rank(), Some(4));
    }
}
