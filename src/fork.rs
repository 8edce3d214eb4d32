//! Instances and `fork`. A child forked after an instance was created has
//! a copy of the instance (its memory, the region mapping) but not its
//! proxy thread, GPU context or MPI state, which stay with the parent. A
//! call there would publish into the region the parent's proxy sends
//! from, and the parent's peers would sum it as the parent's data. So a
//! handler registered with `pthread_atfork` counts forks in the child;
//! every call checks the count it was created under (one relaxed load)
//! and fails in a child, before it touches MPI, CUDA or a lock the
//! parent's threads may have held at the fork (`Device::fork_guard`: the
//! collectives, `barrier`, `check`, `async_error`, `probe_rails`, the
//! safe GPU calls before cudarc's driver calls; `last_stages` shows
//! nothing), and dropping an instance in a child frees nothing the parent
//! still uses.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

/// Forks this process has been the child of (since the handler was
/// registered).
static FORKS: AtomicU64 = AtomicU64::new(0);
static REGISTER: Once = Once::new();

extern "C" fn in_child() {
    // Runs in the child right after fork (one thread): an atomic add is
    // async-signal-safe.
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// The fork count an instance records when it is created (registering the
/// handler first, once per process).
pub(crate) fn generation() -> u64 {
    REGISTER.call_once(|| {
        // SAFETY: registers a handler that only touches an atomic; no
        // prepare or parent handler. A failure (ENOMEM) leaves forks
        // uncounted: logged, not fatal.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
        if rc != 0 {
            log::warn!(
                "arx: pthread_atfork failed ({rc}); calls in a forked child are not refused"
            );
        }
    });
    FORKS.load(Ordering::Relaxed)
}

/// Whether this process is a fork of the one that recorded `born`.
pub(crate) fn forked(born: u64) -> bool {
    FORKS.load(Ordering::Relaxed) != born
}

/// The fork generation an instance was made under, copied out of it
/// ([`crate::Arx::fork_stamp`]) so that a binding can tell a forked child
/// without reaching the instance: the instance may sit behind a lock that
/// a thread of the parent held at the fork, which no thread of the child
/// will ever release.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForkStamp(pub(crate) u64);

impl ForkStamp {
    /// Whether this process is a fork of the one that made the instance.
    pub fn forked(&self) -> bool {
        forked(self.0)
    }

    /// The error every call of the instance returns in a forked child
    /// (`Ok` in the process that made it).
    pub fn check(&self) -> crate::Result<()> {
        if self.forked() {
            return Err(crate::Error::Proxy(format!(
                "this process (pid {}) is a fork of the one that made the instance: the \
                 proxy thread, GPU context and MPI state stay with the parent; make \
                 instances in the child itself",
                std::process::id()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `child` in a forked child and returns its exit status (the
    /// child leaves with `_exit`, running nothing else of the parent's).
    /// `child` must only do what is safe after a fork in a threaded
    /// process: read atomics, format strings.
    fn in_child(child: impl FnOnce() -> bool) -> i32 {
        // SAFETY: the child runs `child` (see above) and calls _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let code = if child() { 0 } else { 1 };
            // SAFETY: leaves the child at once, running nothing of the
            // parent's (no destructors, no test harness).
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        let w = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(w, pid);
        assert!(libc::WIFEXITED(status), "child status {status}");
        libc::WEXITSTATUS(status)
    }

    #[test]
    fn a_forked_child_sees_a_new_generation() {
        let born = generation();
        assert!(!forked(born));
        assert_eq!(
            in_child(|| forked(born)),
            0,
            "the child did not see the fork"
        );
        assert!(!forked(born), "the parent must not count its child's fork");
    }

    #[test]
    fn a_stamp_refuses_in_a_forked_child_only() {
        let stamp = ForkStamp(generation());
        assert!(stamp.check().is_ok());
        let refused =
            || matches!(stamp.check(), Err(crate::Error::Proxy(m)) if m.contains("is a fork"));
        assert_eq!(in_child(refused), 0, "the stamp passed in the child");
        assert!(stamp.check().is_ok());
    }
}
