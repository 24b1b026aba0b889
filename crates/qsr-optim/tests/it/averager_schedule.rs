//! Issue 57, item 4: an Averager given the loop's lr schedule (`AveragerConfig::schedule`) catches a
//! wrong plan while it costs little: a scheduler sized for the whole dataset before the first step,
//! the constant peak lr passed within the run's first tenth, and the run's last step reports the
//! syncs made against those planned.

use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::tensor::Device;
use qsr_comm::{Collective, InProcessGroup};
use qsr_optim::{Averager, AveragerConfig, OptimError};

use crate::averager::Captured;
use crate::common::Mlp;

/// The loop's steps: a rank's shard of 400 batches, over 4 ranks.
const STEPS: usize = 100;

fn cosine(peak: f64, steps: usize) -> ModuleLrScheduler {
    CosineAnnealingLrSchedulerConfig::new(peak, steps).init().unwrap()
}

/// Runs `f` with a tracing subscriber that records what is printed; returns `f`'s value and the lines.
fn printed<T>(f: impl FnOnce() -> T) -> (T, Vec<String>) {
    let out = Captured::default();
    let writer = out.clone();
    let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
    let value = tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    (value, text.lines().map(str::to_owned).collect())
}

fn warnings(lines: &[String]) -> Vec<&String> {
    lines.iter().filter(|l| l.contains("WARN")).collect()
}

fn averager(config: AveragerConfig) -> Result<(Averager, Mlp), OptimError> {
    let mut model = Mlp::new(&Device::flex(), 4, 1);
    Ok((Averager::new(&mut model, config, Box::new(InProcessGroup::new(1).remove(0)))?, model))
}

/// The trial's first mistake: a cosine sized for the whole dataset's 400 batches while this rank's
/// loop takes 100. Warned by `Averager::new`, before the first step, naming where the lr ends.
#[test]
fn a_scheduler_sized_for_the_whole_dataset_is_warned_before_the_first_step() {
    let config = AveragerConfig::qsr(2, 0.01).schedule(&cosine(0.05, 4 * STEPS), STEPS);
    let (built, lines) = printed(|| averager(config));
    built.unwrap();
    let warned = warnings(&lines);
    let ended = warned.iter().find(|w| w.contains("the schedule over its 100 steps: the lr ended at 0.042"));
    assert!(ended.is_some_and(|w| w.contains("86% of its peak 0.05")), "{lines:?}");
    // Its lrs stay high, so QSR's rounds stay at h_base: warned too, and nothing else.
    assert!(warned.iter().all(|w| w.contains("lr ended") || w.contains("lengthens few rounds")), "{lines:?}");
    // Sized for the loop, the same schedule warns of nothing.
    let (built, lines) = printed(|| averager(AveragerConfig::qsr(2, 0.01).schedule(&cosine(0.05, STEPS), STEPS)));
    built.unwrap();
    assert!(warnings(&lines).is_empty(), "{lines:?}");
}

/// The trial's second mistake: the scheduler's constant peak passed to `step` instead of each
/// step's lr. Warned at the second step (the cosine's first lr is its peak), inside the first tenth
/// of the run, and only there: the trial saw the same cause warned 4 times more (syncs ahead of the
/// plan, one lr throughout, the syncs made against those planned). The last step reports the syncs
/// made against the plan's.
#[test]
fn the_peak_lr_passed_instead_of_the_schedules_is_warned_in_the_first_tenth_and_only_there() {
    let sched = cosine(0.05, STEPS);
    let (built, _) = printed(|| averager(AveragerConfig::qsr(2, 0.01).schedule(&sched, STEPS)));
    let (mut avg, mut model) = built.unwrap();
    let (mut first_warning, mut warned) = (None, 0);
    let mut last = Vec::new();
    for t in 0..STEPS {
        let (stepped, lines) = printed(|| avg.step_with_lr(model.clone(), 0.05));
        model = stepped.unwrap();
        warned += warnings(&lines).len();
        if first_warning.is_none() && !warnings(&lines).is_empty() {
            first_warning = Some((t, lines));
        } else {
            last = lines;
        }
    }
    assert_eq!(warned, 1, "{last:?}");
    let (t, lines) = first_warning.expect("no warning");
    assert!(t < STEPS / 10, "warned at step {t}");
    assert!(lines[0].contains("step 2 passed lr 0.05, but the schedule given to `AveragerConfig::schedule` has 0.04"));
    // The run's last step reports; `finish` after it has nothing to add.
    let lines = last;
    let (finished, after) = printed(|| avg.finish(model));
    finished.unwrap();
    assert!(after.is_empty(), "{after:?}");
    let planned = AveragerConfig::qsr(2, 0.01)
        .round_lengths({
            let mut s = sched.clone();
            (0..STEPS).map(move |_| s.step().base())
        })
        .unwrap()
        .len();
    let made = avg.stats().syncs;
    assert_ne!(made, planned as u64);
    let report = format!("Averager: {made} syncs in 100 steps, the schedule planned {planned}");
    assert!(lines.iter().any(|l| l.contains("INFO") && l.contains(&report)), "{lines:?}");
}

