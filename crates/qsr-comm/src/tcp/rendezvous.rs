//! Rendezvous and ring setup.
//!
//! 1. Every rank binds its ring listener (ephemeral port on the bind address).
//! 2. Ranks 1..n connect to rank 0 at `MASTER_ADDR:MASTER_PORT` and send a registration hello:
//!    protocol version, job token, world size, rank, ring listener address. Until the rendezvous
//!    timeout they retry, with backoff, both a refused connect (rank 0 may start later) and a
//!    connection rank 0 closed before answering (it sheds idle connections under a flood), and
//!    say every ~10 s what they are waiting for.
//! 3. Rank 0 reads hellos with one `poll` loop ([`super::accept`]): each connection has
//!    `hello_timeout` to send its hello, so garbage or silent connections are dropped without
//!    stalling anyone. It refuses a wrong version, token, world size, out-of-range or duplicate
//!    rank with a reply naming the field, and keeps waiting. Once all n-1 ranks registered it sends
//!    everyone the address table, and from then on answers late registrations (a second copy of a
//!    rank) with a refusal for as long as the communicator lives.
//! 4. Each rank connects to its right neighbour's ring listener and sends a ring hello, and
//!    accepts its left neighbour (validating token, world size and that it is the expected rank).
//!    Connects complete against the listen backlog, so the order cannot deadlock.

