/* arx: small all-reduce between GPUs and nodes over RDMA or shared memory.
 * The C ABI (docs/C.md). Generated from capi/src by cbindgen with
 * capi/cbindgen.toml: do not edit; run scripts/gen-header. */

#ifndef ARX_H
#define ARX_H

#include <stddef.h>
#include <mpi.h>
/* CUDA's stream handle, without CUDA's headers: the same type as
 * cuda_runtime.h's (a repeated identical typedef is valid C11 and C++). */
#ifndef __DRIVER_TYPES_H__
struct CUstream_st;
typedef struct CUstream_st *cudaStream_t;
#endif

/* ARX_VERSION_CODE of version X.Y.Z. */
#define ARX_VERSION(X, Y, Z) ((X) * 10000 + (Y) * 100 + (Z))
/* An arxConfig_t with every setting unset (environment, then default). */
#define ARX_CONFIG_INITIALIZER { \
    sizeof(arxConfig_t), ARX_CONFIG_MAGIC, ARX_VERSION_CODE, \
    ARX_CONFIG_UNDEF_INT, /* device */ \
    ARX_CONFIG_UNDEF_INT, /* fabric */ \
    ARX_CONFIG_UNDEF_INT, /* staging */ \
    ARX_CONFIG_UNDEF_INT, /* spin */ \
    ARX_CONFIG_UNDEF_INT, /* slotBytes */ \
    ARX_CONFIG_UNDEF_INT, /* timeoutMs */ \
    ARX_CONFIG_UNDEF_INT, /* initTimeoutMs */ \
    ARX_CONFIG_UNDEF_INT, /* stallWarnMs */ \
    ARX_CONFIG_UNDEF_INT, /* cudaDevice */ \
    ARX_CONFIG_UNDEF_INT, /* gidIndex */ \
    ARX_CONFIG_UNDEF_INT, /* proxyCpu */ \
    NULL /* rdmaDevices */ \
}


/**
 * Major version of arx (and of this header).
 */
#define ARX_MAJOR 0

/**
 * Minor version.
 */
#define ARX_MINOR 1

/**
 * Patch version.
 */
#define ARX_PATCH 0

/**
 * `ARX_MAJOR * 10000 + ARX_MINOR * 100 + ARX_PATCH`, as `arxGetVersion`
 * returns it and as `ARX_VERSION(X, Y, Z)` computes it.
 */
#define ARX_VERSION_CODE 100

/**
 * `arxConfig_t.magic`.
 */
#define ARX_CONFIG_MAGIC 1095915587

/**
 * An `int` field of `arxConfig_t` with this value is unset: its `ARX_*`
 * environment variable, then its default, applies. (`INT_MIN`.)
 */
#define ARX_CONFIG_UNDEF_INT (-2147483647 - 1)

/**
 * Result of every call that can fail.
 */
typedef enum arxResult_t {
  /**
   * The call did what it says.
   */
  arxSuccess = 0,
  /**
   * An argument or a setting is wrong (NULL pointer, unknown datatype or
   * operation, overlapping buffers, a count past the address space, a
   * value out of range, a malformed `arxConfig_t`).
   */
  arxInvalidArgument = 1,
  /**
   * The call is not allowed now: MPI is not initialised (or already
   * finalized), a device call on a comm that runs the host side, another
   * thread is inside a call on the same comm.
   */
  arxInvalidUsage = 2,
  /**
   * The ranks disagree: on a setting that must be the same everywhere
   * (at `arxCommInit`), or on a call's count or datatype.
   */
  arxMismatch = 3,
  /**
   * A bounded wait ran out (a peer did not arrive in time).
   */
  arxTimeout = 4,
  /**
   * Another rank failed; this rank stops too.
   */
  arxPeerFailed = 5,
  /**
   * Something arx needs is missing (no usable GPU, no RDMA device, no
   * libcuda or libnvrtc).
   */
  arxUnavailable = 6,
  /**
   * A call into the system failed (MPI, CUDA, verbs, shared memory,
   * threads), or the GPU kernel or the proxy thread failed.
   */
  arxSystemError = 7,
  /**
   * A bug in arx (a panic caught at the boundary, or an error this
   * version of the C ABI does not map yet).
   */
  arxInternalError = 8,
  /**
   * Number of result codes.
   */
  arxNumResults = 9,
} arxResult_t;

