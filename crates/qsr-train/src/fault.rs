//! Faults injected by tests and `cargo xtask chaos` (`QSR_TEST_FAULT`), so that a worker can be lost
//! at an exact point, twice alike.
//!
//! `QSR_TEST_FAULT=<signal>:<rank>:<where>`, where `signal` is `kill` (SIGKILL) or `stop` (SIGSTOP)
//! and `where` is one of:
//! - `<step>`: as the worker starts that step;
//! - `<step>:synced`: right after the global sync that completes `<step>` steps, before anything
//!   (records, evaluation, checkpoint) follows it;
//! - `<step>:commit`: rank 0, while it commits the checkpoint of `<step>`, after every rank wrote its
//!   files and before the checkpoint is renamed into place;
//! - `join`: before joining the elastic store (elastic workers, by their launcher order `--rank`);
//! - `<generation>:formed`: once the store formed that generation with the worker, before its ring
//!   forms (elastic workers, by their launcher order): a second fault while the job re-forms.
//!
//! Several faults, for different ranks, are separated by commas (`kill:2:101,kill:1:1:formed`).
//! Only the first generation of an elastic job fires a step's fault (a process fires at most once): a
//! worker that comes back after a change does not die again at the same step.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Result, anyhow};
use rustix::process::Signal;

/// Where in a worker's life a fault fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Point {
    /// The start of a step.
    Step(u64),
    /// Just after the global sync that completes this many steps.
    Synced(u64),
    /// Rank 0 committing the checkpoint of this step.
    Commit(u64),
    /// Before joining the elastic store.
    Join,
    /// The store formed this generation with the worker; its ring has not formed yet.
    Formed(u64),
}

#[derive(Debug)]
struct Fault {
    signal: Signal,
    rank: usize,
    point: Point,
}

static FAULT: OnceLock<Result<Vec<Fault>, String>> = OnceLock::new();
static ARMED: AtomicBool = AtomicBool::new(true);
/// A fault fired in this process (each fires at most once).
static FIRED: AtomicBool = AtomicBool::new(false);

fn parse(spec: &str) -> Result<Fault, String> {
    let bad = || {
        format!(
            "QSR_TEST_FAULT={spec}: expected kill|stop:<rank>:<step>, kill|stop:<rank>:<step>:synced|commit, kill|stop:<rank>:<generation>:formed or kill|stop:<rank>:join, several separated by commas"
        )
    };
    let parts: Vec<&str> = spec.split(':').collect();
    let signal = match parts.first() {
        Some(&"kill") => Signal::KILL,
        Some(&"stop") => Signal::STOP,
        _ => return Err(bad()),
    };
    let rank = parts.get(1).and_then(|r| r.parse().ok()).ok_or_else(bad)?;
    let step = || parts.get(2).and_then(|s| s.parse::<u64>().ok()).ok_or_else(bad);
    let point = match (parts.get(2), parts.get(3), parts.len()) {
        (Some(&"join"), None, 3) => Point::Join,
        (Some(_), None, 3) => Point::Step(step()?),
        (Some(_), Some(&"synced"), 4) => Point::Synced(step()?),
        (Some(_), Some(&"commit"), 4) => Point::Commit(step()?),
        (Some(_), Some(&"formed"), 4) => Point::Formed(step()?),
        _ => return Err(bad()),
    };
    Ok(Fault { signal, rank, point })
}

fn faults() -> Result<&'static [Fault], String> {
    let f = FAULT
        .get_or_init(|| std::env::var("QSR_TEST_FAULT").map_or(Ok(Vec::new()), |s| s.split(',').map(parse).collect()));
    f.as_deref().map_err(Clone::clone)
}

/// Refuses a malformed `QSR_TEST_FAULT` (before anything starts).
pub(crate) fn check() -> Result<()> {
    faults().map(|_| ()).map_err(|e| anyhow!(e))
}

/// Fires the fault for this rank at this point, if there is one (and none has fired, and the first
/// generation still runs; a `formed` fault fires in the generation it names).
pub(crate) fn at(rank: usize, point: Point) {
    let Ok(faults) = faults() else {
        return;
    };
    let Some(f) = faults.iter().find(|f| f.rank == rank && f.point == point) else {
        return;
    };
    let armed = match point {
        Point::Formed(_) => !FIRED.swap(true, Ordering::Relaxed),
        _ => ARMED.load(Ordering::Relaxed) && !FIRED.swap(true, Ordering::Relaxed),
    };
    if armed {
        let _ = rustix::process::kill_process(this_thread(), f.signal);
    }
}

/// This thread's id, as `kill` takes it: the signal still stops (or kills) the whole process, but
/// the kernel hands it to this thread, which stops before it runs on. Sent to the process id, the
/// main thread took it, and on a busy host this thread ran on first (a checkpoint committed after
/// its `commit` fault). The process id where `/proc/thread-self` cannot be read.
fn this_thread() -> rustix::process::Pid {
    let tid = std::fs::read_link("/proc/thread-self").ok().and_then(|link| {
        let tid = link.file_name()?.to_str()?.parse::<i32>().ok()?;
        rustix::process::Pid::from_raw(tid)
    });
    tid.unwrap_or_else(rustix::process::getpid)
}

/// The first generation of this elastic worker ended: no fault fires after it.
pub(crate) fn disarm() {
    ARMED.store(false, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `commit` fault's SIGSTOP went to the process, and under load the firing thread committed
    /// the checkpoint before the main thread stopped the process: it now goes to the firing thread.
    #[test]
    fn a_fault_signals_the_thread_that_fires_it() {
        // The process id for every thread would give both the same.
        let (here, other) = (this_thread(), std::thread::spawn(this_thread).join().unwrap());
        assert_ne!(here, other, "two threads, one id");
        let task = format!("/proc/self/task/{}", here.as_raw_nonzero());
        assert!(std::path::Path::new(&task).exists(), "{task}: not a thread of this process");
    }

    #[test]
    fn fault_specs_parse_to_their_points_and_malformed_ones_are_refused() {
        let p = |s: &str| parse(s).map(|f| (f.rank, f.point));
        assert_eq!(p("kill:2:101"), Ok((2, Point::Step(101))));
        assert_eq!(p("stop:0:40:synced"), Ok((0, Point::Synced(40))));
        assert_eq!(p("kill:0:80:commit"), Ok((0, Point::Commit(80))));
        assert_eq!(p("kill:1:join"), Ok((1, Point::Join)));
        assert_eq!(p("kill:1:2:formed"), Ok((1, Point::Formed(2))));
        for bad in ["", "kill", "kill:x:1", "hup:1:2", "kill:1:2:later", "kill:1:join:synced", "kill:1:2:synced:3"] {
            assert!(parse(bad).unwrap_err().contains("expected"), "{bad}");
        }
    }
}
