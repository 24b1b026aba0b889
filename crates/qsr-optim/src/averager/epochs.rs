//! The loop's epochs, as `ShardedDataset::set_epoch` marks them on the averager's thread: the
//! first whole epoch's steps, measured once, against the steps the schedule was given.

/// Where the loop's epochs begin, from the `set_epoch` calls of the thread that steps the averager.
#[derive(Debug)]
pub(super) struct Epochs {
    /// `qsr_data::epochs_set_on_this_thread()` when last read.
    marks: u64,
    /// The step the current epoch began at, once a mark was seen.
    began: Option<u64>,
    /// The first whole epoch was measured.
    measured: bool,
}

impl Epochs {
    /// Marks from now on count: `set_epoch` calls made before the averager existed do not.
    pub(super) fn new() -> Self {
        Self { marks: qsr_data::epochs_set_on_this_thread(), began: None, measured: false }
    }

    /// Before step `t`: the steps of the first whole epoch, once, when a new epoch begins at `t`.
    pub(super) fn at_step(&mut self, t: u64) -> Option<u64> {
        let marks = qsr_data::epochs_set_on_this_thread();
        if marks == self.marks {
            return None;
        }
        self.marks = marks;
        match self.began.replace(t) {
            Some(began) if !self.measured && t > began => {
                self.measured = true;
                Some(t - began)
            }
            _ => None,
        }
    }
}

/// What rank 0 says of a first epoch of `per_epoch` steps in a run of `run` steps over `k` ranks: a
/// warning when the run is no whole number of such epochs (a schedule counted from the whole
/// dataset rather than this rank's shard, say), else a note of the epochs it makes.
pub(super) fn judge(per_epoch: u64, run: u64, k: usize) -> (bool, String) {
    let epochs = run as f64 / per_epoch as f64;
    if run.is_multiple_of(per_epoch) {
        // A whole dataset that splits evenly over the ranks gives a whole number too, k times too many:
        // said beside the count, which the user checks against the loop's epochs.
        let whole = match k {
            1 => String::new(),
            k => format!(" ({} if they were counted from the whole dataset of all {k} ranks)", epochs / k as f64),
        };
        let note = format!(
            "Averager: an epoch of this rank's shard is {per_epoch} steps; the schedule's {run} make {epochs} epochs{whole}"
        );
        return (false, note);
    }
    let cause = match k {
        1 => "steps counted from another dataset than the loop reads, say".to_owned(),
        k => format!("steps counted from the whole dataset rather than this rank's shard are about {k} times too many"),
    };
    (
        true,
        format!(
            "an epoch of this rank's shard took {per_epoch} steps, and the {run} steps given to \
             `AveragerConfig::schedule` make {epochs:.2} of them, not a whole number: if the loop runs whole \
             epochs, give the schedule the epochs times {per_epoch} ({cause})"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::judge;

    /// The trial: a whole dataset that splits evenly (40 steps an epoch, 1920 = 4 x 12 x 40) makes a
    /// whole number of epochs; the note says what the count would be if it came from all ranks. One
    /// that does not split (32 an epoch, 1500 steps) is warned.
    #[test]
    fn whole_epochs_are_noted_with_the_count_from_all_ranks_and_others_warned() {
        let (warned, note) = judge(40, 1920, 4);
        assert!(
            !warned && note.ends_with("make 48 epochs (12 if they were counted from the whole dataset of all 4 ranks)")
        );
        let (warned, text) = judge(32, 1500, 4);
        assert!(warned && text.contains("make 46.88 of them") && text.contains("about 4 times too many"), "{text}");
    }
}