/**
 * Element type of a call.
 */
typedef enum arxDataType_t {
  /**
   * IEEE single precision (`float`).
   */
  arxFloat32 = 0,
  /**
   * IEEE half precision.
   */
  arxFloat16 = 1,
  /**
   * bfloat16.
   */
  arxBfloat16 = 2,
  /**
   * Number of element types.
   */
  arxNumTypes = 3,
} arxDataType_t;

/**
 * Reduction operation (the values of NCCL's `ncclRedOp_t`, so that a
 * ported call never silently changes op: 1, NCCL's product, is refused).
 * Every rank must pass the same op (ranks that differ all fail the call
 * with `arxMismatch`). Each op combines the ranks' values widened
 * exactly to fp32, in rank order, and rounds once to the element type;
 * the same bits on every rank, GPU and host side alike.
 */
typedef enum arxRedOp_t {
  /**
   * Sum: every element is `((p0 + p1) + p2) + ...` over the ranks'
   * partials in rank order, in fp32, rounded once to the element type.
   */
  arxSum = 0,
  /**
   * Maximum, IEEE 754-2019 `maximum`: any NaN gives the canonical quiet
   * NaN of the type (bf16 0x7fc0, f16 0x7e00, f32 0x7fc00000), and
   * -0.0 < +0.0. Exact.
   */
  arxMax = 2,
  /**
   * Minimum, IEEE 754-2019 `minimum` (NaN and zeros as `arxMax`). Exact.
   */
  arxMin = 3,
  /**
   * Average: the fp32 sum exactly as `arxSum` computes it, divided once
   * in fp32 by the number of ranks (correctly rounded), then rounded to
   * the element type: two roundings after the sum. A NaN is canonical.
   */
  arxAvg = 4,
  /**
   * One past the largest operation value.
   */
  arxNumOps = 5,
} arxRedOp_t;

/**
 * `arxConfig_t.device`: who writes partials and sums them (`ARX_DEVICE`).
 */
typedef enum arxDeviceSide_t {
  /**
   * The GPU side when every rank has a usable CUDA device, else the host side.
   */
  arxDeviceAuto = 0,
  /**
   * The CPU runs the protocol on host buffers (`arxAllReduceHost` only).
   */
  arxDeviceHost = 1,
  /**
   * The arx CUDA kernel (`arxAllReduce` on device buffers, and
   * `arxAllReduceHost`, which synchronizes the GPU first).
   */
  arxDeviceGpu = 2,
} arxDeviceSide_t;

/**
 * `arxConfig_t.fabric`: how bytes reach peers (`ARX_FABRIC`).
 */
typedef enum arxFabric_t {
  /**
   * Shared memory when every rank is on one node, else RDMA.
   */
  arxFabricAuto = 0,
  /**
   * POSIX shared memory between the ranks of one node.
   */
  arxFabricShm = 1,
  /**
   * RDMA writes over RoCE v2 (verbs).
   */
  arxFabricVerbs = 2,
} arxFabric_t;

/**
 * `arxConfig_t.staging`: how the GPU side fills its send slot (`ARX_STAGING`).
 */
typedef enum arxStaging_t {
  /**
   * Stores from the kernel, then a system-scope fence.
   */
  arxStagingSm = 0,
  /**
   * Copy-engine copies before the kernel.
   */
  arxStagingCopy = 1,
} arxStaging_t;

/**
 * `arxConfig_t.spin`: how CPU waits spin (`ARX_SPIN`).
 */
typedef enum arxSpin_t {
  /**
   * Poll hot for a while, then yield (fair to oversubscribed nodes).
   */
  arxSpinAdaptive = 0,
  /**
   * Never yield the core.
   */
  arxSpinHot = 1,
  /**
   * Nap between polls from the first idle round: 20 us plus the
   * thread's timer slack (10 us on arx's own threads, Linux's 50 us by
   * default on a caller's); for threads that share a CPU with one that
   * never yields (`ARX_SPIN=nap`).
   */
  arxSpinNap = 2,
} arxSpin_t;

/**
 * An arx communicator (opaque to C).
 */
typedef struct arxComm arxComm;

