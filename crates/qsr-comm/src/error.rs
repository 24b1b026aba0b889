//! The one error type of this crate, [`CommError`].

use std::time::Duration;

/// Why a collective, a rendezvous or a launch-environment detection failed: the one error type of
/// this crate.
///
/// Every variant that involves another process names it (rank, and address where we know one) and,
/// for mismatches, the field that differs, because the person reading the message is usually
/// looking at one of N log files and needs to know which other one to open.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// The backend does not offer this operation (e.g. a bf16 all-reduce over MPI).
    #[error("{backend} does not support {what}")]
    Unsupported {
        /// The backend's name (`mpi`, `nccl`).
        backend: &'static str,
        /// The operation, e.g. `a bf16 all-reduce`.
        what: String,
    },
    /// A peer closed its connection or died (EOF, reset, broken pipe).
    #[error("peer rank {rank} ({addr}) was lost during {during}: {detail}")]
    PeerLost {
        /// Rank of the lost peer.
        rank: usize,
        /// The peer's address (`host:port`), as far as it is known.
        addr: String,
        /// The operation under way, e.g. `all_reduce seq 12 (4096 bytes)` or `ring setup`.
        during: String,
        /// The underlying error, e.g. the I/O error or `connection closed`.
        detail: String,
    },

    /// A peer made no progress for the configured timeout.
    #[error("peer rank {rank} ({addr}) made no progress for {timeout:?} during {during}")]
    PeerTimeout {
        /// Rank of the stalled peer.
        rank: usize,
        /// The peer's address (`host:port`), as far as it is known.
        addr: String,
        /// The operation under way, e.g. `all_reduce seq 12 (4096 bytes)`.
        during: String,
        /// The no-progress timeout that expired (`TcpConfig::timeout`, default 30 s).
        timeout: Duration,
    },

    /// Another rank detected a failure and told us about it; `culprit` is the rank it blamed.
    #[error("rank {culprit} failed ({reason}), as reported by rank {reporter} during {during}")]
    Aborted {
        /// Rank the reporter blamed for the failure.
        culprit: usize,
        /// What happened to the culprit, e.g. `connection lost` or `no progress within the timeout`.
        reason: String,
        /// Rank that detected the failure and sent the abort notice.
        reporter: usize,
        /// The operation under way on this rank when the notice arrived.
        during: String,
    },

    /// Ranks made different collective calls (sequence number, kind, length, op or root differ).
    #[error(
        "rank {peer}'s collective call differs from rank {me}'s in {field}: rank {peer} has {theirs}, rank {me} has {ours} ({during})"
    )]
    CallsDiffer {
        /// Rank whose call is compared against (this rank; rank 0 for the in-process group).
        me: usize,
        /// Rank whose call differs (the left neighbour on the TCP ring).
        peer: usize,
        /// What differs: `sequence number`, `call`, `length (bytes)`, `reduce op`, `root`, ...
        field: &'static str,
        /// The value on rank `me`.
        ours: String,
        /// The value on rank `peer`.
        theirs: String,
        /// The call under way, e.g. `all_reduce seq 12`.
        during: String,
    },

    /// A handshake was refused because one field differs (job token, protocol version, world size,
    /// rank); `detail` names the field itself, `field` is there for programs.
    #[error("handshake with {peer} refused: {detail}")]
    HandshakeRefused {
        /// Who refused or was refused: an address or `rank r (addr)`.
        peer: String,
        /// The differing field, for programs: `job token`, `protocol version`, `world size`, `rank` or
        /// `request`.
        field: &'static str,
        /// Human-readable reason, naming the field and both values.
        detail: String,
    },

    /// A peer sent bytes that do not follow the wire protocol.
    #[error("protocol error from {peer}: {detail}")]
    Protocol {
        /// Who sent the bytes: an address, `rank r (addr) during ...`, `rank 0` or `the ring`.
        peer: String,
        /// What was wrong with them.
        detail: String,
    },

    /// Rendezvous did not complete in time.
    #[error("rendezvous failed: {0}")]
    Rendezvous(String),

    /// The caller passed something that cannot work (root out of range, world size 0, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A launch-environment variable (or explicit argument) is malformed, inconsistent or missing;
    /// `detail` names it itself, `var` is there for programs.
    #[error("launch environment: {detail}")]
    Launch {
        /// The variable or flag at fault, e.g. `WORLD_SIZE`, `MASTER_PORT` or `--rank`.
        var: String,
        /// Human-readable reason, naming the variable and its value.
        detail: String,
    },

    /// The communicator already failed; collectives after a failure are refused, because the
    /// ranks can no longer agree on where in the call sequence they are.
    #[error("communicator is broken by an earlier failure: {0}")]
    Broken(String),

    /// An in-process group failed (a member panicked, dropped its handle, or timed out);
    /// `culprit` is the rank responsible when one is known.
    #[error("in-process group: {detail}")]
    Group {
        /// The responsible rank, when one is known.
        culprit: Option<usize>,
        /// What happened, e.g. a member panicked or dropped its handle.
        detail: String,
    },

    /// An I/O error outside a peer connection (binding a listener, for example). The message
    /// states the I/O error, so it is deliberately not also the `source()`: printers of error
    /// chains (anyhow's `{:#}`) would state it twice.
    #[error("{context}: {error}")]
    Io {
        /// What was being done, e.g. `binding the rendezvous port 127.0.0.1:29500`.
        context: String,
        /// The I/O error.
        error: std::io::Error,
    },

    /// An error from the MPI backend.
    #[error("mpi: {0}")]
    Mpi(String),

    /// An error from a device collective (NCCL) or its bootstrap.
    #[error("device collective: {0}")]
    Device(String),

    /// Ranks were configured differently ([`crate::agree()`]): `ranks` differ from rank 0, and `detail`
    /// names the first one's differing settings.
    #[error("the ranks were configured differently ({}); {detail}", differing(ranks))]
    Disagree {
        /// Ranks whose settings differ from rank 0's, ascending.
        ranks: Vec<usize>,
        /// The first differing rank's differing settings, by key, with both values.
        detail: String,
    },

    /// A shared library a backend needs at run time could not be loaded.
    #[error(
        "cannot load the {library} shared library (tried {searched}; last error: {last_error}); install it or add its directory to LD_LIBRARY_PATH"
    )]
    LibraryMissing {
        /// The library's short name, e.g. `cuda` or `nccl`.
        library: String,
        /// The file names or paths tried, comma-separated.
        searched: String,
        /// The loader's error for the last candidate.
        last_error: String,
    },
}

