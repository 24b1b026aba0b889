//! The Averager around burn's own optimizer, with K workers on threads: syncs follow the sync rule from
//! the lr the caller applied (gradient rules through `average_grads`), replicas end bit-identical, reruns
//! are bit-identical, and ranks configured differently fail at construction naming the setting.

use burn::module::Module;
use burn::optim::{GradientsParams, SgdConfig, momentum::MomentumConfig};
use burn::tensor::{Device, Tensor, TensorData};
use qsr_comm::{Collective, InProcessGroup};
use qsr_optim::{Averager, AveragerConfig, OptimError, OuterConfig, OuterUnit, ParamLayout, Wire};
use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncRule};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::common::Mlp;

/// Worker `rank`'s batch at `step`: y = sum(x) + noise, seeded by (rank, step).
pub(crate) fn batch(rank: usize, step: u64, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let mut rng = ChaCha8Rng::seed_from_u64(1000 * rank as u64 + step);
    let x: Vec<f32> = (0..8 * 4).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let y: Vec<f32> = x.chunks(4).map(|r| r.iter().sum::<f32>() + rng.random_range(-0.05f32..0.05)).collect();
    (Tensor::from_data(TensorData::new(x, [8, 4]), device), Tensor::from_data(TensorData::new(y, [8, 1]), device))
}

/// The model with weights from our own seeded RNG.
pub(crate) fn seeded<M: Module>(model: M) -> M {
    let layout = ParamLayout::of(&model);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let values: Vec<f32> = (0..layout.len()).map(|_| rng.random_range(-0.4f32..0.4)).collect();
    layout.write_params(model, &values).unwrap()
}

pub(crate) const STEPS: u64 = 300;

pub(crate) fn schedule() -> LrSchedule {
    LrSchedule::new(ScheduleKind::Cosine, STEPS, 20, 0.1, 1e-4)
}

/// One worker's plain burn loop with the averager added; returns its final flat parameters and syncs.
/// With `known_length` the averager is told the run's length, else the loop calls `finish` at the end.
fn train(comm: Box<dyn Collective>, rule: SyncRule, known_length: bool) -> Result<(Vec<f32>, u64), OptimError> {
    let device = Device::flex().autodiff();
    let rank = comm.rank();
    // burn draws initial weights lazily from one global RNG, which concurrent threads (and tests) share,
    // so its draws are not reproducible: rank 0 writes seeded weights, and the averager hands them to
    // every worker.
    let mut model = if rank == 0 { seeded(Mlp::new(&device, 4, 1)) } else { Mlp::new(&device, 4, 1) };
    let mut config = AveragerConfig::new(rule, 20);
    config.run_steps = known_length.then_some(STEPS);
    let mut avg = Averager::new(&mut model, config, comm)?;
    let mut optim = SgdConfig::new().with_momentum(Some(MomentumConfig::new().with_momentum(0.9))).init();
    let sched = schedule();
    for step in 0..STEPS {
        let lr = sched.lr(step);
        let (x, y) = batch(rank, step, &device);
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = avg.average_grads(&model, grads)?;
        model = optim.step(lr, model, grads);
        model = avg.step_with_lr(model, lr)?;
    }
    if !known_length {
        model = avg.finish(model)?;
    }
    let layout = ParamLayout::of(&model);
    let mut flat = vec![0.0; layout.len()];
    layout.read_params(&model, &mut flat)?;
    Ok((flat, avg.stats().syncs))
}

fn run(k: usize, rule: impl Fn(usize) -> SyncRule + Sync) -> Vec<Result<(Vec<f32>, u64), OptimError>> {
    run_with(k, rule, true)
}