/**
 * Handle of an arx communicator (`struct arxComm` is opaque): made by
 * `arxCommInit`, freed by `arxCommDestroy`.
 */
typedef struct arxComm *arxComm_t;

/**
 * Settings of `arxCommInit`. Start from `ARX_CONFIG_INITIALIZER` (every
 * setting unset: the `ARX_*` environment variable, then the default), then
 * set the fields you want. A set field overrides its variable. Values are
 * checked as the variables are (same ranges). The settings marked "same
 * on every rank" must be (`arxMismatch` on every rank otherwise; `auto`
 * counts as a value of its own).
 */
typedef struct arxConfig_t {
  /**
   * `sizeof(arxConfig_t)` (set by `ARX_CONFIG_INITIALIZER`).
   */
  size_t size;
  /**
   * `ARX_CONFIG_MAGIC` (set by `ARX_CONFIG_INITIALIZER`).
   */
  unsigned int magic;
  /**
   * The `ARX_VERSION_CODE` the program was compiled with (set by
   * `ARX_CONFIG_INITIALIZER`).
   */
  unsigned int version;
  /**
   * An `arxDeviceSide_t` (`ARX_DEVICE`; default auto). Same on every rank.
   */
  int device;
  /**
   * An `arxFabric_t` (`ARX_FABRIC`; default auto). Same on every rank.
   */
  int fabric;
  /**
   * An `arxStaging_t` (`ARX_STAGING`; default sm). Same on every rank.
   */
  int staging;
  /**
   * An `arxSpin_t` (`ARX_SPIN`; default adaptive).
   */
  int spin;
  /**
   * Largest partial of one call in bytes, 1 to 268435455, rounded up to
   * a page (`ARX_SLOT_BYTES`; default 1 MiB). Same on every rank.
   */
  int slotBytes;
  /**
   * Bound on every wait of a call and of the close in `arxCommDestroy`,
   * in ms, 1 to 86400000 (`ARX_TIMEOUT_MS`; default 10 s).
   */
  int timeoutMs;
  /**
   * Bound on each collective step of `arxCommInit`, in ms, 1 to
   * 86400000 (`ARX_INIT_TIMEOUT_MS`; default 60 s).
   */
  int initTimeoutMs;
  /**
   * Stall after which arx logs every peer's progress, in ms, 1 to
   * 86400000 (`ARX_STALL_WARN_MS`; default 2 s, or half the timeout).
   */
  int stallWarnMs;
  /**
   * CUDA device ordinal of the GPU side (`ARX_CUDA_DEVICE`; default: the
   * rank's index on its node modulo the visible devices).
   */
  int cudaDevice;
  /**
   * RoCE GID index for every RDMA device (`ARX_GID_INDEX`; default:
   * found per device).
   */
  int gidIndex;
  /**
   * CPU for the proxy thread (`ARX_PROXY_CPU`; default: chosen from the
   * topology).
   */
  int proxyCpu;
  /**
   * RDMA devices of lane 0 and lane 1, `"dev0,dev1"`, or NULL for unset
   * (`ARX_DEVICES`; default: chosen from the topology). Read during
   * `arxCommInit` only.
   */
  const char *rdmaDevices;
} arxConfig_t;

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

/**
 * Stores `ARX_VERSION_CODE` of this library in `*version`.
 *
 * # Safety
 * `version` is NULL (refused) or valid for a write of one `int`.
 */
arxResult_t arxGetVersion(int *version);

/**
 * A static, human-readable description of a result code (any value: an
 * unknown one gets "unknown arxResult_t value"). Never NULL.
 */
const char *arxGetErrorString(arxResult_t result);

/**
 * The full message of the last failure: with a comm, of the last failed
 * call on that comm, valid until the next call on that comm (or its
 * `arxCommDestroy`); with NULL, of the last failed call of the calling
 * thread (any function, `arxCommInit` included), valid until that
 * thread's next call. An empty string when there was none. Never NULL.
 *
 * # Safety
 * `comm` is NULL or a live comm.
 */
const char *arxGetLastError(arxComm_t comm);

