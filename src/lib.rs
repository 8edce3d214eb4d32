//! # arx
//!
//! All-reduce of small GPU tensors (8 KB – 1 MB) between NVIDIA DGX Spark
//! (GB10) nodes over RoCE RDMA, without NCCL, launched by MPI.
//!
//! Each call is one-shot: every rank's partial goes to every peer as RDMA
//! writes split over both PCIe roots of the ConnectX-7, each half followed by
//! a flag on the same queue pair; every rank then sums all partials in rank
//! order with an fp32 accumulator, so every rank holds the same bits.
//!
//! ## Quick start
//!
//! ```no_run
//! use arx::Arx;
//! use half::bf16;
//! use mpi::traits::*;
//!
//! let universe = mpi::initialize().unwrap();
//! let world = universe.world();
//! let mut arx = Arx::new(&world)?;
//! let input = vec![bf16::from_f32(world.rank() as f32); 4096];
//! let mut output = vec![bf16::ZERO; 4096];
//! arx.allreduce_host(&input, &mut output)?;
//! # Ok::<(), arx::Error>(())
//! ```
//!
//! On GPU buffers (the GPU side is chosen when every rank has a usable CUDA
//! device; the call is enqueued on `stream` and can be captured into a CUDA
//! graph):
//!
//! ```no_run
//! use arx::Arx;
//! use half::bf16;
//! use mpi::traits::*;
//!
//! let universe = mpi::initialize().unwrap();
//! let world = universe.world();
//! let mut arx = Arx::new(&world)?;
//! let ctx = arx.cuda_context().expect("a GPU instance").clone();
//! let stream = ctx.default_stream();
//! let input = stream.memcpy_stod(&vec![bf16::from_f32(1.0); 4096]).unwrap();
//! let mut output = stream.alloc_zeros::<bf16>(4096).unwrap();
//! arx.allreduce(&input, &mut output, &stream)?;
//! arx.check()?; // synchronizes; returns any error the kernel recorded
//! # Ok::<(), arx::Error>(())
//! ```
//!
//! ## Device sides and fabrics
//!
//! | setting | choices (`ARX_*` variable) | default |
//! |---|---|---|
//! | device side ★ | `host`, `gpu`, `auto` (`ARX_DEVICE`) | auto: gpu when every rank has a usable CUDA device, else host |
//! | fabric ★ | `shm`, `verbs`, `auto` (`ARX_FABRIC`) | auto: shm when all ranks share a node, else verbs |
//! | slot size ★ | the partial of one one-shot call (longer calls run as chunks of half a slot): 1 byte to 256 MiB − 1, `K`/`M`/`G` suffixes (`ARX_SLOT_BYTES`); rounded up to a page | 1 MiB |
//! | GPU staging ★ | `sm`, `copy` (`ARX_STAGING`) | sm |
//! | call timeout | 1 ms to 24 h, in ms (`ARX_TIMEOUT_MS`): every wait of a call, [`Arx::barrier`], the collective close at drop | 10 s |
//! | start-up timeout | 1 ms to 24 h, in ms (`ARX_INIT_TIMEOUT_MS`): each collective step of start-up | 60 s |
//! | stall warning | 1 ms to 24 h, in ms (`ARX_STALL_WARN_MS`) | 2 s, or half the call timeout if less |
//! | spin | `adaptive`, `hot`, `nap` (`ARX_SPIN`); hot polls before yielding, 0 to 10⁷ (`ARX_SPIN_HOT`, no builder method) | adaptive (a GPU instance's proxy on its caller's only CPU naps); polls chosen from ranks per core |
//! | shm copy threads | threads beside each rank's proxy that copy posts of 64 KiB and more on the shm fabric, 0 to 15 (`ARX_SHM_COPY_THREADS`, no builder method) | half of the rank's cores less one, at most 3 (a rank's cores: the fewer of its binding's CPUs and the node's online CPUs divided by its ranks; a GPU instance bound to one CPU gets an unbound rank's count, pinned off the main threads' CPUs with its proxy: README, CPU binding on one node) |
//! | CUDA device | ordinal (`ARX_CUDA_DEVICE`) | node-local rank modulo visible devices |
//! | RDMA devices, GID index, proxy CPU | `ARX_DEVICES`, `ARX_GID_INDEX`, `ARX_PROXY_CPU` | chosen by topology (shm: pinned only for a GPU instance bound to one CPU) |
//! | GPU launch shape | most blocks, 1 to 1024 (`ARX_GPU_BLOCKS`); 16-byte vectors per thread per chunk, 1 to 64 (`ARX_GPU_UNROLL`); no builder methods | chosen by size and ranks per GPU |
//! | GPU kernel cache | an absolute directory for the compiled kernels, or `off` (`ARX_KERNEL_CACHE`, no builder method): NVRTC takes seconds per architecture, a cached CUBIN is loaded instead (keyed by a SHA-256 of the sources, options and the NVRTC library; used only if this user's, not writable by others, whole and of its key) | `$XDG_CACHE_HOME/arx/kernels`, else `$HOME/.cache/arx/kernels` |
//!
//! A [`Builder`] method sets an option instead of its variable (the
//! builder wins). Both are checked against the same ranges, in one place: a
//! value out of range is an [`Error::Config`] naming the builder method
//! (`Builder::timeout`) or the variable (`ARX_TIMEOUT_MS`). Each variable
//! that takes effect is logged once.
//!
//! ★ must be the same on every rank (the values as set, `auto` included;
//! the slot size once rounded up to whole pages of the largest page any
//! rank's kernel uses, so 4000 and 4096 bytes agree).
//! The ranks exchange these first, in one collective of fixed shape; a
//! difference fails every rank at once with an [`Error::Mismatch`] naming
//! the variable and the first rank that differs from rank 0. A setting
//! that one rank refuses (say `ARX_SLOT_BYTES=12Q`) fails that rank with
//! its [`Error::Config`] and every other rank at once with
//! [`Error::PeerFailed`] naming it. The other settings are per rank and may
//! differ.
//!
//! ## Guarantees
//!
//! * Never panics, aborts or exits; every failure is an [`Error`] that names
//!   the peer, lane, device, setting or call. This includes calls made
//!   before MPI is initialised or after it is finalized: [`Arx::new`],
//!   [`Builder::build`] and [`Arx::barrier`] then return [`Error::Mpi`]
//!   without calling MPI, and dropping an instance makes no MPI call.
//! * Every wait is bounded: each collective step of start-up by the start-up
//!   timeout, everything after start-up by the call timeout. A rank that
//!   stops calling makes the others return [`Error::Timeout`].
//! * Ranks that disagree (settings, or a call's length, dtype, [`Op`],
//!   algorithm or collective)
//!   all get an error; none computes a wrong sum. Whatever the settings, every rank
//!   runs the same sequence of start-up collectives.
//! * Memory is fixed at construction; no allocation on the call path.
//! * Every element of the result is `((p0 + p1) + p2) + …` over the ranks'
//!   partials in rank order, in fp32 arithmetic (IEEE, round to nearest
//!   even, no flush to zero, no fused multiply-add), rounded once to the
//!   element type, on every rank and both device sides: the sign of zero
//!   follows IEEE addition (−0.0 on every rank gives −0.0). A NaN result is
//!   a NaN on every rank of one instance, but its payload and sign are not
//!   specified (a GPU returns its canonical NaN, the CPU propagates a
//!   payload).
//! * Other reductions ([`Op`], through the `_op` entry points such as
//!   [`Arx::allreduce_op`] and [`Arx::allreduce_host_op`]; the entry points
//!   without `_op` sum) follow the same rule, identical bits on every rank,
//!   GPU and host side alike, any length and chunking:
//!   - max, min: IEEE 754-2019 `maximum` / `minimum` over the values
//!     widened exactly to fp32, in rank order: any NaN input gives NaN,
//!     always the canonical quiet NaN of the dtype (bf16 `0x7fc0`, f16
//!     `0x7e00`, f32 `0x7fc0_0000`), and −0.0 < +0.0 (max(−0, +0) = +0,
//!     min(−0, +0) = −0). The result is one of the inputs: exact.
//!   - avg: the fp32 sum exactly as sum computes it, then one fp32 division
//!     by the world size (correctly rounded), then one rounding to the
//!     dtype (round to nearest even): two roundings after the sum, which
//!     may differ from dividing in higher precision. A sum that overflows
//!     fp32 gives ±Inf (also where the average would fit); a NaN result is
//!     the canonical NaN.
//!
//!   Ranks that pass different ops all fail that call at once with
//!   [`Error::CallMismatch`] (the op is carried in every call's flag word),
//!   never mixing ops.
//! * Calls of one instance run one after another in the order they are
//!   made, whatever CUDA streams they are enqueued on and whether they are
//!   captured into graphs (see GPU buffers).
//! * Any length works (up to what the buffers hold). A call longer than one
//!   slot ([`Arx::max_count`] elements) runs as chunks of half a slot, the
//!   last one shorter, each an ordinary call with its own call number,
//!   pipelined (chunk j + 1 is sent while chunk j is summed; on the GPU
//!   side with SM staging):
//!   every guarantee above holds per chunk, and since each element is
//!   summed by exactly one chunk exactly as one call would sum it, the
//!   result is bit-identical to an unchunked call's, whatever the slot
//!   size. Every chunk but the last announces that more follow, so ranks
//!   that disagree on the total length fail at once with
//!   [`Error::CallMismatch`] at the first chunk where they differ (earlier
//!   chunks' results may already be in the output). A zero-length call is
//!   one call moving no data.
//! * The algorithm does not change the bits. An all-reduce runs one-shot
//!   (every partial to every peer, one round trip) or two-shot (a
//!   reduce-scatter step, then an all-gather step: each rank reduces one
//!   shard by the rule above and sends it to every peer), by [`Algo`]
//!   (`ARX_ALGO`, default [`Algo::Auto`]: [`Algo::choose`]); every element
//!   is still reduced once, in rank order, so the result is identical.
//!   [`Arx::reduce_scatter_host`] leaves on rank `r` bit for bit block `r`
//!   of the all-reduce of the same inputs; [`Arx::all_gather_host`] and
//!   [`Arx::broadcast_host`] copy bits. Ranks whose calls run different
//!   algorithms or collectives (the pattern travels in every flag word)
//!   all fail that call at once with [`Error::CallMismatch`].
//! * A broadcast ([`Arx::broadcast_host`], [`Arx::broadcast`]) is one call
//!   per chunk in which every rank announces the count and whether it is
//!   the root, and only the root's data travels. Ranks that disagree on
//!   the count fail at once (the root too); ranks that disagree on the
//!   root fail at once unless exactly one rank names itself: then the
//!   ranks that named another root fail at once, and the root and the
//!   ranks that named it get its data (their next call times out, the
//!   others having failed). A root that is no rank is refused with
//!   [`Error::InvalidArgument`], its peers failing at once.
//!
//! ### Start-up, timeouts and retrying
//!
//! * arx makes exactly one collective call on a communicator you pass: in
//!   the first [`Arx::new`] on it on each rank, an `MPI_Comm_idup` into
//!   arx's own channel, a communicator cached on yours (as an MPI
//!   attribute, which a duplicate of yours does not inherit: it gets its
//!   own channel) and never freed before `MPI_Finalize`. Every instance on
//!   your communicator is made from its channel. So your own
//!   collectives on the communicator stay in step whatever a start-up does,
//!   a timeout included. (Until every rank has entered [`Arx::new`] on it
//!   once, the others' `MPI_Comm_idup` is pending, and collectives you start
//!   meanwhile are ordered after it, as for any collective.)
//! * **While that `MPI_Comm_idup` is pending (a start-up that timed out
//!   waiting for a late rank), make no new communicator from yours**
//!   (`MPI_Comm_dup`, `_split`, `_create`, and mpi4py's lowercase
//!   collectives, which duplicate the communicator on first use): Open MPI
//!   4.1 was seen to hang in a blocking `MPI_Comm_dup` on the rank whose
//!   `idup` was pending, while the others returned. Collectives on buffers
//!   (`MPI_Allreduce`, mpi4py's `Allreduce`) are fine, and so is the retry
//!   below, which completes the request.
//! * A start-up that times out before every rank has sent its settings
//!   (a rank arrived late, or not yet) leaves its MPI request posted; the
//!   [`Error::Timeout`] says so, and the next [`Arx::new`] on the same
//!   communicator on that rank completes that request (bounded again)
//!   instead of starting another. Calling [`Arx::new`] again on every rank —
//!   at once, or after agreeing on the failure with a collective of your
//!   own — therefore retries, and the late rank's start-up meets the
//!   others'. Where the earlier start-up had already sent its settings,
//!   the retry must keep the settings marked ★ (it fails otherwise); the
//!   others may change.
//! * A start-up that times out after the settings were exchanged (a rank
//!   stopped during set-up) is abandoned; the [`Error::Timeout`] says so,
//!   and the next [`Arx::new`] starts a fresh one. Ranks that timed out at
//!   different steps may need one more attempt before they are back in
//!   step; every attempt is bounded.
//! * No bounded protocol can make every rank reach the same outcome: a
//!   rank that reaches the last step of start-up just as the others'
//!   timeout runs out returns `Ok` while they return a timeout, and its
//!   instance fails its first call with [`Error::Timeout`]. A program that
//!   retries after a start-up failure should agree on the outcome first
//!   (for example, an `MPI_Allreduce` of a success flag on its
//!   communicator: a buffer collective, see above; in mpi4py
//!   `comm.Allreduce` on a NumPy array, not the lowercase `comm.allreduce`),
//!   drop the instances that were created, and call [`Arx::new`] on every
//!   rank.
//! * Calls are bounded the same way, per rank: a rank that arrives after
//!   its peers' timeout ran out may still complete that call (the peers'
//!   partials were there) and return `Ok` with the right result, while the
//!   peers return [`Error::Timeout`]; its next call fails at once with
//!   [`Error::CallMismatch`] naming a peer whose call was
//!   [`CallKind::Failed`]: a rank whose call times out tells its peers
//!   (poisoned flags, from its proxy thread, while the instance lives).
//!   Treat any rank's timeout as the job's.
//! * A rank that drops its instance while its peers still call tells them
//!   (a departure word naming its last call): a peer's call that waits
//!   for that rank fails at once with [`Error::CallMismatch`] naming it,
//!   its call [`CallKind::Departed`], instead of at the timeout. A peer
//!   reached only through a relay (the diagonals of a 4-ring over Verbs)
//!   may not be told (the relay forwards the failed flag only once it
//!   waits for that call itself), and then times out.
//! * Dropping instances is collective with the RDMA fabric (a barrier
//!   bounded by the call timeout): drop them in the same order on every
//!   rank, as `MPI_Comm_free`. Another order still frees everything but
//!   waits up to one timeout per instance, logging that it closed without
//!   every peer.
//!
//! ## GPU buffers
//!
//! With the GPU device side, [`Arx::allreduce`] takes cudarc device slices
//! and a stream, enqueues one kernel per chunk of half a slot (one kernel for a
//! call of one slot or less; plus two copies per chunk with
//! [`Staging::CopyEngine`]) and returns: it never waits for the GPU and does
//! no host work that a CUDA graph would have to repeat, so it can be
//! captured (`CudaStream::begin_capture`) and replayed; the call counter
//! lives in device memory. The chunks of a call follow each other on the
//! stream with no host round trip, alternating between the two sets of
//! slots: with SM staging a chunk is staged and sent while this rank's
//! proxy may still be sending the previous one and slower peers are still
//! summing it. Errors the kernel records (a peer's timeout, an
//! abort, a call mismatch) are returned by the next call, or at once by
//! [`Arx::check`], which synchronizes. A failed kernel writes NaN to its
//! output, so a replayed graph cannot pass a stale result off as new.
//! [`Arx::allreduce_host`] works on a GPU instance too (it synchronizes the
//! GPU first), so `DeviceKind::Auto` choosing the GPU side never breaks a
//! program that uses host slices. Use [`Arx::allreduce_raw`] for device
//! pointers from other frameworks.
//!
//! Calls of one instance are ordered as the host makes them, whatever
//! streams they are enqueued on: each launch waits for an event recorded
//! after the previous one (under capture: an event wait node before a
//! capture's first call, resolved at each replay, an edge between two calls
//! captured into the same graph, and a record node beside each call, off
//! the path of what follows it), so two calls never run at once — not on
//! two streams with no dependency, not on parallel branches of one graph,
//! not a replay next to an eager call (`src/device/order.rs`). As for MPI
//! collectives, every rank must make (and replay) its calls in the same
//! order.
//!
//! A graph may be replayed after its instance was dropped: the instance
//! then keeps the memory such a replay touches (its mapped region, device
//! state and kernels: about the region's size, logged at drop) and marks it
//! closed, so the replay moves no data and writes NaN to its output.
//!
//! Copy-engine staging writes both send slots before each kernel; every
//! call (every chunk) of such an instance (also a failed one, also a host
//! call on a GPU instance) ends only once this rank's own sends of it are
//! complete, so that no peer can receive the next call's data under this
//! call's flag; so its chunks do not overlap each other's sends.
//!
//! Cudarc's per-slice event tracking records events on the slices' streams;
//! inside stream capture, either use one stream for everything or disable
//! it (`CudaContext::disable_event_tracking`).
//!
//! ## Thread safety
//!
//! Calls take `&mut self` and must be made in the same order on every rank,
//! like MPI collectives. An [`Arx`] holds an MPI communicator and is
//! therefore not `Send`: keep it on the thread that uses MPI. Calls make no
//! MPI calls (only construction, [`Arx::barrier`] and drop do; drop makes a
//! collective close, a barrier bounded by the call timeout, with the Verbs
//! fabric only).

