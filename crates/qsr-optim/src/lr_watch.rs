//! Plans that go wrong without an error: the lrs an [`Averager`](crate::Averager) is given, watched
//! for the shapes that make QSR's rounds other than the caller meant (a step past `run_steps`, an lr
//! that rises again after decaying, a scheduler sized for more steps than the loop takes, a
//! constant lr), each warned once with its numbers.

/// The lr's course so far, and the warnings already given (saved in an
/// [`AveragerState`](crate::AveragerState), so a resumed run judges the whole course).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct LrWatch {
    /// The highest lr seen.
    #[serde(with = "crate::exact")]
    peak: f64,
    /// The lowest lr since the lr fell below half its peak, with its 0-based step.
    #[serde(with = "crate::exact::step_and")]
    low: Option<(u64, f64)>,
    /// The first step's lr, and whether any later one differed.
    #[serde(with = "crate::exact::option")]
    first: Option<f64>,
    varied: bool,
    #[serde(with = "crate::exact")]
    last: f64,
    warned_past: bool,
    warned_rise: bool,
    ended: bool,
    /// Whether a round that keeps the workers apart was warned about.
    #[serde(default)]
    warned_apart: bool,
}

/// An lr below this share of its peak has decayed; one that climbs this share of the peak above its
/// low point since then rises again.
const DECAYED: f64 = 0.5;
const RISE: f64 = 0.25;
/// A run whose last lr is above this share of the peak (after decaying some) ended early in its
/// schedule.
const ENDED_HIGH: f64 = 0.25;

impl LrWatch {
    /// A round of `len` steps from step `start` at `lr` (observed first) in a run of `run_steps`: warned
    /// once when it keeps the workers apart while the lr is high, as the planner refuses such rounds
    /// (`qsr_sched::round_apart`, judged against the peak lr seen so far).
    pub(crate) fn round(&mut self, start: u64, len: u64, lr: f64, run_steps: u64) -> Option<String> {
        let apart = qsr_sched::round_apart(start, len, lr, self.peak, run_steps).filter(|_| !self.warned_apart)?;
        self.warned_apart = true;
        Some(format!(
            "the round from step {start} keeps the workers apart for {len} steps at lr {lr} ({:.0} steps at the peak lr \
             {}, above {:.0}, a sixteenth of the run's {run_steps}): rounds this long at a high lr have ended runs near \
             chance (docs/architecture/sched.md); shorten the rounds (a smaller alpha or h, a larger budget)",
            apart.drift, self.peak, apart.limit
        ))
    }

    /// Step `t`'s lr (0-based), under a rule that decides `H` from the lr when `lr_driven`; returns
    /// the warning this step gives, if any.
    pub(crate) fn observe(&mut self, t: u64, lr: f64, run_steps: Option<u64>, lr_driven: bool) -> Option<String> {
        if let Some(r) = run_steps.filter(|&r| t >= r && !self.warned_past) {
            self.warned_past = true;
            return Some(format!(
                "step {} is past the {r} steps the schedule was given (`AveragerConfig::schedule`, or `run_steps`): the averager cut its plan there, so every later step is a round of its own and averages; give the schedule the steps your loop takes (without a schedule, leave `run_steps` out and call `finish` after the last step)",
                t + 1
            ));
        }
        if !(lr_driven && lr.is_finite() && lr > 0.0) {
            return None;
        }
        match self.first {
            None => self.first = Some(lr),
            Some(f) => self.varied |= lr != f,
        }
        self.last = lr;
        self.peak = self.peak.max(lr);
        if lr < DECAYED * self.peak && self.low.is_none_or(|(_, low)| lr < low) {
            self.low = Some((t, lr));
        }
        let (at, low) = self.low.filter(|(_, low)| lr > low + RISE * self.peak && !self.warned_rise)?;
        self.warned_rise = true;
        Some(format!(
            "the lr rose from {} at step {} to {} at step {} after decaying from its peak {}: QSR's rounds shorten again with it. A cosine scheduler sized for fewer steps than your loop takes starts over; size it for the steps this rank takes (its shard's batches times the epochs)",
            short(low),
            at + 1,
            short(lr),
            t + 1,
            short(self.peak)
        ))
    }

    /// The loop was told its steps differ from `run_steps` (after its first epoch): a step past
    /// them is not warned again.
    pub(crate) fn past_told(&mut self) {
        self.warned_past = true;
    }

