//! Everything `include/arx.h` declares besides the functions: the version,
//! the result codes, the element types and operations, the config struct
//! and its settings' values, and the handle types. cbindgen reads this file
//! (capi/cbindgen.toml); the text it cannot derive from Rust (the
//! `cudaStream_t` typedef, `ARX_CONFIG_INITIALIZER`, `ARX_VERSION()`) is
//! written in that file and checked by the tests below.
//!
//! Enumerations appear twice: as C enums for the header (`arxResult_t`,
//! `arxDataType_t`, ...) and as plain `int` aliases (`RawResult`, ...) that the
//! functions take in Rust and that cbindgen prints under the enum's name. A
//! C caller may pass any `int` (a C enum holds any value of its underlying
//! type); receiving it as a Rust enum would be undefined behaviour for a
//! value outside the enum, so every value is read as an `int` and checked.

#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint};

/// Major version of arx (and of this header).
pub const ARX_MAJOR: c_int = 0;
/// Minor version.
pub const ARX_MINOR: c_int = 1;
/// Patch version.
pub const ARX_PATCH: c_int = 0;
/// `ARX_MAJOR * 10000 + ARX_MINOR * 100 + ARX_PATCH`, as `arxGetVersion`
/// returns it and as `ARX_VERSION(X, Y, Z)` computes it.
pub const ARX_VERSION_CODE: c_int = 100;

/// Result of every call that can fail.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum arxResult_t {
    /// The call did what it says.
    arxSuccess = 0,
    /// An argument or a setting is wrong (NULL pointer, unknown datatype or
    /// operation, overlapping buffers, a count past the address space, a
    /// value out of range, a malformed `arxConfig_t`).
    arxInvalidArgument = 1,
    /// The call is not allowed now: MPI is not initialised (or already
    /// finalized), a device call on a comm that runs the host side, another
    /// thread is inside a call on the same comm.
    arxInvalidUsage = 2,
    /// The ranks disagree: on a setting that must be the same everywhere
    /// (at `arxCommInit`), or on a call's count or datatype.
    arxMismatch = 3,
    /// A bounded wait ran out (a peer did not arrive in time).
    arxTimeout = 4,
    /// Another rank failed; this rank stops too.
    arxPeerFailed = 5,
    /// Something arx needs is missing (no usable GPU, no RDMA device, no
    /// libcuda or libnvrtc).
    arxUnavailable = 6,
    /// A call into the system failed (MPI, CUDA, verbs, shared memory,
    /// threads), or the GPU kernel or the proxy thread failed.
    arxSystemError = 7,
    /// A bug in arx (a panic caught at the boundary, or an error this
    /// version of the C ABI does not map yet).
    arxInternalError = 8,
    /// Number of result codes.
    arxNumResults = 9,
}

/// Element type of a call.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum arxDataType_t {
    /// IEEE single precision (`float`).
    arxFloat32 = 0,
    /// IEEE half precision.
    arxFloat16 = 1,
    /// bfloat16.
    arxBfloat16 = 2,
    /// Number of element types.
    arxNumTypes = 3,
}

/// Reduction operation (the values of NCCL's `ncclRedOp_t`, so that a
/// ported call never silently changes op: 1, NCCL's product, is refused).
/// Every rank must pass the same op (ranks that differ all fail the call
/// with `arxMismatch`). Each op combines the ranks' values widened
/// exactly to fp32, in rank order, and rounds once to the element type;
/// the same bits on every rank, GPU and host side alike.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum arxRedOp_t {
    /// Sum: every element is `((p0 + p1) + p2) + ...` over the ranks'
    /// partials in rank order, in fp32, rounded once to the element type.
    arxSum = 0,
    /// Maximum, IEEE 754-2019 `maximum`: any NaN gives the canonical quiet
    /// NaN of the type (bf16 0x7fc0, f16 0x7e00, f32 0x7fc00000), and
    /// -0.0 < +0.0. Exact.
    arxMax = 2,
    /// Minimum, IEEE 754-2019 `minimum` (NaN and zeros as `arxMax`). Exact.
    arxMin = 3,
    /// Average: the fp32 sum exactly as `arxSum` computes it, divided once
    /// in fp32 by the number of ranks (correctly rounded), then rounded to
    /// the element type: two roundings after the sum. A NaN is canonical.
    arxAvg = 4,
    /// One past the largest operation value.
    arxNumOps = 5,
}

/// `arxConfig_t.device`: who writes partials and sums them (`ARX_DEVICE`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum arxDeviceSide_t {
    /// The GPU side when every rank has a usable CUDA device, else the host side.
    arxDeviceAuto = 0,
    /// The CPU runs the protocol on host buffers (`arxAllReduceHost` only).
    arxDeviceHost = 1,
    /// The arx CUDA kernel (`arxAllReduce` on device buffers, and
    /// `arxAllReduceHost`, which synchronizes the GPU first).
    arxDeviceGpu = 2,
}

/// `arxConfig_t.fabric`: how bytes reach peers (`ARX_FABRIC`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum arxFabric_t {
    /// Shared memory when every rank is on one node, else RDMA.
    arxFabricAuto = 0,
    /// POSIX shared memory between the ranks of one node.
    arxFabricShm = 1,
    /// RDMA writes over RoCE v2 (verbs).
    arxFabricVerbs = 2,
}

