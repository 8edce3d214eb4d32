//! `allreduce_perf`: an nccl-tests-style sweep of arx all-reduce sizes, next
//! to `MPI_Allreduce` on the same ranks. It times what a program would run:
//! on a GPU instance (`ARX_DEVICE=gpu`, or `auto` where every rank has a
//! GPU) the GPU path on device buffers, on a host instance the host path.
//!
//! ```sh
//! mpirun -n 4 --oversubscribe target/release/examples/allreduce_perf --check
//! mpirun -n 2 target/release/examples/allreduce_perf -b 8K -e 1M -f 2 -n 200 -w 20 -d bfloat16
//! # GPU instance, 10 calls captured into one CUDA graph per replay:
//! ARX_DEVICE=gpu mpirun -n 2 target/release/examples/allreduce_perf -d bfloat16 -G 10 --check
//! ```
//!
//! **Host instance**: times are the slowest rank's mean per call of `-n`
//! back-to-back `allreduce_host` calls; beside them `MPI_Allreduce` (float
//! sum of the same bytes) on the same ranks, timed alike.
//!
//! **GPU instance**: `cudarc` device buffers, one stream; out-of-place
//! (`allreduce`) and in-place (`allreduce_in_place`) columns. Eager calls by
//! default; `-G N` captures N calls into one CUDA graph and times its
//! replays. Per size and column, after `-w` warm-up calls (or replays):
//! `lat` is the slowest rank's median over `-n` samples of one call (MPI
//! barrier, call, stream synchronize; with `-G N` one replay ÷ N), and
//! `time` the slowest rank's time of `-n` calls (replays) back to back with
//! one synchronize at the end, per call; algbw and busbw come from `time`.
//! Beside them, on the same ranks, CUDA-staged `MPI_Allreduce`: copy to
//! pinned host memory, `MPI_Allreduce` (float sum of the same bytes), copy
//! back, each sample after an MPI barrier, median of `-n` after `-w`
//! warm-ups, slowest rank; `speedup` is its `lat` over arx's out-of-place
//! `lat`. (This is the method of the former `gpu_check bench`.)
//!
//! `--check` (or `-c 1`) validates every size and column against the
//! independent reference of `arx::verify` on every rank (seeded inputs,
//! poisoned outputs, digests compared across ranks): the last timed
//! out-of-place result, then three fresh inputs per column through the same
//! eager call or graph that was timed (an in-place graph of N calls sums N
//! times, and so does its reference). It exits non-zero if any element is
//! wrong.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use arx::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use arx::cudarc::driver::{CudaGraph, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use arx::{verify, Arx, Element, Staging};
use clap::Parser;
use half::{bf16, f16};
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

mod gpu;
use gpu::*;

#[derive(Parser, Debug)]
// A later option wins over an earlier one (as with nccl-tests' getopt), so
// that slurm/allreduce_perf.sbatch's defaults can be overridden by its
// arguments.
#[command(
    about = "arx all-reduce sweep (nccl-tests style), with MPI_Allreduce for comparison",
    args_override_self = true
)]
struct Args {
    /// Smallest size in bytes (K/M/G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "8")]
    min: String,
    /// Largest size in bytes (K/M/G suffixes); also sets the slot size.
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
    /// Data type: bfloat16, half, float or all.
    #[arg(short = 'd', long = "datatype", default_value = "all")]
    dtype: String,
    /// GPU instance: capture this many calls into one CUDA graph and time
    /// its replays (0: eager calls).
    #[arg(short = 'G', long = "cudagraph", default_value_t = 0)]
    graph: usize,
    /// Skip the MPI_Allreduce comparison.
    #[arg(long)]
    no_mpi: bool,
    /// Host instance: time every arx call and report the slowest rank's
    /// median call instead of its mean (robust to the stalls of an emulated
    /// or shared machine).
    #[arg(long)]
    median: bool,
}

