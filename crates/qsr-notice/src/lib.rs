//! What qsr tells the person running a job (a plan that will go wrong, the syncs a run made), where
//! they will see it. A library can assume neither a `tracing` subscriber nor a console, so a
//! notice goes through `tracing` under the target `qsr` when the program's subscriber takes qsr's
//! warnings, and on stderr, as one line (`qsr: warning: ...`), when there is no subscriber or its
//! filter was not set for qsr (it takes errors only, as `EnvFilter` does without `RUST_LOG`).
//! A subscriber whose filter turns qsr off (`RUST_LOG=qsr=off` under `EnvFilter`) silences it;
//! `qsr=error` does not, since a filter that takes qsr's errors but not its warnings cannot be told
//! from one not set for qsr, and without a subscriber nothing reads `RUST_LOG`.
//!
//! ```
//! qsr_notice::notice(true, "the lr never moved"); // no subscriber: `qsr: warning: the lr never moved`
//! ```

use std::sync::atomic::{AtomicBool, Ordering};

use tracing::Level;

/// Whether [`notice`] also prints on stderr what a `tracing` subscriber takes.
static ALSO_ON_STDERR: AtomicBool = AtomicBool::new(false);

/// Makes [`notice`] print on stderr as well what a `tracing` subscriber takes: for a program whose
/// subscriber writes elsewhere than the console (burn-train's writes its experiment log, where nobody
/// watching the run reads a warning). For the whole process.
pub fn notices_on_stderr(on: bool) {
    ALSO_ON_STDERR.store(on, Ordering::Relaxed);
}

/// Says `message` to the person running the job: a warning, or a note (`warning` false). See the
/// crate's page for where it goes.
pub fn notice(warning: bool, message: &str) {
    let level = if warning { Level::WARN } else { Level::INFO };
    let Route { traced, stderr } = route(level);
    if traced && warning {
        tracing::warn!(target: "qsr", "{message}");
    } else if traced {
        tracing::info!(target: "qsr", "{message}");
    }
    if stderr {
        // One write: a line written in pieces can interleave with another thread's output.
        let line = format!("qsr: {}{message}\n", if warning { "warning: " } else { "" });
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }
}

/// Where a notice of `level` goes now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Route {
    traced: bool,
    stderr: bool,
}

/// The route under the current subscriber: none takes nothing; one that takes no error of qsr
/// turned it off; one that takes its errors but not its warnings was not set for qsr.
fn route(level: Level) -> Route {
    let none = tracing::dispatcher::get_default(|d| d.is::<tracing::subscriber::NoSubscriber>());
    if none {
        return Route { traced: false, stderr: true };
    }
    if !enabled(Level::ERROR) {
        return Route { traced: false, stderr: false };
    }
    if !enabled(Level::WARN) {
        return Route { traced: false, stderr: true };
    }
    Route { traced: enabled(level), stderr: ALSO_ON_STDERR.load(Ordering::Relaxed) }
}

/// Whether the current subscriber takes events of `level` for the target `qsr`.
fn enabled(level: Level) -> bool {
    // The macro's level is part of a static callsite: one arm per level.
    if level == Level::ERROR {
        tracing::enabled!(target: "qsr", Level::ERROR)
    } else if level == Level::WARN {
        tracing::enabled!(target: "qsr", Level::WARN)
    } else {
        tracing::enabled!(target: "qsr", Level::INFO)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn under(filter: &str, level: Level) -> Route {
        use tracing_subscriber::util::SubscriberInitExt;
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::sink)
            .finish();
        let _scope = subscriber.set_default();
        route(level)
    }

    /// The sixth trial: a ShardedDataset warning vanished under `EnvFilter`'s default (errors only)
    /// while the Averager's printed, and `RUST_LOG=qsr=off` did not silence the Averager. One rule for
    /// both now: off silences, a filter not set for qsr sends notices to stderr, one that takes qsr's
    /// warnings decides by level.
    #[test]
    fn qsr_off_silences_notices_and_a_filter_not_set_for_qsr_leaves_them_on_stderr() {
        let (stderr, traced, nowhere) = (
            Route { traced: false, stderr: true },
            Route { traced: true, stderr: false },
            Route { traced: false, stderr: false },
        );
        assert_eq!(route(Level::WARN), stderr, "no subscriber");
        assert_eq!(under("qsr=off", Level::WARN), nowhere);
        assert_eq!(under("error", Level::WARN), stderr);
        assert_eq!(under("error", Level::INFO), stderr);
        assert_eq!(under("qsr=warn", Level::WARN), traced);
        assert_eq!(under("qsr=warn", Level::INFO), nowhere);
        assert_eq!(under("info", Level::INFO), traced);
    }
}
