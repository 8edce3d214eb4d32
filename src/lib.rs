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
//! | slot size ★ | 1 byte to 256 MiB − 1, `K`/`M`/`G` suffixes (`ARX_SLOT_BYTES`); rounded up to a page | 1 MiB |
//! | GPU staging ★ | `sm`, `copy` (`ARX_STAGING`) | sm |
//! | call timeout | 1 ms to 24 h, in ms (`ARX_TIMEOUT_MS`): every wait of a call, [`Arx::barrier`], the collective close at drop | 10 s |
//! | start-up timeout | 1 ms to 24 h, in ms (`ARX_INIT_TIMEOUT_MS`): each collective step of start-up | 60 s |
//! | stall warning | 1 ms to 24 h, in ms (`ARX_STALL_WARN_MS`) | 2 s, or half the call timeout if less |
//! | spin | `adaptive`, `hot` (`ARX_SPIN`); hot polls before yielding, 0 to 10⁷ (`ARX_SPIN_HOT`, no builder method) | adaptive; polls chosen from ranks per core |
//! | CUDA device | ordinal (`ARX_CUDA_DEVICE`) | node-local rank modulo visible devices |
//! | RDMA devices, GID index, proxy CPU | `ARX_DEVICES`, `ARX_GID_INDEX`, `ARX_PROXY_CPU` | chosen by topology |
//! | GPU launch shape | most blocks, 1 to 1024 (`ARX_GPU_BLOCKS`); 16-byte vectors per thread per chunk, 1 to 64 (`ARX_GPU_UNROLL`); no builder methods | chosen by size and ranks per GPU |
//!
//! A [`Builder`] method sets an option instead of its variable (the
//! builder wins). Both are checked against the same ranges, in one place: a
//! value out of range is an [`Error::Config`] naming the builder method
//! (`Builder::timeout`) or the variable (`ARX_TIMEOUT_MS`). Each variable
//! that takes effect is logged once.
//!
//! ★ must be the same on every rank (the values as set, `auto` included).
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
//! * Ranks that disagree (settings, or a call's length or dtype) all get
//!   an error; none computes a wrong sum. Whatever the settings, every rank
//!   runs the same sequence of start-up collectives.
//! * Memory is fixed at construction; no allocation on the call path.
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
//!   (for example, an all-reduce of a success flag on its communicator),
//!   drop the instances that were created, and call [`Arx::new`] on every
//!   rank.
//!
//! ## GPU buffers
//!
//! With the GPU device side, [`Arx::allreduce`] takes cudarc device slices
//! and a stream, enqueues one kernel (plus two copies with
//! [`Staging::CopyEngine`]) and returns: it never waits for the GPU and does
//! no host work that a CUDA graph would have to repeat, so it can be
//! captured (`CudaStream::begin_capture`) and replayed; the call counter
//! lives in device memory. Errors the kernel records (a peer's timeout, an
//! abort, a call mismatch) are returned by the next call, or at once by
//! [`Arx::check`], which synchronizes. A failed kernel writes NaN to its
//! output, so a replayed graph cannot pass a stale result off as new.
//! [`Arx::allreduce_host`] works on a GPU instance too (it synchronizes the
//! GPU first), so `DeviceKind::Auto` choosing the GPU side never breaks a
//! program that uses host slices. Use [`Arx::allreduce_raw`] for device
//! pointers from other frameworks.
//!
//! Cudarc's per-slice event tracking records events on the slices' streams;
//! inside stream capture, either use one stream for everything or disable
//! it (`CudaContext::disable_event_tracking`). Graphs captured from an
//! instance must not be launched after the instance is dropped.
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

mod bootstrap;
mod config;
mod device;
mod dtype;
mod error;
mod fabric;
mod layout;
mod proxy;
mod spin;
pub mod topology;
pub mod verify;
mod wire;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use mpi::topology::Communicator;

/// The cudarc version arx's GPU API takes (re-exported so callers use the same).
pub use cudarc;

pub use config::{
    parse_bytes, Config, DeviceKind, FabricKind, SpinMode, Staging, DEFAULT_INIT_TIMEOUT,
    DEFAULT_SLOT_BYTES, DEFAULT_TIMEOUT, MAX_GPU_BLOCKS, MAX_GPU_UNROLL, MAX_SPIN_HOT, MAX_TIMEOUT,
    MIN_TIMEOUT,
};
pub use dtype::{Dtype, Element};
pub use error::{Error, Result};
pub use layout::Layout;
pub use wire::PeerInfo;

