//! Every tuning knob in one place, with its default.
//!
//! A knob is set, in order of precedence, by the builder ([`crate::Builder`]),
//! by its `ARX_*` environment variable, or by its default. Each environment
//! variable that takes effect is logged once per process.

use std::collections::HashSet;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

use crate::error::{Error, Result};

/// Who writes partials and sums them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// GPU if a CUDA driver and device are present, else Host.
    Auto,
    /// The CPU runs the protocol on host buffers (the embedded default).
    Host,
    /// The arx CUDA kernel runs the protocol on GPU buffers.
    Gpu,
}

/// How bytes and flags reach peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FabricKind {
    /// Shm when every rank is on one node, else Verbs.
    Auto,
    /// POSIX shared memory between the ranks of one node.
    Shm,
    /// RDMA writes over RC queue pairs (RoCE v2), one device per lane.
    Verbs,
}

/// How the send slot is filled on the GPU device side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Staging {
    /// SM stores followed by a system-scope fence, inside the kernel.
    Sm,
    /// A copy-engine copy (`cuMemcpyAsync`) before the kernel.
    CopyEngine,
}

/// How an all-reduce moves its bytes (`ARX_ALGO`). Every algorithm gives
/// the same bits (see the crate docs, Guarantees); they differ in bytes
/// moved and round trips.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Algo {
    /// Chosen per call by size and world ([`Algo::choose`]).
    #[default]
    Auto,
    /// Every rank sends its whole partial to every peer and sums all of
    /// them: one round trip, `(N-1)·S` bytes sent per rank.
    OneShot,
    /// Reduce-scatter, then all-gather: each rank sums one shard and sends
    /// it to every peer; two round trips, `2(N-1)/N·S` bytes per rank.
    TwoShot,
}

/// On the host device side, the smallest call (bytes) the automatic choice
/// runs as two-shot at `world` ranks over `fabric` (`None`: never, one
/// rank). On the Shm fabric (one node), measured
/// with `allreduce_perf -A all` on 16 cores, Host+Shm, one core per rank,
/// float and bf16, five rounds (docs/BENCHMARKS.md, "One-shot vs two-shot",
/// 2026-12-04): at 2 ranks one-shot was faster up to 64 KiB (both move the
/// same bytes there, and one-shot's single round trip wins) and two-shot
/// from 128 KiB; at 3 ranks they were even from 8 to 32 KiB and two-shot
/// ahead from 16 KiB in bf16, 16-32 KiB in float; at 4 to 6 ranks two-shot
/// was faster from 2 KiB (1.2-1.5x), even at 1 KiB; at 8 ranks from 1 KiB
/// (1.2x). More ranks make one-shot's sum of N partials the cost, which
/// two-shot cuts to one shard. Worlds above 8 (not measured) take 8's
/// threshold. Over Verbs (between nodes, where each of two-shot's round
/// trips crosses the network; not measured on a NIC yet) the rule before
/// these measurements stays: two-shot from 8 KiB at 2 ranks or more.
/// `FabricKind::Auto` (a fabric not yet resolved) takes the Verbs rule.
pub const fn host_twoshot_from_bytes(world: usize, fabric: FabricKind) -> Option<usize> {
    match (fabric, world) {
        (_, 0 | 1) => None,
        (FabricKind::Shm, 2) => Some(128 << 10),
        (FabricKind::Shm, 3) => Some(16 << 10),
        (FabricKind::Shm, 4..=7) => Some(2 << 10),
        (FabricKind::Shm, _) => Some(1 << 10),
        (FabricKind::Verbs | FabricKind::Auto, _) => Some(8 << 10),
    }
}

/// On the GPU device side, from this many bytes per call, at 4 ranks or
/// more, the automatic choice is two-shot. Measured on one H200 with the
/// ranks under MPS (docs/BENCHMARKS.md): at 4 ranks two-shot was faster
/// from 128 KiB (0.81× one-shot's time) to 4 MiB (0.75×) and slower below;
/// at 3 ranks it was never clearly faster up to 4 MiB, so 3 ranks stay
/// one-shot. The GB10 model (docs/GB10.md) predicts 135-180 KB at 4 ranks
/// on Sparks.
pub const GPU_TWOSHOT_FROM_BYTES: usize = 128 << 10;

