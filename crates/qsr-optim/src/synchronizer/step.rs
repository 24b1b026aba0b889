//! A plan-driven step, driven by the engine: what happens around a Worker's update, in order.

use burn::module::Module;

use super::Synchronizer;
use crate::error::OptimError;
use crate::flat::ParamLayout;
use crate::sync::{BnPolicy, DriverConfig, DriverStats, Level, StepEnd, Stepped, SyncReport};
use crate::synchronizer::Peers;
use qsr_sched::{StepInfo, SyncMode};

/// What one step's syncs act on: the face's module, its layout and flat state.
pub(crate) struct StepTarget<'a, M, S> {
    pub(crate) model: &'a mut M,
    pub(crate) layout: &'a ParamLayout,
    pub(crate) flat: &'a mut S,
}

/// What the engine's step needs of a face's flat state beside the update the face runs.
pub(crate) trait StepState {
    /// The flat parameters when they live on the host, for the streaming syncs after a step (a
    /// device-resident state does not stream).
    fn host_params(&mut self) -> Option<&mut [f32]>;

    /// Averages the parameters (and the state the policies name) through `peers`: a round's end.
    fn sync_parameters<M: Module>(
        &mut self,
        model: &mut M,
        layout: &ParamLayout,
        peers: &mut Peers<'_>,
        step: u64,
    ) -> Result<SyncReport, OptimError>;
}

impl Synchronizer {
    /// Runs the step `end.info` of a plan: counts it for the outer step's inner round, runs the
    /// face's `update` (gradients, the update and the syncs inside it: the gradient all-reduce, a
    /// round's parameter average, through the peers it is given, for the step as the update sees
    /// it), then the streaming fragments (with the BatchNorm statistics at a streaming
    /// round's end), the node's average of a two-level plan, and counts the step and its round in
    /// `stats`. A global sync of the step is its report.
    pub(crate) fn drive_step<M: Module, S: StepState, F>(
        &mut self,
        target: &mut StepTarget<'_, M, S>,
        end: StepEnd<'_>,
        config: &DriverConfig,
        stats: &mut DriverStats,
        update: F,
    ) -> Result<Stepped, OptimError>
    where
        F: FnOnce(&mut StepTarget<'_, M, S>, &mut Peers<'_>, &StepInfo) -> Result<Stepped, OptimError>,
    {
        let info = end.info;
        let update_info = self.begin_step(info);
        let mut peers = self.peers(Level::Global, Some(info.h), config, stats);
        let mut stepped = update(target, &mut peers, &update_info)?;
        if let Some(params) = target.flat.host_params() {
            let bn = (config.bn == BnPolicy::Average).then_some((&mut *target.model, target.layout));
            let streamed = self.end_streaming_step(params, bn, end, &mut stats.comm)?;
            stepped.sync = stepped.sync.or(streamed.report);
        }
        if info.local_sync_after && self.local().is_some() {
            // A plain average inside the node: the outer step runs at global syncs only.
            let mut peers = self.peers(Level::Local, Some(info.h), config, stats);
            let report = target.flat.sync_parameters(target.model, target.layout, &mut peers, info.step)?;
            // A global sync of the same step (a streaming fragment's) is the step's report.
            stepped.sync = Some(stepped.sync.filter(|s| s.level == Level::Global).unwrap_or(report));
            stats.local.syncs += 1;
        }
        stats.steps += 1;
        if let Some(s) = stepped.sync.filter(|s| s.level == Level::Global) {
            stats.syncs += u64::from(self.ends_round(info));
            stats.gradient_syncs += u64::from(s.mode == SyncMode::Gradients);
        }
        Ok(stepped)
    }

    /// Starts step `info`: counts a parameter round's step (for the outer step's inner round) and
    /// returns the step as the face's update sees it: a streaming engine's parameter syncs are its
    /// fragments', after the step ([`Self::end_streaming_step`]), not the update's.
    pub(super) fn begin_step(&mut self, info: &StepInfo) -> StepInfo {
        if info.mode == SyncMode::Parameters {
            self.observe_step(info.lr);
        }
        let update_syncs = self.stream.is_none() || info.mode == SyncMode::Gradients;
        StepInfo { sync_after: info.sync_after && update_syncs, ..*info }
    }

    /// Whether a global sync after `info` counts as a round's: a streaming engine counts rounds, not
    /// the fragments' syncs inside them.
    pub(super) fn ends_round(&self, info: &StepInfo) -> bool {
        self.stream.is_none() || info.sync_after
    }
}
