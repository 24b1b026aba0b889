//! `cargo xtask chaos`: elastic jobs on loopback under injected faults, each checked against the
//! outcome its fault must have and the invariants every job keeps.
//!
//! Every job trains digits with K elastic workers, under a setting drawn from the seed (plain f32
//! syncs, or streaming fragments whose averages go as int8 or fp8), mostly as a `qsr rendezvous`
//! store and K `qsr train --comm tcp --elastic` workers. One fault per job, the kinds in equal
//! quotas, in an order and at points drawn from the seed: workers (rank 0 or another) are killed
//! (SIGKILL) or stopped (SIGSTOP) through `QSR_TEST_FAULT` at a step, right after a sync, or (rank
//! 0) while it commits a checkpoint, so a worker fault replays exactly from the seed; all workers
//! but rank 0 are killed at once (the job shrinks to one survivor), or two at once when the store
//! needs K - 1 (the survivors fall below `--min-workers`); a worker is killed at a step and a second
//! once the store formed the next generation with it, before its ring formed; the store is killed or stopped a drawn
//! delay after training began; a `qsr train --nproc K --elastic` launcher gets SIGINT or SIGTERM
//! while rank 0 commits a checkpoint.
//!
//! Expected outcomes: a lost worker costs a round, and the job finishes with the planned syncs, the
//! workers left and the victims named as the lost ranks; survivors below `--min-workers` give up at
//! their rendezvous timeout, exiting 5; a lost store is a defined failure, every worker exiting
//! with status 5 and naming the store; an interrupted launcher exits 128 + the signal, and
//! `--resume` finishes the run. Invariants of every job: `metrics.jsonl` parses, its syncs are the
//! run's in order and once each, and they agree with `summary.json` and the checkpoint;
//! `ckpt/LATEST` names a checkpoint that verifies; nothing is left in `ckpt/` (`tmp-step-*`) or
//! `/dev/shm` (`qsr-shm-*`); a finished job's model is not at chance (the setting's clean job
//! trains).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

const RECIPE: &str = "recipes/digits-mlp-qsr.toml";
/// Steps of a job whose fault is a worker's; a store's fault needs a job still running when it comes.
const STEPS: u64 = 400;
const STORE_JOB_STEPS: u64 = 4000;
/// A job that is not over by then hangs: everything is killed and the job fails.
const JOB_LIMIT: Duration = Duration::from_secs(150);
/// The rendezvous timeout of a job's workers; survivors below `--min-workers` wait this long.
const RENDEZVOUS_SECS: u64 = 60;
const BELOW_MIN_RENDEZVOUS_SECS: u64 = 8;
/// Test accuracy a finished job's model must exceed (digits has 10 classes: chance is 0.1), and a
/// setting's clean job before it, so that the floor means something.
const ACCURACY_FLOOR: f64 = 0.5;
const CLEAN_ACCURACY: f64 = 0.8;

/// Arguments of `cargo xtask chaos`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ChaosArgs {
    /// Jobs to run (the fault kinds share them equally).
    #[arg(long, default_value_t = 50)]
    pub jobs: usize,
    /// The campaign's seed; a campaign replays from it (default: drawn and printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Workers per job.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Write the summary into docs/RELIABILITY.md.
    #[arg(long)]
    pub write_docs: bool,
    /// Use the `qsr` already in the target dir instead of building it (`cargo xtask ci`: its test step
    /// built it for the integration tests, with the features a plain build would resolve otherwise).
    #[arg(long)]
    pub prebuilt: bool,
}

/// The signal of a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sig {
    Kill,
    Stop,
    Int,
    Term,
}

impl Sig {
    fn name(self) -> &'static str {
        match self {
            Sig::Kill => "kill",
            Sig::Stop => "stop",
            Sig::Int => "int",
            Sig::Term => "term",
        }
    }

    fn raw(self) -> i32 {
        match self {
            Sig::Kill => libc::SIGKILL,
            Sig::Stop => libc::SIGSTOP,
            Sig::Int => libc::SIGINT,
            Sig::Term => libc::SIGTERM,
        }
    }
}

/// How a job's workers sync, drawn per job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setting {
    /// Whole-model f32 averages at the rule's syncs.
    Plain,
    /// Two streaming fragments, each average landing two steps late, sent as this wire (int8, fp8).
    Streaming(&'static str),
}

const SETTINGS: [Setting; 3] = [Setting::Plain, Setting::Streaming("int8"), Setting::Streaming("fp8")];

impl Setting {
    fn name(self) -> &'static str {
        match self {
            Setting::Plain => "f32",
            Setting::Streaming("int8") => "stream int8",
            Setting::Streaming(_) => "stream fp8",
        }
    }

    /// The recipe keys it sets.
    fn sets(self) -> Vec<String> {
        match self {
            Setting::Plain => Vec::new(),
            Setting::Streaming(wire) => {
                vec![
                    format!("driver.wire={wire}"),
                    "sync.streaming.fragments=2".into(),
                    "sync.streaming.delay=2".into(),
                ]
            }
        }
    }
}