fn run_with(
    k: usize,
    rule: impl Fn(usize) -> SyncRule + Sync,
    known_length: bool,
) -> Vec<Result<(Vec<f32>, u64), OptimError>> {
    std::thread::scope(|s| {
        let joins: Vec<_> = InProcessGroup::new(k)
            .into_iter()
            .map(|c| {
                let rule = rule(c.rank());
                s.spawn(move || train(Box::new(c), rule, known_length))
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    })
}

#[test]
fn qsr_around_burns_sgd_syncs_as_planned_and_replicas_end_identical() {
    let rule = SyncRule::Qsr { h_base: 2, alpha: 0.03 };
    let plan = Plan::from_parts(schedule(), rule.clone(), Some(STEPS)).unwrap();
    let results: Vec<(Vec<f32>, u64)> = run(3, |_| rule.clone()).into_iter().map(Result::unwrap).collect();
    for (flat, syncs) in &results {
        assert_eq!(*syncs, plan.summary().rounds, "syncs must equal the planned rounds");
        assert_eq!(flat, &results[0].0, "replicas differ after the final sync");
    }
    assert!(plan.summary().rounds < STEPS / 2, "QSR should sync less than every other step");
    // A rerun gives bit-identical weights.
    let again: Vec<(Vec<f32>, u64)> = run(3, |_| rule.clone()).into_iter().map(Result::unwrap).collect();
    assert_eq!(again[0].0, results[0].0);
}

#[test]
fn finish_cuts_the_last_round_as_a_known_run_length_does() {
    // 300 steps of constant H = 7 end mid-round: `finish` makes the cut round's sync, bit for bit.
    let rule = SyncRule::Constant { h: 7 };
    let known: Vec<_> = run_with(2, |_| rule.clone(), true).into_iter().map(Result::unwrap).collect();
    let finished: Vec<_> = run_with(2, |_| rule.clone(), false).into_iter().map(Result::unwrap).collect();
    assert_eq!(known[0].1, STEPS.div_ceil(7));
    assert_eq!(finished, known);
}

#[test]
fn ranks_with_different_rules_fail_at_construction_naming_the_setting() {
    let results = run(2, |r| SyncRule::Qsr { h_base: if r == 1 { 4 } else { 2 }, alpha: 0.03 });
    for r in results {
        let e = r.unwrap_err();
        let chain = format!("{e}: {}", std::error::Error::source(&e).map(ToString::to_string).unwrap_or_default());
        assert!(chain.contains("`config.rule.h_base`: rank 0 has 2, rank 1 has 4"), "{chain}");
    }
}

/// Issue 57 item 7: ranks whose lrs differ (a scheduler sized by each rank's own shard length) and
/// whose alpha comes from a budget were refused naming `config.rule.alpha`; the refusal now names
/// the lr schedules.
#[test]
fn ranks_whose_budget_alphas_differ_are_told_their_lr_schedules_differ() {
    let results = qsr_comm::run_threads(2, |comm| {
        let steps = if comm.rank() == 0 { 1000 } else { 900 };
        let lrs: Vec<f64> =
            (0..steps).map(|t| 0.05 * (1.0 + (std::f64::consts::PI * t as f64 / steps as f64).cos())).collect();
        let config = AveragerConfig::qsr_for_budget(2, 0.1, 0, &lrs).unwrap();
        Averager::new(&mut Mlp::new(&Device::flex(), 4, 2), config, Box::new(comm)).map(|_| ())
    });
    for r in results {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("invalid `lr`") && e.contains("the ranks' lr schedules differ"), "{e}");
        assert!(e.contains("`config.rule.alpha`: rank 0 has"), "{e}");
    }
}

#[test]
fn dp_through_average_grads_keeps_replicas_bit_identical_and_syncs_every_step() {
    // No parameter is ever averaged under dp: replicas that start equal stay equal only because every
    // step's gradients are.
    let results: Vec<_> = run(3, |_| SyncRule::Dp).into_iter().map(Result::unwrap).collect();
    for (flat, syncs) in &results {
        assert_eq!(*syncs, STEPS);
        assert_eq!(flat, &results[0].0, "dp replicas differ");
    }
}

#[test]
fn post_local_syncs_gradients_then_parameters_as_planned() {
    let rule = SyncRule::PostLocal { switch_step: 150, h: 8 };
    let plan = Plan::from_parts(schedule(), rule.clone(), Some(STEPS)).unwrap();
    let results: Vec<_> = run(2, |_| rule.clone()).into_iter().map(Result::unwrap).collect();
    assert_eq!(plan.summary().rounds, 150 + 150u64.div_ceil(8));
    for (flat, syncs) in &results {
        assert_eq!(*syncs, plan.summary().rounds);
        assert_eq!(flat, &results[0].0);
    }
}

#[test]
fn a_dp_step_without_average_grads_fails_naming_it() {
    let comm = InProcessGroup::new(1).remove(0);
    let device = Device::flex().autodiff();
    let mut model = Mlp::new(&device, 4, 1);
    let mut avg = Averager::new(&mut model, AveragerConfig::new(SyncRule::Dp, 0), Box::new(comm)).unwrap();
    let Err(e) = avg.step_with_lr(model, 0.1) else { panic!("a dp step whose gradients were not averaged must fail") };
    let text = e.to_string();
    assert!(text.contains("average_grads") && text.contains("`dp`"), "{text}");
}

/// Rank `rank`'s parameter `i` before synchronization `round` of the outer-optimizer tests.
fn local_value(rank: usize, round: usize, i: usize) -> f32 {
    ((i * 7 + rank * 13 + round * 5) % 17) as f32 * 0.1 - 0.8
}

/// Two ranks start from the seeded weights and synchronize `rounds` times through `average_now`, rank
/// `r` holding `local_value(r, round, ..)` before each; returns the parameters after each round (equal
/// on both ranks, checked).
fn outer_rounds(outer: Option<OuterConfig>, rounds: usize) -> Vec<Vec<f32>> {
    averaged_rounds(outer, Wire::F32, rounds)
}

/// [`outer_rounds`] with the parameter averages on `wire`.
fn averaged_rounds(outer: Option<OuterConfig>, wire: Wire, rounds: usize) -> Vec<Vec<f32>> {
    let per_rank: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let joins: Vec<_> = InProcessGroup::new(2)
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let rank = c.rank();
                    let mut config = AveragerConfig::new(SyncRule::Constant { h: 1 }, 0);
                    config.outer = outer;
                    config.wire = wire;
                    let mut model = seeded(Mlp::new(&Device::flex(), 4, 1));
                    let mut avg = Averager::new(&mut model, config, Box::new(c))?;
                    let layout = ParamLayout::of(&model);
                    let mut after = Vec::new();
                    for round in 0..rounds {
                        let local: Vec<f32> = (0..layout.len()).map(|i| local_value(rank, round, i)).collect();
                        model = avg.average_now(layout.write_params(model, &local)?)?;
                        let mut flat = vec![0.0; layout.len()];
                        layout.read_params(&model, &mut flat)?;
                        after.push(flat);
                    }
                    Ok::<_, OptimError>(after)
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap().unwrap()).collect()
    });
    assert_eq!(per_rank[0], per_rank[1], "ranks differ after an outer step");
    per_rank.into_iter().next().unwrap()
}

#[test]
fn outer_lr_one_without_momentum_is_plain_averaging_within_f32_rounding() {
    let (outer, plain) = (outer_rounds(Some(OuterConfig::averaging()), 3), outer_rounds(None, 3));
    for (o, p) in outer.iter().flatten().zip(plain.iter().flatten()) {
        assert!((o - p).abs() <= 1e-6, "outer {o} vs plain {p}");
    }
}

