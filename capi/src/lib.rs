//! The C ABI of arx: the functions of `include/arx.h` (generated from this
//! crate by cbindgen, see `capi/cbindgen.toml`), built as `libarx.so` and
//! `libarx.a` by `scripts/install`. docs/C.md is the C user's manual: the
//! API, the mapping from arx's errors to `arxResult_t`, the threading
//! rules and the install.
//!
//! Every entry point runs inside `error::guard` (or `comm::with_comm`),
//! which catches panics (`arxInternalError`) so that none crosses into C;
//! the crate must therefore be built with `panic = "unwind"` (checked
//! below).

// C names: arxComm, arxCommInit(mpiComm, ...), as include/arx.h spells them.
#![allow(non_camel_case_types, non_snake_case)]
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

#[cfg(panic = "abort")]
compile_error!("arx-capi catches panics at the C boundary: build it with panic = \"unwind\"");

mod call;
mod comm;
mod config;
mod error;
pub mod types;

use std::ffi::{c_char, c_int, c_void};
use std::sync::Once;

use arx::{Builder, Error};

pub use comm::arxComm;
use error::{guard, Failure};
pub use types::*;

/// `ARX_LOG` (default `warn`) sets what arx logs to stderr; installed once,
/// at the first `arxCommInit`.
fn init_logging() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let env = env_logger::Env::new()
            .filter_or("ARX_LOG", "warn")
            .write_style("ARX_LOG_STYLE");
        // Fails only if the process already has a `log` logger (another
        // Rust library in it set one): then arx logs through that one.
        let _ = env_logger::Builder::from_env(env).try_init();
    });
}

