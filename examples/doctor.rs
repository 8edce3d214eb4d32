//! `doctor`: what arx finds on this node, what it chooses and why, then a
//! short validated all-reduce. Exits non-zero, saying what to fix, on any
//! problem. Run it on every node of a job:
//!
//! ```sh
//! mpirun -n 2 -H spark1:1,spark2:1 target/release/examples/doctor
//! ```
//!
//! Each rank prints its own report, every line prefixed `[rank r]`.

use std::fmt::Write as _;
use std::path::Path;
use std::process::ExitCode;

use arx::topology::{LocalRank, ThreadCpus};
use arx::{Arx, Config, Element};
use clap::Parser;
use half::{bf16, f16};
use mpi::traits::*;
use rand::{Rng, SeedableRng};

#[derive(Parser, Debug, Clone)]
#[command(about = "Checks what arx needs on this node and runs a validated all-reduce")]
struct Args {
    /// Elements per all-reduce (capped at what one slot holds).
    #[arg(long, default_value_t = 65536)]
    count: usize,
    /// Element type: f32, bf16 or f16.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Validated calls to run.
    #[arg(long, default_value_t = 4)]
    iters: usize,
    /// Base seed of the per-rank random inputs.
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// Only report; skip the all-reduce.
    #[arg(long)]
    no_allreduce: bool,
    /// Fault drill (for CI): after one good call, this rank drops its
    /// instance; every other rank's next call must fail within the timeout.
    #[arg(long, hide = true)]
    fault_drill: Option<usize>,
    /// Fault drill (for CI): after one good call, this rank breaks its
    /// lane-0 queue pair to rank 0 (or to rank 1 if it is rank 0); within
    /// its next two calls it must fail with a verbs error, and every other
    /// rank must fail naming it (poisoned flags), quickly, not by a timeout.
    /// (A call whose inputs had all arrived before the failure was known
    /// returns its correct result; the failure comes with the next call.)
    #[arg(long, hide = true)]
    break_qp_drill: Option<usize>,
}

/// The drills' start: an instance and one checked call of `n` floats.
fn after_one_good_call(
    world: &mpi::topology::SimpleCommunicator,
    args: &Args,
) -> Result<(Arx, usize), String> {
    let mut arx = Arx::new(world).map_err(|e| format!("set-up failed: {e}"))?;
    let n = 4096usize.min(arx.max_count::<f32>());
    let one = Args {
        iters: 1,
        ..args.clone()
    };
    let wrong = check::<f32>(&mut arx, &one, n, f32::NAN)
        .map_err(|e| format!("the good call failed: {e}"))?;
    if wrong != 0 {
        return Err(format!("the good call had {wrong} wrong elements"));
    }
    Ok((arx, n))
}

/// The fault drill: one good call, then rank `leaver` drops its instance
/// (which closes collectively: it waits, bounded, for the others) and the
/// others call again. Passes when every other rank gets an error — a
/// timeout naming the leaver, or a fabric error — within the timeout (plus
/// slack for a slow machine), instead of hanging.
fn fault_drill(
    world: &mpi::topology::SimpleCommunicator,
    args: &Args,
    leaver: usize,
) -> Result<String, String> {
    let (mut arx, n) = after_one_good_call(world, args)?;
    let me = arx.rank();
    if me == leaver {
        drop(arx);
        return Ok("left after one good call".into());
    }
    let timeout = arx.config().timeout;
    let start = std::time::Instant::now();
    let input = vec![1.0f32; n];
    let mut out = vec![f32::NAN; n];
    match arx.allreduce_host(&input, &mut out) {
        Ok(()) => Err(format!("the call after rank {leaver} left succeeded")),
        Err(e) if start.elapsed() < timeout + std::time::Duration::from_secs(10) => Ok(format!(
            "failed within the bound as it should, after {:?} (timeout {timeout:?}): {e}",
            start.elapsed()
        )),
        Err(e) => Err(format!(
            "failed only after {:?} (timeout {timeout:?}): {e}",
            start.elapsed()
        )),
    }
}

/// The QP drill: one good call, then rank `breaker` puts one of its queue
/// pairs into the error state and every rank calls again.
fn break_qp_drill(
    world: &mpi::topology::SimpleCommunicator,
    args: &Args,
    breaker: usize,
) -> Result<String, String> {
    let (mut arx, n) = after_one_good_call(world, args)?;
    let me = arx.rank();
    let victim = if breaker == 0 { 1 } else { 0 };
    if me == breaker {
        arx.inject_fault(victim, 0)
            .map_err(|e| format!("could not break the QP: {e}"))?;
    }
    let timeout = arx.config().timeout;
    let start = std::time::Instant::now();
    let input = vec![1.0f32; n];
    let mut out = vec![f32::NAN; n];
    let mut r = arx.allreduce_host(&input, &mut out);
    if r.is_ok() {
        // A rank whose inputs had all arrived before the failure was known
        // holds a correct result for this call (the breaker: every peer's
        // partial came before its own failed send completed; another rank:
        // the breaker's sends to it went out before the broken one). The
        // failure must then come with its next call.
        r = arx.allreduce_host(&input, &mut out);
    }
    let took = start.elapsed();
    let fast = took < timeout / 2;
    match r {
        Ok(()) => Err("the calls after the QP broke succeeded".into()),
        Err(e @ arx::Error::Verbs { .. }) if me == breaker && fast => {
            Ok(format!("failed at once as it should, after {took:?}: {e}"))
        }
        Err(e @ arx::Error::CallMismatch { .. })
            if me != breaker && fast && e.to_string().contains("fabric failed") =>
        {
            Ok(format!(
                "told by rank {breaker} at once, after {took:?}: {e}"
            ))
        }
        Err(e) => Err(format!(
            "unexpected outcome after {took:?} (timeout {timeout:?}): {e}"
        )),
    }
}