#[test]
fn diloco_outer_step_follows_nesterov_sgd_on_the_mean_pseudo_gradient() {
    let rounds = 3;
    let got = outer_rounds(Some(OuterConfig::diloco()), rounds);
    // The reference in f64: delta = mean_k(global - local_k), m = 0.9 m + delta, global -= 0.7 (delta + 0.9 m).
    let layout = ParamLayout::of(&Mlp::new(&Device::flex(), 4, 1));
    let mut start = vec![0.0f32; layout.len()];
    layout.read_params(&seeded(Mlp::new(&Device::flex(), 4, 1)), &mut start).unwrap();
    let mut global: Vec<f64> = start.iter().map(|&x| f64::from(x)).collect();
    let mut m = vec![0.0f64; global.len()];
    for (round, got) in got.iter().enumerate() {
        for i in 0..global.len() {
            let delta = (0..2).map(|r| global[i] - f64::from(local_value(r, round, i))).sum::<f64>() / 2.0;
            m[i] = 0.9 * m[i] + delta;
            global[i] -= 0.7 * (delta + 0.9 * m[i]);
            assert!(
                (f64::from(got[i]) - global[i]).abs() <= 1e-5,
                "round {round} parameter {i}: {} vs {}",
                got[i],
                global[i]
            );
        }
    }
}

#[test]
fn outer_settings_that_cannot_run_are_refused_naming_the_key() {
    let build = |rule, outer| {
        let mut config = AveragerConfig::new(rule, 0);
        config.outer = Some(outer);
        Averager::new(&mut Mlp::new(&Device::flex(), 4, 1), config, Box::new(InProcessGroup::new(1).remove(0)))
            .map(|_| ())
    };
    let Err(e) = build(SyncRule::Dp, OuterConfig::diloco()) else { panic!("dp with an outer optimizer") };
    assert!(e.to_string().contains("`outer`"), "{e}");
    let Err(e) = build(SyncRule::Constant { h: 4 }, OuterConfig { lr: -1.0, ..OuterConfig::diloco() }) else {
        panic!("negative outer lr")
    };
    assert!(e.to_string().contains("`outer.lr`"), "{e}");
}

/// `AveragerConfig::wire = Bf16`: both ranks hold the same bf16 values after every average, within bf16
/// rounding of the f32 average.
#[test]
fn bf16_parameter_averages_are_identical_bf16_values_near_the_f32_average() {
    let (half, exact) = (averaged_rounds(None, Wire::Bf16, 3), averaged_rounds(None, Wire::F32, 3));
    for (h, e) in half.iter().flatten().zip(exact.iter().flatten()) {
        assert_eq!(h.to_bits() & 0xffff, 0, "{h} is not a bf16");
        assert!((h - e).abs() <= 3.0 * 2f32.powi(-8) * e.abs().max(0.1), "bf16 {h} vs f32 {e}");
    }
    assert_ne!(half, exact);
}

/// What one rank saved at an interruption: the files of the model's and the optimizer's burn records
/// and of the averager's state, as a user's checkpoint would hold them.
struct Saved {
    model: std::path::PathBuf,
    optim: std::path::PathBuf,
    state: std::path::PathBuf,
}

/// Steps `steps` of worker `rank`'s loop: its batch, `optim` at the schedule's lr, then the averager.
pub(crate) fn train_steps(
    avg: &mut Averager,
    mut model: Mlp,
    optim: &mut burn::optim::ModuleOptimizer,
    (rank, device): (usize, &Device),
    steps: std::ops::Range<u64>,
) -> Mlp {
    for step in steps {
        let lr = schedule().lr(step);
        let (x, y) = batch(rank, step, device);
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr, model, grads);
        model = avg.step_with_lr(model, lr).unwrap();
    }
    model
}

/// `model`'s parameters, flat.
pub(crate) fn flat_params(model: &Mlp) -> Vec<f32> {
    let layout = ParamLayout::of(model);
    let mut flat = vec![0.0; layout.len()];
    layout.read_params(model, &mut flat).unwrap();
    flat
}

/// Rank `comm.rank()` trains steps `from.steps..until` (from scratch without `from`); returns its flat
/// parameters and what it would save at `until`.
fn train_span(comm: Box<dyn Collective>, from: Option<Saved>, until: u64, dir: &std::path::Path) -> (Vec<f32>, Saved) {
    let device = Device::flex().autodiff();
    let rank = comm.rank();
    let rule = SyncRule::Qsr { h_base: 2, alpha: 0.03 };
    let mut config = AveragerConfig::new(rule, 20);
    config.run_steps = Some(STEPS);
    let mut model = if rank == 0 { seeded(Mlp::new(&device, 4, 1)) } else { Mlp::new(&device, 4, 1) };
    let mut avg = Averager::new(&mut model, config, comm).unwrap();
    let mut optim = SgdConfig::new().with_momentum(Some(MomentumConfig::new().with_momentum(0.9))).init();
    let start = match from {
        Some(saved) => {
            model = model.load_record(burn::store::ModuleRecord::load(&saved.model).unwrap());
            optim = optim.load(&saved.optim).unwrap();
            avg.restore(qsr_optim::AveragerState::load(&saved.state).unwrap()).unwrap();
            avg.stats().steps
        }
        None => 0,
    };
    let model = train_steps(&mut avg, model, &mut optim, (rank, &device), start..until);
    let flat = flat_params(&model);
    let saved = Saved {
        model: dir.join(format!("model-{until}-{rank}.bpk")),
        optim: dir.join(format!("optim-{until}-{rank}.bpk")),
        state: dir.join(format!("averager-{until}-{rank}.json")),
    };
    model.save_file(&saved.model).unwrap();
    optim.save(&saved.optim).unwrap();
    avg.state().unwrap().save(&saved.state).unwrap();
    (flat, saved)
}

