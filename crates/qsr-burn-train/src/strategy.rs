//! [`LocalTrainingStrategy`]: burn-train's `SupervisedLearningStrategy` for local methods.

use std::any::Any;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use burn::data::dataloader::DataLoader;
use burn::tensor::Device;
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    Interrupter, Learner, LearnerModel, SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader,
    TrainingComponents, TrainingError, ValidLoader, train::WorkerFailure,
};
use qsr_comm::{Collective, InProcessGroup};
use qsr_optim::{Averager, AveragerConfig, AveragerStats};

use crate::metric::{AveragerMetric, Feeds};
use crate::replica::{Failure, Replica};
use crate::report::Reporter;
use crate::resume::ReplicaFiles;
use crate::shard::{Batch, BuildShard, Shard, Source};

/// Where a [`LocalTrainingStrategy`]'s replicas run.
#[derive(Debug, Clone)]
pub enum Replicas {
    /// One replica per device, each on its own thread of this process, averaged over qsr's in-process
    /// group: K simulated workers (the same device K times is fine, e.g. `vec![Device::flex().autodiff(); 4]`).
    Threads(Vec<Device>),
    /// One replica in this process, on this device, averaged over the launch's collective
    /// ([`qsr_comm::from_env`]): run the same program under torchrun, mpirun or srun, one process per worker.
    Launched(Device),
}

impl Replicas {
    /// As the launcher says: one replica in this process ([`Replicas::Launched`]) when `qsr launch`,
    /// torchrun, mpirun or srun started it, else `threads` replicas as threads of this process
    /// ([`Replicas::Threads`], all on `device`), or as many as `QSR_WORKERS` says when set. The same
    /// program then runs as threads (`cargo run`) and as processes (`qsr-launch --nproc 2 -- ...`).
    pub fn from_env(device: Device, threads: usize) -> Result<Self, qsr_comm::CommError> {
        Ok(match qsr_comm::unlaunched_threads(threads)? {
            Some(k) => Replicas::Threads(vec![device; k]),
            None => Replicas::Launched(device),
        })
    }

    /// How many replicas train: the threads, or the launched job's world size (1 where the
    /// launcher's variables cannot be read; joining the launch then names the variable).
    pub fn count(&self) -> usize {
        match self {
            Replicas::Threads(devices) => devices.len(),
            Replicas::Launched(_) => {
                qsr_comm::detect_from_process_env(&qsr_comm::Explicit::default()).map_or(1, |e| e.world_size)
            }
        }
    }
}

