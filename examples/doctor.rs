//! `doctor`: what arx finds on this node, what it chooses and why, then a
//! short validated all-reduce with its time. Exits non-zero, saying what to
//! fix, on any problem. Run it on every node of a job:
//!
//! ```sh
//! mpirun -n 2 -H spark1:1,spark2:1 target/release/examples/doctor
//! ```
//!
//! Each rank prints its own report, every line prefixed `[rank r]`. What it
//! shows comes from the library itself: the topology report
//! (`arx::topology::report`: devices, PCIe links, ports, GIDs, MTU, the lane
//! choice), this rank's proxy core (`arx::topology::select_from` for its
//! place on the node), what libibverbs lists, the locked-memory limit judged
//! by `arx::topology::check_memlock`, the GPU probe `arx::gpu_available` and,
//! per device, `arx::gpu_platform` (integrated or not, and what arx chose), and
//! calls checked against the independent reference of `arx::verify`.
//!
//! On the Verbs fabric it then prints the route to every peer (from the
//! fabric's own description) and measures every rail with
//! `Arx::probe_rails` (`--no-probe` skips it): per peer, rail and lane, the
//! one-way latency of an 8 B and an 8 KiB RDMA write (half the median and
//! p99 round trip of a ping-pong over exactly that queue pair, as
//! `ib_write_lat`) and the bandwidth of back-to-back writes (as
//! `ib_write_bw`), then the all-reduce's own median time at 8 B and 8 KiB
//! next to them, so one sees at once whether arx is near the wire:
//!
//! ```text
//! rail to rank 1 0/0: rxe0 -> rxe0: 8 B one-way 95.4 µs (p99 1788.3), 8 KiB 629.5 µs, 0.020 GB/s
//! all-reduce, 2 ranks, median: 8 B 4292.6 µs, 8 KiB 14809.1 µs (host buffers)
//! ```
//!
//! (soft-RoCE under qemu emulation in CI's VM: the format, not the speed;
//! see docs/BENCHMARKS.md, "Rails vs the collective"). The probe is
//! collective, needs no call in flight, and lands its data in the peers'
//! receive slots (see `arx::probe`).
//!
//! Lines starting `warning:` flag what costs speed but works (a path MTU
//! below 4096, a rail whose two lanes share one device, a PCIe link
//! trained narrower than it can be); they are counted apart from problems
//! and do not fail the run. A GID index that differs between ranks is a
//! `note:` only: arx resolves the GID per device.

use std::fmt::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use arx::topology::{self, HwlocSource, LocalRank, ThreadCpus};
use arx::{verify, Arx, Config, Element, FabricKind};
use clap::{Parser, ValueEnum};
use half::{bf16, f16};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

#[derive(Parser, Debug, Clone)]
#[command(about = "Checks what arx needs on this node and runs a validated all-reduce")]
struct Args {
    /// Elements per all-reduce (capped at what one slot holds).
    #[arg(long, default_value_t = 65536)]
    count: usize,
    /// Element type.
    #[arg(long, value_enum, default_value_t = DtypeArg::Bf16)]
    dtype: DtypeArg,
    /// Validated calls to run.
    #[arg(long, default_value_t = 4)]
    iters: usize,
    /// Base seed of the per-rank random inputs.
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// Only report; skip the all-reduce.
    #[arg(long)]
    no_allreduce: bool,
    /// Skip the rail probe (Verbs fabric only).
    #[arg(long)]
    no_probe: bool,
    /// Timed round trips per size and lane of the rail probe.
    #[arg(long, default_value_t = 1000)]
    probe_iters: usize,
    /// Bytes per bandwidth write of the probe (0: the slot, at most 1 MiB).
    #[arg(long, default_value_t = 0)]
    probe_bw_bytes: usize,
    /// Writes per bandwidth run of the probe.
    #[arg(long, default_value_t = 32)]
    probe_writes: usize,
}

#[derive(ValueEnum, Debug, Clone, Copy)]
enum DtypeArg {
    F32,
    Bf16,
    F16,
}

impl std::fmt::Display for DtypeArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DtypeArg::F32 => "f32",
            DtypeArg::Bf16 => "bf16",
            DtypeArg::F16 => "f16",
        })
    }
}

/// The report of one rank: lines, and problems with what to do about them.
#[derive(Default)]
struct Report {
    text: String,
    problems: Vec<String>,
    warnings: usize,
}

