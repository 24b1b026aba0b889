//! Elastic membership: a job whose workers may be lost and may join, through a store that outlives
//! any of them.
//!
//! The protocol (docs/architecture/elastic.md states its invariants):
//! - every worker keeps one connection to the store ([`crate::Store`]) for its life, opened with the job token and
//!   the settings every worker must share (a worker with other settings is refused, naming the keys);
//!   a closed connection is a lost worker;
//! - the store forms generation 0 when `StoreConfig::workers` workers have joined, ranked by their
//!   launcher order; each generation is a ring formed from the store's table with fresh listeners
//!   and its number in every hello ([`qsr_comm::TcpConfig::generation`]), so no rank of an older
//!   generation can enter it;
//! - a worker whose collective fails joins again, naming the generation it saw; the first such join
//!   (or a member's closed connection) ends the generation; the store then waits until every member
//!   still connected has joined, or `StoreConfig::settle` has passed, and forms the next generation
//!   of the members that joined (in their old rank order) and of waiting new workers; a member that
//!   did not join in time is expelled, and its later joins and polls are refused;
//! - each join carries the last completed synchronization the worker holds ([`LastSync`]); the new
//!   generation learns the newest one and which rank holds it ([`Membership::source`]), so a sync that
//!   completed on any survivor counts, and no survivor continues from a half-finished one;
//! - new workers wait until the running generation decides, at a synchronization boundary, to admit
//!   them ([`Elastic::poll`] by one rank, its answer shared over the collective, then every member
//!   joins).

use std::io::{BufReader, ErrorKind};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use qsr_comm::{Collective, CommError, RingSeat, ShmConfig, TcpComm, TcpConfig, Transport, WaitProgress, over_ring};

use crate::error::ElasticError;
use crate::protocol::{LastSync, Lost, MIN_STORE_TIMEOUT, Request, Response, recv, send};

/// How often a worker whose generation's ring is forming asks the store whether the generation is
/// still on (a member may be lost before it connected).
const GENERATION_POLL: Duration = Duration::from_secs(1);

/// How long a worker whose generation's ring failed to form waits for the store to end the
/// generation before it takes the failure as its own.
const LOSS_NOTICE: Duration = Duration::from_secs(3);

/// A generation as one worker sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    /// The generation's number: 0 for the first, one more at every change.
    pub generation: u64,
    /// This worker's rank in it.
    pub rank: usize,
    /// The number of workers in it.
    pub world_size: usize,
    /// This worker's rank in the previous generation (`None` for a new worker).
    pub previous_rank: Option<usize>,
    /// The rank holding the newest completed synchronization, which the others take over.
    pub source: Option<usize>,
    /// That synchronization (`None` when no member holds one: the first generation of a run).
    pub state: Option<LastSync>,
    /// Members of the previous generation left out, by their previous rank.
    pub lost: Vec<Lost>,
    /// The ranks of new workers in this generation.
    pub joined: Vec<usize>,
}

/// A generation formed by [`Elastic::form_pair`]: two groups of the same ranks.
pub struct Pair {
    /// The generation's collective.
    pub comm: Box<dyn Collective>,
    /// A second group of the same ranks, in the same order, for collectives that run beside `comm`.
    pub side: Box<dyn Collective>,
    /// The generation as this worker sees it.
    pub membership: Membership,
}

/// How a worker reaches its elastic job: the store's address, and how it forms each generation's
/// collective (the same transports as [`qsr_comm::connect`]).
#[derive(Debug, Clone)]
pub struct ElasticConfig {
    /// The store's `host:port`.
    pub store: String,
    /// Ring settings; [`TcpConfig::token`] is also presented to the store.
    pub tcp: TcpConfig,
    /// Shared memory, the ring or both, as for a launch.
    pub transport: Transport,
    /// Shared-memory settings.
    pub shm: ShmConfig,
    /// This worker's host ([`qsr_comm::host_id`]).
    pub host: String,
    /// The launcher's rank for this worker, which orders the first generation (`None`: arrival).
    pub order: Option<u64>,
    /// Settings every worker of the job must share (the store refuses a worker whose differ).
    pub settings: serde_json::Value,
}

/// Whether a running generation should admit new workers now ([`Elastic::poll`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Poll {
    /// The generation runs; this many workers wait to join it.
    Steady {
        /// Workers waiting (at most the room the store's worker count leaves).
        waiting: usize,
    },
    /// The generation is over: a failure is being handled, and this worker should join again.
    Over,
}