/// Writes `value` through `out`, or refuses a NULL `out`.
///
/// # Safety
/// `out` is NULL or valid for a write of one `T`.
unsafe fn put<T>(out: *mut T, what: &str, value: T) -> Result<(), Failure> {
    if out.is_null() {
        return Err(Failure::invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-NULL and writable (the caller's contract).
    unsafe { out.write(value) };
    Ok(())
}

/// Stores `ARX_VERSION_CODE` of this library in `*version`.
///
/// # Safety
/// `version` is NULL (refused) or valid for a write of one `int`.
#[no_mangle]
pub unsafe extern "C" fn arxGetVersion(version: *mut c_int) -> RawResult {
    // SAFETY: the caller's contract.
    guard("arxGetVersion", || unsafe {
        put(version, "version", ARX_VERSION_CODE)
    })
}

/// A static, human-readable description of a result code (any value: an
/// unknown one gets "unknown arxResult_t value"). Never NULL.
#[no_mangle]
pub extern "C" fn arxGetErrorString(result: RawResult) -> *const c_char {
    error::describe(result).as_ptr()
}

/// The full message of the last failure: with a comm, of the last failed
/// call on that comm, valid until the next call on that comm (or its
/// `arxCommDestroy`); with NULL, of the last failed call of the calling
/// thread (any function, `arxCommInit` included), valid until that
/// thread's next call. An empty string when there was none. Never NULL.
///
/// # Safety
/// `comm` is NULL or a live comm.
#[no_mangle]
pub unsafe extern "C" fn arxGetLastError(comm: arxComm_t) -> *const c_char {
    if comm.is_null() {
        return error::thread_error();
    }
    // Nothing here can panic but a bug; the message then says so.
    let r = std::panic::catch_unwind(|| {
        // SAFETY: the caller's contract.
        unsafe { comm::last_error(comm) }
    });
    r.unwrap_or(c"arxGetLastError: internal error (panic)".as_ptr())
}

/// Creates a communicator over `mpiComm` (collective: every rank of
/// `mpiComm` calls it). `config` may be NULL: every setting then comes from
/// its `ARX_*` environment variable, else its default. On failure `*comm`
/// is NULL and every rank fails (a rank that refuses its settings makes
/// the others fail at once with `arxPeerFailed`); the message is
/// `arxGetLastError(NULL)`. arx duplicates `mpiComm` (once per MPI
/// communicator, cached on it) and never frees or uses it otherwise.
///
/// # Safety
/// `comm` is NULL (refused) or writable; `mpiComm` is `MPI_COMM_NULL`
/// (refused) or a live communicator; `config` is NULL or an `arxConfig_t`
/// made from `ARX_CONFIG_INITIALIZER`.
#[no_mangle]
pub unsafe extern "C" fn arxCommInit(
    comm: *mut arxComm_t,
    mpiComm: MPI_Comm,
    config: *const arxConfig_t,
) -> RawResult {
    guard("arxCommInit", || {
        init_logging();
        if !comm.is_null() {
            // SAFETY: writable (the caller's contract).
            unsafe { comm.write(std::ptr::null_mut()) };
        }
        mpi_usable()?;
        // SAFETY: the caller's contract.
        let builder = match unsafe { config::builder(config) } {
            Ok(b) => b,
            Err(e) => Builder::default().refuse(e),
        };
        let builder = if comm.is_null() {
            builder.refuse(Error::InvalidArgument("comm (arxComm_t*) is NULL".into()))
        } else {
            builder
        };
        // SAFETY: `mpiComm` is MPI_COMM_NULL or live (the caller's
        // contract); MPI is initialised and not finalized (checked).
        let arx = unsafe { builder.build_raw(mpiComm) }?;
        // SAFETY: non-NULL (else refused above) and writable.
        unsafe { comm.write(arxComm::create(arx)) };
        Ok(())
    })
}

/// MPI must be between `MPI_Init` and `MPI_Finalize` (Open MPI aborts the
/// process on a call outside; arx would refuse with a system error).
fn mpi_usable() -> Result<(), Failure> {
    let (mut init, mut fin): (c_int, c_int) = (0, 0);
    // SAFETY: both may be called at any time, even outside MPI_Init ..
    // MPI_Finalize; each writes one int.
    unsafe {
        mpi::ffi::MPI_Initialized(&mut init);
        mpi::ffi::MPI_Finalized(&mut fin);
    }
    if fin != 0 {
        Err(Failure::usage("MPI is already finalized"))
    } else if init == 0 {
        Err(Failure::usage(
            "MPI is not initialised (call MPI_Init first)",
        ))
    } else {
        Ok(())
    }
}

/// Frees a communicator: waits for its GPU work, stops its proxy thread,
/// tells its peers it leaves (a peer still calling then fails at once with
/// `arxPeerFailed` naming this rank) and (over RDMA) closes with its peers;
/// each step is bounded by the call timeout. Call it on every rank, before
/// `MPI_Finalize` (after it, arx frees its memory without any MPI call).
/// `comm` must not be used afterwards.
///
/// # Safety
/// `comm` is NULL (refused) or a live comm that no other thread uses
/// during or after the call.
#[no_mangle]
pub unsafe extern "C" fn arxCommDestroy(comm: arxComm_t) -> RawResult {
    // SAFETY: the caller's contract.
    unsafe { comm::destroy(comm) }
}

/// Stores the number of ranks of `comm` in `*count`.
///
/// # Safety
/// `comm` is NULL (refused) or live; `count` is NULL (refused) or writable.
#[no_mangle]
pub unsafe extern "C" fn arxCommCount(comm: arxComm_t, count: *mut c_int) -> RawResult {
    guard("arxCommCount", || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm::comm_ref(comm)? };
        // SAFETY: the caller's contract.
        unsafe { put(count, "count", c.count()) }
    })
}

/// Stores this rank's number in `comm` (its rank in the MPI communicator)
/// in `*rank`.
///
/// # Safety
/// `comm` is NULL (refused) or live; `rank` is NULL (refused) or writable.
#[no_mangle]
pub unsafe extern "C" fn arxCommUserRank(comm: arxComm_t, rank: *mut c_int) -> RawResult {
    guard("arxCommUserRank", || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm::comm_ref(comm)? };
        // SAFETY: the caller's contract.
        unsafe { put(rank, "rank", c.rank()) }
    })
}

