//! `arx._arx`: the compiled part of the `arx` Python package. Its one class,
//! `_Comm`, owns an [`arx::Arx`]; `arx/_comm.py` wraps it as `arx.Comm`,
//! telling NumPy arrays, torch tensors and CuPy arrays apart. Every call
//! releases the GIL while arx works; no Rust panic is expected on any path
//! (arx itself never panics), and every failure is an `arx.Error` subclass
//! (see `errors.rs`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::thread::ThreadId;

use arx::{Arx, Dtype, Error, ForkStamp};
use pyo3::prelude::*;
use pyo3::types::PyDict;

mod device;
mod errors;
mod host;
mod logger;
mod settings;

use errors::{arx_err, usage_err, Usage};

/// An instance handed between threads.
struct Instance(Arx);

// SAFETY: `Arx` is not `Send` only because it holds MPI communicator handles
// (its bootstrap channel), which are plain handles usable from any thread
// that MPI's thread level allows. Calls (`allreduce_*`, `describe`,
// `refuse_call`) make no MPI call; dropping makes MPI calls and is only done
// on the creating thread unless MPI provides MPI_THREAD_MULTIPLE (see
// `Comm::drop`). `Sync`: the instance is only reached through the
// `Comm`'s lock, which makes access exclusive.
unsafe impl Send for Instance {}
// SAFETY: see `Send` above; no `&Instance` is ever shared between threads.
unsafe impl Sync for Instance {}

/// One arx instance (`arx.Comm` wraps it).
#[pyclass(module = "arx._arx", name = "_Comm", frozen)]
struct Comm {
    /// The instance (None once closed). The lock is only ever tried: a
    /// second thread inside a call of the same Comm is refused rather than
    /// made to wait (collective calls must be made in one order on every
    /// rank).
    inst: Mutex<Option<Instance>>,
    /// The fork generation the instance was made under: a forked child's
    /// copy of `inst` stays locked for good when a parent thread was inside
    /// a call at the fork, and the child learns of the fork from here.
    stamp: ForkStamp,
    /// Closed in a forked child whose copy was locked that way (nothing
    /// freed).
    abandoned: AtomicBool,
    rank: usize,
    size: usize,
    owner: ThreadId,
    thread_multiple: bool,
    device: &'static str,
    cuda_device: Option<usize>,
}

/// The MPI library version string of the libmpi this module calls.
fn mpi_library_version() -> String {
    // SAFETY: reading an integer constant the MPI shim exports.
    let cap = unsafe { mpi::ffi::RSMPI_MAX_LIBRARY_VERSION_STRING }.max(1) as usize;
    let mut buf = vec![0u8; cap];
    let mut len: std::os::raw::c_int = 0;
    // SAFETY: `buf` holds MPI_MAX_LIBRARY_VERSION_STRING bytes, as the call
    // requires; MPI allows this call before MPI_Init and after
    // MPI_Finalize.
    let rc = unsafe { mpi::ffi::MPI_Get_library_version(buf.as_mut_ptr().cast(), &mut len) };
    if rc != 0 {
        return String::new();
    }
    buf.truncate((len.max(0) as usize).min(cap));
    String::from_utf8_lossy(&buf)
        .trim_end_matches(['\0', ' ', '\n'])
        .to_string()
}

fn mpi_unusable(call: &'static str, why: &str) -> Error {
    Error::Mpi {
        call,
        detail: why.into(),
    }
}

