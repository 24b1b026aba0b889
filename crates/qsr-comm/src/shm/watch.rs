//! Seeing a group member's process die while we wait for it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// How we learn that member `q`'s process is gone.
pub(crate) enum Watch {
    /// This rank, or a member in this very process (threads): its `closed` flag says it all.
    SameProcess(u32),
    /// A pidfd: readable once the process has exited (zombie or not).
    Pidfd { fd: OwnedFd, pid: u32 },
    /// Kernels without pidfds (before 5.3): `/proc/<pid>/stat`.
    Proc(u32),
}

impl Watch {
    pub(crate) fn new(pid: u64, me: bool) -> Watch {
        let pid = u32::try_from(pid).unwrap_or(0);
        if me || pid == std::process::id() {
            return Watch::SameProcess(pid);
        }
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        match i32::try_from(fd) {
            // SAFETY: a fresh descriptor that nothing else owns.
            Ok(fd) if fd >= 0 => Watch::Pidfd { fd: unsafe { OwnedFd::from_raw_fd(fd) }, pid },
            _ => Watch::Proc(pid),
        }
    }

    /// Whether the process has exited (never, for members of this process).
    pub(crate) fn exited(&self) -> bool {
        match self {
            Watch::SameProcess(_) => false,
            Watch::Pidfd { fd, .. } => {
                let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd, no waiting.
                let rc = unsafe { libc::poll(&mut p, 1, 0) };
                rc > 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
            }
            Watch::Proc(pid) => !super::mapping::alive(*pid),
        }
    }

    /// The member's address, for messages.
    pub(crate) fn describe(&self) -> String {
        match self {
            Watch::SameProcess(pid) => format!("pid {pid}, this process"),
            Watch::Pidfd { pid, .. } | Watch::Proc(pid) => format!("pid {pid}, this host"),
        }
    }
}