/**
 * Creates a communicator over `mpiComm` (collective: every rank of
 * `mpiComm` calls it). `config` may be NULL: every setting then comes from
 * its `ARX_*` environment variable, else its default. On failure `*comm`
 * is NULL and every rank fails (a rank that refuses its settings makes
 * the others fail at once with `arxPeerFailed`); the message is
 * `arxGetLastError(NULL)`. arx duplicates `mpiComm` (once per MPI
 * communicator, cached on it) and never frees or uses it otherwise.
 *
 * # Safety
 * `comm` is NULL (refused) or writable; `mpiComm` is `MPI_COMM_NULL`
 * (refused) or a live communicator; `config` is NULL or an `arxConfig_t`
 * made from `ARX_CONFIG_INITIALIZER`.
 */
arxResult_t arxCommInit(arxComm_t *comm, MPI_Comm mpiComm, const struct arxConfig_t *config);

/**
 * Frees a communicator: waits for its GPU work, stops its proxy thread,
 * tells its peers it leaves (a peer still calling then fails at once with
 * `arxPeerFailed` naming this rank) and (over RDMA) closes with its peers;
 * each step is bounded by the call timeout. Call it on every rank, before
 * `MPI_Finalize` (after it, arx frees its memory without any MPI call).
 * `comm` must not be used afterwards.
 *
 * # Safety
 * `comm` is NULL (refused) or a live comm that no other thread uses
 * during or after the call.
 */
arxResult_t arxCommDestroy(arxComm_t comm);

/**
 * Stores the number of ranks of `comm` in `*count`.
 *
 * # Safety
 * `comm` is NULL (refused) or live; `count` is NULL (refused) or writable.
 */
arxResult_t arxCommCount(arxComm_t comm, int *count);

/**
 * Stores this rank's number in `comm` (its rank in the MPI communicator)
 * in `*rank`.
 *
 * # Safety
 * `comm` is NULL (refused) or live; `rank` is NULL (refused) or writable.
 */
arxResult_t arxCommUserRank(arxComm_t comm, int *rank);

/**
 * Stores in `*asyncError` the first error of `comm` recorded so far (by
 * an earlier call, a GPU kernel that already failed, or the proxy
 * thread), or `arxSuccess`; it does not wait for the GPU. Once a comm has
 * failed it stays failed: every later call returns that error, whose
 * message is `arxGetLastError(comm)`. Returns `arxSuccess` when it could
 * look.
 *
 * # Safety
 * `comm` is NULL (refused) or live; `asyncError` is NULL (refused) or
 * writable.
 */
arxResult_t arxCommGetAsyncError(arxComm_t comm, arxResult_t *asyncError);

/**
 * All-reduce of `count` elements of `datatype` from `sendbuff` into
 * `recvbuff` (device memory of the comm's CUDA device), enqueued on
 * `stream` (`NULL` is the legacy default stream); returns once enqueued,
 * and may be captured into a CUDA graph. `sendbuff == recvbuff` is in
 * place. Errors the kernel records come back from the next call or
 * `arxCommGetAsyncError`; a failed kernel writes NaN to `recvbuff`. Needs
 * a comm on the GPU side (`arxInvalidUsage` otherwise).
 *
 * # Safety
 * Both buffers are device memory of the comm's device, valid for `count`
 * elements until the call completes on `stream`; `stream` is a live
 * stream of that device; `comm` is NULL (refused) or live.
 */
arxResult_t arxAllReduce(const void *sendbuff, void *recvbuff, size_t count, arxDataType_t datatype, arxRedOp_t op, arxComm_t comm, cudaStream_t stream);

/**
 * All-reduce of `count` elements of `datatype` from `sendbuff` into
 * `recvbuff`, both host memory; returns when the result is in
 * `recvbuff`. `sendbuff == recvbuff` is in place. Works on a comm of
 * either side (on the GPU side it synchronizes the GPU first).
 *
 * # Safety
 * `sendbuff` is readable and `recvbuff` writable for `count` elements of
 * `datatype` (aligned to the element), and nothing else touches them
 * during the call; `comm` is NULL (refused) or live.
 */
arxResult_t arxAllReduceHost(const void *sendbuff, void *recvbuff, size_t count, arxDataType_t datatype, arxRedOp_t op, arxComm_t comm);