/// The schedule followed, across a save and restore mid-run: no warning, and the syncs made equal
/// the plan's, as `AveragerConfig::round_lengths` counts them.
#[test]
fn a_schedule_followed_across_a_resume_warns_of_nothing_and_meets_its_plan() {
    let sched = cosine(0.05, STEPS);
    let config = || AveragerConfig::qsr(2, 0.01).schedule(&sched, STEPS);
    let mut lrs = sched.clone();
    let lrs: Vec<f64> = (0..STEPS).map(|_| lrs.step().base()).collect();
    let (run, lines) = printed(|| {
        let (mut first, mut model) = averager(config())?;
        for &lr in &lrs[..40] {
            model = first.step_with_lr(model, lr)?;
        }
        let state = first.state()?;
        first.abandon();
        let (mut resumed, mut model) = averager(config())?;
        resumed.restore(state)?;
        for &lr in &lrs[40..] {
            model = resumed.step_with_lr(model, lr)?;
        }
        resumed.finish(model)?;
        Ok::<_, OptimError>(resumed.stats().syncs)
    });
    let planned = config().round_lengths(lrs.iter().copied()).unwrap().len() as u64;
    assert_eq!(run.unwrap(), planned);
    assert!(warnings(&lines).is_empty(), "{lines:?}");
    assert!(lines.iter().any(|l| l.contains(&format!("{planned} syncs in 100 steps, the schedule planned {planned}"))));
}

/// Ranks whose schedules differ (one sized for the shard, one for the whole dataset) are refused
/// at construction, every rank naming the schedule.
#[test]
fn ranks_with_different_schedules_are_refused_naming_the_schedule() {
    let errors = qsr_comm::run_threads(2, |comm| {
        let steps = if comm.rank() == 0 { STEPS } else { 4 * STEPS };
        let config = AveragerConfig::qsr(2, 0.01).schedule(&cosine(0.05, steps), STEPS);
        Averager::new(&mut Mlp::new(&Device::flex(), 4, 1), config, Box::new(comm)).err()
    });
    for e in errors {
        let e = e.expect("a different schedule was accepted");
        assert!(matches!(&e, OptimError::Config { field, .. } if field == "schedule"), "{e}");
        assert!(e.to_string().contains("lr schedules differ"), "{e}");
    }
}

/// `run_steps` changed after `schedule` set it: refused naming the field, not a plan of another length.
#[test]
fn run_steps_other_than_the_schedules_is_refused() {
    let mut config = AveragerConfig::qsr(2, 0.01).schedule(&cosine(0.05, STEPS), STEPS);
    config.run_steps = Some(50);
    let Err(e) = averager(config) else { panic!("accepted") };
    assert!(matches!(&e, OptimError::Config { field, .. } if field == "run_steps"), "{e}");
}