/// A job's fault.
#[derive(Debug, Clone)]
enum Fault {
    /// None: the clean job that finds where faults can land.
    None,
    /// `QSR_TEST_FAULT=<sig>:<rank>:<point>` (the point as the variable writes it).
    Worker { sig: Sig, rank: usize, point: String },
    /// `QSR_TEST_FAULT=kill:<rank>:<step>:synced` for each of `ranks`, with a store that forms
    /// generations of at least `min_workers`. Right after a global sync, which every rank completes
    /// alike: at a plain step, a rank might learn of the others' loss (a streaming fragment's
    /// average) before it reached the step, and live.
    Several { ranks: Vec<usize>, step: u64, min_workers: usize },
    /// `QSR_TEST_FAULT=kill:<first>:<step>`, then `kill:<second>:1:formed`: a second worker lost once
    /// the store formed the next generation with it, before that generation's ring formed.
    Reforming { first: usize, step: u64, second: usize },
    /// The store gets `sig` this long after training began.
    Store { sig: Sig, after: Duration },
    /// A `--nproc` launcher gets `sig` while its rank 0 is stopped committing the checkpoint of `step`.
    Launcher { sig: Sig, step: u64 },
}

/// The kinds of faults, each with its quota of jobs.
pub(crate) const KINDS: [&str; 11] = [
    "kill worker",
    "stop worker",
    "kill rank 0",
    "stop rank 0",
    "kill store",
    "stop store",
    "shrink to one",
    "below min",
    "SIGINT launcher",
    "SIGTERM launcher",
    "second loss",
];

impl Fault {
    fn kind(&self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::Worker { sig: Sig::Kill, rank: 0, .. } => KINDS[2],
            Fault::Worker { sig: Sig::Stop, rank: 0, .. } => KINDS[3],
            Fault::Worker { sig: Sig::Kill, .. } => KINDS[0],
            Fault::Worker { .. } => KINDS[1],
            Fault::Store { sig: Sig::Kill, .. } => KINDS[4],
            Fault::Store { .. } => KINDS[5],
            Fault::Several { min_workers: 1, .. } => KINDS[6],
            Fault::Several { .. } => KINDS[7],
            Fault::Launcher { sig: Sig::Int, .. } => KINDS[8],
            Fault::Launcher { .. } => KINDS[9],
            Fault::Reforming { .. } => KINDS[10],
        }
    }

    fn describe(&self) -> String {
        match self {
            Fault::None => "no fault".into(),
            Fault::Worker { sig, rank, point } => format!("QSR_TEST_FAULT={}:{rank}:{point}", sig.name()),
            Fault::Store { sig, after } => {
                format!("{} the store {} ms after training began", sig.name(), after.as_millis())
            }
            Fault::Several { ranks, step, min_workers } => {
                format!("kill ranks {ranks:?} after the sync of step {step}, min-workers {min_workers}")
            }
            Fault::Launcher { sig, step } => format!("{} the launcher, rank 0 committing step {step}", sig.name()),
            Fault::Reforming { first, step, second } => {
                format!("kill rank {first} at step {step}, rank {second} as generation 1 forms")
            }
        }
    }

    /// Each rank's `QSR_TEST_FAULT`.
    fn spec(&self, rank: usize) -> Option<String> {
        match self {
            Fault::Worker { sig, rank: r, point } if *r == rank => Some(format!("{}:{rank}:{point}", sig.name())),
            Fault::Several { ranks, step, .. } if ranks.contains(&rank) => Some(format!("kill:{rank}:{step}:synced")),
            Fault::Launcher { step, .. } if rank == 0 => Some(format!("stop:0:{step}:commit")),
            Fault::Reforming { first, step, .. } if *first == rank => Some(format!("kill:{rank}:{step}")),
            Fault::Reforming { second, .. } if *second == rank => Some(format!("kill:{rank}:1:formed")),
            _ => None,
        }
    }

    /// The fewest workers a generation of the job forms with.
    fn min_workers(&self) -> usize {
        match self {
            Fault::Several { min_workers, .. } => *min_workers,
            Fault::Reforming { .. } => 1,
            _ => 2,
        }
    }

    /// The workers' rendezvous timeout: short where survivors are meant to give up waiting.
    fn rendezvous_secs(&self) -> u64 {
        match self {
            Fault::Several { min_workers, ranks, .. } if *min_workers > 1 && ranks.len() > 1 => {
                BELOW_MIN_RENDEZVOUS_SECS
            }
            _ => RENDEZVOUS_SECS,
        }
    }
}

/// Where faults can land: the sync steps and checkpoint steps of a clean run of the job's recipe.
struct Points {
    syncs: Vec<u64>,
    checkpoints: Vec<u64>,
}