/**
 * Reduce-scatter (NCCL's `ncclReduceScatter`): `sendbuff` holds
 * `N × recvcount` elements (N ranks); block `r` of their reduction over
 * every rank (elements `r·recvcount ..`) lands in rank `r`'s `recvbuff`
 * of `recvcount` elements, bit for bit block `r` of `arxAllReduce` of the
 * same inputs. In place when `recvbuff == sendbuff + rank × recvcount`.
 * The buffers are device memory, the call enqueued on `stream` (as
 * `arxAllReduce`'s, graph-capturable); `arxReduceScatterHost` runs on
 * host memory.
 *
 * # Safety
 * As `arxAllReduce`, for `N × recvcount` elements at `sendbuff` and
 * `recvcount` at `recvbuff`.
 */
arxResult_t arxReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, arxDataType_t datatype, arxRedOp_t op, arxComm_t comm, cudaStream_t stream);

/**
 * All-gather (NCCL's `ncclAllGather`): every rank's `sendbuff` of
 * `sendcount` elements, concatenated in rank order, lands in every rank's
 * `recvbuff` of `N × sendcount` elements. In place when `sendbuff ==
 * recvbuff + rank × sendcount`. Device memory on `stream`, as
 * `arxReduceScatter`; `arxAllGatherHost` runs on host memory.
 *
 * # Safety
 * As `arxAllReduce`, for `sendcount` elements at `sendbuff` and `N ×
 * sendcount` at `recvbuff`.
 */
arxResult_t arxAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, arxDataType_t datatype, arxComm_t comm, cudaStream_t stream);

/**
 * `arxReduceScatter` on host memory; returns when `recvbuff` holds the
 * result. Works on a comm of either side (on the GPU side it synchronizes
 * the GPU first).
 *
 * # Safety
 * `sendbuff` is readable for `N × recvcount` elements of `datatype`
 * (and writable, in place) and `recvbuff` writable for `recvcount`, both
 * aligned to the element, and nothing else touches them during the call;
 * `comm` is NULL (refused) or live.
 */
arxResult_t arxReduceScatterHost(const void *sendbuff, void *recvbuff, size_t recvcount, arxDataType_t datatype, arxRedOp_t op, arxComm_t comm);

/**
 * `arxAllGather` on host memory; returns when `recvbuff` holds the
 * result. Works on a comm of either side (on the GPU side it synchronizes
 * the GPU first).
 *
 * # Safety
 * `sendbuff` is readable for `sendcount` elements of `datatype` and
 * `recvbuff` writable for `N × sendcount`, both aligned to the element,
 * and nothing else touches them during the call; `comm` is NULL (refused)
 * or live.
 */
arxResult_t arxAllGatherHost(const void *sendbuff, void *recvbuff, size_t sendcount, arxDataType_t datatype, arxComm_t comm);

/**
 * Broadcast (NCCL's `ncclBroadcast`): the root's `sendbuff` of `count`
 * elements lands in every rank's `recvbuff`, bit for bit. `sendbuff` is
 * read on the root only (NULL is accepted elsewhere); `sendbuff ==
 * recvbuff` is in place. Every rank passes the same `count`, `datatype`
 * and `root`: a `root` that is no rank is refused with
 * `arxInvalidArgument` on this rank and its peers fail at once
 * (`arxMismatch` naming it), as do ranks that disagree on the count
 * or the root. Device memory on `stream`, as `arxAllReduce`
 * (graph-capturable); `arxBroadcastHost` runs on host memory.
 *
 * # Safety
 * As `arxAllReduce`, for `count` elements at `recvbuff` and, on the
 * root, at `sendbuff`.
 */
arxResult_t arxBroadcast(const void *sendbuff, void *recvbuff, size_t count, arxDataType_t datatype, int root, arxComm_t comm, cudaStream_t stream);

/**
 * `arxBroadcast` on host memory; returns when `recvbuff` holds the
 * result. Works on a comm of either side (on the GPU side it synchronizes
 * the GPU first).
 *
 * # Safety
 * `recvbuff` is writable for `count` elements of `datatype` and, on the
 * root, `sendbuff` readable for as many (NULL or ignored elsewhere), both
 * aligned to the element, and nothing else touches them during the call;
 * `comm` is NULL (refused) or live.
 */
arxResult_t arxBroadcastHost(const void *sendbuff, void *recvbuff, size_t count, arxDataType_t datatype, int root, arxComm_t comm);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* ARX_H */