impl Report {
    fn line(&mut self, s: impl AsRef<str>) {
        let _ = writeln!(self.text, "{}", s.as_ref());
    }
    fn problem(&mut self, s: impl Into<String>) {
        let s = s.into();
        self.line(format!("  PROBLEM: {s}"));
        self.problems.push(s);
    }
    /// Costs speed, works: counted apart, does not fail the run.
    fn warning(&mut self, s: impl AsRef<str>) {
        self.line(format!("warning: {}", s.as_ref()));
        self.warnings += 1;
    }
}

fn bytes(b: u64) -> String {
    match b {
        u64::MAX => "unlimited".into(),
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b => format!("{} KiB", b >> 10),
    }
}

/// This rank's place on its node, learnt from the ranks sharing the node
/// (and its memory). Main threads bound to one CPU each are left to them,
/// as arx does when it picks proxy cores.
fn local_rank(world: &SimpleCommunicator, rank: usize) -> LocalRank {
    let node = world.split_shared(rank as i32);
    let sole = ThreadCpus::of_current_thread()
        .sole_cpu()
        .map_or(u64::MAX, |c| c as u64);
    let mut mains = vec![0u64; node.size() as usize];
    node.all_gather_into(&sole, &mut mains[..]);
    LocalRank {
        index: node.rank() as usize,
        count: node.size() as usize,
        main_cpus: mains
            .iter()
            .filter(|&&c| c != u64::MAX)
            .map(|&c| c as usize)
            .collect(),
        // The report's own process has no live instance.
        claimed_cpus: Vec::new(),
    }
}

/// The lanes' port states and this rank's proxy core (it depends on the
/// rank's place on its node, which the topology report cannot know).
/// Returns whether lanes were found, and the selection error, if any (a
/// problem only where the job uses the Verbs fabric).
fn this_rank(r: &mut Report, cfg: &Config, local: &LocalRank) -> (bool, Option<String>) {
    let disc = match topology::discover_in(Path::new("/"), HwlocSource::Live) {
        Ok(d) => d,
        Err(e) => return (false, Some(format!("RDMA discovery failed: {e}"))),
    };
    let sel = match topology::select_from(&disc, cfg, &ThreadCpus::of_current_thread(), local) {
        Ok(s) => s,
        Err(e) => {
            return (
                false,
                Some(format!(
                    "RDMA device selection failed: {e} (set ARX_DEVICES=dev0,dev1 and ARX_GID_INDEX to override)"
                )),
            )
        }
    };
    for (l, d) in sel.lanes.iter().enumerate() {
        let port = disc
            .devices
            .iter()
            .find(|x| x.name == d.name)
            .and_then(|x| x.ports.iter().find(|p| p.port == d.port));
        match port {
            Some(p) if p.is_active() => {}
            Some(p) => r.problem(format!(
                "lane {l} device {} port {} is {} / {}: bring the link up (cable, switch port, `ip link set {} up`)",
                d.name, d.port, p.state, p.phys_state, d.netdev
            )),
            None => r.problem(format!(
                "lane {l} device {} port {} is not among the discovered ports",
                d.name, d.port
            )),
        }
    }
    if sel.lanes.len() == 2 && sel.lanes[0].root == sel.lanes[1].root {
        r.line("note: both lanes share one PCIe root (about half the bandwidth of a Spark)");
    }
    r.line(format!(
        "proxy core: {}, for local rank {} of {} on this node",
        sel.proxy_cpu
            .map_or("not pinned".to_string(), |c| format!("CPU {c}")),
        local.index,
        local.count
    ));
    if let Some(why) = sel.notes.iter().find(|n| n.starts_with("proxy CPU")) {
        r.line(format!("  because: {why}"));
    }
    // A narrow PCIe link (a Spark's second root at x2 on old firmware),
    // lane MTUs that differ, ...: shown among the topology notes, counted
    // here.
    for w in sel.warnings() {
        r.warning(w.trim_start_matches("warning: "));
    }
    (!sel.single_device(), None)
}

/// What libibverbs lists (sysfs may show devices it cannot open).
fn libibverbs(r: &mut Report, verbs: bool) {
    match topology::ibv_devices() {
        Ok(names) if !names.is_empty() => {
            r.line(format!("libibverbs lists: {}", names.join(", ")))
        }
        Ok(_) if verbs => r.problem(
            "libibverbs lists no RDMA device: install the NIC's user-space provider (rdma-core / ibverbs-providers) and, in a container, pass /dev/infiniband",
        ),
        Ok(_) => r.line("libibverbs lists no RDMA device (the shm fabric needs none)"),
        Err(e) if verbs => r.problem(format!("{e}")),
        Err(e) => r.line(format!("libibverbs: {e} (the shm fabric needs none)")),
    }
}

