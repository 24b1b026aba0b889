//! The store: a TCP server that outlives any worker and settles each generation's membership.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::BufReader;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::proto::{Request, Response, recv, send};
use super::{Lost, MAX_SYNC_PAYLOAD, SyncState};
use crate::CommError;
use crate::tcp::notice;
use crate::wire::MAX_HOST_LEN;

/// How often a waiting join hears from the store, and how often threads look at the stop flag.
const TICK: Duration = Duration::from_millis(50);
const KEEPALIVE: Duration = Duration::from_secs(5);

/// Settings of a [`Store`].
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Workers of the first generation, and the most any generation admits: the first generation
    /// forms when this many have joined.
    pub workers: usize,
    /// The fewest workers a later generation forms with (default 1); below it, the survivors wait
    /// for joiners.
    pub min_workers: usize,
    /// How long, after a member reported its generation over, the store waits for the members that
    /// have not reported before it expels them (a stopped or cut-off process keeps its connection
    /// open but never reports). Default 30 s; it should be at least the workers' comm timeout.
    pub settle: Duration,
    /// The job token every worker must present ([`crate::TcpConfig::token`]).
    pub token: String,
    /// Connections served at once, counting those that have not said hello yet (default 4096);
    /// more are refused, so idle sockets cannot exhaust the store's threads.
    pub max_connections: usize,
}

impl StoreConfig {
    /// A store for `workers` workers with the default settle time and no token.
    pub fn new(workers: usize) -> Self {
        StoreConfig {
            workers,
            min_workers: 1,
            settle: Duration::from_secs(30),
            token: String::new(),
            max_connections: 4096,
        }
    }
}

/// The rendezvous store of an elastic job (`qsr rendezvous`, or a thread of the `--nproc`
/// launcher): workers keep one connection to it for their lifetime, so a closed connection is a
/// lost worker, and every formation, failure report and poll goes through it. Dropping it stops
/// serving.
pub struct Store {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<std::thread::JoinHandle<()>>,
}

struct Shared {
    cfg: StoreConfig,
    state: Mutex<State>,
    changed: Condvar,
    stop: AtomicBool,
    /// Connections being served, hello or not.
    connections: AtomicUsize,
}

/// A join waiting for its generation.
struct Pending {
    host: String,
    port: u16,
    state: Option<SyncState>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    settings: Option<serde_json::Value>,
    /// Open connections, by worker id, with their launcher order.
    alive: HashMap<u64, Option<u64>>,
    generation: Option<u64>,
    /// The current generation's workers, in rank order.
    members: Vec<u64>,
    /// Why the current generation ended, and since when a member has been waiting to go on.
    over: Option<Over>,
    pending: BTreeMap<u64, Pending>,
    /// Answers for joins, picked up by their connections.
    formed: HashMap<u64, Response>,
    /// Workers expelled, with the generation they were expelled from.
    expelled: HashMap<u64, u64>,
    done: HashSet<u64>,
    /// What the last formation has to say, printed once the lock is released.
    notice: Option<String>,
}

/// The end of a generation.
struct Over {
    why: String,
    /// When the first member reported for the next generation: the settle time runs from then, not
    /// from the loss, since survivors learn of a loss only at their next sync (a long round later).
    since: Option<Instant>,
}

impl Store {
    /// Binds `addr` (`host:port`; port 0 picks one) and serves in background threads.
    pub fn bind(addr: &str, cfg: StoreConfig) -> Result<Store, CommError> {
        if cfg.workers == 0 || cfg.min_workers == 0 || cfg.min_workers > cfg.workers {
            return Err(CommError::InvalidArgument(format!(
                "an elastic store needs 1 <= min_workers ({}) <= workers ({})",
                cfg.min_workers, cfg.workers
            )));
        }
        let listener = TcpListener::bind(addr).map_err(|e| CommError::io(format!("binding the store on {addr}"), e))?;
        let addr = listener.local_addr().map_err(|e| CommError::io("store address", e))?;
        listener.set_nonblocking(true).map_err(|e| CommError::io("store listener", e))?;
        let shared = Arc::new(Shared {
            cfg,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            connections: AtomicUsize::new(0),
        });
        let s = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("qsr-store".into())
            .spawn(move || accept_loop(&listener, &s))
            .map_err(|e| CommError::io("starting the store thread", e))?;
        Ok(Store { addr, shared, accept: Some(accept) })
    }

