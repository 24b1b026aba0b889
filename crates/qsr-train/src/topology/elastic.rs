//! `qsr train --elastic`: a lost worker costs the round in flight, not the run.
//!
//! Every worker keeps a [`Snapshot`] of the last completed global sync (after its evaluation and
//! checkpoint). When a collective fails because a peer was lost or stalled, the worker goes back to
//! it and joins the next generation at the store ([`qsr_elastic::Elastic`]); the new generation takes
//! the newest sync any survivor holds from that rank ([`Worker::adopt`]), continues the plan from its
//! step (the plan and the lr schedule never change), and each rank trains on the shard of its new rank
//! and world size (the data is a pure function of seed, rank, world size and step). New workers wait
//! at the store until rank 0, polling after each global sync, finds them waiting; then every rank
//! joins the next generation at that sync, and the newcomers take the parameters, outer state and
//! counters over, with fresh optimizer moments. Rank 0's duties (metrics, summary, the shared
//! checkpoint files) belong to whoever is rank 0 of the current generation: survivors keep their
//! order, so that is the lowest surviving rank. A streaming recipe forms each generation as a pair
//! of groups (its fragments' all-reduces run on the second); going back to a snapshot drops the
//! averages in flight on every rank alike, except at an admission, where they complete and the
//! source shares them with every rank of the next generation.

use anyhow::{Context, Result, anyhow, bail};
use qsr_comm::{Collective, CommError, TcpConfig};
use qsr_elastic::{Elastic, ElasticConfig, ElasticError, LastSync, Membership, Poll};
use qsr_elastic::{Store, StoreConfig};
use qsr_optim::{Level, Snapshot, StreamState, Worker};
use serde::{Deserialize, Serialize};

use crate::args::TrainArgs;
use crate::checkpoint::Counters;
use crate::device_spec::DeviceSpec;
use crate::exit::{bad_input, is_peer_failure};
use crate::fault::{self, Point};
use crate::launch_facts::{LaunchFacts, agree};
use crate::recipe::TrainRecipe;
use crate::records::{MembershipChange, Record, Summary};
use crate::run_dir::{Resume, prepare_run_dir, refuse_old_run};
use crate::run_lock::RunLock;
use crate::worker::segment::{AfterSync, Pace, Segment};
use crate::worker::task::{ImageTask, Task, TextTask};
use crate::worker::{RunSpec, TrainModel, build_model};

/// The store a `--nproc N --elastic` launcher serves for its workers on loopback; it settles a failure
/// within the workers' comm timeout.
pub(crate) fn launcher_store(n: usize, token: &str) -> Result<Store> {
    let tcp = TcpConfig::from_env(&|k| std::env::var(k).ok())?;
    let cfg = StoreConfig { settle: tcp.timeout, token: token.into(), ..StoreConfig::new(n) };
    Ok(Store::bind("127.0.0.1:0", cfg)?)
}