/// A burn-train strategy for Local SGD / Local AdamW: every replica trains a clone of the Learner (the
/// model, **the Learner's own optimizer and lr scheduler**) on its own shard of the training data, and a
/// [`qsr_optim::Averager`] averages the replicas' parameters whenever a round of the sync rule ends,
/// each round's `H` picked from the lr the Learner's scheduler produced (QSR: at the round's start).
///
/// What it does with the rest of burn-train (each choice because replicas must call collectives at
/// the same steps):
/// - **Data**: with [`with_shards`](Self::with_shards), each replica trains on the loader the user's
///   function builds for its rank and epoch (over `qsr_data::ShardedDataset`: every rank strided over
///   a fresh permutation of the whole dataset each epoch, as `qsr train` samples). Without it, the
///   Learner's training loader is cut into K equal contiguous slices (burn's `DataLoader::slice`, the
///   remainder of `items / K` dropped so every replica takes the same number of steps): a loader holds
///   no dataset the strategy could stride over, so on data stored in class order each replica would
///   train on a few classes; the loader's `.shuffle(seed)` only reorders each slice.
/// - **Events and metrics**: rank 0 reports its own replica's training items, with the averager's
///   counts for [`syncs_metric`](Self::syncs_metric) and [`traffic_metric`](Self::traffic_metric)
///   (an epoch's value includes the average that ends it). After each epoch it
///   validates the replicas' average: the mean of their current parameters ([`Averager::mean`], one
///   all-reduce of the parameters, not counted as a sync, the round going on), and after the last
///   epoch the model the Learner returns. burn-train's best-checkpoint choice and early stopping
///   therefore judge the average, and the last validation is of the model returned (an early stop
///   returns the mean it validated).
/// - **Checkpoints**: burn-train's checkpointer saves rank 0's Learner holding that average. With
///   [`with_checkpoints`](Self::with_checkpoints) every replica also saves its own state each epoch, and
///   a run resumed with burn-train's `.checkpoint(epoch)` continues on the bits of the run that was not
///   interrupted. Without it, resuming starts every replica from burn-train's checkpoint (the averager
///   broadcasts rank 0's parameters; each replica's optimizer state is rank 0's) and restarts the
///   averager's step count, so set `warmup_steps` for the resumed part.
/// - **Stopping**: an interruption or early stopping takes effect at the end of an epoch, on every rank
///   together (one 4-byte all-reduce per epoch); a failed rank fails the others at their next collective.
/// - Gradient accumulation counts one optimizer step per accumulated batch group, as burn-train does.
/// - **The lr scheduler** steps once per replica step: size it for a replica's steps (its `1/K` of the
///   loader's batches times the epochs), not the whole loader's. A scheduler that decays to its end
///   long after the run ends (cosine, linear sized for the whole loader) is refused before the first
///   step (the replica's steps estimated from its first batch), naming the step count to give it: the
///   sync rule would otherwise follow lrs that never decay as planned.
pub struct LocalTrainingStrategy {
    replicas: Replicas,
    config: AveragerConfig,
    stats: Mutex<Option<AveragerStats>>,
    /// Where every replica saves its own state each epoch ([`LocalTrainingStrategy::with_checkpoints`]).
    checkpoints: Option<PathBuf>,
    /// A `BuildShard<I>` from [`LocalTrainingStrategy::with_shards`] (typed when `fit` knows the
    /// model's batch type `I`).
    shards: Option<Arc<dyn Any + Send + Sync>>,
    /// Where rank 0 publishes the averager's counts to the metrics made by the strategy.
    feeds: Arc<Feeds>,
}

/// What every replica follows, from [`TrainingComponents`] (shared by reference with the threads).
struct Run {
    epochs: std::ops::RangeInclusive<usize>,
    grad_accumulation: Option<usize>,
    interrupter: Interrupter,
    /// What burn-train's checkpointers are called with (the replicas' own, [`ReplicaFiles`], too).
    event_store: Arc<EventStoreClient>,
    /// The items of the Learner's training loader, which `with_shards`' loaders split.
    loader_items: usize,
}

impl LocalTrainingStrategy {
    /// Replicas placed as `replicas` says, averaged as `config` says (any rule: `dp` and `post-local`
    /// before its switch average gradients before the Learner's optimizer step, the others parameters
    /// after it).
    pub fn new(replicas: Replicas, config: AveragerConfig) -> Self {
        let feeds = Arc::default();
        Self { replicas, config, stats: Mutex::new(None), checkpoints: None, shards: None, feeds }
    }

