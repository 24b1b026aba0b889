//! The loop's epochs, as `ShardedDataset::set_epoch` marks them on the averager's thread: the
//! first whole epoch's steps, measured once, against the steps the schedule was given.

/// Where the loop's epochs begin, from the `set_epoch` calls of the thread that steps the averager.
#[derive(Debug)]
pub(super) struct Epochs {
    /// `qsr_data::epochs_set_on_this_thread()` when the averager was built: later loops are its.
    start: u64,
    /// `qsr_data::epochs_set_on_this_thread()` when last read.
    marks: u64,
    /// The step the current epoch began at, once a mark was seen.
    began: Option<u64>,
    /// The steps of the first whole epoch, once measured.
    measured: Option<u64>,
}

impl Epochs {
    /// Marks from now on count: `set_epoch` calls made before the averager existed do not.
    pub(super) fn new() -> Self {
        let marks = qsr_data::epochs_set_on_this_thread();
        Self { start: marks, marks, began: None, measured: None }
    }

    /// The epochs the loop runs, when it goes through `ShardedDataset::epochs` since the averager
    /// was built.
    pub(super) fn of_loop(&self) -> Option<u64> {
        qsr_data::loop_epochs_on_this_thread().filter(|l| l.set_before >= self.start).map(|l| l.epochs)
    }

    /// Before step `t`: the steps of the first whole epoch, once, when a new epoch begins at `t`.
    pub(super) fn at_step(&mut self, t: u64) -> Option<u64> {
        let marks = qsr_data::epochs_set_on_this_thread();
        if marks == self.marks {
            return None;
        }
        self.marks = marks;
        match self.began.replace(t) {
            Some(began) if self.measured.is_none() && t > began => {
                self.measured = Some(t - began);
                self.measured
            }
            _ => None,
        }
    }

    /// Whether the loop, which said its epochs (`ShardedDataset::epochs`) and whose first epoch was
    /// measured, takes more steps than `run`.
    pub(super) fn runs_past(&self, run: u64) -> bool {
        matches!((self.of_loop(), self.measured), (Some(epochs), Some(per_epoch)) if epochs.saturating_mul(per_epoch) > run)
    }

    /// " (12 epochs of 32 steps)": `steps` counted in the measured epochs, for the run's last line.
    pub(super) fn of(&self, steps: u64) -> String {
        match self.measured {
            Some(per_epoch) => format!(" ({} epochs of {per_epoch} steps)", epochs_of(steps, per_epoch)),
            None => String::new(),
        }
    }
}

/// What `run` steps, where the loop takes `steps`, say of their count over `k` ranks: ", 4 times as
/// many: ..." when they are (about) `k` times as many, what counting the whole dataset gives.
pub(super) fn times_the_shard(run: u64, steps: u64, k: u64) -> String {
    let ratio = run as f64 / steps.max(1) as f64;
    if k < 2 || (ratio / k as f64 - 1.0).abs() > 0.1 {
        return String::new();
    }
    let about = if run == steps.saturating_mul(k) { "" } else { "about " };
    let all = if k == 2 { "both".to_owned() } else { format!("all {k}") };
    format!(
        ", {about}{k} times as many: steps counted from the whole dataset of {all} ranks rather than this rank's shard"
    )
}

/// `steps` in epochs of `per_epoch` (at least 1): "12", or "46.88" when not whole.
fn epochs_of(steps: u64, per_epoch: u64) -> String {
    if steps.is_multiple_of(per_epoch) {
        (steps / per_epoch).to_string()
    } else {
        format!("{:.2}", steps as f64 / per_epoch as f64)
    }
}