/// Draws job `i`'s fault, of the kind its quota gives it.
fn draw(kind: &str, rng: &mut ChaCha8Rng, k: usize, points: &Points) -> Fault {
    let sig = if kind.starts_with("kill") { Sig::Kill } else { Sig::Stop };
    let inner = &points.syncs[2..points.syncs.len() - 2];
    let checkpoint = |rng: &mut ChaCha8Rng| points.checkpoints[rng.random_range(0..points.checkpoints.len() - 1)];
    match kind {
        "shrink to one" | "below min" => {
            let step = inner[rng.random_range(0..inner.len())];
            let (ranks, min_workers) =
                if kind == "shrink to one" { ((1..k).collect(), 1) } else { ((k - 2..k).collect(), k - 1) };
            return Fault::Several { ranks, step, min_workers };
        }
        "second loss" => {
            let first = rng.random_range(1..k);
            let second = (1..k).filter(|&r| r != first).collect::<Vec<_>>()[rng.random_range(0..k - 2)];
            let step = rng.random_range(inner[0]..inner[inner.len() - 1]);
            return Fault::Reforming { first, step, second };
        }
        "SIGINT launcher" => return Fault::Launcher { sig: Sig::Int, step: checkpoint(rng) },
        "SIGTERM launcher" => return Fault::Launcher { sig: Sig::Term, step: checkpoint(rng) },
        _ => {}
    }
    if kind.ends_with("store") {
        return Fault::Store { sig, after: Duration::from_millis(rng.random_range(200..1500)) };
    }
    let rank = if kind.ends_with("rank 0") { 0 } else { rng.random_range(1..k) };
    let point = match (rank, rng.random_range(0..3)) {
        (0, 2) => format!("{}:commit", checkpoint(rng)),
        (_, 1) => format!("{}:synced", inner[rng.random_range(0..inner.len())]),
        _ => rng.random_range(inner[0]..inner[inner.len() - 1]).to_string(),
    };
    Fault::Worker { sig, rank, point }
}

/// What one job did, and what was wrong with it.
struct JobResult {
    setting: Setting,
    fault: Fault,
    seconds: f64,
    violations: Vec<String>,
}

/// Runs the campaign (after building `qsr`); returns an error when a job broke an expectation or an
/// invariant.
pub(crate) fn run(args: &ChaosArgs, root: &Path, target: &Path) -> Result<()> {
    if args.workers < 3 || args.jobs == 0 {
        bail!("--workers must be at least 3 (a fault leaves two to go on) and --jobs at least 1");
    }
    if !args.prebuilt {
        let mut build = crate::cargo();
        build.args(["build", "--release", "--locked", "--bin", "qsr"]);
        crate::run(build)?;
    }
    let qsr = target.join("release/qsr");
    let seed = args.seed.unwrap_or_else(rand::random);
    println!("chaos: seed {seed} (replay: cargo xtask chaos --jobs {} --seed {seed})", args.jobs);
    let scratch = target.join("chaos");
    let _ = std::fs::remove_dir_all(&scratch);
    let started = Instant::now();
    let mut points = Vec::new();
    for setting in SETTINGS {
        let dir = scratch.join(format!("clean-{}", setting.name().replace(' ', "-")));
        points.push(clean_points(&Setup { qsr: &qsr, root, k: args.workers, dir: &dir, setting })?);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut kinds: Vec<&str> = (0..args.jobs).map(|i| KINDS[i % KINDS.len()]).collect();
    kinds.shuffle(&mut rng);
    let mut results = Vec::new();
    for (i, kind) in kinds.iter().enumerate() {
        let s = rng.random_range(0..SETTINGS.len());
        let (setting, fault) = (SETTINGS[s], draw(kind, &mut rng, args.workers, &points[s]));
        let setup = Setup { qsr: &qsr, root, k: args.workers, dir: &scratch.join(format!("job-{i}")), setting };
        let r = match fault {
            Fault::Launcher { sig, step } => run_launcher_job(&setup, sig, step)?,
            fault => run_job(&setup, fault, rng.random())?,
        };
        let verdict = if r.violations.is_empty() { "ok".to_string() } else { r.violations.join("; ") };
        let (kind, what) = (r.fault.kind(), r.fault.describe());
        println!("chaos: job {i:>3} {kind:<16} {:<11} {what:<56} {:>5.1} s  {verdict}", setting.name(), r.seconds);
        if r.violations.is_empty() {
            let _ = std::fs::remove_dir_all(setup.dir);
        }
        results.push(r);
    }
    let summary = summary(&results, seed, args, started.elapsed());
    print!("{summary}");
    if args.write_docs {
        write_docs(root, &summary)?;
    }
    let bad = results.iter().filter(|r| !r.violations.is_empty()).count();
    if bad > 0 {
        bail!(
            "{bad} of {} chaos jobs broke an expectation (their directories are kept in {})",
            results.len(),
            scratch.display()
        );
    }
    Ok(())
}

/// What every job shares.
struct Setup<'a> {
    qsr: &'a Path,
    root: &'a Path,
    k: usize,
    dir: &'a Path,
    setting: Setting,
}