/// Stores in `*asyncError` the first error of `comm` recorded so far (by
/// an earlier call, a GPU kernel that already failed, or the proxy
/// thread), or `arxSuccess`; it does not wait for the GPU. Once a comm has
/// failed it stays failed: every later call returns that error, whose
/// message is `arxGetLastError(comm)`. Returns `arxSuccess` when it could
/// look.
///
/// # Safety
/// `comm` is NULL (refused) or live; `asyncError` is NULL (refused) or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn arxCommGetAsyncError(
    comm: arxComm_t,
    asyncError: *mut RawResult,
) -> RawResult {
    let name = "arxCommGetAsyncError";
    // SAFETY: `comm` is NULL or live (the caller's contract).
    if let Some(f) = unsafe { comm::forked_and_held(comm) } {
        // The fork is the comm's error here, as in a child whose copy is
        // not held; `arxGetLastError(comm)` names it. (A successful call
        // leaves the thread's last error alone.)
        if asyncError.is_null() {
            return guard(name, || Err(Failure::invalid("asyncError is NULL")));
        }
        // SAFETY: non-NULL (checked) and writable (the caller's contract).
        unsafe { asyncError.write(f.code as RawResult) };
        return arxResult_t::arxSuccess as RawResult;
    }
    let mut found = arxResult_t::arxSuccess as RawResult;
    let f = |_: &arxComm, st: &mut comm::State| {
        if asyncError.is_null() {
            return Err(Failure::invalid("asyncError is NULL"));
        }
        // The comm's error is the answer, not a failure of this call.
        if let Err(e) = st.arx.async_error() {
            let f = Failure::from(e);
            st.record_found(name, &f);
            found = f.code as RawResult;
        }
        Ok(())
    };
    // SAFETY: `comm` is NULL or live (the caller's contract).
    let r = unsafe { comm::with_comm(name, comm, f) };
    if r == arxResult_t::arxSuccess as RawResult {
        // SAFETY: non-NULL (checked) and writable (the caller's contract).
        unsafe { asyncError.write(found) };
    }
    r
}

/// All-reduce of `count` elements of `datatype` from `sendbuff` into
/// `recvbuff` (device memory of the comm's CUDA device), enqueued on
/// `stream` (`NULL` is the legacy default stream); returns once enqueued,
/// and may be captured into a CUDA graph. `sendbuff == recvbuff` is in
/// place. Errors the kernel records come back from the next call or
/// `arxCommGetAsyncError`; a failed kernel writes NaN to `recvbuff`. Needs
/// a comm on the GPU side (`arxInvalidUsage` otherwise).
///
/// # Safety
/// Both buffers are device memory of the comm's device, valid for `count`
/// elements until the call completes on `stream`; `stream` is a live
/// stream of that device; `comm` is NULL (refused) or live.
#[no_mangle]
pub unsafe extern "C" fn arxAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    op: RawRedOp,
    comm: arxComm_t,
    stream: cudaStream_t,
) -> RawResult {
    let f = |c: &arxComm, st: &mut comm::State| {
        let d = call::dtype(datatype)?;
        let o = call::op(op)?;
        let b = call::Buffers::check(sendbuff, recvbuff, count, d, o)?;
        if !c.gpu() {
            return Err(Failure::usage(
                "this comm runs the host side (no usable GPU on some rank, or arxDeviceHost): \
                 use arxAllReduceHost, or set arxConfig_t.device = arxDeviceGpu",
            ));
        }
        // SAFETY: the buffers and the stream are the caller's contract.
        unsafe { call::device(&mut st.arx, &b, stream) }
    };
    // SAFETY: `comm` is NULL or live (the caller's contract).
    unsafe { comm::with_comm("arxAllReduce", comm, f) }
}

