//! `allreduce_perf`: an nccl-tests-style sweep of arx all-reduce sizes, next
//! to `MPI_Allreduce` (and NCCL, on a GPU instance where it runs) on the
//! same ranks. It times what a program would run: on a GPU instance
//! (`ARX_DEVICE=gpu`, or `auto` where every rank has a GPU) the GPU path on
//! device buffers, on a host instance the host path.
//!
//! ```sh
//! mpirun -n 4 --oversubscribe target/release/examples/allreduce_perf --check
//! mpirun -n 2 target/release/examples/allreduce_perf -b 8K -e 1M -f 2 -n 200 -w 20 -d bfloat16 -I -J perf.json
//! # every all-reduce algorithm, one column each; reduce-scatter:
//! mpirun -n 4 --oversubscribe target/release/examples/allreduce_perf -A all -b 8K -e 4M -d float -I --check
//! mpirun -n 4 --oversubscribe target/release/examples/allreduce_perf -C reduce_scatter --check
//! # GPU instance, 10 calls captured into one CUDA graph per replay:
//! ARX_DEVICE=gpu mpirun -n 2 target/release/examples/allreduce_perf -d bfloat16 -G 10 --check
//! ```
//!
//! **Rank statistics** (`-a`, module `stats`): by default every time is the
//! slowest rank's: per iteration the largest time any rank measured for
//! it, then the median (or p99) over iterations; a back-to-back time is the
//! largest rank's. `-a 1/2/3` take each rank's own statistic and report
//! their average / minimum / maximum over ranks (nccl-tests' `-a`).
//! `-I` adds the 99th percentile of the per-iteration samples (and, on a
//! host instance, their median).
//!
//! **Host instance**: `time` is the mean per call of `-n` back-to-back
//! `allreduce_host` calls (with `--median`, the median call); beside it
//! `MPI_Allreduce` (float sum of the same bytes) on the same ranks, timed
//! alike; `speedup` = MPI's time ÷ arx's.
//!
//! **GPU instance** (module `gpu`): `cudarc` device buffers, one stream;
//! out-of-place (`allreduce`) and in-place (`allreduce_in_place`) columns.
//! Eager calls by default; `-G N` captures N calls into one CUDA graph and
//! times its replays. Per size and column, after `-w` warm-up calls (or
//! replays): `lat` is the median over `-n` samples of one call (MPI
//! barrier, call, stream synchronize; with `-G N` one replay ÷ N), and
//! `time` the time of `-n` calls (replays) back to back with one
//! synchronize at the end, per call; algbw and busbw come from `time`.
//! Beside them, on the same ranks, CUDA-staged `MPI_Allreduce`: copy to
//! pinned host memory, `MPI_Allreduce` (float sum of the same bytes), copy
//! back, each sample after an MPI barrier, median of `-n` after `-w`
//! warm-ups; `speedup` is its `lat` over arx's out-of-place `lat`. And
//! NCCL's `ncclAllReduce` (module `nccl`), out of place and in place, timed
//! exactly as arx's columns, when libnccl loads and every rank has its own
//! GPU; otherwise the header says why it was skipped.
//!
//! **Algorithms** (`-A`, host instances): `-A oneshot|twoshot|auto`
//! times one instance built with that `arx::Algo`; `-A all` builds one per
//! algorithm and times each as its own column (`arx-1shot`, `arx-2shot`,
//! `arx-auto`), one after the other at each size, with `1s/2s` = one-shot
//! time ÷ two-shot time; `speedup` compares MPI with the last column.
//! Without `-A` one instance follows `ARX_ALGO` (column `arx`). A GPU
//! instance times one algorithm per run (`-A all` is refused there; run
//! `-A oneshot` and `-A twoshot` one after the other). `scripts/crossover` reads the
//! `-J` files of `-A all` runs and prints the crossover table.
//!
//! **Collectives** (`-C`, module `colls`): `reduce_scatter` and
//! `all_gather` time `reduce_scatter_host_op` / `all_gather_host` on a host
//! instance beside `MPI_Reduce_scatter_block` / `MPI_Allgather`, sizes as
//! nccl-tests' reduce_scatter_perf / all_gather_perf (the whole buffer).
//! On a GPU instance they are timed exactly as the all-reduce is there
//! (module `gpu`): `reduce_scatter_op` / `all_gather` out of place and
//! `reduce_scatter_in_place_op` / `all_gather_in_place` in place (NCCL's
//! rule: this rank's block of the N-block buffer), eager or `-G` graph
//! replays, beside CUDA-staged `MPI_Reduce_scatter_block` /
//! `MPI_Allgather` and NCCL's `ncclReduceScatter` / `ncclAllGather`.
//!
//! `--check` (or `-c 1`, module `check`) validates every size and column
//! against the independent reference of `arx::verify` on every rank (seeded
//! inputs, poisoned outputs, digests compared across ranks): arx bit for
//! bit, NCCL and MPI within a stated sum-order tolerance. It exits non-zero
//! if any element is wrong. `-J FILE` writes the header and every result as
//! JSON (module `report`); `scripts/plot-perf` draws it.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use arx::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use arx::cudarc::driver::{
    CudaGraph, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use arx::{verify, Arx, Element, Staging};
