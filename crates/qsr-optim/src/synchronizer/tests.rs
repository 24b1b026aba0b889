//! The sync engine alone, each kind of sync over a fake collective whose peers hold known values:
//! what is averaged, on which collective and wire, with which tag, and what is accounted.

use std::sync::{Arc, Mutex};

use burn::nn::{Linear, LinearConfig};
use burn::tensor::Device;
use qsr_comm::{Codec, Collective, CommError, CommStats, ReduceOp, SyncTag};
use qsr_sched::{StepInfo, StreamingConfig, SyncMode};

use super::{At, Synced, Synchronizer};
use crate::flat::ParamLayout;
use crate::outer::OuterConfig;
use crate::settings::Face;
use crate::sync::{Level, StepEnd, Transfer, Wire};

/// A collective call as the fake saw it.
#[derive(Debug, Clone, PartialEq)]
struct Call {
    kind: &'static str,
    len: usize,
    tag: Option<SyncTag>,
}

/// Rank `rank` of `world` ranks whose peers all hold `peer` in every element, or (`peer` NaN) what
/// this rank holds (they are the root of every broadcast this rank does not own). Its calls go to
/// a shared log.
struct Fake {
    rank: usize,
    world: usize,
    peer: f32,
    tag: Option<SyncTag>,
    log: Arc<Mutex<Vec<Call>>>,
    stats: CommStats,
}

impl Fake {
    fn seat(rank: usize, world: usize, peer: f32) -> (Box<dyn Collective>, Arc<Mutex<Vec<Call>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let fake = Self { rank, world, peer, tag: None, log: Arc::clone(&log), stats: CommStats::default() };
        (Box::new(fake), log)
    }

    fn record(&mut self, kind: &'static str, len: usize) {
        self.log.lock().unwrap().push(Call { kind, len, tag: self.tag });
        let bytes = 4 * len as u64;
        self.stats = CommStats { calls: self.stats.calls + 1, bytes_sent: self.stats.bytes_sent + bytes, ..self.stats };
    }

    fn mean(&self, buf: &mut [f32]) {
        if self.peer.is_nan() {
            return;
        }
        let k = self.world as f32;
        buf.iter_mut().for_each(|x| *x = (*x + (k - 1.0) * self.peer) / k);
    }
}

impl Collective for Fake {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        assert_eq!(op, ReduceOp::Mean, "syncs average");
        self.record("f32", buf.len());
        self.mean(buf);
        Ok(())
    }
    fn all_reduce_quantized(&mut self, buf: &mut [f32], op: ReduceOp, codec: Codec) -> Result<(), CommError> {
        assert_eq!(op, ReduceOp::Mean, "syncs average");
        self.record("int8", buf.len());
        codec.round_block(buf);
        self.mean(buf);
        Ok(())
    }
    fn supports_quantized(&self) -> bool {
        true
    }
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        self.record("broadcast", buf.len());
        if root != self.rank {
            buf.fill(self.peer);
        }
        Ok(())
    }
    fn broadcast_bytes(&mut self, _bytes: &mut Vec<u8>, _root: usize) -> Result<(), CommError> {
        unreachable!("the synchronizer broadcasts values only")
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        Ok(())
    }
    fn set_tag(&mut self, tag: Option<SyncTag>) {
        self.tag = tag;
    }
    fn stats(&self) -> &CommStats {
        &self.stats
    }
    fn backend(&self) -> &'static str {
        "fake"
    }
}

fn calls(log: &Arc<Mutex<Vec<Call>>>) -> Vec<Call> {
    log.lock().unwrap().clone()
}

fn f32_wire(bucket: Option<usize>) -> Transfer {
    Transfer { wire: Wire::F32, bucket }
}

/// A model of two tensors (weight 3 x 2, bias 2): two fragments of 6 and 2 values.
fn linear() -> Linear {
    LinearConfig::new(3, 2).init(&Device::flex())
}

/// Step `step` of a round of `h` from `round_start` that averages parameters.
fn step(step: u64, round_start: u64, h: u64) -> StepInfo {
    let sync_after = step + 1 == round_start + h;
    StepInfo {
        step,
        lr: 0.1,
        round: 0,
        round_start,
        h,
        sync_after,
        mode: SyncMode::Parameters,
        local_sync_after: false,
    }
}

#[test]
fn a_plain_average_is_one_tagged_call_accounted_once() {
    let (comm, log) = Fake::seat(0, 2, 1.0);
    let mut sync = Synchronizer::new(comm, f32_wire(None), Face::Recipe).unwrap();
    let mut buf = vec![3.0; 5];
    let start = sync.start(Level::Global);
    let calls_made = sync.average(&mut buf, 5, At::after(9, Some(4)), Level::Global).unwrap();
    let mut totals = CommStats::default();
    let synced = Synced { mode: SyncMode::Parameters, elements: 5, calls: calls_made };
    let report = sync.account(start, synced, &mut totals);
    assert_eq!(buf, vec![2.0; 5]);
    assert_eq!(calls(&log), vec![Call { kind: "f32", len: 5, tag: Some(SyncTag::new(10, 4)) }]);
    assert_eq!((report.calls, report.bytes_sent, report.level), (1, 20, Level::Global));
    assert_eq!((totals.calls, totals.bytes_sent), (1, 20));
}

