//! The protocol between an elastic job's workers ([`crate::Elastic`]) and its store
//! ([`crate::Store`]): one JSON object per line, at most [`MAX_LINE`] bytes, each way, and the
//! types both sides share.

use std::io::{BufRead, Write};

use serde::{Deserialize, Serialize, de::DeserializeOwned};

/// The longest line either side reads: the settings (a resolved recipe) and a state payload fit.
pub(crate) const MAX_LINE: u64 = 1 << 20;

/// How often a waiting join hears from the store. A worker gives up on a silent store after its
/// comm timeout, but never sooner than [`MIN_STORE_TIMEOUT`].
pub(crate) const KEEPALIVE: std::time::Duration = std::time::Duration::from_millis(500);

/// The shortest a worker waits for an answer of its store (four keepalives).
pub(crate) const MIN_STORE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// A worker's request.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[allow(missing_docs)] // the fields are the variant's words
pub(crate) enum Request {
    /// The first request on a connection: the job token, the settings every worker must share, and
    /// the launcher's rank, which orders the first generation.
    Hello { token: String, settings: serde_json::Value, order: Option<u64> },
    /// Join the next generation: `seen` is the generation this worker belonged to (`None` for a
    /// new worker), `state` the last completed sync it holds.
    Join { seen: Option<u64>, host: String, port: u16, state: Option<LastSync>, reason: String },
    /// Whether the generation still runs, and how many workers wait to join it.
    Poll { generation: u64 },
    /// This worker finished the run.
    Done,
}

/// The store's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[allow(missing_docs)] // the fields are the variant's words
pub(crate) enum Response {
    /// The hello was accepted: the worker's id, and the job's (one per store, random), which names
    /// the job in its run directory's lock.
    Welcome { id: u64, job: String },
    /// A request was refused; the message says why. `mismatch`: because the worker's own token or
    /// settings do not match the job's (its input, not the store, is at fault).
    Refused {
        message: String,
        #[serde(default)]
        mismatch: bool,
    },
    /// A join is still waiting (sent every [`KEEPALIVE`], so the worker knows the store lives):
    /// `status` says for what, in words the worker prints. `for_workers`: it waits for workers that
    /// have not joined (the first generation's, or new ones to reach `min_workers`), which the
    /// worker waits for at most its rendezvous timeout; a spare waiting for a free slot and a
    /// survivor waiting for members to report (bounded by the store's settle time) do not.
    Waiting {
        generation: Option<u64>,
        #[serde(default)]
        status: String,
        #[serde(default)]
        for_workers: bool,
    },
    /// A generation formed with this worker in it.
    Formed {
        generation: u64,
        rank: usize,
        previous_rank: Option<usize>,
        table: Vec<(String, u16)>,
        source: Option<usize>,
        state: Option<LastSync>,
        lost: Vec<Lost>,
        joined: Vec<usize>,
    },
    /// The worker's generation ended without it.
    Expelled { generation: u64, current: u64 },
    /// Answer to a poll: the generation runs; `waiting` workers would join at the next boundary.
    Steady { waiting: usize },
    /// Answer to a poll: the generation is over (a failure is being handled).
    Over { current: u64 },
    /// Done was recorded.
    Ok,
}

/// Writes one message as a line.
pub(crate) fn send(w: &mut impl Write, msg: &impl Serialize) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    line.push(b'\n');
    w.write_all(&line)?;
    w.flush()
}

/// Reads one line (`None` at end of stream) and decodes it; a line over [`MAX_LINE`] is an error.
pub(crate) fn recv<T: DeserializeOwned>(r: &mut impl BufRead) -> std::io::Result<Option<T>> {
    let mut line = Vec::new();
    let n = std::io::Read::take(&mut *r, MAX_LINE + 1).read_until(b'\n', &mut line)?;
    if n == 0 {
        return Ok(None);
    }
    if line.last() != Some(&b'\n') {
        let what = if n as u64 > MAX_LINE { "a line longer than 1 MiB" } else { "a line cut off by end of stream" };
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, what));
    }
    serde_json::from_slice(&line).map(Some).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// The longest [`LastSync::payload`] a store accepts, so that its answers fit a line.
pub const MAX_SYNC_PAYLOAD: usize = 64 << 10;

/// The last completed synchronization a worker holds: its step and an opaque payload the new
/// generation receives from the worker chosen as [`Membership::source`](crate::Membership::source) (the trainer's counters).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastSync {
    /// Steps completed at that synchronization.
    pub step: u64,
    /// What the application wants the new generation to have (at most [`MAX_SYNC_PAYLOAD`] bytes).
    pub payload: String,
}

/// A member of the previous generation that is not in the new one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lost {
    /// Its rank in the previous generation.
    pub rank: usize,
    /// Why the store dropped it (exited, or did not report within the settle time).
    pub reason: String,
}
