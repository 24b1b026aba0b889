//! Errors and status words that cross groups: renaming the ranks an error names, and the abort
//! words hosts exchange. A leaf under `hier.rs`, `connect.rs` and the TCP ring's doubling.

use crate::CommError;
use crate::shm::Cause;

/// `e` with the ranks it names (of a ring of leaders, or of a split group) replaced by their ranks in
/// the job, `names[r]` for rank `r`.
pub(crate) fn rename(e: CommError, names: &[usize]) -> CommError {
    let job = |r: usize| names.get(r).copied().unwrap_or(r);
    match e {
        CommError::PeerLost { rank, addr, during, detail } => {
            CommError::PeerLost { rank: job(rank), addr, during, detail }
        }
        CommError::PeerTimeout { rank, addr, during, timeout } => {
            CommError::PeerTimeout { rank: job(rank), addr, during, timeout }
        }
        CommError::Aborted { culprit, reason, reporter, during } => {
            CommError::Aborted { culprit: job(culprit), reason, reporter: job(reporter), during }
        }
        CommError::CallsDiffer { me, peer, field, ours, theirs, during } => {
            CommError::CallsDiffer { me: job(me), peer: job(peer), field, ours, theirs, during }
        }
        other => other,
    }
}

impl CommError {
    /// Whether the ranks made different calls: [`CommError::CallsDiffer`] where it was found, or the
    /// abort that told the other ranks of it.
    pub fn calls_differ(&self) -> bool {
        match self {
            CommError::CallsDiffer { .. } => true,
            CommError::Aborted { .. } => reason_of(self) == Cause::CallsDiffer,
            _ => false,
        }
    }
}

/// The reason for the local abort word of an error from the leaders' ring (an abort notice
/// carries its reason as the text of the ring's or of the shared memory's reasons).
pub(crate) fn reason_of(e: &CommError) -> Cause {
    const ALL: [Cause; 6] =
        [Cause::Exited, Cause::Stalled, Cause::Closed, Cause::Lost, Cause::CallsDiffer, Cause::Other];
    match e {
        CommError::PeerLost { .. } => Cause::Lost,
        CommError::PeerTimeout { .. } => Cause::Stalled,
        CommError::CallsDiffer { .. } => Cause::CallsDiffer,
        CommError::Aborted { reason, .. } => {
            use crate::wire::Reason as Ring;
            let ring =
                [(Ring::Timeout, Cause::Stalled), (Ring::Lost, Cause::Lost), (Ring::CallsDiffer, Cause::CallsDiffer)];
            ring.iter()
                .find(|(r, _)| r.describe() == reason)
                .map(|(_, ours)| *ours)
                .or_else(|| ALL.into_iter().find(|r| r.text() == reason))
                .unwrap_or(Cause::Other)
        }
        _ => Cause::Other,
    }
}

/// A host's status word in the leaders' all-reduce: 0, or the culprit's job rank + 1 and the
/// reason's code in bits 20..; exact in f32 (below 2^24).
pub(crate) fn status_word(culprit: usize, why: Cause) -> f32 {
    ((why as u32) << 20 | (culprit as u32 + 1)) as f32
}

pub(crate) fn read_status(w: f32) -> Option<(usize, Cause)> {
    let w = w as u32;
    let culprit = (w & 0xf_ffff).checked_sub(1)? as usize;
    Some((culprit, Cause::from_code(u64::from(w >> 20)).unwrap_or(Cause::Other)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_words_round_trip_exactly() {
        for (c, why) in [(0, Cause::Exited), (2, Cause::Stalled), (70_000, Cause::Lost)] {
            assert_eq!(read_status(status_word(c, why)), Some((c, why)));
        }
        assert_eq!(read_status(0.0), None);
    }

    /// Regression: reasons were matched by fragments of their text, so "connection lost",
    /// "closed" and "diverging" became "it failed" on the next host.
    #[test]
    fn reasons_survive_the_hop_between_hosts() {
        let aborted =
            |reason: &str| CommError::Aborted { culprit: 1, reason: reason.into(), reporter: 0, during: "d".into() };
        for r in [Cause::Exited, Cause::Stalled, Cause::Closed, Cause::Lost, Cause::CallsDiffer, Cause::Other] {
            assert_eq!(reason_of(&aborted(r.text())), r);
        }
        use crate::wire::Reason as Ring;
        assert_eq!(reason_of(&aborted(Ring::Timeout.describe())), Cause::Stalled);
        assert_eq!(reason_of(&aborted(Ring::Lost.describe())), Cause::Lost);
        assert_eq!(reason_of(&aborted(Ring::CallsDiffer.describe())), Cause::CallsDiffer);
    }
}