use bootstrap::Bootstrap;
use fabric::Fabric;
use layout::Region;
use proxy::Proxy;

/// Number of usable CUDA devices, or why the GPU device side cannot run
/// here (no libcuda, no libnvrtc, no device). Never panics.
pub fn gpu_available() -> Result<usize> {
    device::gpu::device_count()
}

/// Options for [`Arx`]; each overrides its `ARX_*` environment variable.
#[derive(Debug, Clone, Default)]
pub struct Builder {
    o: config::Overrides,
}

impl Builder {
    /// Device side (`ARX_DEVICE`).
    pub fn device(mut self, d: DeviceKind) -> Self {
        self.o.device = Some(d);
        self
    }
    /// Fabric (`ARX_FABRIC`).
    pub fn fabric(mut self, f: FabricKind) -> Self {
        self.o.fabric = Some(f);
        self
    }
    /// Largest partial in bytes (`ARX_SLOT_BYTES`); rounded up to a page.
    pub fn slot_bytes(mut self, b: usize) -> Self {
        self.o.slot_bytes = Some(b);
        self
    }
    /// Bound on every wait of a call, of [`Arx::barrier`] and of the
    /// collective close at drop (`ARX_TIMEOUT_MS`); 1 ms to 24 h, checked
    /// by [`Builder::build`].
    pub fn timeout(mut self, t: Duration) -> Self {
        self.o.timeout = Some(t);
        self
    }
    /// Bound on each collective step of start-up (`ARX_INIT_TIMEOUT_MS`);
    /// 1 ms to 24 h, checked by [`Builder::build`].
    pub fn init_timeout(mut self, t: Duration) -> Self {
        self.o.init_timeout = Some(t);
        self
    }
    /// Stall duration after which the watchdog logs peers' flags (`ARX_STALL_WARN_MS`).
    pub fn stall_warn(mut self, t: Duration) -> Self {
        self.o.stall_warn = Some(t);
        self
    }
    /// CPU spin policy (`ARX_SPIN`).
    pub fn spin(mut self, s: SpinMode) -> Self {
        self.o.spin = Some(s);
        self
    }
    /// GPU send-slot staging (`ARX_STAGING`).
    pub fn staging(mut self, s: Staging) -> Self {
        self.o.staging = Some(s);
        self
    }
    /// RDMA devices for lane 0 and lane 1 (`ARX_DEVICES`).
    pub fn devices(mut self, d: Vec<String>) -> Self {
        self.o.devices = Some(d);
        self
    }
    /// RoCE GID index for every device (`ARX_GID_INDEX`).
    pub fn gid_index(mut self, g: u32) -> Self {
        self.o.gid_index = Some(g);
        self
    }
    /// CPU for the proxy thread (`ARX_PROXY_CPU`).
    pub fn proxy_cpu(mut self, c: usize) -> Self {
        self.o.proxy_cpu = Some(c);
        self
    }
    /// CUDA device ordinal of the GPU device side (`ARX_CUDA_DEVICE`).
    pub fn cuda_device(mut self, ordinal: usize) -> Self {
        self.o.cuda_device = Some(ordinal);
        self
    }

    /// Creates the instance: collective over `comm`, each step bounded by
    /// the start-up timeout. Every rank returns an error if any rank fails
    /// or disagrees; see the crate docs (Guarantees) for a timeout.
    pub fn build<C: Communicator>(self, comm: &C) -> Result<Arx> {
        // Before any MPI call (even MPI_Comm_size): outside MPI_Init ..
        // MPI_Finalize, Open MPI aborts the process.
        bootstrap::usable("MPI_Comm_idup")?;
        // A bad setting on one rank must fail every rank at once, not leave
        // the others waiting: every rank sends its settings or its refusal
        // in the first collective, of one fixed shape.
        let cfg = Config::resolve(&self.o);
        let init_timeout = match &cfg {
            Ok(c) => c.init_timeout,
            Err(_) => Config::init_timeout_or_default(&self.o),
        };
        let record =
            wire::Settings::local(comm.size() as usize, comm.rank() as usize, &cfg).encode();
        let (boot, all) = Bootstrap::start(comm, init_timeout, &record)?;
        let cfg = wire::agree_settings(cfg, &all)?;
        Arx::establish(boot, cfg)
    }
}