impl Algo {
    /// The algorithm a call of `bytes` bytes over `world` ranks runs on the
    /// host device side (`gpu` false) or the GPU device side (`gpu` true;
    /// host calls on a GPU instance follow the GPU rule, so that every rank
    /// of an instance decides alike whichever kind of call it makes).
    ///
    /// Automatic: two-shot from [`Algo::twoshot_from_bytes`], otherwise
    /// one-shot. `fabric`: the one in use (every rank's is the same).
    pub fn choose(self, world: usize, bytes: usize, gpu: bool, fabric: FabricKind) -> Algo {
        let two = Self::twoshot_from_bytes(world, gpu, fabric).is_some_and(|from| bytes >= from);
        match self {
            Algo::Auto if two => Algo::TwoShot,
            Algo::Auto => Algo::OneShot,
            fixed => fixed,
        }
    }
    /// The smallest call (bytes) that the automatic choice runs as
    /// two-shot over `world` ranks on the GPU side (`gpu`: from 4 ranks,
    /// [`GPU_TWOSHOT_FROM_BYTES`]) or the host side
    /// ([`host_twoshot_from_bytes`], over `fabric`); `None`: always
    /// one-shot.
    pub const fn twoshot_from_bytes(world: usize, gpu: bool, fabric: FabricKind) -> Option<usize> {
        if gpu {
            if world >= 4 {
                Some(GPU_TWOSHOT_FROM_BYTES)
            } else {
                None
            }
        } else {
            host_twoshot_from_bytes(world, fabric)
        }
    }
    /// Its code in the start-up record every rank compares
    /// (`setting_name` spells it back).
    pub(crate) fn code(self) -> u8 {
        match self {
            Algo::Auto => 0,
            Algo::OneShot => 1,
            Algo::TwoShot => 2,
        }
    }
    /// Its spelling in `ARX_ALGO`.
    pub fn name(self) -> &'static str {
        match self {
            Algo::Auto => "auto",
            Algo::OneShot => "oneshot",
            Algo::TwoShot => "twoshot",
        }
    }
}

/// How CPU-side waits (proxy, Host device side) spin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpinMode {
    /// Poll hot for a while, then yield, then sleep briefly: fair to
    /// oversubscribed runs and to idle periods.
    Adaptive,
    /// Never give up the core (one rank per node, dedicated cores).
    Hot,
    /// Sleep in short naps from the first idle round, never poll hot: 20
    /// us plus the thread's timer slack (10 us on arx's own threads,
    /// Linux's 50 us by default on a caller's). For threads that share
    /// their CPU with a thread that never yields. A GPU instance's proxy takes it by itself when it must share
    /// the caller's only CPU (under `Adaptive`, the default; README, *CPU
    /// binding on one node*). Each call waits about a nap longer.
    Nap,
}

macro_rules! parse_enum {
    ($t:ty, $name:literal, { $($s:literal => $v:expr),+ $(,)? }) => {
        impl FromStr for $t {
            type Err = Error;
            fn from_str(s: &str) -> Result<Self> {
                match s.to_ascii_lowercase().as_str() {
                    $($s => Ok($v),)+
                    _ => Err(Error::Config {
                        name: $name,
                        value: s.into(),
                        reason: format!("expected one of: {}", [$($s),+].join(", ")),
                    }),
                }
            }
        }
    };
}
parse_enum!(DeviceKind, "ARX_DEVICE", { "auto" => DeviceKind::Auto, "host" => DeviceKind::Host, "gpu" => DeviceKind::Gpu });
parse_enum!(FabricKind, "ARX_FABRIC", { "auto" => FabricKind::Auto, "shm" => FabricKind::Shm, "verbs" => FabricKind::Verbs });
parse_enum!(Staging, "ARX_STAGING", { "sm" => Staging::Sm, "copy" => Staging::CopyEngine, "ce" => Staging::CopyEngine });
parse_enum!(Algo, "ARX_ALGO", { "auto" => Algo::Auto, "oneshot" => Algo::OneShot, "one-shot" => Algo::OneShot, "twoshot" => Algo::TwoShot, "two-shot" => Algo::TwoShot });
parse_enum!(SpinMode, "ARX_SPIN", { "adaptive" => SpinMode::Adaptive, "hot" => SpinMode::Hot, "nap" => SpinMode::Nap });

