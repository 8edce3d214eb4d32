//! The GPU instance's columns: arx on device buffers (eager or graph
//! replays), CUDA-staged `MPI_Allreduce`, and NCCL where it runs.

use super::*;
use nccl::{Nccl, Setup};

/// Who runs a GPU column.
enum Who<'a> {
    Arx(&'a mut Arx),
    Nccl(&'a Nccl),
}

impl Who<'_> {
    fn name(&self) -> &'static str {
        match self {
            Who::Arx(_) => "arx",
            Who::Nccl(_) => "NCCL",
        }
    }

    fn oop<T: Element + DeviceRepr>(
        &mut self,
        din: &CudaSlice<T>,
        dout: &mut CudaSlice<T>,
        op: arx::Op,
        s: &Arc<CudaStream>,
    ) -> Result<(), String> {
        match self {
            Who::Arx(a) => a.allreduce_op(din, dout, op, s).map_err(|e| e.to_string()),
            Who::Nccl(n) => {
                let (src, _a) = din.device_ptr(s);
                let (dst, _b) = dout.device_ptr_mut(s);
                // SAFETY: two device allocations of `din.len()` elements on
                // this context; callers keep them (and any graph that
                // captured this call) alive until the stream has run it.
                unsafe { n.all_reduce(src, dst, din.len(), T::DTYPE, s) }
            }
        }
    }

    fn inp<T: Element + DeviceRepr>(
        &mut self,
        buf: &mut CudaSlice<T>,
        op: arx::Op,
        s: &Arc<CudaStream>,
    ) -> Result<(), String> {
        match self {
            Who::Arx(a) => a
                .allreduce_in_place_op(buf, op, s)
                .map_err(|e| e.to_string()),
            Who::Nccl(n) => {
                let len = buf.len();
                let (p, _g) = buf.device_ptr_mut(s);
                // SAFETY: as in `oop`, one allocation read and written in
                // place.
                unsafe { n.all_reduce(p, p, len, T::DTYPE, s) }
            }
        }
    }

    /// An error the calls recorded asynchronously.
    fn check(&mut self) -> Result<(), String> {
        match self {
            Who::Arx(a) => a.check().map_err(|e| e.to_string()),
            Who::Nccl(n) => n.check(),
        }
    }
}

pub(super) fn cuda<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{what}: {e}")
}

/// One GPU table row.
struct GpuRow {
    oop: Col,
    inp: Col,
    mpi: Option<Col>,
    nccl: Option<(Col, Col)>,
}

fn gpu_layout(args: &Args, nccl: bool) -> Layout {
    let g = fields(Kind::Gpu, args.per_iter);
    let mut l = vec![
        ("arx out-of-place".to_string(), g.clone()),
        ("arx in-place".to_string(), g.clone()),
    ];
    if !args.no_mpi {
        l.push((
            "CUDA-staged MPI_Allreduce".into(),
            fields(Kind::Staged, args.per_iter),
        ));
        l.push(("".into(), vec![("speedup", "(x)", 7)]));
    }
    if nccl {
        l.push(("NCCL out-of-place".into(), g.clone()));
        l.push(("NCCL in-place".into(), g));
    }
    l
}