impl CommError {
    pub(crate) fn io(context: impl Into<String>, error: std::io::Error) -> Self {
        CommError::Io { context: context.into(), error }
    }

    pub(crate) fn launch(var: impl Into<String>, detail: impl Into<String>) -> Self {
        CommError::Launch { var: var.into(), detail: detail.into() }
    }

    /// The rank this error blames, when it blames one: tests and the trainer use it to report the
    /// lost worker without parsing messages.
    pub fn blamed_rank(&self) -> Option<usize> {
        match self {
            CommError::PeerLost { rank, .. } | CommError::PeerTimeout { rank, .. } => Some(*rank),
            CommError::Aborted { culprit, .. } => Some(*culprit),
            CommError::CallsDiffer { peer, .. } => Some(*peer),
            CommError::Group { culprit, .. } => *culprit,
            _ => None,
        }
    }
}

impl CommError {
    /// Whether this error is the consequence of another rank's failure (it was lost, stalled, or
    /// aborted the call for a reason other than different collective calls; the communicator broke earlier; an
    /// in-process group member failed): a rank
    /// that stops for it exits with [`crate::EXIT_PEER_FAILED`], so that a launcher names the rank
    /// that failed first.
    pub fn peer_failed(&self) -> bool {
        // Diverging calls are the job's cause, not a peer's failure: every rank reports them.
        let aborted = matches!(self, CommError::Aborted { .. }) && !self.calls_differ();
        aborted
            || matches!(
                self,
                CommError::PeerLost { .. }
                    | CommError::PeerTimeout { .. }
                    | CommError::Broken(_)
                    | CommError::Group { .. }
            )
    }
}

/// "rank 1 differs from rank 0" / "ranks 1, 3 differ from rank 0".
fn differing(ranks: &[usize]) -> String {
    let list = ranks.iter().map(usize::to_string).collect::<Vec<_>>().join(", ");
    if ranks.len() == 1 {
        format!("rank {list} differs from rank 0")
    } else {
        format!("ranks {list} differ from rank 0")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What anyhow's `{:#}` prints: every error of the chain, joined by ": ".
    fn chain(e: &dyn std::error::Error) -> String {
        let mut parts = vec![e.to_string()];
        let mut next = e.source();
        while let Some(s) = next {
            parts.push(s.to_string());
            next = s.source();
        }
        parts.join(": ")
    }

    #[test]
    fn io_error_is_stated_once_in_a_chain() {
        let e = CommError::io(
            "binding the rendezvous port 127.0.0.1:29500",
            std::io::Error::new(std::io::ErrorKind::AddrInUse, "Address already in use"),
        );
        let printed = chain(&e);
        assert_eq!(printed, "binding the rendezvous port 127.0.0.1:29500: Address already in use");
    }
}