use clap::Parser;
use half::{bf16, f16};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

mod check;
mod colls;
mod gpu;
mod nccl;
mod report;
mod stages;
mod stats;
mod table;
use colls::Coll;
use gpu::*;
use report::{Check, Col, Report, J};
use stats::Across;
use table::*;

#[derive(Parser, Debug)]
// A later option wins over an earlier one (as with nccl-tests' getopt), so
// that slurm/allreduce_perf.sbatch's defaults can be overridden by its
// arguments.
#[command(
    about = "arx all-reduce sweep (nccl-tests style), with MPI_Allreduce and NCCL for comparison",
    args_override_self = true
)]
struct Args {
    /// Smallest size in bytes (K/M/G suffixes) [default: 8].
    #[arg(short = 'b', long = "minbytes")]
    min: Option<String>,
    /// Largest size in bytes (K/M/G suffixes). Sizes beyond the slot
    /// (`ARX_SLOT_BYTES`; by default 1 MiB, or the next power of two of
    /// this size if less) run as chunks of one slot.
    #[arg(short = 'e', long = "maxbytes", default_value = "1M")]
    max: String,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    factor: usize,
    /// Timed iterations per size (GPU: latency samples, and back-to-back
    /// calls or replays).
    #[arg(short = 'n', long = "iters", default_value_t = 50)]
    iters: usize,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: usize,
    /// Check results (0/1), as in nccl-tests.
    #[arg(short = 'c', long = "check_level", default_value_t = 0)]
    check_level: u8,
    /// Check every result against the reference (same as -c 1).
    #[arg(long)]
    check: bool,
    /// Reduction: sum, max, min or avg (as nccl-tests' -o; prod is not
    /// supported). Other ops than sum run the arx columns only (no MPI or
    /// NCCL comparison), checked bit for bit by `--check`.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    op: String,
    /// Data type: bfloat16, half, float or all.
    #[arg(short = 'd', long = "datatype", default_value = "all")]
    dtype: String,
    /// GPU instance: capture this many calls into one CUDA graph and time
    /// its replays (0: eager calls).
    #[arg(short = 'G', long = "cudagraph", default_value_t = 0)]
    graph: usize,
    /// How the ranks' times combine: 0 the slowest rank per iteration
    /// (default); 1, 2, 3 the average, min, max over ranks of each rank's
    /// own statistic (as nccl-tests' -a).
    #[arg(short = 'a', long = "average", default_value_t = 0)]
    average: u8,
    /// Per-iteration statistics: add the 99th percentile of the
    /// per-iteration samples (host instance: also their median).
    #[arg(short = 'I', long = "per-iter")]
    per_iter: bool,
    /// Write the header and one record per size x dtype x column as JSON to
    /// this file (rank 0).
    #[arg(short = 'J', long = "json")]
    json: Option<String>,
    /// Skip the MPI_Allreduce comparison.
    #[arg(long)]
    no_mpi: bool,
    /// GPU instance: skip the NCCL columns.
    #[arg(long)]
    no_nccl: bool,
    /// Host instance: report the median call instead of the mean per call
    /// (robust to the stalls of an emulated or shared machine).
    #[arg(long)]
    median: bool,
    /// Per-stage times of one call instead of the sweep: 8K, 64K, 256K and
    /// 1M (up to -e), -n calls each, of -d's type (bfloat16 for "all"),
    /// every result checked; sum only. A -b given adds the small sizes 8,
    /// 64, 512 and 2K from -b on. -f, -G, -I, -a and -J do not apply.
    /// See docs/GB10.md for what each column is and which model stage it
    /// checks.
    #[arg(long)]
    stages: bool,
    /// All-reduce algorithm(s): auto (arx's choice by size and world,
    /// `Algo::choose`), oneshot, twoshot, or all: one instance per
    /// algorithm (built with `Builder::algo`), one column each (arx-1shot,
    /// arx-2shot, arx-auto). Not given: one instance as `ARX_ALGO` says,
    /// column "arx". A GPU instance times one algorithm per run (`all`
    /// is refused there).
    #[arg(short = 'A', long = "algo")]
    algo: Option<String>,
    /// Collective: allreduce (default), reduce_scatter or all_gather
    /// (size = the whole buffer as in nccl-tests' reduce_scatter_perf /
    /// all_gather_perf; host instances out of place, GPU instances out of
    /// place and in place, eager or -G).
    #[arg(short = 'C', long = "collective", default_value = "allreduce")]
    coll: String,
    #[arg(skip = Across::Slowest)]
    across: Across,
}

