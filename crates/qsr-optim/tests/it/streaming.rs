//! Streaming syncs (fragments on staggered steps, applied `delay` steps late, blended by `mix`) and
//! quantized payloads with error feedback, with K in-process workers on threads.

use std::thread;

use qsr_comm::{Collective, InProcessComm, InProcessGroup};
use qsr_optim::{
    DriverConfig, Level, OptimError, OptimState, OuterConfig, Residency, StepReport, StreamState, Wire, Worker,
};
use qsr_sched::{Cursor, Plan, StreamingConfig, SyncRule};

use crate::common::Mlp;
use crate::driver::{BATCH, IN, OUT, Task, assert_close, bit_identical, device, init, mse, plan, sgd};

/// One run's settings.
#[derive(Clone)]
struct Setup {
    k: usize,
    plan: Plan,
    streaming: Option<StreamingConfig>,
    wire: Wire,
    outer: Option<OuterConfig>,
    /// The fragments' all-reduces on a second in-process group, on a thread.
    background: bool,
    /// Snapshot after the first step, go back to it after the second (an elastic round abandoned).
    rewind: Option<(u64, u64)>,
    /// Workers per node of a two-level plan (consecutive ranks), each node with its own group.
    nodes: Option<usize>,
    /// After this step every rank adopts rank 0's state and rank 0 shares its averages in flight
    /// (an elastic admission).
    share_at: Option<u64>,
}

impl Setup {
    fn new(k: usize, plan: Plan, streaming: Option<StreamingConfig>) -> Self {
        Setup {
            k,
            plan,
            streaming,
            wire: Wire::F32,
            outer: None,
            background: false,
            rewind: None,
            nodes: None,
            share_at: None,
        }
    }
}

/// Everything a checkpoint of one rank holds.
#[derive(Clone)]
struct Saved {
    params: Vec<f32>,
    optim: OptimState,
    outer: Option<(Vec<f32>, Vec<f32>)>,
    stream: Option<StreamState>,
    cursor: Cursor,
}

/// One rank's run: final parameters, reports, the global parameters after every step, and the state
/// at `stop_after` (if the run stopped there).
struct Ranked {
    params: Vec<f32>,
    reports: Vec<StepReport>,
    globals: Vec<Vec<f32>>,
    saved: Option<Saved>,
    syncs: u64,
    /// Node averages, and the bytes this rank sent in them.
    local: (u64, u64),
}

fn worker(
    setup: &Setup,
    comm: Box<dyn Collective>,
    (stream, node): (Option<Box<dyn Collective>>, Option<InProcessComm>),
) -> Worker<Mlp> {
    let config = DriverConfig { wire: setup.wire, ..DriverConfig::default() };
    let model = init(Mlp::new(&device(), IN, OUT));
    let mut w = Worker::new(model, sgd(), comm, setup.plan.cursor(), config).unwrap();
    if let Some(node) = node {
        w.set_local(Box::new(node)).unwrap();
    }
    if let Some(s) = setup.streaming {
        w.set_streaming(s).unwrap();
        if let Some(c) = stream {
            w.set_streaming_comm(c).unwrap();
        }
    }
    if let Some(o) = setup.outer {
        w.set_outer(o).unwrap();
    }
    w
}