/// The C handle of an mpi4py communicator, from its Fortran handle
/// (`comm.py2f()`): portable across MPI libraries, whatever their `MPI_Comm`
/// is (a pointer in Open MPI, an int in MPICH).
fn comm_from_fortran(fhandle: i64) -> Result<mpi::ffi::MPI_Comm, Error> {
    // Outside MPI_Init .. MPI_Finalize Open MPI aborts the process on
    // MPI_Comm_f2c: check first.
    if !mpi::environment::is_initialized() {
        return Err(mpi_unusable(
            "MPI_Comm_f2c",
            "MPI is not initialized (import mpi4py.MPI before creating an arx.Comm)",
        ));
    }
    if mpi::environment::is_finalized() {
        return Err(mpi_unusable("MPI_Comm_f2c", "MPI is already finalized"));
    }
    let f = std::os::raw::c_int::try_from(fhandle).map_err(|_| {
        Error::InvalidArgument(format!(
            "communicator handle {fhandle} is not an MPI Fortran handle"
        ))
    })?;
    // SAFETY: MPI is initialized and not finalized (checked); MPI_Comm_f2c
    // returns MPI_COMM_NULL for a handle it does not know, which
    // `build_raw` refuses.
    Ok(unsafe { mpi::ffi::MPI_Comm_f2c(f) })
}

fn thread_multiple() -> bool {
    let mut provided: std::os::raw::c_int = 0;
    // SAFETY: called right after a successful `build_raw`, so MPI is
    // initialized and not finalized; `provided` is a valid out-pointer.
    let rc = unsafe { mpi::ffi::MPI_Query_thread(&mut provided) };
    // SAFETY: reading an integer constant the MPI shim exports.
    rc == 0 && provided == unsafe { mpi::ffi::RSMPI_THREAD_MULTIPLE }
}

/// The instance for a call, or why there is none.
fn instance(inst: &mut Option<Instance>) -> Result<&mut Arx, Usage> {
    inst.as_mut().map(|i| &mut i.0).ok_or(Usage::Closed)
}

impl Comm {
    /// Whether this thread may make MPI calls on the instance (its drop):
    /// the creating thread, or any thread under MPI_THREAD_MULTIPLE.
    fn may_call_mpi(&self) -> bool {
        self.thread_multiple || std::thread::current().id() == self.owner
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        let held = matches!(self.inst.try_lock(), Err(TryLockError::WouldBlock));
        let inst = match self.inst.get_mut() {
            Ok(i) => i.take(),
            Err(p) => p.into_inner().take(),
        };
        if held {
            // Only in a forked child: a parent thread was inside a call at
            // the fork (the call's own reference keeps a Comm alive in the
            // process it runs in). The instance may be half-way through
            // that call: nothing of it is touched.
            std::mem::forget(inst);
            return;
        }
        if let Some(inst) = inst {
            if self.may_call_mpi() {
                drop(inst);
            } else {
                // Dropping would make MPI calls on a thread MPI's thread level
                // does not allow: keep the instance (its proxy thread idles)
                // rather than break MPI.
                log::warn!(
                    "arx: an arx.Comm was garbage-collected on another thread than its own \
                     without MPI_THREAD_MULTIPLE; it is left open. Call close() on its thread."
                );
                std::mem::forget(inst);
            }
        }
    }
}

/// Takes the `Comm`'s instance for a call, or says why it cannot: closed
/// in a forked child (`abandoned`); another thread is inside a call; in a
/// forked child whose copy a thread held at the fork, the fork's error (as
/// every call in a child gets); or an earlier call panicked (a bug: the
/// instance may be half-way through a change, so it is not used again;
/// `closing` takes it all the same, to free it).
fn lock<'a>(
    py: Python<'_>,
    me: &'a Comm,
    closing: bool,
) -> PyResult<MutexGuard<'a, Option<Instance>>> {
    if me.abandoned.load(Ordering::Relaxed) {
        return Err(usage_err(py, Usage::Closed));
    }
    match me.inst.try_lock() {
        Ok(g) => Ok(g),
        Err(TryLockError::Poisoned(p)) if closing => Ok(p.into_inner()),
        Err(TryLockError::Poisoned(_)) => Err(usage_err(py, Usage::Broken)),
        Err(TryLockError::WouldBlock) => match me.stamp.check() {
            Err(e) => Err(arx_err(py, e)),
            Ok(()) => Err(usage_err(py, Usage::Busy)),
        },
    }
}