#[test]
fn interrupted_and_resumed_run_equals_the_uninterrupted_one_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let run = |from: Vec<Option<Saved>>, until: u64| -> Vec<(Vec<f32>, Saved)> {
        std::thread::scope(|s| {
            let joins: Vec<_> = InProcessGroup::new(2)
                .into_iter()
                .zip(from)
                .map(|(c, f)| {
                    let dir = dir.path();
                    s.spawn(move || train_span(Box::new(c), f, until, dir))
                })
                .collect();
            joins.into_iter().map(|j| j.join().unwrap()).collect()
        })
    };
    let whole = run(vec![None, None], STEPS);
    // 137 is inside a QSR round (and after warmup): the resumed run must finish that round on time.
    let first = run(vec![None, None], 137);
    assert_eq!(qsr_optim::AveragerState::load(&first[0].1.state).unwrap().steps(), 137);
    let resumed = run(first.into_iter().map(|(_, saved)| Some(saved)).collect(), STEPS);
    let state = |s: &Saved| qsr_optim::AveragerState::load(&s.state).unwrap();
    for (w, r) in whole.iter().zip(&resumed) {
        assert_eq!(w.0, r.0, "resumed parameters differ from the uninterrupted run's");
        assert_eq!(state(&w.1), state(&r.1), "resumed averager state differs");
    }
}

#[test]
fn a_state_saved_under_another_rule_is_refused_naming_the_setting() {
    let device = Device::flex();
    let make = |rule: SyncRule| {
        let comm = InProcessGroup::new(1).remove(0);
        Averager::new(&mut Mlp::new(&device, 4, 1), AveragerConfig::new(rule, 0), Box::new(comm)).unwrap()
    };
    let saved = make(SyncRule::Constant { h: 4 }).state().unwrap();
    let err = make(SyncRule::Constant { h: 8 }).restore(saved).unwrap_err();
    assert!(matches!(&err, OptimError::Config { field, .. } if field == "state"), "{err}");
    assert!(err.to_string().contains("config.rule"), "{err}");
    let unreadable = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(unreadable.path(), b"{ not json").unwrap();
    let err = qsr_optim::AveragerState::load(unreadable.path()).unwrap_err();
    assert!(err.to_string().contains(&unreadable.path().display().to_string()), "{err}");
}

/// A writer the test can read back: what a tracing subscriber printed.
#[derive(Clone, Default)]
pub(crate) struct Captured(pub(crate) std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What dropping `avg` after `steps` constant-H=4 steps prints, and its unsynced steps before the drop.
fn dropped_after(steps: u64, finish: bool) -> (u64, String) {
    let device = Device::flex();
    let comm = InProcessGroup::new(1).remove(0);
    let config = AveragerConfig::new(SyncRule::Constant { h: 4 }, 0);
    let mut model = Mlp::new(&device, 4, 1);
    let mut avg = Averager::new(&mut model, config, Box::new(comm)).unwrap();
    for _ in 0..steps {
        model = avg.step_with_lr(model, 0.1).unwrap();
    }
    if finish {
        model = avg.finish(model).unwrap();
    }
    let pending = avg.unsynced_steps();
    let out = Captured::default();
    let writer = out.clone();
    let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
    tracing::subscriber::with_default(subscriber, || drop(avg));
    drop(model);
    let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    (pending, text)
}

#[test]
fn dropping_an_averager_mid_round_warns_naming_finish() {
    let (pending, warning) = dropped_after(6, false);
    assert_eq!(pending, 2, "steps 4 and 5 of the second round are not averaged");
    assert!(warning.contains("WARN") && warning.contains("Averager::finish"), "{warning}");
    assert!(warning.contains("2 step(s)"), "{warning}");
    // At a round's end nothing is lost: the drop only reports the syncs made, as `finish` does; after
    // `finish` it prints nothing.
    let (pending, text) = dropped_after(8, false);
    assert_eq!(pending, 0);
    assert!(!text.contains("WARN") && text.contains("syncs in 8 steps"), "{text}");
    assert_eq!(dropped_after(6, true), (0, String::new()));
}

#[test]
fn seeded_init_gives_every_thread_the_same_weights_every_time() {
    let weights = || {
        std::thread::scope(|s| {
            let joins: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        let device = Device::flex();
                        let model = qsr_optim::seeded_init(&device, 11, || Mlp::new(&device, 4, 1));
                        let layout = ParamLayout::of(&model);
                        let mut flat = vec![0.0; layout.len()];
                        layout.read_params(&model, &mut flat).unwrap();
                        flat
                    })
                })
                .collect();
            joins.into_iter().map(|j| j.join().unwrap()).collect::<Vec<_>>()
        })
    };
    let first = weights();
    assert!(first.iter().all(|w| w == &first[0]), "threads built different weights");
    assert_eq!(weights()[0], first[0], "a rerun built other weights");
    assert!(first[0].iter().any(|&v| v != 0.0));
}

/// Regression: an Averager's bf16 refusal named the trainer's recipe key `driver.wire`, which a
/// library user does not have; it names the config's field.
#[test]
fn an_averagers_bf16_refusal_names_its_own_field() {
    let mut config = AveragerConfig::qsr(2, 0.1);
    config.wire = Wire::Bf16;
    let comm = Box::new(crate::driver::NoBf16(InProcessGroup::new(1).remove(0), None));
    let Err(e) = Averager::new(&mut Mlp::new(&Device::flex(), 4, 1), config, comm) else {
        panic!("bf16 over a collective without it was accepted")
    };
    assert!(matches!(&e, OptimError::Config { field, .. } if field == "wire"), "{e}");
    assert!(!e.to_string().contains("driver."), "{e}");
}

