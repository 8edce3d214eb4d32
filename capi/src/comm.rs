//! The communicator behind an `arxComm_t`: an [`Arx`] instance, its last
//! error message, and the lock that keeps two threads out of one instance.

use std::ffi::{c_char, c_int, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, TryLockError};

use arx::{Arx, ForkStamp};

use crate::error::{c_string, guard, Failure};
use crate::types::{arxComm_t, RawResult};

/// Marks a live communicator: a pointer that is not one (a stray pointer,
/// or one already destroyed and not yet reused) is refused in most cases
/// instead of being used. A help, not a guarantee: reading freed memory is
/// undefined behaviour in C already.
const LIVE: u64 = 0x6172_785f_636f_6d6d; // "arx_comm"
const DEAD: u64 = 0x6172_785f_6465_6164; // "arx_dead"

/// An arx communicator (opaque to C).
pub struct arxComm {
    magic: u64,
    rank: c_int,
    count: c_int,
    gpu: bool,
    /// The fork generation the instance was made under: a forked child's
    /// copy of `state` may be locked for good (a parent thread was inside
    /// a call at the fork), so the child learns of the fork from here.
    stamp: ForkStamp,
    // The lock is only ever tried: a second thread inside a call on the
    // same comm is refused rather than made to wait (collective calls must
    // be made in one order on every rank; two threads racing for one comm
    // would make that order arbitrary).
    state: Mutex<State>,
}

pub(crate) struct State {
    pub(crate) arx: Arx,
    /// `arxGetLastError(comm)`; valid until the next failing call on the comm.
    last_error: CString,
    /// The message of `last_error`, without the entry point's name.
    last_message: String,
    /// A call panicked: the instance may be half-way through a change, so
    /// every later call fails with this message.
    broken: Option<String>,
}

impl State {
    /// Records `f`, the failure of entry point `name`, as the comm's last error.
    pub(crate) fn record(&mut self, name: &str, f: &Failure) {
        self.last_error = c_string(&format!("{name}: {}", f.message));
        self.last_message.clone_from(&f.message);
    }

    /// Records `f` (the comm's error, found by `name` without failing)
    /// unless the last error is that failure already: the message keeps
    /// the name of the call that returned it.
    pub(crate) fn record_found(&mut self, name: &str, f: &Failure) {
        if self.last_message != f.message {
            self.record(name, f);
        }
    }
}

impl arxComm {
    /// A new communicator handle owning `arx`.
    pub(crate) fn create(arx: Arx) -> arxComm_t {
        let gpu = arx.cuda_context().is_some();
        let stamp = arx.fork_stamp();
        let c = arxComm {
            stamp,
            magic: LIVE,
            rank: arx.rank() as c_int,
            count: arx.world() as c_int,
            gpu,
            state: Mutex::new(State {
                arx,
                last_error: CString::default(),
                last_message: String::new(),
                broken: None,
            }),
        };
        Box::into_raw(Box::new(c))
    }

    pub(crate) fn rank(&self) -> c_int {
        self.rank
    }
    pub(crate) fn count(&self) -> c_int {
        self.count
    }
    /// Whether the instance runs the GPU side (device calls allowed).
    pub(crate) fn gpu(&self) -> bool {
        self.gpu
    }
}

/// The communicator behind `comm`, or why it cannot be used.
///
/// # Safety
/// `comm` is NULL or was returned by `arxCommInit` and not yet destroyed.
pub(crate) unsafe fn comm_ref<'a>(comm: arxComm_t) -> Result<&'a arxComm, Failure> {
    if comm.is_null() {
        return Err(Failure::invalid("comm is NULL"));
    }
    // SAFETY: the caller's contract; the magic check only catches some
    // misuse (see LIVE).
    let c = unsafe { &*comm };
    match c.magic {
        LIVE => Ok(c),
        DEAD => Err(Failure::usage("comm was destroyed (arxCommDestroy)")),
        _ => Err(Failure::invalid(
            "comm is not an arxComm_t made by arxCommInit",
        )),
    }
}

/// Why `c` is locked: another thread is inside a call on it, or, in a
/// forked child, a thread of the parent was at the fork (that lock is
/// never released in the child: the fork's error, as every call there
/// gets).
fn busy(c: &arxComm) -> Failure {
    match c.stamp.check() {
        Err(e) => Failure::from(e),
        Ok(()) => Failure::usage(
            "another thread is inside a call on this comm (use a comm from one thread at a time)",
        ),
    }
}