/// The locked-memory limit, judged by arx's own check against what this
/// job's instance will register (per lane device) on the Verbs fabric.
fn memlock(r: &mut Report, cfg: &Config, world: usize, devices: usize, verbs: bool) {
    let limits = match topology::memlock_limits() {
        Ok((soft, hard)) => format!("soft {}, hard {}", bytes(soft), bytes(hard)),
        Err(e) => {
            r.problem(format!("{e}"));
            return;
        }
    };
    if !verbs {
        r.line(format!(
            "locked memory (RLIMIT_MEMLOCK): {limits}; the shm fabric registers nothing"
        ));
        return;
    }
    let needed = topology::memlock_needed(cfg.slot_bytes, world).saturating_mul(devices.max(1));
    r.line(format!(
        "locked memory (RLIMIT_MEMLOCK): {limits}; this job registers about {} a rank",
        bytes(needed as u64)
    ));
    if let Err(e) = topology::check_memlock(needed) {
        r.problem(format!("{e}"));
    }
}

/// CUDA: arx's own probe (libcuda and libnvrtc loadable, a device visible),
/// then what each device is.
fn cuda(r: &mut Report, cfg: Option<&Config>) {
    use arx::cudarc::driver::{result, sys};
    let n = match arx::gpu_available() {
        Ok(n) => n,
        Err(e) => {
            r.line(format!("CUDA: {e} (the host device side works)"));
            return;
        }
    };
    let mut version = 0;
    // SAFETY: libcuda is loaded and initialised (gpu_available); the call
    // writes one int.
    let _ = unsafe { sys::cuDriverGetVersion(&mut version) };
    r.line(format!(
        "CUDA: driver API {}.{}, {n} device(s)",
        version / 1000,
        (version % 1000) / 10
    ));
    for i in 0..n as i32 {
        let Ok(d) = result::device::get(i) else {
            continue;
        };
        let attr = |a| {
            // SAFETY: `d` is a valid device handle of an initialised driver.
            unsafe { result::device::get_attribute(d, a) }.unwrap_or(-1)
        };
        use sys::CUdevice_attribute::*;
        r.line(format!(
            "  device {i}: {}, compute capability {}.{}, {} SMs",
            result::device::get_name(d).unwrap_or_default(),
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
            attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        ));
        // Integrated or not, and what the GPU side chooses for it (decided
        // from the device's attributes, as an instance does at start-up).
        match arx::gpu_platform(i as usize) {
            Ok(p) => r.line(format!("  {p}")),
            Err(e) => r.problem(format!("device {i}: {e}")),
        }
    }
    // Where compiled kernels are kept (NVRTC takes seconds per process
    // without them); the instance's `info` log says whether it compiled or
    // loaded them.
    match cfg.map(|c| c.kernel_cache.as_deref()) {
        Some(Some(d)) => {
            let files = std::fs::read_dir(d)
                .map(|it| {
                    it.flatten()
                        .filter(|e| {
                            let n = e.file_name();
                            let n = n.to_string_lossy();
                            n.starts_with("arx-") && n.ends_with(".cubin")
                        })
                        .count()
                })
                .unwrap_or(0);
            r.line(format!(
                "  kernel cache: {} ({files} compiled kernel file(s); ARX_KERNEL_CACHE)",
                d.display()
            ));
        }
        Some(None) => r.line(
            "  kernel cache: none (ARX_KERNEL_CACHE off, or no absolute HOME / XDG_CACHE_HOME): every process compiles the kernels",
        ),
        None => {}
    }
}

/// What the validated calls found on this rank.
struct Outcome {
    /// Device side and fabric.
    desc: String,
    fabric: &'static str,
    count: usize,
    setup: Duration,
    /// Each call's time.
    times: Vec<Duration>,
    /// Wrong elements over all calls, and the first one's description.
    wrong: usize,
    first_wrong: Option<String>,
    /// Digest of every call's result, folded.
    digest: u64,
    /// The rail probe (None: not run) and the all-reduce's median time
    /// per probed size, with its wrong elements.
    probe: Option<Result<Vec<arx::RailProbe>, String>>,
    coll: Vec<(usize, Duration, usize)>,
}

