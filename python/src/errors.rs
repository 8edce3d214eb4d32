//! arx's errors as Python exceptions: one class per [`arx::Error`] variant,
//! defined in `arx/__init__.py` (so that they can also derive from Python's
//! own `TimeoutError`, `ValueError`, ...), each carrying arx's message and
//! what a program may branch on as attributes.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Errors of the binding itself, besides [`arx::Error`].
pub(crate) enum Usage {
    /// The `Comm` was closed.
    Closed,
    /// Another thread is inside a call of the same `Comm`.
    Busy,
    /// An earlier call panicked (a bug in arx).
    Broken,
    /// Not allowed on this thread (MPI's thread level).
    Thread(String),
    /// A call this build cannot make (the message says which).
    Unsupported(String),
}

/// The Python exception for `e`.
pub(crate) fn arx_err(py: Python<'_>, e: arx::Error) -> PyErr {
    let msg = e.to_string();
    let attrs = PyDict::new(py);
    let class = match &e {
        arx::Error::Mpi { call, .. } => {
            let _ = attrs.set_item("call", *call);
            "MpiError"
        }
        arx::Error::Mismatch { what, rank, .. } => {
            let _ = attrs.set_item("what", *what);
            let _ = attrs.set_item("rank", *rank);
            "MismatchError"
        }
        // A peer that announced its failure (a failed fabric, a call it
        // timed out in) or closed its comm after fewer calls made no call
        // to disagree with: it failed, as the C ABI's arxPeerFailed says.
        arx::Error::CallMismatch {
            seq, peer, theirs, ..
        } if matches!(
            theirs.kind,
            arx::CallKind::FabricFailed | arx::CallKind::Failed | arx::CallKind::Departed
        ) =>
        {
            let _ = attrs.set_item("seq", *seq);
            let _ = attrs.set_item("peer", *peer);
            "PeerFailedError"
        }
        arx::Error::CallMismatch { seq, peer, .. } => {
            let _ = attrs.set_item("seq", *seq);
            let _ = attrs.set_item("peer", *peer);
            "CallMismatchError"
        }
        arx::Error::Timeout { during, waited, .. } => {
            let _ = attrs.set_item("during", *during);
            let _ = attrs.set_item("waited", waited.as_secs_f64());
            "TimeoutError"
        }
        arx::Error::PeerFailed { peer, .. } => {
            let _ = attrs.set_item("peer", *peer);
            "PeerFailedError"
        }
        arx::Error::InvalidArgument(_) => "InvalidArgumentError",
        arx::Error::Config { name, .. } => {
            let _ = attrs.set_item("setting", *name);
            "ConfigError"
        }
        arx::Error::Unavailable { what, .. } => {
            let _ = attrs.set_item("what", *what);
            "UnavailableError"
        }
        arx::Error::Os { call, .. } => {
            let _ = attrs.set_item("call", *call);
            "OsError"
        }
        arx::Error::Verbs { call, .. } => {
            let _ = attrs.set_item("call", *call);
            "VerbsError"
        }
        arx::Error::Topology(_) => "TopologyError",
        arx::Error::Cuda { call, .. } => {
            let _ = attrs.set_item("call", *call);
            "CudaError"
        }
        arx::Error::Kernel { seq, .. } => {
            let _ = attrs.set_item("seq", *seq);
            "KernelError"
        }
        arx::Error::Proxy(_) => "ProxyError",
        // `arx::Error` is non-exhaustive: a variant this binding does not
        // know yet is still an `arx.Error` with arx's message.
        _ => "Error",
    };
    make(py, class, msg, &attrs)
}

/// The Python exception for a misuse of the binding.
pub(crate) fn usage_err(py: Python<'_>, u: Usage) -> PyErr {
    let attrs = PyDict::new(py);
    let (class, msg) = match u {
        Usage::Closed => ("ClosedError", "this arx.Comm is closed".to_string()),
        Usage::Busy => (
            "InvalidUsageError",
            "another thread is inside a call of this arx.Comm: calls of one Comm must not overlap"
                .to_string(),
        ),
        Usage::Broken => (
            "Error",
            "an earlier call of this arx.Comm panicked (a bug in arx; please report it): the \
             instance may be half-way through a change and is not used again; close this Comm"
                .to_string(),
        ),
        Usage::Thread(m) => ("InvalidUsageError", m),
        Usage::Unsupported(m) => ("UnsupportedError", m),
    };
    make(py, class, msg, &attrs)
}

/// An instance of `arx.<class>(msg)` with `attrs` and `kind` set; a
/// `RuntimeError` with the same message if the package is not importable
/// (the extension module loaded on its own).
fn make(py: Python<'_>, class: &str, msg: String, attrs: &Bound<'_, PyDict>) -> PyErr {
    let built = (|| -> PyResult<Bound<'_, PyAny>> {
        let cls = py.import("arx")?.getattr(class)?;
        let exc = cls.call1((msg.clone(),))?;
        exc.setattr("kind", class)?;
        for (k, v) in attrs.iter() {
            let k: String = k.extract()?;
            exc.setattr(k.as_str(), v)?;
        }
        Ok(exc)
    })();
    match built {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => PyRuntimeError::new_err(format!("arx.{class}: {msg}")),
    }
}