impl Setup<'_> {
    fn run_dir(&self) -> PathBuf {
        self.dir.join("run")
    }

    /// `qsr` with the job's environment: a short comm timeout, so stalls are seen in seconds.
    fn qsr(&self, token: &str) -> Command {
        let mut c = Command::new(self.qsr);
        c.current_dir(self.root).env("QSR_COMM_TIMEOUT_SECS", "2").env("QSR_JOB_TOKEN", token);
        c.env("QSR_RENDEZVOUS_TIMEOUT_SECS", RENDEZVOUS_SECS.to_string()).env_remove("QSR_TEST_FAULT");
        c
    }

    /// `train` arguments of every worker of the job: the recipe, `steps`, K and the setting.
    fn train_args(&self, steps: u64) -> Vec<String> {
        let mut sets = vec![format!("schedule.total_steps={steps}"), format!("train.workers={}", self.k)];
        sets.push("eval.every_epochs=1".into());
        sets.extend(self.setting.sets());
        let mut args: Vec<String> = ["train", "--recipe", RECIPE, "--quiet"].map(String::from).into();
        args.extend(sets.into_iter().flat_map(|s| ["--set".to_string(), s]));
        args
    }

    /// The store, forming generations of at least `min_workers`: its process and address.
    fn store(&self, token: &str, min_workers: usize) -> Result<(Child, String)> {
        let mut c = self.qsr(token);
        c.args(["rendezvous", "--listen", "127.0.0.1:0", "--workers", &self.k.to_string()]);
        c.args(["--min-workers", &min_workers.to_string(), "--settle-secs", "2"]);
        let err = std::fs::File::create(self.dir.join("store.err"))?;
        let mut child = c.stdout(Stdio::piped()).stderr(err).spawn().context("cannot start qsr rendezvous")?;
        let mut line = String::new();
        let out = child.stdout.take().context("no stdout")?;
        std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line)?;
        let addr = line.split_whitespace().nth(2).context("qsr rendezvous printed no address")?.to_string();
        Ok((child, addr))
    }

    /// Worker `rank` of the job (launcher order `rank`), with the fault's variable.
    fn worker(&self, token: &str, store: &str, rank: usize, steps: u64, fault: &Fault) -> Result<Child> {
        let mut c = self.qsr(token);
        c.args(self.train_args(steps)).args(["--comm", "tcp", "--elastic", "--rendezvous", store]);
        c.args(["--rank", &rank.to_string(), "--out"]).arg(self.run_dir());
        c.env("QSR_RENDEZVOUS_TIMEOUT_SECS", fault.rendezvous_secs().to_string());
        if let Some(f) = fault.spec(rank) {
            c.env("QSR_TEST_FAULT", f);
        }
        let err = std::fs::File::create(self.dir.join(format!("rank{rank}.err")))?;
        c.stdout(Stdio::null()).stderr(err).spawn().context("cannot start qsr train")
    }
}

/// A clean job, for the steps faults can land on (and a check that a job without faults passes).
fn clean_points(setup: &Setup<'_>) -> Result<Points> {
    let r = run_job(setup, Fault::None, 0)?;
    if !r.violations.is_empty() {
        bail!("the clean job ({}) failed: {}", setup.setting.name(), r.violations.join("; "));
    }
    let accuracy = read_json(&setup.run_dir().join("summary.json"))?["final_test_accuracy"].as_f64().unwrap_or(0.0);
    if accuracy < CLEAN_ACCURACY {
        bail!(
            "the clean job ({}) reached {accuracy:.3}, under {CLEAN_ACCURACY}: the recipe does not train",
            setup.setting.name()
        );
    }
    let records = read_records(&setup.run_dir())?;
    let steps = |kind: &str| -> Vec<u64> {
        records.iter().filter(|r| r["kind"] == kind).filter_map(|r| r["step"].as_u64()).collect()
    };
    let points = Points { syncs: steps("sync"), checkpoints: steps("eval") };
    if points.syncs.len() < 8 || points.checkpoints.len() < 2 {
        bail!("the clean job had too few syncs or checkpoints to place faults");
    }
    Ok(points)
}

