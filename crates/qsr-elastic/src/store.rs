//! The store: a TCP server that outlives any worker and settles each generation's membership.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::BufReader;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::Value;

use qsr_comm::{CommError, MAX_HOST_LEN, notice};
use subtle::ConstantTimeEq;

use crate::protocol::{KEEPALIVE, LastSync, Lost, MAX_SYNC_PAYLOAD, Request, Response, recv, send};

/// The most workers a store admits: the most ranks a TCP ring forms (issue 56 D12: `qsr rendezvous
/// --workers 100000000` was accepted).
pub const MAX_WORKERS: usize = 1 << 16;

/// How often threads look at the stop flag.
const TICK: Duration = Duration::from_millis(50);

/// Distinct settings kept while no generation has fixed the job's: workers that disagree wait
/// apart, and a client that is not one of the job's workers cannot make the others wrong.
const MAX_VARIANTS: usize = 16;

/// An I/O error of the store's own (binding, threads), as the collectives report theirs.
fn io_err(context: impl Into<String>, error: std::io::Error) -> CommError {
    CommError::Io { context: context.into(), error }
}

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
    /// The job token every worker must present ([`qsr_comm::TcpConfig::token`]).
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
    /// This job's id (random): it names the job in its run directory's lock.
    job: String,
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
    state: Option<LastSync>,
}

/// A worker connected to the store.
struct Conn {
    /// Its launcher's rank, which orders the first generation.
    order: Option<u64>,
    /// Its settings (shared among the workers that have the same).
    settings: Arc<Value>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    /// The job's settings: those of the workers that formed generation 0.
    settings: Option<Arc<Value>>,
    /// One copy of each distinct settings of workers that said hello before generation 0 formed.
    variants: Vec<Arc<Value>>,
    /// Open connections, by worker id.
    alive: HashMap<u64, Conn>,
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
    /// The launcher orders of workers expelled while still connected (stopped or cut off).
    expelled_orders: Vec<u64>,
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
        if cfg.workers > MAX_WORKERS {
            return Err(CommError::InvalidArgument(format!(
                "an elastic store admits at most {MAX_WORKERS} workers (a ring's most ranks), not {}",
                cfg.workers
            )));
        }
        if cfg.workers == 0 || cfg.min_workers == 0 || cfg.min_workers > cfg.workers {
            return Err(CommError::InvalidArgument(format!(
                "an elastic store needs 1 <= min_workers ({}) <= workers ({})",
                cfg.min_workers, cfg.workers
            )));
        }
        let listener = TcpListener::bind(addr).map_err(|e| io_err(format!("binding the store on {addr}"), e))?;
        let addr = listener.local_addr().map_err(|e| io_err("store address", e))?;
        listener.set_nonblocking(true).map_err(|e| io_err("store listener", e))?;
        let shared = Arc::new(Shared {
            cfg,
            job: qsr_comm::random_token(),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            connections: AtomicUsize::new(0),
        });
        let s = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("qsr-store".into())
            .spawn(move || accept_loop(&listener, &s))
            .map_err(|e| io_err("starting the store thread", e))?;
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

    /// This job's id: random, one per store; workers name their job by it in the run directory's lock.
    pub fn job_id(&self) -> &str {
        &self.shared.job
    }

    /// Why the job cannot go on, once every worker of its generation left without finishing (exited,
    /// lost or expelled): no one holds its training state, and only a resume from the checkpoint can
    /// continue it.
    pub fn orphaned(&self) -> Option<String> {
        self.shared.lock().orphaned()
    }

    /// What the store waits for, in words, while it waits for workers (the first generation to
    /// fill, members to report after a failure, new workers to reach `min_workers`); `None` while a
    /// generation runs or after the job finished.
    pub fn waiting_for(&self) -> Option<String> {
        let st = self.shared.lock();
        if st.finished() || (st.generation.is_some() && st.over.is_none()) {
            return None;
        }
        Some(st.status(None, &self.shared.cfg))
    }

