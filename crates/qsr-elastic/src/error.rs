//! What an elastic job's worker meets beyond its collectives: the store refusing it, expelling it or
//! failing. A collective's own failures stay [`CommError`]s, wrapped.

use qsr_comm::CommError;

/// An elastic job's error, as [`Elastic`](crate::Elastic) returns it.
#[derive(Debug, thiserror::Error)]
pub enum ElasticError {
    /// This worker's generation ended without it: the store formed the next generation while this
    /// worker made no progress (stopped, or cut off) for the settle time.
    #[error(
        "this worker was expelled from the elastic job: its generation {generation} is over and generation {current} formed without it (it made no progress for the store's settle time, or lost its links); its messages to the new generation are refused"
    )]
    Expelled {
        /// The generation this worker belonged to.
        generation: u64,
        /// The job's generation now.
        current: u64,
    },

    /// The store refused this worker because its settings or job token do not match the job's
    /// (before or at its first generation); `detail` names the keys.
    #[error("{peer} refused this worker: {detail}")]
    Mismatch {
        /// Who refused, e.g. `rendezvous store 10.0.0.1:29400`.
        peer: String,
        /// Why, naming the differing keys or the token.
        detail: String,
    },

    /// The store (`qsr rendezvous`) refused a request, closed its connection, or sent something
    /// unreadable.
    #[error("rendezvous store {addr}: {detail}")]
    Store {
        /// The store's address.
        addr: String,
        /// What happened.
        detail: String,
    },

    /// A collective or a connection failed (forming a generation's ring, reaching the store).
    #[error(transparent)]
    Comm(#[from] CommError),
}