/// One worker of an elastic job (`--comm tcp --elastic --rendezvous ADDR`, or a `--nproc` child).
pub(crate) fn train(
    args: &TrainArgs,
    spec: DeviceSpec,
    recipe: TrainRecipe,
    run_dir: std::path::PathBuf,
    resume: Resume,
) -> Result<Option<Summary>> {
    let store = args
        .rendezvous
        .clone()
        .ok_or_else(|| anyhow!("--elastic needs --rendezvous HOST:PORT (the store of `qsr rendezvous`), or --nproc"))?;
    let var = |k: &str| std::env::var(k).ok();
    let tcp = TcpConfig::from_env(&var)?;
    let shm = qsr_comm::ShmConfig { timeout: tcp.timeout, ..qsr_comm::ShmConfig::default() };
    let transport = qsr_comm::Transport::from_env(&var)?;
    // The store refuses a worker whose settings differ, the transport included (`QSR_TRANSPORT`).
    let settings = serde_json::json!({
        "qsr": env!("CARGO_PKG_VERSION"),
        "recipe": serde_json::to_value(&recipe)?,
        "QSR_TRANSPORT": transport.name(),
    });
    let cfg = ElasticConfig {
        store,
        host: qsr_comm::host_id(&var, &shm),
        transport,
        tcp,
        shm,
        order: args.rank.map(|r| r as u64),
        settings,
    };
    let mut job = Elastic::connect(cfg)?;
    // The workers a `--nproc` launcher started share its lock; others share their job's.
    let share = || RunLock::share(&run_dir, job.job_id(), job.store_addr()).map_err(bad_input);
    let _lock = if args.spawned { None } else { Some(share()?) };
    if let Some(order) = args.rank {
        fault::at(order, Point::Join);
        job.on_formed(move |m| fault::at(order, Point::Formed(m.generation)));
    }
    let (mut comm, side, m) = form(&mut job, &recipe, None, "start")?;
    let first = m.generation == 0;
    if first {
        start_first_generation(args, &recipe, (&run_dir, &resume), comm.as_mut(), spec.is_gpu())?;
    } else {
        crate::worker::preflight(&recipe, m.world_size, 1, spec.is_gpu()).map_err(bad_input)?;
    }
    let device = spec.open(0).map_err(bad_input)?;
    let model = build_model(&recipe, &device)?;
    let progress = !args.quiet && m.rank == 0 && first;
    let resume = if first { resume } else { None };
    let spec = RunSpec { recipe, device, run_dir, resume, progress, halt_after: None };
    let summary = run_member(&spec, &mut job, (comm, side, m), model);
    // A run that diverged or did not train ended its plan too: the store's job is finished, the exit
    // status says how.
    let outcome =
        |c: &(dyn std::error::Error + 'static)| c.is::<crate::exit::Diverged>() || c.is::<crate::exit::NotTrained>();
    if summary.as_ref().is_err_and(|e| e.chain().any(outcome)) {
        let _ = job.finish();
    }
    let summary = summary?;
    job.finish()?;
    Ok(if args.spawned { None } else { summary })
}

/// A generation's collective and membership, and for a streaming recipe the group its fragments'
/// all-reduces run on, beside the training collective.
type Formed = (Box<dyn Collective>, Option<Box<dyn Collective>>, Membership);

/// Joins the next generation ([`Elastic::form`]); a streaming recipe's members form a pair of groups.
fn form(job: &mut Elastic, recipe: &TrainRecipe, state: Option<LastSync>, why: &str) -> Result<Formed, ElasticError> {
    if recipe.sync.streaming.is_some() {
        let pair = job.form_pair(state, why)?;
        Ok((pair.comm, Some(pair.side), pair.membership))
    } else {
        let (comm, m) = job.form(state, why)?;
        Ok((comm, None, m))
    }
}

/// The first generation agrees before its first training collective, as an external launch does:
/// every rank has the recipe's world size, the same version, recipe and start checkpoint (a resumed
/// worker never trains beside a fresh one), and rank 0 may start in the run directory (a fresh run
/// never trains over another run's checkpoints); then rank 0 writes the resolved recipe.
fn start_first_generation(
    args: &TrainArgs,
    recipe: &TrainRecipe,
    (run_dir, resume): (&std::path::Path, &Resume),
    comm: &mut dyn Collective,
    gpu: bool,
) -> Result<()> {
    let world = comm.world_size();
    if world != recipe.train.workers {
        return Err(bad_input(anyhow!(
            "the store formed the first generation with {world} workers, but the recipe has train.workers = {} (give `qsr rendezvous --workers` the same number)",
            recipe.train.workers
        )));
    }
    let mut facts = LaunchFacts::new(recipe, resume.as_ref().map(|(_, s)| s.step));
    let unfit = crate::worker::preflight(recipe, world, 1, gpu).err();
    let owner = comm.rank() == 0 && !args.spawned;
    let old_run = if owner && resume.is_none() { refuse_old_run(run_dir).err() } else { None };
    match (unfit, old_run) {
        (Some(e), _) if comm.rank() != 0 => return Err(bad_input(e)),
        (Some(e), _) | (None, Some(e)) => facts.refusal = Some(format!("{e:#}")),
        (None, None) => {}
    }
    agree(comm, &facts)?;
    if owner {
        prepare_run_dir(run_dir, recipe)?;
    }
    Ok(())
}

/// The training loop of one elastic worker, for the recipe's task.
fn run_member(spec: &RunSpec, job: &mut Elastic, first: Formed, model: TrainModel) -> Result<Option<Summary>> {
    let recipe = &spec.recipe;
    match model {
        TrainModel::Image(m) => {
            // The task reads BatchNorm facts from a model; the worker owns this one.
            let probe = m.deep_clone();
            Member::run(spec, job, first, m, |rank, k| ImageTask::new(recipe, &probe, rank, k, &spec.device))
        }
        TrainModel::Language(m) => {
            let gpt =
                recipe.model.as_gpt().ok_or_else(|| anyhow!("a GPT was built for a `model.kind` that is not gpt"))?;
            Member::run(spec, job, first, m, |rank, k| TextTask::new(recipe, gpt, rank, k, &spec.device))
        }
    }
}

/// What a step of the loop asks for next.
enum Next {
    Continue,
    /// The run diverged: every rank saw it at the same evaluation.
    Stop,
    /// Form the next generation at this sync: new workers wait, or the store ended this generation.
    Reform(String),
}

/// One elastic worker's state across generations.
struct Member<'a, T: Task, F> {
    spec: &'a RunSpec,
    job: &'a mut Elastic,
    make: F,
    pace: Pace,
    task: T,
    batches: T::Batches,
    worker: Worker<T::Module>,
    segment: Segment,
    /// The last completed global sync, and what a new generation continuing from it takes over.
    snap: (Snapshot, Handover),
    /// A streaming worker's averages in flight at that sync, waited for when the generation admits
    /// workers (nobody failed): the next generation keeps them ([`Worker::share_in_flight`]).
    held: Option<StreamState>,
    generation: u64,
}

