//! Supervising a launch's worker processes: `qsr launch`'s ranks of any program, and the trainer's
//! `--nproc` workers.
//!
//! Ownership: the launcher owns its workers. A worker asks the kernel for SIGKILL when the launcher
//! dies (`PR_SET_PDEATHSIG`) and checks, after asking, that the launcher is still its parent, so no
//! worker outlives a launcher killed even with SIGKILL. SIGINT, SIGTERM and SIGHUP sent to the launcher
//! are forwarded to every worker, which are then reaped. When a worker fails, the launcher stops the
//! others and names the rank that failed first by its cause: a worker that only saw another rank fail
//! exits with [`EXIT_PEER_FAILED`] and is not blamed while a rank with its own cause exists.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rustix::process::{Pid, Signal, WaitId, WaitIdOptions};

use qsr_comm::EXIT_PEER_FAILED;

use crate::error::{Interrupted, WorkersFailed, signal_name};
use crate::relay::Relay;

/// Environment variable through which a worker learns its launcher's pid.
const LAUNCHER_PID: &str = "QSR_LAUNCHER_PID";

/// How long workers get to exit after a forwarded signal before they are killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// How long the launcher keeps collecting failures after the first one, to find the rank that failed
/// first rather than the first one it happened to poll.
const FAILURE_WINDOW: Duration = Duration::from_millis(500);

const POLL: Duration = Duration::from_millis(50);

/// How long the launcher waits for a rank of its own that the failed ranks blame, when none of them
/// failed for a cause of its own (a culprit that fails after its casualties, D11).
const CULPRIT_WINDOW: Duration = Duration::from_secs(10);

/// How long a launcher waits for its ranks' last output lines once they have exited.
const RELAY_DRAIN: Duration = Duration::from_secs(2);

/// In a worker: die with the launcher (SIGKILL on its death), and refuse to start if it is already gone.
pub fn die_with_launcher() -> Result<()> {
    let Some(launcher) = std::env::var(LAUNCHER_PID).ok().and_then(|p| p.parse::<i32>().ok()) else {
        bail!("this is for the processes `qsr train --nproc` and `qsr launch` start ({LAUNCHER_PID} is not set)");
    };
    rustix::process::set_parent_process_death_signal(Some(Signal::KILL))
        .context("cannot ask for a parent-death signal")?;
    // The launcher may have died before the request above: then our parent is already someone else.
    if Pid::as_raw(rustix::process::getppid()) != launcher {
        bail!("the launcher (pid {launcher}) is gone; this worker stops");
    }
    Ok(())
}

/// What a launch of the trainer's workers ([`run_workers`]) knows beside their commands.
#[derive(Clone, Copy)]
pub struct Job<'a> {
    /// An elastic job's store: a failed worker does not stop the others, and the job succeeds when
    /// the store says every worker of its last generation finished.
    pub store: Option<&'a qsr_elastic::Store>,
    /// Where rank 0 writes the rendezvous port it bound; the other ranks start once it did.
    pub port_file: Option<&'a Path>,
    /// Exit statuses that are a finished elastic job's outcome rather than a lost worker (a run
    /// that diverged, say), with what they say.
    pub outcomes: &'a [(u8, &'static str)],
}

/// Starts `n` workers of one job (`command(rank, port)`, in the launcher's process group), waits for
/// them: signals are forwarded, the first failure stops the rest and is named (see [`Job`]). `port`
/// is `None` for rank 0, whose port the others get through [`Job::port_file`], and in elastic jobs.
pub fn run_workers(n: usize, command: impl Fn(usize, Option<u16>) -> Result<Command>, job: Job<'_>) -> Result<()> {
    let signal = Arc::new(AtomicUsize::new(0));
    let ids = register_signals(&signal)?;
    let result = supervise(0..n, &command, &signal, job, (Groups::Shared, None));
    for id in ids {
        signal_hook::low_level::unregister(id);
    }
    result
}