#[pymethods]
impl Comm {
    /// Collective: creates the instance on the communicator whose Fortran
    /// handle is `fhandle` (mpi4py's `comm.py2f()`). `mpi4py_library` is
    /// mpi4py's `MPI.Get_library_version()`: it must name the same MPI
    /// library as this module's.
    #[new]
    #[pyo3(signature = (fhandle, settings=None, mpi4py_library=None))]
    fn new(
        py: Python<'_>,
        fhandle: i64,
        settings: Option<&Bound<'_, PyDict>>,
        mpi4py_library: Option<String>,
    ) -> PyResult<Self> {
        logger::init();
        if let Some(theirs) = mpi4py_library {
            let ours = mpi_library_version();
            let theirs = theirs.trim_end_matches(['\0', ' ', '\n']);
            if ours != theirs {
                return Err(arx_err(
                    py,
                    Error::Unavailable {
                        what: "the MPI library of mpi4py",
                        reason: format!(
                            "mpi4py runs '{theirs}', arx was built against '{ours}': build \
                             arx against the MPI library that mpi4py uses (mpicc on PATH)"
                        ),
                    },
                ));
            }
        }
        let builder = settings::builder(settings);
        let comm = comm_from_fortran(fhandle).map_err(|e| arx_err(py, e))?;
        let raw = SendComm(comm);
        let built = py.detach(move || {
            let raw = raw;
            // SAFETY: `raw.0` is MPI_COMM_NULL or a live communicator of the
            // MPI library this process runs (mpi4py's, checked above), which
            // the caller's mpi4py object keeps alive during the call.
            unsafe { builder.build_raw(raw.0) }.map(Instance)
        });
        let inst = built.map_err(|e| arx_err(py, e))?;
        let d = inst.0.describe();
        let cuda_device = inst.0.cuda_context().map(|c| c.ordinal());
        let stamp = inst.0.fork_stamp();
        Ok(Comm {
            stamp,
            abandoned: AtomicBool::new(false),
            rank: d.rank,
            size: d.world,
            device: d.device,
            cuda_device,
            owner: std::thread::current().id(),
            thread_multiple: thread_multiple(),
            inst: Mutex::new(Some(inst)),
        })
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    #[getter]
    fn size(&self) -> usize {
        self.size
    }

    /// "gpu" or "host".
    #[getter]
    fn device(&self) -> &'static str {
        self.device
    }

    /// The CUDA device ordinal of a GPU instance, else None.
    #[getter]
    fn cuda_device(&self) -> Option<usize> {
        self.cuda_device
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        if self.abandoned.load(Ordering::Relaxed) {
            return true;
        }
        match self.inst.try_lock() {
            Ok(g) => g.is_none(),
            Err(TryLockError::Poisoned(p)) => p.into_inner().is_none(),
            // A call is running (or, in a forked child, ran at the fork).
            Err(TryLockError::WouldBlock) => false,
        }
    }

