//! Failures at the boundary: the one mapping from [`arx::Error`] to
//! `arxResult_t`, the messages `arxGetLastError` returns, and [`guard`],
//! which every entry point runs in so that no panic crosses into C.

use std::any::Any;
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use arx::{CallKind, Error};

use crate::types::{arxResult_t, RawResult};

/// A failed call: its code and its message (without the function's name).
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub code: arxResult_t,
    pub message: String,
}

impl Failure {
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Failure {
            code: arxResult_t::arxInvalidArgument,
            message: format!("invalid argument: {}", message.into()),
        }
    }
    pub(crate) fn usage(message: impl Into<String>) -> Self {
        Failure {
            code: arxResult_t::arxInvalidUsage,
            message: format!("invalid usage: {}", message.into()),
        }
    }
    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Failure {
            code: arxResult_t::arxInternalError,
            message: format!("internal error: {}", message.into()),
        }
    }
    /// From a caught panic's payload.
    pub(crate) fn panic(payload: &(dyn Any + Send)) -> Self {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into());
        Failure::internal(format!("arx panicked (a bug; please report it): {what}"))
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure {
            code: code_of(&e),
            message: e.to_string(),
        }
    }
}

/// The result code of an arx error (the table in docs/C.md).
pub(crate) fn code_of(e: &Error) -> arxResult_t {
    use arxResult_t::*;
    match e {
        Error::InvalidArgument(_) | Error::Config { .. } => arxInvalidArgument,
        Error::Mismatch { .. } => arxMismatch,
        // A peer whose fabric failed announced nothing: that is its failure,
        // not a disagreement about the call.
        // Nor is one that had failed a call before (a timeout of its own),
        // or had destroyed its comm after fewer calls.
        Error::CallMismatch { theirs, .. }
            if matches!(
                theirs.kind,
                CallKind::FabricFailed | CallKind::Failed | CallKind::Departed
            ) =>
        {
            arxPeerFailed
        }
        Error::CallMismatch { .. } => arxMismatch,
        Error::Timeout { .. } => arxTimeout,
        Error::PeerFailed { .. } => arxPeerFailed,
        Error::Unavailable { .. } | Error::Topology(_) => arxUnavailable,
        Error::Mpi { .. }
        | Error::Os { .. }
        | Error::Verbs { .. }
        | Error::Cuda { .. }
        | Error::Kernel { .. }
        | Error::Proxy(_) => arxSystemError,
        // A variant added to arx after this mapping was written.
        _ => arxInternalError,
    }
}

/// Every code but `arxNumResults`, in order.
pub(crate) const ALL: [arxResult_t; 9] = [
    arxResult_t::arxSuccess,
    arxResult_t::arxInvalidArgument,
    arxResult_t::arxInvalidUsage,
    arxResult_t::arxMismatch,
    arxResult_t::arxTimeout,
    arxResult_t::arxPeerFailed,
    arxResult_t::arxUnavailable,
    arxResult_t::arxSystemError,
    arxResult_t::arxInternalError,
];

/// The static description of a code (`arxGetErrorString`).
pub(crate) fn describe(code: RawResult) -> &'static std::ffi::CStr {
    use arxResult_t::*;
    let known = ALL.into_iter().find(|c| *c as RawResult == code);
    match known {
        Some(arxSuccess) => c"no error",
        Some(arxInvalidArgument) => c"invalid argument",
        Some(arxInvalidUsage) => c"invalid usage",
        Some(arxMismatch) => c"ranks disagree (settings, or a call's count or datatype)",
        Some(arxTimeout) => c"timed out waiting for a peer",
        Some(arxPeerFailed) => c"a peer rank failed",
        Some(arxUnavailable) => c"something arx needs is not available",
        Some(arxSystemError) => c"system error (MPI, CUDA, verbs, OS)",
        Some(arxInternalError) => c"internal error",
        _ => c"unknown arxResult_t value",
    }
}

/// A C string of `s` (a NUL inside, which no message should hold, becomes
/// a space rather than cutting the message short).
pub(crate) fn c_string(s: &str) -> CString {
    CString::new(s.replace('\0', " ")).unwrap_or_default()
}

thread_local! {
    /// The calling thread's last failure message (`arxGetLastError(NULL)`).
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `message` as this thread's last failure.
pub(crate) fn set_thread_error(message: &str) {
    // `try_with`: a call from a thread's destructors after its
    // thread-locals are gone records nothing rather than panicking.
    let _ = LAST.try_with(|l| *l.borrow_mut() = c_string(message));
}

/// This thread's last failure message; valid until this thread's next
/// failing call.
pub(crate) fn thread_error() -> *const c_char {
    LAST.try_with(|l| l.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// Runs entry point `name`: its failure (or a panic, as
/// `arxInternalError`) is recorded as this thread's last error and
/// returned as a code.
pub(crate) fn guard(name: &str, f: impl FnOnce() -> Result<(), Failure>) -> RawResult {
    let r = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(Failure::panic(&*p)),
    };
    match r {
        Ok(()) => arxResult_t::arxSuccess as RawResult,
        Err(f) => {
            set_thread_error(&format!("{name}: {}", f.message));
            f.code as RawResult
        }
    }
}