#[test]
fn buckets_split_a_sync_into_calls_that_all_carry_its_tag() {
    let (comm, log) = Fake::seat(0, 2, 0.0);
    let mut sync = Synchronizer::new(comm, f32_wire(Some(2)), Face::Recipe).unwrap();
    let mut buf = vec![2.0; 5];
    assert_eq!(sync.average(&mut buf, 5, At::after(3, Some(2)), Level::Global).unwrap(), 3);
    let lens: Vec<usize> = calls(&log).iter().map(|c| c.len).collect();
    assert_eq!(lens, [2, 2, 1]);
    assert!(calls(&log).iter().all(|c| c.tag == Some(SyncTag::new(4, 2))));
    assert_eq!(buf, vec![1.0; 5]);
}

#[test]
fn an_outer_step_averages_pseudo_gradients_and_steps_from_the_global_parameters() {
    // Global 1.0, this rank moved to 0.0 (pseudo-gradient 1.0), the peer's pseudo-gradient 3.0:
    // their mean 2.0, and the outer step (lr 0.5, no momentum) lands at 1.0 - 0.5 * 2.0 = 0.0.
    let (comm, log) = Fake::seat(0, 2, 3.0);
    let mut sync = Synchronizer::new(comm, f32_wire(None), Face::Recipe).unwrap();
    let config = OuterConfig { lr: 0.5, ..OuterConfig::averaging() };
    sync.set_outer(config, &[1.0; 4]).unwrap();
    sync.observe_step(0.1);
    let mut buf = vec![0.0; 4];
    sync.average(&mut buf, 4, At::after(0, Some(1)), Level::Global).unwrap();
    assert_eq!(buf, vec![0.0; 4]);
    assert_eq!(sync.outer_state().unwrap().0, [0.0; 4], "the new global parameters");
    assert_eq!(sync.inner_round().steps, 0, "a global sync ends the inner round");
    assert_eq!(calls(&log).len(), 1);
}

#[test]
fn a_two_level_sync_averages_the_node_in_f32_without_the_outer_step() {
    let (comm, global) = Fake::seat(0, 4, 0.0);
    let (node, local) = Fake::seat(0, 2, 5.0);
    let mut sync = Synchronizer::new(comm, Transfer { wire: Wire::Int8, bucket: None }, Face::Recipe).unwrap();
    sync.set_local(node).unwrap();
    sync.set_outer(OuterConfig::diloco(), &[1.0; 3]).unwrap();
    sync.observe_step(0.1);
    let mut buf = vec![1.0; 3];
    sync.average(&mut buf, 3, At::after(1, Some(2)), Level::Local).unwrap();
    assert_eq!(buf, vec![3.0; 3], "the node's plain mean");
    assert_eq!(calls(&local), vec![Call { kind: "f32", len: 3, tag: Some(SyncTag::new(2, 2)) }]);
    assert!(calls(&global).is_empty(), "nothing crossed the nodes");
    assert_eq!(sync.outer_state().unwrap().0, [1.0; 3], "the outer step waits for a global sync");
    assert_eq!(sync.inner_round().steps, 1, "a node's sync does not end the inner round");
}

#[test]
fn streaming_sends_each_fragment_once_a_round_and_lands_it_after_the_delay() {
    let model = linear();
    let layout = ParamLayout::of(&model);
    let (comm, log) = Fake::seat(0, 2, 0.0);
    let mut sync = Synchronizer::new(comm, f32_wire(None), Face::Recipe).unwrap();
    let config = StreamingConfig { fragments: 2, delay: 1, mix: 1.0 };
    assert!(sync.streams_with(Some(&config)));
    let stream = sync.prepare_streaming(Some(config), &layout).unwrap();
    let mut params = vec![1.0; layout.len()];
    sync.start_streaming(stream, &params);
    let mut totals = CommStats::default();
    let mut landed = Vec::new();
    for t in 0..4 {
        params.iter_mut().for_each(|p| *p -= 1.0); // a local step: pseudo-gradient 1 per step so far
        let info = step(t, 0, 4);
        let end = StepEnd { info: &info, last: false };
        let out = sync.end_streaming_step(&mut params, None::<(&mut Linear, &ParamLayout)>, end, &mut totals).unwrap();
        landed.push(out.landed);
    }
    // Fragment 1 (the weight) syncs after step 1 (offset ceil(4 / 2)), fragment 2 after step 3.
    let tags: Vec<_> = calls(&log).iter().map(|c| (c.tag.unwrap(), c.len)).collect();
    assert_eq!(tags, [(SyncTag::new(2, 4).fragment(1), 6), (SyncTag::new(4, 4).fragment(2), 2)]);
    assert_eq!(landed, [false, false, true, false], "fragment 1 lands one step after it was sent");
    assert_eq!(totals.calls, 2);
    assert_eq!(sync.stream_state().unwrap().unwrap().in_flight.len(), 1, "fragment 2 is still on its way");
}

