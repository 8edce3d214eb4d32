//! [`Builder`]: explicit settings for an [`Arx`] instance, and the start of
//! its construction (the settings exchange that every rank runs first).

use std::time::Duration;

use mpi::topology::Communicator;

use crate::bootstrap::{self, Bootstrap};
use crate::config::{self, Config, DeviceKind, FabricKind, SpinMode, Staging};
use crate::error::{Error, Result};
use crate::{wire, Arx};

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
    /// All-reduce algorithm (`ARX_ALGO`; see [`crate::Algo`]).
    pub fn algo(mut self, a: crate::Algo) -> Self {
        self.o.algo = Some(a);
        self
    }
    /// Test hook, not for use: pauses `d` before each pipelined chunk's
    /// sum (two-shot: its reduce and its copy out) on the host side (calls
    /// longer than one slot), and on the GPU side before every one-shot
    /// sum and every reduce and copy out of the collective kernels
    /// (two-shot, reduce_scatter, all_gather), so that a test can make one
    /// rank the slow one while its peers run ahead.
    #[doc(hidden)]
    pub fn test_sum_delay(mut self, d: Duration) -> Self {
        self.o.sum_delay = Some(d);
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

    /// Makes [`Builder::build`] fail on this rank with `e`, as a bad
    /// setting does: this rank still takes part in the exchange of settings,
    /// so every other rank fails at once with [`Error::PeerFailed`] naming
    /// it instead of waiting for the start-up timeout. For bindings whose
    /// own checks of an option failed (an unknown keyword, a value of the
    /// wrong type).
    pub fn refuse(mut self, e: Error) -> Self {
        // The first refusal wins: it is the one the user should see.
        self.o.refused.get_or_insert(e);
        self
    }

    /// For bindings: the name a refused setting goes by in their API
    /// (`names("Builder::timeout")` gives, say, `"arxConfig_t.timeoutMs"`;
    /// an `ARX_*` variable's name, or one `names` returns unchanged, stays
    /// as it is), so that the error names what the caller wrote.
    #[doc(hidden)]
    pub fn names(mut self, names: fn(&'static str) -> &'static str) -> Self {
        self.o.names = Some(names);
        self
    }

    /// Creates the instance: collective over `comm`, each step bounded by
    /// the start-up timeout. Every rank returns an error if any rank fails
    /// or disagrees; see the crate docs (Guarantees) for a timeout.
    pub fn build<C: Communicator>(self, comm: &C) -> Result<Arx> {
        // SAFETY: an rsmpi communicator is a live intra-communicator.
        unsafe { self.build_raw(comm.as_raw()) }
    }

    /// [`Builder::build`] on a raw `MPI_Comm` handle, for programs whose
    /// communicator does not come from rsmpi (the C ABI, the Python
    /// module). The handle stays the caller's: arx duplicates it and never
    /// frees it. `MPI_COMM_NULL` and inter-communicators are refused.
    ///
    /// # Safety
    /// `comm` must be `MPI_COMM_NULL` or a live communicator handle of the
    /// MPI library this process runs (not freed before this returns).
    pub unsafe fn build_raw(self, comm: mpi::ffi::MPI_Comm) -> Result<Arx> {
        // Before any MPI call (even MPI_Comm_size): outside MPI_Init ..
        // MPI_Finalize, Open MPI aborts the process.
        bootstrap::usable("MPI_Comm_idup")?;
        // SAFETY: the caller's contract.
        let (world, rank) = unsafe { bootstrap::raw_size_rank(comm)? };
        // A bad setting on one rank must fail every rank at once, not leave
        // the others waiting: every rank sends its settings or its refusal
        // in the first collective, of one fixed shape.
        let cfg = Config::resolve(&self.o);
        let init_timeout = match &cfg {
            Ok(c) => c.init_timeout,
            Err(_) => Config::init_timeout_or_default(&self.o),
        };
        let record = wire::Settings::local(world, rank, &cfg).encode();
        // SAFETY: the caller's contract.
        let (boot, all) = unsafe { Bootstrap::start_raw(comm, init_timeout, &record)? };
        let cfg = wire::agree_settings(cfg, &all)?;
        crate::establish::establish(boot, cfg)
    }
}