impl FabricKind {
    pub(crate) fn code(self) -> u8 {
        match self {
            FabricKind::Auto => 0,
            FabricKind::Shm => 1,
            FabricKind::Verbs => 2,
        }
    }
    pub(crate) fn from_code(c: u8) -> Option<Self> {
        [FabricKind::Auto, FabricKind::Shm, FabricKind::Verbs]
            .into_iter()
            .find(|k| k.code() == c)
    }
}

impl DeviceKind {
    pub(crate) fn code(self) -> u8 {
        match self {
            DeviceKind::Auto => 0,
            DeviceKind::Host => 1,
            DeviceKind::Gpu => 2,
        }
    }
}

/// The spelling of a setting's value in its `ARX_*` variable, for messages
/// that compare ranks' settings.
pub(crate) fn setting_name(what: &str, code: u8) -> String {
    let names: &[&str] = match what {
        "ARX_DEVICE" => &["auto", "host", "gpu"],
        "ARX_FABRIC" => &["auto", "shm", "verbs"],
        "ARX_STAGING" => &["sm", "copy"],
        "ARX_ALGO" => &["auto", "oneshot", "twoshot"],
        _ => &[],
    };
    names
        .get(code as usize)
        .map_or_else(|| format!("code {code}"), |n| n.to_string())
}

impl Staging {
    pub(crate) fn code(self) -> u8 {
        match self {
            Staging::Sm => 0,
            Staging::CopyEngine => 1,
        }
    }
}

/// Default slot size: the largest partial of one call (1 MiB).
pub const DEFAULT_SLOT_BYTES: usize = 1 << 20;
/// Default bound on every wait of a call, [`crate::Arx::barrier`] and the
/// collective close at drop (`ARX_TIMEOUT_MS`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default bound on each collective step of start-up (`ARX_INIT_TIMEOUT_MS`):
/// generous, because setting up RDMA devices, CUDA contexts and kernels can
/// take seconds on a loaded or virtual machine.
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(60);
/// Shortest timeout accepted (for every timeout-like setting).
pub const MIN_TIMEOUT: Duration = Duration::from_millis(1);
/// Longest timeout accepted (for every timeout-like setting): one day. Far
/// above any useful bound, and far below what would overflow a deadline
/// (`Instant + timeout`) or the kernel's 64-bit nanosecond deadline.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// Most blocks of one GPU launch (`ARX_GPU_BLOCKS`): more than any GPU has
/// SMs (H200: 132, GB10: 48); the default is at most 16.
pub const MAX_GPU_BLOCKS: u32 = 1024;
/// Most 16-byte vectors per thread per chunk (`ARX_GPU_UNROLL`): 64 × 16 B ×
/// 256 threads is a 256 KiB chunk per block, a quarter of the default slot;
/// larger chunks only leave a call to fewer blocks (the default is 2). The
/// bound also keeps the kernel's 32-bit chunk arithmetic far from overflow.
pub const MAX_GPU_UNROLL: u32 = 64;
/// Most hot polls before a CPU wait yields (`ARX_SPIN_HOT`): ten million
/// polls is already about a second of a core; beyond that, hot spinning is
/// no longer a latency choice (use `ARX_SPIN=hot` to never yield).
pub const MAX_SPIN_HOT: u32 = 10_000_000;
/// Most copy threads beside each rank's proxy on the Shm fabric
/// (`ARX_SHM_COPY_THREADS`): past a few, a copy is bound by memory
/// bandwidth, not by threads (the default is at most 3).
pub const MAX_SHM_COPY_THREADS: u32 = 15;