use std::io::{self, ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use subtle::ConstantTimeEq;

use crate::CommError;
use crate::wire::{self, Field, Hello, PREFIX_LEN, PROTOCOL_VERSION, Purpose, Reply};

use super::TcpConfig;
use super::accept::{Acceptor, Incoming};

/// Every rank's ring listener, `(host, port)` by rank.
type Table = Vec<(String, u16)>;

/// How often a waiting rank says what it waits for (a quarter of the timeout when that is shorter).
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// What a rank that cannot reach rank 0 is told to check.
const MASTER_HINT: &str = "; rank 0 has not started, MASTER_ADDR:MASTER_PORT points elsewhere, \
                           or the rendezvous completed without this rank";

/// Seconds for progress lines: one decimal below 10 s.
fn secs(d: Duration) -> String {
    if d < Duration::from_secs(10) { format!("{:.1} s", d.as_secs_f64()) } else { format!("{} s", d.as_secs()) }
}

/// Progress lines of one wait (through [`crate::notice`]), so that a long rendezvous is never silent:
/// the ring's own, and an elastic store's clients.
pub struct WaitProgress {
    start: Instant,
    /// The longest the wait may last (`None`: as long as it takes).
    total: Option<Duration>,
    every: Duration,
    due: Instant,
}

impl WaitProgress {
    /// A wait of at most `total`: a line every 10 s (a quarter of `total` when that is shorter).
    pub fn new(total: Duration) -> WaitProgress {
        WaitProgress::of(Some(total))
    }

    fn of(total: Option<Duration>) -> WaitProgress {
        let every = total.map_or(PROGRESS_EVERY, |t| PROGRESS_EVERY.min(t / 4)).max(Duration::from_millis(100));
        let start = Instant::now();
        WaitProgress { start, total, every, due: start + every }
    }

    /// A wait of at most `total` (`None`: no limit), its first line due after `first` (a wait that
    /// is already unusual).
    pub fn first_after(total: Option<Duration>, first: Duration) -> WaitProgress {
        let w = WaitProgress::of(total);
        WaitProgress { due: w.start + first.min(w.every), ..w }
    }

    /// When the next line is due.
    fn due(&self) -> Instant {
        self.due
    }

    /// Prints `what (elapsed of total): detail` if a line is due.
    pub fn tick(&mut self, what: &str, detail: &str) {
        let now = Instant::now();
        if now < self.due {
            return;
        }
        self.due = now + self.every;
        let sep = if detail.is_empty() { "" } else { ": " };
        let spent = secs(now - self.start);
        let of = self.total.map_or(String::new(), |t| format!(" of {}", secs(t)));
        qsr_notice::notice(false, &format!("{what} ({spent}{of}){sep}{detail}"));
    }
}

/// Exponential backoff between attempts, bounded by a deadline.
struct Backoff(Duration);

impl Backoff {
    fn new() -> Backoff {
        Backoff(Duration::from_millis(20))
    }

    fn sleep(&mut self, deadline: Instant) {
        std::thread::sleep(self.0.min(deadline.saturating_duration_since(Instant::now())));
        self.0 = (self.0 * 2).min(Duration::from_secs(1));
    }
}

fn send_reply(s: &mut TcpStream, reply: &Reply, timeout: Duration) {
    let _ = s.set_write_timeout(Some(timeout));
    if let Err(e) = s.write_all(&reply.encode()) {
        tracing::warn!(error = %e, "could not send handshake reply");
    }
}

fn refuse(s: &mut TcpStream, field: Field, message: String, timeout: Duration) {
    send_reply(s, &Reply::Refused { field, message }, timeout);
}

/// Refuses a hello of another protocol version; returns the message sent.
fn refuse_version(mut s: TcpStream, peer: SocketAddr, me: usize, theirs: u32, timeout: Duration) -> String {
    let message = format!("protocol version differs: rank {me} speaks {PROTOCOL_VERSION}, the hello sent {theirs}");
    tracing::warn!(%peer, "{message}");
    refuse(&mut s, Field::Version, message.clone(), timeout);
    message
}

/// Checks a hello against this job; `Err((field, message))` is sent back as a refusal. Messages
/// name the field themselves (the error shows them as they are).
fn check_hello(h: &Hello, purpose: Purpose, cfg: &TcpConfig, n: usize) -> Result<(), (Field, String)> {
    if h.purpose != purpose {
        return Err((Field::Other, format!("expected a {:?} hello, got {:?}", purpose, h.purpose)));
    }
    if !bool::from(h.token.as_slice().ct_eq(cfg.token.as_bytes())) {
        return Err((Field::Token, "job token differs (is this rank from another job or launch?)".into()));
    }
    if h.generation != cfg.generation {
        let age = if h.generation < cfg.generation { "is over" } else { "has not formed here yet" };
        return Err((
            Field::Generation,
            format!(
                "generation {} of this elastic job {age}: this ring is generation {} (rank {} is stale)",
                h.generation, cfg.generation, h.rank
            ),
        ));
    }
    if h.world_size as usize != n {
        return Err((
            Field::WorldSize,
            format!("world size differs: this job has {n}, rank {} sent {}", h.rank, h.world_size),
        ));
    }
    Ok(())
}

fn out_of_range(r: usize, n: usize) -> Result<(), (Field, String)> {
    if r == 0 || r >= n {
        return Err((Field::Rank, format!("rank {r} is out of range 1..{n} for registration")));
    }
    Ok(())
}

/// Whether the peer closed a connection (a registered rank that gave up and now retries).
fn closed(s: &TcpStream) -> bool {
    if s.set_nonblocking(true).is_err() {
        return true;
    }
    let res = s.peek(&mut [0u8; 1]);
    let _ = s.set_nonblocking(false);
    match res {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != ErrorKind::WouldBlock,
    }
}

/// A registered rank: its connection (answered with the table at the end) and ring address.
struct Joined {
    s: TcpStream,
    peer: SocketAddr,
    host: String,
    port: u16,
}

/// Rank 0's registrations so far.
struct Registry<'a> {
    n: usize,
    cfg: &'a TcpConfig,
    addr: String,
    slots: Vec<Option<Joined>>,
    /// Ranks registered, rank 0 included.
    count: usize,
    refusals: Vec<String>,
    /// A refusal that means this job can never form: a rank with the job's token that counts
    /// another world size (launches that disagree on `--nproc` or `--nnodes`).
    fatal: Option<CommError>,
}

impl<'a> Registry<'a> {
    fn new(n: usize, cfg: &'a TcpConfig, addr: String) -> Self {
        let slots = (0..n).map(|_| None).collect();
        Registry { n, cfg, addr, slots, count: 1, refusals: Vec::new(), fatal: None }
    }

    fn missing(&self) -> Vec<usize> {
        (1..self.n).filter(|&r| self.slots[r].is_none()).collect()
    }

    fn take(&mut self, inc: Incoming) {
        match inc {
            Incoming::Garbage(why, peer) => {
                tracing::warn!(%peer, %why, "dropped a connection to the rendezvous port");
            }
            Incoming::WrongVersion(v, s, peer) => {
                let message = refuse_version(s, peer, 0, v, self.cfg.hello_timeout);
                self.refusals.push(format!("{peer}: {message}"));
            }
            Incoming::Hello(h, s, peer) => self.hello(h, s, peer),
        }
    }