/// Rank 0's warning, if any, of a first epoch of `per_epoch` steps (at least 1) in a run of `run`
/// steps over `k` ranks, whose loop runs `loop_epochs` epochs when it said so
/// (`ShardedDataset::epochs`): steps other than those epochs' (counted from the whole dataset, `k`
/// times too many, say). Without them, steps that make no whole number of epochs; a whole dataset
/// that splits evenly makes a whole number, which only the loop's epochs tell apart from a run of
/// that many.
pub(super) fn judge(per_epoch: u64, run: u64, k: usize, loop_epochs: Option<u64>) -> Option<String> {
    let k = k as u64;
    let given = format!("the {run} steps the schedule was given (`AveragerConfig::schedule`, or `run_steps`)");
    if let Some(epochs) = loop_epochs {
        let steps = epochs.saturating_mul(per_epoch);
        return (run != steps).then(|| {
            format!(
                "the loop runs {epochs} epochs of {per_epoch} steps (this rank's shard), {steps} steps, but {given} \
                 make {} epochs{}; give the scheduler and the schedule {steps}",
                epochs_of(run, per_epoch),
                times_the_shard(run, steps, k)
            )
        });
    }
    if run.is_multiple_of(per_epoch) {
        return None;
    }
    let cause = match k {
        1 => "steps counted from another dataset than the loop reads, say".to_owned(),
        k => format!("steps counted from the whole dataset rather than this rank's shard are about {k} times too many"),
    };
    Some(format!(
        "an epoch of this rank's shard took {per_epoch} steps, and {given} make {} of them, not a whole number: if \
         the loop runs whole epochs, give the scheduler and the schedule the epochs times {per_epoch} ({cause})",
        epochs_of(run, per_epoch)
    ))
}

#[cfg(test)]
mod tests {
    use super::{Epochs, judge};

    /// A loop over `ShardedDataset::epochs` that ran on this thread before the averager was built
    /// (an earlier run's) is not its loop; one that runs after is.
    #[test]
    fn only_a_loop_after_the_averager_was_built_tells_its_epochs() {
        let items = burn::data::dataset::InMemDataset::new((0..8).collect::<Vec<u32>>());
        let shard = qsr_data::ShardedDataset::new(items, 0, 2, 7).unwrap();
        shard.epochs(0..5).for_each(drop);
        let epochs = Epochs::new();
        assert_eq!(epochs.of_loop(), None);
        shard.epochs(0..3).next();
        assert_eq!(epochs.of_loop(), Some(3));
    }

    /// The trial: a whole dataset that splits evenly (40 steps an epoch, 1920 = 4 x 12 x 40) makes a
    /// whole number of a shard's epochs; a loop that says it runs 12 (`ShardedDataset::epochs`) is
    /// warned, with the factor and the steps to give. One that does not split (32 an epoch, 1500
    /// steps) is warned as no whole number, said or not.
    #[test]
    fn steps_counted_from_a_whole_dataset_are_warned_whether_or_not_it_splits_evenly() {
        let text = judge(40, 1920, 4, Some(12)).expect("an evenly split whole dataset is warned");
        assert!(!text.contains("  "), "the sixth trial saw a run of spaces: {text}");
        assert!(text.contains("the loop runs 12 epochs of 40 steps (this rank's shard), 480 steps"), "{text}");
        assert!(text.contains("make 48 epochs, 4 times as many") && text.ends_with("schedule 480"), "{text}");
        let text = judge(32, 1500, 4, None).expect("no whole number of epochs is warned");
        assert!(text.contains("make 46.88 of them") && text.contains("about 4 times too many"), "{text}");
        let text = judge(32, 1500, 4, Some(12)).expect("said or not");
        assert!(text.contains("about 4 times as many: steps counted from the whole dataset") && !text.contains("  "));
        assert!(text.ends_with("give the scheduler and the schedule 384"), "{text}");
        let text = judge(32, 320, 4, Some(12)).expect("10 epochs' steps for a loop of 12");
        assert!(!text.contains("times as many") && text.contains("make 10 epochs"), "{text}");
    }

    /// The fifth trial: a correct run of 12 epochs on 2, 3 or 4 ranks was warned that its steps might
    /// be counted from the whole dataset. Steps the loop's epochs make, or a whole number of epochs
    /// when the loop did not say how many, say nothing.
    #[test]
    fn a_correct_run_of_any_number_of_epochs_is_not_warned() {
        for k in [1, 2, 3, 4] {
            assert_eq!(judge(32, 12 * 32, k, Some(12)), None);
            assert_eq!(judge(32, 12 * 32, k, None), None);
        }
        assert_eq!(judge(40, 1920, 4, None), None, "ambiguous without the loop's epochs: a run of 48 is right");
    }
}