/// Which device side an instance runs.
enum Side {
    Host,
    Gpu(Box<device::gpu::GpuSide>),
}

/// One all-reduce instance over a communicator.
pub struct Arx {
    // Field order is drop order: the proxy stops before the region goes.
    proxy: Proxy,
    region: Arc<Region>,
    layout: Layout,
    cfg: Config,
    side: Side,
    seq: u64,
    failed: Option<Error>,
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

    fn establish(mut boot: Bootstrap, cfg: Config) -> Result<Self> {
        let world = boot.world();
        let rank = boot.rank();

        // Device side. Auto takes the GPU only if every rank can, so that
        // all ranks run the same side (and a rank without a GPU does not
        // fail a job that never asked for one). The availability is
        // exchanged whatever the setting, so that every rank runs the same
        // collectives; the host side does not probe (no driver loading).
        let probe = match cfg.device {
            DeviceKind::Host => Err(Error::Unavailable {
                what: "the GPU device side",
                reason: "not probed (ARX_DEVICE=host)".into(),
            }),
            _ => device::gpu::device_count().map(|_| ()),
        };
        let avail = boot.all_gather_bytes(
            "GPU availability",
            &match &probe {
                Ok(()) => vec![1],
                Err(e) => [&[0u8][..], e.to_string().as_bytes()].concat(),
            },
        )?;
        let missing = avail.iter().position(|b| b.first() != Some(&1));
        let peer_text =
            |r: usize| String::from_utf8_lossy(avail[r].get(1..).unwrap_or_default()).into_owned();
        let want_gpu = match cfg.device {
            DeviceKind::Host => false,
            DeviceKind::Gpu => {
                probe?;
                if let Some(r) = missing {
                    return Err(Error::PeerFailed {
                        peer: r,
                        reason: peer_text(r),
                    });
                }
                true
            }
            DeviceKind::Auto => match missing {
                None => true,
                Some(r) => {
                    log::debug!("arx: device side auto: host (rank {r}: {})", peer_text(r));
                    false
                }
            },
        };
        let device_code = if want_gpu {
            DeviceKind::Gpu.code()
        } else {
            DeviceKind::Host.code()
        };
        let layout = boot.agree("layout", Layout::agreed(&boot, world, rank, cfg.slot_bytes))?;

        // Everyone's description, validated identically on every rank.
        let me = PeerInfo::local(world, rank, layout.slot_bytes(), cfg.fabric, device_code);
        let infos = wire::validate(&boot.all_gather_bytes("PeerInfo", &me.encode())?)?;
        let one_node = infos.iter().all(|p| p.host == infos[0].host);
        let local_ranks = infos.iter().filter(|p| p.host == infos[rank].host).count();
        let mut cfg = cfg;
        cfg.spin_hot = Some(cfg.hot_rounds(local_ranks));
        let fabric_kind = match cfg.fabric {
            FabricKind::Auto if one_node => FabricKind::Shm,
            FabricKind::Auto => FabricKind::Verbs,
            k => k,
        };
        if fabric_kind == FabricKind::Shm && !one_node {
            let other = infos
                .iter()
                .position(|p| p.host != infos[0].host)
                .unwrap_or(0);
            return Err(Error::Mismatch {
                what: "node (the shm fabric needs every rank on one node)",
                rank: other,
                ours: infos[0].host.clone(),
                theirs: infos[other].host.clone(),
            });
        }

        // The CUDA context: this rank's index among the ranks of its node
        // picks the device unless one was set.
        let ranks_on_node = infos.iter().filter(|p| p.host == infos[rank].host).count();
        let ctx = if want_gpu {
            let local = infos[..rank]
                .iter()
                .filter(|p| p.host == infos[rank].host)
                .count();
            let ctx = device::gpu::device_count()
                .and_then(|n| device::gpu::context(cfg.cuda_device.unwrap_or(local % n)));
            Some(boot.agree("CUDA context", ctx)?)
        } else {
            None
        };

        // Region and fabric.
        let (region, fabric): (Arc<Region>, Box<dyn Fabric>) = match fabric_kind {
            FabricKind::Shm => {
                let setup = fabric::shm::establish(&boot, &layout)?;
                let region = Arc::clone(&setup.regions[rank]);
                (
                    region,
                    Box::new(fabric::shm::ShmFabric::new(layout, &setup)),
                )
            }
            _ => {
                let region = match &ctx {
                    Some(c) => device::gpu::alloc_region(c, layout.region_bytes()),
                    None => Region::anonymous(layout.region_bytes()),
                };
                let region = Arc::new(boot.agree("region", region)?);
                let hosts: Vec<&str> = infos.iter().map(|p| p.host.as_str()).collect();
                let local = topology::LocalRank::gather(&boot, &hosts, rank)?;
                let f = fabric::verbs::connect(&boot, &cfg, &layout, &region, local)?;
                (region, Box::new(f))
            }
        };
        region
            .ctrl()
            .timeout_ns()
            .store(cfg.timeout.as_nanos() as u64, Ordering::Relaxed);
        // The GPU side is complete (region mapped, kernels loaded, device
        // state initialised) before the proxy starts.
        let side = match ctx {
            Some(ctx) => {
                let g = device::gpu::GpuSide::new(
                    ctx,
                    Arc::clone(&region),
                    fabric_kind == FabricKind::Shm,
                    layout,
                    &cfg,
                    ranks_on_node,
                );
                Side::Gpu(Box::new(boot.agree("GPU side", g)?))
            }
            None => Side::Host,
        };
        // Test-only: every post late (fabric::delayed).
        let fabric: Box<dyn Fabric> = match fabric::delayed::from_env() {
            Some(d) => Box::new(fabric::delayed::Delayed::new(fabric, d)),
            None => fabric,
        };
        let fabric_name = fabric.name();
        let fabric_desc = fabric.describe();
        let proxy = boot.agree("proxy start", {
            let cpu = cfg.proxy_cpu.or(fabric.proxy_cpu());
            Proxy::start(fabric, Arc::clone(&region), layout, &cfg, cpu)
        })?;
        boot.barrier("start-up barrier")?;
        boot.set_call_timeout(cfg.timeout);
        log::info!(
            "arx: rank {rank}/{world} ready: device {}, fabric {fabric_name} ({fabric_desc}), {} bytes mapped",
            match &side {
                Side::Host => "host".to_string(),
                Side::Gpu(g) => g.describe(),
            },
            layout.region_bytes()
        );
        Ok(Arx {
            proxy,
            region,
            layout,
            cfg,
            side,
            seq: 0,
            failed: None,
            fabric_desc,
            fabric_name,
            boot,
        })
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
        &self.cfg
    }
    /// Largest element count of one call for `T`.
    pub fn max_count<T: Element>(&self) -> usize {
        (self.layout.slot_bytes() / std::mem::size_of::<T>()).min(abi::ARX_MAX_COUNT as usize)
    }
    /// What this instance is made of.
    pub fn describe(&self) -> Description {
        Description {
            device: match self.side {
                Side::Host => "host",
                Side::Gpu(_) => "gpu",
            },
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
        self.proxy.inject_fault(peer, lane)
    }

    /// A barrier over the instance's private communicator, bounded by the
    /// call timeout (a rank that never arrives is an [`Error::Timeout`]).
    /// After `MPI_Finalize` it returns [`Error::Mpi`] without calling MPI.
    pub fn barrier(&self) -> Result<()> {
        self.boot.barrier("user barrier")
    }

    /// Returns the sticky error, the proxy's or the kernel's, before a call.
    fn ready(&mut self) -> Result<()> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if let Side::Gpu(g) = &self.side {
            if let Some(e) = g.kernel_error(self.proxy.shared()) {
                self.failed = Some(e.clone());
                return Err(e);
            }
        }
        proxy::check(&self.proxy).inspect_err(|e| self.failed = Some(e.clone()))
    }