    fn hello(&mut self, h: Hello, mut s: TcpStream, peer: SocketAddr) {
        let r = h.rank as usize;
        let verdict = check_hello(&h, Purpose::Register, self.cfg, self.n)
            .and_then(|_| out_of_range(r, self.n))
            .and_then(|_| self.duplicate(r));
        if let Err((field, message)) = verdict {
            tracing::warn!(%peer, rank = r, "refused registration: {message}");
            refuse(&mut s, field, message.clone(), self.cfg.hello_timeout);
            if field == Field::WorldSize && self.fatal.is_none() {
                let detail = format!(
                    "{message}: the launches disagree on the size (do the nodes give the same \
                     --nproc and --nnodes?)"
                );
                let peer = format!("rank {r} ({peer})");
                self.fatal = Some(CommError::HandshakeRefused { peer, field: field.name(), detail });
            }
            self.refusals.push(format!("{peer}: {message}"));
            return;
        }
        let host = if h.host.is_empty() { peer.ip().to_string() } else { h.host };
        let joined = Joined { s, peer, host, port: h.port };
        if self.slots[r].replace(joined).is_none() {
            self.count += 1;
        }
    }

    /// A second registration of a rank is refused while the first one's connection is open.
    fn duplicate(&self, r: usize) -> Result<(), (Field, String)> {
        match &self.slots[r] {
            Some(first) if !closed(&first.s) => {
                Err((Field::Rank, format!("rank {r} is already registered from {}", first.peer)))
            }
            Some(first) => {
                tracing::info!(rank = r, first = %first.peer, "rank re-registered after closing");
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Forgets registrations whose connection closed (a rank that died or gave up before the
    /// table), so the ring is never built with a rank that is gone.
    fn prune_closed(&mut self) {
        for (r, slot) in self.slots.iter_mut().enumerate() {
            if slot.as_ref().is_some_and(|j| closed(&j.s)) {
                tracing::info!(rank = r, "a registered rank closed its connection; waiting for it again");
                *slot = None;
                self.count -= 1;
            }
        }
    }

    fn waiting_line(&self) -> String {
        format!(
            "rank 0 at {}: {} of {} ranks registered, waiting for rank(s) {:?}",
            self.addr,
            self.count,
            self.n,
            self.missing()
        )
    }

    fn timeout_error(&self) -> CommError {
        let mut msg = format!(
            "rank 0 waited {:?} at {}: {} of {} ranks registered, missing rank(s) {:?}",
            self.cfg.rendezvous_timeout,
            self.addr,
            self.count,
            self.n,
            self.missing()
        );
        if !self.refusals.is_empty() {
            msg.push_str(&format!("; refused: {}", self.refusals.join("; ")));
        }
        CommError::Rendezvous(msg)
    }

    /// Sends everyone the table; returns it and where each rank registered from.
    fn finish(mut self, own_ring: (Option<String>, u16)) -> (Table, Vec<String>) {
        // Rank 0's own ring address as seen by its left neighbour (rank n-1), unless configured.
        let own_host = own_ring.0.unwrap_or_else(|| {
            self.slots[self.n - 1]
                .as_ref()
                .and_then(|j| j.s.local_addr().ok())
                .map(|a| a.ip().to_string())
                .unwrap_or_else(|| "127.0.0.1".into())
        });
        let mut table = vec![(own_host, own_ring.1)];
        table.extend(
            self.slots.iter().skip(1).map(|j| j.as_ref().map(|j| (j.host.clone(), j.port)).unwrap_or_default()),
        );
        let reply = Reply::Accepted { table: table.clone() };
        for j in self.slots.iter_mut().skip(1).flatten() {
            send_reply(&mut j.s, &reply, self.cfg.hello_timeout);
        }
        let joined = self.slots.iter().map(|j| j.as_ref().map(|j| j.peer.to_string()).unwrap_or_default()).collect();
        (table, joined)
    }
}

/// Rank 0: collect n-1 registrations and send everyone the ring address table. Returns the table
/// and the address each rank registered from.
pub(crate) fn serve(
    listener: &TcpListener,
    n: usize,
    cfg: &TcpConfig,
    own_ring: (Option<String>, u16),
) -> Result<(Table, Vec<String>), CommError> {
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    let mut acc = Acceptor::new(listener, cfg.hello_timeout)?;
    let addr = listener.local_addr().map_or_else(|_| "?".into(), |a| a.to_string());
    let mut reg = Registry::new(n, cfg, addr);
    let mut wait = WaitProgress::new(cfg.rendezvous_timeout);
    while reg.count < n {
        match acc.next(deadline.min(wait.due())) {
            Some(inc) => reg.take(inc),
            None if Instant::now() >= deadline => return Err(reg.timeout_error()),
            None => wait.tick(&reg.waiting_line(), ""),
        }
        if let Some(e) = reg.fatal.take() {
            // The ranks registered so far learn it when this listener and their connections close.
            return Err(e);
        }
        if reg.count == n {
            reg.prune_closed();
        }
    }
    Ok(reg.finish(own_ring))
}

/// After the ring formed, rank 0 keeps its rendezvous port and refuses late registrations (a
/// second copy of a rank, a restarted one) at once, so they do not wait out their timeout. The
/// port closes when this is dropped (with the communicator).
pub(crate) struct LateRefuser {
    stop: Arc<AtomicBool>,
}

impl LateRefuser {
    /// Serves `listener` on a thread; `joined[r]` is where rank r registered from.
    pub(crate) fn spawn(listener: TcpListener, n: usize, cfg: &TcpConfig, joined: Vec<String>) -> Option<LateRefuser> {
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, cfg) = (Arc::clone(&stop), cfg.clone());
        let spawned = std::thread::Builder::new()
            .name("qsr-late-ranks".into())
            .spawn(move || refuse_late(&listener, n, &cfg, &joined, &flag));
        match spawned {
            Ok(_) => Some(LateRefuser { stop }),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the thread that refuses late ranks");
                None
            }
        }
    }
}

impl Drop for LateRefuser {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn refuse_late(listener: &TcpListener, n: usize, cfg: &TcpConfig, joined: &[String], stop: &AtomicBool) {
    let Ok(mut acc) = Acceptor::new(listener, cfg.hello_timeout) else {
        return;
    };
    while !stop.load(Ordering::Relaxed) {
        let Some(inc) = acc.next(Instant::now() + Duration::from_millis(100)) else {
            continue;
        };
        match inc {
            Incoming::Garbage(..) => {}
            Incoming::WrongVersion(v, s, peer) => {
                refuse_version(s, peer, 0, v, cfg.hello_timeout);
            }
            Incoming::Hello(h, mut s, peer) => {
                let r = h.rank as usize;
                let verdict = check_hello(&h, Purpose::Register, cfg, n)
                    .and_then(|_| out_of_range(r, n))
                    .and_then(|_| Err::<(), _>(late(r, &joined[r])));
                if let Err((field, message)) = verdict {
                    tracing::warn!(%peer, rank = r, "refused a late registration: {message}");
                    refuse(&mut s, field, message, cfg.hello_timeout);
                }
            }
        }
    }
}

/// The refusal of rank `r` after the ring formed.
fn late(r: usize, first: &str) -> (Field, String) {
    (
        Field::Rank,
        format!(
            "rank {r} already joined from {first} and the ring has formed (the rendezvous is \
             complete): is a second copy of rank {r} running?"
        ),
    )
}

/// Connects to `target`, retrying until `deadline`; `name` says who listens there (for progress
/// lines and the error), `hint` is appended to the error.
fn connect_retry(
    target: &str,
    name: &str,
    me: usize,
    (deadline, abort): (Instant, &mut Abort<'_>),
    wait: &mut WaitProgress,
    hint: &str,
) -> Result<TcpStream, CommError> {
    let mut backoff = Backoff::new();
    let mut last_err = String::from("no address");
    loop {
        let addrs: Vec<SocketAddr> = match target.to_socket_addrs() {
            Ok(a) => a.collect(),
            Err(e) => {
                last_err = format!("cannot resolve {target}: {e}");
                Vec::new()
            }
        };
        for a in &addrs {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            match TcpStream::connect_timeout(a, left.min(Duration::from_secs(5))) {
                Ok(s) => return Ok(s),
                // The address only where it says more than the target does.
                Err(e) if a.to_string() == target => last_err = e.to_string(),
                Err(e) => last_err = format!("{a}: {e}"),
            }
        }
        if Instant::now() >= deadline {
            return Err(CommError::Rendezvous(format!(
                "could not connect to {name} at {target} within {:?}: {last_err}{hint}",
                wait.total
            )));
        }
        wait.tick(&format!("rank {me}: waiting for {name} at {target}"), &last_err);
        if let Some(why) = abort() {
            return Err(aborted(me, &why));
        }
        backoff.sleep(deadline);
    }
}

/// Asked while a ring forms from a table: `Some(why)` ends the wait (the rendezvous that handed out
/// the table says the ranks will not all come).
pub(crate) type Abort<'a> = dyn FnMut() -> Option<String> + 'a;

/// How often a ring's formation asks its [`Abort`].
const ABORT_POLL: Duration = Duration::from_millis(500);

fn aborted(rank: usize, why: &str) -> CommError {
    CommError::Rendezvous(format!("rank {rank}: the ring's formation was abandoned: {why}"))
}

/// Fills `buf` by `deadline`, calling `idle` whenever a second passes without data.
fn read_full(s: &mut TcpStream, buf: &mut [u8], deadline: Instant, idle: &mut dyn FnMut()) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left.min(Duration::from_secs(1))))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(k) => got += k,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => idle(),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Why no reply arrived.
enum ReplyFail {
    /// The peer closed or reset the connection (a registration may retry).
    Closed(io::Error),
    TimedOut(Duration),
    Err(CommError),
}

impl ReplyFail {
    fn from_io(e: io::Error, waited: Duration) -> ReplyFail {
        match e.kind() {
            ErrorKind::TimedOut | ErrorKind::WouldBlock => ReplyFail::TimedOut(waited),
            _ => ReplyFail::Closed(e),
        }
    }

    fn into_err(self, peer: &str) -> CommError {
        match self {
            ReplyFail::Closed(e) => CommError::Protocol {
                peer: peer.to_string(),
                detail: format!(
                    "connection ended before the handshake reply ({e}); was the rendezvous \
                     already complete, or was our hello not understood?"
                ),
            },
            ReplyFail::TimedOut(waited) => CommError::Rendezvous(format!("no reply from {peer} within {waited:?}")),
            ReplyFail::Err(e) => e,
        }
    }
}

/// Reads a reply (bounded by the table size we expect) from `peer`.
fn read_reply(
    s: &mut TcpStream,
    peer: &str,
    max_entries: usize,
    deadline: Instant,
    idle: &mut dyn FnMut(),
) -> Result<Reply, ReplyFail> {
    let waited = deadline.saturating_duration_since(Instant::now());
    let proto = |detail: String| ReplyFail::Err(CommError::Protocol { peer: peer.to_string(), detail });
    let mut prefix = [0u8; PREFIX_LEN];
    read_full(s, &mut prefix, deadline, idle).map_err(|e| ReplyFail::from_io(e, waited))?;
    let p = wire::decode_prefix(&prefix, &wire::REPLY_MAGIC, Reply::max_body(max_entries))
        .map_err(|e| proto(e.to_string()))?;
    if p.version != PROTOCOL_VERSION {
        return Err(ReplyFail::Err(CommError::HandshakeRefused {
            peer: peer.to_string(),
            field: Field::Version.name(),
            detail: format!("protocol version differs: it speaks {}, we speak {PROTOCOL_VERSION}", p.version),
        }));
    }
    let mut body = vec![0u8; p.body_len];
    read_full(s, &mut body, deadline, &mut || {}).map_err(|e| proto(format!("reply body incomplete: {e}")))?;
    Reply::decode_body(&body, max_entries).map_err(|e| proto(e.to_string()))
}

fn hello(cfg: &TcpConfig, purpose: Purpose, n: usize, rank: usize, host: String, port: u16) -> Hello {
    Hello {
        version: cfg.protocol_version,
        purpose,
        world_size: n as u32,
        rank: rank as u32,
        token: cfg.token.as_bytes().to_vec(),
        host,
        port,
        generation: cfg.generation,
    }
}

/// One registration attempt's failure: worth retrying (rank 0 closed the connection), or final.
enum Attempt {
    Retry(String),
    Fatal(CommError),
}

/// A rank 1..n registering with rank 0.
struct Registrant<'a> {
    master: &'a str,
    peer: String,
    rank: usize,
    n: usize,
    cfg: &'a TcpConfig,
    own_ring: (String, u16),
    deadline: Instant,
}

impl Registrant<'_> {
    fn attempt(&self, mut s: TcpStream, wait: &mut WaitProgress) -> Result<Table, Attempt> {
        let (rank, n) = (self.rank, self.n);
        s.set_write_timeout(Some(self.cfg.hello_timeout))
            .map_err(|e| Attempt::Fatal(CommError::io("socket setup", e)))?;
        let (host, port) = self.own_ring.clone();
        s.write_all(&hello(self.cfg, Purpose::Register, n, rank, host, port).encode())
            .map_err(|e| Attempt::Retry(format!("sending the registration: {e}")))?;
        let what = format!("rank {rank}: registered with rank 0 at {}, waiting for the other ranks", self.master);
        let mut idle = || wait.tick(&what, "");
        let reply = read_reply(&mut s, &self.peer, n, self.deadline, &mut idle);
        match reply {
            Err(ReplyFail::Closed(e)) => {
                Err(Attempt::Retry(format!("rank 0 closed the connection before answering ({e})")))
            }
            Err(ReplyFail::TimedOut(waited)) => Err(Attempt::Fatal(CommError::Rendezvous(format!(
                "registered with {}, but it sent no address table within {waited:?}: \
                     some other rank did not register (rank 0's error names it)",
                self.peer
            )))),
            Err(ReplyFail::Err(e)) => Err(Attempt::Fatal(e)),
            Ok(Reply::Refused { field, message }) => Err(Attempt::Fatal(CommError::HandshakeRefused {
                peer: self.peer.clone(),
                field: field.name(),
                detail: message,
            })),
            Ok(Reply::Accepted { table }) if table.len() != n => Err(Attempt::Fatal(CommError::Protocol {
                peer: self.peer.clone(),
                detail: format!("address table has {} entries for world size {n}", table.len()),
            })),
            Ok(Reply::Accepted { table }) => Ok(table),
        }
    }
}