/// Resolved settings of one instance.
#[derive(Debug, Clone)]
pub struct Config {
    /// Device side.
    pub device: DeviceKind,
    /// Fabric.
    pub fabric: FabricKind,
    /// Capacity of one partial in bytes (`ARX_SLOT_BYTES`).
    pub slot_bytes: usize,
    /// Bound on every wait of a call, of [`crate::Arx::barrier`] and of the
    /// collective close at drop (`ARX_TIMEOUT_MS`).
    pub timeout: Duration,
    /// Bound on each collective step of start-up: the duplicate of the
    /// communicator, the exchange of settings and descriptions, the fabric's
    /// connection and the start-up barrier (`ARX_INIT_TIMEOUT_MS`).
    pub init_timeout: Duration,
    /// After this long without progress the proxy logs every peer's flags
    /// (`ARX_STALL_WARN_MS`).
    pub stall_warn: Duration,
    /// CPU spin policy (`ARX_SPIN`).
    pub spin: SpinMode,
    /// Hot polls before yielding (`ARX_SPIN_HOT`). Unset: chosen at start-up
    /// (few when the node's ranks and proxies outnumber its cores, many
    /// otherwise).
    pub spin_hot: Option<u32>,
    /// Threads that copy beside the proxy on the Shm fabric, for posts of
    /// 64 KiB and more (`ARX_SHM_COPY_THREADS`). Unset: chosen at start-up
    /// from the cores each rank of the node has.
    pub shm_copy_threads: Option<u32>,
    /// GPU send-slot staging (`ARX_STAGING`).
    pub staging: Staging,
    /// All-reduce algorithm (`ARX_ALGO`): every rank must choose alike
    /// (checked at start-up, [`crate::Error::Mismatch`] naming the first
    /// rank that differs; a call whose flags show another algorithm still
    /// fails at once, [`crate::Error::CallMismatch`]).
    pub algo: Algo,
    /// RDMA devices for lane 0 and lane 1 (`ARX_DEVICES=dev0,dev1`).
    pub devices: Option<Vec<String>>,
    /// RoCE GID index for every device (`ARX_GID_INDEX`).
    pub gid_index: Option<u32>,
    /// CPU for the proxy thread (`ARX_PROXY_CPU`).
    pub proxy_cpu: Option<usize>,
    /// CUDA device ordinal of the GPU device side (`ARX_CUDA_DEVICE`);
    /// `None`: the rank's index among the ranks of its node, modulo the
    /// number of visible devices.
    pub cuda_device: Option<usize>,
    /// Most blocks of one GPU launch (`ARX_GPU_BLOCKS`); `None`: chosen from
    /// the SM count and the ranks sharing the GPU.
    pub gpu_blocks: Option<u32>,
    /// 16-byte vectors per thread per work chunk of the GPU kernel
    /// (`ARX_GPU_UNROLL`); `None`: chosen by size.
    pub gpu_unroll: Option<u32>,
    /// Directory of the GPU kernels' CUBIN cache (`ARX_KERNEL_CACHE`, a
    /// directory or `off`; environment only); `None`: no cache. Default:
    /// `$XDG_CACHE_HOME/arx/kernels`, else `$HOME/.cache/arx/kernels`.
    pub kernel_cache: Option<std::path::PathBuf>,
    /// Test hook (`Builder::test_sum_delay`, no environment variable): a
    /// pause before each pipelined chunk's sum on the host side, and before
    /// every one-shot sum on the GPU side (each block, after its wait), so
    /// that tests can make this rank the slow one. Not exchanged with peers.
    pub sum_delay: Option<Duration>,
    /// How long a host call's flag word that would fail the call must keep
    /// one value before it is believed (`spin::settle`; 10 ms).
    /// Only unit tests change it (no builder method, no environment
    /// variable).
    pub settle: Duration,
}