    /// The address workers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether every worker of the current generation finished the run.
    pub fn finished(&self) -> bool {
        self.shared.lock().finished()
    }

    /// The current generation, once one formed.
    pub fn generation(&self) -> Option<u64> {
        self.shared.lock().generation
    }

    /// Blocks until every worker of the current generation finished the run, or `timeout` passes
    /// (`None`: no limit); returns whether the run finished.
    pub fn wait_finished(&self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = self.shared.lock();
        while !st.finished() {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return false;
            }
            st = self.shared.changed.wait_timeout(st, TICK).map_or_else(|e| e.into_inner().0, |r| r.0);
        }
        true
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicked connection thread leaves consistent state: every update is one assignment.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait_timeout(st, TICK).map_or_else(|e| e.into_inner().0, |r| r.0)
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    while !shared.stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((mut s, peer)) => {
                let limit = shared.cfg.max_connections;
                if shared.connections.load(Ordering::Relaxed) >= limit {
                    let message = format!("the store already serves its limit of {limit} connections");
                    let _ = s.set_write_timeout(Some(TICK));
                    let _ = send(&mut s, &Response::Refused { message });
                    continue;
                }
                shared.connections.fetch_add(1, Ordering::Relaxed);
                let sh = Arc::clone(shared);
                let spawned = std::thread::Builder::new().name("qsr-store-conn".into()).spawn(move || {
                    serve(s, peer, &sh);
                    sh.connections.fetch_sub(1, Ordering::Relaxed);
                });
                if spawned.is_err() {
                    shared.connections.fetch_sub(1, Ordering::Relaxed);
                }
            }
            Err(_) => std::thread::sleep(TICK),
        }
    }
}

/// One worker's connection, from its hello to its end (the worker's end, as far as the store knows).
fn serve(s: TcpStream, peer: SocketAddr, shared: &Shared) {
    let _ = s.set_nonblocking(false);
    let _ = s.set_nodelay(true);
    let Ok(mut w) = s.try_clone() else {
        return;
    };
    let mut r = BufReader::new(s);
    let id = match hello(&mut r, shared) {
        Ok(id) => id,
        Err(message) => {
            let _ = send(&mut w, &Response::Refused { message });
            return;
        }
    };
    let _ = send(&mut w, &Response::Welcome { id });
    loop {
        let req = match recv::<Request>(&mut r) {
            Ok(Some(req)) => req,
            Ok(None) => break,
            Err(e) => {
                let _ = send(&mut w, &Response::Refused { message: format!("unreadable request: {e}") });
                break;
            }
        };
        let reply = match req {
            Request::Hello { .. } => Response::Refused { message: "a second hello on one connection".into() },
            Request::Join { seen, host, port, state, reason } => {
                let host = if host.is_empty() { peer.ip().to_string() } else { host };
                join(shared, id, seen, Pending { host, port, state }, reason, &mut w)
            }
            Request::Poll { generation } => shared.lock().poll(id, generation, &shared.cfg),
            Request::Done => {
                shared.lock().done.insert(id);
                shared.changed.notify_all();
                Response::Ok
            }
        };
        if send(&mut w, &reply).is_err() {
            break;
        }
    }
    let mut st = shared.lock();
    st.lost_connection(id);
    drop(st);
    shared.changed.notify_all();
}

/// Reads and checks the hello; returns the worker's id.
fn hello(r: &mut BufReader<TcpStream>, shared: &Shared) -> Result<u64, String> {
    let _ = r.get_ref().set_read_timeout(Some(Duration::from_secs(10)));
    let req = recv::<Request>(r).map_err(|e| format!("unreadable hello: {e}"))?;
    let _ = r.get_ref().set_read_timeout(None);
    let Some(Request::Hello { token, settings, order }) = req else {
        return Err("the first request must be a hello".into());
    };
    if !crate::tcp::rendezvous::same_token(token.as_bytes(), shared.cfg.token.as_bytes()) {
        return Err("job token differs (is this worker from another job?)".into());
    }
    let mut st = shared.lock();
    match &st.settings {
        None => st.settings = Some(settings),
        Some(job) if *job != settings => {
            let diffs: Vec<String> = crate::differing_keys(job, &settings)
                .into_iter()
                .map(|d| format!("`{}` (job: {}, this worker: {})", d.key, d.left, d.right))
                .collect();
            return Err(format!("this worker's settings differ from the job's in {}", diffs.join(", ")));
        }
        Some(_) => {}
    }
    let id = st.next_id;
    st.next_id += 1;
    st.alive.insert(id, order);
    Ok(id)
}