/// Ranks 1..n: register with rank 0 and receive the address table.
pub(crate) fn register(
    master: &str,
    rank: usize,
    n: usize,
    cfg: &TcpConfig,
    own_ring: (String, u16),
) -> Result<Table, CommError> {
    let me = Registrant {
        master,
        peer: format!("rank 0 ({master})"),
        rank,
        n,
        cfg,
        own_ring,
        deadline: Instant::now() + cfg.rendezvous_timeout,
    };
    let mut wait = WaitProgress::new(cfg.rendezvous_timeout);
    let mut backoff = Backoff::new();
    loop {
        let s = connect_retry(master, "rank 0", rank, (me.deadline, &mut || None), &mut wait, MASTER_HINT)?;
        let why = match me.attempt(s, &mut wait) {
            Ok(table) => return Ok(table),
            Err(Attempt::Fatal(e)) => return Err(e),
            Err(Attempt::Retry(why)) => why,
        };
        tracing::debug!(rank, %why, "registration not answered; retrying");
        if Instant::now() >= me.deadline {
            return Err(CommError::Rendezvous(format!(
                "could not register with {} within {:?}: {why}{MASTER_HINT}",
                me.peer, cfg.rendezvous_timeout
            )));
        }
        wait.tick(&format!("rank {rank}: waiting for rank 0 at {master}"), &why);
        backoff.sleep(me.deadline);
    }
}