/// The rounds planned from a user's burn scheduler (sampled) are the rounds the Averager makes when
/// stepped with that scheduler's lrs.
#[test]
fn round_lengths_from_a_burn_scheduler_are_the_averagers_syncs() {
    use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
    let steps = 700;
    let sched = || LinearLrSchedulerConfig::new(0.2, 0.001, steps).init().unwrap();
    let config = AveragerConfig::new(SyncRule::Qsr { h_base: 2, alpha: 0.03 }, 30);
    let mut planning = sched();
    let planned = config.round_lengths((0..steps).map(|_| planning.step().base())).unwrap();
    let comm = InProcessGroup::new(1).remove(0);
    let mut model = Mlp::new(&Device::flex(), 4, 1);
    let mut avg = Averager::new(&mut model, config, Box::new(comm)).unwrap();
    let mut training = sched();
    let mut ends = Vec::new();
    for _ in 0..steps {
        let syncs = avg.stats().syncs;
        model = avg.step_with_lr(model, training.step().base()).unwrap();
        if avg.stats().syncs > syncs {
            ends.push(avg.stats().steps);
        }
    }
    model = avg.finish(model).unwrap();
    drop(model);
    ends.extend((ends.last() != Some(&(steps as u64))).then_some(steps as u64));
    let planned_ends: Vec<u64> = planned
        .iter()
        .scan(0, |t, h| {
            Some({
                *t += h;
                *t
            })
        })
        .collect();
    assert_eq!(planned_ends, ends);
    assert!(planned.len() > 20 && planned.len() < 350, "{} rounds", planned.len());
}

/// Regression: between `average_grads` (which counts its step as synced) and `step`, the unsynced count
/// underflowed, and an averager dropped there (an error in the optimizer step, say) warned of 2^64 - 1
/// steps, or panicked in a debug build; an abandoned averager does not warn either.
#[test]
fn an_averager_dropped_after_average_grads_or_abandoned_does_not_warn() {
    let device = Device::flex().autodiff();
    let comm = InProcessGroup::new(1).remove(0);
    let mut model = Mlp::new(&device, 4, 1);
    let mut avg = Averager::new(&mut model, AveragerConfig::new(SyncRule::Dp, 0), Box::new(comm)).unwrap();
    let (x, y) = batch(0, 0, &device);
    let loss = (model.forward(x) - y).powi_scalar(2).mean();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let _grads = avg.average_grads(&model, grads).unwrap();
    assert_eq!(avg.unsynced_steps(), 0);
    let comm = InProcessGroup::new(1).remove(0);
    let config = AveragerConfig::new(SyncRule::Constant { h: 4 }, 0);
    let mut model = Mlp::new(&device, 4, 1);
    let mut mid_round = Averager::new(&mut model, config, Box::new(comm)).unwrap();
    model = mid_round.step_with_lr(model, 0.1).unwrap();
    mid_round.abandon();
    let out = Captured::default();
    let writer = out.clone();
    let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
    tracing::subscriber::with_default(subscriber, || {
        drop(avg);
        drop(mid_round);
    });
    drop(model);
    assert_eq!(String::from_utf8(out.0.lock().unwrap().clone()).unwrap(), "");
}

/// A budget gives the Averager the alpha the planner finds for the same schedule (the rounds of the
/// caller's lrs are the plan's), and its rounds spend at most the budget.
#[test]
fn a_budget_gives_the_alpha_the_planner_finds_and_its_rounds_stay_within_it() {
    let schedule = LrSchedule::new(ScheduleKind::Cosine, 3_000, 300, 0.2, 0.0);
    let lrs: Vec<f64> = (0..3_000).map(|t| schedule.lr(t)).collect();
    for (h_base, budget) in [(2, 0.1), (4, 0.05), (2, 0.3)] {
        let config = AveragerConfig::qsr_for_budget(h_base, budget, 300, &lrs).unwrap();
        let SyncRule::Qsr { alpha, .. } = config.rule else { panic!("{:?}", config.rule) };
        let planned = qsr_sched::alpha_for_budget(&schedule, h_base, budget, None).unwrap();
        assert!((alpha - planned).abs() <= 1e-6 * planned, "h_base {h_base}, {budget}: {alpha} vs {planned}");
        let syncs = config.round_lengths(lrs.iter().copied()).unwrap().len() as f64;
        assert!(syncs <= budget * 3_000.0, "{syncs}");
    }
    let err = AveragerConfig::qsr_for_budget(4, 0.5, 300, &lrs).unwrap_err().to_string();
    assert!(err.contains("`budget`") && err.contains("lower h_base"), "{err}");
}