/// The report of one rank: lines, and problems with what to do about them.
#[derive(Default)]
struct Report {
    text: String,
    problems: Vec<String>,
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
}

fn read(p: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// `Max locked memory` from /proc/self/limits, and whether CAP_IPC_LOCK
/// lifts it.
fn memlock(r: &mut Report) {
    let limits = read("/proc/self/limits").unwrap_or_default();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max locked memory"))
        .unwrap_or("Max locked memory ? ? bytes")
        .to_string();
    let soft = line.split_whitespace().nth(3).unwrap_or("?").to_string();
    let cap = read("/proc/self/status")
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|c| c & (1 << 14) != 0);
    r.line(format!(
        "locked memory (RLIMIT_MEMLOCK): {soft}{}",
        if cap {
            " (CAP_IPC_LOCK: not enforced)"
        } else {
            ""
        }
    ));
    if soft != "unlimited" && !cap {
        let bytes: u64 = soft.parse().unwrap_or(0);
        if bytes < 64 << 20 {
            r.problem(format!(
                "RLIMIT_MEMLOCK is {soft} bytes: registering the region can fail; run with `ulimit -l unlimited` (docker: --ulimit memlock=-1)"
            ));
        }
    }
}

/// CUDA driver and devices, without ever touching a missing libcuda.
fn cuda(r: &mut Report) {
    use cudarc::driver::{result, sys};
    // SAFETY: only tries to dlopen libcuda; no CUDA call is made.
    if !unsafe { sys::is_culib_present() } {
        r.line("CUDA: libcuda not found (the GPU device side is unavailable; the host side works)");
        return;
    }
    if let Err(e) = result::init() {
        r.line(format!(
            "CUDA: libcuda present but cuInit failed: {e} (no GPU, or the driver is not loaded)"
        ));
        return;
    }
    let mut version = 0;
    // SAFETY: writes one int.
    let _ = unsafe { sys::cuDriverGetVersion(&mut version) };
    let n = result::device::get_count().unwrap_or(0);
    r.line(format!(
        "CUDA: driver API {}.{}, {n} device(s)",
        version / 1000,
        (version % 1000) / 10
    ));
    for i in 0..n {
        if let Ok(d) = result::device::get(i) {
            r.line(format!(
                "  device {i}: {}",
                result::device::get_name(d).unwrap_or_default()
            ));
        }
    }
}