/// Ring setup: connect to the right neighbour, accept the left one. Returns (left, right).
pub(crate) fn connect_ring(
    listener: &TcpListener,
    (rank, n): (usize, usize),
    table: &[(String, u16)],
    cfg: &TcpConfig,
    abort: &mut Abort<'_>,
) -> Result<(TcpStream, TcpStream), CommError> {
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    let mut wait = WaitProgress::new(cfg.rendezvous_timeout);
    let right_rank = (rank + 1) % n;
    let (host, port) = &table[right_rank];
    let target = if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
    let right_name = format!("rank {right_rank} ({target})");
    let name = format!("ring neighbour rank {right_rank}");
    let mut right = connect_retry(&target, &name, rank, (deadline, &mut *abort), &mut wait, "")?;
    right.set_write_timeout(Some(cfg.hello_timeout)).map_err(|e| CommError::io("socket setup", e))?;
    right.write_all(&hello(cfg, Purpose::Ring, n, rank, String::new(), 0).encode()).map_err(|e| {
        CommError::PeerLost {
            rank: right_rank,
            addr: target.clone(),
            during: "ring setup".into(),
            detail: e.to_string(),
        }
    })?;
    let left = accept_left(listener, (rank, n), cfg, (deadline, abort), &mut wait)?;
    let reply = read_reply(&mut right, &right_name, 0, deadline, &mut || {}).map_err(|f| f.into_err(&right_name))?;
    match reply {
        Reply::Accepted { .. } => Ok((left, right)),
        Reply::Refused { field, message } => {
            Err(CommError::HandshakeRefused { peer: right_name, field: field.name(), detail: message })
        }
    }
}