#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

/// Rust view of `kernels/arx_abi.h`, generated by bindgen.
#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    missing_docs,
    dead_code,
    clippy::all
)]
pub mod abi {
    include!(concat!(env!("OUT_DIR"), "/abi.rs"));
}

mod algo;
mod bootstrap;
mod builder;
mod codec;
mod collectives;
mod config;
mod device;
mod dtype;
mod error;
mod establish;
mod fabric;
mod fork;
mod gpu_collectives;
mod layout;
mod op;
pub mod probe;
mod protocol;
mod proxy;
mod spin;
pub mod stages;
mod sync;
pub mod topology;
pub mod verify;
mod wire;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use mpi::topology::Communicator;

/// The cudarc version arx's GPU API takes (re-exported so callers use the same).
pub use cudarc;

pub use builder::Builder;
pub use config::{
    host_twoshot_from_bytes, parse_bytes, Algo, Config, DeviceKind, FabricKind, SpinMode, Staging,
    DEFAULT_INIT_TIMEOUT, DEFAULT_SLOT_BYTES, DEFAULT_TIMEOUT, GPU_TWOSHOT_FROM_BYTES,
    MAX_GPU_BLOCKS, MAX_GPU_UNROLL, MAX_SPIN_HOT, MAX_TIMEOUT, MIN_TIMEOUT,
};
pub use device::platform::{GpuAttrs, GpuPlatform, RegionAlloc};
pub use dtype::{CallDesc, CallKind, Dtype, Element, Pattern};
pub use error::{Error, Result};
#[doc(hidden)]
pub use fork::ForkStamp;
pub use layout::Layout;
pub use op::Op;
pub use probe::{Bandwidth, Latency, ProbeOptions, RailProbe};
pub use stages::Stages;
pub use wire::PeerInfo;

