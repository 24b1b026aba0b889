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

/// The signal received, if one came since the handlers were armed.
pub(crate) fn received() -> Option<i32> {
    SIGNAL.get().map(|s| s.load(Ordering::Relaxed) as i32).filter(|s| *s != 0)
}