/// What every path needs besides `Args`.
struct Run<'a> {
    args: &'a Args,
    world: &'a SimpleCommunicator,
    check: bool,
    report: Report,
    call: u64,
    op: arx::Op,
    /// `-C`: the collective timed.
    coll: Coll,
}

fn main() -> ExitCode {
    // NVLink SHARP (multicast) can put a shared host's GPUs out of service;
    // NCCL uses it only if this is not 0. Set before MPI or NCCL starts a
    // thread; a value the user set wins.
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let mut args = Args::parse();
    // MPI and NCCL columns compare sums only (their max/min/avg are not
    // arx's rule).
    if args.op != "sum" {
        args.no_mpi = true;
        args.no_nccl = true;
    }
    let universe = match mpi::initialize() {
        Some(u) => u,
        None => {
            eprintln!("allreduce_perf: MPI was already initialised");
            return ExitCode::FAILURE;
        }
    };
    let world = universe.world();
    let r = Across::from_arg(args.average).and_then(|a| {
        args.across = a;
        run(&args, &world)
    });
    match r {
        Ok(0) => ExitCode::SUCCESS,
        Ok(wrong) => {
            if world.rank() == 0 {
                eprintln!("allreduce_perf: {wrong} wrong elements");
            }
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("allreduce_perf: rank {}: {e}", world.rank());
            ExitCode::FAILURE
        }
    }
}

/// An arx instance of the host sweep and the name of its column.
struct Inst {
    /// "arx" (one instance, `-A` auto or not given), "arx-1shot",
    /// "arx-2shot", "arx-auto" (`-A all`).
    name: &'static str,
    arx: Arx,
}

/// `-A` → (column, the algorithm to build with; None: as `ARX_ALGO` says).
fn algos(a: Option<&str>) -> Result<Vec<(&'static str, Option<arx::Algo>)>, String> {
    use arx::Algo;
    let one = |a: Algo| match a {
        Algo::Auto => ("arx", Some(a)),
        Algo::OneShot => ("arx-1shot", Some(a)),
        Algo::TwoShot => ("arx-2shot", Some(a)),
    };
    Ok(match a {
        None => vec![("arx", None)],
        Some("all") => vec![
            ("arx-1shot", Some(Algo::OneShot)),
            ("arx-2shot", Some(Algo::TwoShot)),
            ("arx-auto", Some(Algo::Auto)),
        ],
        Some(s) => vec![one(s.parse::<Algo>().map_err(|_| {
            format!("-A {s}: expected auto, oneshot, twoshot or all")
        })?)],
    })
}

/// The canonical name of a `-d` value.
fn dtype_name(dt: &str) -> &'static str {
    match dt {
        "bfloat16" | "bf16" => "bfloat16",
        "half" | "f16" => "half",
        _ => "float",
    }
}