    /// Waits for every call enqueued on the GPU and returns the first error
    /// of this instance (kernel, proxy or earlier call), if any. On the host
    /// device side it only returns the recorded error.
    pub fn check(&mut self) -> Result<()> {
        if let Side::Gpu(g) = &self.side {
            if let Err(e) = g.synchronize() {
                self.failed.get_or_insert(e.clone());
                return Err(e);
            }
        }
        self.ready()
    }

    /// The CUDA context of the GPU device side (None on the host side).
    pub fn cuda_context(&self) -> Option<&Arc<CudaContext>> {
        match &self.side {
            Side::Gpu(g) => Some(g.context()),
            Side::Host => None,
        }
    }

    /// The call number the next host-side call uses. On the GPU side the
    /// counter lives in device memory (graph replays advance it without
    /// the host), so the GPU is synchronized and the counter read.
    fn next_host_seq(&mut self) -> Result<u64> {
        match &self.side {
            Side::Host => Ok(self.seq + 1),
            Side::Gpu(g) => {
                g.synchronize()?;
                if let Some(e) = g.kernel_error(self.proxy.shared()) {
                    return Err(e);
                }
                Ok(g.device_seq()? + 1)
            }
        }
    }

    /// Sums `input` over all ranks into `output` (GPU memory), enqueued on
    /// `stream`. Every rank gets the same bits. Returns once the work is
    /// enqueued; errors the kernel records come back from the next call or
    /// from [`Arx::check`]. Capturable into a CUDA graph.
    pub fn allreduce<T: Element + DeviceRepr>(
        &mut self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        self.same_context(stream)?;
        if input.len() != output.len() {
            let e = Error::InvalidArgument(format!(
                "input has {} elements, output {}",
                input.len(),
                output.len()
            ));
            return self.refuse_gpu(output.len(), e, stream.cu_stream());
        }
        let n = output.len();
        let (i, _ri) = input.device_ptr(stream);
        let (o, _ro) = output.device_ptr_mut(stream);
        // SAFETY: both slices are live device allocations of `n` elements of
        // T in this context (checked), borrowed until the launch is enqueued;
        // cudarc's events order later uses of them after the kernel.
        unsafe { self.gpu_call(i, o, n, T::DTYPE, stream.cu_stream()) }
    }