/// A worker's connection to its elastic job's store ([`Store`](crate::Store)).
///
/// ```no_run
/// # fn main() -> Result<(), qsr_elastic::ElasticError> {
/// use qsr_comm::{ShmConfig, TcpConfig, Transport};
/// use qsr_elastic::{Elastic, ElasticConfig};
///
/// let cfg = ElasticConfig {
///     store: "10.0.0.1:29400".into(),
///     tcp: TcpConfig::default(),
///     transport: Transport::Auto,
///     shm: ShmConfig::default(),
///     host: qsr_comm::host_id(&|k| std::env::var(k).ok(), &ShmConfig::default()),
///     order: None,
///     settings: serde_json::json!({ "recipe": "digits" }),
/// };
/// let mut job = Elastic::connect(cfg)?;
/// let (mut comm, membership) = job.form(None, "start")?;
/// // ... train; on a peer failure: restore the last sync and `job.form(Some(state), reason)` again.
/// # let _ = (&mut comm, membership);
/// job.finish()?;
/// # Ok(())
/// # }
/// ```
pub struct Elastic {
    cfg: ElasticConfig,
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    generation: Option<u64>,
    job: String,
    /// Told of each generation the store forms with this worker, before its ring forms.
    on_formed: Option<Observer>,
}

/// What [`Elastic::on_formed`] calls.
type Observer = Box<dyn FnMut(&Membership) + Send>;

/// The store's answer to a join: a seat for the generation's ring, the generation as this worker
/// sees it, and the ring's address table.
struct Seated {
    seat: RingSeat,
    membership: Membership,
    table: Vec<(String, u16)>,
}

impl Elastic {
    /// Connects to the store (retrying until [`TcpConfig::rendezvous_timeout`], saying what it
    /// waits for) and says hello.
    pub fn connect(cfg: ElasticConfig) -> Result<Elastic, ElasticError> {
        let stream = connect_store(&cfg.store, cfg.tcp.rendezvous_timeout)?;
        let _ = stream.set_nodelay(true);
        let writer = stream.try_clone().map_err(|e| CommError::Io { context: "store connection".into(), error: e })?;
        let reader = BufReader::new(stream);
        let mut job = Elastic { reader, writer, cfg, generation: None, job: String::new(), on_formed: None };
        let hello = Request::Hello {
            token: job.cfg.tcp.token.clone(),
            settings: job.cfg.settings.clone(),
            order: job.cfg.order,
        };
        match job.ask(&hello)? {
            Response::Welcome { job: id, .. } => {
                job.job = id;
                Ok(job)
            }
            other => Err(job.unexpected(other)),
        }
    }

    /// Calls `observe` with each generation the store forms with this worker, before the
    /// generation's collective is built (for a log; tests inject faults there).
    pub fn on_formed(&mut self, observe: impl FnMut(&Membership) + Send + 'static) {
        self.on_formed = Some(Box::new(observe));
    }

    /// The generation this worker last formed (`None` before [`Self::form`]).
    pub fn generation(&self) -> Option<u64> {
        self.generation
    }

    /// The job's id, the same for every worker of this store ([`Store::job_id`](crate::Store::job_id)).
    pub fn job_id(&self) -> &str {
        &self.job
    }

    /// The store's address.
    pub fn store_addr(&self) -> &str {
        &self.cfg.store
    }

    /// Joins the next generation and forms its collective. `state` is the last completed
    /// synchronization this worker holds (`None` for a new worker); `reason` says why (a failure
    /// seen, a growth). Fails with [`ElasticError::Expelled`] when this worker's generation ended
    /// without it.
    pub fn form(
        &mut self,
        state: Option<LastSync>,
        reason: &str,
    ) -> Result<(Box<dyn Collective>, Membership), ElasticError> {
        let (ring, membership) = self.join(state, reason)?;
        let comm = over_ring(ring, self.cfg.transport, &self.cfg.host, self.cfg.shm.clone())?;
        Ok((comm, membership))
    }

    /// [`Self::form`], and a second group of the same ranks split from the generation's ring
    /// ([`qsr_comm::split`]), for collectives that run beside the first (a streaming worker's
    /// fragments on a thread). Every member of a generation must call the same one.
    pub fn form_pair(&mut self, state: Option<LastSync>, reason: &str) -> Result<Pair, ElasticError> {
        let (mut ring, membership) = self.join(state, reason)?;
        let (transport, host, shm) = (self.cfg.transport, &self.cfg.host, &self.cfg.shm);
        let side = qsr_comm::split(&mut ring, 0, membership.rank as u32, transport, host, shm.clone())?;
        let comm = over_ring(ring, transport, host, shm.clone())?;
        Ok(Pair { comm, side, membership })
    }