/// Starts the ranks `ranks` of a program that is not qsr's (`command(rank)`; all of a job's ranks, or
/// one node's of a job over several), each in a process group of its own, so that stopping a rank
/// stops whatever it started too; waits for them like [`run_workers`]: the first failure stops the
/// rest and is named, signals are forwarded. Their output goes through `relay`.
pub(crate) fn launch_program(
    ranks: Range<usize>,
    command: impl Fn(usize) -> Result<Command>,
    relay: &Relay,
) -> Result<()> {
    let signal = Arc::new(AtomicUsize::new(0));
    let ids = register_signals(&signal)?;
    crate::adopted::become_subreaper()?;
    let job = Job { store: None, port_file: None, outcomes: &[] };
    let result = supervise(ranks, &|rank, _| command(rank), &signal, job, (Groups::Own, Some(relay)));
    for id in ids {
        signal_hook::low_level::unregister(id);
    }
    // The ranks' last lines before the launcher's verdict.
    relay.drain(RELAY_DRAIN);
    result
}

/// Whether each worker leads a session and process group of its own (a foreign program through
/// `qsr exec-rank`, whose own children must stop with it, and which no terminal may stop for reading or
/// setting it) or stays in the launcher's (qsr's workers, which start no processes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Groups {
    Shared,
    Own,
}

/// Records the number of the last of SIGINT, SIGTERM, SIGHUP received, instead of dying of it.
fn register_signals(signal: &Arc<AtomicUsize>) -> Result<Vec<signal_hook::SigId>> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    [SIGINT, SIGTERM, SIGHUP]
        .into_iter()
        .map(|s| {
            signal_hook::flag::register_usize(s, Arc::clone(signal), s as usize)
                .context("cannot install signal handlers")
        })
        .collect()
}

/// A worker process and its rank.
struct Spawned {
    rank: usize,
    child: Child,
    groups: Groups,
    /// Where it leaves its failure record.
    record: PathBuf,
    /// Its status once reaped: from then on its pid, and its group's number, may be another process's.
    reaped: Option<ExitStatus>,
}

/// A directory of the launcher's own where its ranks leave their failure records
/// ([`qsr_comm::FAILURE_FILE`]), removed with it.
struct Records {
    dir: PathBuf,
}

impl Records {
    fn new() -> Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!("qsr-launch-{}-{nanos}", std::process::id()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("cannot create {} for the ranks' failure records", dir.display()))?;
        Ok(Self { dir })
    }

    fn file(&self, rank: usize) -> PathBuf {
        self.dir.join(format!("failure-rank{rank}.json"))
    }
}

impl Drop for Records {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The failure record a worker left at `path`, if it left one.
fn record(path: &Path) -> Option<qsr_comm::FailureRecord> {
    let bytes = qsr_files::read(path, 1 << 20, "failure record").ok()?;
    serde_json::from_slice(&bytes).ok()
}

impl Spawned {
    /// Sends `sig` to the worker, and with [`Groups::Own`] to every process of its group; nothing
    /// once it was reaped (whether it sent).
    fn signal(&self, sig: Signal) -> bool {
        if self.reaped.is_some() {
            return false;
        }
        let pid = Pid::from_child(&self.child);
        let _ = match self.groups {
            Groups::Own => rustix::process::kill_process_group(pid, sig),
            Groups::Shared => rustix::process::kill_process(pid, sig),
        };
        true
    }