    /// What the instance is made of.
    fn describe<'py>(slf: &Bound<'py, Self>, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let me = slf.get();
        let cuda_device = me.cuda_device;
        let mut g = lock(py, me, false)?;
        let arx = instance(&mut g).map_err(|u| usage_err(py, u))?;
        let d = arx.describe();
        let c = arx.config();
        let out = PyDict::new(py);
        out.set_item("device", d.device)?;
        out.set_item("fabric", d.fabric)?;
        out.set_item("fabric_detail", d.fabric_detail)?;
        out.set_item("region_bytes", d.region_bytes)?;
        out.set_item("slot_bytes", d.slot_bytes)?;
        out.set_item("world", d.world)?;
        out.set_item("rank", d.rank)?;
        out.set_item("cuda_device", cuda_device)?;
        out.set_item("timeout", c.timeout.as_secs_f64())?;
        out.set_item("init_timeout", c.init_timeout.as_secs_f64())?;
        let max = PyDict::new(py);
        for t in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
            let n = match t {
                Dtype::F32 => arx.max_count::<f32>(),
                Dtype::F16 => arx.max_count::<half::f16>(),
                Dtype::Bf16 => arx.max_count::<half::bf16>(),
            };
            max.set_item(dtype_name(t), n)?;
        }
        out.set_item("max_count", max)?;
        Ok(out)
    }

    /// Collective (a barrier with the Verbs fabric): frees the instance.
    /// Closing a closed Comm does nothing. In a forked child it frees
    /// nothing the parent uses, and a copy that a parent thread was inside
    /// at the fork is only marked closed.
    fn close(slf: &Bound<'_, Self>, py: Python<'_>) -> PyResult<()> {
        let me = slf.get();
        if me.stamp.forked() && matches!(me.inst.try_lock(), Err(TryLockError::WouldBlock)) {
            // Held by a thread of the parent at the fork, or by one of the
            // child's threads in a call that fails with the fork's error:
            // either way marked closed, nothing freed.
            me.abandoned.store(true, Ordering::Relaxed);
            return Ok(());
        }
        let mut g = lock(py, me, true)?;
        if g.is_none() {
            return Ok(());
        }
        if !me.may_call_mpi() {
            return Err(usage_err(
                py,
                Usage::Thread(
                    "close() makes MPI calls: call it on the thread that created this \
                     arx.Comm, or initialize MPI with MPI_THREAD_MULTIPLE (mpi4py's default)"
                        .into(),
                ),
            ));
        }
        let inst = g.take();
        // Dropping waits for the GPU and, with Verbs, for the peers.
        py.detach(move || drop(inst));
        Ok(())
    }

    /// Host call on buffers (NumPy arrays): `input` into `out`, or in place
    /// when `out` is None or the same memory. `dtype="bfloat16"` reads
    /// 16-bit integer buffers as bfloat16 bits; `op` is "sum", "max", "min"
    /// or "avg" (`arx::Op`).
    #[pyo3(signature = (input, out=None, dtype=None, op="sum"))]
    fn allreduce_host(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        dtype: Option<&str>,
        op: &str,
    ) -> PyResult<()> {
        let check = |_: &Arx| {
            let op = op_named(op)?;
            let bf16 = bf16_keyword(dtype)?;
            let i = host::view(input, "input", out.is_none(), bf16)?;
            let o = out.map(|o| host::view(o, "out", true, bf16)).transpose()?;
            let call = host::pair(&i, o.as_ref())?;
            Ok(((i, o), (call, op)))
        };
        let shown = |_| host::count_hint(input);
        checked_call(slf, py, shown, check, |arx, (call, op)| {
            // SAFETY: `checked_call` holds the exports checked by `view` and
            // `pair` until after this call; the GIL is released, and the
            // docs tell callers not to touch the arrays during the call.
            unsafe { host::run(arx, &call, op) }
        })
    }

    /// Reduce-scatter on host buffers: `input` (`size × n` elements) into
    /// `out` (`n`), or in place when `out` is None (this rank's block of
    /// `input` receives the result) or `out` is that block. `dtype` and
    /// `op` as `allreduce_host`.
    #[pyo3(signature = (input, out=None, dtype=None, op="sum"))]
    fn reduce_scatter_host(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        dtype: Option<&str>,
        op: &str,
    ) -> PyResult<()> {
        blocks_host(slf, py, host::Coll::ReduceScatter, input, out, dtype, op)
    }

    /// All-gather on host buffers: `input` (`n` elements) of every rank into
    /// `out` (`size × n`) in rank order, or in place when `out` is None
    /// (`input` holds `size × n` elements, this rank's block is its input)
    /// or `input` is this rank's block of `out`.
    #[pyo3(signature = (input, out=None, dtype=None))]
    fn all_gather_host(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        dtype: Option<&str>,
    ) -> PyResult<()> {
        blocks_host(slf, py, host::Coll::AllGather, input, out, dtype, "sum")
    }

    /// Broadcast on host buffers from `root`: the root's `input` into
    /// every rank's `out` (same length), or in place when `out` is None or
    /// `input` itself. `dtype` as `allreduce_host`. A `root` that is no rank
    /// (negative too) is refused on every rank at once.
    #[pyo3(signature = (input, out=None, dtype=None, root=0))]
    fn broadcast_host(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        dtype: Option<&str>,
        root: i64,
    ) -> PyResult<()> {
        let check = |arx: &Arx| {
            let root = root_of(arx, root)?;
            let bf16 = bf16_keyword(dtype)?;
            let i = host::view(input, "input", out.is_none(), bf16)?;
            let o = out.map(|o| host::view(o, "out", true, bf16)).transpose()?;
            let call = host::pair(&i, o.as_ref())?;
            Ok(((i, o), (call, root)))
        };
        let shown = |_| host::count_hint(input);
        checked_call(slf, py, shown, check, |arx, (call, root)| {
            // SAFETY: `checked_call` holds the exports checked by `view` and
            // `pair` until after this call; the GIL is released, and the
            // docs tell callers not to touch the arrays during the call.
            unsafe { host::run_bcast(arx, &call, root) }
        })
    }

    /// GPU call on device addresses (torch tensors, CuPy arrays), enqueued
    /// on `stream`. Private: `arx.Comm.allreduce` passes addresses of live
    /// tensors it holds; `in_bytes`/`out_bytes` are their extents, for the
    /// overlap check.
    #[pyo3(signature = (input, out, count, out_count, dtype, out_dtype, stream, op="sum"))]
    #[allow(clippy::too_many_arguments)]
    fn allreduce_device(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        input: u64,
        out: u64,
        count: usize,
        out_count: usize,
        dtype: &str,
        out_dtype: &str,
        stream: u64,
        op: &str,
    ) -> PyResult<()> {
        let check = |arx: &Arx| {
            let op = op_named(op)?;
            let call = device::check(arx, input, out, count, out_count, dtype, out_dtype)?;
            Ok(((), (call, op)))
        };
        checked_call(
            slf,
            py,
            |_| count,
            check,
            |arx, (call, op)| {
                // SAFETY: `arx.Comm.allreduce` passes the data pointers, element
                // counts and current stream of live CUDA tensors/arrays it holds
                // (on this instance's device: checked by `device::check`); the
                // work is ordered on `stream` like any kernel of the framework.
                unsafe { device::run(arx, &call, stream, op) }
            },
        )
    }

    /// GPU reduce-scatter or all-gather on device addresses, enqueued on
    /// `stream`. Private: `arx.Comm.reduce_scatter` / `all_gather` pass the
    /// addresses, element counts and dtypes of live tensors they hold;
    /// `out` None is in place in `input`. `coll` is "reduce_scatter" or
    /// "all_gather" (whose `op` is ignored).
    #[pyo3(signature = (coll, input, count, dtype, out, out_count, out_dtype, stream, op="sum"))]
    #[allow(clippy::too_many_arguments)]
    fn blocks_device(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        coll: &str,
        input: u64,
        count: usize,
        dtype: &str,
        out: Option<u64>,
        out_count: usize,
        out_dtype: &str,
        stream: u64,
        op: &str,
    ) -> PyResult<()> {
        let coll = match coll {
            "reduce_scatter" => host::Coll::ReduceScatter,
            _ => host::Coll::AllGather,
        };
        // The count per rank, as arx's own refusals show it.
        let shown = |world: usize| match (coll, out) {
            (host::Coll::ReduceScatter, Some(_)) => out_count,
            (host::Coll::AllGather, Some(_)) => count,
            (_, None) => count / world.max(1),
        };
        let check = |arx: &Arx| {
            let op = op_named(op)?;
            let o = out.map(|o| (o, out_count, out_dtype));
            let call = device::check_blocks(arx, coll, (input, count, dtype), o)?;
            Ok(((), (call, op)))
        };
        checked_call(slf, py, shown, check, |arx, (call, op)| {
            // SAFETY: `arx.Comm` passes the data pointers, element counts
            // and current stream of live CUDA tensors/arrays it holds;
            // `device::check_blocks` checked their device, lengths and
            // overlap; the work is ordered on `stream` like any kernel of
            // the framework.
            unsafe { device::run_blocks(arx, &call, stream, op) }
        })
    }

    /// GPU broadcast from `root` on device addresses, enqueued on
    /// `stream`. Private: `arx.Comm.broadcast` passes the addresses,
    /// element counts and dtypes of live tensors it holds; `out` None is
    /// in place in `input`.
    #[pyo3(signature = (input, count, dtype, out, out_count, out_dtype, stream, root))]
    #[allow(clippy::too_many_arguments)]
    fn broadcast_device(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        input: u64,
        count: usize,
        dtype: &str,
        out: Option<u64>,
        out_count: usize,
        out_dtype: &str,
        stream: u64,
        root: i64,
    ) -> PyResult<()> {
        // The output's length, as `Arx::broadcast` shows it.
        let out_n = if out.is_some() { out_count } else { count };
        let check = |arx: &Arx| {
            let root = root_of(arx, root)?;
            let o = out.map(|o| (o, out_count, out_dtype));
            let call = device::check_bcast(arx, (input, count, dtype), o)?;
            Ok(((), (call, root)))
        };
        checked_call(
            slf,
            py,
            |_| out_n,
            check,
            |arx, (call, root)| {
                // SAFETY: `arx.Comm` passes the data pointers, element counts
                // and current stream of live CUDA tensors/arrays it holds;
                // `device::check_bcast` checked their device, lengths and
                // overlap; the work is ordered on `stream` like any kernel of
                // the framework.
                unsafe { device::run_bcast(arx, &call, stream, root) }
            },
        )
    }

    /// Refuses this rank's part of the next call with `message` (an
    /// argument error found in Python): peers fail at once naming this rank.
    /// Always raises: `arx.InvalidArgumentError`, or with `unsupported`
    /// `arx.UnsupportedError` (a call this build cannot make), or the
    /// instance's earlier error.
    #[pyo3(signature = (count, message, unsupported=false))]
    fn refuse(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        count: usize,
        message: String,
        unsupported: bool,
    ) -> PyResult<()> {
        let mut g = lock(py, slf.get(), false)?;
        let arx = instance(&mut g).map_err(|u| usage_err(py, u))?;
        let e = arx.refuse_call(count, Error::InvalidArgument(message.clone()));
        match e {
            Error::InvalidArgument(m) if unsupported && m == message => {
                Err(usage_err(py, Usage::Unsupported(m)))
            }
            e => Err(arx_err(py, e)),
        }
    }

    /// Waits for this instance's GPU work and raises the first error the
    /// instance recorded, if any.
    fn check(slf: &Bound<'_, Self>, py: Python<'_>) -> PyResult<()> {
        let mut g = lock(py, slf.get(), false)?;
        let arx = SendArx(instance(&mut g).map_err(|u| usage_err(py, u))?);
        py.detach(move || {
            let arx = arx;
            arx.0.check()
        })
        .map_err(|e| arx_err(py, e))
    }
}