/// Prints the selection for this rank's place on its node (which decides
/// its proxy core); returns the selection error, if any (a problem unless
/// the job turns out to run on the shm fabric).
fn selection(r: &mut Report, cfg: &Config, local: &LocalRank) -> Option<String> {
    match arx::topology::select(cfg, local) {
        Ok(sel) => {
            r.line("chosen lanes:");
            for (l, d) in sel.lanes.iter().enumerate() {
                let state = read(format!(
                    "/sys/class/infiniband/{}/ports/{}/state",
                    d.name, d.port
                ))
                .unwrap_or_else(|| "?".into());
                r.line(format!(
                    "  lane {l}: {} port {} ({state}), root {}, PCI {}, netdev {}, GID[{}] {}, active MTU {}",
                    d.name,
                    d.port,
                    d.root,
                    d.pci.as_deref().unwrap_or("-"),
                    d.netdev,
                    d.gid_index,
                    std::net::Ipv6Addr::from(d.gid),
                    d.active_mtu
                ));
                if !state.contains("ACTIVE") {
                    r.problem(format!(
                        "lane {l} device {} port {} is {state}: bring the link up (cable, switch port, `ip link set <netdev> up`)",
                        d.name, d.port
                    ));
                }
            }
            if sel.lanes.len() == 2 && sel.lanes[0].root == sel.lanes[1].root {
                r.line(
                    "  note: both lanes share one PCIe root (about half the bandwidth of a Spark)",
                );
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
            for n in sel.notes.iter().filter(|n| !n.starts_with("proxy CPU")) {
                r.line(format!("  why: {n}"));
            }
            for w in sel.warnings() {
                r.line(format!("  {w}"));
            }
            None
        }
        Err(e) => {
            r.line(format!("chosen lanes: none: {e}"));
            Some(format!(
                "RDMA device selection failed: {e} (set ARX_DEVICES=dev0,dev1 and ARX_GID_INDEX to override)"
            ))
        }
    }
}

/// Rank `r`'s input of call `iter`: uniform in [-1, 1), rounded to `T`.
fn input<T: Element>(seed: u64, r: usize, iter: usize, n: usize) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(
        seed ^ (r as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((iter as u64) << 48),
    );
    (0..n)
        .map(|_| T::from_f32(rng.gen_range(-1.0f32..1.0)))
        .collect()
}

/// Runs `iters` validated calls; returns the number of wrong elements.
fn check<T: Element + PartialEq>(
    arx: &mut Arx,
    args: &Args,
    n: usize,
    poison: T,
) -> arx::Result<usize> {
    let (me, world) = (arx.rank(), arx.world());
    let mut wrong = 0;
    for iter in 0..args.iters {
        let inputs: Vec<Vec<T>> = (0..world)
            .map(|r| input::<T>(args.seed, r, iter, n))
            .collect();
        // The arx rule, computed here independently: f32 accumulator, rank
        // order, one rounding.
        let expected: Vec<T> = (0..n)
            .map(|i| {
                let mut acc = 0.0f32;
                for inp in &inputs {
                    acc += inp[i].to_f32();
                }
                T::from_f32(acc)
            })
            .collect();
        let mut out = vec![poison; n];
        arx.allreduce_host(&inputs[me], &mut out)?;
        wrong += out
            .iter()
            .zip(&expected)
            .filter(|(a, b)| bytemuck::bytes_of(*a) != bytemuck::bytes_of(*b))
            .count();
    }
    Ok(wrong)
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
    if let Some(breaker) = args.break_qp_drill {
        return match break_qp_drill(&world, &args, breaker) {
            Ok(m) => {
                println!("[rank {rank}] QP drill: {m}");
                ExitCode::SUCCESS
            }
            Err(m) => {
                println!("[rank {rank}] QP drill: PROBLEM: {m}");
                ExitCode::FAILURE
            }
        };
    }
    if let Some(leaver) = args.fault_drill {
        return match fault_drill(&world, &args, leaver) {
            Ok(m) => {
                println!("[rank {rank}] fault drill: {m}");
                ExitCode::SUCCESS
            }
            Err(m) => {
                println!("[rank {rank}] fault drill: PROBLEM: {m}");
                ExitCode::FAILURE
            }
        };
    }
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
    // Topology's own report: devices, roots, ports, GIDs, PCIe links, CPUs.
    for l in arx::topology::report().lines() {
        r.line(format!("topology: {l}"));
    }
    // The ranks sharing this node (and its memory): each rank's proxy gets
    // its own core among them.
    // Main threads bound to one CPU each are left to them, as arx does.
    let node = world.split_shared(rank as i32);
    let sole = ThreadCpus::of_current_thread()
        .sole_cpu()
        .map_or(u64::MAX, |c| c as u64);
    let mut mains = vec![0u64; node.size() as usize];
    node.all_gather_into(&sole, &mut mains[..]);
    let local = LocalRank {
        index: node.rank() as usize,
        count: node.size() as usize,
        main_cpus: mains
            .iter()
            .filter(|&&c| c != u64::MAX)
            .map(|&c| c as usize)
            .collect(),
    };
    let mut select_err = cfg.as_ref().and_then(|c| selection(&mut r, c, &local));
    memlock(&mut r);
    cuda(&mut r);

    if !args.no_allreduce {
        let outcome = (|| -> arx::Result<(String, usize, usize)> {
            let mut arx = Arx::new(&world)?;
            let d = arx.describe();
            let desc = format!(
                "{} device side, {} fabric: {}",
                d.device, d.fabric, d.fabric_detail
            );
            let (count, wrong) = match args.dtype.as_str() {
                "f32" => {
                    let c = args.count.min(arx.max_count::<f32>());
                    (c, check::<f32>(&mut arx, &args, c, f32::NAN)?)
                }
                "f16" => {
                    let c = args.count.min(arx.max_count::<f16>());
                    (c, check::<f16>(&mut arx, &args, c, f16::NAN)?)
                }
                _ => {
                    let c = args.count.min(arx.max_count::<bf16>());
                    (c, check::<bf16>(&mut arx, &args, c, bf16::NAN)?)
                }
            };
            Ok((desc, count, wrong))
        })();
        match outcome {
            Ok((desc, count, wrong)) => {
                r.line(format!("arx: {desc}"));
                if desc.contains("shm fabric") && select_err.take().is_some() {
                    r.line("  note: no RDMA lanes, which the shm fabric (one node) does not need");
                }
                if wrong == 0 {
                    r.line(format!(
                        "all-reduce: {} calls of {count} x {} over {n} ranks: every element correct",
                        args.iters, args.dtype
                    ));
                } else {
                    r.problem(format!(
                        "all-reduce: {wrong} wrong elements in {} calls of {count}: a fabric ordering bug; report this output",
                        args.iters
                    ));
                }
            }
            Err(e) => r.problem(format!("all-reduce failed: {e}")),
        }
    }

    if let Some(e) = select_err {
        r.problem(e);
    }
    if r.problems.is_empty() {
        r.line("doctor: no problem found");
    } else {
        r.line(format!(
            "doctor: {} problem(s); fix them as described above",
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