    /// In-place variant of [`Arx::allreduce`]: `buf` holds this rank's
    /// partial and receives the sum.
    pub fn allreduce_in_place<T: Element + DeviceRepr>(
        &mut self,
        buf: &mut CudaSlice<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        self.same_context(stream)?;
        let n = buf.len();
        let (p, _r) = buf.device_ptr_mut(stream);
        // SAFETY: as in `allreduce`; input and output may alias (each
        // element is read before it is written, and the partial is staged
        // before any output is written).
        unsafe { self.gpu_call(p, p, n, T::DTYPE, stream.cu_stream()) }
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
        self.gpu_call(input, output, count, dtype, stream)
    }

    fn same_context(&mut self, stream: &CudaStream) -> Result<()> {
        match &self.side {
            Side::Gpu(g) if g.context().cu_ctx() == stream.context().cu_ctx() => Ok(()),
            Side::Gpu(g) => Err(Error::InvalidArgument(format!(
                "the stream belongs to CUDA device {}, this instance to device {}",
                stream.context().ordinal(),
                g.context().ordinal()
            ))),
            Side::Host => Err(Error::InvalidArgument(
                "this instance runs the host device side (no usable GPU, or ARX_DEVICE=host): use allreduce_host".into(),
            )),
        }
    }

    /// # Safety
    /// As [`Arx::allreduce_raw`].
    unsafe fn gpu_call(
        &mut self,
        input: u64,
        output: u64,
        count: usize,
        dtype: Dtype,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        self.ready()?;
        let max = (self.layout.slot_bytes() / dtype.size()).min(abi::ARX_MAX_COUNT as usize);
        if count > max {
            let e = Error::InvalidArgument(format!(
                "{count} elements of {} ({} bytes) exceed the slot of {} bytes (ARX_SLOT_BYTES)",
                dtype.name(),
                count * dtype.size(),
                self.layout.slot_bytes()
            ));
            return self.refuse_gpu(count, e, stream);
        }
        let Side::Gpu(g) = &mut self.side else {
            return Err(Error::InvalidArgument(
                "this instance runs the host device side: use allreduce_host".into(),
            ));
        };
        let r = g.launch(input, output, count, dtype.code(), stream);
        self.seq += 1;
        r.inspect_err(|e| self.failed = Some(e.clone()))
    }

    /// Refuses a GPU call: the kernel publishes it with the "invalid" dtype
    /// and no data (so peers fail at once, also inside a graph), and this
    /// rank returns `err`; the instance is failed afterwards.
    fn refuse_gpu(
        &mut self,
        count: usize,
        err: Error,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        self.ready()?;
        if let Side::Gpu(g) = &mut self.side {
            let c = count.min(abi::ARX_MAX_COUNT as usize);
            // SAFETY: an INVALID call touches no input or output memory.
            if let Err(e) = unsafe { g.launch(0, 0, c, abi::ARX_DTYPE_INVALID, stream) } {
                log::warn!("arx: could not announce the refused call to peers: {e}");
            }
        }
        self.failed = Some(err.clone());
        Err(err)
    }