fn run(args: &Args, world: &SimpleCommunicator) -> Result<u64, String> {
    let min = arx::parse_bytes("-b", args.min.as_deref().unwrap_or("8"))
        .map_err(|e| e.to_string())?
        .max(1);
    let max = arx::parse_bytes("-e", &args.max)
        .map_err(|e| e.to_string())?
        .max(min);
    if args.factor < 2 {
        return Err("-f must be at least 2".into());
    }
    let op = arx::Op::from_name(&args.op)
        .ok_or_else(|| format!("-o {}: expected sum, max, min or avg", args.op))?;
    if args.stages && op != arx::Op::Sum {
        return Err(format!("-o {}: --stages times sums only", args.op));
    }
    let dtypes: Vec<&'static str> = match args.dtype.as_str() {
        "all" => vec!["bfloat16", "half", "float"],
        d @ ("bfloat16" | "bf16" | "half" | "f16" | "float" | "f32") => vec![dtype_name(d)],
        d => return Err(format!("-d {d}: expected bfloat16, half, float or all")),
    };
    let specs = algos(args.algo.as_deref())?;
    let coll = Coll::from_arg(&args.coll)?;
    report::set_collective(coll);
    if coll != Coll::AllReduce
        && (specs.len() > 1 || specs[0].1.is_some_and(|a| a != arx::Algo::Auto))
    {
        return Err(format!(
            "-A {}: -A picks all-reduce algorithms; -C {} has one",
            args.algo.as_deref().unwrap_or(""),
            coll.name()
        ));
    }
    if coll != Coll::AllReduce && args.stages {
        return Err(format!(
            "-C {}: --stages times all-reduce calls only",
            coll.name()
        ));
    }
    if args.stages && specs[0].1.is_some_and(|a| a != arx::Algo::OneShot) {
        return Err("--stages times one-shot calls; -A does not apply".into());
    }
    // A small sweep needs no more than its largest size per slot; larger
    // sizes run chunked, as a program's would. ARX_SLOT_BYTES, if set, wins.
    let build = |algo: Option<arx::Algo>| {
        let mut builder = Arx::builder();
        if std::env::var_os("ARX_SLOT_BYTES").is_none() {
            builder = builder.slot_bytes(arx::DEFAULT_SLOT_BYTES.min(max.next_power_of_two()));
        }
        if let Some(a) = algo {
            builder = builder.algo(a);
        }
        builder.build(world).map_err(|e| e.to_string())
    };
    // The trace records the stages of a one-shot call (a two-shot call has
    // two rounds of them).
    let mut arx = build(if args.stages {
        Some(arx::Algo::OneShot)
    } else {
        specs[0].1
    })?;
    let gpu = arx.cuda_context().is_some();
    if gpu && specs.len() > 1 {
        return Err(format!(
            "-A {}: a GPU instance times one algorithm per run: -A oneshot, -A twoshot or -A auto",
            args.algo.as_deref().unwrap_or("")
        ));
    }
    // One instance per algorithm, built in the same order on every rank.
    let mut more = vec![];
    for &(_, algo) in &specs[1..] {
        more.push(build(algo)?);
    }
    let mut run = Run {
        args,
        world,
        check: args.check || args.check_level > 0,
        report: Report::default(),
        call: 0,
        op,
        coll,
    };
    let mut sizes = vec![];
    let mut size = min;
    while size <= max {
        sizes.push(size);
        size = size.saturating_mul(args.factor);
    }
    let wrong = if args.stages {
        stages::run_stages(
            &mut run,
            &mut arx,
            &dtypes,
            args.min.as_ref().map(|_| min),
            max,
        )?
    } else if gpu {
        run_gpu(&mut run, &mut arx, &dtypes, &sizes)?
    } else if args.graph > 0 {
        return Err(format!(
            "-G {}: CUDA graphs need a GPU instance; this one runs the host device side",
            args.graph
        ));
    } else if coll != Coll::AllReduce {
        colls::run_host_coll(&mut run, &mut arx, coll, &dtypes, &sizes)?
    } else {
        let mut insts: Vec<Inst> = std::iter::once(arx)
            .chain(more)
            .zip(&specs)
            .map(|(arx, &(name, _))| Inst { name, arx })
            .collect();
        run_host(&mut run, &mut insts, &dtypes, &sizes)?
    };
    if world.rank() == 0 && !args.stages {
        if let Some(path) = &args.json {
            run.report.write(path)?;
            println!("# JSON written to {path}");
        }
    }
    Ok(wrong)
}