/// The Learner trial: the warning of a loop that ended before `run_steps` came with runs of spaces
/// where its string was continued without a backslash. One sentence now, naming both counts.
#[test]
fn a_loop_that_ends_before_run_steps_is_warned_in_one_clean_sentence() {
    let sched = cosine(0.05, STEPS);
    let (built, _) = printed(|| averager(AveragerConfig::qsr(2, 0.01).schedule(&sched, STEPS)));
    let (mut avg, mut model) = built.unwrap();
    let mut s = sched.clone();
    for _ in 0..STEPS / 2 {
        let lr = s.step().base();
        model = avg.step_with_lr(model, lr).unwrap();
    }
    let (finished, lines) = printed(|| avg.finish(model));
    finished.unwrap();
    let warned = warnings(&lines);
    let ended = warned.iter().find(|l| l.contains("the loop ended after 50 of the 100 steps the schedule was given"));
    let ended = ended.unwrap_or_else(|| panic!("{lines:?}"));
    // tracing pads its level; the message after it has no run of spaces.
    assert!(!ended.split("WARN").nth(1).unwrap_or(ended).contains("  "), "{ended}");
}

/// Issue 57: `Averager::step` takes each step's lr from the schedule given, so the rounds follow the
/// loop's scheduler without the loop passing lrs; the run's last step averages and reports the syncs
/// against the plan, and a `finish` after it changes and says nothing.
#[test]
fn a_scheduled_step_follows_the_schedule_and_its_last_step_ends_the_run() {
    let sched = cosine(0.05, STEPS);
    let config = AveragerConfig::qsr(2, 0.01).schedule(&sched, STEPS);
    let mut sampled = sched.clone();
    let planned = config.round_lengths((0..STEPS).map(|_| sampled.step().base())).unwrap();
    let (built, _) = printed(|| averager(config));
    let (mut avg, mut model) = built.unwrap();
    let (stepped, lines) = printed(|| {
        for _ in 0..STEPS {
            model = avg.step(model.clone())?;
        }
        Ok::<_, OptimError>(model)
    });
    let model = stepped.unwrap();
    assert_eq!(avg.stats().syncs, planned.len() as u64);
    assert_eq!(avg.unsynced_steps(), 0, "the last step averaged");
    let report = format!("{} syncs in {STEPS} steps, the schedule planned {}", planned.len(), planned.len());
    assert!(lines.iter().any(|l| l.contains(&report)), "{lines:?}");
    assert!(warnings(&lines).is_empty(), "{lines:?}");
    let (finished, lines) = printed(|| avg.finish(model));
    finished.unwrap();
    assert!(lines.is_empty(), "{lines:?}");
    assert_eq!(avg.stats().syncs, planned.len() as u64);
}

/// Issue 57: `Averager::step` without a schedule cannot know the lrs: refused naming `schedule`
/// and the two ways to give them.
#[test]
fn a_step_without_a_schedule_is_refused_naming_it() {
    let (mut avg, model) = averager(AveragerConfig::qsr(2, 0.01)).unwrap();
    let e = avg.step(model).unwrap_err().to_string();
    assert!(e.contains("`schedule`") && e.contains("AveragerConfig::schedule") && e.contains("step_with_lr"), "{e}");
    avg.abandon();
}

/// Issue 57 (the trial): an alpha the lrs never fall far enough below (the README's 0.0025, copied
/// into a run at lr 0.05) made 177 syncs where h_base alone makes 192, and the end-of-run count
/// showed the plan met. Warned before the first step, naming both counts and the remedy.
#[test]
fn an_alpha_that_lengthens_few_rounds_is_warned_before_the_first_step() {
    let (built, lines) = printed(|| averager(AveragerConfig::qsr(2, 0.002).schedule(&cosine(0.05, STEPS), STEPS)));
    built.unwrap();
    let warned = warnings(&lines);
    assert_eq!(warned.len(), 1, "{lines:?}");
    assert!(warned[0].contains("alpha = 0.002 lengthens few rounds") && warned[0].contains("h_base = 2 makes 50"));
    assert!(warned[0].contains("qsr_for_budget"), "{lines:?}");
}