    /// Joins the next generation at the store and forms its ring. A generation the store ends while
    /// its ring forms (a member lost before it connected) is left at once for the next, whose
    /// membership then also names that generation's losses.
    fn join(&mut self, state: Option<LastSync>, reason: &str) -> Result<(TcpComm, Membership), ElasticError> {
        let mut reason = reason.to_string();
        let mut earlier: Vec<Lost> = Vec::new();
        loop {
            let Seated { seat, mut membership, table } = self.joined(state.clone(), &reason)?;
            let generation = membership.generation;
            let tcp = TcpConfig { generation, ..self.cfg.tcp.clone() };
            let mut over = false;
            let mut asked = Instant::now();
            let mut abandon = || {
                if asked.elapsed() < GENERATION_POLL {
                    return None;
                }
                asked = Instant::now();
                over = matches!(self.ask(&Request::Poll { generation }), Ok(Response::Over { .. }));
                over.then(|| format!("the store ended generation {generation} before every member connected"))
            };
            let formed = seat.form_unless(membership.rank, tcp, table, &mut abandon);
            match formed {
                Ok(ring) => {
                    membership.lost.splice(0..0, earlier);
                    return Ok((ring, membership));
                }
                // A member lost as the ring formed (a reset connection, say) ends the generation.
                Err(_) if over || self.ends_soon(generation) => {
                    let ended = |l: Lost| Lost {
                        reason: format!(
                            "{} (rank {} of generation {}, which ended while it formed)",
                            l.reason,
                            l.rank,
                            generation.saturating_sub(1)
                        ),
                        ..l
                    };
                    earlier.extend(membership.lost.into_iter().map(ended));
                    reason = format!("generation {generation} ended while its ring formed");
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Whether the store ends `generation` within [`LOSS_NOTICE`] (a ring that failed to form: the
    /// store learns of the member lost when its connection closes).
    fn ends_soon(&mut self, generation: u64) -> bool {
        let since = Instant::now();
        while since.elapsed() < LOSS_NOTICE {
            match self.ask(&Request::Poll { generation }) {
                Ok(Response::Over { .. }) => return true,
                Ok(_) => std::thread::sleep(Duration::from_millis(100)),
                Err(_) => return false,
            }
        }
        false
    }

    /// Joins the next generation at the store, with a fresh seat for its ring.
    fn joined(&mut self, state: Option<LastSync>, reason: &str) -> Result<Seated, ElasticError> {
        let seat = RingSeat::open(&self.cfg.tcp)?;
        let (host, port) = (seat.host().unwrap_or_default().to_string(), seat.port());
        let join = Request::Join { seen: self.generation, host, port, state, reason: reason.into() };
        let reply = self.ask_until(&join, Some(self.cfg.tcp.rendezvous_timeout))?;
        let Response::Formed { generation, rank, previous_rank, table, source, state, lost, joined } = reply else {
            return Err(self.unexpected(reply));
        };
        self.generation = Some(generation);
        let n = table.len();
        let membership = Membership { generation, rank, world_size: n, previous_rank, source, state, lost, joined };
        if let Some(observe) = &mut self.on_formed {
            observe(&membership);
        }
        Ok(Seated { seat, membership, table })
    }

    /// Asks the store whether the current generation still runs and how many workers wait to join.
    /// One rank polls and shares the answer, so that every member decides alike.
    pub fn poll(&mut self) -> Result<Poll, ElasticError> {
        let Some(generation) = self.generation else {
            return Err(CommError::InvalidArgument("poll before the first generation formed".into()).into());
        };
        match self.ask(&Request::Poll { generation })? {
            Response::Steady { waiting } => Ok(Poll::Steady { waiting }),
            Response::Over { .. } => Ok(Poll::Over),
            other => Err(self.unexpected(other)),
        }
    }

    /// Tells the store this worker finished the run (so its leaving is not a loss).
    pub fn finish(&mut self) -> Result<(), ElasticError> {
        match self.ask(&Request::Done)? {
            Response::Ok => Ok(()),
            other => Err(self.unexpected(other)),
        }
    }

    /// Sends a request and reads its answer, skipping the keepalives of a waiting join.
    fn ask(&mut self, req: &Request) -> Result<Response, ElasticError> {
        self.ask_until(req, None)
    }

    /// [`Self::ask`], failing once a join has waited `patience` for workers that have not joined
    /// (the first generation's, or new ones to reach the store's `min_workers`). A wait of more than
    /// a second says what it waits for (the store's words) at a bounded interval.
    fn ask_until(&mut self, req: &Request, patience: Option<Duration>) -> Result<Response, ElasticError> {
        let addr = self.cfg.store.clone();
        send(&mut self.writer, req).map_err(|e| store_err(&addr, format!("cannot send: {e}")))?;
        // The store answers at once, or keeps a waiting join alive every half second: silence for
        // the comm timeout means it stopped.
        let silence = self.cfg.tcp.timeout.max(MIN_STORE_TIMEOUT);
        let _ = self.reader.get_ref().set_read_timeout(Some(silence));
        // A spare waits for a free slot as long as the job runs, and survivors for members to
        // report as long as the store's settle time: only a wait for workers is bounded here.
        let mut wait = WaitProgress::first_after(None, Duration::from_secs(1));
        let mut since = Some(Instant::now());
        let what = format!("waiting at the elastic store {addr}");
        loop {
            match recv::<Response>(&mut self.reader) {
                Ok(Some(Response::Waiting { generation, status, for_workers })) => {
                    if !for_workers {
                        since = None;
                    }
                    let started = for_workers.then(|| *since.get_or_insert_with(Instant::now));
                    match (patience, started) {
                        (Some(p), Some(t)) if t.elapsed() >= p => return Err(gave_up(&addr, generation, p, &status)),
                        (Some(p), Some(t)) => {
                            let left = p.saturating_sub(t.elapsed()).as_secs_f64().ceil();
                            wait.tick(&what, &format!("{status}; giving up in {left} s"));
                        }
                        _ => wait.tick(&what, &status),
                    }
                }
                Ok(Some(r)) => return Ok(r),
                Ok(None) => return Err(store_err(&addr, "the store closed the connection (did `qsr rendezvous` exit or get killed?); the job cannot change its membership without it: restart the store and the workers with `qsr train --resume` from the run's checkpoint".into())),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(store_err(
                        &addr,
                        format!(
                            "the store stopped answering: nothing for {silence:?} (QSR_COMM_TIMEOUT_SECS); it may be stopped (SIGSTOP), overloaded or cut off. The job cannot change its membership without it: restart the store and the workers with `qsr train --resume` from the run's checkpoint"
                        ),
                    ));
                }
                Err(e) => return Err(store_err(&addr, format!("no usable answer: {e}"))),
            }
        }
    }

    fn unexpected(&self, r: Response) -> ElasticError {
        match r {
            Response::Refused { message, mismatch: true } => {
                ElasticError::Mismatch { peer: format!("rendezvous store {}", self.cfg.store), detail: message }
            }
            Response::Refused { message, .. } => store_err(&self.cfg.store, format!("refused: {message}")),
            Response::Expelled { generation, current } => ElasticError::Expelled { generation, current },
            other => store_err(&self.cfg.store, format!("unexpected answer {other:?}")),
        }
    }
}

/// The error of a join that waited `patience` for workers that did not come.
fn gave_up(addr: &str, generation: Option<u64>, patience: Duration, status: &str) -> ElasticError {
    let detail = match generation {
        None => format!(
            "the first generation did not form within the rendezvous timeout of {patience:?} (QSR_RENDEZVOUS_TIMEOUT_SECS): {status} (did one fail to start, or run with other settings?)"
        ),
        Some(g) => format!(
            "no new worker came within the rendezvous timeout of {patience:?} (QSR_RENDEZVOUS_TIMEOUT_SECS): {status}; start workers with the store's address, or lower its --min-workers, and continue from generation {g}'s checkpoint with `qsr train --resume`"
        ),
    };
    store_err(addr, detail)
}

fn store_err(addr: &str, detail: String) -> ElasticError {
    ElasticError::Store { addr: addr.into(), detail }
}

/// Tries every address a name resolved to (`localhost` may be `::1` first), each with a bounded
/// connect; returns the first connection or the last error.
fn first_connect(addrs: impl Iterator<Item = std::net::SocketAddr>, left: Duration) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::new(ErrorKind::NotFound, "the address resolved to nothing");
    for a in addrs {
        match TcpStream::connect_timeout(&a, left.clamp(Duration::from_millis(100), Duration::from_secs(5))) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Connects to the store at `addr`, retrying until `within`; says at once, then every 10 s, what it
/// waits for, since no store listening is worth knowing about before the timeout.
fn connect_store(addr: &str, within: Duration) -> Result<TcpStream, ElasticError> {
    let deadline = Instant::now() + within;
    let mut wait = WaitProgress::first_after(Some(within), Duration::ZERO);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = addr.to_socket_addrs().and_then(|addrs| first_connect(addrs, left));
        match attempt {
            Ok(s) => return Ok(s),
            Err(e) if left.is_zero() => {
                return Err(store_err(
                    addr,
                    format!(
                        "cannot connect within the rendezvous timeout of {within:?} (QSR_RENDEZVOUS_TIMEOUT_SECS): {e}; is `qsr rendezvous` running there?"
                    ),
                ));
            }
            Err(e) => {
                wait.tick(
                    &format!("waiting for the elastic store at {addr}"),
                    &format!("{e}; is `qsr rendezvous` running there?"),
                );
                std::thread::sleep(Duration::from_millis(100).min(left));
            }
        }
    }
}