    /// Reaps the worker if it exited: its status then (and after). What is left of its own group
    /// (what it started) gets SIGKILL first, while the worker is a zombie and the group's number
    /// still its own: once reaped, the number may be a new process's, which made it its group's
    /// (a rank of another launch took a SIGINT meant for this one's).
    fn try_reap(&mut self) -> std::io::Result<Option<ExitStatus>> {
        if self.reaped.is_some() {
            return Ok(self.reaped);
        }
        let pid = Pid::from_child(&self.child);
        let peek = WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT;
        if matches!(rustix::process::waitid(WaitId::Pid(pid), peek), Ok(None)) {
            return Ok(None);
        }
        if self.groups == Groups::Own {
            let _ = rustix::process::kill_process_group(pid, Signal::KILL);
        }
        self.reaped = self.child.try_wait()?;
        Ok(self.reaped)
    }
}

/// A worker that ended unsuccessfully, or stopped answering.
struct Failure {
    rank: usize,
    /// Its exit status; `None`: it was found stopped (SIGSTOP, a debugger) while the others failed.
    status: Option<ExitStatus>,
    seen: Instant,
    /// The rank its error blames, from its failure record.
    blames: Option<usize>,
    /// Its failure record says it stopped only because another rank failed, whatever its exit
    /// status (a `main` that returns its error exits 1).
    lost_peer: bool,
}

impl Failure {
    /// Whether the worker, which exited with `code`, stopped only because another rank failed: its
    /// status says so, or its failure record does.
    fn lost_a_peer(&self, code: i32) -> bool {
        code == i32::from(EXIT_PEER_FAILED) || self.lost_peer
    }

    /// Lower is more likely the first cause: killed by a signal or stopped, then a failure of its
    /// own, then a worker that only saw another rank fail. (Workers the launcher stops are reaped by
    /// `stop` and are never failures.)
    fn precedence(&self) -> u8 {
        use std::os::unix::process::ExitStatusExt;
        let Some(status) = self.status else {
            return 0;
        };
        match (status.signal(), status.code()) {
            (Some(_), _) => 0,
            (_, Some(c)) if self.lost_a_peer(c) => 2,
            _ => 1,
        }
    }

    /// The launcher's exit status when this failure is the job's: the worker's own (bad input,
    /// divergence, ...), or [`EXIT_PEER_FAILED`] for a worker lost to a signal or a stop (the job
    /// failed for a lost peer).
    fn launcher_status(&self) -> u8 {
        match self.status.and_then(|s| s.code()) {
            Some(c) if (1..=255).contains(&c) => c as u8,
            _ => EXIT_PEER_FAILED,
        }
    }

