//! The GPU instance's columns: arx on device buffers (eager or graph
//! replays), beside CUDA-staged `MPI_Allreduce`.

use super::*;

/// One column of the GPU table.
#[derive(Default)]
pub(super) struct GpuCol {
    lat_us: f64,
    time_us: f64,
    wrong: u64,
}

pub(super) struct GpuRow {
    oop: GpuCol,
    inp: GpuCol,
    mpi_us: Option<f64>,
}

pub(super) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

pub(super) fn cuda<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{what}: {e}")
}

#[allow(clippy::too_many_arguments)]
pub(super) fn run_gpu(
    args: &Args,
    world: &SimpleCommunicator,
    arx: &mut Arx,
    dtypes: &[&str],
    min: usize,
    max: usize,
    check: bool,
) -> Result<u64, String> {
    let ctx = arx
        .cuda_context()
        .ok_or("no CUDA context on a GPU instance")?
        .clone();
    // One stream for everything: cudarc's per-slice events are not needed,
    // and they would be recorded into captured graphs.
    // SAFETY: every slice below is used on `s` only.
    unsafe { ctx.disable_event_tracking() };
    let s = ctx.new_stream().map_err(cuda("new_stream"))?;
    let d = arx.describe();
    let rank = world.rank();
    if rank == 0 {
        let gpu = ctx.name().unwrap_or_else(|e| format!("name unknown: {e}"));
        println!("# arx allreduce_perf");
        println!(
            "# {} ranks | device gpu ({gpu}, CUDA device {} on rank 0) | staging {} | fabric {} ({}) | slot {} B",
            d.world,
            ctx.ordinal(),
            match arx.config().staging {
                Staging::Sm => "sm",
                Staging::CopyEngine => "copy",
            },
            d.fabric,
            d.fabric_detail,
            d.slot_bytes
        );
        print_common_header(args, &d, check);
        if args.graph > 0 {
            println!(
                "# launch: CUDA graph of {} calls per replay; lat = median of (MPI barrier, one replay, stream sync) / {}, time = back-to-back replays / calls",
                args.graph, args.graph
            );
        } else {
            println!("# launch: eager calls on one stream; lat = median of (MPI barrier, one call, stream sync), time = back-to-back calls, one sync, / calls");
        }
        println!("# times: slowest rank's; algbw and busbw from time");
        if !args.no_mpi {
            println!("# CUDA-staged MPI_Allreduce: D2H to pinned memory, MPI_Allreduce float sum of the same bytes, H2D, stream sync; median (after an MPI barrier each), slowest rank; speedup = its lat / arx out-of-place lat");
        }
        println!("#");
        println!(
            "# {:>10} {:>10} {:>9} {:>6} | {:^38} | {:^38} | {:^25} |",
            "", "", "", "", "arx out-of-place", "arx in-place", "CUDA-staged MPI_Allreduce"
        );
        println!(
            "# {:>10} {:>10} {:>9} {:>6} | {:>8} {:>8} {:>6} {:>6} {:>6} | {:>8} {:>8} {:>6} {:>6} {:>6} | {:>9} {:>7} {:>7} | {:>7}",
            "size", "count", "type", "redop", "lat", "time", "algbw", "busbw", "#wrong", "lat", "time",
            "algbw", "busbw", "#wrong", "lat", "algbw", "busbw", "speedup"
        );
        println!(
            "# {:>10} {:>10} {:>9} {:>6} | {:>8} {:>8} {:>6} {:>6} {:>6} | {:>8} {:>8} {:>6} {:>6} {:>6} | {:>9} {:>7} {:>7} | {:>7}",
            "(B)", "(elements)", "", "", "(us)", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)",
            "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "(x)"
        );
    }
    let mut total_wrong = 0;
    let mut call = 0u64;
    for &dt in dtypes {
        let mut size = min;
        while size <= max {
            let row = match dt {
                "bfloat16" | "bf16" => {
                    measure_gpu::<bf16>(args, world, arx, &s, size, check, &mut call)?
                }
                "half" | "f16" => measure_gpu::<f16>(args, world, arx, &s, size, check, &mut call)?,
                _ => measure_gpu::<f32>(args, world, arx, &s, size, check, &mut call)?,
            };
            if let Some(row) = row {
                total_wrong += row.oop.wrong + row.inp.wrong;
                if rank == 0 {
                    print_gpu_row(dt, size, world.size() as usize, &row, check);
                }
            }
            size = size.saturating_mul(args.factor);
        }
    }
    arx.check().map_err(|e| e.to_string())?;
    Ok(total_wrong)
}