/// `arxConfig_t.staging`: how the GPU side fills its send slot (`ARX_STAGING`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum arxStaging_t {
    /// Stores from the kernel, then a system-scope fence.
    arxStagingSm = 0,
    /// Copy-engine copies before the kernel.
    arxStagingCopy = 1,
}

/// `arxConfig_t.spin`: how CPU waits spin (`ARX_SPIN`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum arxSpin_t {
    /// Poll hot for a while, then yield (fair to oversubscribed nodes).
    arxSpinAdaptive = 0,
    /// Never yield the core.
    arxSpinHot = 1,
    /// Nap between polls from the first idle round: 20 us plus the
    /// thread's timer slack (10 us on arx's own threads, Linux's 50 us by
    /// default on a caller's); for threads that share a CPU with one that
    /// never yields (`ARX_SPIN=nap`).
    arxSpinNap = 2,
}

/// `arxConfig_t.magic`.
pub const ARX_CONFIG_MAGIC: c_uint = 0x4152_5843;
/// An `int` field of `arxConfig_t` with this value is unset: its `ARX_*`
/// environment variable, then its default, applies. (`INT_MIN`.)
pub const ARX_CONFIG_UNDEF_INT: c_int = -2147483647 - 1;

/// Settings of `arxCommInit`. Start from `ARX_CONFIG_INITIALIZER` (every
/// setting unset: the `ARX_*` environment variable, then the default), then
/// set the fields you want. A set field overrides its variable. Values are
/// checked as the variables are (same ranges). The settings marked "same
/// on every rank" must be (`arxMismatch` on every rank otherwise; `auto`
/// counts as a value of its own).
#[repr(C)]
pub struct arxConfig_t {
    /// `sizeof(arxConfig_t)` (set by `ARX_CONFIG_INITIALIZER`).
    pub size: usize,
    /// `ARX_CONFIG_MAGIC` (set by `ARX_CONFIG_INITIALIZER`).
    pub magic: c_uint,
    /// The `ARX_VERSION_CODE` the program was compiled with (set by
    /// `ARX_CONFIG_INITIALIZER`).
    pub version: c_uint,
    /// An `arxDeviceSide_t` (`ARX_DEVICE`; default auto). Same on every rank.
    pub device: c_int,
    /// An `arxFabric_t` (`ARX_FABRIC`; default auto). Same on every rank.
    pub fabric: c_int,
    /// An `arxStaging_t` (`ARX_STAGING`; default sm). Same on every rank.
    pub staging: c_int,
    /// An `arxSpin_t` (`ARX_SPIN`; default adaptive).
    pub spin: c_int,
    /// Largest partial of one call in bytes, 1 to 268435455, rounded up to
    /// a page (`ARX_SLOT_BYTES`; default 1 MiB). Same on every rank.
    pub slotBytes: c_int,
    /// Bound on every wait of a call and of the close in `arxCommDestroy`,
    /// in ms, 1 to 86400000 (`ARX_TIMEOUT_MS`; default 10 s).
    pub timeoutMs: c_int,
    /// Bound on each collective step of `arxCommInit`, in ms, 1 to
    /// 86400000 (`ARX_INIT_TIMEOUT_MS`; default 60 s).
    pub initTimeoutMs: c_int,
    /// Stall after which arx logs every peer's progress, in ms, 1 to
    /// 86400000 (`ARX_STALL_WARN_MS`; default 2 s, or half the timeout).
    pub stallWarnMs: c_int,
    /// CUDA device ordinal of the GPU side (`ARX_CUDA_DEVICE`; default: the
    /// rank's index on its node modulo the visible devices).
    pub cudaDevice: c_int,
    /// RoCE GID index for every RDMA device (`ARX_GID_INDEX`; default:
    /// found per device).
    pub gidIndex: c_int,
    /// CPU for the proxy thread (`ARX_PROXY_CPU`; default: chosen from the
    /// topology).
    pub proxyCpu: c_int,
    /// RDMA devices of lane 0 and lane 1, `"dev0,dev1"`, or NULL for unset
    /// (`ARX_DEVICES`; default: chosen from the topology). Read during
    /// `arxCommInit` only.
    pub rdmaDevices: *const c_char,
}

/// Handle of an arx communicator (`struct arxComm` is opaque): made by
/// `arxCommInit`, freed by `arxCommDestroy`.
pub type arxComm_t = *mut crate::comm::arxComm;

/// The `int` that carries an `arxResult_t` (printed as `arxResult_t`).
pub type RawResult = c_int;
/// The `int` that carries an `arxDataType_t` (printed as `arxDataType_t`).
pub type RawDataType = c_int;
/// The `int` that carries an `arxRedOp_t` (printed as `arxRedOp_t`).
pub type RawRedOp = c_int;

/// CUDA's stream handle, declared in the header without CUDA's headers.
pub type cudaStream_t = *mut CUstream_st;
/// CUDA's opaque stream object.
pub enum CUstream_st {}
/// The MPI library's communicator handle (from `mpi.h`).
pub type MPI_Comm = mpi::ffi::MPI_Comm;