    /// What happened to the worker. `others_failed`: whether another rank failed with a cause of
    /// its own, which an exit with [`EXIT_PEER_FAILED`] (lost a peer) then refers to; `ranks`: this
    /// launcher's, to say whether the peer it lost runs on another node.
    fn describe(&self, others_failed: bool, ranks: &Range<usize>) -> String {
        use std::os::unix::process::ExitStatusExt;
        let Some(status) = self.status else {
            return format!(
                "rank {} was stopped (SIGSTOP or a debugger) and made no progress; the others gave up waiting for it",
                self.rank
            );
        };
        match (status.signal(), status.code()) {
            (Some(s), _) => format!("rank {} was killed by signal {s} ({})", self.rank, signal_name(s)),
            (_, Some(c)) if self.lost_a_peer(c) && others_failed => {
                format!("rank {} stopped after losing a peer (exit status {c}; its error is printed above)", self.rank)
            }
            (_, Some(c)) if self.lost_a_peer(c) => match self.blames {
                Some(b) if !ranks.contains(&b) => format!(
                    "rank {} stopped after losing rank {b}, which runs on another node: that node's launcher says why rank {b} failed (exit status {c}; the error is printed above)",
                    self.rank
                ),
                Some(b) => format!(
                    "rank {} stopped after losing rank {b}, which was still running {} s later and was stopped (exit status {c}; the error is printed above)",
                    self.rank,
                    CULPRIT_WINDOW.as_secs()
                ),
                None => format!(
                    "rank {} exited with status {c}, which says it lost a peer, but no other rank failed (its error is printed above)",
                    self.rank
                ),
            },
            (_, code) => {
                format!("rank {} failed (exit status {}; its error is printed above)", self.rank, code.unwrap_or(-1))
            }
        }
    }
}

fn supervise(
    ranks: Range<usize>,
    command: &impl Fn(usize, Option<u16>) -> Result<Command>,
    signal: &AtomicUsize,
    job: Job<'_>,
    (groups, relay): (Groups, Option<&Relay>),
) -> Result<()> {
    let records = Records::new()?;
    let workers = start(ranks.clone(), command, signal, job.port_file, (groups, relay, &records))?;
    let result = watch(ranks, workers, signal, job);
    if result.is_err() && groups == Groups::Own {
        crate::adopted::stop_adopted();
    }
    result
}

/// Waits for the started workers (see [`supervise`]).
fn watch(ranks: Range<usize>, mut workers: Vec<Spawned>, signal: &AtomicUsize, job: Job<'_>) -> Result<()> {
    let store = job.store;
    let n = ranks.len();
    let mut failures: Vec<Failure> = Vec::new();
    let mut finished_at: Option<Instant> = None;
    let mut tail = Tail::default();
    while !workers.is_empty() {
        workers = reap(workers, &mut failures)?;
        if store.is_none() {
            tail.tell(ranks.clone(), &workers);
        }
        if let Some(s) = store.filter(|s| s.finished()) {
            // Members exit on their own once the job finished; expelled ones (stopped, cut off) never will.
            let since = *finished_at.get_or_insert_with(|| {
                stop_expelled(&mut workers, &s.expelled_orders(), &mut failures);
                Instant::now()
            });
            if since.elapsed() >= STOP_GRACE {
                break;
            }
        }
        if let Some(sig) = received(signal) {
            let stopped = workers.len();
            // qsr's own workers checkpoint; another program's ranks may not.
            let resumable = workers.iter().all(|w| w.groups == Groups::Shared);
            stop(&mut workers, sig);
            let (signal, name) = (sig.as_raw(), signal_name(sig.as_raw()));
            return Err(Interrupted { signal, name, stopped, resumable }.into());
        }
        // Elastic jobs go on without a failed worker once they run; before, the others would wait for it.
        // ... unless nobody holds the training state any more (orphaned).
        let fatal = store.is_none_or(|s| s.generation().is_none() || s.orphaned().is_some());
        if fatal && failures.first().is_some_and(|f| f.seen.elapsed() >= window(&failures, &workers)) {
            // A stopped worker is the cause the others saw: they timed out waiting for it.
            for w in workers.iter().filter(|w| is_stopped(&w.child)) {
                failures.push(Failure {
                    rank: w.rank,
                    status: None,
                    seen: failures[0].seen,
                    blames: None,
                    lost_peer: false,
                });
            }
            break;
        }
        std::thread::sleep(POLL);
    }
    stop(&mut workers, Signal::TERM);
    workers = reap(workers, &mut failures)?;
    debug_assert!(workers.is_empty());
    if store.is_some_and(qsr_elastic::Store::finished) {
        // Workers that (say) diverged finished the plan: the job's outcome is theirs.
        let outcome = |f: &Failure| {
            let code = f.status.and_then(|s| s.code())?;
            job.outcomes.iter().find(|(status, _)| i32::from(*status) == code).copied()
        };
        if let Some((f, (status, what))) = failures.iter().find_map(|f| outcome(f).map(|o| (f, o))) {
            let message = format!("rank {} {what} (its error is printed above)", f.rank);
            return Err(WorkersFailed { status, message }.into());
        }
        for f in &failures {
            eprintln!("qsr: {}; the elastic job went on without it", f.describe(true, &ranks));
        }
        return Ok(());
    }
    if let Some(first) = failures.iter().min_by_key(|f| (f.precedence(), f.seen)) {
        let own = failures.iter().filter(|f| f.precedence() < 2).count();
        let lost = failures.len() - own;
        let tally = match (own, lost) {
            (_, 0) => format!("{own} of {n} workers failed"),
            (0, _) => format!("{lost} of {n} workers stopped after losing a peer"),
            _ => format!("{own} of {n} workers failed, {lost} stopped because of it"),
        };
        let message = format!("{} ({tally})", first.describe(own > 0, &ranks));
        return Err(WorkersFailed { status: first.launcher_status(), message }.into());
    }
    Ok(())
}

/// How long after the first failure the launcher stops the rest: longer while every failed rank only
/// lost a peer and one of them blames a rank of this launcher that still runs (the culprit may fail
/// late, and is then the cause to name).
fn window(failures: &[Failure], running: &[Spawned]) -> Duration {
    let blamed_here = |f: &Failure| f.blames.is_some_and(|b| running.iter().any(|w| w.rank == b));
    let only_lost = failures.iter().all(|f| f.precedence() == 2);
    if only_lost && failures.iter().any(blamed_here) { CULPRIT_WINDOW } else { FAILURE_WINDOW }
}

/// Says which ranks still run once others have finished: 5 s after the first finished, then every
/// minute (N11: the launcher waited on silently).
#[derive(Default)]
struct Tail {
    /// When the first rank finished, and when the next line is due.
    since: Option<(Instant, Instant)>,
}

impl Tail {
    fn tell(&mut self, ranks: Range<usize>, running: &[Spawned]) {
        if running.len() == ranks.len() {
            return;
        }
        let now = Instant::now();
        let (first, due) = self.since.get_or_insert((now, now + Duration::from_secs(5)));
        if now < *due {
            return;
        }
        *due = now + Duration::from_secs(60);
        let left: Vec<usize> = running.iter().map(|w| w.rank).collect();
        let done: Vec<usize> = ranks.filter(|r| !left.contains(r)).collect();
        eprintln!(
            "qsr: rank(s) {done:?} finished {} s ago; waiting for rank(s) {left:?}, still running",
            first.elapsed().as_secs()
        );
    }
}

/// Starts the workers of `ranks`: the first first, and with a `port_file` the others only once rank 0 wrote the
/// port it bound. When rank 0 fails first or a signal comes, only rank 0 runs; the supervisor reports it.
fn start(
    ranks: Range<usize>,
    command: &impl Fn(usize, Option<u16>) -> Result<Command>,
    signal: &AtomicUsize,
    port_file: Option<&Path>,
    (groups, relay, records): (Groups, Option<&Relay>, &Records),
) -> Result<Vec<Spawned>> {
    let mut workers: Vec<Spawned> = Vec::new();
    let mut port = None;
    if let Some(path) = port_file {
        clear_stale_port(path)?;
    }
    for rank in ranks {
        // Rank 0 chose the port (a `--nproc` launch, whose ranks start at 0).
        if rank == 1
            && let Some(path) = port_file
        {
            let timeout = qsr_comm::TcpConfig::from_env(&|k| std::env::var(k).ok())?.rendezvous_timeout;
            match rank_zero_port(&mut workers[0], path, signal, timeout) {
                Ok(Some(p)) => port = Some(p),
                Ok(None) => break,
                Err(e) => {
                    stop(&mut workers, Signal::TERM);
                    return Err(e);
                }
            }
        }
        if let Err(e) = spawn(&mut workers, rank, command(rank, port), (groups, relay, records)) {
            stop(&mut workers, Signal::TERM);
            return Err(e);
        }
    }
    Ok(workers)
}

/// Starts worker `rank` from its command line.
fn spawn(
    workers: &mut Vec<Spawned>,
    rank: usize,
    command: Result<Command>,
    (groups, relay, records): (Groups, Option<&Relay>, &Records),
) -> Result<()> {
    let mut c = command?;
    let record = records.file(rank);
    c.env(LAUNCHER_PID, std::process::id().to_string()).env(qsr_comm::FAILURE_FILE, &record);
    if groups == Groups::Own {
        // Until `qsr exec-rank` makes it a session (and group) of its own, it is in ours.
        c.stdin(std::process::Stdio::null());
    }
    if let Some(r) = relay {
        r.prepare(&mut c);
    }
    let mut child = c.spawn().with_context(|| format!("cannot start worker process {rank}"))?;
    let attached = relay.map_or(Ok(()), |r| r.attach(rank, &mut child));
    workers.push(Spawned { rank, child, groups, record, reaped: None });
    attached
}

/// Waits for rank 0 to write the port it bound for the rendezvous to `path`, and removes the file.
/// `None` when rank 0 failed first or a signal came (the caller reports either); an error when rank 0
/// ended without a port or did not write one within `timeout`.
fn rank_zero_port(rank0: &mut Spawned, path: &Path, signal: &AtomicUsize, timeout: Duration) -> Result<Option<u16>> {
    let start = Instant::now();
    loop {
        if std::fs::symlink_metadata(path).is_ok() {
            // Bounded and regular only: a FIFO or a link to a device in its place must not hang us.
            let text = qsr_files::read_text(path, PORT_FILE_BYTES, "rendezvous port file");
            let _ = std::fs::remove_file(path);
            let text = text.with_context(|| format!("cannot read rank 0's rendezvous port from {}", path.display()))?;
            let port = text.trim().parse::<u16>().ok().filter(|p| *p != 0);
            return port
                .map(Some)
                .with_context(|| format!("rank 0 wrote {text:?} to {}, not its rendezvous port", path.display()));
        }
        match rank0.try_reap().context("cannot wait for worker 0")? {
            Some(status) if status.success() => bail!("worker 0 exited before it bound its rendezvous port"),
            Some(_) => return Ok(None),
            None => {}
        }
        if received(signal).is_some() {
            return Ok(None);
        }
        if start.elapsed() >= timeout {
            bail!(
                "worker 0 did not bind its rendezvous port within {} s (QSR_RENDEZVOUS_TIMEOUT_SECS)",
                timeout.as_secs()
            );
        }
        std::thread::sleep(POLL);
    }
}

/// The most bytes a rendezvous port file holds (a port number).
const PORT_FILE_BYTES: u64 = 16;

/// Removes what a launcher that was killed before reading it left at `path` (D3: later launches read
/// its dead port and waited the whole rendezvous timeout), a link or a FIFO in its place too: removing
/// never follows a link or opens a FIFO. The run directory's lock keeps other launchers out.
fn clear_stale_port(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("cannot check {}", path.display())),
        Ok(m) if m.is_dir() => {
            bail!(
                "{} is a directory, where the launcher takes the rendezvous port from rank 0; remove it",
                path.display()
            )
        }
        Ok(_) => std::fs::remove_file(path).with_context(|| format!("cannot remove the stale {}", path.display())),
    }
}