pub(super) fn print_gpu_row(dt: &str, size: usize, n: usize, r: &GpuRow, check: bool) {
    let esize = if matches!(dt, "float" | "f32") { 4 } else { 2 };
    let name = match dt {
        "bf16" => "bfloat16",
        "f16" => "half",
        "f32" => "float",
        d => d,
    };
    let bus = 2.0 * (n as f64 - 1.0) / n as f64;
    let col = |c: &GpuCol| {
        let alg = size as f64 / c.time_us / 1e3;
        let wrong = if check {
            c.wrong.to_string()
        } else {
            "N/A".into()
        };
        format!(
            "{:>8.2} {:>8.2} {:>6.2} {:>6.2} {:>6}",
            c.lat_us,
            c.time_us,
            alg,
            alg * bus,
            wrong
        )
    };
    let mpi = match r.mpi_us {
        Some(m) => {
            let a = size as f64 / m / 1e3;
            format!(
                "{m:>9.2} {a:>7.2} {:>7.2} | {:>7.1}",
                a * bus,
                m / r.oop.lat_us
            )
        }
        None => format!("{:>9} {:>7} {:>7} | {:>7}", "-", "-", "-", "-"),
    };
    println!(
        "  {:>10} {:>10} {:>9} {:>6} | {} | {} | {}",
        size,
        size / esize,
        name,
        "sum",
        col(&r.oop),
        col(&r.inp),
        mpi
    );
}

/// What one timed unit launches: one eager call, or one replay of a graph
/// of `-G` calls.
enum Launch {
    Eager,
    Graph(CudaGraph),
}

/// Captures `n` calls made by `call` into one graph, uploaded.
pub(super) fn capture(
    s: &Arc<CudaStream>,
    n: usize,
    mut call: impl FnMut() -> arx::Result<()>,
) -> Result<CudaGraph, String> {
    s.synchronize().map_err(cuda("synchronize"))?;
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(cuda("begin_capture"))?;
    let mut r = Ok(());
    for _ in 0..n {
        r = call();
        if r.is_err() {
            break;
        }
    }
    let g = s
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(cuda("end_capture"))?;
    r.map_err(|e| format!("allreduce under capture: {e}"))?;
    let g = g.ok_or("stream capture produced no graph")?;
    g.upload().map_err(cuda("graph upload"))?;
    Ok(g)
}

/// The former gpu_check bench's method: `warmup` units, then `iters`
/// single units each after an MPI barrier and followed by a stream
/// synchronize (median), then `iters` units back to back with one
/// synchronize; each divided by `per_unit` calls; the slowest rank's.
/// Returns (lat, time) in µs.
pub(super) fn time_units(
    args: &Args,
    world: &SimpleCommunicator,
    s: &Arc<CudaStream>,
    per_unit: usize,
    mut unit: impl FnMut() -> Result<(), String>,
) -> Result<(f64, f64), String> {
    let iters = args.iters.max(1);
    let per = per_unit.max(1) as f64;
    for _ in 0..args.warmup {
        unit()?;
    }
    s.synchronize().map_err(cuda("synchronize"))?;
    let mut lat = Vec::with_capacity(iters);
    for _ in 0..iters {
        world.barrier();
        let t = Instant::now();
        unit()?;
        s.synchronize().map_err(cuda("synchronize"))?;
        lat.push(t.elapsed().as_secs_f64() * 1e6 / per);
    }
    let lat = slowest(world, median(&mut lat));
    world.barrier();
    let t = Instant::now();
    for _ in 0..iters {
        unit()?;
    }
    s.synchronize().map_err(cuda("synchronize"))?;
    let time = slowest(
        world,
        t.elapsed().as_secs_f64() * 1e6 / (iters as f64 * per),
    );
    Ok((lat, time))
}

