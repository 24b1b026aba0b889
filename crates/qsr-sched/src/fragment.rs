//! Streaming synchronization's schedule: the parameters in `P` fragments, each averaged once per round
//! of the plan at its own step (Streaming DiLoCo's staggered syncs, with the plan's rule picking every
//! round's `H` from the lr, as QSR does).
//!
//! In a round of `H` steps starting at `s`, fragment `p` syncs after step `s + ceil((p + 1) H / P) - 1`:
//! the last fragment at the round's end, as the whole model does without fragments, the others spread
//! `H / P` steps apart before it. So each fragment syncs once per round (its period is the rule's `H`,
//! decided at the round's first step), the bytes of one sync are a fragment's, and with `H >= P` no two
//! fragments share a step. Where `H < P` (a short round, `h_base` below `P`) they share steps, at most
//! `ceil(P / H)` to a step.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;
use crate::plan::{Plan, StepInfo};
use crate::round::{Round, SyncMode};

/// Most fragments a plan accepts.
pub const MAX_FRAGMENTS: u32 = 1024;

/// The recipe name of the fragment count, for refusals.
const FIELD: &str = "sync.streaming.fragments";

/// Which of `fragments` fragments sync after the step `info` describes (none in a data-parallel
/// round), in fragment order: [`FragmentPlan::syncs_after`] for rounds decided one at a time rather
/// than planned ahead (qsr-optim's `Averager`, whose rounds follow the caller's lr). `info.h` is the
/// round's length as run (cut at the run's end).
///
/// ```
/// use qsr_sched::{StepInfo, SyncMode, fragments_syncing_after};
///
/// let at = |step| StepInfo { step, lr: 0.1, round: 0, round_start: 0, h: 8, sync_after: step == 7,
///     mode: SyncMode::Parameters, local_sync_after: false };
/// let steps: Vec<Vec<u32>> = (0..8).map(|s| fragments_syncing_after(4, &at(s)).collect()).collect();
/// assert_eq!(steps, [vec![], vec![0], vec![], vec![1], vec![], vec![2], vec![], vec![3]]);
/// ```
pub fn fragments_syncing_after(fragments: u32, info: &StepInfo) -> impl Iterator<Item = u32> + use<> {
    let parameters = info.mode == SyncMode::Parameters;
    let offset = info.step.checked_sub(info.round_start).map(|o| o + 1).filter(|_| parameters);
    let len = info.h;
    (0..fragments).filter(move |&f| offset == Some(steps_into_round(f, len, fragments)))
}

/// The steps of a round of `len` steps taken when fragment `fragment` of `fragments` syncs: the
/// one rule both the planned and the step-by-step questions use.
fn steps_into_round(fragment: u32, len: u64, fragments: u32) -> u64 {
    ((u64::from(fragment) + 1) * len).div_ceil(u64::from(fragments))
}

/// A [`Plan`] whose parameter averages go fragment by fragment: in a round of `H` steps from `s`,
/// fragment `p` of `P` syncs after step `s + ceil((p + 1) H / P) - 1`, so the last one at the round's
/// end and the others `H / P` steps apart before it (at most `ceil(P / H)` share a step when `H < P`).
///
/// ```
/// use qsr_sched::{FragmentPlan, LrSchedule, Plan, ScheduleKind, SyncRule};
///
/// let schedule = LrSchedule::new(ScheduleKind::Constant, 16, 0, 0.1, 0.0);
/// let plan = FragmentPlan::new(Plan::new(schedule, SyncRule::Constant { h: 8 }).unwrap(), 4).unwrap();
/// let steps: Vec<(u64, u32)> = plan.syncs().map(|s| (s.step, s.fragment)).collect();
/// assert_eq!(&steps[..4], &[(1, 0), (3, 1), (5, 2), (7, 3)]);
/// assert_eq!(plan.summary().max_per_step, 1);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct FragmentPlan {
    plan: Plan,
    fragments: u32,
}

impl FragmentPlan {
    /// `plan`'s parameter averages split over `fragments` fragments.
    ///
    /// # Errors
    ///
    /// `sync.streaming.fragments` outside `1..=MAX_FRAGMENTS`, or above 1 with a rule that all-reduces
    /// gradients (data parallel, post-local before its switch): those rounds average no parameters.
    pub fn new(plan: Plan, fragments: u32) -> Result<Self, ConfigError> {
        if !(1..=MAX_FRAGMENTS).contains(&fragments) {
            return Err(ConfigError::new(FIELD, format!("must be 1..={MAX_FRAGMENTS} (got {fragments})")));
        }
        if fragments > 1 && plan.rounds().any(|r| r.mode == SyncMode::Gradients) {
            let rule = plan.sync().name();
            let reason = format!("needs a rule that averages parameters; `{rule}` all-reduces gradients (use 1)");
            return Err(ConfigError::new(FIELD, reason));
        }
        Ok(Self { plan, fragments })
    }

    /// The plan whose rounds the fragments follow.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// How many fragments the parameters are in.
    pub fn fragments(&self) -> u32 {
        self.fragments
    }

    /// The step after which `fragment` syncs in `round`.
    pub fn sync_step(&self, round: &Round, fragment: u32) -> u64 {
        round.start + steps_into_round(fragment, round.len, self.fragments) - 1
    }

    /// The fragments that sync after the step `info` hands out (none in a data-parallel round), in
    /// fragment order: a trainer's question at each step.
    pub fn syncs_after(&self, info: &StepInfo) -> impl Iterator<Item = u32> + use<> {
        fragments_syncing_after(self.fragments, info)
    }