/// "NVIDIA H200 (CUDA device 0, GPU-…)" for this rank.
pub(super) fn gpu_desc(ctx: &Arc<arx::cudarc::driver::CudaContext>) -> String {
    let name = ctx.name().unwrap_or_else(|e| format!("name unknown: {e}"));
    let uuid = ctx.uuid().map_or_else(
        |_| "uuid unknown".to_string(),
        |u| {
            let b: Vec<u8> = u.bytes.iter().map(|&x| x as u8).collect();
            format!(
                "GPU-{}-{}-{}-{}-{}",
                hex(&b[0..4]),
                hex(&b[4..6]),
                hex(&b[6..8]),
                hex(&b[8..10]),
                hex(&b[10..16])
            )
        },
    );
    format!("{name} (CUDA device {}, {uuid})", ctx.ordinal())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// "1 GPU(s) (ranks share GPUs: MPS needed): host: NVIDIA H200 (CUDA
/// device 0, GPU-…) [rank 0,1]" from every rank's host and GPU.
fn devices_summary(hosts: &[String], gpus: &[String]) -> String {
    let mut distinct: Vec<(String, Vec<usize>)> = vec![];
    for (r, (h, g)) in hosts.iter().zip(gpus).enumerate() {
        let key = format!("{h}: {g}");
        match distinct.iter_mut().find(|(k, _)| *k == key) {
            Some((_, rs)) => rs.push(r),
            None => distinct.push((key, vec![r])),
        }
    }
    let parts: Vec<String> = distinct
        .iter()
        .map(|(k, rs)| {
            let rs: Vec<String> = rs.iter().map(|r| r.to_string()).collect();
            format!("{k} [rank {}]", rs.join(","))
        })
        .collect();
    let n = distinct.len();
    let shared = if n < hosts.len() {
        " (ranks share GPUs: MPS needed)"
    } else {
        " (one rank per GPU)"
    };
    format!("{n} GPU(s){shared}: {}", parts.join("; "))
}

pub(super) fn run_gpu(
    run: &mut Run,
    arx: &mut Arx,
    dtypes: &[&'static str],
    sizes: &[usize],
) -> Result<u64, String> {
    let (args, world) = (run.args, run.world);
    let ctx = arx
        .cuda_context()
        .ok_or("no CUDA context on a GPU instance")?
        .clone();
    // One stream for everything: cudarc's per-slice events are not needed,
    // and they would be recorded into captured graphs.
    // SAFETY: every slice below is used on `s` only.
    unsafe { ctx.disable_event_tracking() };
    ctx.bind_to_thread().map_err(cuda("bind CUDA context"))?;
    let s = ctx.new_stream().map_err(cuda("new_stream"))?;
    let d = arx.describe();
    let host = host_name();
    let hosts = gather_text(world, &host);
    let gpus = gather_text(world, &gpu_desc(&ctx));
    let devices = devices_summary(&hosts, &gpus);
    let nccl = nccl::setup(world, &ctx, &host, args.no_nccl);
    let staging = match arx.config().staging {
        Staging::Sm => "sm",
        Staging::CopyEngine => "copy",
    };
    if world.rank() == 0 {
        common_header(run, &d, &hosts, &devices);
        let r = &mut run.report;
        r.set("staging", J::s(staging));
        let settings = nccl::settings();
        let set_line: Vec<String> = settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let set_json = J::Obj(
            settings
                .iter()
                .map(|(k, v)| (k.clone(), J::s(v.clone())))
                .collect(),
        );
        println!("# arx staging: {staging}");
        match &nccl {
            Setup::On(n) => {
                println!(
                    "# NCCL {}: ncclAllReduce beside arx, same buffers' sizes, same timing | {}",
                    n.version,
                    set_line.join(" ")
                );
                r.set(
                    "nccl",
                    J::obj(vec![
                        ("status", J::s("run")),
                        ("version", J::s(n.version.clone())),
                        ("settings", set_json),
                    ]),
                );
            }
            Setup::Off(why) => {
                println!("# NCCL: skipped: {why} | {}", set_line.join(" "));
                r.set(
                    "nccl",
                    J::obj(vec![
                        ("status", J::s("skipped")),
                        ("reason", J::s(why.clone())),
                        ("version", J::Null),
                        ("settings", set_json),
                    ]),
                );
            }
        }
        if args.graph > 0 {
            println!(
                "# launch: CUDA graph of {} calls per replay; lat = median of (MPI barrier, one replay, stream sync) / {}, time = back-to-back replays / calls",
                args.graph, args.graph
            );
        } else {
            println!("# launch: eager calls on one stream; lat = median of (MPI barrier, one call, stream sync), time = back-to-back calls, one sync, / calls");
        }
        println!("# algbw and busbw from time; arx checked bit for bit, NCCL and MPI within the sum-order tolerance (docs/BENCHMARKS.md)");
        if !args.no_mpi {
            println!("# CUDA-staged MPI_Allreduce: D2H to pinned memory, MPI_Allreduce float sum of the same bytes, H2D, stream sync; lat = median (after an MPI barrier each); speedup = its lat / arx out-of-place lat");
        }
        println!("#");
        print_table_header(&gpu_layout(args, matches!(nccl, Setup::On(_))));
    }
    let nccl = match &nccl {
        Setup::On(n) => Some(n),
        Setup::Off(_) => None,
    };
    let launch = if args.graph > 0 { "graph" } else { "eager" };
    let n = world.size() as usize;
    let mut total_wrong = 0;
    for &dt in dtypes {
        for &size in sizes {
            let row = match dt {
                "bfloat16" => measure_gpu::<bf16>(run, arx, nccl, &s, size)?,
                "half" => measure_gpu::<f16>(run, arx, nccl, &s, size)?,
                _ => measure_gpu::<f32>(run, arx, nccl, &s, size)?,
            };
            let Some(row) = row else { continue };
            let mut cols = vec![&row.oop, &row.inp];
            cols.extend(row.mpi.as_ref());
            if let Some((a, b)) = &row.nccl {
                cols.extend([a, b]);
            }
            total_wrong += cols.iter().map(|c| c.wrong).sum::<u64>();
            if world.rank() == 0 {
                let pi = args.per_iter;
                let count = size / if dt == "float" { 4 } else { 2 };
                let gpu = |c: &Col| (widths(Kind::Gpu, pi), cells(Kind::Gpu, pi, c, size, n));
                let mut g = vec![gpu(&row.oop), gpu(&row.inp)];
                if let Some(m) = &row.mpi {
                    g.push((
                        widths(Kind::Staged, pi),
                        cells(Kind::Staged, pi, m, size, n),
                    ));
                    let sp = match (m.median_us, row.oop.median_us) {
                        (Some(a), Some(b)) => format!("{:.1}", a / b),
                        _ => "-".into(),
                    };
                    g.push((vec![7], vec![sp]));
                }
                if let Some((a, b)) = &row.nccl {
                    g.extend([gpu(a), gpu(b)]);
                }
                print_table_row(size, count, dt, run.op, &g);
                for c in cols {
                    run.report.record(size, count, dt, launch, n, c);
                }
            }
        }
    }
    arx.check().map_err(|e| e.to_string())?;
    Ok(total_wrong)
}

/// Captures `n` calls made by `call` into one graph, uploaded.
fn capture(
    s: &Arc<CudaStream>,
    n: usize,
    mut call: impl FnMut() -> Result<(), String>,
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
    r.map_err(|e| format!("call under capture: {e}"))?;
    let g = g.ok_or("stream capture produced no graph")?;
    g.upload().map_err(cuda("graph upload"))?;
    Ok(g)
}

/// The former gpu_check bench's method: `warmup` units, then `iters`
/// single units each after an MPI barrier and followed by a stream
/// synchronize, then `iters` units back to back with one synchronize; each
/// divided by `per_unit` calls. Returns (median, p99, time) in µs, combined
/// across ranks by `-a`.
fn time_units(
    args: &Args,
    world: &SimpleCommunicator,
    s: &Arc<CudaStream>,
    per_unit: usize,
    mut unit: impl FnMut() -> Result<(), String>,
) -> Result<(f64, f64, f64), String> {
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
    let (med, p99) = stats::samples(world, args.across, &lat);
    world.barrier();
    let t = Instant::now();
    for _ in 0..iters {
        unit()?;
    }
    s.synchronize().map_err(cuda("synchronize"))?;
    let time = stats::scalar(
        world,
        args.across,
        t.elapsed().as_secs_f64() * 1e6 / (iters as f64 * per),
    );
    Ok((med, p99, time))
}

fn poison_dev<T: Element + DeviceRepr>(
    s: &Arc<CudaStream>,
    d: &mut CudaSlice<T>,
) -> Result<(), String> {
    let mut h = vec![T::zeroed(); d.len()];
    verify::poison(&mut h);
    s.memcpy_htod(&h, d).map_err(cuda("poison"))
}

fn down<T: DeviceRepr + Default + Clone>(
    s: &Arc<CudaStream>,
    d: &CudaSlice<T>,
) -> Result<Vec<T>, String> {
    let v = s.clone_dtoh(d).map_err(cuda("dtoh"))?;
    s.synchronize().map_err(cuda("synchronize"))?;
    Ok(v)
}

/// Every rank's input of call `call`.
fn inputs<T: Element>(seed: u64, call: u64, n: usize, count: usize) -> Vec<Vec<T>> {
    (0..n)
        .map(|r| verify::input(seed, call, r, count))
        .collect()
}

fn measure_gpu<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    run: &mut Run,
    arx: &mut Arx,
    nccl: Option<&Nccl>,
    s: &Arc<CudaStream>,
    size: usize,
) -> Result<Option<GpuRow>, String> {
    let count = size / std::mem::size_of::<T>();
    if count == 0 {
        return Ok(None);
    }
    let oop = gpu_col::<T>(run, &mut Who::Arx(arx), s, false, count)?;
    let inp = gpu_col::<T>(run, &mut Who::Arx(arx), s, true, count)?;
    let mpi = if run.args.no_mpi {
        None
    } else {
        Some(staged_mpi(run, s, size)?)
    };
    let nccl = match nccl {
        Some(n) => Some((
            gpu_col::<T>(run, &mut Who::Nccl(n), s, false, count)?,
            gpu_col::<T>(run, &mut Who::Nccl(n), s, true, count)?,
        )),
        None => None,
    };
    Ok(Some(GpuRow {
        oop,
        inp,
        mpi,
        nccl,
    }))
}

/// One call (out of place into `out`, or in place in `a`).
fn one<T: Element + DeviceRepr>(
    who: &mut Who,
    s: &Arc<CudaStream>,
    a: &mut CudaSlice<T>,
    out: Option<&mut CudaSlice<T>>,
    op: arx::Op,
) -> Result<(), String> {
    match out {
        Some(o) => who.oop(a, o, op, s),
        None => who.inp(a, op, s),
    }
}

/// One column at one size: timed, then (`--check`) checked. Out of place:
/// the timed calls' last result, then three fresh inputs into poisoned
/// outputs through the same eager call or graph. In place: the buffer
/// holds the previous sum at each timed call (nccl-tests does the same);
/// three fresh inputs are checked, and a graph of k in-place calls sums k
/// times, and so does its reference.
fn gpu_col<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    run: &mut Run,
    who: &mut Who,
    s: &Arc<CudaStream>,
    in_place: bool,
    count: usize,
) -> Result<Col, String> {
    let (args, world, check, op) = (run.args, run.world, run.check, run.op);
    let rank = world.rank() as usize;
    let n = world.size() as usize;
    let seed = 0xa11_0ced;
    // NCCL: checked within the sum-order tolerance, warmed up before capture.
    let nccl = matches!(who, Who::Nccl(_));
    let name = who.name();
    let placement = if in_place { "in-place" } else { "out-of-place" };
    let ctx = |e: String| format!("{name} {placement}, {count} x {:?}: {e}", T::DTYPE);
    let per_unit = args.graph.max(1);

    run.call += 1;
    let timed_call = run.call;
    let mut a = s
        .clone_htod(&verify::input::<T>(seed, timed_call, rank, count))
        .map_err(cuda("htod"))?;
    let mut b = if in_place {
        None
    } else {
        let mut o = s.alloc_zeros::<T>(count).map_err(cuda("alloc"))?;
        poison_dev(s, &mut o)?;
        Some(o)
    };
    if args.graph > 0 && nccl {
        // NCCL connects its transports at a communicator's first call of
        // each algorithm (NCCL_RUNTIME_CONNECT), host work that does not
        // belong inside a stream capture: one eager call first.
        one(who, s, &mut a, b.as_mut(), op).map_err(ctx)?;
        s.synchronize().map_err(cuda("synchronize"))?;
    }
    let graph = if args.graph > 0 {
        Some(capture(s, args.graph, || one(who, s, &mut a, b.as_mut(), op)).map_err(ctx)?)
    } else {
        None
    };
    let unit = |who: &mut Who, a: &mut CudaSlice<T>, b: Option<&mut CudaSlice<T>>| match &graph {
        None => one(who, s, a, b, op),
        Some(g) => g.launch().map_err(cuda("graph launch")),
    };
    let (med, p99, time) =
        time_units(args, world, s, per_unit, || unit(who, &mut a, b.as_mut())).map_err(ctx)?;
    who.check().map_err(ctx)?;
    let mut col = Col {
        name,
        placement,
        median_us: Some(med),
        p99_us: args.per_iter.then_some(p99),
        time_us: Some(time),
        check: match (check, nccl) {
            (false, _) => Check::Off,
            (true, false) => Check::Exact,
            (true, true) => Check::Tolerance,
        },
        wrong: 0,
        inexact: 0,
    };
    if check {
        let mut add = |(w, i): (u64, u64)| {
            col.wrong += w;
            col.inexact += i;
        };
        if let Some(out) = b.as_ref() {
            let (want, tol) = check::want_op(op, &inputs::<T>(seed, timed_call, n, count), nccl);
            add(check::tally(world, &down(s, out)?, &want, tol.as_deref()));
        }
        for _ in 0..3 {
            run.call += 1;
            s.memcpy_htod(&verify::input::<T>(seed, run.call, rank, count), &mut a)
                .map_err(cuda("htod"))?;
            if let Some(out) = b.as_mut() {
                poison_dev(s, out)?;
            }
            unit(who, &mut a, b.as_mut()).map_err(ctx)?;
            who.check().map_err(ctx)?;
            let (mut want, mut tol) =
                check::want_op(op, &inputs::<T>(seed, run.call, n, count), nccl);
            if in_place {
                // Every rank holds the previous result at each call after
                // the first of the unit.
                for _ in 1..per_unit {
                    (want, tol) = if op == arx::Op::Sum {
                        check::chain(&want, tol.as_deref(), n)
                    } else {
                        (verify::reference_op(op, &vec![want; n]), None)
                    };
                }
            }
            let got = down(s, b.as_ref().unwrap_or(&a))?;
            add(check::tally(world, &got, &want, tol.as_deref()));
        }
    }
    // The graph goes before the buffers it captured.
    drop(graph);
    Ok(col)
}