/// Rank `rank`'s wrong-element count summed over ranks, plus the whole
/// buffer for every rank whose digest differs from rank 0's.
pub(super) fn tally<T: Element>(world: &SimpleCommunicator, got: &[T], want: &[T]) -> u64 {
    let n = world.size() as usize;
    let mut local = verify::count_wrong(got, want) as u64;
    let d = verify::digest(got);
    let mut all = vec![0u64; n];
    world.all_gather_into(&d, &mut all[..]);
    if all.iter().any(|&x| x != all[0]) {
        local += got.len() as u64; // ranks disagree: count the buffer wrong
    }
    let mut sum = 0u64;
    world.all_reduce_into(&local, &mut sum, SystemOperation::sum());
    sum
}

pub(super) fn poison_dev<T: Element + DeviceRepr>(
    s: &Arc<CudaStream>,
    d: &mut CudaSlice<T>,
) -> Result<(), String> {
    let mut h = vec![T::zeroed(); d.len()];
    verify::poison(&mut h);
    s.memcpy_htod(&h, d).map_err(cuda("poison"))
}

pub(super) fn down<T: DeviceRepr + Default + Clone>(
    s: &Arc<CudaStream>,
    d: &CudaSlice<T>,
) -> Result<Vec<T>, String> {
    let v = s.clone_dtoh(d).map_err(cuda("dtoh"))?;
    s.synchronize().map_err(cuda("synchronize"))?;
    Ok(v)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn measure_gpu<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    args: &Args,
    world: &SimpleCommunicator,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
    size: usize,
    check: bool,
    call: &mut u64,
) -> Result<Option<GpuRow>, String> {
    let count = size / std::mem::size_of::<T>();
    if count == 0 {
        return Ok(None);
    }
    let rank = world.rank() as usize;
    let n = world.size() as usize;
    let seed = 0xa11_0ced;
    let fail = |e: arx::Error| format!("{count} x {:?}: {e}", T::DTYPE);
    let g = args.graph;
    let per_unit = g.max(1);

    // Out of place.
    *call += 1;
    let timed_call = *call;
    let mut din = s
        .clone_htod(&verify::input::<T>(seed, timed_call, rank, count))
        .map_err(cuda("htod"))?;
    let mut dout = s.alloc_zeros::<T>(count).map_err(cuda("alloc"))?;
    poison_dev(s, &mut dout)?;
    let launch = if g > 0 {
        Launch::Graph(capture(s, g, || arx.allreduce(&din, &mut dout, s))?)
    } else {
        Launch::Eager
    };
    let unit_oop = |arx: &mut Arx, din: &CudaSlice<T>, dout: &mut CudaSlice<T>| match &launch {
        Launch::Eager => arx.allreduce(din, dout, s).map_err(fail),
        Launch::Graph(gr) => gr.launch().map_err(cuda("graph launch")),
    };
    let (lat, time) = time_units(args, world, s, per_unit, || unit_oop(arx, &din, &mut dout))?;
    arx.check().map_err(fail)?;
    let mut oop = GpuCol {
        lat_us: lat,
        time_us: time,
        wrong: 0,
    };
    if check {
        // The timed calls' last result, then fresh inputs into poisoned
        // outputs through the same call or graph.
        let want = verify::expected::<T>(seed, timed_call, n, count);
        oop.wrong += tally(world, &down(s, &dout)?, &want);
        for _ in 0..3 {
            *call += 1;
            s.memcpy_htod(&verify::input::<T>(seed, *call, rank, count), &mut din)
                .map_err(cuda("htod"))?;
            poison_dev(s, &mut dout)?;
            unit_oop(arx, &din, &mut dout)?;
            arx.check().map_err(fail)?;
            let want = verify::expected::<T>(seed, *call, n, count);
            oop.wrong += tally(world, &down(s, &dout)?, &want);
        }
    }
    drop(launch);
    drop(dout);
    drop(din);

    // In place: the buffer holds the previous sum at each call (nccl-tests
    // does the same); checked below on fresh inputs.
    *call += 1;
    let mut dbuf = s
        .clone_htod(&verify::input::<T>(seed, *call, rank, count))
        .map_err(cuda("htod"))?;
    let launch = if g > 0 {
        Launch::Graph(capture(s, g, || arx.allreduce_in_place(&mut dbuf, s))?)
    } else {
        Launch::Eager
    };
    let unit_inp = |arx: &mut Arx, dbuf: &mut CudaSlice<T>| match &launch {
        Launch::Eager => arx.allreduce_in_place(dbuf, s).map_err(fail),
        Launch::Graph(gr) => gr.launch().map_err(cuda("graph launch")),
    };
    let (lat, time) = time_units(args, world, s, per_unit, || unit_inp(arx, &mut dbuf))?;
    arx.check().map_err(fail)?;
    let mut inp = GpuCol {
        lat_us: lat,
        time_us: time,
        wrong: 0,
    };
    if check {
        for _ in 0..3 {
            *call += 1;
            s.memcpy_htod(&verify::input::<T>(seed, *call, rank, count), &mut dbuf)
                .map_err(cuda("htod"))?;
            unit_inp(arx, &mut dbuf)?;
            arx.check().map_err(fail)?;
            // A unit of k in-place calls sums k times: every rank holds the
            // previous sum at each call after the first.
            let mut want = verify::expected::<T>(seed, *call, n, count);
            for _ in 1..per_unit {
                want = verify::reference(&vec![want; n]);
            }
            inp.wrong += tally(world, &down(s, &dbuf)?, &want);
        }
    }
    drop(launch);
    drop(dbuf);

    let mpi_us = if args.no_mpi {
        None
    } else {
        Some(staged_mpi(args, world, s, size)?)
    };
    Ok(Some(GpuRow { oop, inp, mpi_us }))
}