/// `dtype=`: None, or "bfloat16" for 16-bit integer buffers of bfloat16
/// bits.
fn bf16_keyword(dtype: Option<&str>) -> arx::Result<bool> {
    match dtype {
        None => Ok(false),
        Some("bfloat16" | "bf16") => Ok(true),
        Some(other) => Err(Error::InvalidArgument(format!(
            "dtype='{other}': only dtype='bfloat16' (for uint16 buffers of \
             bfloat16 bits) may be given"
        ))),
    }
}

/// `reduce_scatter_host` / `all_gather_host`: the binding's checks (a
/// refusal is told to the peers), then the call with the GIL released.
fn blocks_host(
    slf: &Bound<'_, Comm>,
    py: Python<'_>,
    coll: host::Coll,
    input: &Bound<'_, PyAny>,
    out: Option<&Bound<'_, PyAny>>,
    dtype: Option<&str>,
    op: &str,
) -> PyResult<()> {
    // The count per rank, as arx's own refusals show it.
    let shown = |world: usize| match (coll, out) {
        (host::Coll::ReduceScatter, Some(o)) => host::count_hint(o),
        (host::Coll::AllGather, Some(_)) => host::count_hint(input),
        (_, None) => host::count_hint(input) / world.max(1),
    };
    let check = |arx: &Arx| {
        let op = op_named(op)?;
        let bf16 = bf16_keyword(dtype)?;
        let i = host::view(input, "input", out.is_none(), bf16)?;
        let o = out.map(|o| host::view(o, "out", true, bf16)).transpose()?;
        let call = host::pair_blocks(coll, arx.world(), arx.rank(), &i, o.as_ref())?;
        Ok(((i, o), (call, op)))
    };
    checked_call(slf, py, shown, check, |arx, (call, op)| {
        // SAFETY: `checked_call` holds the exports checked by `view` and
        // `pair_blocks` until after this call; the GIL is released, and the
        // docs tell callers not to touch the arrays during the call.
        unsafe { host::run_blocks(arx, &call, op) }
    })
}