/// Runs `iters` calls on seeded inputs (`arx::verify::input`, call numbers
/// 1, 2, …), each output poisoned first and checked bit for bit against
/// `arx::verify::expected`; times each call from a common start.
fn run_calls<T: Element>(arx: &mut Arx, args: &Args, count: usize) -> arx::Result<Outcome> {
    let (me, world) = (arx.rank(), arx.world());
    let count = count.min(arx.max_count::<T>());
    let mut out = vec![T::from_f32(0.0); count];
    let mut o = Outcome {
        desc: String::new(),
        fabric: "",
        count,
        setup: Duration::ZERO,
        times: Vec::new(),
        wrong: 0,
        first_wrong: None,
        digest: 0,
        probe: None,
        coll: Vec::new(),
    };
    for call in 1..=args.iters as u64 {
        let input = verify::input::<T>(args.seed, call, me, count);
        let want = verify::expected::<T>(args.seed, call, world, count);
        verify::poison(&mut out);
        // Start together, so that a call's time is not a peer's reference
        // computation (the barrier is arx's, bounded by the call timeout).
        arx.barrier()?;
        let t = Instant::now();
        arx.allreduce_host(&input, &mut out)?;
        o.times.push(t.elapsed());
        let wrong = verify::count_wrong(&out, &want);
        if wrong > 0 && o.first_wrong.is_none() {
            let i = verify::first_wrong(&out, &want).unwrap_or(0);
            o.first_wrong = Some(format!(
                "call {call}, element {i}: got {} want {}",
                verify::value_of(&out[i]),
                verify::value_of(&want[i])
            ));
        }
        o.wrong += wrong;
        o.digest = o.digest.rotate_left(7) ^ verify::digest(&out);
    }
    Ok(o)
}

fn allreduce(world: &SimpleCommunicator, args: &Args) -> arx::Result<Outcome> {
    let t = Instant::now();
    let mut arx = Arx::new(world)?;
    let setup = t.elapsed();
    let mut o = match args.dtype {
        DtypeArg::F32 => run_calls::<f32>(&mut arx, args, args.count)?,
        DtypeArg::Bf16 => run_calls::<bf16>(&mut arx, args, args.count)?,
        DtypeArg::F16 => run_calls::<f16>(&mut arx, args, args.count)?,
    };
    let d = arx.describe();
    if d.fabric == "verbs" && !args.no_probe {
        probe(&mut arx, args, &mut o);
    }
    o.desc = format!(
        "{} device side, {} fabric: {}",
        d.device, d.fabric, d.fabric_detail
    );
    o.fabric = d.fabric;
    o.setup = setup;
    Ok(o)
}

/// Probe sizes: 8 B and 8 KiB (what fits the slot).
fn probe_sizes(arx: &Arx) -> Vec<usize> {
    let slot = arx.describe().slot_bytes;
    [8, 8192].into_iter().filter(|&s| s <= slot).collect()
}

/// The rail probe, then the all-reduce's median time at the probed sizes
/// (f32, back to back, each output checked).
fn probe(arx: &mut Arx, args: &Args, o: &mut Outcome) {
    let opts = arx::ProbeOptions {
        sizes: probe_sizes(arx),
        iters: args.probe_iters.max(1),
        warmup: (args.probe_iters / 10).max(1),
        bw_bytes: args.probe_bw_bytes,
        writes: args.probe_writes.max(1),
        ..Default::default()
    };
    o.probe = Some(arx.probe_rails(&opts).map_err(|e| e.to_string()));
    if !matches!(o.probe, Some(Ok(_))) {
        return;
    }
    let (me, world) = (arx.rank(), arx.world());
    let iters = args.probe_iters.clamp(10, 200);
    for bytes in opts.sizes {
        let count = (bytes / 4).max(1);
        let mut times = Vec::with_capacity(iters);
        let mut out = vec![0.0f32; count];
        let mut wrong = 0;
        for call in 0..iters as u64 + 5 {
            let input = verify::input::<f32>(args.seed ^ 0x9e37, call, me, count);
            let want = verify::expected::<f32>(args.seed ^ 0x9e37, call, world, count);
            verify::poison(&mut out);
            let t = Instant::now();
            if let Err(e) = arx.allreduce_host(&input, &mut out) {
                o.probe = Some(Err(format!("all-reduce of {bytes} B after the probe: {e}")));
                return;
            }
            if call >= 5 {
                times.push(t.elapsed());
            }
            wrong += verify::count_wrong(&out, &want);
        }
        times.sort();
        o.coll.push((bytes, times[times.len() / 2], wrong));
    }
}

