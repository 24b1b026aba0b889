//! burn's own Muon (the MuLoCo recipe's inner optimizer) inside QSR's rounds, through the Averager: Muon
//! on the weight matrices and AdamW on the rest, as a burn user groups them with `ModuleOptimizer`.

use burn::module::ParamGroup;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::{AdamWConfig, ModuleOptimizer, MuonConfig};
use burn::tensor::Device;
use qsr_comm::{Collective, InProcessGroup, MasterListener, TcpComm, TcpConfig};
use qsr_optim::{Averager, AveragerConfig};
use qsr_sched::{Plan, SyncRule};

use crate::averager::{STEPS, flat_params, schedule, seeded, train_steps};
use crate::common::Mlp;

const RULE: SyncRule = SyncRule::Qsr { h_base: 2, alpha: 0.03 };

/// Muon on the matrices (burn's panics on anything else), AdamW on the biases; `muon: false` gives
/// AdamW everywhere.
fn optimizer(muon: bool) -> ModuleOptimizer {
    let adamw = ModuleOptimizer::from(AdamWConfig::new().with_weight_decay(0.01).build());
    if !muon {
        return adamw;
    }
    let muon = MuonConfig::new().with_weight_decay(Some(WeightDecayConfig::new(0.01))).build();
    adamw.with_group(ParamGroup::from_predicate("weight"), muon, None)
}

/// One worker's burn loop with the Averager; its final flat parameters and syncs.
fn train(comm: Box<dyn Collective>, muon: bool) -> (Vec<f32>, u64) {
    let device = Device::flex().autodiff();
    let rank = comm.rank();
    let mut model = if rank == 0 { seeded(Mlp::new(&device, 4, 1)) } else { Mlp::new(&device, 4, 1) };
    let mut config = AveragerConfig::new(RULE, 20);
    config.run_steps = Some(STEPS);
    let mut avg = Averager::new(&mut model, config, comm).unwrap();
    let model = train_steps(&mut avg, model, &mut optimizer(muon), (rank, &device), 0..STEPS);
    (flat_params(&model), avg.stats().syncs)
}

fn on_threads(k: usize, muon: bool) -> Vec<(Vec<f32>, u64)> {
    std::thread::scope(|s| {
        let joins: Vec<_> =
            InProcessGroup::new(k).into_iter().map(|c| s.spawn(move || train(Box::new(c), muon))).collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    })
}

/// The ranks of a launch: qsr's TCP ring over loopback, one rank per thread.
fn over_tcp(k: usize, muon: bool) -> Vec<(Vec<f32>, u64)> {
    let listener = MasterListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::scope(|s| {
        let workers: Vec<_> = (1..k)
            .map(|rank| {
                let addr = addr.clone();
                s.spawn(move || train(Box::new(TcpComm::worker(&addr, rank, k, TcpConfig::default()).unwrap()), muon))
            })
            .collect();
        let master = train(Box::new(TcpComm::master(listener, k, TcpConfig::default()).unwrap()), muon);
        std::iter::once(master).chain(workers.into_iter().map(|j| j.join().unwrap())).collect()
    })
}

/// MuLoCo's inner optimizer under QSR's lr-tied H: every replica ends identical, the syncs are what
/// qsr-sched plans, threads and the ranks of a launch end on the same bits, and Muon really ran
/// (AdamW alone ends elsewhere).
#[test]
fn burns_muon_inside_qsr_rounds_syncs_as_planned_and_threads_equal_tcp_ranks() {
    let plan = Plan::from_parts(schedule(), RULE, Some(STEPS)).unwrap();
    let threads = on_threads(3, true);
    for (flat, syncs) in &threads {
        assert_eq!(*syncs, plan.summary().rounds, "syncs must equal the planned rounds");
        assert_eq!(flat, &threads[0].0, "replicas differ after the final sync");
        assert!(flat.iter().all(|v| v.is_finite()));
    }
    // Two ranks: a sum of two is the same in any order, so a TCP ring and the threads' group agree to
    // the bit (with more ranks the ring adds in another order than the threads' rank order).
    let (pair, ranks) = (on_threads(2, true), over_tcp(2, true));
    assert_eq!(ranks, pair, "the ranks of a launch differ from the threads");
    assert_ne!(on_threads(3, false)[0].0, threads[0].0, "the Muon group changed nothing");
}