struct Row {
    arx_us: f64,
    mpi_us: Option<f64>,
    wrong: u64,
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = Args::parse();
    let universe = match mpi::initialize() {
        Some(u) => u,
        None => {
            eprintln!("allreduce_perf: MPI was already initialised");
            return ExitCode::FAILURE;
        }
    };
    let world = universe.world();
    match run(&args, &world) {
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

fn run(args: &Args, world: &SimpleCommunicator) -> Result<u64, String> {
    let min = arx::parse_bytes("-b", &args.min)
        .map_err(|e| e.to_string())?
        .max(1);
    let max = arx::parse_bytes("-e", &args.max)
        .map_err(|e| e.to_string())?
        .max(min);
    if args.factor < 2 {
        return Err("-f must be at least 2".into());
    }
    let check = args.check || args.check_level > 0;
    let dtypes: Vec<&str> = match args.dtype.as_str() {
        "all" => vec!["bfloat16", "half", "float"],
        d @ ("bfloat16" | "bf16" | "half" | "f16" | "float" | "f32") => vec![d],
        d => return Err(format!("-d {d}: expected bfloat16, half, float or all")),
    };
    let slot = max.max(arx::DEFAULT_SLOT_BYTES.min(max.next_power_of_two()));
    let mut arx = Arx::builder()
        .slot_bytes(slot)
        .build(world)
        .map_err(|e| e.to_string())?;
    if arx.cuda_context().is_some() {
        return run_gpu(args, world, &mut arx, &dtypes, min, max, check);
    }
    if args.graph > 0 {
        return Err(format!(
            "-G {}: CUDA graphs need a GPU instance; this one runs the host device side",
            args.graph
        ));
    }
    let d = arx.describe();
    let rank = world.rank();
    if rank == 0 {
        println!("# arx allreduce_perf");
        println!(
            "# {} ranks | device {} | fabric {} ({}) | slot {} B",
            d.world, d.device, d.fabric, d.fabric_detail, d.slot_bytes
        );
        print_common_header(args, &d, check);
        if !args.no_mpi {
            println!("# MPI_Allreduce: float sum over the same number of bytes (MPI has no bfloat16/half sum)");
        }
        println!("#");
        println!(
            "# {:>10} {:>10} {:>9} {:>6} | {:>9} {:>7} {:>7} {:>7} | {:>9} {:>7} {:>7} | {:>7}",
            "size",
            "count",
            "type",
            "redop",
            "arx",
            "algbw",
            "busbw",
            "#wrong",
            "MPI",
            "algbw",
            "busbw",
            "speedup"
        );
        println!(
            "# {:>10} {:>10} {:>9} {:>6} | {:>9} {:>7} {:>7} {:>7} | {:>9} {:>7} {:>7} | {:>7}",
            "(B)",
            "(elements)",
            "",
            "",
            "time(us)",
            "(GB/s)",
            "(GB/s)",
            "",
            "time(us)",
            "(GB/s)",
            "(GB/s)",
            "(x)"
        );
    }
    let mut total_wrong = 0;
    let mut call = 0u64;
    for dt in dtypes {
        let mut size = min;
        while size <= max {
            let row = match dt {
                "bfloat16" | "bf16" => {
                    measure::<bf16>(args, world, &mut arx, size, check, &mut call)?
                }
                "half" | "f16" => measure::<f16>(args, world, &mut arx, size, check, &mut call)?,
                _ => measure::<f32>(args, world, &mut arx, size, check, &mut call)?,
            };
            if let Some(row) = row {
                total_wrong += row.wrong;
                if rank == 0 {
                    print_row(dt, size, world.size() as usize, &row, check);
                }
            }
            size = size.saturating_mul(args.factor);
        }
    }
    Ok(total_wrong)
}

/// Header lines shared by both device sides (rank 0 prints).
fn print_common_header(args: &Args, d: &arx::Description, check: bool) {
    println!(
        "# memory per rank, fixed at start-up: {} B mapped ({}); nothing is allocated per call",
        d.region_bytes,
        if d.fabric == "shm" {
            "POSIX shared memory"
        } else {
            "registered, pinned"
        }
    );
    println!(
        "# MPI library: {}",
        mpi::environment::library_version()
            .unwrap_or_default()
            .trim_end_matches('\0')
            .split(',')
            .next()
            .unwrap_or("?")
    );
    println!(
        "# iters {} warmup {} check {} | host arx time: {} per call",
        args.iters,
        args.warmup,
        if check { "every size" } else { "off" },
        if args.median { "median" } else { "mean" }
    );
}

fn print_row(dt: &str, size: usize, n: usize, r: &Row, check: bool) {
    let esize = if matches!(dt, "float" | "f32") { 4 } else { 2 };
    let name = match dt {
        "bf16" => "bfloat16",
        "f16" => "half",
        "f32" => "float",
        d => d,
    };
    let bus = 2.0 * (n as f64 - 1.0) / n as f64;
    let alg = size as f64 / r.arx_us / 1e3;
    let wrong = if check {
        r.wrong.to_string()
    } else {
        "N/A".into()
    };
    let (mt, ma, mb, sp) = match r.mpi_us {
        Some(m) => {
            let a = size as f64 / m / 1e3;
            (
                format!("{m:.2}"),
                format!("{a:.2}"),
                format!("{:.2}", a * bus),
                format!("{:.1}", m / r.arx_us),
            )
        }
        None => ("-".into(), "-".into(), "-".into(), "-".into()),
    };
    println!(
        "  {:>10} {:>10} {:>9} {:>6} | {:>9.2} {:>7.2} {:>7.2} {:>7} | {:>9} {:>7} {:>7} | {:>7}",
        size,
        size / esize,
        name,
        "sum",
        r.arx_us,
        alg,
        alg * bus,
        wrong,
        mt,
        ma,
        mb,
        sp
    );
}

/// The slowest rank's value.
fn slowest(world: &SimpleCommunicator, v: f64) -> f64 {
    let mut m = 0.0;
    world.all_reduce_into(&v, &mut m, SystemOperation::max());
    m
}

fn measure<T: Element>(
    args: &Args,
    world: &SimpleCommunicator,
    arx: &mut Arx,
    size: usize,
    check: bool,
    call: &mut u64,
) -> Result<Option<Row>, String> {
    let count = size / std::mem::size_of::<T>();
    if count == 0 {
        return Ok(None);
    }
    let rank = world.rank() as usize;
    let n = world.size() as usize;
    let seed = 0xa11_0ced;
    *call += 1;
    let input = verify::input::<T>(seed, *call, rank, count);
    let mut out = vec![T::from_f32(0.0); count];
    let fail = |e: arx::Error| format!("{count} x {:?}: {e}", T::DTYPE);

    for _ in 0..args.warmup {
        arx.allreduce_host(&input, &mut out).map_err(fail)?;
    }
    world.barrier();
    let mut calls = Vec::with_capacity(if args.median { args.iters.max(1) } else { 0 });
    let t = Instant::now();
    for _ in 0..args.iters.max(1) {
        let c = Instant::now();
        arx.allreduce_host(&input, &mut out).map_err(fail)?;
        if args.median {
            calls.push(c.elapsed().as_secs_f64());
        }
    }
    let local = if args.median {
        calls.sort_by(f64::total_cmp);
        calls[calls.len() / 2]
    } else {
        t.elapsed().as_secs_f64() / args.iters.max(1) as f64
    };
    let arx_us = slowest(world, local * 1e6);

    let mut wrong = 0u64;
    if check {
        // The timed calls' last result, then fresh inputs into poisoned outputs.
        let mut local =
            verify::count_wrong(&out, &verify::expected::<T>(seed, *call, n, count)) as u64;
        for _ in 0..3 {
            *call += 1;
            let inp = verify::input::<T>(seed, *call, rank, count);
            verify::poison(&mut out);
            arx.allreduce_host(&inp, &mut out).map_err(fail)?;
            local +=
                verify::count_wrong(&out, &verify::expected::<T>(seed, *call, n, count)) as u64;
            let d = verify::digest(&out);
            let mut all = vec![0u64; n];
            world.all_gather_into(&d, &mut all[..]);
            if all.iter().any(|&x| x != d) {
                local += count as u64; // ranks disagree: count the whole buffer wrong
            }
        }
        world.all_reduce_into(&local, &mut wrong, SystemOperation::sum());
    }

    let mpi_us = if args.no_mpi {
        None
    } else {
        let floats = size.div_ceil(4);
        let send: Vec<f32> = (0..floats).map(|i| (i % 7) as f32).collect();
        let mut recv = vec![0f32; floats];
        for _ in 0..args.warmup {
            world.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
        }
        world.barrier();
        let t = Instant::now();
        for _ in 0..args.iters.max(1) {
            world.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
        }
        Some(slowest(
            world,
            t.elapsed().as_secs_f64() * 1e6 / args.iters.max(1) as f64,
        ))
    };
    Ok(Some(Row {
        arx_us,
        mpi_us,
        wrong,
    }))
}