    /// Every fragment sync of the run, lazily, in step order (fragment order within a step).
    pub fn syncs(&self) -> impl Iterator<Item = FragmentSync> + '_ {
        self.plan.rounds().flat_map(move |round| {
            (0..self.fragments).map(move |fragment| FragmentSync {
                step: self.sync_step(&round, fragment),
                fragment,
                round: round.index,
            })
        })
    }

    /// How many fragment syncs come fewer than `delay` steps after the same fragment's previous sync,
    /// before that sync's average was due to land: it lands then, early (at most one average of a
    /// fragment is in flight), so those averages wait a round instead of `delay` steps. Rounds shorter
    /// than the delay (a small `h_base`, or `H` near `delay` early in a run) cause it; 0 means every
    /// average lands `delay` steps after its sync.
    pub fn syncs_within(&self, delay: u64) -> u64 {
        let mut last = vec![None::<u64>; self.fragments as usize];
        let mut within = 0;
        for s in self.syncs() {
            let prev = last[s.fragment as usize].replace(s.step);
            within += u64::from(prev.is_some_and(|p| s.step - p < delay));
        }
        within
    }

    /// The most elements one step sends, fragment `p` holding `elements[p]` of them.
    ///
    /// # Panics
    ///
    /// If `elements` does not have one entry per fragment (a programming error).
    pub fn peak_elements(&self, elements: &[u64]) -> u64 {
        assert_eq!(elements.len(), self.fragments as usize, "peak_elements: one size per fragment");
        let mut peak = 0;
        let mut current = (u64::MAX, 0);
        for sync in self.syncs() {
            if sync.step != current.0 {
                current = (sync.step, 0);
            }
            current.1 += elements[sync.fragment as usize];
            peak = peak.max(current.1);
        }
        peak
    }

    /// The schedule's shape: syncs per fragment, how many fragments share a step at most, and the
    /// fewest steps between two syncs.
    pub fn summary(&self) -> FragmentSummary {
        let mut s = FragmentSummary {
            fragments: self.fragments,
            syncs_per_fragment: 0,
            max_per_step: 0,
            shared_steps: 0,
            min_gap: None,
        };
        let (mut last, mut at_step) = (None::<u64>, 0u32);
        for sync in self.syncs() {
            if last == Some(sync.step) {
                at_step += 1;
                s.shared_steps += u64::from(at_step == 2);
            } else {
                if let Some(last) = last {
                    s.min_gap = Some(s.min_gap.map_or(sync.step - last, |g: u64| g.min(sync.step - last)));
                }
                (last, at_step) = (Some(sync.step), 1);
            }
            s.max_per_step = s.max_per_step.max(at_step);
            s.syncs_per_fragment += u64::from(sync.fragment == 0);
        }
        s
    }
}

/// One fragment's synchronization: after `step`, in round `round`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FragmentSync {
    /// The step after which the fragment is averaged.
    pub step: u64,
    /// Which fragment, `0..fragments`.
    pub fragment: u32,
    /// The plan's round the sync belongs to.
    pub round: u64,
}

/// Aggregate shape of a [`FragmentPlan`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FragmentSummary {
    /// Fragments the parameters are in.
    pub fragments: u32,
    /// Syncs of each fragment: one per round of the plan.
    pub syncs_per_fragment: u64,
    /// Most fragments averaged after one step (1 when every round has at least `fragments` steps).
    pub max_per_step: u32,
    /// Steps after which more than one fragment is averaged.
    pub shared_steps: u64,
    /// Fewest steps between two consecutive steps that sync (`None` with a single such step): a delay
    /// below it keeps at most one fragment in flight.
    pub min_gap: Option<u64>,
}

/// The parameter tensors of `sizes` (elements each, in the model's order) grouped into `fragments`
/// contiguous fragments of about equal size: fragment `p` ends at the first tensor where the running
/// total reaches `(p + 1) / fragments` of the whole. Every fragment holds at least one tensor.
///
/// # Errors
///
/// `sync.streaming.fragments` of 0 or more than there are tensors.
pub fn split_tensors(sizes: &[u64], fragments: u32) -> Result<Vec<Range<usize>>, ConfigError> {
    let p = fragments as usize;
    if p == 0 || p > sizes.len() {
        let reason = format!("must be 1..={} (one tensor at least per fragment; got {fragments})", sizes.len());
        return Err(ConfigError::new(FIELD, reason));
    }
    let total: u128 = sizes.iter().map(|&s| u128::from(s)).sum();
    let (mut ranges, mut start, mut running) = (Vec::with_capacity(p), 0, 0u128);
    for (i, &size) in sizes.iter().enumerate() {
        running += u128::from(size);
        let (done, left) = (ranges.len(), sizes.len() - i - 1);
        // Cut once this fragment's share is reached, or when the tensors left are only enough for one
        // per remaining fragment.
        let share_reached = running * p as u128 >= (done as u128 + 1) * total;
        if done + 1 < p && (share_reached || left == p - done - 1) {
            ranges.push(start..i + 1);
            start = i + 1;
        }
    }
    ranges.push(start..sizes.len());
    Ok(ranges)
}

/// `elements` split into `fragments` contiguous ranges whose sizes differ by at most one (for `qsr plan
/// --params`, where there is no model to split by tensor).
pub fn split_elements(elements: u64, fragments: u32) -> Vec<Range<u64>> {
    let p = u128::from(fragments.max(1));
    // In u128: `i * elements` overflows u64 for a parameter count near u64::MAX.
    let cut = |i: u128| (i * u128::from(elements) / p) as u64;
    (0..p).map(|i| cut(i)..cut(i + 1)).collect()
}
