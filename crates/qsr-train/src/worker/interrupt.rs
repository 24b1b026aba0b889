//! A run's SIGINT, SIGTERM or SIGHUP (issue 56 D10: `qsr train --workers 4` died of it at once,
//! silent, without a `--resume` hint and sometimes with a checkpoint half written; `--nproc` workers
//! died of their launcher's forwarded SIGTERM). Armed, the first signal is recorded; the workers (the
//! threads of this process, or the ranks of a launch, each armed) check it together at their syncs,
//! one all-reduce, and stop there with a checkpoint. A second signal ends the process at once.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{Context, Result};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};

/// The signal received since the handlers were armed (0: none).
static SIGNAL: OnceLock<Arc<AtomicUsize>> = OnceLock::new();

/// Arms the handlers for this process (once): the first SIGINT, SIGTERM or SIGHUP is recorded and
/// said on stderr; a second ends the process with the shell's status for it (128 + the signal).
pub(crate) fn arm() -> Result<()> {
    if SIGNAL.get().is_some() {
        return Ok(());
    }
    let signal = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(AtomicBool::new(false));
    for s in [SIGINT, SIGTERM, SIGHUP] {
        // In this order: a signal after the first ends the process before it is recorded again.
        signal_hook::flag::register_conditional_shutdown(s, 128 + s, Arc::clone(&seen))
            .and_then(|_| signal_hook::flag::register(s, Arc::clone(&seen)))
            .and_then(|_| signal_hook::flag::register_usize(s, Arc::clone(&signal), s as usize))
            .context("cannot install signal handlers")?;
    }
    let said = Arc::clone(&signal);
    std::thread::Builder::new()
        .name("qsr-signals".into())
        .spawn(move || {
            while said.load(Ordering::Relaxed) == 0 {
                std::thread::sleep(Duration::from_millis(100));
            }
            let s = said.load(Ordering::Relaxed) as i32;
            eprintln!(
                "qsr: {} received: the workers stop at their next sync, with a checkpoint (again to stop at once)",
                crate::exit::signal_name(s)
            );
        })
        .context("cannot start the signal watcher")?;
    let _ = SIGNAL.set(signal);
    Ok(())
}

/// Whether the handlers are armed in this process: every worker thread of it sees the same answer,
/// so they all check at the same syncs.
pub(crate) fn armed() -> bool {
    SIGNAL.get().is_some()
}

/// The signals a run stops for, in the order that picks one when the ranks received different ones.
const STOPPING: [i32; 3] = [SIGTERM, SIGINT, SIGHUP];

/// `signal` as one count per [`STOPPING`] signal, for the ranks to sum at a sync.
pub(crate) fn one_hot(signal: Option<i32>) -> [f32; 3] {
    STOPPING.map(|s| f32::from(u8::from(signal == Some(s))))
}

/// The signal every rank stops for, from the sum of the ranks' [`one_hot`]s: the same on every rank,
/// whichever ranks the signal reached.
pub(crate) fn agreed(counts: &[f32; 3]) -> Option<i32> {
    STOPPING.iter().zip(counts).find(|&(_, &count)| count > 0.0).map(|(&s, _)| s)
}

/// The signal received, if one came since the handlers were armed.
pub(crate) fn received() -> Option<i32> {
    SIGNAL.get().map(|s| s.load(Ordering::Relaxed) as i32).filter(|s| *s != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summed(ranks: &[Option<i32>]) -> [f32; 3] {
        ranks.iter().map(|&s| one_hot(s)).fold([0.0; 3], |acc, x| [acc[0] + x[0], acc[1] + x[1], acc[2] + x[2]])
    }

    /// The flaky `--nproc` SIGTERM test: rank 0 checked before the launcher's forwarded SIGTERM
    /// reached it, saw another rank's flag, and stopped "interrupted by signal 2 (SIGINT)". The ranks
    /// now sum which signal each received, and every rank stops for the same one.
    #[test]
    fn a_rank_the_forwarded_signal_has_not_reached_stops_for_the_others_signal_not_sigint() {
        assert_eq!(agreed(&summed(&[None, Some(SIGTERM)])), Some(SIGTERM));
        assert_eq!(agreed(&summed(&[Some(SIGHUP), None, None])), Some(SIGHUP));
        assert_eq!(agreed(&summed(&[Some(SIGINT), Some(SIGTERM)])), Some(SIGTERM));
        assert_eq!(agreed(&summed(&[None, None])), None);
    }
}