    /// Each replica trains on the loader `build` makes for its [`Shard`] (rank, world size, epoch) at the
    /// start of every epoch, instead of a contiguous slice of the Learner's loader: e.g. a DataLoader
    /// over `qsr_data::ShardedDataset` at that epoch, which strides every rank over a fresh permutation
    /// of the whole dataset (the slices give each replica a few classes of class-ordered data). Every
    /// rank's loader must hold the same number of items: its `1/K` of the Learner's own training loader,
    /// which is then not trained on but says how many items the shards split (a shard of another
    /// dataset is refused before the first step). (`examples/learner_digits.rs` is a complete program.)
    ///
    /// ```text
    /// let data = Arc::new(InMemDataset::new(items));
    /// let strategy = LocalTrainingStrategy::new(replicas, config).with_shards(move |s: Shard| {
    ///     let shard = ShardedDataset::new(Arc::clone(&data), s.rank, s.world_size, SEED)?;
    ///     shard.set_epoch(s.epoch as u64);
    ///     // No `.shuffle`: the shard holds the epoch's order, a function of (SEED, epoch).
    ///     Ok::<_, qsr_data::DataError>(DataLoaderBuilder::new(MyBatcher).batch_size(32).build(shard))
    /// });
    /// ```
    pub fn with_shards<I, E>(
        mut self,
        build: impl Fn(Shard) -> Result<Arc<dyn DataLoader<I>>, E> + Send + Sync + 'static,
    ) -> Self
    where
        I: 'static,
        E: std::fmt::Display,
    {
        let build: BuildShard<I> = Arc::new(move |s| build(s).map_err(|e| e.to_string()));
        self.shards = Some(Arc::new(build));
        self
    }

    /// Every replica saves its own state after each epoch into `dir/rank-<r>/` (its Learner through
    /// burn-train's file checkpointer, and its averager's rounds), and a run resumed with burn-train's
    /// `.checkpoint(epoch)` continues each replica from its own: it ends on the same bits as the run
    /// that was not interrupted (with [`with_shards`](Self::with_shards), whose loaders depend on the
    /// epoch alone). Every epoch is kept, as burn-train may resume from any it kept; each costs K
    /// models and optimizer states on disk. Without it a resumed run starts every replica from
    /// burn-train's checkpoint (the average) and restarts the rounds. Launched ranks must share one
    /// burn-train directory (and `dir`): rank 0 writes burn-train's checkpoints, and on a resume
    /// burn-train reads them on every rank before the strategy runs (it panics where they are missing).
    pub fn with_checkpoints(mut self, dir: impl Into<PathBuf>) -> Self {
        self.checkpoints = Some(dir.into());
        self
    }