/// What a new generation takes over from the rank holding the newest sync (the payload of its
/// [`LastSync`]): the run's counters then, and that sync's records (rank 0's as it wrote them; on
/// another rank the same records with its own training loss and byte counts), so that the new rank 0
/// restores any its predecessor died before writing.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Handover {
    counters: Counters,
    records: Vec<Record>,
}

impl<'a, T: Task, F: Fn(usize, usize) -> Result<T>> Member<'a, T, F> {
    fn run(
        spec: &'a RunSpec,
        job: &'a mut Elastic,
        (comm, side, m): Formed,
        model: T::Module,
        make: F,
    ) -> Result<Option<Summary>> {
        let recipe = &spec.recipe;
        let plan = recipe.plan()?;
        let task = make(m.rank, m.world_size)?;
        // Evaluation cadence and epochs are reckoned in the recipe's world, whatever the membership.
        let nominal = recipe.train.workers;
        let spe = if m.world_size == nominal { task.steps_per_epoch() } else { make(0, nominal)?.steps_per_epoch() };
        let pace = Pace { plan, spe };
        let joining = m.generation > 0;
        let mut driver = recipe.driver_config();
        driver.broadcast_initial &= !joining;
        let mut worker = Worker::new(model, recipe.optimizer.clone(), comm, pace.plan.cursor(), driver)?;
        crate::worker::set_up_syncs(&mut worker, recipe, side, m.rank == 0 && !joining)?;
        let (records, base) =
            if joining { (None, Counters::default()) } else { crate::worker::resume(spec, &pace.plan, &mut worker)? };
        let (end, step) = (pace.plan.end_step(), worker.cursor().step());
        let segment = Segment::start(spec, m.rank, end, step, records, base)?;
        let batches = task.batches(step, end)?;
        let snap = (worker.snapshot()?, Handover { counters: base, records: Vec::new() });
        let generation = m.generation;
        let held = None;
        let (resized, rank) = (if joining { None } else { resized(spec, &m) }, m.rank);
        let mut me = Member { spec, job, make, pace, task, batches, worker, segment, snap, held, generation };
        if joining {
            me.take_over(m, None, "a new worker joined")?;
        }
        if let Some(change) = resized {
            if rank == 0 {
                eprintln!("qsr: {} ({} workers now)", change.reason, change.world_size);
            }
            let record = me.record(step, base, change);
            me.segment.append(&record)?;
        }
        while !me.worker.cursor().is_done() {
            match me.step() {
                Ok(Next::Continue) => {}
                Ok(Next::Stop) => break,
                Ok(Next::Reform(why)) => me.reform(&why)?,
                Err(e) if is_peer_failure(&e) => me.reform(&format!("{e:#}"))?,
                Err(e) => return Err(e),
            }
        }
        let summary = me.segment.finish(spec, &me.pace, &me.task, &me.worker, true)?;
        me.segment.check_diverged(me.worker.rank())?;
        Ok(summary)
    }