/// Trains `setup.k` workers from `resume` (or the start) to the end of the plan, or to `stop_after`.
fn run(setup: &Setup, resume: Option<&[Saved]>, stop_after: Option<u64>) -> Vec<Ranked> {
    let k = setup.k;
    let task = Task::new();
    let comms = InProcessGroup::new(k);
    let streams: Vec<Option<Box<dyn Collective>>> = if setup.background {
        InProcessGroup::new(k).into_iter().map(|c| Some(Box::new(c) as Box<dyn Collective>)).collect()
    } else {
        (0..k).map(|_| None).collect()
    };
    let nodes: Vec<Option<InProcessComm>> = match setup.nodes {
        Some(n) => (0..k / n).flat_map(|_| InProcessGroup::new(n)).map(Some).collect(),
        None => (0..k).map(|_| None).collect(),
    };
    thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .zip(streams.into_iter().zip(nodes))
            .enumerate()
            .map(|(rank, (comm, lanes))| {
                let task = &task;
                s.spawn(move || {
                    let device = device();
                    let mut w = worker(setup, Box::new(comm), lanes);
                    if let Some(saved) = resume.map(|r| &r[rank]) {
                        w.restore(&saved.params, saved.optim.clone(), saved.cursor.clone()).unwrap();
                        if let Some((g, m)) = &saved.outer {
                            w.restore_outer_state(g, m).unwrap();
                        }
                        if let Some(st) = &saved.stream {
                            w.restore_streaming_state(st.clone()).unwrap();
                        }
                    }
                    let (mut reports, mut globals, mut saved) = (Vec::new(), Vec::new(), None);
                    let (mut snapshot, mut rewind) = (None, setup.rewind);
                    while !w.cursor().is_done() {
                        let t = w.cursor().step();
                        let r = w
                            .step(|m: &Mlp, _| {
                                let (x, y) = task.batch(Task::start(rank, k, t, 0, 1), BATCH, &device);
                                Ok(mse(m.forward(x), y))
                            })
                            .unwrap();
                        reports.push(r);
                        globals.push(w.outer_state().map(|(g, _)| g.to_vec()).unwrap_or_default());
                        if setup.share_at == Some(t) {
                            let held = w.streaming_state().unwrap().unwrap();
                            assert!(!held.in_flight.is_empty(), "nothing in flight to share");
                            w.adopt(0, w.cursor().clone()).unwrap();
                            w.share_in_flight(0, (rank == 0).then(|| held.clone())).unwrap();
                            let shared = w.streaming_state().unwrap().unwrap();
                            // The means and steps are every rank's; the sent values rank 0's, now everyone's.
                            let unsent = |s: &StreamState| {
                                let f = s.in_flight.iter();
                                f.map(|f| (f.fragment, f.sent_after, f.apply_after, f.mean.clone())).collect::<Vec<_>>()
                            };
                            assert_eq!(unsent(&shared), unsent(&held), "rank {rank}: the averages in flight");
                            if rank == 0 {
                                assert_eq!(shared.in_flight, held.in_flight, "rank 0's sent values");
                            }
                        }
                        match rewind {
                            Some((at, _)) if at == t => snapshot = Some(w.snapshot().unwrap()),
                            Some((_, back)) if back == t => {
                                w.restore_snapshot(snapshot.as_ref().unwrap()).unwrap();
                                let state = w.streaming_state().unwrap().unwrap();
                                assert!(state.in_flight.is_empty(), "averages in flight after the restore");
                                assert!(state.residual.iter().flatten().all(|&x| x == 0.0), "a residual kept");
                                rewind = None;
                            }
                            _ => {}
                        }
                        if stop_after == Some(t) {
                            saved = Some(Saved {
                                params: w.params().unwrap().to_vec(),
                                optim: w.optimizer_state().unwrap().into_owned(),
                                outer: w.outer_state().map(|(g, m)| (g.to_vec(), m.to_vec())),
                                stream: w.streaming_state().unwrap(),
                                cursor: w.cursor().clone(),
                            });
                            break;
                        }
                    }
                    let syncs = w.stats().syncs;
                    let local = (w.stats().local.syncs, w.local_comm().map_or(0, |c| c.stats().bytes_sent));
                    Ranked { params: w.params().unwrap().to_vec(), reports, globals, saved, syncs, local }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn streaming(fragments: u32, delay: u64, mix: f64) -> Option<StreamingConfig> {
    Some(StreamingConfig { fragments, delay, mix })
}

fn all_identical(runs: &[Ranked], what: &str, get: impl Fn(&Ranked) -> &Vec<f32>) {
    for (r, run) in runs.iter().enumerate().skip(1) {
        assert!(bit_identical(get(run), get(&runs[0])), "{what}: rank {r} differs from rank 0");
    }
}

/// The global (and outer) state of every fragment is the same bits on every rank after every step;
/// with `mix = 1` the ranks' parameters agree at the end, and so they do with `mix < 1` (the run ends
/// with an f32 average). Rounds are counted once, not once per fragment.
#[test]
fn streaming_keeps_the_global_state_identical_on_every_rank() {
    let p = plan(80, SyncRule::Qsr { h_base: 2, alpha: 0.25 });
    let rounds = p.summary().rounds;
    for (mix, outer) in [(1.0, None), (0.5, None), (1.0, Some(OuterConfig::short_rounds()))] {
        let mut setup = Setup::new(3, p.clone(), streaming(4, 2, mix));
        setup.outer = outer;
        let runs = run(&setup, None, None);
        for step in 0..runs[0].globals.len() {
            all_identical(&runs, &format!("mix {mix}, outer {outer:?}: global after step {step}"), |r| {
                &r.globals[step]
            });
        }
        all_identical(&runs, &format!("mix {mix}: final parameters"), |r| &r.params);
        assert!(runs[0].params.iter().all(|x| x.is_finite()));
        assert_eq!(runs[0].syncs, rounds, "mix {mix}: syncs count rounds");
        let sent: usize = runs[0].reports.iter().filter_map(|r| r.sync).map(|s| s.elements).sum();
        // Every fragment once per round, and the final average of everything.
        assert_eq!(sent as u64, rounds * runs[0].params.len() as u64 + runs[0].params.len() as u64, "mix {mix}");
    }
}

/// Where the all-reduces run changes nothing: on a collective of their own on a thread, the run is
/// the same bits as with them between steps.
#[test]
fn background_and_inline_fragment_all_reduces_give_the_same_bits() {
    let p = plan(60, SyncRule::Constant { h: 6 });
    for wire in [Wire::F32, Wire::Int8] {
        let mut setup = Setup::new(3, p.clone(), streaming(3, 2, 0.75));
        setup.wire = wire;
        let inline = run(&setup, None, None);
        setup.background = true;
        let background = run(&setup, None, None);
        for (r, (a, b)) in inline.iter().zip(&background).enumerate() {
            assert!(bit_identical(&a.params, &b.params), "{wire:?}: rank {r}'s parameters differ");
            for (step, (x, y)) in a.globals.iter().zip(&b.globals).enumerate() {
                assert!(bit_identical(x, y), "{wire:?}: rank {r}'s global state after step {step} differs");
            }
        }
    }
}

/// Two nodes of two workers: the fragments sync over all four ranks, and each node averages its
/// parameters in f32 at every local round's end, as the plan says. The global state stays identical on
/// every rank, the ranks end with one model, on f32 and int8 wires; the node averages move f32 bytes.
#[test]
fn streaming_runs_over_two_levels_with_node_averages_in_f32() {
    let p = plan(60, SyncRule::Constant { h: 8 }).with_local(SyncRule::Constant { h: 2 }).unwrap();
    for wire in [Wire::F32, Wire::Int8] {
        let mut setup = Setup::new(4, p.clone(), streaming(2, 2, 1.0));
        (setup.wire, setup.nodes) = (wire, Some(2));
        let runs = run(&setup, None, None);
        for step in 0..runs[0].globals.len() {
            all_identical(&runs, &format!("{wire:?}: global after step {step}"), |r| &r.globals[step]);
        }
        all_identical(&runs, &format!("{wire:?}: final parameters"), |r| &r.params);
        assert_eq!(runs[0].syncs, p.summary().rounds, "{wire:?}: global rounds");
        // Every other step but the global rounds' ends: 22 node averages of the whole model.
        let planned = p.cursor().filter(|s| s.local_sync_after).count() as u64;
        assert_eq!(planned, 22);
        let n = runs[0].params.len() as u64;
        let f32_average = qsr_sched::ring_allreduce_bytes_per_rank(n, Wire::F32.encoding(), 2);
        assert_eq!(runs[0].local, (planned, planned * f32_average), "{wire:?}: node averages and their bytes");
        let globals = runs[0].reports.iter().filter(|r| r.sync.is_some_and(|s| s.level == Level::Global)).count();
        assert!(globals >= 2 * 8, "{wire:?}: {globals} steps report a global sync (two fragments a round)");
    }
}

/// Going back to a snapshot (an elastic round abandoned) with averages in flight drops them on every
/// rank alike: the global state stays identical on all ranks after every step, a background lane
/// skips the answers it still owes for them (the same bits as inline), and the run still trains.
#[test]
fn restoring_a_snapshot_drops_the_averages_in_flight_alike_on_every_rank_and_lane() {
    let p = plan(60, SyncRule::Constant { h: 8 });
    for wire in [Wire::F32, Wire::Int8] {
        let mut setup = Setup::new(3, p.clone(), streaming(4, 3, 1.0));
        setup.wire = wire;
        // Snapshots after step 23 (a fragment just sent, its average in flight), back after 26.
        setup.rewind = Some((23, 26));
        let inline = run(&setup, None, None);
        assert_eq!(inline[0].reports.len(), 63, "{wire:?}: steps 24..=26 taken twice");
        for step in 0..inline[0].globals.len() {
            all_identical(&inline, &format!("{wire:?}: global after step {step}"), |r| &r.globals[step]);
        }
        all_identical(&inline, &format!("{wire:?}: final parameters"), |r| &r.params);
        setup.background = true;
        let background = run(&setup, None, None);
        for (r, (a, b)) in inline.iter().zip(&background).enumerate() {
            assert!(bit_identical(&a.params, &b.params), "{wire:?}: rank {r}'s parameters differ in the background");
        }
        let whole = run(&Setup { rewind: None, ..setup.clone() }, None, None);
        assert!(!bit_identical(&whole[0].params, &inline[0].params), "{wire:?}: the rewind changed nothing");
        assert_close(&whole[0].params, &inline[0].params, 5e-2, &format!("{wire:?}: rewound vs whole run"));
    }
}

/// An elastic admission (nobody failed) keeps the averages in flight: after every rank adopts rank 0's
/// state, rank 0 shares its averages (waited for); every rank then holds the same ones, the global state
/// stays identical on all ranks after every later step, and the run ends with one model.
#[test]
fn averages_in_flight_shared_after_adopt_reach_every_rank() {
    let p = plan(60, SyncRule::Constant { h: 8 });
    let mut setup = Setup::new(3, p, streaming(4, 3, 1.0));
    (setup.wire, setup.background, setup.share_at) = (Wire::Int8, true, Some(23));
    let runs = run(&setup, None, None);
    for step in 0..runs[0].globals.len() {
        all_identical(&runs, &format!("global after step {step}"), |r| &r.globals[step]);
    }
    all_identical(&runs, "final parameters", |r| &r.params);
}

/// A source sharing more averages in flight than fragments can have (one each, at most 1024) is
/// refused on every rank alike, before anything is allocated for them.
#[test]
fn sharing_more_averages_in_flight_than_fragments_is_refused_on_every_rank() {
    let setup = Setup::new(2, plan(20, SyncRule::Constant { h: 4 }), streaming(2, 1, 1.0));
    let bogus = qsr_optim::InFlight { fragment: 0, sent_after: 0, apply_after: 1, mean: Vec::new(), sent: Vec::new() };
    let held = StreamState { in_flight: vec![bogus; 1025], residual: None };
    let errors: Vec<String> = thread::scope(|s| {
        let handles: Vec<_> = InProcessGroup::new(2)
            .into_iter()
            .map(|comm| {
                let (setup, held) = (&setup, held.clone());
                s.spawn(move || {
                    let rank = comm.rank();
                    let mut w = worker(setup, Box::new(comm), (None, None));
                    w.share_in_flight(0, (rank == 0).then_some(held)).unwrap_err().to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errors {
        assert!(e.contains("rank 0 shares 1025 averages in flight"), "{e}");
    }
}

/// A run stopped with a fragment's average in flight (and the quantized wires' error-feedback
/// residuals) and resumed from what a checkpoint holds ends with the same bits as the run that never
/// stopped.
#[test]
fn streaming_resumes_bit_exact_with_an_average_in_flight() {
    let p = plan(60, SyncRule::Constant { h: 8 });
    let wires = [(Wire::F32, false), (Wire::Int8, true), (Wire::Fp8, false), (Wire::Int4, true), (Wire::Int2, false)];
    for (wire, background) in wires {
        let mut setup = Setup::new(3, p.clone(), streaming(4, 3, 0.5));
        (setup.wire, setup.background) = (wire, background);
        let whole = run(&setup, None, None);
        // After step 24 (a round's first): the last fragment's average, sent after step 23 with a delay
        // of 3, is in flight.
        let first = run(&setup, None, Some(24));
        let saved: Vec<Saved> = first.iter().map(|r| r.saved.clone().unwrap()).collect();
        let stream = saved[0].stream.as_ref().unwrap();
        assert!(!stream.in_flight.is_empty(), "{wire:?}: nothing in flight at the stop");
        assert_eq!(stream.residual.is_none(), wire == Wire::F32, "{wire:?}: residual");
        let rest = run(&setup, Some(&saved), None);
        for (r, (a, b)) in whole.iter().zip(&rest).enumerate() {
            assert!(bit_identical(&a.params, &b.params), "{wire:?}: rank {r} differs after the resume");
        }
    }
}

/// `driver.wire = "int8"` without streaming: a pseudo-gradient per sync with error feedback, applied at
/// once. Ranks agree after every sync, the parameters follow the f32 run closely, and a sync sends
/// 0.27 of the f32 bytes or less (int4 0.141, int2 0.078, further from f32).
#[test]
fn quantized_syncs_keep_ranks_identical_follow_f32_and_send_a_fraction_of_the_bytes() {
    let p = plan(60, SyncRule::Constant { h: 4 });
    let exact = run(&Setup::new(3, p.clone(), None), None, None);
    for (wire, tolerance) in [(Wire::Int8, 3e-2), (Wire::Fp8, 3e-2), (Wire::Int4, 0.1), (Wire::Int2, 0.3)] {
        let mut setup = Setup::new(3, p.clone(), None);
        setup.wire = wire;
        let q = run(&setup, None, None);
        for step in (3..60).step_by(4) {
            all_identical(&q, &format!("{wire:?}: global after step {step}"), |r| &r.globals[step as usize]);
        }
        all_identical(&q, &format!("{wire:?}: parameters"), |r| &r.params);
        assert_close(&q[0].params, &exact[0].params, tolerance, &format!("{wire:?} vs f32 syncs"));
        // A sync moves the ring's share of whole blocks: the packed codes and a 4-byte scale each.
        let bytes = |runs: &[Ranked]| runs[0].reports.iter().filter_map(|r| r.sync).map(|s| s.bytes_sent).sum::<u64>();
        let n = q[0].params.len() as u64;
        let per_sync = qsr_sched::ring_allreduce_bytes_per_rank(n, wire.encoding(), 3);
        assert_eq!(bytes(&q), q[0].syncs * per_sync, "{wire:?}");
        let block_bytes = wire.codec().unwrap().block_bytes() as u64;
        assert_eq!(per_sync, n.div_ceil(64) * block_bytes * 4 / 3);
        assert_eq!(q[0].syncs, exact[0].syncs);
    }
}

/// Settings the driver cannot stream with are refused before training, naming the key.
#[test]
fn streaming_settings_that_cannot_run_are_refused_naming_the_key() {
    let build = |sync: SyncRule, config: DriverConfig, s: StreamingConfig| -> OptimError {
        let model = init(Mlp::new(&device(), IN, OUT));
        let comm = Box::new(InProcessGroup::new(1).remove(0));
        let mut w = Worker::new(model, sgd(), comm, plan(20, sync).cursor(), config).unwrap();
        w.set_streaming(s).unwrap_err()
    };
    let h4 = SyncRule::Constant { h: 4 };
    let moments = qsr_optim::StatePolicy { average_first_moment: true, average_second_moment: false };
    let cases = [
        (
            build(h4.clone(), DriverConfig::default(), StreamingConfig { delay: 0, ..StreamingConfig::new(2) }),
            "sync.streaming.delay",
        ),
        (
            build(h4.clone(), DriverConfig::default(), StreamingConfig { mix: 0.0, ..StreamingConfig::new(2) }),
            "sync.streaming.mix",
        ),
        (build(h4.clone(), DriverConfig::default(), StreamingConfig::new(5)), "sync.streaming.fragments"),
        (build(SyncRule::Dp, DriverConfig::default(), StreamingConfig::new(2)), "sync.streaming.fragments"),
        (
            build(
                h4.clone(),
                DriverConfig { residency: Residency::Device, ..DriverConfig::default() },
                StreamingConfig::new(2),
            ),
            "sync.streaming",
        ),
        (
            build(h4, DriverConfig { state: moments, ..DriverConfig::default() }, StreamingConfig::new(2)),
            "sync.streaming",
        ),
    ];
    for (e, key) in cases {
        assert!(e.to_string().contains(&format!("`{key}`")), "expected `{key}` in: {e}");
    }
    // A streaming collective without streaming, and one of another size.
    let model = init(Mlp::new(&device(), IN, OUT));
    let mut w = Worker::new(
        model,
        sgd(),
        Box::new(InProcessGroup::new(1).remove(0)),
        plan(20, SyncRule::Constant { h: 4 }).cursor(),
        DriverConfig::default(),
    )
    .unwrap();
    let e = w.set_streaming_comm(Box::new(InProcessGroup::new(1).remove(0))).unwrap_err();
    assert!(e.to_string().contains("`sync.streaming`"), "{e}");
}

/// Streaming with a delay trains: the loss of the last steps is far below the first steps'.
#[test]
fn streaming_with_a_delay_trains_the_model() {
    let p = plan(120, SyncRule::Qsr { h_base: 2, alpha: 0.25 });
    let runs = run(&Setup::new(2, p, streaming(4, 2, 1.0)), None, None);
    let mean = |r: &[StepReport]| r.iter().map(|s| s.loss).sum::<f32>() / r.len() as f32;
    let (first, last) = (mean(&runs[0].reports[..10]), mean(&runs[0].reports[110..]));
    assert!(last < 0.5 * first, "loss {first} -> {last}");
}

/// N1: an average that lands a whole round (or more) after it was sent keeps the local steps taken
/// meanwhile. With one fragment, `mix = 1` and `delay >= H`, the landing used to replace them and
/// the run never trained; now the loss falls as with a shorter delay, and the ranks end with one model.
#[test]
fn a_landing_average_keeps_the_local_steps_taken_while_it_was_in_flight() {
    let p = plan(120, SyncRule::Constant { h: 4 });
    let mean = |r: &[StepReport]| r.iter().map(|s| s.loss).sum::<f32>() / r.len() as f32;
    let last_loss = |delay| {
        let runs = run(&Setup::new(2, p.clone(), streaming(1, delay, 1.0)), None, None);
        all_identical(&runs, &format!("delay {delay}: final parameters"), |r| &r.params);
        let (first, last) = (mean(&runs[0].reports[..10]), mean(&runs[0].reports[110..]));
        assert!(last < 0.5 * first, "delay {delay}: loss {first} -> {last}");
        last
    };
    let short = last_loss(3);
    for delay in [4, 8, 900] {
        let late = last_loss(delay);
        assert!(late < 2.0 * short, "delay {delay}: last loss {late}, delay 3's {short}");
    }
}