    /// The launcher orders (`--rank`) of the workers expelled while still connected (stopped or cut
    /// off, not exited), lowest first: a launcher stops them.
    pub fn expelled_orders(&self) -> Vec<u64> {
        let st = self.shared.lock();
        let mut orders: Vec<u64> = st.expelled_orders.clone();
        orders.sort_unstable();
        orders.dedup();
        orders
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
                    let _ = send(&mut s, &refused(message));
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
        Err(refusal) => {
            let _ = send(&mut w, &refusal);
            return;
        }
    };
    let _ = send(&mut w, &Response::Welcome { id, job: shared.job.clone() });
    loop {
        let req = match recv::<Request>(&mut r) {
            Ok(Some(req)) => req,
            Ok(None) => break,
            Err(e) => {
                let _ = send(&mut w, &refused(format!("unreadable request: {e}")));
                break;
            }
        };
        let reply = match req {
            Request::Hello { .. } => refused("a second hello on one connection".into()),
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

/// Reads and checks the hello; returns the worker's id, or the refusal to send.
fn hello(r: &mut BufReader<TcpStream>, shared: &Shared) -> Result<u64, Box<Response>> {
    let _ = r.get_ref().set_read_timeout(Some(Duration::from_secs(10)));
    let req = recv::<Request>(r).map_err(|e| Box::new(refused(format!("unreadable hello: {e}"))))?;
    let _ = r.get_ref().set_read_timeout(None);
    let Some(Request::Hello { token, settings, order }) = req else {
        return Err(Box::new(refused("the first request must be a hello".into())));
    };
    if !bool::from(token.as_bytes().ct_eq(shared.cfg.token.as_bytes())) {
        return Err(Box::new(mismatch("job token differs (is this worker from another job?)".into())));
    }
    let mut st = shared.lock();
    let settings = match &st.settings {
        Some(job) if **job != settings => return Err(Box::new(mismatch(differ(job, &settings)))),
        Some(job) => Arc::clone(job),
        // No generation has fixed the job's settings yet: the first workers to fill one will.
        None => st.variant(settings).map_err(|m| Box::new(mismatch(m)))?,
    };
    let id = st.next_id;
    st.next_id += 1;
    st.alive.insert(id, Conn { order, settings });
    Ok(id)
}

/// A refusal for another reason than the worker's own token or settings.
fn refused(message: String) -> Response {
    Response::Refused { message, mismatch: false }
}

/// A refusal because the worker's own token or settings do not match the job's.
fn mismatch(message: String) -> Response {
    Response::Refused { message, mismatch: true }
}

/// The refusal of a worker whose settings differ from the job's, naming the keys.
fn differ(job: &Value, mine: &Value) -> String {
    let diffs: Vec<String> = qsr_comm::differing_keys(job, mine)
        .into_iter()
        .map(|d| format!("`{}` (job: {}, this worker: {})", d.key, d.left, d.right))
        .collect();
    format!("this worker's settings differ from the job's in {}", diffs.join(", "))
}

/// A join: waits until a generation forms with this worker, or says it was expelled.
fn join(shared: &Shared, id: u64, seen: Option<u64>, pending: Pending, reason: String, w: &mut TcpStream) -> Response {
    if let Err(message) = pending.check() {
        return refused(message);
    }
    let mut st = shared.lock();
    if let Some(g) = seen {
        let current = st.generation.unwrap_or(0);
        if st.expelled.contains_key(&id) || st.generation != Some(g) {
            return Response::Expelled { generation: g, current };
        }
        let Some(rank) = st.rank_of(id) else {
            return refused(format!("worker {id} names generation {g} but is not a member of it"));
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
            return refused("the job has finished".into());
        }
        if let Some(job) = st.settings.as_ref().filter(|job| !Arc::ptr_eq(job, &st.alive[&id].settings)) {
            let message = format!("{} (the first generation formed without it)", differ(job, &st.alive[&id].settings));
            st.pending.remove(&id);
            return mismatch(message);
        }
        if let Some(message) = st.orphaned() {
            st.pending.remove(&id);
            return refused(message);
        }
        if beat.elapsed() >= KEEPALIVE {
            let (generation, status) = (st.generation, st.status(Some(id), &shared.cfg));
            let for_workers = st.waits_for_workers();
            drop(st);
            if send(w, &Response::Waiting { generation, status, for_workers }).is_err() {
                return refused("connection lost".into());
            }
            beat = Instant::now();
            st = shared.lock();
            continue;
        }
        if shared.stop.load(Ordering::Relaxed) {
            return refused("the store is shutting down".into());
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
    /// The job finished: every member of the generation is done or gone, and one at least is done
    /// (a member lost after the last sync does not hold the others' finished job open).
    fn finished(&self) -> bool {
        let gone_or_done = |m: &u64| self.done.contains(m) || !self.alive.contains_key(m);
        self.generation.is_some()
            && self.members.iter().all(gone_or_done)
            && self.members.iter().any(|m| self.done.contains(m))
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

    /// One shared copy of `settings` (workers with equal settings share it); refused when more
    /// than [`MAX_VARIANTS`] distinct settings are connected.
    fn variant(&mut self, settings: Value) -> Result<Arc<Value>, String> {
        self.variants.retain(|v| Arc::strong_count(v) > 1);
        if let Some(v) = self.variants.iter().find(|v| ***v == settings) {
            return Ok(Arc::clone(v));
        }
        if self.variants.len() >= MAX_VARIANTS {
            return Err(format!(
                "{MAX_VARIANTS} workers with different settings are already waiting for the first generation: are they from different jobs?"
            ));
        }
        let v = Arc::new(settings);
        self.variants.push(Arc::clone(&v));
        Ok(v)
    }

    /// Waiting joins by settings, in the order their settings first came: the groups that could form
    /// the first generation.
    fn groups(&self) -> Vec<(Arc<Value>, Vec<u64>)> {
        let mut groups: Vec<(Arc<Value>, Vec<u64>)> = Vec::new();
        for id in self.pending.keys() {
            let s = &self.alive[id].settings;
            match groups.iter_mut().find(|(g, _)| Arc::ptr_eq(g, s)) {
                Some((_, ids)) => ids.push(*id),
                None => groups.push((Arc::clone(s), vec![*id])),
            }
        }
        groups
    }

    /// The first generation: the first `workers` of the first group of equal settings to fill it,
    /// in launcher order; their settings become the job's.
    fn form_first(&mut self, cfg: &StoreConfig) -> bool {
        let Some((settings, mut ids)) = self.groups().into_iter().find(|(_, ids)| ids.len() >= cfg.workers) else {
            return false;
        };
        ids.sort_by_key(|id| (self.alive[id].order.unwrap_or(u64::MAX), *id));
        ids.truncate(cfg.workers);
        self.settings = Some(settings);
        self.variants.clear();
        self.install(ids, cfg);
        true
    }

    /// Whether the next generation waits for workers that have not joined: the first generation's,
    /// or new ones to reach `min_workers` once every surviving member has reported.
    fn waits_for_workers(&self) -> bool {
        match (self.generation, &self.over) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(_), Some(_)) => self.missing_members().is_empty(),
        }
    }

    /// The ranks of the current generation that are connected, not done and have not reported.
    fn missing_members(&self) -> Vec<usize> {
        (0..self.members.len())
            .filter(|&r| {
                let m = self.members[r];
                self.alive.contains_key(&m) && !self.done.contains(&m) && !self.pending.contains_key(&m)
            })
            .collect()
    }

    /// What a waiting join (of worker `id`, or the store itself with `None`) waits for, in words.
    fn status(&self, id: Option<u64>, cfg: &StoreConfig) -> String {
        let Some(g) = self.generation else {
            return self.first_status(id, cfg);
        };
        let Some(over) = &self.over else {
            return format!(
                "generation {g} runs with {} workers; new workers are admitted at one of its synchronizations",
                self.members.len()
            );
        };
        let missing = self.missing_members();
        let reported = self.members.iter().filter(|m| self.pending.contains_key(m)).count();
        if missing.is_empty() {
            let ready = reported + self.pending.keys().filter(|p| !self.members.contains(p)).count();
            return format!(
                "generation {g} is over ({}); the next needs at least {} workers and {ready} are ready: waiting for new workers",
                over.why, cfg.min_workers
            );
        }
        let left = over.since.map_or(cfg.settle, |t| cfg.settle.saturating_sub(t.elapsed()));
        format!(
            "generation {g} is over ({}); {reported} of {} members reported, waiting for rank(s) {missing:?}, expelled in {:.0} s",
            over.why,
            self.members.len(),
            left.as_secs_f64().ceil()
        )
    }

    /// [`Self::status`] before the first generation formed: how many of its workers have joined.
    fn first_status(&self, id: Option<u64>, cfg: &StoreConfig) -> String {
        let groups = self.groups();
        // The worker's own group; for the store's lines, the largest.
        let mine = match id.and_then(|id| self.alive.get(&id)) {
            Some(c) => groups.iter().position(|(g, _)| Arc::ptr_eq(g, &c.settings)),
            None => (0..groups.len()).max_by_key(|&i| (groups[i].1.len(), std::cmp::Reverse(i))),
        };
        let joined = mine.map_or(0, |i| groups[i].1.len());
        let mut text = format!("{joined} of {} workers have joined the first generation", cfg.workers);
        let other = |i: &usize| Some(*i) != mine;
        let others: usize = (0..groups.len()).filter(other).map(|i| groups[i].1.len()).sum();
        if let (Some(i), Some(j)) = (mine, (0..groups.len()).find(other)) {
            let keys: Vec<String> = qsr_comm::differing_keys(&groups[i].0, &groups[j].0)
                .into_iter()
                .take(3)
                .map(|d| format!("`{}`", d.key))
                .collect();
            text.push_str(&format!(
                "; {others} more joined with other settings (differing in {}) and do not count",
                keys.join(", ")
            ));
        }
        text
    }

    /// Forms the next generation when it is due; returns whether it did.
    fn form(&mut self, cfg: &StoreConfig) -> bool {
        let due = match (self.generation, &self.over) {
            (None, _) => return self.form_first(cfg),
            (Some(_), None) => false,
            (Some(_), Some(over)) => {
                self.missing_members().is_empty() || over.since.is_some_and(|t| t.elapsed() >= cfg.settle)
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
        joiners.sort_by_key(|id| (self.alive.get(id).and_then(|c| c.order).unwrap_or(u64::MAX), *id));
        joiners.truncate(cfg.workers.saturating_sub(survivors.len()));
        let next: Vec<u64> = survivors.into_iter().chain(joiners).collect();
        if next.len() < cfg.min_workers {
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
            if let Some(order) = self.alive.get(m).and_then(|c| c.order) {
                self.expelled_orders.push(order);
            }
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