fn is_left(h: &Hello, rank: usize, left_rank: usize) -> Result<(), (Field, String)> {
    if h.rank as usize == left_rank {
        return Ok(());
    }
    Err((Field::Rank, format!("rank {rank} expects its left neighbour rank {left_rank}, got rank {}", h.rank)))
}

/// Accepts the left neighbour's ring connection, refusing anyone else.
fn accept_left(
    listener: &TcpListener,
    (rank, n): (usize, usize),
    cfg: &TcpConfig,
    (deadline, abort): (Instant, &mut Abort<'_>),
    wait: &mut WaitProgress,
) -> Result<TcpStream, CommError> {
    let left_rank = (rank + n - 1) % n;
    let mut acc = Acceptor::new(listener, cfg.hello_timeout)?;
    loop {
        let Some(inc) = acc.next(deadline.min(wait.due()).min(Instant::now() + ABORT_POLL)) else {
            if let Some(why) = abort() {
                return Err(aborted(rank, &why));
            }
            if Instant::now() >= deadline {
                return Err(CommError::Rendezvous(format!(
                    "rank {rank}: left neighbour rank {left_rank} did not connect within {:?}",
                    cfg.rendezvous_timeout
                )));
            }
            let what = format!("rank {rank}: waiting for ring neighbour rank {left_rank} to connect");
            wait.tick(&what, "");
            continue;
        };
        let (h, mut s, peer) = match inc {
            Incoming::Garbage(why, peer) => {
                tracing::warn!(%peer, %why, "dropped a connection to the ring port");
                continue;
            }
            Incoming::WrongVersion(v, s, peer) => {
                refuse_version(s, peer, rank, v, cfg.hello_timeout);
                continue;
            }
            Incoming::Hello(h, s, peer) => (h, s, peer),
        };
        match check_hello(&h, Purpose::Ring, cfg, n).and_then(|_| is_left(&h, rank, left_rank)) {
            Err((field, message)) => {
                tracing::warn!(%peer, "refused ring connection: {message}");
                refuse(&mut s, field, message, cfg.hello_timeout);
            }
            Ok(()) => {
                send_reply(&mut s, &Reply::Accepted { table: Vec::new() }, cfg.hello_timeout);
                return Ok(s);
            }
        }
    }
}

/// The host others should use for our ring listener: configured, else the bind address unless
/// it is unspecified (then the address rank 0 sees us connect from).
pub(crate) fn advertised_host(cfg: &TcpConfig) -> Option<String> {
    if let Some(h) = &cfg.advertise_host {
        return Some(h.clone());
    }
    match cfg.bind_ip {
        IpAddr::V4(a) if a.is_unspecified() => None,
        IpAddr::V6(a) if a.is_unspecified() => None,
        ip => Some(ip.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison() {
        let same = |a: &[u8], b: &[u8]| bool::from(a.ct_eq(b));
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd"));
        assert!(!same(b"abc", b"abcd"));
        assert!(same(b"", b""));
    }

    #[test]
    fn progress_lines_come_at_most_every_ten_seconds() {
        assert_eq!(WaitProgress::new(Duration::from_secs(300)).every, PROGRESS_EVERY);
        assert_eq!(WaitProgress::new(Duration::from_secs(2)).every, Duration::from_millis(500));
        assert_eq!(
            (secs(Duration::from_millis(2500)), secs(Duration::from_secs(300))),
            ("2.5 s".to_string(), "300 s".to_string())
        );
    }
}