/// Gathers a short text from every rank (cut to 240 bytes). Collective.
pub(crate) fn gather_text(world: &SimpleCommunicator, s: &str) -> Vec<String> {
    const W: usize = 240;
    let mut mine = [0u8; W];
    let b = s.as_bytes();
    let k = b.len().min(W);
    mine[..k].copy_from_slice(&b[..k]);
    let mut all = vec![0u8; W * world.size() as usize];
    world.all_gather_into(&mine[..], &mut all[..]);
    all.chunks(W)
        .map(|c| {
            let end = c.iter().position(|&x| x == 0).unwrap_or(W);
            String::from_utf8_lossy(&c[..end]).into_owned()
        })
        .collect()
}

/// This node's name as MPI reports it.
fn host_name() -> String {
    mpi::environment::processor_name().unwrap_or_else(|_| "?".into())
}

/// "<CPU model>, <n> cores".
fn cpu_desc() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name") || l.starts_with("Hardware"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    // Online CPUs of the node, not this rank's affinity (mpirun binds).
    // SAFETY: sysconf reads a system constant.
    let cores = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    format!("{model}, {cores} cores")
}

/// Lines of the header every instance prints (rank 0), and the same facts
/// in the JSON header. `devices` is one line per rank ("host: what");
/// collective through the callers' gathers only.
fn common_header(run: &mut Run, d: &arx::Description, hosts: &[String], devices: &str) {
    let args = run.args;
    let nodes = {
        let mut h = hosts.to_vec();
        h.sort();
        h.dedup();
        h.len()
    };
    let date = report::utc_now();
    let mpi_lib = mpi::environment::library_version()
        .unwrap_or_default()
        .trim_end_matches('\0')
        .split(',')
        .next()
        .unwrap_or("?")
        .to_string();
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    println!(
        "# arx allreduce_perf | {date} | {} ({nodes} node(s))",
        hosts[0]
    );
    println!("# command: {command}");
    println!(
        "# {} ranks | device side {} | fabric {} ({}) | slot {} B",
        d.world, d.device, d.fabric, d.fabric_detail, d.slot_bytes
    );
    println!("# devices: {devices}");
    println!(
        "# memory per rank, fixed at start-up: {} B mapped ({}); nothing is allocated per call",
        d.region_bytes,
        if d.fabric == "shm" {
            "POSIX shared memory"
        } else {
            "registered, pinned"
        }
    );
    println!("# MPI library: {mpi_lib}");
    println!("# op: {}", run.op);
    println!(
        "# iters {} warmup {} check {} | times: {}{}",
        args.iters,
        args.warmup,
        if run.check { "every size" } else { "off" },
        args.across.describe(),
        if args.per_iter {
            " | -I: p99 = nearest-rank 99th percentile of the per-iteration samples"
        } else {
            ""
        }
    );
    let r = &mut run.report;
    r.set("date", J::s(date));
    r.set("host", J::s(hosts[0].clone()));
    r.set("nodes", J::Int(nodes as i64));
    r.set("ranks", J::Int(d.world as i64));
    r.set("command", J::s(command));
    r.set("device_side", J::s(d.device));
    r.set("fabric", J::s(d.fabric));
    r.set("fabric_detail", J::s(d.fabric_detail.clone()));
    r.set("slot_bytes", J::Int(d.slot_bytes as i64));
    r.set("region_bytes_per_rank", J::Int(d.region_bytes as i64));
    r.set("devices", J::s(devices));
    r.set("mpi_library", J::s(mpi_lib));
    r.set(
        "settings",
        J::obj(vec![
            ("iters", J::Int(args.iters as i64)),
            ("warmup", J::Int(args.warmup as i64)),
            ("check", J::Bool(run.check)),
            ("op", J::s(run.op.name())),
            ("average", J::Int(i64::from(args.across.code()))),
            ("average_rule", J::s(args.across.describe())),
            ("per_iter", J::Bool(args.per_iter)),
            ("graph_calls_per_replay", J::Int(args.graph as i64)),
            (
                "host_time",
                J::s(if args.median { "median" } else { "mean" }),
            ),
            (
                "p99_rule",
                J::s("nearest rank: the ceil(0.99 n)-th smallest sample"),
            ),
            ("median_rule", J::s("the floor(n/2)+1-th smallest sample")),
        ]),
    );
}