use bootstrap::Bootstrap;
use device::Device;
use proxy::Proxy;

/// Number of usable CUDA devices, or why the GPU device side cannot run
/// here (no libcuda, no libnvrtc, no device). Never panics.
pub fn gpu_available() -> Result<usize> {
    device::gpu::device_count()
}

/// What CUDA device `ordinal` reports (integrated or not, and how it
/// reaches host memory) and what the GPU device side chooses for it (see
/// [`GpuPlatform`]); the same as an instance logs at start-up.
pub fn gpu_platform(ordinal: usize) -> Result<GpuPlatform> {
    let n = device::gpu::device_count()?;
    if ordinal >= n {
        return Err(Error::Unavailable {
            what: "the requested CUDA device",
            reason: format!("device {ordinal} asked for, {n} visible"),
        });
    }
    GpuPlatform::read(ordinal)
}

/// One all-reduce instance over a communicator.
pub struct Arx {
    // Field order is drop order (after `Drop::drop`, which synchronizes the
    // GPU and stops the proxy): the device side, then the proxy and its
    // fabric, then the bootstrap channel.
    device: Device,
    proxy: Proxy,
    layout: Layout,
    fabric_desc: String,
    fabric_name: &'static str,
    boot: Bootstrap,
}

/// What an instance is made of, for headers and logs.
#[derive(Debug, Clone)]
pub struct Description {
    /// "host" or "gpu".
    pub device: &'static str,
    /// "shm" or "verbs".
    pub fabric: &'static str,
    /// Fabric details (devices, GIDs, segment).
    pub fabric_detail: String,
    /// Bytes of mapped (pinned or shared) memory this rank holds.
    pub region_bytes: usize,
    /// Slot size in bytes.
    pub slot_bytes: usize,
    /// Ranks.
    pub world: usize,
    /// This rank.
    pub rank: usize,
}

