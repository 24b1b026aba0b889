//! What `qsr launch`'s ranks started and left behind. Each rank leads a process group the launcher
//! stops, but a process that made a session of its own (`setsid`, a daemon) leaves that group; as
//! the ranks' child subreaper, the launcher inherits such processes once their parent exits, and
//! stops them with the job (N11).

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rustix::process::{Pid, Signal, WaitOptions};

/// How long an adopted process has, after SIGTERM, before SIGKILL.
const GRACE: Duration = Duration::from_secs(1);

/// Makes this process the subreaper of its descendants: orphans come to it, not to init.
pub(crate) fn become_subreaper() -> Result<()> {
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))
        .context("cannot become the ranks' child subreaper (prctl PR_SET_CHILD_SUBREAPER)")
}

/// Stops every child of this process (once the ranks were reaped, only what they left behind), each
/// named: SIGTERM, then SIGKILL after [`GRACE`]. Looks again a few times, since a process is
/// reparented only once its dying parent is gone.
pub(crate) fn stop_adopted() {
    for _ in 0..3 {
        let adopted = children();
        for &pid in &adopted {
            eprintln!("qsr: stopping pid {} that a rank started and left running", pid.as_raw_nonzero());
            let _ = rustix::process::kill_process(pid, Signal::TERM);
        }
        let deadline = Instant::now() + GRACE;
        let mut left = adopted;
        while !left.is_empty() && Instant::now() < deadline {
            left.retain(|&pid| !reaped(pid));
            std::thread::sleep(Duration::from_millis(20));
        }
        for pid in left {
            let _ = rustix::process::kill_process(pid, Signal::KILL);
            let _ = rustix::process::waitpid(Some(pid), WaitOptions::empty());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether `pid` has exited (and is reaped now).
fn reaped(pid: Pid) -> bool {
    !matches!(rustix::process::waitpid(Some(pid), WaitOptions::NOHANG), Ok(None))
}

/// The processes whose parent is this one, from `/proc/<pid>/stat`.
fn children() -> Vec<Pid> {
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            let stat = qsr_files::read_text(std::path::Path::new(&format!("/proc/{pid}/stat")), 4096, "process status");
            stat.ok().and_then(|s| parent_in(&s)) == Some(me)
        })
        .filter_map(Pid::from_raw)
        .collect()
}

/// The parent pid in a `/proc/<pid>/stat` line: the second field after the command, whose name may
/// hold spaces and parentheses (so the last `)` ends it).
fn parent_in(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parent_is_read_past_a_command_with_spaces_and_parentheses() {
        assert_eq!(parent_in("4242 (a (b) c) S 17 4242 4242 0 -1"), Some(17));
        assert_eq!(parent_in("garbage"), None);
    }
}