    /// Test hook: the kernels' own f32 → bf16/f16 conversions (and back) on
    /// `bits`, to compare with the `half` crate.
    #[doc(hidden)]
    pub fn gpu_convert_check(&self, bits: &[u32]) -> Result<device::gpu::ConvertOut> {
        match &self.side {
            Side::Gpu(g) => g.convert_check(bits),
            Side::Host => Err(Error::InvalidArgument("no GPU side".into())),
        }
    }

    fn check_len<T: Element>(&self, n: usize) -> Result<()> {
        if n > self.max_count::<T>() {
            return Err(Error::InvalidArgument(format!(
                "{n} elements of {} ({} bytes) exceed the slot of {} bytes (ARX_SLOT_BYTES)",
                T::DTYPE.name(),
                n * std::mem::size_of::<T>(),
                self.layout.slot_bytes()
            )));
        }
        Ok(())
    }

    /// Sums `input` over all ranks into `output` (host memory). Every rank
    /// gets the same bits. Lengths must match each other and every rank's.
    pub fn allreduce_host<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        if input.len() != output.len() {
            let e = Error::InvalidArgument(format!(
                "input has {} elements, output {}",
                input.len(),
                output.len()
            ));
            self.ready()?;
            return self.refuse(output.len(), e);
        }
        self.host_call(Some(input), output)
    }

    /// In-place variant of [`Arx::allreduce_host`].
    pub fn allreduce_host_in_place<T: Element>(&mut self, buf: &mut [T]) -> Result<()> {
        self.host_call(None, buf)
    }

    fn host_call<T: Element>(&mut self, input: Option<&[T]>, output: &mut [T]) -> Result<()> {
        self.ready()?;
        if let Err(e) = self.check_len::<T>(output.len()) {
            return self.refuse(output.len(), e);
        }
        let seq = self
            .next_host_seq()
            .inspect_err(|e| self.failed = Some(e.clone()))?;
        let r = device::host::allreduce(
            &self.region,
            &self.layout,
            &self.cfg,
            self.proxy.shared(),
            seq,
            input,
            output,
        );
        self.seq = seq;
        let r = match (&self.side, r) {
            // The device counter follows the host call.
            (Side::Gpu(g), Ok(())) => g.set_device_seq(seq),
            (_, r) => r,
        };
        r.inspect_err(|e| self.failed = Some(e.clone()))
    }

    /// Refuses a call this rank cannot make, without leaving the peers to
    /// time out: it publishes the call with the "invalid" dtype and no data,
    /// so every peer fails at once with a [`Error::CallMismatch`] naming this
    /// rank, and this rank returns `err`. The instance is failed afterwards.
    fn refuse(&mut self, count: usize, err: Error) -> Result<()> {
        let seq = match self.next_host_seq() {
            Ok(s) => s,
            Err(e) => {
                log::warn!("arx: could not announce the refused call to peers: {e}");
                self.failed = Some(err.clone());
                return Err(err);
            }
        };
        let ctrl = self.region.ctrl();
        let p = (seq & 1) as usize;
        ctrl.meta(p).store(
            layout::flag_word(seq, abi::ARX_DTYPE_INVALID, count),
            Ordering::Relaxed,
        );
        ctrl.seq().store(seq, Ordering::Release);
        self.seq = seq;
        if let Side::Gpu(g) = &self.side {
            let _ = g.set_device_seq(seq);
        }
        self.failed = Some(err.clone());
        Err(err)
    }
}

impl Drop for Arx {
    fn drop(&mut self) {
        // Kernels in flight need the proxy (peers wait for this rank's
        // sends): let them finish (each ends by its deadline) before the
        // fields, the proxy first, are dropped.
        if let Side::Gpu(g) = &self.side {
            if let Err(e) = g.synchronize() {
                log::warn!("arx: synchronize at drop failed: {e}");
            }
        }
        // Collective close for RC queue pairs: every rank drains its own
        // sends (each completion means the peer acknowledged), then a bounded
        // barrier, then the endpoints go. Without the barrier a rank could
        // destroy its QPs while a peer's last writes still await their
        // acknowledgement, and that peer would see "retry exceeded".
        self.proxy.stop();
        if self.proxy.needs_collective_close() {
            if let Err(e) = self.boot.barrier("collective close") {
                log::warn!("arx: rank {}: closing without every peer: {e}", self.rank());
            }
        }
    }
}