/// CUDA-staged `MPI_Allreduce` of `size` bytes of floats: D2H to pinned
/// memory, MPI_Allreduce, H2D, synchronize; median (and p99) by `-a`;
/// the last result checked within the sum-order tolerance.
fn staged_mpi(run: &mut Run, s: &Arc<CudaStream>, size: usize) -> Result<Col, String> {
    let (args, world, check) = (run.args, run.world, run.check);
    let floats = size.div_ceil(4);
    let n = world.size() as usize;
    let ctx = s.context();
    let dsrc = s
        .clone_htod(&verify::input::<f32>(
            MPI_SEED,
            size as u64,
            world.rank() as usize,
            floats,
        ))
        .map_err(cuda("htod"))?;
    let mut ddst = s.alloc_zeros::<f32>(floats).map_err(cuda("alloc"))?;
    poison_dev(s, &mut ddst)?;
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
            world.all_reduce_into(a, b, mpi::collective::SystemOperation::sum());
        }
        s.memcpy_htod(&hout, &mut ddst).map_err(cuda("htod"))?;
        s.synchronize().map_err(cuda("synchronize"))?;
        if it >= args.warmup {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let (med, p99) = stats::samples(world, args.across, &lat);
    let mut col = Col {
        name: "CUDA-staged MPI_Allreduce",
        placement: "out-of-place",
        median_us: Some(med),
        p99_us: args.per_iter.then_some(p99),
        time_us: None,
        check: if check { Check::Tolerance } else { Check::Off },
        wrong: 0,
        inexact: 0,
    };
    if check {
        let inputs: Vec<Vec<f32>> = (0..n)
            .map(|r| verify::input::<f32>(MPI_SEED, size as u64, r, floats))
            .collect();
        let (want, tol) = check::want(&inputs, true);
        (col.wrong, col.inexact) = check::tally(world, &down(s, &ddst)?, &want, tol.as_deref());
    }
    Ok(col)
}