    /// The function of [`with_shards`](Self::with_shards), for model `M`; an error when it builds loaders
    /// of another batch type than `M` trains on.
    fn build_shard<M: LearnerModel + 'static>(&self) -> Result<Option<BuildShard<Batch<M>>>, String> {
        let Some(any) = &self.shards else {
            return Ok(None);
        };
        let build = any.downcast_ref::<BuildShard<Batch<M>>>().cloned();
        build.map(Some).ok_or_else(|| "with_shards builds loaders of another batch type than the model's".into())
    }

    /// A burn-train metric of the run's synchronizations so far, with the epoch's share (rank 0's
    /// averager): `.metric_train_numeric(strategy.syncs_metric())`.
    pub fn syncs_metric(&self) -> AveragerMetric {
        AveragerMetric::new(&self.feeds, true)
    }

    /// A burn-train metric of the megabytes of parameters rank 0 sent so far, with the epoch's share:
    /// `.metric_train_numeric(strategy.traffic_metric())`.
    pub fn traffic_metric(&self) -> AveragerMetric {
        AveragerMetric::new(&self.feeds, false)
    }

    /// The averager's totals (steps, synchronizations, traffic) of this process's first replica (rank 0
    /// with [`Replicas::Threads`]) after the last training: read them after `launch` returns.
    pub fn stats(&self) -> Option<AveragerStats> {
        *self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn fit_threads<M: LearnerModel + 'static>(
        &self,
        devices: &[Device],
        run: Run,
        (learner, train): (Learner<M>, TrainLoader<M>),
        reporter: Reporter<M>,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let shards = match self.build_shard::<M>() {
            Ok(build) => crate::shard::sources::<M>(&train, devices.len(), build.as_ref()),
            Err(message) => {
                run.interrupter.fail(failure(0, 0, message));
                return (learner.model(), reporter.into_processor());
            }
        };
        let comms = InProcessGroup::new(devices.len());
        let run = &run;
        std::thread::scope(|s| {
            let mut lanes = comms.into_iter().zip(shards).zip(devices);
            let Some(((comm0, shard0), device0)) = lanes.next() else {
                run.interrupter.fail(failure(0, 0, "Replicas::Threads(vec![]) lists no device to train on".into()));
                return (learner.model(), reporter.into_processor());
            };
            let others: Vec<_> = lanes
                .map(|((comm, shard), device)| {
                    let learner = learner.clone();
                    s.spawn(move || {
                        self.replica(run, learner, Box::new(comm), shard, device, (None, false)).map(|_| ())
                    })
                })
                .collect();
            let (model, processor) = self.rank0(run, learner, Box::new(comm0), shard0, device0, reporter);
            for (rank, handle) in (1..).zip(others) {
                if let Ok(Err(message)) | Err(message) = handle.join().map_err(panic_message) {
                    run.interrupter.fail(failure(rank, rank, message));
                }
            }
            (model, processor)
        })
    }

    fn fit_launched<M: LearnerModel + 'static>(
        &self,
        device: &Device,
        run: Run,
        (learner, train): (Learner<M>, TrainLoader<M>),
        reporter: Reporter<M>,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let comm = match qsr_comm::from_env() {
            Ok(comm) => comm,
            Err(e) => {
                let message = format!("qsr: this process cannot join the launch: {e}");
                run.interrupter.fail(TrainingError::Workers(vec![WorkerFailure { device_id: 0, message }]));
                return (learner.model(), reporter.into_processor());
            }
        };
        let (rank, k) = (comm.rank(), comm.world_size());
        let shard = match self.build_shard::<M>() {
            Ok(build) => crate::shard::sources::<M>(&train, k, build.as_ref()).swap_remove(rank),
            Err(message) => {
                run.interrupter.fail(failure(rank, 0, message));
                return (learner.model(), reporter.into_processor());
            }
        };
        if rank == 0 {
            return self.rank0(&run, learner, comm, shard, device, reporter);
        }
        let processor = reporter.into_processor();
        match self.replica(&run, learner.clone(), comm, shard, device, (None, true)) {
            Ok(model) => (model, processor),
            Err(message) => {
                run.interrupter.fail(failure(rank, 0, message));
                (learner.model(), processor)
            }
        }
    }

    /// Rank 0: its replica, reporting through burn-train's event processor.
    fn rank0<M: LearnerModel>(
        &self,
        run: &Run,
        learner: Learner<M>,
        comm: Box<dyn Collective>,
        shard: Source<M>,
        device: &Device,
        mut reporter: Reporter<M>,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        match self.replica(run, learner.clone(), comm, shard, device, (Some(&mut reporter), true)) {
            Ok(model) => (model, reporter.into_processor()),
            Err(message) => {
                run.interrupter.fail(failure(0, 0, message));
                (learner.model(), reporter.into_processor())
            }
        }
    }

    /// One replica from start to end: joins the group, trains every epoch, agrees with the others on
    /// stopping after each, averages at the end; `reporter` on rank 0, `record_stats` on this process's
    /// first replica. Errors are returned as text for burn-train's result.
    fn replica<M: LearnerModel>(
        &self,
        run: &Run,
        learner: Learner<M>,
        comm: Box<dyn Collective>,
        source: Source<M>,
        device: &Device,
        (mut reporter, record_stats): (Option<&mut Reporter<M>>, bool),
    ) -> Result<M, String> {
        let (mut replica, mut files) = self.join(run, learner, comm, &source, device)?;
        let result = self.epochs(run, &mut replica, (&mut reporter, files.as_mut()), (&source, device));
        if result.is_err() {
            // The run ends on an error it reports; the last round's steps are not lost by mistake.
            replica.avg.abandon();
        }
        if record_stats {
            *self.stats.lock().unwrap_or_else(PoisonError::into_inner) = Some(*replica.avg.stats());
        }
        match result {
            Ok(model) => Ok(model),
            Err(Failure::Training(e)) => {
                run.interrupter.fail(e);
                Ok(replica.learner.model())
            }
            Err(Failure::Qsr(e)) => Err(e.to_string()),
            Err(Failure::Shard(message) | Failure::Save(message)) => Err(message),
        }
    }

    /// A replica ready for its first step: the ranks agree on what decides their step counts, every
    /// replica takes rank 0's parameters, and a resumed one with `with_checkpoints` its own state.
    fn join<M: LearnerModel>(
        &self,
        run: &Run,
        mut learner: Learner<M>,
        mut comm: Box<dyn Collective>,
        source: &Source<M>,
        device: &Device,
    ) -> Result<(Replica<M>, Option<ReplicaFiles<M>>), String> {
        let shard = source.for_epoch(*run.epochs.start())?.to_device(device);
        learner.fork(device);
        // Every rank must take the same number of steps: check what decides it before the first one.
        let settings = serde_json::json!({
            "shard_items": shard.num_items(),
            "epochs": [run.epochs.start(), run.epochs.end()],
            "grad_accumulation": run.grad_accumulation,
        });
        qsr_comm::agree(comm.as_mut(), &settings).map_err(|e| e.to_string())?;
        if shard.num_items() == 0 {
            return Err(format!(
                "its slice of the training loader is empty: fewer training items than the {} replicas",
                comm.world_size()
            ));
        }
        let rank = comm.rank();
        if let Source::Built { .. } = source {
            crate::shard::check_split(rank, comm.world_size(), shard.num_items(), run.loader_items)?;
        }
        let place = (rank, comm.world_size());
        // Judged on a loader of its own: the probe's batch is not a read of the shard training reads.
        let probe = source.for_epoch(*run.epochs.start())?;
        crate::horizon::judge(&learner, &self.config, &probe, (&run.epochs, run.grad_accumulation), place)?;
        let mut model = learner.model();
        let mut avg = Averager::new(&mut model, self.config.clone(), comm).map_err(|e| e.to_string())?;
        learner.load_model(model.into_record());
        let store = || Arc::clone(&run.event_store);
        let files = self.checkpoints.as_deref().map(|dir| ReplicaFiles::new(dir, rank, store(), &run.interrupter));
        match (&files, run.epochs.start() - 1) {
            (Some(files), resumed @ 1..) => learner = files.load(learner, &mut avg, resumed)?,
            (None, resumed @ 1..) if rank == 0 => qsr_comm::notice(
                true,
                &format!(
                    "qsr-burn-train: resumed after epoch {resumed} without `with_checkpoints`: every replica starts \
                     from burn-train's checkpoint (the average) and the rounds start over, so the run will not end \
                     on the bits of one never stopped; give the strategy `with_checkpoints(dir)` in every run"
                ),
            ),
            _ => {}
        }
        Ok((Replica { learner, avg, train: shard, grad_accumulation: run.grad_accumulation }, files))
    }

    /// The epochs, then the final average; returns the model the last validation saw.
    fn epochs<M: LearnerModel>(
        &self,
        run: &Run,
        replica: &mut Replica<M>,
        (reporter, mut files): (&mut Option<&mut Reporter<M>>, Option<&mut ReplicaFiles<M>>),
        (source, device): (&Source<M>, &Device),
    ) -> Result<M, Failure> {
        for epoch in run.epochs.clone() {
            if epoch != *run.epochs.start() && matches!(source, Source::Built { .. }) {
                replica.train = source.for_epoch(epoch).map_err(Failure::Shard)?.to_device(device);
            }
            if let Some(r) = reporter.as_deref_mut() {
                r.start_epoch(epoch, replica.train.num_items(), replica.avg.stats());
                replica.train_epoch(|item, stats| r.item(item, stats))?;
            } else {
                replica.train_epoch(|_, _| ())?;
            }
            if let Some(model) = self.end_epoch(run, epoch, replica, reporter, files.as_deref_mut())? {
                return Ok(model);
            }
        }
        Ok(replica.finish(false)?)
    }

    /// After `epoch`: every rank agrees on an interruption, then averages (the run's last epoch, or
    /// an interrupted one) or takes the mean without ending the round; each saves its own state, and
    /// rank 0 validates that model, checkpoints it and asks early stopping. `Some(model validated)`
    /// when the run ends here.
    fn end_epoch<M: LearnerModel>(
        &self,
        run: &Run,
        epoch: usize,
        replica: &mut Replica<M>,
        reporter: &mut Option<&mut Reporter<M>>,
        files: Option<&mut ReplicaFiles<M>>,
    ) -> Result<Option<M>, Failure> {
        let ends = epoch == *run.epochs.end() || replica.avg.any(run.interrupter.should_stop())?;
        let model = match ends {
            true => replica.finish(epoch != *run.epochs.end())?,
            false => replica.avg.mean(&replica.learner.model())?,
        };
        if let (Some(files), false) = (files, ends) {
            files.save(&replica.learner, &mut replica.avg, epoch).map_err(Failure::Save)?;
        }
        let mut early = false;
        if let Some(r) = reporter.as_deref_mut() {
            r.end_training(epoch, replica.avg.stats());
            let mut shown = replica.learner.clone();
            shown.load_model(model.clone().into_record());
            early = r.end_epoch(epoch, &shown);
        }
        if ends {
            return Ok(Some(model));
        }
        if replica.avg.any(early)? {
            // The replicas end on their average; the model returned is the one validated.
            replica.finish(true)?;
            return Ok(Some(model));
        }
        Ok(None)
    }
}