impl Arx {
    /// Creates an instance with settings from the environment and defaults.
    /// Collective over `comm`; arx's only collective on `comm` itself is
    /// the `MPI_Comm_idup` of the first instance on it (see the crate docs,
    /// Guarantees).
    pub fn new<C: Communicator>(comm: &C) -> Result<Self> {
        Builder::default().build(comm)
    }

    /// A builder for explicit settings.
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.layout.rank()
    }
    /// Ranks in the communicator.
    pub fn world(&self) -> usize {
        self.layout.world()
    }
    /// The resolved settings.
    pub fn config(&self) -> &Config {
        self.device.config()
    }
    /// Elements of `T` in one slot: the largest call that runs unchunked.
    /// Longer all-reduces run as chunks of half this many elements
    /// (reduce_scatter and all_gather: of this many, over all blocks; see
    /// Guarantees).
    pub fn max_count<T: Element>(&self) -> usize {
        self.device.max_count(T::DTYPE)
    }
    /// What this instance is made of.
    pub fn describe(&self) -> Description {
        Description {
            device: self.device.kind(),
            fabric: self.fabric_name,
            fabric_detail: self.fabric_desc.clone(),
            region_bytes: self.layout.region_bytes(),
            slot_bytes: self.layout.slot_bytes(),
            world: self.world(),
            rank: self.rank(),
        }
    }
    /// Fault injection for tests and drills: breaks this rank's endpoint to
    /// `peer` on `lane` (Verbs: the QP goes to the error state), so that the
    /// next call exercises the failure path. Not for production use.
    #[doc(hidden)]
    pub fn inject_fault(&mut self, peer: usize, lane: usize) -> Result<()> {
        self.device.fork_guard()?;
        self.proxy.inject_fault(peer, lane)
    }

    /// Measures every rail and lane to every directly linked peer over the
    /// queue pair the all-reduce uses there: one-way write latency per
    /// size (half the median and p99 round trip of a ping-pong, as
    /// `ib_write_lat`) and the bandwidth of back-to-back writes (as
    /// `ib_write_bw`); peers reached through a relay are listed as such,
    /// unmeasured. See [`probe`] for the schedule.
    ///
    /// Collective: every rank calls it, between the same two calls, with
    /// the same options (a difference fails naming the peer). Only while no
    /// call is in flight: on a GPU instance it synchronizes first (as
    /// [`Arx::check`]), but a graph replayed on a stream of your own must
    /// have finished on every rank. The data lands in the peers' receive
    /// slots, which every call writes before reading. Each wait is bounded
    /// by the call timeout; a failure (a timeout, a verbs error naming peer,
    /// rail, lane and device) fails the instance as a failed call does.
    /// The Shm fabric has no rails: [`Error::Unavailable`].
    pub fn probe_rails(&mut self, opts: &ProbeOptions) -> Result<Vec<RailProbe>> {
        self.device.check()?;
        self.proxy.probe_rails(opts)
    }

    /// Turns the stage trace on or off for the calls that follow: the
    /// device side and the proxy take the time at each stage of a call
    /// (see [`stages`] for the stages, and what a GPU instance records).
    /// Per rank, not collective; off by default, and then it costs one
    /// predictable branch per stage.
    pub fn trace_stages(&mut self, on: bool) {
        self.proxy.set_trace(on);
    }

    /// The stages of the last one-shot all-reduce traced on this rank (see
    /// [`Arx::trace_stages`]): the last chunk of a call longer than one
    /// slot. Stages that were not recorded are `None`. Two-shot calls,
    /// `reduce_scatter`, `all_gather` and `broadcast` are not traced (build with
    /// `Algo::OneShot` to trace every all-reduce, as `allreduce_perf
    /// --stages` does). On a GPU instance,
    /// synchronize first ([`Arx::check`]) to read a finished call.
    ///
    /// In a forked child: nothing traced (the trace's lock may have been
    /// held by the parent's proxy thread at the fork).
    pub fn last_stages(&self) -> Stages {
        if self.device.forked() {
            return Stages::default();
        }
        self.proxy.stages()
    }

    /// A barrier over the instance's private communicator, bounded by the
    /// call timeout (a rank that never arrives is an [`Error::Timeout`]).
    /// After `MPI_Finalize` it returns [`Error::Mpi`] without calling MPI.
    /// In a forked child: the fork's error, without calling MPI.
    pub fn barrier(&self) -> Result<()> {
        self.device.fork_guard()?;
        self.boot.barrier("user barrier")
    }

    /// Waits for every call enqueued on the GPU and returns the first error
    /// of this instance (kernel, proxy or earlier call), if any. On the host
    /// device side it only returns the recorded error.
    pub fn check(&mut self) -> Result<()> {
        self.device.check()
    }

    /// The instance's fork stamp, for bindings: its `check()` is the error
    /// every call of this instance returns in a forked child (for a binding
    /// that asks CUDA about buffers before calling arx, so that a child gets
    /// the fork's error rather than CUDA's), and a binding that keeps the
    /// instance behind a lock can read it while a forked child's copy of
    /// that lock stays held for good (a parent thread was inside a call).
    #[doc(hidden)]
    pub fn fork_stamp(&self) -> ForkStamp {
        self.device.fork_stamp()
    }

    /// [`Arx::check`] without waiting for the GPU: the first error of this
    /// instance recorded so far (by an earlier call, a kernel that already
    /// failed, or the proxy), or `Ok` while there is none. Calls still
    /// queued on the GPU may fail later.
    pub fn async_error(&mut self) -> Result<()> {
        self.device.ready()
    }

    /// The CUDA context of the GPU device side (None on the host side).
    pub fn cuda_context(&self) -> Option<&Arc<CudaContext>> {
        self.device.cuda_context()
    }

    /// Sums `input` over all ranks into `output` (GPU memory), enqueued on
    /// `stream`. Every rank gets the same bits. Returns once the work is
    /// enqueued; errors the kernel records come back from the next call or
    /// from [`Arx::check`]. Capturable into a CUDA graph. Calls of one
    /// instance run in the order they are made, whatever streams they use.
    pub fn allreduce<T: Element + DeviceRepr>(
        &mut self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        self.allreduce_op(input, output, Op::Sum, stream)
    }

    /// [`Arx::allreduce`] with the reduction `op` (see [`Op`] for its exact
    /// rule). Every rank must pass the same op: ranks that differ all fail
    /// that call with [`Error::CallMismatch`].
    pub fn allreduce_op<T: Element + DeviceRepr>(
        &mut self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        op: Op,
        stream: &CudaStream,
    ) -> Result<()> {
        self.device.same_context(stream)?;
        if input.len() != output.len() {
            let e = Error::InvalidArgument(format!(
                "input has {} elements, output {}",
                input.len(),
                output.len()
            ));
            return self.device.refuse_gpu(output.len(), e, stream.cu_stream());
        }
        let n = output.len();
        let (i, _ri) = input.device_ptr(stream);
        let (o, _ro) = output.device_ptr_mut(stream);
        // SAFETY: both slices are live device allocations of `n` elements of
        // T in this context (checked), borrowed until the launch is enqueued;
        // cudarc's events order later uses of them after the kernel.
        unsafe {
            self.device
                .gpu_call(i, o, n, T::DTYPE, op, stream.cu_stream())
        }
    }

    /// In-place variant of [`Arx::allreduce`]: `buf` holds this rank's
    /// partial and receives the sum.
    pub fn allreduce_in_place<T: Element + DeviceRepr>(
        &mut self,
        buf: &mut CudaSlice<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        self.allreduce_in_place_op(buf, Op::Sum, stream)
    }

    /// [`Arx::allreduce_in_place`] with the reduction `op` (see
    /// [`Arx::allreduce_op`]).
    pub fn allreduce_in_place_op<T: Element + DeviceRepr>(
        &mut self,
        buf: &mut CudaSlice<T>,
        op: Op,
        stream: &CudaStream,
    ) -> Result<()> {
        self.device.same_context(stream)?;
        let n = buf.len();
        let (p, _r) = buf.device_ptr_mut(stream);
        // SAFETY: as in `allreduce`; input and output may alias (each
        // element is read before it is written, and the partial is staged
        // before any output is written).
        unsafe {
            self.device
                .gpu_call(p, p, n, T::DTYPE, op, stream.cu_stream())
        }
    }

    /// [`Arx::allreduce`] on raw device addresses, for interop with other
    /// CUDA frameworks. `input == output` is allowed.
    ///
    /// # Safety
    /// `input` and `output` must be device addresses (in this instance's
    /// context, see [`Arx::cuda_context`]) valid for `count` elements of
    /// `dtype` until the call completes on `stream`, and `stream` must be a
    /// live stream of that context. Nothing else may write `input` or
    /// access `output` until then.
    pub unsafe fn allreduce_raw(
        &mut self,
        input: u64,
        output: u64,
        count: usize,
        dtype: Dtype,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.allreduce_raw_op(input, output, count, dtype, Op::Sum, stream) }
    }

    /// [`Arx::allreduce_raw`] with the reduction `op` (see
    /// [`Arx::allreduce_op`]).
    ///
    /// # Safety
    /// As [`Arx::allreduce_raw`].
    pub unsafe fn allreduce_raw_op(
        &mut self,
        input: u64,
        output: u64,
        count: usize,
        dtype: Dtype,
        op: Op,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's contract is the same as `gpu_call`'s.
        unsafe {
            self.device
                .gpu_call(input, output, count, dtype, op, stream)
        }
    }

    /// Refuses this rank's part of the next call with `err`, as arx refuses
    /// a call whose arguments it finds wrong: the call is announced to the
    /// peers as refused (they fail at once with [`Error::CallMismatch`]
    /// naming this rank, instead of waiting for the call timeout), and the
    /// instance is failed afterwards. Returns the error to report: `err`, or
    /// the instance's earlier error. For bindings that check what arx cannot
    /// see (a buffer's type, layout or device); `count` is the element count
    /// asked for, shown to the peers. On a GPU instance it synchronizes the
    /// GPU first, as a host call does.
    pub fn refuse_call(&mut self, count: usize, err: Error) -> Error {
        if let Err(earlier) = self.device.ready() {
            return earlier;
        }
        match self.device.refuse_host(count, err) {
            Err(e) => e,
            // refuse_host never returns Ok.
            Ok(()) => Error::InvalidArgument("call refused".into()),
        }
    }

    /// Test hook: the kernels' own f32 → bf16/f16 conversions (and back) on
    /// `bits`, to compare with the `half` crate.
    #[doc(hidden)]
    pub fn gpu_convert_check(&self, bits: &[u32]) -> Result<device::gpu::ConvertOut> {
        self.device.convert_check(bits)
    }

    /// Sums `input` over all ranks into `output` (host memory). Every rank
    /// gets the same bits. Lengths must match each other and every rank's.
    pub fn allreduce_host<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        self.device.host_call(Some(input), output, Op::Sum)
    }

    /// In-place variant of [`Arx::allreduce_host`].
    pub fn allreduce_host_in_place<T: Element>(&mut self, buf: &mut [T]) -> Result<()> {
        self.device.host_call(None, buf, Op::Sum)
    }

    /// [`Arx::allreduce_host`] with the reduction `op` (see
    /// [`Arx::allreduce_op`]).
    pub fn allreduce_host_op<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: Op,
    ) -> Result<()> {
        self.device.host_call(Some(input), output, op)
    }

    /// [`Arx::allreduce_host_in_place`] with the reduction `op` (see
    /// [`Arx::allreduce_op`]).
    pub fn allreduce_host_in_place_op<T: Element>(&mut self, buf: &mut [T], op: Op) -> Result<()> {
        self.device.host_call(None, buf, op)
    }
}