    /// One training step; after a global sync, its evaluation and checkpoint, the new snapshot and
    /// whether to form the next generation now (rank 0 asks the store and tells the others).
    fn step(&mut self) -> Result<Next> {
        fault::at(self.worker.rank(), Point::Step(self.worker.cursor().step()));
        let report = self.task.train_step(&mut self.worker, &mut self.batches)?;
        self.segment.stepped(&self.worker, &report, &self.pace);
        // A round's end (streaming fragments sync inside rounds; their records are the round's).
        if !(report.info.sync_after && report.sync.is_some_and(|s| s.level == Level::Global)) {
            return Ok(Next::Continue);
        }
        if self.segment.synced(self.spec, &self.pace, &self.task, &mut self.worker, &report)? == AfterSync::Diverged {
            return Ok(Next::Stop);
        }
        self.worker.snapshot_into(&mut self.snap.0)?;
        let records = self.segment.sync_records().to_vec();
        self.snap.1 = Handover { counters: self.segment.counters(&self.worker), records };
        if self.worker.cursor().is_done() {
            return Ok(Next::Continue);
        }
        let mut answer = [0.0f32];
        if self.worker.rank() == 0 {
            answer[0] = match self.job.poll()? {
                Poll::Steady { waiting } => waiting as f32,
                Poll::Over => -1.0,
            };
        }
        self.worker.comm_mut().broadcast(&mut answer, 0).context("sharing the store's answer")?;
        Ok(match answer[0] {
            0.0 => Next::Continue,
            n if n < 0.0 => Next::Reform(format!("the store ended generation {}", self.generation)),
            n => {
                // Every rank is here at this sync: the averages in flight complete and are kept.
                self.held = self.worker.streaming_state()?;
                Next::Reform(format!("admitting {n} new worker(s)"))
            }
        })
    }

    /// Abandons the round in flight (back to the last completed sync) and continues in the next
    /// generation; a failure while it forms starts over, up to a few times.
    fn reform(&mut self, why: &str) -> Result<()> {
        let failed_at = self.worker.cursor().step();
        for attempt in 0.. {
            self.worker.restore_snapshot(&self.snap.0)?;
            let wall = self.segment.counters(&self.worker).wall_seconds;
            let counters = Counters { wall_seconds: wall, ..self.snap.1.counters };
            let handover = Handover { counters, ..self.snap.1.clone() };
            let state = LastSync { step: self.snap.0.step(), payload: serde_json::to_string(&handover)? };
            let formed = form(self.job, &self.spec.recipe, Some(state), why).and_then(|(comm, side, m)| {
                let invalid = |e: qsr_optim::OptimError| ElasticError::from(CommError::InvalidArgument(e.to_string()));
                self.worker.replace_comm(comm).map_err(invalid)?;
                if let Some(side) = side {
                    self.worker.set_streaming_comm(side).map_err(invalid)?;
                }
                Ok(m)
            });
            let result = match formed {
                Ok(m) => self.take_over(m, Some(failed_at), why),
                Err(e @ (ElasticError::Expelled { .. } | ElasticError::Store { .. })) => return Err(e.into()),
                Err(e) => Err(e.into()),
            };
            match result {
                Ok(()) => return Ok(()),
                Err(e) if attempt < 5 && (is_peer_failure(&e) || is_setup_failure(&e)) => {
                    eprintln!("qsr: forming the next generation failed ({e:#}); trying again");
                }
                Err(e) => return Err(e),
            }
        }
        unreachable!("the loop returns")
    }