impl<M: LearnerModel + 'static> SupervisedLearningStrategy<M> for LocalTrainingStrategy {
    fn fit(
        &self,
        components: TrainingComponents<M>,
        learner: Learner<M>,
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        // burn-train's subscriber writes its experiment log: qsr's warnings go to the console too.
        qsr_comm::notices_on_stderr(true);
        let run = Run {
            epochs: starting_epoch..=components.num_epochs,
            grad_accumulation: components.grad_accumulation,
            interrupter: components.interrupter.clone(),
            event_store: Arc::clone(&components.event_store),
            loader_items: train.num_items(),
        };
        match &self.replicas {
            Replicas::Threads(devices) => {
                let main = devices.first().cloned().unwrap_or_default();
                let reporter = Reporter::new(components, valid, &main, Arc::clone(&self.feeds));
                self.fit_threads(devices, run, (learner, train), reporter)
            }
            Replicas::Launched(device) => {
                let reporter = Reporter::new(components, valid, device, Arc::clone(&self.feeds));
                self.fit_launched(device, run, (learner, train), reporter)
            }
        }
    }
}

/// burn-train's error for replica `rank`'s failure on `device`, the index of its device in this
/// process (burn-train's message names it: a thread's place in `Replicas::Threads`, a launched
/// process's one device, 0).
fn failure(rank: usize, device: usize, message: String) -> TrainingError {
    TrainingError::Workers(vec![WorkerFailure { device_id: device, message: format!("qsr replica {rank}: {message}") }])
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    let text = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
    format!("panicked: {}", text.unwrap_or_else(|| "(no message)".into()))
}

#[cfg(test)]
mod tests {
    /// The Learner trial: a launched rank's error named its rank as a device ("training worker on
    /// device 3"); a process has one device, 0, and the rank is qsr's.
    #[test]
    fn a_launched_ranks_failure_names_its_rank_and_its_one_device() {
        let text = super::failure(3, 0, "its shard failed".into()).to_string();
        assert_eq!(text, "training worker on device 0 failed: qsr replica 3: its shard failed");
    }
}