fn size(b: usize) -> String {
    if b >= 1024 && b % 1024 == 0 {
        format!("{} KiB", b / 1024)
    } else {
        format!("{b} B")
    }
}

fn micros(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e6)
}

/// One line per rail and lane, the all-reduce's time next to them, and
/// the pain points the probe shows.
fn print_probe(r: &mut Report, o: &Outcome, n: usize) {
    let rails = match &o.probe {
        None => return,
        Some(Err(e)) => {
            r.problem(format!("rail probe failed: {e}"));
            return;
        }
        Some(Ok(p)) => p,
    };
    for p in rails {
        if let Some(via) = p.relayed_by {
            r.line(format!(
                "rail to rank {}: none, relayed by rank {via} (no direct link; not probed)",
                p.peer
            ));
            continue;
        }
        let mut t = format!(
            "rail to rank {} {}/{}: {} -> {}:",
            p.peer, p.rail, p.lane, p.device, p.peer_device
        );
        for (k, l) in p.latency.iter().enumerate() {
            let sep = if k == 0 { " " } else { ", " };
            let _ = write!(t, "{sep}{} ", size(l.bytes));
            if k == 0 {
                let _ = write!(t, "one-way {} µs (p99 {})", micros(l.median), micros(l.p99));
            } else {
                let _ = write!(t, "{} µs", micros(l.median));
            }
        }
        if let Some(b) = &p.bandwidth {
            let _ = write!(t, ", {:.3} GB/s", b.gbps);
        }
        r.line(t);
    }
    if !o.coll.is_empty() {
        let times: Vec<String> = o
            .coll
            .iter()
            .map(|(b, t, _)| format!("{} {} µs", size(*b), micros(*t)))
            .collect();
        r.line(format!(
            "all-reduce, {n} ranks, median: {} (host buffers)",
            times.join(", ")
        ));
        for (b, _, wrong) in &o.coll {
            if *wrong > 0 {
                r.problem(format!(
                    "all-reduce of {} after the probe: {wrong} wrong elements: a bug; report this output",
                    size(*b)
                ));
            }
        }
    }
    // Pain points, once per rail (both lanes) or lane.
    for p in rails.iter().filter(|p| p.relayed_by.is_none()) {
        if p.path_mtu < 4096 {
            r.warning(format!(
                "rail to rank {} {}/{}: path MTU {} (a netdev MTU of 1500 gives RoCE 1024): set the netdev MTU to 4200 on every node",
                p.peer, p.rail, p.lane, p.path_mtu
            ));
        }
        if p.lane == 0 {
            if let Some(l1) = rails
                .iter()
                .find(|x| x.peer == p.peer && x.rail == p.rail && x.lane == 1)
            {
                if l1.device == p.device || l1.peer_device == p.peer_device {
                    r.warning(format!(
                        "rail to rank {} {}: both lanes share one device ({} -> {}): about half the bandwidth; give both PCIe functions of the port an address in the link's subnet (on both nodes)",
                        p.peer, p.rail, p.device, p.peer_device
                    ));
                }
            }
        }
        if p.gid_index != p.peer_gid_index {
            r.line(format!(
                "note: rail to rank {} {}/{}: GID index {} here, {} on rank {} ({}): fine, arx resolves the GID per device",
                p.peer, p.rail, p.lane, p.gid_index, p.peer_gid_index, p.peer, p.peer_device
            ));
        }
    }
}