/// A join: waits until a generation forms with this worker, or says it was expelled.
fn join(shared: &Shared, id: u64, seen: Option<u64>, pending: Pending, reason: String, w: &mut TcpStream) -> Response {
    if let Err(message) = pending.check() {
        return Response::Refused { message };
    }
    let mut st = shared.lock();
    if let Some(g) = seen {
        let current = st.generation.unwrap_or(0);
        if st.expelled.contains_key(&id) || st.generation != Some(g) {
            return Response::Expelled { generation: g, current };
        }
        let Some(rank) = st.rank_of(id) else {
            return Response::Refused {
                message: format!("worker {id} names generation {g} but is not a member of it"),
            };
        };
        let over = st.over.get_or_insert_with(|| Over { why: format!("rank {rank}: {reason}"), since: None });
        over.since.get_or_insert_with(Instant::now);
    }
    st.pending.insert(id, pending);
    shared.changed.notify_all();
    let mut beat = Instant::now();
    loop {
        if let Some(r) = st.formed.remove(&id) {
            return r;
        }
        if st.form(&shared.cfg) {
            shared.changed.notify_all();
            if let Some(text) = st.notice.take() {
                drop(st);
                notice(false, &text);
                st = shared.lock();
            }
            continue;
        }
        if st.finished() {
            st.pending.remove(&id);
            return Response::Refused { message: "the job has finished".into() };
        }
        if let Some(message) = st.orphaned() {
            st.pending.remove(&id);
            return Response::Refused { message };
        }
        if beat.elapsed() >= KEEPALIVE {
            let generation = st.generation;
            drop(st);
            if send(w, &Response::Waiting { generation }).is_err() {
                return Response::Refused { message: "connection lost".into() };
            }
            beat = Instant::now();
            st = shared.lock();
            continue;
        }
        if shared.stop.load(Ordering::Relaxed) {
            return Response::Refused { message: "the store is shutting down".into() };
        }
        st = shared.wait(st);
    }
}

impl Pending {
    /// Refuses a join whose fields would not fit the store's answers.
    fn check(&self) -> Result<(), String> {
        if self.host.len() > MAX_HOST_LEN {
            return Err(format!("join: `host` has {} bytes, more than {MAX_HOST_LEN}", self.host.len()));
        }
        match &self.state {
            Some(s) if s.payload.len() > MAX_SYNC_PAYLOAD => {
                Err(format!("join: `state.payload` has {} bytes, more than {MAX_SYNC_PAYLOAD}", s.payload.len()))
            }
            _ => Ok(()),
        }
    }
}

impl State {
    fn finished(&self) -> bool {
        self.generation.is_some() && self.members.iter().all(|m| self.done.contains(m))
    }

    fn rank_of(&self, id: u64) -> Option<usize> {
        self.members.iter().position(|m| *m == id)
    }

    fn poll(&self, id: u64, generation: u64, cfg: &StoreConfig) -> Response {
        let current = self.generation.unwrap_or(0);
        if self.expelled.contains_key(&id) || self.generation != Some(generation) || self.over.is_some() {
            return Response::Over { current };
        }
        let joiners = self.pending.keys().filter(|p| self.rank_of(**p).is_none()).count();
        Response::Steady { waiting: joiners.min(cfg.workers.saturating_sub(self.members.len())) }
    }

    fn lost_connection(&mut self, id: u64) {
        self.alive.remove(&id);
        self.pending.remove(&id);
        self.formed.remove(&id);
        if let Some(rank) = self.rank_of(id)
            && !self.done.contains(&id)
            && self.over.is_none()
        {
            self.over = Some(Over { why: format!("rank {rank} lost its connection to the store"), since: None });
        }
    }