    /// The run's end (its last step, or `finish`): the lr's course as a whole, once.
    pub(crate) fn at_end(&mut self) -> Option<String> {
        if std::mem::replace(&mut self.ended, true) {
            return None;
        }
        let first = self.first?;
        if !self.varied {
            return Some(format!(
                "every step had the same lr {first}: QSR decides each round's H from the lr, so with one lr every round has the same H; pass the lr your scheduler gave each step, not its peak"
            ));
        }
        let decayed = self.last < self.peak && !self.warned_rise;
        (decayed && self.last > ENDED_HIGH * self.peak).then(|| {
            format!(
                "the lr ended at {}, {:.0}% of its peak {}: a scheduler sized for more steps than your loop takes (for the whole dataset rather than this rank's shard, say) keeps the lr, and QSR's rounds, short to the end",
                short(self.last),
                100.0 * self.last / self.peak,
                short(self.peak)
            )
        })
    }
}

/// `lr` to 4 significant digits, as a message shows it ("0.04238", not "0.042379009876311").
pub(crate) fn short(lr: f64) -> String {
    significant(lr, 4)
}

/// `x` rounded to `digits` significant digits (at least 1), in Rust's shortest decimal form.
pub(crate) fn significant(x: f64, digits: usize) -> String {
    format!("{x:.*e}", digits.max(1) - 1).parse::<f64>().map_or_else(|_| x.to_string(), |r| r.to_string())
}

/// Says a line of information to the person running the job (`qsr_comm::notice`, qsr-notice's rule).
pub(crate) fn note(message: &str) {
    qsr_comm::notice(false, message);
}

/// Says a warning to the person running the job (`qsr_comm::notice`, qsr-notice's rule).
pub(crate) fn warn(message: &str) {
    qsr_comm::notice(true, message);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seventh trial: warnings printed lrs as "0.042379009876311" and "0.000003346552260954927".
    #[test]
    fn lrs_in_warnings_print_four_significant_digits() {
        assert_eq!(short(0.042379009876311), "0.04238");
        assert_eq!(short(0.000003346552260954927), "0.000003347");
        assert_eq!(short(0.05), "0.05");
    }

    fn warnings(lrs: &[f64], run_steps: Option<u64>) -> Vec<String> {
        let mut w = LrWatch::default();
        let mut out: Vec<String> =
            lrs.iter().enumerate().filter_map(|(t, &lr)| w.observe(t as u64, lr, run_steps, true)).collect();
        out.extend(w.at_end());
        out
    }

    fn cosine(steps: usize, horizon: usize) -> Vec<f64> {
        (0..steps).map(|t| 0.05 * (1.0 + (std::f64::consts::PI * t as f64 / horizon as f64).cos())).collect()
    }

    #[test]
    fn a_cosine_sized_for_the_loop_gives_no_warning() {
        assert_eq!(warnings(&cosine(100, 100), Some(100)), Vec::<String>::new());
    }

    #[test]
    fn each_wrong_plan_is_warned_once_with_its_numbers() {
        let past = warnings(&cosine(8, 8), Some(4));
        assert_eq!(past.len(), 1, "{past:?}");
        assert!(past[0].starts_with("step 5 is past the 4 steps the schedule was given"), "{past:?}");
        // One batch short per epoch: the cosine passes 0 and rises again.
        let rise = warnings(&cosine(150, 100), None);
        assert_eq!(rise.len(), 1, "{rise:?}");
        assert!(rise[0].starts_with("the lr rose from 0.0000") && rise[0].contains(" at step 100 to 0.0"), "{rise:?}");
        // Sized for the whole dataset: the run ends with the lr at 67% of its peak.
        let high = warnings(&cosine(40, 100), None);
        assert_eq!(high.len(), 1, "{high:?}");
        assert!(high[0].starts_with("the lr ended at 0.066") && high[0].contains("67% of its peak 0.1:"), "{high:?}");
        let constant = warnings(&[0.1; 20], None);
        assert!(constant[0].starts_with("every step had the same lr 0.1"), "{constant:?}");
    }

    #[test]
    fn a_round_that_keeps_the_workers_apart_is_warned_once() {
        let mut w = LrWatch::default();
        assert_eq!(w.observe(0, 0.2, Some(880), true), None);
        assert_eq!(w.round(0, 16, 0.2, 880), None, "a round of 16 steps always passes");
        assert_eq!(w.round(16, 55, 0.2, 880), None, "a sixteenth of the run passes");
        let warning = w.round(71, 800, 0.2, 880).expect("800 steps at the peak lr");
        assert!(warning.contains("keeps the workers apart for 800 steps"), "{warning}");
        assert_eq!(w.round(871, 800, 0.2, 880), None, "once");
    }
}
