//! The GPU instance's columns: arx on device buffers (eager or graph
//! replays), CUDA-staged MPI, and NCCL where it runs; for the all-reduce,
//! and with `-C` for reduce-scatter and all-gather (sizes, MPI calls and
//! their checks from module `colls`).

use super::*;
use nccl::{Nccl, Setup};

/// Who runs a GPU column.
enum Who<'a> {
    Arx(&'a mut Arx),
    Nccl(&'a Nccl),
}

/// What one call is: the collective (`-C`), the op, and this rank's place.
#[derive(Clone, Copy)]
struct Call {
    coll: Coll,
    op: arx::Op,
    rank: usize,
    n: usize,
}

impl Who<'_> {
    fn name(&self) -> &'static str {
        match self {
            Who::Arx(_) => "arx",
            Who::Nccl(_) => "NCCL",
        }
    }

    /// Out of place: `din` and `dout` of the lengths `colls::lens` gives.
    fn oop<T: Element + DeviceRepr>(
        &mut self,
        c: Call,
        din: &CudaSlice<T>,
        dout: &mut CudaSlice<T>,
        s: &Arc<CudaStream>,
    ) -> Result<(), String> {
        match self {
            Who::Arx(a) => match c.coll {
                Coll::AllReduce => a.allreduce_op(din, dout, c.op, s),
                Coll::ReduceScatter => a.reduce_scatter_op(din, dout, c.op, s),
                Coll::AllGather => a.all_gather(din, dout, s),
            }
            .map_err(|e| e.to_string()),
            Who::Nccl(n) => {
                let (in_len, out_len) = (din.len(), dout.len());
                let (src, _a) = din.device_ptr(s);
                let (dst, _b) = dout.device_ptr_mut(s);
                let count = match c.coll {
                    Coll::ReduceScatter => out_len,
                    Coll::AllReduce | Coll::AllGather => in_len,
                };
                // SAFETY: two device allocations of the call's input and
                // output lengths on this context; callers keep them (and
                // any graph that captured this call) alive until the stream
                // has run it.
                unsafe { n.call(c.coll, src, dst, count, T::DTYPE, s) }
            }
        }
    }

    /// In place in `buf` (reduce-scatter and all-gather: N blocks, this
    /// rank's block the output, resp. the input, as NCCL defines it).
    fn inp<T: Element + DeviceRepr>(
        &mut self,
        c: Call,
        buf: &mut CudaSlice<T>,
        s: &Arc<CudaStream>,
    ) -> Result<(), String> {
        match self {
            Who::Arx(a) => match c.coll {
                Coll::AllReduce => a.allreduce_in_place_op(buf, c.op, s),
                Coll::ReduceScatter => a.reduce_scatter_in_place_op(buf, c.op, s),
                Coll::AllGather => a.all_gather_in_place(buf, s),
            }
            .map_err(|e| e.to_string()),
            Who::Nccl(n) => {
                let len = buf.len();
                let per = len / c.n.max(1);
                let (p, _g) = buf.device_ptr_mut(s);
                let own = p + (c.rank * per * std::mem::size_of::<T>()) as u64;
                let (src, dst, count) = match c.coll {
                    Coll::AllReduce => (p, p, len),
                    Coll::ReduceScatter => (p, own, per),
                    Coll::AllGather => (own, p, per),
                };
                // SAFETY: as in `oop`, one allocation of N blocks (all-reduce:
                // one), read and written in place.
                unsafe { n.call(c.coll, src, dst, count, T::DTYPE, s) }
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

fn gpu_layout(args: &Args, coll: Coll, nccl: bool) -> Layout {
    let g = fields(Kind::Gpu, args.per_iter);
    let mut l = vec![
        ("arx out-of-place".to_string(), g.clone()),
        ("arx in-place".to_string(), g.clone()),
    ];
    if !args.no_mpi {
        l.push((
            format!("CUDA-staged {}", coll.mpi_name()),
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
    let (args, world, coll) = (run.args, run.world, run.coll);
    if coll == Coll::AllGather && run.op != arx::Op::Sum {
        return Err(format!("-o {}: all_gather has no reduction", run.op));
    }
    let n = world.size() as usize;
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
        r.set("collective", J::s(coll.name()));
        if coll != Coll::AllReduce {
            r.set(
                "size_rule",
                J::s("nccl-tests: size = the whole buffer (N blocks); count = elements per rank's block, rounded down to a multiple of 4"),
            );
            println!(
                "# arx: {}, out of place and in place (NCCL's in-place rule: this rank's block of the N-block buffer); size = the whole {} of {n} blocks (nccl-tests' {}_perf convention); count = elements per rank's block (rounded down to a multiple of 4); busbw = algbw x (N-1)/N",
                if coll == Coll::ReduceScatter { "reduce_scatter_op" } else { "all_gather" },
                if coll == Coll::ReduceScatter { "send buffer" } else { "receive buffer" },
                coll.name()
            );
        }
        match &nccl {
            Setup::On(n) => {
                println!(
                    "# NCCL {}: {} beside arx, same buffers' sizes, same timing | {}",
                    n.version,
                    nccl_call(coll),
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
            let m = coll.mpi_name();
            println!(
                "# CUDA-staged {m}: D2H to pinned memory, {m} {} of the same bytes, H2D, stream sync; lat = median (after an MPI barrier each); speedup = its lat / arx out-of-place lat",
                if coll == Coll::AllGather { "of floats" } else { "float sum" }
            );
        }
        println!("#");
        print_table_header(&gpu_layout(args, coll, matches!(nccl, Setup::On(_))));
    }
    let nccl = match &nccl {
        Setup::On(n) => Some(n),
        Setup::Off(_) => None,
    };
    let launch = if args.graph > 0 { "graph" } else { "eager" };
    let mut total_wrong = 0;
    for &dt in dtypes {
        let esize = if dt == "float" { 4 } else { 2 };
        for &size in sizes {
            // Elements per rank's block (all-reduce: the whole call), the
            // size shown, and the staged MPI call's floats per block and
            // seed (as the host columns' MPI calls).
            let (per, shown, mpi) = if coll == Coll::AllReduce {
                (size / esize, size, (size.div_ceil(4), size as u64))
            } else {
                let per = colls::block_count(size, esize, n);
                let floats = per * esize / 4;
                (per, per * n * esize, (floats, (floats * n) as u64))
            };
            if per == 0 {
                continue;
            }
            let row = match dt {
                "bfloat16" => measure_gpu::<bf16>(run, arx, nccl, &s, per, mpi)?,
                "half" => measure_gpu::<f16>(run, arx, nccl, &s, per, mpi)?,
                _ => measure_gpu::<f32>(run, arx, nccl, &s, per, mpi)?,
            };
            let mut cols = vec![&row.oop, &row.inp];
            cols.extend(row.mpi.as_ref());
            if let Some((a, b)) = &row.nccl {
                cols.extend([a, b]);
            }
            total_wrong += cols.iter().map(|c| c.wrong).sum::<u64>();
            if world.rank() == 0 {
                let pi = args.per_iter;
                let gpu = |c: &Col| (widths(Kind::Gpu, pi), cells(Kind::Gpu, pi, c, shown, n));
                let mut g = vec![gpu(&row.oop), gpu(&row.inp)];
                if let Some(m) = &row.mpi {
                    g.push((
                        widths(Kind::Staged, pi),
                        cells(Kind::Staged, pi, m, shown, n),
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
                let redop = if coll == Coll::AllGather {
                    "none"
                } else {
                    run.op.name()
                };
                print_table_row_redop(shown, per, dt, redop, &g);
                for c in cols {
                    run.report.record(shown, per, dt, launch, n, c);
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

/// NCCL's call for `coll`.
fn nccl_call(coll: Coll) -> &'static str {
    match coll {
        Coll::AllReduce => "ncclAllReduce",
        Coll::ReduceScatter => "ncclReduceScatter",
        Coll::AllGather => "ncclAllGather",
    }
}

/// One row: blocks of `per` elements per rank (all-reduce: `per` elements);
/// `mpi` = (floats per block, seed call number) of the staged MPI column.
fn measure_gpu<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    run: &mut Run,
    arx: &mut Arx,
    nccl: Option<&Nccl>,
    s: &Arc<CudaStream>,
    per: usize,
    mpi: (usize, u64),
) -> Result<GpuRow, String> {
    let oop = gpu_col::<T>(run, &mut Who::Arx(arx), s, false, per)?;
    let inp = gpu_col::<T>(run, &mut Who::Arx(arx), s, true, per)?;
    let mpi = if run.args.no_mpi {
        None
    } else {
        Some(staged_mpi(run, s, mpi.0, mpi.1)?)
    };
    let nccl = match nccl {
        Some(n) => Some((
            gpu_col::<T>(run, &mut Who::Nccl(n), s, false, per)?,
            gpu_col::<T>(run, &mut Who::Nccl(n), s, true, per)?,
        )),
        None => None,
    };
    Ok(GpuRow {
        oop,
        inp,
        mpi,
        nccl,
    })
}

/// One call (out of place into `out`, or in place in `a`).
fn one<T: Element + DeviceRepr>(
    who: &mut Who,
    s: &Arc<CudaStream>,
    a: &mut CudaSlice<T>,
    out: Option<&mut CudaSlice<T>>,
    c: Call,
) -> Result<(), String> {
    match out {
        Some(o) => who.oop(c, a, o, s),
        None => who.inp(c, a, s),
    }
}

/// This rank's buffer `a` for call `call` (blocks of `per`): its input, or
/// in place the N-block buffer (all-gather: its input in this rank's block,
/// the other blocks poisoned).
fn first_buffer<T: Element>(c: Call, seed: u64, call: u64, in_place: bool, per: usize) -> Vec<T> {
    let (in_len, out_len) = colls::lens(c.coll, c.n, per);
    if in_place && c.coll == Coll::AllGather {
        let mut v = vec![T::from_f32(0.0); out_len];
        verify::poison(&mut v);
        v[c.rank * per..(c.rank + 1) * per]
            .copy_from_slice(&verify::input::<T>(seed, call, c.rank, per));
        return v;
    }
    verify::input(seed, call, c.rank, in_len)
}

/// The reference (and, `tolerant`, the per-element bound) of what this
/// rank holds after `k` calls of call `call` (in place: a graph of `k`
/// calls, each on the previous one's buffer; out of place `k` is 1): the
/// output, or in place the whole buffer (the other blocks unchanged).
/// Built from every rank's seeded inputs, not from any arx call.
fn reference<T: Element>(
    c: Call,
    seed: u64,
    call: u64,
    per: usize,
    in_place: bool,
    k: usize,
    tolerant: bool,
) -> (Vec<T>, Option<Vec<f64>>) {
    let (in_len, _) = colls::lens(c.coll, c.n, per);
    let mut bufs = inputs::<T>(seed, call, c.n, in_len);
    let steps = if in_place { k.max(1) } else { 1 };
    match c.coll {
        Coll::AllReduce => {
            let (mut want, mut tol) = check::want_op(c.op, &bufs, tolerant);
            // Every rank holds the previous result at each call after the
            // first of the unit.
            for _ in 1..steps {
                (want, tol) = if c.op == arx::Op::Sum {
                    check::chain(&want, tol.as_deref(), c.n)
                } else {
                    (verify::reference_op(c.op, &vec![want; c.n]), None)
                };
            }
            (want, tol)
        }
        // Bits unchanged, for NCCL too; repeated in place, the same.
        Coll::AllGather => (bufs.concat(), None),
        Coll::ReduceScatter => {
            let mine = c.rank * per..(c.rank + 1) * per;
            let (mut full, mut tol) = (vec![], None::<Vec<f64>>);
            for step in 0..steps {
                if step > 0 {
                    // Each rank's own block now holds its result.
                    for (q, b) in bufs.iter_mut().enumerate() {
                        b[q * per..(q + 1) * per].copy_from_slice(&full[q * per..(q + 1) * per]);
                    }
                }
                let (w, t) = check::want_op(c.op, &bufs, tolerant);
                // One input of each block (its owner's) is off by the
                // previous bound: carried twice over, generously.
                tol = match (t, tol) {
                    (Some(t), Some(p)) => {
                        Some(t.iter().zip(&p).map(|(a, b)| a + 2.0 * b).collect())
                    }
                    (t, _) => t,
                };
                full = w;
            }
            if in_place {
                let mut want = bufs.swap_remove(c.rank);
                want[mine.clone()].copy_from_slice(&full[mine.clone()]);
                let tol = tol.map(|t| {
                    let mut z = vec![0.0; want.len()];
                    z[mine.clone()].copy_from_slice(&t[mine.clone()]);
                    z
                });
                (want, tol)
            } else {
                (full[mine.clone()].to_vec(), tol.map(|t| t[mine].to_vec()))
            }
        }
    }
}

/// One column at one size (blocks of `per`; all-reduce: `per` elements):
/// timed, then (`--check`) checked. Out of place: the timed calls' last
/// result, then three fresh inputs into poisoned outputs through the same
/// eager call or graph. In place: the buffer holds the previous result at
/// each timed call (nccl-tests does the same); three fresh inputs are
/// checked, and a graph of k in-place calls runs k times on its own
/// results, and so does its reference (`reference`).
fn gpu_col<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    run: &mut Run,
    who: &mut Who,
    s: &Arc<CudaStream>,
    in_place: bool,
    per: usize,
) -> Result<Col, String> {
    let (args, world, check) = (run.args, run.world, run.check);
    let c = Call {
        coll: run.coll,
        op: run.op,
        rank: world.rank() as usize,
        n: world.size() as usize,
    };
    let seed = 0xa11_0ced;
    // NCCL: checked within the sum-order tolerance, warmed up before capture.
    let nccl = matches!(who, Who::Nccl(_));
    let name = who.name();
    let placement = if in_place { "in-place" } else { "out-of-place" };
    let ctx = |e: String| {
        format!(
            "{name} {} {placement}, {per} x {:?}: {e}",
            c.coll.name(),
            T::DTYPE
        )
    };
    let per_unit = args.graph.max(1);
    let out_len = colls::lens(c.coll, c.n, per).1;

    run.call += 1;
    let timed_call = run.call;
    let mut a = s
        .clone_htod(&first_buffer::<T>(c, seed, timed_call, in_place, per))
        .map_err(cuda("htod"))?;
    let mut b = if in_place {
        None
    } else {
        let mut o = s.alloc_zeros::<T>(out_len).map_err(cuda("alloc"))?;
        poison_dev(s, &mut o)?;
        Some(o)
    };
    if args.graph > 0 && nccl {
        // NCCL connects its transports at a communicator's first call of
        // each algorithm (NCCL_RUNTIME_CONNECT), host work that does not
        // belong inside a stream capture: one eager call first.
        one(who, s, &mut a, b.as_mut(), c).map_err(ctx)?;
        s.synchronize().map_err(cuda("synchronize"))?;
    }
    let graph = if args.graph > 0 {
        Some(capture(s, args.graph, || one(who, s, &mut a, b.as_mut(), c)).map_err(ctx)?)
    } else {
        None
    };
    let unit = |who: &mut Who, a: &mut CudaSlice<T>, b: Option<&mut CudaSlice<T>>| match &graph {
        None => one(who, s, a, b, c),
        Some(g) => g.launch().map_err(cuda("graph launch")),
    };
    let (med, p99, time) =
        time_units(args, world, s, per_unit, || unit(who, &mut a, b.as_mut())).map_err(ctx)?;
    who.check().map_err(ctx)?;
    // NCCL's reductions add in another order; its all-gather moves bits.
    let tolerant = nccl && c.coll != Coll::AllGather;
    let mut col = Col {
        name,
        placement,
        median_us: Some(med),
        p99_us: args.per_iter.then_some(p99),
        time_us: Some(time),
        check: match (check, tolerant) {
            (false, _) => Check::Off,
            (true, false) => Check::Exact,
            (true, true) => Check::Tolerance,
        },
        wrong: 0,
        inexact: 0,
    };
    if check {
        // Reduce-scatter results differ by rank (no digest comparison).
        let tally = |got: &[T], want: &[T], tol: Option<&[f64]>| match c.coll {
            Coll::ReduceScatter => check::tally_own(world, got, want, tol),
            _ => check::tally(world, got, want, tol),
        };
        let mut add = |(w, i): (u64, u64)| {
            col.wrong += w;
            col.inexact += i;
        };
        if let Some(out) = b.as_ref() {
            let (want, tol) = reference::<T>(c, seed, timed_call, per, false, 1, tolerant);
            add(tally(&down(s, out)?, &want, tol.as_deref()));
        }
        for _ in 0..3 {
            run.call += 1;
            s.memcpy_htod(&first_buffer::<T>(c, seed, run.call, in_place, per), &mut a)
                .map_err(cuda("htod"))?;
            if let Some(out) = b.as_mut() {
                poison_dev(s, out)?;
            }
            unit(who, &mut a, b.as_mut()).map_err(ctx)?;
            who.check().map_err(ctx)?;
            let (want, tol) = reference::<T>(c, seed, run.call, per, in_place, per_unit, tolerant);
            let got = down(s, b.as_ref().unwrap_or(&a))?;
            add(tally(&got, &want, tol.as_deref()));
        }
    }
    // The graph goes before the buffers it captured.
    drop(graph);
    Ok(col)
}

/// CUDA-staged MPI call of the run's collective (`colls::mpi_call`) on
/// blocks of `floats` floats (all-reduce: `floats` floats), inputs seeded
/// by `call_no`: D2H to pinned memory, the MPI call, H2D, synchronize;
/// median (and p99) by `-a`; the last result checked as the host MPI
/// columns are (`colls::mpi_check`).
fn staged_mpi(
    run: &mut Run,
    s: &Arc<CudaStream>,
    floats: usize,
    call_no: u64,
) -> Result<Col, String> {
    let (args, world, check, coll) = (run.args, run.world, run.check, run.coll);
    let n = world.size() as usize;
    let (in_len, out_len) = colls::lens(coll, n, floats);
    let ctx = s.context();
    let dsrc = s
        .clone_htod(&verify::input::<f32>(
            MPI_SEED,
            call_no,
            world.rank() as usize,
            in_len,
        ))
        .map_err(cuda("htod"))?;
    let mut ddst = s.alloc_zeros::<f32>(out_len).map_err(cuda("alloc"))?;
    poison_dev(s, &mut ddst)?;
    // SAFETY: page-locked buffers whose contents are written (D2H copy,
    // the MPI call) before they are read.
    let mut hin =
        unsafe { ctx.alloc_pinned_with_flags::<f32>(in_len, 0) }.map_err(cuda("pinned"))?;
    // SAFETY: as above.
    let mut hout =
        unsafe { ctx.alloc_pinned_with_flags::<f32>(out_len, 0) }.map_err(cuda("pinned"))?;
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
            colls::mpi_call(world, coll, a, b);
        }
        s.memcpy_htod(&hout, &mut ddst).map_err(cuda("htod"))?;
        s.synchronize().map_err(cuda("synchronize"))?;
        if it >= args.warmup {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let (med, p99) = stats::samples(world, args.across, &lat);
    let name: &'static str = match coll {
        Coll::AllReduce => "CUDA-staged MPI_Allreduce",
        Coll::ReduceScatter => "CUDA-staged MPI_Reduce_scatter_block",
        Coll::AllGather => "CUDA-staged MPI_Allgather",
    };
    let mut col = Col {
        name,
        placement: "out-of-place",
        median_us: Some(med),
        p99_us: args.per_iter.then_some(p99),
        time_us: None,
        check: match (check, colls::mpi_tolerant(coll)) {
            (false, _) => Check::Off,
            (true, true) => Check::Tolerance,
            (true, false) => Check::Exact,
        },
        wrong: 0,
        inexact: 0,
    };
    if check {
        (col.wrong, col.inexact) = colls::mpi_check(world, coll, call_no, floats, &down(s, &ddst)?);
    }
    Ok(col)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(coll: Coll, rank: usize) -> Call {
        Call {
            coll,
            op: arx::Op::Sum,
            rank,
            n: 3,
        }
    }

    #[test]
    fn in_place_references_follow_nccl_rules() {
        let (seed, k, per) = (7, 11, 8);
        for rank in 0..3 {
            let rs = call(Coll::ReduceScatter, rank);
            let (oop, _) = reference::<f32>(rs, seed, k, per, false, 1, false);
            let (inp, _) = reference::<f32>(rs, seed, k, per, true, 1, false);
            let mine = verify::input::<f32>(seed, k, rank, 3 * per);
            let own = rank * per..(rank + 1) * per;
            assert_eq!(oop.len(), per);
            // In place: this rank's block is the result, the others stay.
            assert_eq!(inp[own.clone()], oop[..]);
            for q in (0..3).filter(|&q| q != rank) {
                assert_eq!(inp[q * per..(q + 1) * per], mine[q * per..(q + 1) * per]);
            }
            // A second in-place call reduces the first one's buffers: block
            // r adds rank r's result and the others' untouched inputs.
            let (two, tol) = reference::<f32>(rs, seed, k, per, true, 2, true);
            let tol = tol.expect("tolerant");
            assert!(tol[own.clone()].iter().all(|&t| t > 0.0));
            assert!(tol
                .iter()
                .enumerate()
                .all(|(i, &t)| own.contains(&i) || t == 0.0));
            let all: Vec<Vec<f32>> = (0..3).map(|r| verify::input(seed, k, r, 3 * per)).collect();
            let first = verify::reference(&all);
            let mut second: Vec<Vec<f32>> = all.clone();
            for (q, b) in second.iter_mut().enumerate() {
                b[q * per..(q + 1) * per].copy_from_slice(&first[q * per..(q + 1) * per]);
            }
            assert_eq!(two[own.clone()], verify::reference(&second)[own]);
            // All-gather: every rank's block, in place or not, any k.
            let ag = call(Coll::AllGather, rank);
            let want: Vec<f32> = (0..3)
                .flat_map(|r| verify::input(seed, k, r, per))
                .collect();
            assert_eq!(reference::<f32>(ag, seed, k, per, false, 1, true).0, want);
            assert_eq!(reference::<f32>(ag, seed, k, per, true, 3, true).0, want);
            let buf = first_buffer::<f32>(ag, seed, k, true, per);
            assert_eq!(
                buf[rank * per..(rank + 1) * per],
                want[rank * per..(rank + 1) * per]
            );
        }
    }
}