/// All-reduce of `count` elements of `datatype` from `sendbuff` into
/// `recvbuff`, both host memory; returns when the result is in
/// `recvbuff`. `sendbuff == recvbuff` is in place. Works on a comm of
/// either side (on the GPU side it synchronizes the GPU first).
///
/// # Safety
/// `sendbuff` is readable and `recvbuff` writable for `count` elements of
/// `datatype` (aligned to the element), and nothing else touches them
/// during the call; `comm` is NULL (refused) or live.
#[no_mangle]
pub unsafe extern "C" fn arxAllReduceHost(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    op: RawRedOp,
    comm: arxComm_t,
) -> RawResult {
    let f = |_: &arxComm, st: &mut comm::State| {
        let d = call::dtype(datatype)?;
        let o = call::op(op)?;
        let b = call::Buffers::check(sendbuff, recvbuff, count, d, o)?;
        // SAFETY: the buffers are the caller's contract.
        unsafe { call::host(&mut st.arx, &b) }
    };
    // SAFETY: `comm` is NULL or live (the caller's contract).
    unsafe { comm::with_comm("arxAllReduceHost", comm, f) }
}

/// The checks of a reduce-scatter or all-gather that are local, as
/// `arxAllReduce`'s (arguments wrong on their face: refused on this rank
/// only, nothing is sent and the comm stays usable).
fn blocks_face(
    st: &comm::State,
    coll: call::Coll,
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    n: usize,
    datatype: RawDataType,
    op: Option<RawRedOp>,
) -> Result<call::Blocks, Failure> {
    let d = call::dtype(datatype)?;
    let o = op.map_or(Ok(arx::Op::Sum), call::op)?;
    let (world, rank) = (st.arx.world(), st.arx.rank());
    call::Blocks::check(coll, sendbuff, recvbuff, n, d, o, world, rank)
}

/// The layout check, after the local ones: buffers that overlap without
/// being in place for this rank are refused through `Arx::refuse_call`,
/// so that every peer fails at once. The in-place position depends on the
/// rank (`recvbuff == sendbuff` is in place on rank 0 only), so a layout
/// wrong here may be right on a peer, which would otherwise wait for the
/// call timeout. The comm is then failed on every rank.
fn blocks_layout(st: &mut comm::State, b: &mut call::Blocks) -> Result<(), Failure> {
    b.layout()
        .map_err(|why| Failure::from(st.arx.refuse_call(b.n, Error::InvalidArgument(why))))
}

/// Refusal of a device call on a comm of the host side.
fn host_side(host_fn: &str) -> Failure {
    Failure::usage(format!(
        "this comm runs the host side (no usable GPU on some rank, or arxDeviceHost): \
         use {host_fn}, or set arxConfig_t.device = arxDeviceGpu"
    ))
}

/// Reduce-scatter (NCCL's `ncclReduceScatter`): `sendbuff` holds
/// `N × recvcount` elements (N ranks); block `r` of their reduction over
/// every rank (elements `r·recvcount ..`) lands in rank `r`'s `recvbuff`
/// of `recvcount` elements, bit for bit block `r` of `arxAllReduce` of the
/// same inputs. In place when `recvbuff == sendbuff + rank × recvcount`.
/// The buffers are device memory, the call enqueued on `stream` (as
/// `arxAllReduce`'s, graph-capturable); `arxReduceScatterHost` runs on
/// host memory.
///
/// # Safety
/// As `arxAllReduce`, for `N × recvcount` elements at `sendbuff` and
/// `recvcount` at `recvbuff`.
#[no_mangle]
pub unsafe extern "C" fn arxReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: RawDataType,
    op: RawRedOp,
    comm: arxComm_t,
    stream: cudaStream_t,
) -> RawResult {
    let f = |c: &arxComm, st: &mut comm::State| {
        let coll = call::Coll::ReduceScatter;
        let mut b = blocks_face(st, coll, sendbuff, recvbuff, recvcount, datatype, Some(op))?;
        if !c.gpu() {
            return Err(host_side("arxReduceScatterHost"));
        }
        blocks_layout(st, &mut b)?;
        // SAFETY: the buffers and the stream are the caller's contract;
        // sized and laid out as checked.
        unsafe { call::device_blocks(&mut st.arx, &b, stream) }
    };
    // SAFETY: `comm` is NULL or live (the caller's contract).
    unsafe { comm::with_comm("arxReduceScatter", comm, f) }
}