fn us(d: Duration) -> String {
    format!("{:.1} us", d.as_secs_f64() * 1e6)
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = Args::parse();
    let Some(universe) = mpi::initialize() else {
        eprintln!("doctor: MPI was already initialised");
        return ExitCode::FAILURE;
    };
    let world = universe.world();
    let rank = world.rank() as usize;
    let n = world.size() as usize;
    let mut r = Report::default();
    let host = mpi::environment::processor_name().unwrap_or_default();
    r.line(format!("arx doctor, rank {rank} of {n} on {host}"));
    r.line(format!(
        "MPI: {}",
        mpi::environment::library_version()
            .unwrap_or_default()
            .trim_end_matches('\0')
            .lines()
            .next()
            .unwrap_or("?")
    ));
    let local = local_rank(&world, rank);
    let cfg = match Config::from_env() {
        Ok(c) => {
            r.line(format!(
                "settings: device {:?}, fabric {:?}, slot {} bytes, timeout {:?}, devices {:?}, GID index {:?}",
                c.device, c.fabric, c.slot_bytes, c.timeout, c.devices, c.gid_index
            ));
            Some(c)
        }
        Err(e) => {
            r.problem(format!("{e}"));
            None
        }
    };
    // As arx decides at start-up: shm when every rank shares this node.
    let mut verbs = match cfg.as_ref().map(|c| c.fabric) {
        Some(FabricKind::Shm) => false,
        Some(FabricKind::Verbs) => true,
        _ => local.count < n,
    };
    r.line(format!(
        "node: {} of this job's {n} rank(s) here; fabric: {}",
        local.count,
        if verbs {
            "verbs (RDMA)"
        } else {
            "shm (every rank on this node)"
        }
    ));
    for l in topology::report().lines() {
        r.line(format!("topology: {l}"));
    }
    libibverbs(&mut r, verbs);
    let mut select_err = None;
    if let Some(c) = &cfg {
        let (two, err) = this_rank(&mut r, c, &local);
        select_err = err;
        memlock(&mut r, c, n, if two { 2 } else { 1 }, verbs);
    }
    cuda(&mut r, cfg.as_ref());

    if !args.no_allreduce {
        // The instance is dropped inside, on every rank, before the
        // collective below (its close is collective on the Verbs fabric).
        let outcome = allreduce(&world, &args);
        let mut mine = [0u64; 2];
        if let Ok(o) = &outcome {
            mine = [1, o.digest];
        }
        let mut all = vec![0u64; 2 * n];
        world.all_gather_into(&mine[..], &mut all[..]);
        match outcome {
            Ok(o) => {
                // What arx chose, where it differs from the guess above.
                verbs = o.fabric == "verbs";
                r.line(format!("arx: {}", o.desc));
                print_probe(&mut r, &o, n);
                r.line(format!(
                    "  set-up took {:.1} ms",
                    o.setup.as_secs_f64() * 1e3
                ));
                let calls = format!(
                    "{} calls of {} x {} over {n} ranks",
                    args.iters, o.count, args.dtype
                );
                if o.wrong == 0 {
                    r.line(format!("all-reduce: {calls}: every element correct"));
                } else {
                    r.problem(format!(
                        "all-reduce: {} wrong elements in {calls} (first: {}): a bug; report this output",
                        o.wrong,
                        o.first_wrong.unwrap_or_default()
                    ));
                }
                let done: Vec<u64> = all.chunks(2).filter(|c| c[0] == 1).map(|c| c[1]).collect();
                if done.len() < n {
                    r.line(format!(
                        "  {} rank(s) did not finish their calls (see their reports)",
                        n - done.len()
                    ));
                } else if done.iter().all(|&d| d == o.digest) {
                    r.line("  every rank holds the same bits");
                } else {
                    r.problem("the ranks' results differ in their bits: a bug; report this output");
                }
                if let Some(first) = o.times.first() {
                    let mut rest = o.times[1..].to_vec();
                    rest.sort();
                    let mut t = format!("  time per call: first {}", us(*first));
                    if !rest.is_empty() {
                        let _ = write!(
                            t,
                            ", then median {}, best {}",
                            us(rest[rest.len() / 2]),
                            us(rest[0])
                        );
                    }
                    r.line(format!(
                        "{t} (host buffers; allreduce_perf measures properly)"
                    ));
                }
            }
            Err(e) => r.problem(format!("all-reduce failed: {e}")),
        }
    }

    match select_err {
        Some(e) if verbs => r.problem(e),
        Some(_) => r.line("note: no RDMA lanes, which the shm fabric does not need"),
        None => {}
    }
    let warnings = match r.warnings {
        0 => String::new(),
        w => format!(" ({w} warning(s): see the lines starting `warning:`)"),
    };
    if r.problems.is_empty() {
        r.line(format!("doctor: no problem found{warnings}"));
    } else {
        r.line(format!(
            "doctor: {} problem(s); fix them as described above{warnings}",
            r.problems.len()
        ));
    }
    let prefixed: String = r
        .text
        .lines()
        .map(|l| format!("[rank {rank}] {l}\n"))
        .collect();
    print!("{prefixed}");
    if r.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