/// Issue 57 (the trial): a loop that ends before the schedule's steps (both sized for the whole
/// dataset) was told at the drop to set `run_steps`, which the schedule had set. The drop names the
/// step the loop ended at and the steps the schedule was given.
#[test]
fn a_loop_that_ends_before_the_schedule_is_told_where_at_its_drop() {
    let (built, _) = printed(|| averager(AveragerConfig::qsr(2, 0.01).schedule(&cosine(0.05, 4 * STEPS), 4 * STEPS)));
    let (mut avg, mut model) = built.unwrap();
    for _ in 0..STEPS - 1 {
        model = avg.step(model).unwrap();
    }
    let (_, lines) = printed(|| drop(avg));
    let warned = warnings(&lines);
    assert_eq!(warned.len(), 1, "{lines:?}");
    assert!(warned[0].contains("dropped after step 99 of the 400 given to `AveragerConfig::schedule`"), "{lines:?}");
    // The eighth trial: the syncs made were never said of a loop dropped early.
    assert!(lines.iter().any(|l| l.contains("INFO") && l.contains("syncs in 99 steps")), "{lines:?}");
    assert!(!warned[0].contains("set `AveragerConfig::run_steps`"), "{lines:?}");
    // A loop whose last step happened to end a round loses no step, but it still ended early.
    let (built, _) = printed(|| averager(AveragerConfig::qsr(2, 0.01).schedule(&cosine(0.05, 4 * STEPS), 4 * STEPS)));
    let (mut avg, mut model) = built.unwrap();
    for _ in 0..STEPS {
        model = avg.step(model).unwrap();
    }
    assert_eq!(avg.unsynced_steps(), 0);
    let (_, lines) = printed(|| drop(avg));
    let warned = warnings(&lines);
    assert_eq!(warned.len(), 1, "{lines:?}");
    assert!(warned[0].contains("dropped after step 100 of the 400") && warned[0].contains("never reached their end"));
}

/// Issue 57 (the Learner trial): a run stopped early on purpose was told its lr "ended at 52 % of its
/// peak", blaming a scheduler sized for the whole dataset. `finish` before the schedule's end judges
/// no lr end; it says where the loop stopped.
#[test]
fn a_run_stopped_early_is_not_judged_by_its_last_lr() {
    let (built, _) = printed(|| averager(AveragerConfig::qsr(2, 0.01).schedule(&cosine(0.05, STEPS), STEPS)));
    let (mut avg, mut model) = built.unwrap();
    for _ in 0..STEPS / 2 {
        model = avg.step(model).unwrap();
    }
    let (finished, lines) = printed(|| avg.finish(model));
    finished.unwrap();
    assert!(!lines.iter().any(|l| l.contains("the lr ended")), "{lines:?}");
    assert!(
        lines.iter().any(|l| l.contains("the loop ended after 50 of the 100 steps the schedule was given")),
        "{lines:?}"
    );
}

/// Issue 57 (the trial): a constant lr through `step_with_lr`, with neither a schedule nor
/// `run_steps`, was silent to the end. An averager dropped without `finish` reports as `finish`
/// would: the lr that never moved, and the syncs made.
#[test]
fn an_averager_dropped_without_finish_reports_the_runs_end() {
    let (mut avg, mut model) = averager(AveragerConfig::qsr(2, 0.01)).unwrap();
    for _ in 0..STEPS {
        model = avg.step_with_lr(model, 0.05).unwrap();
    }
    let (_, lines) = printed(|| drop(avg));
    assert!(warnings(&lines).iter().any(|w| w.contains("every step had the same lr 0.05")), "{lines:?}");
    assert!(lines.iter().any(|l| l.contains("Averager: 50 syncs in 100 steps")), "{lines:?}");
}

/// Issue 57 (the Learner trial): under burn-train, whose tracing subscriber writes only its
/// experiment log, qsr's warnings never reached the console. After `notices_on_stderr(true)` (which
/// qsr-burn-train's strategy sets) a notice goes to stderr as well as to the subscriber. Run in a
/// child process: the subscriber and the switch are process-wide.
#[test]
fn notices_reach_stderr_beside_a_subscriber_that_writes_elsewhere() {
    if !crate::common::is_alone() {
        let stderr = crate::common::run_alone(
            "averager_schedule::notices_reach_stderr_beside_a_subscriber_that_writes_elsewhere",
        );
        assert!(!stderr.contains("only in the log"), "{stderr}");
        assert!(stderr.contains("qsr: warning: on the console too"), "{stderr}");
        return;
    }
    let subscriber = tracing_subscriber::fmt().with_writer(std::io::sink).finish();
    tracing::subscriber::set_global_default(subscriber).unwrap();
    qsr_comm::notice(true, "only in the log");
    qsr_comm::notices_on_stderr(true);
    qsr_comm::notice(true, "on the console too");
}