/// The shape of every call: borrows the instance; `check` makes the
/// binding's checks and gives what must be held during the call (buffer
/// exports) and the call; a failed check is refused (`Arx::refuse_call`:
/// the peers fail at once naming this rank, shown `count(world size)`
/// elements); else `run` makes the call with the GIL released, and what
/// was held is dropped after it.
fn checked_call<H, C: Send>(
    slf: &Bound<'_, Comm>,
    py: Python<'_>,
    count: impl FnOnce(usize) -> usize,
    check: impl FnOnce(&Arx) -> arx::Result<(H, C)>,
    run: impl FnOnce(&mut Arx, C) -> arx::Result<()> + Send,
) -> PyResult<()> {
    let me = slf.get();
    let mut g = lock(py, me, false)?;
    let arx = instance(&mut g).map_err(|u| usage_err(py, u))?;
    // In a forked child, before `check` asks CUDA about the buffers.
    me.stamp.check().map_err(|e| arx_err(py, e))?;
    let (held, call) = match check(arx) {
        Ok(c) => c,
        Err(e) => {
            let n = count(arx.world());
            return Err(arx_err(py, arx.refuse_call(n, e)));
        }
    };
    let arx = SendArx(arx);
    let r = py.detach(move || {
        let arx = arx;
        run(arx.0, call)
    });
    drop(held);
    r.map_err(|e| arx_err(py, e))
}