/// Runs one job under `fault` and checks it.
fn run_job(setup: &Setup<'_>, fault: Fault, salt: u64) -> Result<JobResult> {
    std::fs::create_dir_all(setup.dir)?;
    let shm_before = shm_files();
    let token = format!("chaos-{salt:016x}");
    let t0 = Instant::now();
    let (mut store, addr) = setup.store(&token, fault.min_workers())?;
    let steps = if matches!(fault, Fault::Store { .. }) { STORE_JOB_STEPS } else { STEPS };
    let mut workers =
        (0..setup.k).map(|r| setup.worker(&token, &addr, r, steps, &fault)).collect::<Result<Vec<Child>>>()?;
    let statuses = supervise(setup, &fault, &mut store, &mut workers, t0);
    let mut violations = Vec::new();
    let statuses = match statuses {
        Ok(s) => s,
        Err(e) => {
            violations.push(format!("{e:#}"));
            Vec::new()
        }
    };
    for c in workers.iter_mut().chain(std::iter::once(&mut store)) {
        let _ = c.kill();
        let _ = c.wait();
    }
    if !statuses.is_empty() {
        violations.extend(check(setup, &fault, &addr, &statuses));
    }
    let left: Vec<String> = shm_files().difference(&shm_before).cloned().collect();
    if !left.is_empty() {
        violations.push(format!("left in /dev/shm: {left:?}"));
    }
    Ok(JobResult { setting: setup.setting, fault, seconds: t0.elapsed().as_secs_f64(), violations })
}

/// How a worker ended: its exit code, or the signal that ended it, or `stopped` (the chaos victim
/// left stopped, killed at the end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Code(i32),
    Signal(i32),
    Stopped,
}