/// A loop over rank 0's `ShardedDataset` of 400 items on 4 ranks, in batches of 32: 4 steps an
/// epoch; `epochs` epochs under a cosine schedule of `steps` steps. The lines printed.
fn sharded_loop(steps: usize, epochs: u64) -> Vec<String> {
    let items = burn::data::dataset::InMemDataset::new((0..400).collect::<Vec<i64>>());
    let shard = qsr_optim::ShardedDataset::new(items, 0, 4, 7).unwrap();
    let per_epoch = burn::data::dataset::Dataset::len(&shard).div_ceil(32);
    let (built, _) = printed(|| averager(AveragerConfig::qsr(2, 0.01).schedule(&cosine(0.05, steps), steps)));
    let (mut avg, mut model) = built.unwrap();
    let (_, lines) = printed(|| {
        for epoch in 0..epochs {
            shard.set_epoch(epoch);
            for _ in 0..per_epoch {
                model = avg.step(model.clone()).unwrap();
            }
        }
    });
    avg.abandon();
    lines
}

/// Issue 57 (the trial): `steps` and the scheduler both counted from the whole dataset (13 batches of
/// 32 a epoch, 39 steps for 3 epochs, where this rank's shard gives 4 an epoch) were told only when
/// the averager was dropped. Warned after the first epoch, from the loop's own `set_epoch` calls. A
/// schedule of whole epochs says nothing then; its last step counts them.
#[test]
fn a_schedule_of_no_whole_number_of_epochs_is_warned_after_the_first() {
    let lines = sharded_loop(39, 2);
    let warned = warnings(&lines);
    assert_eq!(warned.len(), 1, "{lines:?}");
    assert!(warned[0].contains("an epoch of this rank's shard took 4 steps"), "{lines:?}");
    assert!(warned[0].contains("make 9.75 of them, not a whole number"), "{lines:?}");
    let lines = sharded_loop(12, 3);
    assert!(warnings(&lines).is_empty(), "{lines:?}");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("syncs in 12 steps (3 epochs of 4 steps), the schedule planned"), "{lines:?}");
}

/// 3 epochs over each rank's shard of 512 items on 4 ranks, in batches of 32 (4 steps an epoch; the
/// whole dataset, 16), under a cosine of `steps` steps, the epochs from `ShardedDataset::epochs`
/// when `said`, else from `set_epoch`; rank 0's lines.
fn four_ranks_loop(steps: usize, said: bool) -> Vec<String> {
    let lines = qsr_comm::run_threads(4, |comm| {
        let items = burn::data::dataset::InMemDataset::new((0..512).collect::<Vec<i64>>());
        let shard = qsr_optim::ShardedDataset::new(items, comm.rank(), 4, 7).unwrap();
        let rank = comm.rank();
        let run = || {
            let mut model = Mlp::new(&Device::flex(), 4, 1);
            let config = AveragerConfig::qsr(2, 0.01).schedule(&cosine(0.05, steps), steps);
            let mut avg = Averager::new(&mut model, config, Box::new(comm)).unwrap();
            let epochs: Box<dyn Iterator<Item = u64>> = match said {
                true => Box::new(shard.epochs(0..3)),
                false => Box::new((0..3).inspect(|&epoch| shard.set_epoch(epoch))),
            };
            for _ in epochs {
                for _ in 0..burn::data::dataset::Dataset::len(&shard).div_ceil(32) {
                    model = avg.step(model).unwrap();
                }
            }
            avg.finish(model).unwrap();
        };
        if rank == 0 {
            printed(run).1
        } else {
            run();
            Vec::new()
        }
    });
    lines.into_iter().next().unwrap()
}