/// Issue 46: ranks whose lrs differ decide different rounds (here H = 4 on rank 0, H = 2 on rank 1).
/// Each sync carries its tag in the call, so the first sync fails on every rank naming both syncs,
/// and no rank averages one step's parameters with another's.
#[test]
fn ranks_with_different_lrs_fail_at_the_first_sync_naming_both_syncs() {
    let outcomes: Vec<(String, u64)> = std::thread::scope(|s| {
        let joins: Vec<_> = InProcessGroup::new(2)
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let device = Device::flex().autodiff();
                    let rank = comm.rank();
                    let mut model = seeded(Mlp::new(&device, 4, 1));
                    let lr = if rank == 0 { 0.05 } else { 0.1 }; // H = max(2, (0.1 / lr)^2): 4 and 2
                    let mut avg = Averager::new(&mut model, AveragerConfig::qsr(2, 0.1), Box::new(comm)).unwrap();
                    let mut optim = SgdConfig::new().init();
                    for step in 0..8 {
                        let (x, y) = batch(rank, step, &device);
                        let loss = (model.forward(x) - y).powi_scalar(2).mean();
                        let grads = GradientsParams::from_grads(loss.backward(), &model);
                        model = optim.step(lr, model, grads);
                        match avg.step_with_lr(model, lr) {
                            Ok(m) => model = m,
                            Err(e) => {
                                assert!(matches!(e, OptimError::SyncsDiffer { .. }), "{e:?}");
                                return (format!("{:#}", anyhow::Error::from(e)), avg.stats().syncs);
                            }
                        }
                    }
                    panic!("rank {rank} never failed");
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let (rank0, rank1) = ("the sync after step 4 (a round of H = 4)", "the sync after step 2 (a round of H = 2)");
    for (rank, (message, syncs)) in outcomes.iter().enumerate() {
        assert_eq!(*syncs, 0, "rank {rank} counted a sync: {message}");
        let mine = if rank == 0 { rank0 } else { rank1 };
        assert!(message.contains(&format!("this rank is at {mine}")), "rank {rank}: {message}");
        assert!(message.contains("same lr schedule, warmup and run_steps"), "rank {rank}: {message}");
        // The group's report compares rank 1 with rank 0: both syncs, both ranks.
        assert!(message.contains(&format!("rank 1 has {rank1}, rank 0 has {rank0}")), "rank {rank}: {message}");
    }
}

/// Issue 46: plans that go wrong without an error are warned once, naming the numbers: here a loop of
/// 8 steps with `run_steps = 4` (every later step would average), and a scheduler sized for 4 times
/// the steps the loop takes (its lr ends high).
#[test]
fn wrong_plans_are_warned_once_naming_the_numbers() {
    let warnings = |rule: SyncRule, run_steps: Option<u64>, horizon: f64| {
        let device = Device::flex();
        let comm = InProcessGroup::new(1).remove(0);
        let mut config = AveragerConfig::new(rule, 0);
        config.run_steps = run_steps;
        let mut model = Mlp::new(&device, 4, 1);
        let mut avg = Averager::new(&mut model, config, Box::new(comm)).unwrap();
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
        tracing::subscriber::with_default(subscriber, || {
            for t in 0..8 {
                let lr = 0.05 * (1.0 + (std::f64::consts::PI * t as f64 / horizon).cos());
                model = avg.step_with_lr(model.clone(), lr).unwrap();
            }
            model = avg.finish(model.clone()).unwrap();
        });
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        text.lines().filter(|l| l.contains("WARN")).map(|l| format!("{l}\n")).collect::<String>()
    };
    let qsr = SyncRule::Qsr { h_base: 2, alpha: 0.05 };
    let past = warnings(SyncRule::Constant { h: 2 }, Some(4), 8.0);
    assert_eq!(past.matches("WARN").count(), 1, "{past}");
    assert!(past.contains("Averager (rank 0 of 1): step 5 is past the 4 steps the schedule was given"), "{past}");
    let high = warnings(qsr.clone(), None, 32.0);
    assert_eq!(high.matches("WARN").count(), 1, "{high}");
    assert!(high.contains("% of its peak 0.1: a scheduler sized for more steps"), "{high}");
    assert_eq!(warnings(qsr, Some(8), 8.0), "", "a cosine sized for the loop warns of nothing");
}

/// Issue 46: the lr warnings judge the whole run across a resume. A cosine sized for its 8 steps,
/// interrupted after 6: alone, the last two lrs (0.0146, then 0.0038, 26% of it) look like a run that
/// ended high; with the course saved in the state, the resumed averager warns of nothing.
#[test]
fn a_resumed_averager_judges_the_whole_lr_course() {
    let device = Device::flex();
    let lr = |t: u64| 0.05 * (1.0 + (std::f64::consts::PI * t as f64 / 8.0).cos());
    let averager = || {
        let comm = Box::new(InProcessGroup::new(1).remove(0));
        let mut model = Mlp::new(&device, 4, 1);
        (Averager::new(&mut model, AveragerConfig::qsr(2, 0.05), comm).unwrap(), model)
    };
    let (mut first, mut model) = averager();
    for t in 0..6 {
        model = first.step_with_lr(model, lr(t)).unwrap();
    }
    let state = first.state().unwrap();
    first.abandon();
    let (mut resumed, mut model) = averager();
    resumed.restore(state).unwrap();
    let out = Captured::default();
    let writer = out.clone();
    let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
    tracing::subscriber::with_default(subscriber, || {
        for t in 6..8 {
            model = resumed.step_with_lr(model.clone(), lr(t)).unwrap();
        }
        resumed.finish(model.clone()).unwrap();
    });
    let printed = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    let warnings: Vec<&str> = printed.lines().filter(|l| l.contains("WARN")).collect();
    assert!(warnings.is_empty(), "a cosine sized for the run, resumed, warns of nothing: {warnings:?}");
}

/// Two ranks step averagers with `outer` through rounds of H = 3, at lr `0.1 / (1 + t)` for step `t`,
/// rank `r` holding `local_value(r, t, ..)` after step `t`, over steps `from`; returns each rank's
/// parameters after the last step and its state.
fn outer_steps(
    outer: OuterConfig,
    from: (std::ops::Range<u64>, Vec<Option<qsr_optim::AveragerState>>),
) -> Vec<(Vec<Vec<f32>>, qsr_optim::AveragerState)> {
    let (steps, states) = from;
    std::thread::scope(|s| {
        let joins: Vec<_> = InProcessGroup::new(2)
            .into_iter()
            .zip(states)
            .map(|(c, state)| {
                let steps = steps.clone();
                s.spawn(move || {
                    let rank = c.rank();
                    let mut config = AveragerConfig::new(SyncRule::Constant { h: 3 }, 0);
                    config.outer = Some(outer);
                    let mut model = seeded(Mlp::new(&Device::flex(), 4, 1));
                    let mut avg = Averager::new(&mut model, config, Box::new(c)).unwrap();
                    if let Some(state) = state {
                        avg.restore(state).unwrap();
                    }
                    let layout = ParamLayout::of(&model);
                    let mut synced = Vec::new();
                    for t in steps {
                        let local: Vec<f32> = (0..layout.len()).map(|i| local_value(rank, t as usize, i)).collect();
                        model = avg
                            .step_with_lr(layout.write_params(model, &local).unwrap(), 0.1 / (1.0 + t as f64))
                            .unwrap();
                        if (t + 1) % 3 == 0 {
                            let mut flat = vec![0.0; layout.len()];
                            layout.read_params(&model, &mut flat).unwrap();
                            synced.push(flat);
                        }
                    }
                    (synced, avg.state().unwrap())
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    })
}

/// Issue 47: under `unit = "lr"` each sync is the outer step of its round's 3 steps and their summed lr
/// (the f64 reference of `outer.rs`'s formula), and a run resumed mid-round from its `AveragerState`
/// continues bit for bit (the state carries the round's steps and lrs so far).
#[test]
fn an_lr_unit_outer_step_takes_each_rounds_steps_and_lrs_and_resumes_mid_round() {
    let outer = OuterConfig { lr: 0.7, momentum: 0.9, nesterov: true, unit: OuterUnit::Lr };
    let whole = outer_steps(outer, (0..9, vec![None, None]));
    assert_eq!(whole[0].0, whole[1].0, "ranks differ after an outer step");
    let layout = ParamLayout::of(&Mlp::new(&Device::flex(), 4, 1));
    let mut start = vec![0.0f32; layout.len()];
    layout.read_params(&seeded(Mlp::new(&Device::flex(), 4, 1)), &mut start).unwrap();
    let mut global: Vec<f64> = start.iter().map(|&x| f64::from(x)).collect();
    let mut buf = vec![0.0f64; global.len()];
    let p = 0.9f64.powi(3);
    for (round, got) in whole[0].0.iter().enumerate() {
        let last = 3 * round + 2;
        let lr_sum: f64 = (3 * round..=last).map(|t| 0.1 / (1.0 + t as f64)).sum();
        for i in 0..global.len() {
            let delta = (0..2).map(|r| global[i] - f64::from(local_value(r, last, i))).sum::<f64>() / 2.0;
            let d = delta / lr_sum;
            buf[i] = p * buf[i] + d;
            global[i] -= 0.7 * lr_sum * (d + p * buf[i]);
            assert!(
                (f64::from(got[i]) - global[i]).abs() <= 1e-5,
                "round {round} parameter {i}: {} vs {}",
                got[i],
                global[i]
            );
        }
    }
    // Interrupted after step 4, inside the second round.
    let first = outer_steps(outer, (0..4, vec![None, None]));
    let resumed = outer_steps(outer, (4..9, first.into_iter().map(|(_, s)| Some(s)).collect()));
    for (w, r) in whole.iter().zip(&resumed) {
        assert_eq!(w.0[1..], r.0[..], "the resumed run's syncs differ");
        assert_eq!(w.1, r.1, "the resumed averager's state differs");
    }
}

/// Regression (issue 47): under post-local with an outer optimizer the Averager's global parameters
/// stayed at the initial weights through the data-parallel phase, so the first outer step pulled every
/// rank back toward them; they now follow every data-parallel step.
#[test]
fn the_outer_steps_global_parameters_follow_post_locals_data_parallel_steps() {
    let device = Device::flex().autodiff();
    let mut config = AveragerConfig::new(SyncRule::PostLocal { switch_step: 5, h: 2 }, 0);
    config.outer = Some(OuterConfig::diloco());
    let comm = Box::new(InProcessGroup::new(1).remove(0));
    let mut model = seeded(Mlp::new(&device, 4, 1));
    let mut avg = Averager::new(&mut model, config, comm).unwrap();
    let mut optim = SgdConfig::new().init();
    for step in 0..5 {
        let (x, y) = batch(0, step, &device);
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        let grads = avg.average_grads(&model, GradientsParams::from_grads(loss.backward(), &model)).unwrap();
        model = avg.step_with_lr(optim.step(0.1, model, grads), 0.1).unwrap();
    }
    let layout = ParamLayout::of(&model);
    let mut flat = vec![0.0; layout.len()];
    layout.read_params(&model, &mut flat).unwrap();
    assert_eq!(avg.outer_state().unwrap().0, &flat[..], "the global parameters stayed behind");
}

/// Issue 47: fragments' syncs end no round, so the per-step outer units refuse streaming and quantized
/// wires, naming `outer.unit`.
#[test]
fn a_per_step_outer_unit_with_streaming_is_refused_naming_the_key() {
    for wire in [Wire::Int8, Wire::F32] {
        let mut config = AveragerConfig::new(SyncRule::Constant { h: 4 }, 0);
        config.outer = Some(OuterConfig { unit: OuterUnit::Step, ..OuterConfig::diloco() });
        config.wire = wire;
        if wire == Wire::F32 {
            config.streaming = Some(qsr_sched::StreamingConfig { fragments: 2, delay: 1, mix: 1.0 });
        }
        let comm = Box::new(InProcessGroup::new(1).remove(0));
        let Err(e) = Averager::new(&mut Mlp::new(&Device::flex(), 4, 1), config, comm) else {
            panic!("{wire:?} accepted")
        };
        assert!(e.to_string().contains("`outer.unit`"), "{e}");
    }
}

/// Issue 57: a scheduler that reaches lr = 0 inside the run (burn's cosine does) was a hard error for
/// QSR. A round that starts at lr 0 lasts to the run's end (QSR's `H` for lr 0); a negative or NaN lr
/// is still refused naming `lr`.
#[test]
fn a_scheduler_that_reaches_lr_zero_ends_the_rounds_there_instead_of_failing() {
    let lrs: Vec<f64> = (0..100).map(|t| if t < 50 { 0.1 } else { 0.0 }).collect();
    let config = AveragerConfig { run_steps: Some(100), ..AveragerConfig::qsr(2, 0.05) };
    let mut expected = vec![2u64; 25];
    expected.push(50);
    assert_eq!(config.round_lengths(lrs.iter().copied()).unwrap(), expected);
    let mut model = Mlp::new(&Device::flex(), 4, 1);
    let comm = InProcessGroup::new(1).remove(0);
    let mut avg = Averager::new(&mut model, config.clone(), Box::new(comm)).unwrap();
    for &lr in &lrs {
        model = avg.step_with_lr(model, lr).unwrap();
    }
    assert_eq!((avg.stats().syncs, avg.unsynced_steps()), (26, 0));
    for bad in [-0.1, f64::NAN] {
        let err = config.round_lengths([0.1, 0.1, bad, 0.1]).unwrap_err();
        assert!(matches!(&err, OptimError::Config { field, .. } if field == "lr"), "{err}");
    }
}

/// `mean` mid-round (a burn-train validation of the average): the mean of the ranks' parameters, with
/// the round, the syncs and each rank's own parameters left as they were; the round's `finish` then
/// gives the same bits (f32, plain averaging).
#[test]
fn the_mean_mid_round_leaves_the_round_and_equals_its_finish() {
    let out = qsr_comm::run_threads(2, |comm| -> Result<_, OptimError> {
        let device = Device::flex().autodiff();
        let rank = comm.rank();
        let mut model = if rank == 0 { seeded(Mlp::new(&device, 4, 1)) } else { Mlp::new(&device, 4, 1) };
        let mut avg = Averager::new(&mut model, AveragerConfig::new(SyncRule::Constant { h: 100 }, 0), Box::new(comm))?;
        let mut optim = SgdConfig::new().init();
        for step in 0..5 {
            let (x, y) = batch(rank, step, &device);
            let grads = GradientsParams::from_grads((model.forward(x) - y).powi_scalar(2).mean().backward(), &model);
            model = optim.step(0.05, model, grads);
            model = avg.step_with_lr(model, 0.05)?;
        }
        let layout = ParamLayout::of(&model);
        let flat = |m: &Mlp| {
            let mut v = vec![0.0; layout.len()];
            layout.read_params(m, &mut v).map(|()| v)
        };
        let own = flat(&model)?;
        let mean = flat(&avg.mean(&model)?)?;
        let kept = (avg.unsynced_steps(), avg.stats().syncs, flat(&model)? == own);
        let finished = flat(&avg.finish(model)?)?;
        Ok((own, mean, kept, finished))
    });
    let out: Vec<_> = out.into_iter().map(Result::unwrap).collect();
    let (a, b) = (&out[0].0, &out[1].0);
    assert_ne!(a, b, "the ranks trained on different batches");
    for (own, mean, kept, finished) in &out {
        assert!(a.iter().zip(b).zip(mean).all(|((x, y), m)| (m - (x + y) / 2.0).abs() < 1e-6), "not the mean");
        assert_eq!(*kept, (5, 0, true), "the round, its syncs or the rank's parameters changed");
        assert_ne!(own, mean);
        assert!(mean.iter().zip(finished).all(|(m, f)| m.to_bits() == f.to_bits()), "finish differs from the mean");
    }
}

/// Issue 57: under `run_workers`' threads rank 0 draws its lazily initialized weights alone, before it
/// first communicates, so a program that seeds burn's shared RNG and builds its model as a plain burn
/// program does starts from the seed's weights, every run and on every rank, however much the other
/// threads draw meanwhile. Run in a child process of its own: other tests draw from the same RNG.
#[test]
fn run_workers_threads_start_from_rank_0s_seeded_weights_whatever_the_others_draw() {
    if !crate::common::is_alone() {
        crate::common::run_alone(
            "averager::run_workers_threads_start_from_rank_0s_seeded_weights_whatever_the_others_draw",
        );
        return;
    }
    let device = Device::flex();
    let alone = || {
        device.seed(7);
        flat_params(&Mlp::new(&device, 4, 1))
    };
    let expected = alone();
    assert_eq!(alone(), expected, "burn's seeded draws repeat");
    let ranks = qsr_comm::run_workers(4, |comm| {
        device.seed(7);
        let mut model = Mlp::new(&device, 4, 1);
        match comm.rank() {
            // Rank 0 does other work before its Averager::new (loads its data, say) ...
            0 => std::thread::sleep(std::time::Duration::from_millis(100)),
            // ... while another rank seeds and draws a larger model of its own.
            _ => drop(flat_params(&Mlp::new(&device, 256, 64))),
        }
        let mut avg = Averager::new(&mut model, AveragerConfig::qsr(2, 0.1), comm).unwrap();
        avg.abandon();
        flat_params(&model)
    })
    .unwrap();
    for (rank, params) in ranks.iter().enumerate() {
        assert_eq!(params, &expected, "rank {rank}");
    }
}