/// The signal the launcher received, if any.
fn received(signal: &AtomicUsize) -> Option<Signal> {
    match signal.load(Ordering::Relaxed) {
        0 => None,
        s => Some(Signal::from_named_raw(s as i32).unwrap_or(Signal::TERM)),
    }
}

/// Waits without blocking: returns the workers still running, recording the ones that failed (once
/// each: a worker already recorded as stopped is not recorded again when it is killed).
fn reap(workers: Vec<Spawned>, failures: &mut Vec<Failure>) -> Result<Vec<Spawned>> {
    let mut running = Vec::new();
    for mut w in workers {
        // What it started goes with it (`try_reap`).
        let exited = w.try_reap().with_context(|| format!("cannot wait for worker {}", w.rank))?;
        match exited {
            Some(_) if failures.iter().any(|f| f.rank == w.rank) => {}
            Some(status) if !status.success() => {
                let record = record(&w.record);
                let blames = record.as_ref().and_then(|r| r.blames);
                let lost_peer = record.is_some_and(|r| r.peer_failed);
                failures.push(Failure { rank: w.rank, status: Some(status), seen: Instant::now(), blames, lost_peer });
            }
            Some(_) => {}
            None => running.push(w),
        }
    }
    Ok(running)
}

/// Sends `sig` to every running worker (SIGKILL to stopped ones, which could not act on it), waits
/// up to [`STOP_GRACE`] saying for which ranks, then kills and reaps the rest.
fn stop(workers: &mut Vec<Spawned>, sig: Signal) {
    for w in workers.iter() {
        w.signal(if w.reaped.is_none() && is_stopped(&w.child) { Signal::KILL } else { sig });
    }
    let deadline = Instant::now() + STOP_GRACE;
    let mut said = false;
    loop {
        let left: Vec<usize> =
            workers.iter_mut().filter_map(|w| matches!(w.try_reap(), Ok(None)).then_some(w.rank)).collect();
        if left.is_empty() || Instant::now() >= deadline {
            break;
        }
        if !said && deadline - Instant::now() < STOP_GRACE - Duration::from_secs(1) {
            eprintln!("qsr: waiting up to {} s for rank(s) {left:?} to exit before killing them", STOP_GRACE.as_secs());
            said = true;
        }
        std::thread::sleep(POLL);
    }
    for w in workers.iter_mut() {
        if matches!(w.try_reap(), Ok(None)) {
            // The group first, while the worker's number is still its own; then reap it.
            w.signal(Signal::KILL);
            let _ = w.child.kill();
            w.reaped = w.child.wait().ok();
        }
    }
    workers.clear();
}