/// A forked child's copy of a comm that a parent thread was inside at the
/// fork: its lock stays held, so its calls and its own error go through
/// here. The fork's failure, or None when `comm` is not such a copy.
///
/// # Safety
/// As [`comm_ref`].
pub(crate) unsafe fn forked_and_held(comm: arxComm_t) -> Option<Failure> {
    // SAFETY: the caller's contract.
    let c = unsafe { comm_ref(comm) }.ok()?;
    if !c.stamp.forked() {
        return None;
    }
    match c.state.try_lock() {
        Err(TryLockError::WouldBlock) => Some(busy(c)),
        _ => None,
    }
}

/// Runs entry point `name` on `comm`'s instance: refused while another
/// thread is inside a call on it; a failure is recorded as the comm's last
/// error as well as the thread's.
///
/// # Safety
/// As [`comm_ref`].
pub(crate) unsafe fn with_comm(
    name: &str,
    comm: arxComm_t,
    f: impl FnOnce(&arxComm, &mut State) -> Result<(), Failure>,
) -> RawResult {
    guard(name, || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm)? };
        let mut st = match c.state.try_lock() {
            Ok(g) => g,
            Err(TryLockError::WouldBlock) => return Err(busy(c)),
            // Never poisoned: panics are caught below, inside the lock.
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
        };
        if let Some(b) = &st.broken {
            return Err(Failure::internal(format!(
                "an earlier call on this comm panicked: {b}"
            )));
        }
        let r = match catch_unwind(AssertUnwindSafe(|| f(c, &mut st))) {
            Ok(r) => r,
            Err(p) => {
                let f = Failure::panic(&*p);
                st.broken = Some(f.message.clone());
                Err(f)
            }
        };
        if let Err(e) = &r {
            st.record(name, e);
        }
        r
    })
}

/// `arxGetLastError(comm)`: the comm's last failure message.
///
/// # Safety
/// As [`comm_ref`].
pub(crate) unsafe fn last_error(comm: arxComm_t) -> *const c_char {
    // SAFETY: the caller's contract.
    let c = match unsafe { comm_ref(comm) } {
        Ok(c) => c,
        Err(_) => return c"arxGetLastError: comm is not a live arxComm_t".as_ptr(),
    };
    match c.state.try_lock() {
        // The string stays in the comm after the lock is released: it is
        // replaced only by a later failing call on the comm (the documented
        // validity) or freed by arxCommDestroy.
        Ok(st) => st.last_error.as_ptr(),
        Err(TryLockError::Poisoned(p)) => p.into_inner().last_error.as_ptr(),
        Err(TryLockError::WouldBlock) if c.stamp.forked() => {
            c"arxGetLastError: this process is a fork of the one that made the comm, \
              and a thread of that process was inside a call on it at the fork: make \
              comms in the child itself"
                .as_ptr()
        }
        Err(TryLockError::WouldBlock) => {
            c"arxGetLastError: another thread is inside a call on this comm".as_ptr()
        }
    }
}

/// `arxCommDestroy`: frees the communicator (the instance closes: it
/// waits for its GPU work, stops its proxy and, over RDMA, closes with its
/// peers, bounded by the call timeout). In a forked child it frees
/// nothing the parent uses (arx's drop abandons the proxy, GPU and MPI
/// parts); a copy that a parent thread was inside at the fork is only
/// marked destroyed, not freed: its lock is held for good and its
/// instance may be half-way through that call.
///
/// # Safety
/// As [`comm_ref`]; no other thread uses `comm` during or after the call.
pub(crate) unsafe fn destroy(comm: arxComm_t) -> RawResult {
    guard("arxCommDestroy", || {
        // SAFETY: the caller's contract.
        unsafe { comm_ref(comm)? };
        {
            // SAFETY: checked live just above.
            let c = unsafe { &*comm };
            let held = matches!(c.state.try_lock(), Err(TryLockError::WouldBlock));
            if held && !c.stamp.forked() {
                return Err(Failure::usage(
                    "another thread is inside a call on this comm: it cannot be destroyed now",
                ));
            }
            if held {
                // SAFETY: live (checked); in a forked child only this
                // thread runs, and `c` is not used after this write. The
                // memory is the child's copy, reclaimed when it exits or
                // execs.
                unsafe { (*comm).magic = DEAD };
                return Ok(());
            }
        }
        // SAFETY: `comm` came from Box::into_raw in `create` and is live;
        // no other thread is inside it (checked), and the caller promises
        // none will use it again.
        let mut b = unsafe { Box::from_raw(comm) };
        b.magic = DEAD;
        drop(b);
        Ok(())
    })
}