    /// Continues in generation `m`: the newest sync from its source rank, its counters, this rank's
    /// shard, and (rank 0) the membership record. `failed_at` is where this worker's round was
    /// abandoned (`None` for a new worker).
    fn take_over(&mut self, m: Membership, failed_at: Option<u64>, why: &str) -> Result<()> {
        let Some(state) = &m.state else {
            bail!("generation {} formed without any worker holding a completed sync", m.generation);
        };
        let step = state.step;
        fault::disarm();
        let source = m.source.unwrap_or(0);
        self.worker.adopt(source, self.pace.plan.cursor_at(step))?;
        if self.spec.recipe.sync.streaming.is_some() {
            self.worker.share_in_flight(source, self.held.take())?;
        }
        let handover: Handover = serde_json::from_str(&state.payload).context("the counters handed over")?;
        let base = handover.counters;
        let failed_at = failed_at.unwrap_or(step);
        let change = MembershipChange {
            generation: m.generation,
            world_size: m.world_size,
            lost: m.lost.clone(),
            joined: m.joined.clone(),
            reason: why.to_string(),
            rounds_lost: u64::from(failed_at > step),
            steps_lost: failed_at.saturating_sub(step),
        };
        let record = self.record(step, base, change);
        self.segment.rebase(self.spec, &mut self.worker, base, &handover.records, record)?;
        self.task = (self.make)(m.rank, m.world_size)?;
        self.batches = self.task.batches(step, self.pace.plan.end_step())?;
        self.generation = m.generation;
        self.snap = (self.worker.snapshot()?, Handover { counters: base, records: handover.records });
        if m.rank == 0 {
            eprintln!(
                "qsr: generation {} continues from step {step} with {} workers (lost {:?}, joined {:?}): {why}",
                m.generation,
                m.world_size,
                m.lost.iter().map(|l| l.rank).collect::<Vec<_>>(),
                m.joined
            );
        }
        Ok(())
    }

    /// The `membership` record of a change at `step`.
    fn record(&self, step: u64, c: Counters, change: MembershipChange) -> Record {
        let lr = self.pace.plan.lr(step.min(self.pace.plan.end_step().saturating_sub(1)));
        let h = self.worker.cursor().round().len;
        let counted = Record::counted("membership", step, self.pace.epoch(step), lr, h, c);
        Record { membership: Some(change), ..counted }
    }
}

/// The membership change of an elastic resume with another number of workers than wrote the
/// checkpoint (N9): its ranks this generation lacks are lost, those past its own joined.
fn resized(spec: &RunSpec, m: &Membership) -> Option<MembershipChange> {
    let (_, state) = spec.resume.as_ref()?;
    let (was, now) = (state.world_size, m.world_size);
    let reason = format!("the job resumed with {now} workers");
    (was != now).then(|| MembershipChange {
        generation: m.generation,
        world_size: now,
        lost: (now..was).map(|rank| qsr_elastic::Lost { rank, reason: reason.clone() }).collect(),
        joined: (was..now).collect(),
        reason: format!("resumed from the checkpoint at step {} written by {was} workers", state.step),
        rounds_lost: 0,
        steps_lost: 0,
    })
}

/// Whether forming a generation's ring failed (a member of it died meanwhile): worth another try.
fn is_setup_failure(e: &anyhow::Error) -> bool {
    crate::exit::comm_errors(e).any(|c| matches!(c, CommError::Rendezvous(_) | CommError::HandshakeRefused { .. }))
}