/// After an elastic job finished: SIGKILL for the workers the store expelled that still run (stopped
/// or cut off, they would never exit), each named, and recorded as failures.
/// The workers must have been reaped just before, so that those that exited keep their status.
fn stop_expelled(workers: &mut Vec<Spawned>, expelled: &[u64], failures: &mut Vec<Failure>) {
    let doomed = |w: &Spawned| expelled.contains(&(w.rank as u64)) || is_stopped(&w.child);
    for w in workers.iter_mut().filter(|w| doomed(w)) {
        let state = if is_stopped(&w.child) { "stopped" } else { "still running" };
        eprintln!(
            "qsr: rank {} (pid {}) was expelled from the elastic job and is {state}: killing it",
            w.rank,
            w.child.id()
        );
        let _ = w.child.kill();
        if let Ok(status) = w.child.wait() {
            failures.push(Failure {
                rank: w.rank,
                status: Some(status),
                seen: Instant::now(),
                blames: None,
                lost_peer: false,
            });
        }
    }
    let killed: Vec<usize> = failures.iter().map(|f| f.rank).collect();
    workers.retain(|w| !killed.contains(&w.rank));
}

/// Whether a child is stopped (by SIGSTOP, or traced): `T` or `t` in `/proc/<pid>/stat`.
fn is_stopped(child: &Child) -> bool {
    qsr_files::read_text(Path::new(&format!("/proc/{}/stat", child.id())), 4096, "process status")
        .ok()
        .and_then(|st| st.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()))
        .is_some_and(|state| matches!(state, 'T' | 't'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PORT_FILE: &str = ".rendezvous-port";

    /// A stand-in for rank 0: a shell running `script` with `$1` the port file.
    fn rank0(script: &str, file: &Path) -> Spawned {
        let child = Command::new("sh").args(["-c", script, "sh"]).arg(file).spawn().unwrap();
        Spawned { rank: 0, child, groups: Groups::Shared, record: PathBuf::new(), reaped: None }
    }

    fn wait(script: &str, timeout: Duration) -> (Result<Option<u16>>, bool) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(PORT_FILE);
        let mut rank0 = rank0(script, &file);
        let port = rank_zero_port(&mut rank0, &file, &AtomicUsize::new(0), timeout);
        let _ = rank0.child.kill();
        let _ = rank0.child.wait();
        (port, file.exists())
    }

    /// Regression (CI, 2026-12-06): the launcher signalled the group of a worker it had reaped
    /// long before; by then the number may be a new process's that leads its own group, and a
    /// `qsr train --nproc` rank of another launch took a SIGINT meant for this one's ranks. A reaped
    /// worker gets no signal; its status stays.
    #[test]
    fn a_reaped_worker_is_never_signalled() {
        use std::os::unix::process::CommandExt;
        let child = Command::new("true").process_group(0).spawn().unwrap();
        let mut w = Spawned { rank: 0, child, groups: Groups::Own, record: PathBuf::new(), reaped: None };
        let deadline = Instant::now() + Duration::from_secs(30);
        while w.try_reap().unwrap().is_none() {
            assert!(Instant::now() < deadline, "`true` did not exit");
            std::thread::sleep(POLL);
        }
        assert!(!w.signal(Signal::TERM), "signalled the number of a reaped worker");
        assert!(w.try_reap().unwrap().is_some_and(|s| s.success()), "its status stays");
    }

    /// The launcher never picks a port itself (it used to bind one, release it and hope rank 0 got
    /// it first): it reads the port rank 0 bound, and removes the file.
    #[test]
    fn the_launcher_takes_the_rendezvous_port_rank_zero_bound() {
        let (port, left) = wait(r#"printf 4242 > "$1.tmp" && mv "$1.tmp" "$1"; sleep 5"#, Duration::from_secs(5));
        assert_eq!(port.unwrap(), Some(4242));
        assert!(!left, "the port file is removed once read");
    }

    /// D3: a port file left by a launcher killed before reading it (or a link to /dev/zero, or a FIFO,
    /// in its place) is removed before rank 0 starts, so the launch takes the port rank 0 binds now.
    #[test]
    fn a_stale_rendezvous_port_file_is_cleared_before_rank_zero_starts() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(PORT_FILE);
        for stale in ["file", "link", "fifo"] {
            match stale {
                "file" => std::fs::write(&file, "36189").unwrap(),
                "link" => std::os::unix::fs::symlink("/dev/zero", &file).unwrap(),
                _ => assert!(Command::new("mkfifo").arg(&file).status().unwrap().success()),
            }
            clear_stale_port(&file).unwrap();
            assert!(std::fs::symlink_metadata(&file).is_err(), "{stale} left in place");
        }
        std::fs::create_dir(&file).unwrap();
        let err = clear_stale_port(&file).unwrap_err().to_string();
        assert!(err.contains("is a directory"), "{err}");
    }

    /// D3: a rank 0 stand-in whose port file is a FIFO or a link to /dev/zero is refused at once,
    /// naming the file, instead of blocking the launcher or growing it without bound.
    #[test]
    fn a_port_file_that_is_not_a_regular_file_is_refused_not_read() {
        let (port, _) = wait(r#"ln -s /dev/zero "$1"; sleep 5"#, Duration::from_secs(5));
        let err = format!("{:#}", port.unwrap_err());
        assert!(err.contains("not a regular file"), "{err}");
        let (port, _) = wait(r#"mkfifo "$1"; sleep 5"#, Duration::from_secs(5));
        let err = format!("{:#}", port.unwrap_err());
        assert!(err.contains("not a regular file"), "{err}");
    }

    /// A rank 0 that fails before its rendezvous is reported by the supervisor, not waited for.
    #[test]
    fn a_rank_zero_that_fails_before_binding_is_not_waited_for() {
        assert_eq!(wait("exit 3", Duration::from_secs(5)).0.unwrap(), None);
    }

    /// A rank 0 that exits cleanly without a port, writes garbage, or is silent past the rendezvous
    /// timeout is an error naming it.
    #[test]
    fn a_rank_zero_without_a_port_is_an_error_naming_it() {
        let e = wait("exit 0", Duration::from_secs(5)).0.unwrap_err().to_string();
        assert!(e.contains("worker 0 exited before it bound its rendezvous port"), "{e}");
        let e = wait(r#"printf 0 > "$1"; sleep 5"#, Duration::from_secs(5)).0.unwrap_err().to_string();
        assert!(e.contains("not its rendezvous port"), "{e}");
        let e = wait("sleep 5", Duration::from_millis(200)).0.unwrap_err().to_string();
        assert!(e.contains("did not bind its rendezvous port within"), "{e}");
    }
}