/// Waits for the job's end, signalling the store at the fault's time; returns each worker's end.
fn supervise(
    setup: &Setup<'_>,
    fault: &Fault,
    store: &mut Child,
    workers: &mut [Child],
    t0: Instant,
) -> Result<Vec<End>> {
    use std::os::unix::process::ExitStatusExt;
    let mut ends: Vec<Option<End>> = vec![None; workers.len()];
    let mut training_since: Option<Instant> = None;
    let mut store_hit = false;
    loop {
        if t0.elapsed() > JOB_LIMIT {
            bail!("hung: still running after {} s", JOB_LIMIT.as_secs());
        }
        for (i, w) in workers.iter_mut().enumerate() {
            if ends[i].is_none()
                && let Some(s) = w.try_wait()?
            {
                ends[i] = Some(s.code().map_or_else(|| End::Signal(s.signal().unwrap_or(0)), End::Code));
            }
        }
        if training_since.is_none() && setup.run_dir().join("metrics.jsonl").exists() {
            training_since = Some(Instant::now());
        }
        if let (Fault::Store { sig, after }, Some(t)) = (fault, training_since)
            && !store_hit
            && t.elapsed() >= *after
        {
            signal(store.id(), sig.raw());
            store_hit = true;
        }
        // The victim of a stop never ends by itself: the others' ends decide.
        let open: Vec<usize> = (0..workers.len()).filter(|&i| ends[i].is_none()).collect();
        let stopped_victim = matches!(fault, Fault::Worker { sig: Sig::Stop, rank, .. } if open == [*rank]);
        if open.is_empty() || stopped_victim {
            if stopped_victim {
                ends[open[0]] = Some(End::Stopped);
            }
            return Ok(ends.into_iter().map(|e| e.unwrap_or(End::Stopped)).collect());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The expectations of `fault` and the invariants of every job; returns what did not hold.
fn check(setup: &Setup<'_>, fault: &Fault, store: &str, ends: &[End]) -> Vec<String> {
    let mut v = Vec::new();
    let run = setup.run_dir();
    match fault {
        Fault::Worker { sig, rank, .. } => check_worker_fault(setup, *sig, *rank, ends, &mut v),
        Fault::None => check_finished(setup, ends, &[], &mut v),
        Fault::Several { ranks, min_workers, .. } => check_several(setup, ranks, *min_workers, ends, &mut v),
        Fault::Reforming { first, second, .. } => check_reforming(setup, (*first, *second), ends, &mut v),
        // Checked by `run_launcher_job`.
        Fault::Launcher { .. } => {}
        Fault::Store { .. } => {
            for (r, end) in ends.iter().enumerate() {
                let err = std::fs::read_to_string(setup.dir.join(format!("rank{r}.err"))).unwrap_or_default();
                if *end != End::Code(5) || !err.contains(store) {
                    v.push(format!("rank {r} ended {end:?} without naming the store {store}: {}", last_line(&err)));
                }
            }
        }
    }
    if let Err(e) = check_files(setup, &run) {
        v.push(format!("{e:#}"));
    }
    v
}

fn check_worker_fault(setup: &Setup<'_>, sig: Sig, victim: usize, ends: &[End], v: &mut Vec<String>) {
    let want = if sig == Sig::Kill { End::Signal(libc::SIGKILL) } else { End::Stopped };
    if ends[victim] != want {
        v.push(format!("the victim, rank {victim}, ended {:?}, not {want:?}", ends[victim]));
    }
    check_finished(setup, ends, &[victim], v);
}

/// Several workers killed at once: the job finishes with the survivors when they are at least
/// `min_workers`; otherwise each survivor gives up at its rendezvous timeout, exiting 5.
fn check_several(setup: &Setup<'_>, victims: &[usize], min_workers: usize, ends: &[End], v: &mut Vec<String>) {
    for &r in victims.iter().filter(|&&r| ends[r] != End::Signal(libc::SIGKILL)) {
        v.push(format!("the victim, rank {r}, ended {:?}, not killed", ends[r]));
    }
    if setup.k - victims.len() >= min_workers {
        return check_finished(setup, ends, victims, v);
    }
    for (r, end) in ends.iter().enumerate().filter(|(r, _)| !victims.contains(r)) {
        let err = std::fs::read_to_string(setup.dir.join(format!("rank{r}.err"))).unwrap_or_default();
        if *end != End::Code(5) || !err.contains("no new worker came within the rendezvous timeout") {
            v.push(format!("survivor rank {r} ended {end:?}, not giving up below min-workers: {}", last_line(&err)));
        }
    }
}

/// A second worker lost while the next generation formed: both victims killed, the job finished
/// with the rest, and both named: the first by its rank of generation 0, the second by its rank of
/// generation 1 (one less when the first ranked before it).
fn check_reforming(setup: &Setup<'_>, (first, second): (usize, usize), ends: &[End], v: &mut Vec<String>) {
    for r in [first, second].into_iter().filter(|&r| ends[r] != End::Signal(libc::SIGKILL)) {
        v.push(format!("the victim, rank {r}, ended {:?}, not killed", ends[r]));
    }
    let second_in_1 = second - usize::from(first < second);
    finished_losing(setup, ends, (&[first, second], &[first, second_in_1]), v);
}

/// A finished job: every worker but the victims exited 0, the store reported the job finished, and
/// the summary has the planned syncs, the world less the victims, the victims as the lost ranks and
/// a model that is not at chance.
fn check_finished(setup: &Setup<'_>, ends: &[End], victims: &[usize], v: &mut Vec<String>) {
    finished_losing(setup, ends, (victims, victims), v);
}

/// [`check_finished`] for victims whose ranks when lost (`lost_as`) differ from their launcher order.
fn finished_losing(setup: &Setup<'_>, ends: &[End], (victims, lost_as): (&[usize], &[usize]), v: &mut Vec<String>) {
    for (r, end) in ends.iter().enumerate().filter(|(r, _)| !victims.contains(r)) {
        if *end != End::Code(0) {
            let err = std::fs::read_to_string(setup.dir.join(format!("rank{r}.err"))).unwrap_or_default();
            v.push(format!("rank {r} ended {end:?}: {}", last_line(&err)));
        }
    }
    let summary = match read_json(&setup.run_dir().join("summary.json")) {
        Ok(s) => s,
        Err(e) => return v.push(format!("{e:#}")),
    };
    check_summary(&summary, v);
    let world = setup.k - victims.len();
    if summary["world_size"].as_u64() != Some(world as u64) {
        v.push(format!("the job ended with {} workers, not {world}", summary["world_size"]));
    }
    let lost: Vec<u64> = summary["membership"]
        .as_array()
        .map(|m| {
            m.iter()
                .flat_map(|c| c["lost"].as_array().into_iter().flatten())
                .filter_map(|l| l["rank"].as_u64())
                .collect()
        })
        .unwrap_or_default();
    let mut lost = lost;
    lost.sort();
    let mut want: Vec<u64> = lost_as.iter().map(|&r| r as u64).collect();
    want.sort();
    if lost != want {
        v.push(format!("the lost ranks were {lost:?}, the victims {victims:?} (lost as ranks {want:?})"));
    }
}

/// A finished run's summary: the planned syncs, and a model above [`ACCURACY_FLOOR`].
fn check_summary(summary: &Value, v: &mut Vec<String>) {
    if summary["syncs"] != summary["planned_syncs"] {
        v.push(format!("{} syncs where the plan has {}", summary["syncs"], summary["planned_syncs"]));
    }
    let accuracy = summary["final_test_accuracy"].as_f64().unwrap_or(0.0);
    if accuracy <= ACCURACY_FLOOR {
        v.push(format!("the final model reached {accuracy:.3}, not above {ACCURACY_FLOOR} (chance is 0.1)"));
    }
}

/// A `qsr train --nproc K --elastic` launcher that gets `sig` while its rank 0 is stopped committing
/// the checkpoint of `step`: it exits 128 + the signal leaving no unfinished checkpoint, and
/// `--resume` finishes the run.
fn run_launcher_job(setup: &Setup<'_>, sig: Sig, step: u64) -> Result<JobResult> {
    std::fs::create_dir_all(setup.dir)?;
    let shm_before = shm_files();
    let fault = Fault::Launcher { sig, step };
    let t0 = Instant::now();
    let run = setup.run_dir();
    let mut c = setup.qsr("launcher");
    c.args(setup.train_args(STEPS)).args(["--nproc", &setup.k.to_string(), "--elastic", "--out"]).arg(&run);
    c.env("QSR_TEST_FAULT", fault.spec(0).context("rank 0 has the fault")?);
    let err = std::fs::File::create(setup.dir.join("launcher.err"))?;
    let mut launcher = c.stdout(Stdio::null()).stderr(err).spawn().context("cannot start qsr train --nproc")?;
    let mut violations = Vec::new();
    let tmp = run.join(format!("ckpt/tmp-step-{step}/state.json"));
    while !tmp.exists() && t0.elapsed() < JOB_LIMIT && launcher.try_wait()?.is_none() {
        std::thread::sleep(Duration::from_millis(20));
    }
    if tmp.exists() {
        signal(launcher.id(), sig.raw());
    } else {
        violations.push(format!("rank 0 never reached the commit of step {step}"));
    }
    let status = wait_within(&mut launcher, JOB_LIMIT.saturating_sub(t0.elapsed()))?;
    let log = std::fs::read_to_string(setup.dir.join("launcher.err")).unwrap_or_default();
    if violations.is_empty() && status != Some(128 + sig.raw()) {
        violations.push(format!("the launcher ended {status:?}, not {}: {}", 128 + sig.raw(), last_line(&log)));
    }
    if let Err(e) = check_files(setup, &run) {
        violations.push(format!("after the signal: {e:#}"));
    }
    if violations.is_empty() {
        violations.extend(resume_to_the_end(setup, &run));
    }
    let left: Vec<String> = shm_files().difference(&shm_before).cloned().collect();
    if !left.is_empty() {
        violations.push(format!("left in /dev/shm: {left:?}"));
    }
    Ok(JobResult { setting: setup.setting, fault, seconds: t0.elapsed().as_secs_f64(), violations })
}

/// `qsr train --resume` of an interrupted run finishes it: the planned syncs, a model above the
/// floor, and the files' invariants.
fn resume_to_the_end(setup: &Setup<'_>, run: &Path) -> Vec<String> {
    let mut v = Vec::new();
    let mut c = setup.qsr("resume");
    c.args(["train", "--resume"]).arg(run).args(["--nproc", &setup.k.to_string(), "--elastic", "--quiet"]);
    let out = match c.output() {
        Ok(o) => o,
        Err(e) => return vec![format!("cannot resume: {e}")],
    };
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return vec![format!("the resume ended {:?}: {}", out.status.code(), last_line(&err))];
    }
    match read_json(&run.join("summary.json")) {
        Ok(summary) => check_summary(&summary, &mut v),
        Err(e) => v.push(format!("{e:#}")),
    }
    if let Err(e) = check_files(setup, run) {
        v.push(format!("after the resume: {e:#}"));
    }
    v
}

/// Waits up to `limit` for `child`, killing it after; its exit code (`None` when a signal ended it).
fn wait_within(child: &mut Child, limit: Duration) -> Result<Option<i32>> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(s) = child.try_wait()? {
            return Ok(s.code());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    bail!("hung: still running after {} s", limit.as_secs())
}

/// Invariants of the run directory, whatever the fault.
fn check_files(setup: &Setup<'_>, run: &Path) -> Result<()> {
    let records = read_records(run)?;
    let syncs: Vec<&Value> = records.iter().filter(|r| r["kind"] == "sync").collect();
    let steps: Vec<u64> = syncs.iter().filter_map(|r| r["step"].as_u64()).collect();
    if !steps.windows(2).all(|w| w[0] < w[1]) {
        bail!("sync records out of order or twice: {steps:?}");
    }
    for (i, r) in syncs.iter().enumerate() {
        if r["syncs"].as_u64() != Some(i as u64 + 1) {
            bail!("the sync record at step {} counts {} syncs, the file has {}", r["step"], r["syncs"], i + 1);
        }
    }
    if let Ok(summary) = read_json(&run.join("summary.json"))
        && summary["syncs"].as_u64() != Some(syncs.len() as u64)
    {
        bail!("summary.json counts {} syncs, metrics.jsonl has {}", summary["syncs"], syncs.len());
    }
    let ckpt = run.join("ckpt");
    let leftovers: Vec<String> = std::fs::read_dir(&ckpt)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    if let Some(l) = leftovers.iter().find(|n| n.starts_with("tmp-") || n.ends_with(".tmp")) {
        bail!("left in ckpt/: {l}");
    }
    check_latest(setup, run, &syncs)
}

/// `ckpt/LATEST` names a checkpoint that verifies (a resume with nothing left to train loads and
/// verifies it, then refuses), whose counters agree with the metrics.
fn check_latest(setup: &Setup<'_>, run: &Path, syncs: &[&Value]) -> Result<()> {
    let Ok(name) = std::fs::read_to_string(run.join("ckpt/LATEST")) else {
        return Ok(());
    };
    let step: u64 = name.trim().strip_prefix("step-").and_then(|s| s.parse().ok()).context("LATEST is malformed")?;
    let state = read_json(&run.join("ckpt").join(name.trim()).join("state.json"))?;
    let counted = syncs.iter().find(|r| r["step"].as_u64() == Some(step)).map(|r| r["syncs"].clone());
    if counted.as_ref() != Some(&state["counters"]["syncs"]) {
        bail!("the checkpoint of step {step} counts {} syncs, its sync record {counted:?}", state["counters"]["syncs"]);
    }
    let out = setup
        .qsr("verify")
        .args(["train", "--resume"])
        .arg(run)
        .args(["--set", &format!("train.steps={step}")])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    if !err.contains("nothing to resume") {
        bail!("the checkpoint of step {step} does not verify: {}", last_line(&err));
    }
    Ok(())
}

fn read_records(run: &Path) -> Result<Vec<Value>> {
    let path = run.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("metrics.jsonl line {} does not parse: {l}", i + 1))
        })
        .collect()
}