/// A broadcast's `root` as a rank number (a negative one is no rank; one
/// past the world is refused by arx itself).
fn root_of(arx: &Arx, root: i64) -> arx::Result<usize> {
    usize::try_from(root).map_err(|_| {
        Error::InvalidArgument(format!(
            "broadcast: root {root} is not a rank of this {}-rank comm",
            arx.world()
        ))
    })
}

/// `&mut Arx` into a closure that runs with the GIL released (on the same
/// thread: `Python::detach` runs it in place).
struct SendArx<'a>(&'a mut Arx);
// SAFETY: the closure runs on the calling thread; see `Instance`.
unsafe impl Send for SendArx<'_> {}

/// An MPI_Comm handle into `Python::detach` (same thread).
struct SendComm(mpi::ffi::MPI_Comm);
// SAFETY: a plain handle, used on the calling thread only.
unsafe impl Send for SendComm {}

/// The op named `s` ("sum", "max", "min", "avg").
fn op_named(s: &str) -> arx::Result<arx::Op> {
    arx::Op::from_name(s).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "op={s:?}: arx reduces with op='sum', 'max', 'min' or 'avg'"
        ))
    })
}

pub(crate) fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "float32",
        Dtype::F16 => "float16",
        Dtype::Bf16 => "bfloat16",
    }
}

/// The compiled part of the `arx` package.
#[pymodule]
fn _arx(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Comm>()?;
    m.add("SETTINGS", settings::KEYWORDS.to_vec())?;
    m.add("MPI_LIBRARY", mpi_library_version())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(_log_level_of, m)?)?;
    Ok(())
}

/// The level a `RUST_LOG` value gives records of `target`
/// (`logger::level_of`), by name: for the tests only.
#[pyfunction]
#[pyo3(signature = (value, target="arx"))]
fn _log_level_of(value: &str, target: &str) -> String {
    logger::level_of(value, target).to_string()
}