/// CUDA-staged `MPI_Allreduce` of `size` bytes of floats: D2H to pinned
/// memory, MPI_Allreduce, H2D, synchronize; the slowest rank's median (µs).
pub(super) fn staged_mpi(
    args: &Args,
    world: &SimpleCommunicator,
    s: &Arc<CudaStream>,
    size: usize,
) -> Result<f64, String> {
    let floats = size.div_ceil(4);
    let ctx = s.context();
    let dsrc = s
        .clone_htod(&verify::input::<f32>(
            0x3a9_57a6e,
            size as u64,
            world.rank() as usize,
            floats,
        ))
        .map_err(cuda("htod"))?;
    let mut ddst = s.alloc_zeros::<f32>(floats).map_err(cuda("alloc"))?;
    // SAFETY: page-locked buffers whose contents are written (D2H copy,
    // MPI_Allreduce) before they are read.
    let mut hin =
        unsafe { ctx.alloc_pinned_with_flags::<f32>(floats, 0) }.map_err(cuda("pinned"))?;
    // SAFETY: as above.
    let mut hout =
        unsafe { ctx.alloc_pinned_with_flags::<f32>(floats, 0) }.map_err(cuda("pinned"))?;
    let iters = args.iters.max(1);
    let mut lat = Vec::with_capacity(iters);
    for it in 0..args.warmup + iters {
        world.barrier();
        let t = Instant::now();
        s.memcpy_dtoh(&dsrc, &mut hin).map_err(cuda("dtoh"))?;
        s.synchronize().map_err(cuda("synchronize"))?;
        {
            let a = hin.as_slice().map_err(cuda("pinned"))?;
            let b = hout.as_mut_slice().map_err(cuda("pinned"))?;
            world.all_reduce_into(a, b, SystemOperation::sum());
        }
        s.memcpy_htod(&hout, &mut ddst).map_err(cuda("htod"))?;
        s.synchronize().map_err(cuda("synchronize"))?;
        if it >= args.warmup {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(slowest(world, median(&mut lat)))
}