    /// Why the job cannot go on, when every member of its generation was lost: no one holds its
    /// training state, so joiners are refused rather than left waiting.
    fn orphaned(&self) -> Option<String> {
        let g = self.generation?;
        let holders = self.members.iter().any(|m| self.alive.contains_key(m) || self.done.contains(m));
        (!holders).then(|| {
            format!(
                "every worker of generation {g} was lost, and with them the training state: start the job again from its checkpoint (qsr train --resume)"
            )
        })
    }

    /// Forms the next generation when it is due; returns whether it did.
    fn form(&mut self, cfg: &StoreConfig) -> bool {
        let due = match (self.generation, &self.over) {
            (None, _) => self.pending.len() >= cfg.workers,
            (Some(_), None) => false,
            (Some(_), Some(over)) => {
                let missing = self
                    .members
                    .iter()
                    .any(|m| self.alive.contains_key(m) && !self.done.contains(m) && !self.pending.contains_key(m));
                !missing || over.since.is_some_and(|t| t.elapsed() >= cfg.settle)
            }
        };
        if !due {
            return false;
        }
        let survivors: Vec<u64> = self.members.iter().copied().filter(|m| self.pending.contains_key(m)).collect();
        // A later generation continues a survivor's state: joiners alone cannot form one.
        if self.generation.is_some() && survivors.is_empty() {
            return false;
        }
        let mut joiners: Vec<u64> = self.pending.keys().copied().filter(|p| !self.members.contains(p)).collect();
        joiners.sort_by_key(|id| (self.alive.get(id).copied().flatten().unwrap_or(u64::MAX), *id));
        joiners.truncate(cfg.workers.saturating_sub(survivors.len()));
        let next: Vec<u64> = survivors.into_iter().chain(joiners).collect();
        let min = if self.generation.is_none() { cfg.workers } else { cfg.min_workers };
        if next.len() < min {
            return false;
        }
        self.install(next, cfg);
        true
    }

    /// Makes `next` the new generation and leaves each worker its answer.
    fn install(&mut self, next: Vec<u64>, cfg: &StoreConfig) {
        let generation = self.generation.map_or(0, |g| g + 1);
        let lost: Vec<Lost> = self
            .members
            .iter()
            .enumerate()
            .filter(|(_, m)| !next.contains(m))
            .map(|(rank, m)| {
                let reason = if !self.alive.contains_key(m) {
                    "its process exited or its connection to the store closed".to_string()
                } else if self.done.contains(m) {
                    "it had finished".to_string()
                } else {
                    format!("it did not report within the settle time of {:?} (stopped or cut off)", cfg.settle)
                };
                Lost { rank, reason }
            })
            .collect();
        for m in self.members.iter().filter(|m| !next.contains(m)) {
            self.expelled.insert(*m, generation - 1);
        }
        let joined: Vec<usize> = (0..next.len()).filter(|&i| self.rank_of(next[i]).is_none()).collect();
        let pending: Vec<Pending> = next.iter().filter_map(|id| self.pending.remove(id)).collect();
        // The newest completed sync any member holds; ties go to the lowest rank.
        let source = (0..pending.len())
            .filter_map(|i| pending[i].state.as_ref().map(|s| (s.step, i)))
            .max_by_key(|&(step, i)| (step, std::cmp::Reverse(i)))
            .map(|(_, i)| i);
        let state = source.and_then(|i| pending[i].state.clone());
        let table: Vec<(String, u16)> = pending.iter().map(|p| (p.host.clone(), p.port)).collect();
        if generation > 0 {
            let why = self.over.as_ref().map_or("", |o| o.why.as_str());
            self.notice = Some(format!(
                "elastic store: generation {generation} formed with {} workers ({why}; lost {:?}, joined {:?})",
                next.len(),
                lost.iter().map(|l| l.rank).collect::<Vec<_>>(),
                joined
            ));
        }
        for (rank, id) in next.iter().enumerate() {
            let answer = Response::Formed {
                generation,
                rank,
                previous_rank: self.rank_of(*id),
                table: table.clone(),
                source,
                state: state.clone(),
                lost: lost.clone(),
                joined: joined.clone(),
            };
            self.formed.insert(*id, answer);
        }
        self.generation = Some(generation);
        self.members = next;
        self.over = None;
    }
}