/// All-gather (NCCL's `ncclAllGather`): every rank's `sendbuff` of
/// `sendcount` elements, concatenated in rank order, lands in every rank's
/// `recvbuff` of `N × sendcount` elements. In place when `sendbuff ==
/// recvbuff + rank × sendcount`. Device memory on `stream`, as
/// `arxReduceScatter`; `arxAllGatherHost` runs on host memory.
///
/// # Safety
/// As `arxAllReduce`, for `sendcount` elements at `sendbuff` and `N ×
/// sendcount` at `recvbuff`.
#[no_mangle]
pub unsafe extern "C" fn arxAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: RawDataType,
    comm: arxComm_t,
    stream: cudaStream_t,
) -> RawResult {
    let f = |c: &arxComm, st: &mut comm::State| {
        let coll = call::Coll::AllGather;
        let mut b = blocks_face(st, coll, sendbuff, recvbuff, sendcount, datatype, None)?;
        if !c.gpu() {
            return Err(host_side("arxAllGatherHost"));
        }
        blocks_layout(st, &mut b)?;
        // SAFETY: as in arxReduceScatter.
        unsafe { call::device_blocks(&mut st.arx, &b, stream) }
    };
    // SAFETY: `comm` is NULL or live (the caller's contract).
    unsafe { comm::with_comm("arxAllGather", comm, f) }
}

/// `arxReduceScatter` on host memory; returns when `recvbuff` holds the
/// result. Works on a comm of either side (on the GPU side it synchronizes
/// the GPU first).
///
/// # Safety
/// `sendbuff` is readable for `N × recvcount` elements of `datatype`
/// (and writable, in place) and `recvbuff` writable for `recvcount`, both
/// aligned to the element, and nothing else touches them during the call;
/// `comm` is NULL (refused) or live.
#[no_mangle]
pub unsafe extern "C" fn arxReduceScatterHost(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: RawDataType,
    op: RawRedOp,
    comm: arxComm_t,
) -> RawResult {
    let f = |_: &arxComm, st: &mut comm::State| {
        let coll = call::Coll::ReduceScatter;
        let mut b = blocks_face(st, coll, sendbuff, recvbuff, recvcount, datatype, Some(op))?;
        b.aligned()?;
        blocks_layout(st, &mut b)?;
        // SAFETY: the buffers are the caller's contract; sized, aligned
        // and laid out as checked.
        unsafe { call::host_blocks(&mut st.arx, &b) }
    };
    // SAFETY: `comm` is NULL or live (the caller's contract).
    unsafe { comm::with_comm("arxReduceScatterHost", comm, f) }
}

/// `arxAllGather` on host memory; returns when `recvbuff` holds the
/// result. Works on a comm of either side (on the GPU side it synchronizes
/// the GPU first).
///
/// # Safety
/// `sendbuff` is readable for `sendcount` elements of `datatype` and
/// `recvbuff` writable for `N × sendcount`, both aligned to the element,
/// and nothing else touches them during the call; `comm` is NULL (refused)
/// or live.
#[no_mangle]
pub unsafe extern "C" fn arxAllGatherHost(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: RawDataType,
    comm: arxComm_t,
) -> RawResult {
    let f = |_: &arxComm, st: &mut comm::State| {
        let coll = call::Coll::AllGather;
        let mut b = blocks_face(st, coll, sendbuff, recvbuff, sendcount, datatype, None)?;
        b.aligned()?;
        blocks_layout(st, &mut b)?;
        // SAFETY: as in `arxReduceScatterHost`.
        unsafe { call::host_blocks(&mut st.arx, &b) }
    };
    // SAFETY: `comm` is NULL or live (the caller's contract).
    unsafe { comm::with_comm("arxAllGatherHost", comm, f) }
}

