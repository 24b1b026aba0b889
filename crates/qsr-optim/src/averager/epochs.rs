//! The loop's epochs, as `ShardedDataset::set_epoch` marks them on the averager's thread: the
//! first whole epoch's steps, measured once, against the steps the schedule was given.

/// Where the loop's epochs begin, from the `set_epoch` calls of the thread that steps the averager.
#[derive(Debug)]
pub(super) struct Epochs {
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
        Self { marks: qsr_data::epochs_set_on_this_thread(), began: None, measured: None }
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

    /// " (12 epochs of 32 steps)": `steps` counted in the measured epochs, for the run's last line.
    pub(super) fn of(&self, steps: u64) -> String {
        match self.measured {
            Some(per_epoch) => format!(" ({} epochs of {per_epoch} steps)", epochs(steps, per_epoch)),
            None => String::new(),
        }
    }
}

/// `steps` in epochs of `per_epoch` (at least 1): "12", or "46.88" when not whole.
fn epochs(steps: u64, per_epoch: u64) -> String {
    if steps.is_multiple_of(per_epoch) {
        (steps / per_epoch).to_string()
    } else {
        format!("{:.2}", steps as f64 / per_epoch as f64)
    }
}

/// Rank 0's warning, if any, of a first epoch of `per_epoch` steps (at least 1) in a run of `run`
/// steps over `k` ranks. Steps counted from the whole dataset rather than this rank's shard are `k`
/// times too many: no whole number of epochs when the dataset does not split evenly, else a multiple
/// of `k` epochs, which a loop of that many epochs would also make (the warning names both readings).
pub(super) fn judge(per_epoch: u64, run: u64, k: usize) -> Option<String> {
    let made = epochs(run, per_epoch);
    if !run.is_multiple_of(per_epoch) {
        let cause = match k {
            1 => "steps counted from another dataset than the loop reads, say".to_owned(),
            k => format!(
                "steps counted from the whole dataset rather than this rank's shard are about {k} times too many"
            ),
        };
        return Some(format!(
            "an epoch of this rank's shard took {per_epoch} steps, and the {run} steps given to \
             `AveragerConfig::schedule` make {made} of them, not a whole number: if the loop runs whole \
             epochs, give the scheduler and the schedule the epochs times {per_epoch} ({cause})"
        ));
    }
    let k = k as u64;
    let whole = run / per_epoch;
    (k > 1 && whole.is_multiple_of(k)).then(|| {
        let loop_epochs = whole / k;
        let noun = if loop_epochs == 1 { "epoch" } else { "epochs" };
        format!(
            "the {run} steps given to `AveragerConfig::schedule` make {whole} epochs of this rank's shard ({per_epoch} \
             steps each): if the loop runs {loop_epochs} {noun}, they were counted from the whole dataset of all {k} \
             ranks, and the lr will end the loop high; give the scheduler and the schedule {loop_epochs} x \
             {per_epoch} = {} steps (a loop of {whole} epochs is right as it is)",
            run / k
        )
    })
}

#[cfg(test)]
mod tests {
    use super::judge;

    /// The trial: a whole dataset that splits evenly (40 steps an epoch, 1920 = 4 x 12 x 40) makes a
    /// multiple of the ranks' count of epochs: warned with both readings. One that does not split
    /// (32 an epoch, 1500 steps) is warned as no whole number.
    #[test]
    fn steps_counted_from_a_whole_dataset_are_warned_whether_or_not_it_splits_evenly() {
        let text = judge(40, 1920, 4).expect("an evenly split whole dataset is warned");
        assert!(
            text.contains("make 48 epochs of this rank's shard (40 steps each): if the loop runs 12 epochs")
                && text.contains("12 x 40 = 480 steps"),
            "{text}"
        );
        let text = judge(32, 1500, 4).expect("no whole number of epochs is warned");
        assert!(text.contains("make 46.88 of them") && text.contains("about 4 times too many"), "{text}");
    }

    /// A run of whole epochs that are no multiple of the ranks, or on one rank, says nothing.
    #[test]
    fn whole_epochs_that_no_whole_dataset_makes_say_nothing() {
        assert_eq!(judge(32, 5 * 32, 4), None);
        assert_eq!(judge(32, 12 * 32, 1), None);
        assert_eq!(judge(40, 6 * 40, 4), None);
    }
}