// -------------------------------------------------------------- host side

/// Every rank's node name, and the header's devices line of a host
/// instance (each node's CPU and core count). Collective.
fn host_devices(world: &SimpleCommunicator) -> (Vec<String>, String) {
    let hosts = gather_text(world, &host_name());
    let cpus = gather_text(world, &cpu_desc());
    let mut kinds: Vec<String> = hosts
        .iter()
        .zip(&cpus)
        .map(|(h, c)| format!("{h}: {c}"))
        .collect();
    kinds.sort();
    kinds.dedup();
    let devices = format!("host CPUs: {}", kinds.join("; "));
    (hosts, devices)
}

/// One host row: each arx column, then MPI_Allreduce unless `--no-mpi`.
struct HostRow {
    arx: Vec<Col>,
    mpi: Option<Col>,
}

/// With `-A all`: the one-shot time ÷ the two-shot time (above 1: two-shot
/// is faster).
fn ratio_col(insts: &[Inst]) -> Option<(usize, usize)> {
    let i1 = insts.iter().position(|i| i.name == "arx-1shot")?;
    let i2 = insts.iter().position(|i| i.name == "arx-2shot")?;
    Some((i1, i2))
}

/// The column `speedup` compares MPI with: the instance of the automatic
/// choice (the last), as a program would run.
fn host_layout(args: &Args, insts: &[Inst]) -> Layout {
    let mut l: Layout = insts
        .iter()
        .map(|i| (i.name.to_string(), fields(Kind::Host, args.per_iter)))
        .collect();
    if !args.no_mpi {
        l.push(("MPI_Allreduce".into(), fields(Kind::Host, args.per_iter)));
        l.push(("".into(), vec![("speedup", "(x)", 7)]));
    }
    if ratio_col(insts).is_some() {
        l.push(("".into(), vec![("1s/2s", "(x)", 6)]));
    }
    l
}

/// A time ratio cell with `digits` decimals.
fn ratio(a: Option<f64>, b: Option<f64>, digits: usize) -> String {
    match (a, b) {
        (Some(a), Some(b)) => format!("{:.digits$}", a / b),
        _ => "-".into(),
    }
}