/// Options the builder sets explicitly (each overrides its environment variable).
#[derive(Debug, Clone, Default)]
pub(crate) struct Overrides {
    pub device: Option<DeviceKind>,
    pub fabric: Option<FabricKind>,
    pub slot_bytes: Option<usize>,
    pub timeout: Option<Duration>,
    pub init_timeout: Option<Duration>,
    pub stall_warn: Option<Duration>,
    pub spin: Option<SpinMode>,
    pub staging: Option<Staging>,
    pub algo: Option<Algo>,
    pub devices: Option<Vec<String>>,
    pub gid_index: Option<u32>,
    pub proxy_cpu: Option<usize>,
    pub cuda_device: Option<usize>,
    /// A binding's own refusal of an option (`Builder::refuse`).
    pub refused: Option<Error>,
    /// A binding's names for the builder's options (`Builder::names`).
    pub names: Option<fn(&'static str) -> &'static str>,
    /// `Builder::test_sum_delay`.
    pub sum_delay: Option<Duration>,
    /// `Config::settle` (unit tests only).
    pub settle: Option<Duration>,
}

/// The node's online CPUs (at least 1), if the system says.
pub(crate) fn online_cpus() -> Option<usize> {
    // SAFETY: sysconf reads a system value; no pointer is involved.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).ok().map(|n| n.max(1))
}

/// [`Config::copy_threads`]'s default for a rank that may run on `mine`
/// CPUs, on a node of `online` CPUs and `local_ranks` ranks.
pub(crate) fn default_copy_threads(mine: usize, online: usize, local_ranks: usize) -> usize {
    let cores = mine.min(online / local_ranks.max(1));
    (cores / 2).saturating_sub(1).min(3)
}

static LOGGED: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// Logs `name=value` the first time this process uses it.
fn log_once(name: &str, value: &str) {
    let mut g = LOGGED.lock().unwrap_or_else(|e| e.into_inner());
    if g.get_or_insert_with(HashSet::new)
        .insert(format!("{name}={value}"))
    {
        log::info!("arx: {name}={value} (from the environment)");
    }
}

/// Reads one variable through `get` (the environment, or a map in tests).
fn env_var<T, F>(
    get: &F,
    name: &'static str,
    parse: impl Fn(&str) -> Result<T>,
) -> Result<Option<T>>
where
    F: Fn(&str) -> Option<String>,
{
    match get(name) {
        None => Ok(None),
        Some(v) if v.trim().is_empty() => Ok(None),
        Some(v) => {
            let t = parse(v.trim())?;
            log_once(name, v.trim());
            Ok(Some(t))
        }
    }
}

fn number<T: FromStr>(name: &'static str) -> impl Fn(&str) -> Result<T> {
    move |s: &str| {
        s.parse::<T>().map_err(|_| {
            // Digits only, yet not parsed: past the type's range.
            let digits = !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
            Error::Config {
                name,
                value: s.into(),
                reason: if digits {
                    "too large".into()
                } else {
                    "expected a non-negative integer".into()
                },
            }
        })
    }
}

fn milliseconds(name: &'static str) -> impl Fn(&str) -> Result<Duration> {
    move |s: &str| number::<u64>(name)(s).map(Duration::from_millis)
}

// The one place where every knob's range is checked. The builder's value
// and the environment's go through the same function, each under its own
// name (`Builder::timeout` or `ARX_TIMEOUT_MS`), so that neither accepts
// what the other refuses.

/// A timeout-like duration: between [`MIN_TIMEOUT`] and [`MAX_TIMEOUT`].
fn check_duration(name: &'static str, d: Duration) -> Result<Duration> {
    if (MIN_TIMEOUT..=MAX_TIMEOUT).contains(&d) {
        Ok(d)
    } else {
        Err(Error::Config {
            name,
            value: format!("{d:?}"),
            reason: format!("must be between {MIN_TIMEOUT:?} and {MAX_TIMEOUT:?} (24 h)"),
        })
    }
}

/// An integer knob within `[min, max]`.
fn check_range<T: Copy + PartialOrd + std::fmt::Display>(
    name: &'static str,
    v: T,
    min: T,
    max: T,
) -> Result<T> {
    if v >= min && v <= max {
        Ok(v)
    } else {
        Err(Error::Config {
            name,
            value: v.to_string(),
            reason: format!("must be between {min} and {max}"),
        })
    }
}

/// A knob's value from the builder (checked under `builder_name`) or else
/// from its variable (parsed and checked under `var`).
fn knob<T, F: Fn(&str) -> Option<String>>(
    get: &F,
    explicit: Option<T>,
    builder_name: &'static str,
    var: &'static str,
    parse: impl Fn(&str) -> Result<T>,
    check: impl Fn(&'static str, T) -> Result<T>,
) -> Result<Option<T>> {
    match explicit {
        Some(v) => {
            // The variable is not used; a value it would refuse is most
            // likely a typo the user should hear about.
            if let Some(raw) = get(var).filter(|r| !r.trim().is_empty()) {
                if let Err(e) = parse(raw.trim()) {
                    log::warn!("arx: {var} is ignored ({builder_name} was given): {e}");
                }
            }
            check(builder_name, v).map(Some)
        }
        None => match env_var(get, var, parse)? {
            // A refused variable is shown as it was written.
            Some(v) => check(var, v).map(Some).map_err(|e| match e {
                Error::Config { name, reason, .. } => Error::Config {
                    name,
                    value: get(var).unwrap_or_default().trim().to_string(),
                    reason,
                },
                e => e,
            }),
            None => Ok(None),
        },
    }
}

/// `ARX_KERNEL_CACHE`: `off` (or `0`, `no`, `none`, `false`) turns the
/// cache off; anything else must be an absolute directory (the same one
/// whatever each rank's working directory; `~` and `$VAR` are not
/// expanded here).
fn kernel_cache_dir(v: &str) -> Result<Option<std::path::PathBuf>> {
    if ["off", "0", "no", "none", "false"]
        .iter()
        .any(|o| v.eq_ignore_ascii_case(o))
    {
        return Ok(None);
    }
    let p = std::path::PathBuf::from(v);
    if p.is_absolute() {
        Ok(Some(p))
    } else {
        Err(Error::Config {
            name: "ARX_KERNEL_CACHE",
            value: v.into(),
            reason: "must be an absolute directory or `off` (`~` and `$VAR` are not expanded)"
                .into(),
        })
    }
}

fn any<T>(_: &'static str, v: T) -> Result<T> {
    Ok(v)
}

/// Parses a byte size with an optional K/M/G suffix (powers of 1024).
pub fn parse_bytes(name: &'static str, s: &str) -> Result<usize> {
    let t = s.trim();
    let (num, mul) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let mul = match c.to_ascii_uppercase() {
                'K' => 1usize << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                _ => {
                    return Err(Error::Config {
                        name,
                        value: s.into(),
                        reason: "size suffix must be K, M or G".into(),
                    })
                }
            };
            (&t[..i], mul)
        }
        _ => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| Error::Config {
            name,
            value: s.into(),
            reason: "expected a byte count such as 65536, 64K or 1M".into(),
        })
}