impl Drop for Arx {
    fn drop(&mut self) {
        // In a forked child (src/fork.rs) the proxy thread, the GPU context
        // and MPI belong to the parent: leave them alone, free nothing.
        if self.device.forked() {
            log::warn!(
                "arx: rank {}: instance dropped in a forked child; the parent's is left alone",
                self.rank()
            );
            self.device.abandon();
            self.proxy.abandon();
            self.boot.abandon();
            return;
        }
        // Kernels in flight need the proxy (peers wait for this rank's
        // sends): let them finish (each ends by its deadline) before the
        // proxy stops.
        if let Err(e) = self.device.synchronize() {
            log::warn!("arx: synchronize at drop failed: {e}");
        }
        // Collective close for RC queue pairs: every rank drains its own
        // sends (each completion means the peer acknowledged), then a bounded
        // barrier, then the endpoints go. Without the barrier a rank could
        // destroy its QPs while a peer's last writes still await their
        // acknowledgement, and that peer would see "retry exceeded".
        self.proxy.stop();
        // Then the peers learn that this rank makes no more calls: a peer
        // still calling fails at once naming this rank, not at its timeout.
        self.proxy.depart();
        if self.proxy.needs_collective_close() {
            if let Err(e) = self.boot.barrier("collective close") {
                log::warn!("arx: rank {}: closing without every peer: {e}", self.rank());
            }
        }
    }
}