fn run_host(
    run: &mut Run,
    insts: &mut [Inst],
    dtypes: &[&'static str],
    sizes: &[usize],
) -> Result<u64, String> {
    let (args, world) = (run.args, run.world);
    let d = insts[0].arx.describe();
    let (hosts, devices) = host_devices(world);
    let n = world.size() as usize;
    if world.rank() == 0 {
        common_header(run, &d, &hosts, &devices);
        run.report.set("collective", J::s("allreduce"));
        run.report.set("staging", J::Null);
        run.report.set(
            "nccl",
            J::obj(vec![
                ("status", J::s("not run (host instance)")),
                ("version", J::Null),
            ]),
        );
        let algos: Vec<J> = insts
            .iter()
            .map(|i| {
                J::obj(vec![
                    ("column", J::s(i.name)),
                    ("algo", J::s(i.arx.config().algo.name())),
                ])
            })
            .collect();
        run.report.set("algos", J::Arr(algos));
        let fabric = insts[0].arx.config().fabric;
        let from = arx::host_twoshot_from_bytes(n, fabric);
        run.report.set(
            "twoshot_from_bytes",
            from.map_or(J::Null, |b| J::Int(b as i64)),
        );
        println!(
            "# arx: allreduce_host, out of place; time = {} per call of -n back-to-back calls",
            if args.median { "median" } else { "mean" }
        );
        for i in insts.iter() {
            let a = i.arx.config().algo;
            println!(
                "# {}: ARX_ALGO={}{}",
                i.name,
                a.name(),
                if a == arx::Algo::Auto {
                    match from {
                        Some(b) => format!(" (host side: two-shot from {b} B at {n} ranks)"),
                        None => format!(" (host side: one-shot at {n} rank)"),
                    }
                } else {
                    String::new()
                }
            );
        }
        if !args.no_mpi {
            println!("# MPI_Allreduce: float sum over the same number of bytes (MPI has no bfloat16/half sum), timed alike; checked within the sum-order tolerance; speedup = MPI time / {} time", insts[insts.len() - 1].name);
        }
        if ratio_col(insts).is_some() {
            println!("# 1s/2s = arx-1shot time / arx-2shot time (above 1: two-shot is faster)");
        }
        println!("#");
        print_table_header(&host_layout(args, insts));
    }
    let mut total_wrong = 0;
    for &dt in dtypes {
        for &size in sizes {
            let row = match dt {
                "bfloat16" => measure_host::<bf16>(run, insts, size)?,
                "half" => measure_host::<f16>(run, insts, size)?,
                _ => measure_host::<f32>(run, insts, size)?,
            };
            let Some(row) = row else { continue };
            total_wrong += row.arx.iter().map(|c| c.wrong).sum::<u64>()
                + row.mpi.as_ref().map_or(0, |m| m.wrong);
            if world.rank() == 0 {
                let esize = if dt == "float" { 4 } else { 2 };
                let count = size / esize;
                let mut g = vec![];
                for (c, i) in row.arx.iter().zip(insts.iter()) {
                    g.push((
                        widths(Kind::Host, args.per_iter),
                        cells(Kind::Host, args.per_iter, c, size, n),
                    ));
                    let algo = i.arx.config().algo;
                    run.report.record_with(
                        size,
                        count,
                        dt,
                        "host",
                        n,
                        c,
                        vec![
                            ("algo", J::s(algo.name())),
                            (
                                "algo_run",
                                J::s(algo.choose(n, size, false, i.arx.config().fabric).name()),
                            ),
                        ],
                    );
                }
                if let Some(m) = &row.mpi {
                    g.push((
                        widths(Kind::Host, args.per_iter),
                        cells(Kind::Host, args.per_iter, m, size, n),
                    ));
                    let last = &row.arx[row.arx.len() - 1];
                    g.push((vec![7], vec![ratio(m.time_us, last.time_us, 1)]));
                    run.report.record(size, count, dt, "host", n, m);
                }
                if let Some((i1, i2)) = ratio_col(insts) {
                    g.push((
                        vec![6],
                        vec![ratio(row.arx[i1].time_us, row.arx[i2].time_us, 2)],
                    ));
                }
                print_table_row(size, count, dt, run.op, &g);
            }
        }
    }
    Ok(total_wrong)
}

/// Seed of the MPI columns' inputs (the call number is the size).
const MPI_SEED: u64 = 0x3a9_57a6e;

/// Times `f` `iters` times back to back: (per-call samples µs, mean µs).
fn back_to_back(
    iters: usize,
    mut f: impl FnMut() -> Result<(), String>,
) -> Result<(Vec<f64>, f64), String> {
    let mut per = Vec::with_capacity(iters);
    let t = Instant::now();
    for _ in 0..iters {
        let c = Instant::now();
        f()?;
        per.push(c.elapsed().as_secs_f64() * 1e6);
    }
    Ok((per, t.elapsed().as_secs_f64() * 1e6 / iters as f64))
}

/// (median, p99, time) of a host column by the `-a` rule. Collective.
fn host_times(run: &Run, per: &[f64], mean: f64) -> (Option<f64>, Option<f64>, f64) {
    let (args, world) = (run.args, run.world);
    if !(args.per_iter || args.median) {
        return (None, None, stats::scalar(world, args.across, mean));
    }
    let (med, p99) = stats::samples(world, args.across, per);
    let time = if args.median {
        med
    } else {
        stats::scalar(world, args.across, mean)
    };
    (Some(med), args.per_iter.then_some(p99), time)
}

fn measure_host<T: Element>(
    run: &mut Run,
    insts: &mut [Inst],
    size: usize,
) -> Result<Option<HostRow>, String> {
    let count = size / std::mem::size_of::<T>();
    if count == 0 {
        return Ok(None);
    }
    let mut cols = vec![];
    for i in insts.iter_mut() {
        cols.push(measure_arx_host::<T>(run, i, count)?);
    }
    let mpi = measure_mpi_host(run, size)?;
    Ok(Some(HostRow { arx: cols, mpi }))
}

/// One arx column: `-n` back-to-back calls of `count` elements, then (with
/// `--check`) their last result and three fresh calls against the reference.
fn measure_arx_host<T: Element>(
    run: &mut Run,
    inst: &mut Inst,
    count: usize,
) -> Result<Col, String> {
    let (args, world, check, op) = (run.args, run.world, run.check, run.op);
    let arx = &mut inst.arx;
    let rank = world.rank() as usize;
    let n = world.size() as usize;
    let iters = args.iters.max(1);
    let seed = 0xa11_0ced;
    run.call += 1;
    let timed_call = run.call;
    let input = verify::input::<T>(seed, timed_call, rank, count);
    let mut out = vec![T::from_f32(0.0); count];
    let fail = |e: arx::Error| format!("{}: {count} x {:?}: {e}", inst.name, T::DTYPE);

    for _ in 0..args.warmup {
        arx.allreduce_host_op(&input, &mut out, op).map_err(fail)?;
    }
    world.barrier();
    let (per, mean) = back_to_back(iters, || {
        arx.allreduce_host_op(&input, &mut out, op).map_err(fail)
    })?;
    let (median_us, p99_us, time) = host_times(run, &per, mean);
    let mut col = Col {
        name: inst.name,
        placement: "out-of-place",
        median_us,
        p99_us,
        time_us: Some(time),
        check: if check { Check::Exact } else { Check::Off },
        wrong: 0,
        inexact: 0,
    };
    if check {
        // The timed calls' last result, then fresh inputs into poisoned
        // outputs.
        let want = verify::expected_op::<T>(op, false, seed, timed_call, n, count);
        col.wrong += check::tally(world, &out, &want, None).0;
        for _ in 0..3 {
            run.call += 1;
            let inp = verify::input::<T>(seed, run.call, rank, count);
            verify::poison(&mut out);
            arx.allreduce_host_op(&inp, &mut out, op).map_err(fail)?;
            let want = verify::expected_op::<T>(op, false, seed, run.call, n, count);
            col.wrong += check::tally(world, &out, &want, None).0;
        }
    }
    Ok(col)
}

/// The MPI_Allreduce column of `size` bytes (None with `--no-mpi`).
fn measure_mpi_host(run: &mut Run, size: usize) -> Result<Option<Col>, String> {
    let (args, world, check) = (run.args, run.world, run.check);
    let rank = world.rank() as usize;
    let n = world.size() as usize;
    let iters = args.iters.max(1);
    let mpi = if args.no_mpi {
        None
    } else {
        let floats = size.div_ceil(4);
        let send = verify::input::<f32>(MPI_SEED, size as u64, rank, floats);
        let mut recv = vec![0f32; floats];
        let op = mpi::collective::SystemOperation::sum();
        for _ in 0..args.warmup {
            world.all_reduce_into(&send[..], &mut recv[..], op);
        }
        world.barrier();
        verify::poison(&mut recv);
        let (per, mean) = back_to_back(iters, || {
            world.all_reduce_into(&send[..], &mut recv[..], op);
            Ok(())
        })?;
        let (median_us, p99_us, time) = host_times(run, &per, mean);
        let mut m = Col {
            name: "MPI_Allreduce",
            placement: "out-of-place",
            median_us,
            p99_us,
            time_us: Some(time),
            check: if check { Check::Tolerance } else { Check::Off },
            wrong: 0,
            inexact: 0,
        };
        if check {
            let inputs: Vec<Vec<f32>> = (0..n)
                .map(|r| verify::input::<f32>(MPI_SEED, size as u64, r, floats))
                .collect();
            let (want, tol) = check::want(&inputs, true);
            (m.wrong, m.inexact) = check::tally(world, &recv, &want, tol.as_deref());
        }
        Some(m)
    };
    Ok(mpi)
}
