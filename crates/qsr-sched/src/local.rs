//! The local level of a two-level plan (`[sync.local]`): averaging inside a node between the global
//! synchronizations.
//!
//! Local rounds tile each global round: the first starts where the global round starts, each takes
//! `H_local` from the local rule at its own first step (clamped to the global round's end), and a
//! local average follows every local round except the one that ends with the global round, which the
//! global average supersedes. So with a data-parallel global rule there is no local average at all,
//! and a node of one worker averages with nobody. The local rule's round count (which the
//! exponential rule doubles by) runs over the whole run and counts every local round, also the one
//! that ends with its global round.

use serde::{Deserialize, Serialize};

use crate::comm::{CommVolume, Encoding};
use crate::error::ConfigError;
use crate::round::{Round, SyncMode};
use crate::rule::SyncRule;
use crate::schedule::LrSchedule;

/// Checks a local rule: valid at `sync.local`, and one that averages parameters.
pub(crate) fn validate(rule: &SyncRule, schedule: &LrSchedule) -> Result<(), ConfigError> {
    rule.validate_at(schedule, "sync.local")?;
    if rule.syncs_gradients(0) {
        return Err(ConfigError::new(
            "sync.local.rule",
            format!(
                "`{}` all-reduces gradients, but the local level averages parameters inside a node; use \
                 rule = \"constant\" with h = 1 to average every step",
                rule.name()
            ),
        ));
    }
    Ok(())
}

/// Where a cursor stands in the local level: the local round under way and how many local rounds
/// before it started in warmup (the exponential rule counts rounds after warmup).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LocalPos {
    pub(crate) round: Round,
    pub(crate) warm_rounds: u64,
}

impl LocalPos {
    /// The local round `index` that starts at `start` inside a global round ending at `end`.
    pub(crate) fn at(
        schedule: &LrSchedule,
        rule: &SyncRule,
        start: u64,
        end: u64,
        index: u64,
        warm_rounds: u64,
    ) -> LocalPos {
        let h = rule.round_h(schedule, start, index, warm_rounds);
        let round =
            Round { index, start, len: h.min(end - start), lr_start: schedule.lr(start), mode: SyncMode::Parameters };
        LocalPos { round, warm_rounds }
    }

    /// The first local round of the global round `global`.
    pub(crate) fn first_of(schedule: &LrSchedule, rule: &SyncRule, global: &Round) -> LocalPos {
        LocalPos::at(schedule, rule, global.start, global.end(), 0, 0)
    }

    /// The local round that follows this one, starting at `start` (this round's end, or the start of
    /// the next global round) inside a global round ending at `end`.
    pub(crate) fn next(&self, schedule: &LrSchedule, rule: &SyncRule, start: u64, end: u64) -> LocalPos {
        let warm = self.warm_rounds + u64::from(schedule.in_warmup(self.round.start));
        LocalPos::at(schedule, rule, start, end, self.round.index + 1, warm)
    }

    /// Walks from this local round (of the global round `global`) to the one containing `step`, or
    /// to the global round's last.
    pub(crate) fn seek(mut self, schedule: &LrSchedule, rule: &SyncRule, global: &Round, step: u64) -> LocalPos {
        while self.round.end() < global.end() && step >= self.round.end() {
            self = self.next(schedule, rule, self.round.end(), global.end());
        }
        self
    }
}

/// The local level of a [`PlanSummary`](crate::PlanSummary).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LocalSummary {
    /// Name of the local rule ([`SyncRule::name`]).
    pub rule: String,
    /// Local averages over the run (local rounds that do not end with a global synchronization).
    pub rounds: u64,
    /// `100 * rounds / run_steps`.
    pub comm_percent: f64,
    /// Longest local round, in steps.
    pub max_h: u64,
}

impl LocalSummary {
    /// The local level of a plan whose global rounds are `rounds` (of a run of `end_step` steps under
    /// `schedule`), with local rule `rule`: one pass over its local rounds.
    pub(crate) fn of(
        rounds: impl Iterator<Item = Round>,
        schedule: &LrSchedule,
        rule: &SyncRule,
        end_step: u64,
    ) -> LocalSummary {
        let mut s = LocalSummary { rule: rule.name().to_string(), rounds: 0, comm_percent: 0.0, max_h: 0 };
        let mut pos: Option<LocalPos> = None;
        for g in rounds {
            let mut l = match pos {
                Some(p) => p.next(schedule, rule, g.start, g.end()),
                None => LocalPos::first_of(schedule, rule, &g),
            };
            loop {
                s.max_h = s.max_h.max(l.round.len);
                if l.round.end() == g.end() {
                    break;
                }
                s.rounds += 1;
                l = l.next(schedule, rule, l.round.end(), g.end());
            }
            pos = Some(l);
        }
        s.comm_percent = 100.0 * s.rounds as f64 / end_step as f64;
        s
    }

    /// Bytes each rank sends for the local averages over the run: a ring all-reduce of `params`
    /// values in `encoding` inside a node of `node_size` workers.
    pub fn volume(&self, run_steps: u64, params: u64, encoding: Encoding, node_size: u64) -> CommVolume {
        CommVolume::new(self.rounds, run_steps, params, encoding, node_size)
    }
}