fn read_json(path: &Path) -> Result<Value> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("{} does not parse", path.display()))
}

fn last_line(text: &str) -> &str {
    text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("(nothing on stderr)")
}

fn shm_files() -> BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("qsr-shm-"))
                .collect()
        })
        .unwrap_or_default()
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) with a pid of a child this process spawned and has not reaped.
    unsafe {
        libc::kill(pid as i32, sig);
    }
}

/// The campaign's table: jobs and expectations held per fault kind, then every violation.
fn summary(results: &[JobResult], seed: u64, args: &ChaosArgs, took: Duration) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "Measured {} on {} by `cargo xtask chaos --jobs {} --seed {seed} --workers {}`: {} jobs in {:.0} s.\n",
        crate::bench::today(),
        crate::bench::machine(),
        args.jobs,
        args.workers,
        results.len(),
        took.as_secs_f64()
    );
    let _ = writeln!(o, "| fault | jobs | of them streaming (int8, fp8) | expected | held | invariants violated |");
    let _ = writeln!(o, "|---|---|---|---|---|---|");
    for kind in KINDS {
        let of: Vec<&JobResult> = results.iter().filter(|r| r.fault.kind() == kind).collect();
        let held = of.iter().filter(|r| r.violations.is_empty()).count();
        let wire = |w: &'static str| of.iter().filter(|r| r.setting == Setting::Streaming(w)).count();
        let (int8, fp8) = (wire("int8"), wire("fp8"));
        let expected = match kind {
            "kill store" | "stop store" => "every worker exits 5 naming the store",
            "shrink to one" => "finishes with the planned syncs, 1 worker, the victims named",
            "below min" => "the survivors give up at their rendezvous timeout, exiting 5",
            "SIGINT launcher" | "SIGTERM launcher" => "exits 128 + signal; `--resume` finishes the run",
            "second loss" => "finishes with the planned syncs, K - 2 workers, both victims named",
            _ => "finishes with the planned syncs, K - 1 workers, the victim named",
        };
        let n = of.len();
        let _ = writeln!(o, "| {kind} | {n} | {} ({int8}, {fp8}) | {expected} | {held} | {} |", int8 + fp8, n - held);
    }
    let _ = writeln!(
        o,
        "\nEvery finished run (and every resumed one) ended with test accuracy above {ACCURACY_FLOOR}; each setting's clean job first reached {CLEAN_ACCURACY}."
    );
    let at = |p: &str| {
        results.iter().filter(|r| matches!(&r.fault, Fault::Worker { point, .. } if point.ends_with(p))).count()
    };
    let (synced, commit) = (at(":synced"), at(":commit"));
    let workers = results.iter().filter(|r| matches!(r.fault, Fault::Worker { .. })).count();
    let _ = writeln!(
        o,
        "\nWorker faults fired as a step starts: {}; right after a sync: {synced}; while rank 0 commits a checkpoint: {commit}.",
        workers - synced - commit
    );
    for (i, r) in results.iter().enumerate().filter(|(_, r)| !r.violations.is_empty()) {
        let _ = writeln!(o, "\n- job {i} ({}): {}", r.fault.describe(), r.violations.join("; "));
    }
    o
}

fn write_docs(root: &Path, summary: &str) -> Result<()> {
    let path = root.join("docs/RELIABILITY.md");
    let doc = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let (open, close) = ("<!-- chaos -->", "<!-- /chaos -->");
    let (Some(a), Some(b)) = (doc.find(open), doc.find(close)) else {
        bail!("{} has no `{open}` ... `{close}` section", path.display());
    };
    let new = format!("{}{open}\n{summary}{close}{}", &doc[..a], &doc[b + close.len()..]);
    std::fs::write(&path, new).with_context(|| format!("cannot write {}", path.display()))?;
    println!("chaos: wrote {}", path.display());
    Ok(())
}