impl Config {
    /// Hot polls before yielding, given how many ranks share this node.
    pub(crate) fn hot_rounds(&self, local_ranks: usize) -> u32 {
        if let Some(h) = self.spin_hot {
            return h;
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // Each rank runs two spinning threads (caller and proxy). When they
        // outnumber the cores, spinning only delays the thread that would
        // make progress: yield almost at once.
        if 2 * local_ranks > cores {
            64
        } else {
            20_000
        }
    }

    /// Copy threads beside the proxy on the Shm fabric, given how many
    /// ranks share this node: as set, or half of this rank's cores, less
    /// one, at most 3 (none where a rank has fewer than four cores of its
    /// own: the caller and the proxy already spin on two). A rank's cores:
    /// the fewer of the CPUs it may run on (its binding) and the node's
    /// online CPUs divided by its ranks.
    pub(crate) fn copy_threads(&self, local_ranks: usize) -> usize {
        if let Some(n) = self.shm_copy_threads {
            return n as usize;
        }
        let mine = std::thread::available_parallelism().map_or(1, |n| n.get());
        default_copy_threads(mine, online_cpus().unwrap_or(mine), local_ranks)
    }

    /// The settings from the `ARX_*` environment and defaults, as
    /// [`crate::Arx::new`] resolves them (for tools such as `doctor`).
    pub fn from_env() -> Result<Self> {
        Self::resolve(&Overrides::default())
    }

    /// Resolves the settings from builder overrides and the process environment.
    pub(crate) fn resolve(o: &Overrides) -> Result<Self> {
        Self::resolve_with(o, |k| std::env::var(k).ok())
    }

    /// As [`Config::resolve`], reading variables through `get`.
    pub(crate) fn resolve_with<F: Fn(&str) -> Option<String>>(
        o: &Overrides,
        get: F,
    ) -> Result<Self> {
        if let Some(e) = &o.refused {
            return Err(e.clone());
        }
        Self::resolve_options(o, get).map_err(|e| match (e, o.names) {
            (
                Error::Config {
                    name,
                    value,
                    reason,
                },
                Some(names),
            ) => Error::Config {
                name: names(name),
                value,
                reason,
            },
            (e, _) => e,
        })
    }

    fn resolve_options<F: Fn(&str) -> Option<String>>(o: &Overrides, get: F) -> Result<Self> {
        let device = knob(
            &get,
            o.device,
            "Builder::device",
            "ARX_DEVICE",
            str::parse,
            any,
        )?
        .unwrap_or(DeviceKind::Auto);
        let fabric = knob(
            &get,
            o.fabric,
            "Builder::fabric",
            "ARX_FABRIC",
            str::parse,
            any,
        )?
        .unwrap_or(FabricKind::Auto);
        let max_slot = crate::abi::ARX_MAX_COUNT as usize;
        let slot_bytes = knob(
            &get,
            o.slot_bytes,
            "Builder::slot_bytes",
            "ARX_SLOT_BYTES",
            |s| parse_bytes("ARX_SLOT_BYTES", s),
            |n, v| check_range(n, v, 1, max_slot),
        )?
        .unwrap_or(DEFAULT_SLOT_BYTES);
        let timeout = knob(
            &get,
            o.timeout,
            "Builder::timeout",
            "ARX_TIMEOUT_MS",
            milliseconds("ARX_TIMEOUT_MS"),
            check_duration,
        )?
        .unwrap_or(DEFAULT_TIMEOUT);
        let init_timeout = Self::init_timeout_with(o, &get)?;
        let stall_warn = knob(
            &get,
            o.stall_warn,
            "Builder::stall_warn",
            "ARX_STALL_WARN_MS",
            milliseconds("ARX_STALL_WARN_MS"),
            check_duration,
        )?
        .unwrap_or(Duration::from_secs(2).min(timeout / 2));
        let spin = knob(&get, o.spin, "Builder::spin", "ARX_SPIN", str::parse, any)?
            .unwrap_or(SpinMode::Adaptive);
        let spin_hot = knob(
            &get,
            None,
            "",
            "ARX_SPIN_HOT",
            number::<u32>("ARX_SPIN_HOT"),
            |n, v| check_range(n, v, 0, MAX_SPIN_HOT),
        )?;
        let shm_copy_threads = knob(
            &get,
            None,
            "",
            "ARX_SHM_COPY_THREADS",
            number::<u32>("ARX_SHM_COPY_THREADS"),
            |n, v| check_range(n, v, 0, MAX_SHM_COPY_THREADS),
        )?;
        let staging = knob(
            &get,
            o.staging,
            "Builder::staging",
            "ARX_STAGING",
            str::parse,
            any,
        )?
        .unwrap_or(Staging::Sm);
        let algo =
            knob(&get, o.algo, "Builder::algo", "ARX_ALGO", str::parse, any)?.unwrap_or_default();
        let devices = knob(
            &get,
            o.devices.clone(),
            "Builder::devices",
            "ARX_DEVICES",
            |s| {
                Ok(s.split(',')
                    .map(|d| d.trim().to_string())
                    .filter(|d| !d.is_empty())
                    .collect())
            },
            |name, v: Vec<String>| {
                if v.is_empty() || v.len() > 2 || v.iter().any(|d| d.trim().is_empty()) {
                    Err(Error::Config {
                        name,
                        value: v.join(","),
                        reason:
                            "expected one or two RDMA device names, e.g. rocep1s0f0,roceP2p1s0f0"
                                .into(),
                    })
                } else {
                    Ok(v)
                }
            },
        )?;
        let gid_index = knob(
            &get,
            o.gid_index,
            "Builder::gid_index",
            "ARX_GID_INDEX",
            number::<u32>("ARX_GID_INDEX"),
            any,
        )?;
        let proxy_cpu = knob(
            &get,
            o.proxy_cpu,
            "Builder::proxy_cpu",
            "ARX_PROXY_CPU",
            number::<usize>("ARX_PROXY_CPU"),
            any,
        )?;
        let cuda_device = knob(
            &get,
            o.cuda_device,
            "Builder::cuda_device",
            "ARX_CUDA_DEVICE",
            number::<usize>("ARX_CUDA_DEVICE"),
            any,
        )?;
        let gpu_blocks = knob(
            &get,
            None,
            "",
            "ARX_GPU_BLOCKS",
            number::<u32>("ARX_GPU_BLOCKS"),
            |n, v| check_range(n, v, 1, MAX_GPU_BLOCKS),
        )?;
        let gpu_unroll = knob(
            &get,
            None,
            "",
            "ARX_GPU_UNROLL",
            number::<u32>("ARX_GPU_UNROLL"),
            |n, v| check_range(n, v, 1, MAX_GPU_UNROLL),
        )?;
        let kernel_cache = match env_var(&get, "ARX_KERNEL_CACHE", kernel_cache_dir)? {
            Some(v) => v,
            None => crate::device::default_cache_dir(&get),
        };
        Ok(Config {
            device,
            fabric,
            slot_bytes,
            timeout,
            init_timeout,
            stall_warn,
            spin,
            spin_hot,
            shm_copy_threads,
            staging,
            algo,
            devices,
            gid_index,
            proxy_cpu,
            cuda_device,
            gpu_blocks,
            gpu_unroll,
            kernel_cache,
            sum_delay: o.sum_delay,
            settle: o.settle.unwrap_or(crate::spin::SETTLE),
        })
    }

    fn init_timeout_with<F: Fn(&str) -> Option<String>>(
        o: &Overrides,
        get: &F,
    ) -> Result<Duration> {
        Ok(knob(
            get,
            o.init_timeout,
            "Builder::init_timeout",
            "ARX_INIT_TIMEOUT_MS",
            milliseconds("ARX_INIT_TIMEOUT_MS"),
            check_duration,
        )?
        .unwrap_or(DEFAULT_INIT_TIMEOUT))
    }

    /// The start-up bound alone, for a rank whose other settings were
    /// refused: it still takes part in the exchange of settings (so that
    /// its peers fail at once, naming it), bounded by its own start-up
    /// timeout if that one is valid, else by the default.
    pub(crate) fn init_timeout_or_default(o: &Overrides) -> Duration {
        Self::init_timeout_with(o, &|k: &str| std::env::var(k).ok()).unwrap_or(DEFAULT_INIT_TIMEOUT)
    }
}

#[cfg(test)]
mod tests;