/// Issue 57 (the fourth and fifth trials): a whole dataset that splits evenly over the ranks makes a
/// whole number of epochs of a shard, `k` times too many, and was only noted; then warned as a
/// multiple of `k`, which warned correct runs of 12 epochs on 4 ranks too. A loop over
/// `ShardedDataset::epochs` says how many it runs: rank 0 warns after the first, naming the factor
/// and the steps to give. Counted from the shard, or with the epochs unsaid, nothing until the end.
#[test]
fn steps_counted_from_an_evenly_split_whole_dataset_are_warned_after_the_first_epoch() {
    let of_epochs = |lines: &[String]| -> Vec<String> {
        warnings(lines).into_iter().filter(|w| w.contains("epochs of 4 steps")).cloned().collect()
    };
    let lines = four_ranks_loop(3 * 16, true);
    let warned = of_epochs(&lines);
    assert_eq!(warned.len(), 1, "{lines:?}");
    assert!(
        warned[0].contains("the loop runs 3 epochs of 4 steps (this rank's shard), 12 steps")
            && warned[0].contains("make 12 epochs, 4 times as many")
            && warned[0].ends_with("give the scheduler and the schedule 12"),
        "{lines:?}"
    );
    // Over 12 steps alpha 0.01 lengthens few rounds, a warning of its own: only the epochs matter here.
    for said in [true, false] {
        let lines = four_ranks_loop(3 * 4, said);
        assert!(of_epochs(&lines).is_empty(), "{lines:?}");
        assert!(lines.iter().any(|l| l.contains("in 12 steps (3 epochs of 4 steps)")), "{lines:?}");
    }
    // Without the loop's epochs a whole number of them is ambiguous (a run of 12 epochs is right).
    let lines = four_ranks_loop(3 * 16, false);
    assert!(!warnings(&lines).iter().any(|w| w.contains("epochs of 4 steps") && w.contains("times as many")));
}

/// The sixth trial: steps for 2 epochs given to a loop of 3 were warned after the first epoch, and
/// then again as a step past `run_steps` and as syncs that run ahead of the plan, each blaming
/// another cause. The first warning says it all.
#[test]
fn steps_for_fewer_epochs_than_the_loop_runs_are_warned_once() {
    let lines = four_ranks_loop(2 * 4, true);
    let warned = warnings(&lines);
    let epochs: Vec<_> = warned.iter().filter(|w| w.contains("the loop runs 3 epochs of 4 steps")).collect();
    assert_eq!(epochs.len(), 1, "{lines:?}");
    assert!(epochs[0].contains("make 2 epochs; give the scheduler and the schedule 12"), "{lines:?}");
    assert!(!warned.iter().any(|w| w.contains("past the 8 steps") || w.contains("run ahead")), "{lines:?}");
    // The eighth trial: its syncs were reported at the schedule's last step too, before the loop ended.
    let counts: Vec<_> = lines.iter().filter(|l| l.contains("syncs in")).collect();
    assert!(counts.len() == 1 && counts[0].contains("in 12 steps (3 epochs of 4 steps)"), "{lines:?}");
}

/// The seventh trial: a loop whose steps were counted from a whole dataset that splits evenly, with
/// no loop epochs said (or a one-epoch loop), was told only that it ended early, with no cause.
/// Steps about K times the loop's name it.
#[test]
fn a_loop_that_ends_at_a_kth_of_its_steps_is_told_they_were_counted_from_the_whole_dataset() {
    let lines = four_ranks_loop(3 * 16, false);
    let ended = warnings(&lines)
        .into_iter()
        .find(|w| w.contains("the loop ended after 12 of the 48 steps the schedule was given"));
    let ended = ended.unwrap_or_else(|| panic!("{lines:?}"));
    assert!(
        ended.contains("or `run_steps`), 4 times as many: steps counted from the whole dataset of all 4 ranks"),
        "{ended}"
    );
}

/// The seventh trial: a loop that ran past its steps (warned after the first epoch) had its syncs
/// reported at the schedule's last step, though every later step averaged. Dropped at its real end,
/// the averager reports the count there.
#[test]
fn a_loop_that_ran_past_its_steps_reports_its_syncs_at_its_real_end() {
    let (built, _) = printed(|| averager(AveragerConfig::qsr(2, 0.01).schedule(&cosine(0.05, 8), 8)));
    let (mut avg, mut model) = built.unwrap();
    let (_, during) = printed(|| {
        for _ in 0..12 {
            model = avg.step(model.clone()).unwrap();
        }
    });
    let syncs = avg.stats().syncs;
    let (_, lines) = printed(|| drop(avg));
    assert!(during.iter().any(|l| l.contains("syncs in 8 steps")), "{during:?}");
    assert!(lines.iter().any(|l| l.contains(&format!("Averager: {syncs} syncs in 12 steps"))), "{lines:?}");
}