#[test]
fn a_quantized_wire_streams_one_fragment_at_the_round_end_with_error_feedback() {
    let model = linear();
    let layout = ParamLayout::of(&model);
    let (comm, log) = Fake::seat(0, 2, 0.0);
    let mut sync = Synchronizer::new(comm, Transfer { wire: Wire::Int8, bucket: None }, Face::Recipe).unwrap();
    assert!(sync.streams_with(None), "a quantized wire streams without a streaming setting");
    let stream = sync.prepare_streaming(None, &layout).unwrap();
    let global = vec![1.0; layout.len()];
    sync.start_streaming(stream, &global);
    // Pseudo-gradients off the int8 grid of their block (scale 1 / 127): quantization drops some.
    let mut params: Vec<f32> = (0..layout.len()).map(|i| 1.0 - 0.3 * i as f32 / 7.0).collect();
    let mut totals = CommStats::default();
    for t in 0..2 {
        let info = step(t, 0, 2);
        let end = StepEnd { info: &info, last: false };
        let out = sync.end_streaming_step(&mut params, None::<(&mut Linear, &ParamLayout)>, end, &mut totals).unwrap();
        assert_eq!((out.landed, out.ranks_equal), (t == 1, t == 1), "step {t}");
    }
    assert_eq!(calls(&log), vec![Call { kind: "int8", len: 8, tag: Some(SyncTag::new(2, 2).fragment(1)) }]);
    let residual = sync.stream_state().unwrap().unwrap().residual.unwrap();
    assert!(residual.iter().any(|r| *r != 0.0), "what int8 dropped is kept for the next sync");
}

#[test]
fn the_initial_broadcast_takes_rank_zeros_parameters() {
    let model = linear();
    let layout = ParamLayout::of(&model);
    let (comm, log) = Fake::seat(1, 2, 0.25);
    let mut sync = Synchronizer::new(comm, f32_wire(None), Face::Averager).unwrap();
    let fail = |source| crate::OptimError::Setup { source };
    let model = sync.broadcast_initial(model, &layout, true, fail).unwrap();
    let mut params = vec![0.0; layout.len()];
    layout.read_params(&model, &mut params).unwrap();
    assert_eq!(params, vec![0.25; 8]);
    assert_eq!(calls(&log), vec![Call { kind: "broadcast", len: 8, tag: None }], "no statistics to send");
}

#[test]
fn a_fingerprint_rides_with_the_next_average_and_fails_different_parameters_naming_its_step() {
    let (comm, log) = Fake::seat(0, 2, f32::NAN);
    let mut sync = Synchronizer::new(comm, f32_wire(None), Face::Recipe).unwrap();
    sync.set_fingerprint(true);
    let mut buf = vec![0.5; 5];
    sync.average(&mut buf, 5, At::after(3, Some(4)), Level::Global).unwrap();
    sync.average(&mut buf, 5, At::after(7, Some(4)), Level::Global).unwrap();
    let lens: Vec<usize> = calls(&log).iter().map(|c| c.len).collect();
    assert_eq!(lens, [5, 5 + 22], "the first average's fingerprint rides with the second, in one call");
    assert_eq!(buf, vec![0.5; 5], "the parameters come back without it");
    assert!(sync.state().unwrap().fingerprint.is_some(), "the second's waits for the third");
    let (comm, _) = Fake::seat(0, 2, 0.0);
    let mut sync = Synchronizer::new(comm, f32_wire(None), Face::Recipe).unwrap();
    sync.set_fingerprint(true);
    sync.average(&mut [0.5; 5], 5, At::after(3, Some(4)), Level::Global).unwrap();
    let err = sync.average(&mut [0.5; 5], 5, At::after(7, Some(4)), Level::Global).unwrap_err();
    assert!(matches!(err, crate::OptimError::ParametersDiffer { step: 3 }), "{err}");
    assert!(err.to_string().contains("after the sync at step 3"), "{err}");
}

#[test]
fn a_streaming_engine_takes_a_rounds_parameter_sync_from_the_update_and_counts_rounds() {
    let model = linear();
    let layout = ParamLayout::of(&model);
    let (comm, _) = Fake::seat(0, 2, 0.0);
    let mut sync = Synchronizer::new(comm, f32_wire(None), Face::Recipe).unwrap();
    let (last, mid) = (step(3, 0, 4), step(1, 0, 4));
    assert!(sync.begin_step(&last).sync_after && sync.ends_round(&mid), "a plain engine: the update syncs");
    let stream = sync.prepare_streaming(Some(StreamingConfig { fragments: 2, delay: 1, mix: 1.0 }), &layout).unwrap();
    sync.start_streaming(stream, &[0.0; 8]);
    assert!(!sync.begin_step(&last).sync_after, "the fragments sync, after the update");
    let gradients = StepInfo { mode: SyncMode::Gradients, ..last };
    assert!(sync.begin_step(&gradients).sync_after, "data-parallel steps still all-reduce in the update");
    assert!(sync.ends_round(&last) && !sync.ends_round(&mid), "rounds, not fragments");
    assert_eq!(sync.inner_round().steps, 2, "the parameter round's steps were counted");
}