/// The local checks of a broadcast, as `arxAllReduce`'s (arguments wrong
/// on their face: refused on this rank only, nothing is sent and the comm
/// stays usable). A `sendbuff` of NULL is taken as `recvbuff` on ranks
/// other than the root, which never read it.
fn bcast_face(
    st: &comm::State,
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    root: c_int,
) -> Result<call::Buffers, Failure> {
    let d = call::dtype(datatype)?;
    // Off the root `sendbuff` is ignored, as documented: not even checked
    // (a refusal there, on this rank only, would leave the root waiting).
    let send = if usize::try_from(root).ok() != Some(st.arx.rank()) {
        recvbuff.cast_const()
    } else {
        sendbuff
    };
    call::Buffers::check(send, recvbuff, count, d, arx::Op::Sum)
}

/// The root as a rank index: a negative one is refused through
/// `Arx::refuse_call`, so that every peer fails at once (one at or above
/// the rank count is refused so by `broadcast_raw` / `broadcast_host`).
fn bcast_root(st: &mut comm::State, root: c_int, count: usize) -> Result<usize, Failure> {
    usize::try_from(root).map_err(|_| {
        let world = st.arx.world();
        let e = Error::InvalidArgument(format!(
            "broadcast: root {root} is not a rank of this {world}-rank comm"
        ));
        Failure::from(st.arx.refuse_call(count, e))
    })
}

/// Broadcast (NCCL's `ncclBroadcast`): the root's `sendbuff` of `count`
/// elements lands in every rank's `recvbuff`, bit for bit. `sendbuff` is
/// read on the root only (NULL is accepted elsewhere); `sendbuff ==
/// recvbuff` is in place. Every rank passes the same `count`, `datatype`
/// and `root`: a `root` that is no rank is refused with
/// `arxInvalidArgument` on this rank and its peers fail at once
/// (`arxMismatch` naming it), as do ranks that disagree on the count
/// or the root. Device memory on `stream`, as `arxAllReduce`
/// (graph-capturable); `arxBroadcastHost` runs on host memory.
///
/// # Safety
/// As `arxAllReduce`, for `count` elements at `recvbuff` and, on the
/// root, at `sendbuff`.
#[no_mangle]
pub unsafe extern "C" fn arxBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    root: c_int,
    comm: arxComm_t,
    stream: cudaStream_t,
) -> RawResult {
    let f = |c: &arxComm, st: &mut comm::State| {
        let b = bcast_face(st, sendbuff, recvbuff, count, datatype, root)?;
        if !c.gpu() {
            return Err(host_side("arxBroadcastHost"));
        }
        let root = bcast_root(st, root, count)?;
        // SAFETY: the buffers and the stream are the caller's contract;
        // sized as checked.
        unsafe { call::device_bcast(&mut st.arx, &b, root, stream) }
    };
    // SAFETY: `comm` is NULL or live (the caller's contract).
    unsafe { comm::with_comm("arxBroadcast", comm, f) }
}

/// `arxBroadcast` on host memory; returns when `recvbuff` holds the
/// result. Works on a comm of either side (on the GPU side it synchronizes
/// the GPU first).
///
/// # Safety
/// `recvbuff` is writable for `count` elements of `datatype` and, on the
/// root, `sendbuff` readable for as many (NULL or ignored elsewhere), both
/// aligned to the element, and nothing else touches them during the call;
/// `comm` is NULL (refused) or live.
#[no_mangle]
pub unsafe extern "C" fn arxBroadcastHost(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: RawDataType,
    root: c_int,
    comm: arxComm_t,
) -> RawResult {
    let f = |_: &arxComm, st: &mut comm::State| {
        let b = bcast_face(st, sendbuff, recvbuff, count, datatype, root)?;
        let root = bcast_root(st, root, count)?;
        // SAFETY: the buffers are the caller's contract; sized as checked.
        unsafe { call::host_bcast(&mut st.arx, &b, root) }
    };
    // SAFETY: `comm` is NULL or live (the caller's contract).
    unsafe { comm::with_comm("arxBroadcastHost", comm, f) }
}

#[cfg(test)]
mod tests;
