//! How a finished run is judged beyond divergence: a final evaluation no better than chance (the run
//! did not train, exit status 6), and a last average that lost much of what the workers' own models
//! had (a warning naming both numbers).

use super::task::Eval;

/// A classifier's final accuracy at most this far above chance is no model.
const CHANCE_MARGIN: f64 = 0.02;

/// The workers' own models above their average by more than this (accuracy points of a classifier) is
/// an average worth a warning.
const AVERAGING_LOSS: f64 = 0.05;

/// The same for a language model, in nats of validation loss.
const AVERAGING_LOSS_NATS: f64 = 0.1;

/// What to lower when the workers' average is worse than they are.
const HINT: &str = "shorten the rounds (sync.h, sync.alpha, a larger sync.budget), raise sync.streaming.mix, or lower \
                    the outer optimizer's lr or momentum";

/// What to change when a run whose workers take the same update every step (data parallel) did not
/// learn: its lr, not its rounds.
const LR_HINT: &str = "the run did not learn with every step's gradients averaged; lower schedule.lr_max or lengthen \
                       schedule.warmup_steps";

/// What a model that learnt nothing scores: the loss of predicting every class (or token) alike, and
/// a classifier's accuracy.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Chance {
    pub(crate) loss: f64,
    pub(crate) accuracy: Option<f64>,
}

/// How a run's workers met, for the advice of a run that did not train.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Meeting {
    /// Every step's gradients averaged (data parallel): a failure is the lr's.
    EveryStep,
    /// Parameters averaged at rounds' ends for some of the run: the rounds may be to blame.
    Rounds,
}

impl Meeting {
    /// How the workers of `rule` meet.
    pub(crate) fn of(rule: &qsr_sched::SyncRule) -> Self {
        if rule.syncs_gradients(u64::MAX) { Meeting::EveryStep } else { Meeting::Rounds }
    }

    fn hint(self) -> String {
        match self {
            Meeting::EveryStep => LR_HINT.into(),
            Meeting::Rounds => format!("the workers' average is no model: {HINT}"),
        }
    }
}

/// Whether the final evaluation `ev` says the run did not train: its loss not below `chance_loss`
/// (every class, or token, predicted alike), or a classifier's accuracy within [`CHANCE_MARGIN`] of
/// `chance_accuracy`.
pub(crate) fn untrained(ev: &Eval, chance: Chance, meeting: Meeting) -> Option<crate::exit::NotTrained> {
    let Chance { loss: chance_loss, accuracy: chance_accuracy } = chance;
    let hint = meeting.hint();
    if ev.loss >= chance_loss {
        let why = format!(
            "the final test loss {:.4} is not below {chance_loss:.4}, the loss of predicting every class alike; {hint}",
            ev.loss
        );
        return Some(crate::exit::NotTrained { why });
    }
    let chance = chance_accuracy?;
    (ev.accuracy <= chance + CHANCE_MARGIN).then(|| crate::exit::NotTrained {
        why: format!(
            "the final test accuracy {:.2}% is within {:.0} points of chance ({:.2}%); {hint}",
            100.0 * ev.accuracy,
            100.0 * CHANCE_MARGIN,
            100.0 * chance
        ),
    })
}

/// Whether the run's last average lost more than [`AVERAGING_LOSS`] (a classifier's accuracy) or
/// [`AVERAGING_LOSS_NATS`] (a language model's loss) of what the workers' own models had one step
/// before it (`before`), against the average's final evaluation `after`; the warning names both.
pub(crate) fn averaging_lost(before: &Eval, after: &Eval, chance_accuracy: Option<f64>) -> Option<String> {
    let lost = match chance_accuracy {
        Some(_) if before.accuracy - after.accuracy > AVERAGING_LOSS => format!(
            "accuracy {:.2}% one step before the last average, their average {:.2}%",
            100.0 * before.accuracy,
            100.0 * after.accuracy
        ),
        None if after.loss - before.loss > AVERAGING_LOSS_NATS => format!(
            "validation loss {:.4} one step before the last average, their average {:.4}",
            before.loss, after.loss
        ),
        _ => return None,
    };
    Some(format!("averaging lost what the workers had learned apart: their own models' {lost}; {HINT}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: a data-parallel run at chance (Fashion-MNIST at lr 1.6, batch 2,048) was told to
    /// shorten its rounds; it is told to lower its lr, and a local rule still hears about its rounds.
    #[test]
    fn a_data_parallel_run_at_chance_is_told_about_its_lr_not_its_rounds() {
        let at_chance = eval(0.1, 2.303);
        let dp = untrained(
            &at_chance,
            Chance { loss: (10f64).ln(), accuracy: Some(0.1) },
            Meeting::of(&qsr_sched::SyncRule::Dp),
        )
        .unwrap();
        assert!(dp.why.contains("schedule.lr_max") && !dp.why.contains("rounds"), "{}", dp.why);
        let qsr = qsr_sched::SyncRule::Qsr { h_base: 2, alpha: 0.1 };
        let local =
            untrained(&at_chance, Chance { loss: (10f64).ln(), accuracy: Some(0.1) }, Meeting::of(&qsr)).unwrap();
        assert!(local.why.contains("shorten the rounds"), "{}", local.why);
    }

    fn eval(accuracy: f64, loss: f64) -> Eval {
        Eval { accuracy, loss, train: None }
    }

    #[test]
    fn a_final_evaluation_at_chance_did_not_train() {
        let chance = (10f64).ln();
        // The repro: 9.17 % and loss 2.85, below 3 ln 10 but above ln 10.
        assert!(
            untrained(&eval(0.0917, 2.85), Chance { loss: chance, accuracy: Some(0.1) }, Meeting::Rounds).is_some()
        );
        // Loss below chance but accuracy within 2 points of it.
        assert!(untrained(&eval(0.115, 2.2), Chance { loss: chance, accuracy: Some(0.1) }, Meeting::Rounds).is_some());
        assert!(untrained(&eval(0.44, 1.6), Chance { loss: chance, accuracy: Some(0.1) }, Meeting::Rounds).is_none());
        // A language model is judged by its loss alone.
        assert!(untrained(&eval(0.01, 4.0), Chance { loss: (65f64).ln(), accuracy: None }, Meeting::Rounds).is_none());
        assert!(untrained(&eval(0.3, 4.2), Chance { loss: (65f64).ln(), accuracy: None }, Meeting::Rounds).is_some());
    }

    #[test]
    fn an_average_far_below_the_workers_own_models_is_named_with_both_numbers() {
        let w = averaging_lost(&eval(0.93, 0.3), &eval(0.64, 1.1), Some(0.1)).unwrap();
        assert!(w.contains("93.00%") && w.contains("64.00%") && w.contains("sync.alpha"), "{w}");
        assert_eq!(averaging_lost(&eval(0.93, 0.3), &eval(0.91, 0.32), Some(0.1)), None);
        let w = averaging_lost(&eval(0.4, 1.9), &eval(0.38, 2.2), None).unwrap();
        assert!(w.contains("1.9000") && w.contains("2.2000"), "{w}");
        assert_eq!(averaging_lost(&eval(0.4, 1.9), &eval(0.4, 1.95), None), None);
    }
}
