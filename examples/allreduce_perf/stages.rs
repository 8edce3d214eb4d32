//! `--stages`: where the time of one call goes, per size (8 KB, 64 KB,
//! 256 KB, 1 MB, up to `-e`), on the instance it runs on, from the
//! library's own stage trace (`Arx::trace_stages`, `arx::stages`).
//!
//! Per size: `-w` warm-up calls; `-n` untraced calls, each timed alone
//! (`whole`); `-n` traced calls (each stage, and `traced`, the whole of a
//! traced call); the reduction timed alone (`arx::stages::time_reduction`,
//! host instance). Every number is one rank's median over its calls, and
//! the table shows the largest over ranks (the slowest rank's median).
//! `sum` adds the six stage medians; `sum/whole` sets it against the
//! untraced call's median.
//!
//! Verbs fabric: the rail probe (`Arx::probe_rails`) first gives the wire's
//! one-way latency at each size's half (what one lane carries) and its
//! bandwidth. Shm fabric: the wire is the proxy's copy, so `post` / (N−1)
//! is the cost of one peer's copy and `copy GB/s` its rate.
//!
//! GPU instance: staging, publish, the wait and the reduction run inside
//! the kernel, which the host clock cannot see. The table gives the
//! proxy's `post` from the trace, `whole` (barrier, eager call, stream
//! synchronize: the launch and the synchronize included), and `kernel`:
//! CUDA-event time of one arx kernel launched once every peer's flags for
//! its call are already there (per iteration one rank in turn starts 2 ms
//! after the others, and a 64 MiB memset ahead of it on the stream keeps
//! the launch's host time out of the interval): staging + publish + one
//! pass over present flags + the reduction.

use super::*;

/// The sizes `--stages` measures (those up to `-e`).
const SIZES: [usize; 4] = [8 << 10, 64 << 10, 256 << 10, 1 << 20];
/// The sizes `--stages` adds below them when `-b` is given (those from
/// `-b` on): where a call is mostly fixed cost.
const SMALL: [usize; 4] = [8, 64, 512, 2 << 10];

/// Each rank's median of `v` (µs), the largest over ranks; -1 where this
/// rank has no sample on any rank. Collective.
fn slowest_median(world: &SimpleCommunicator, v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = if v.is_empty() {
        -1.0
    } else {
        stats::median_sorted(v)
    };
    stats::scalar(world, Across::Max, m)
}

fn us(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn cell(v: f64) -> String {
    if v < 0.0 {
        "-".into()
    } else {
        format!("{v:.2}")
    }
}

/// One row: the six stages, traced whole, untraced whole, extra columns.
struct Row {
    size: usize,
    stages: [f64; 6],
    traced: f64,
    whole: f64,
    extra: Vec<(&'static str, f64)>,
    wrong: u64,
}

fn print_row(r: &Row, n: usize, shm: bool) {
    // A GPU row has no traced whole: its stages do not add up to a call.
    let sum: f64 = if r.traced < 0.0 {
        -1.0
    } else {
        r.stages.iter().filter(|v| **v >= 0.0).sum()
    };
    let mut line = format!("{:>9}", r.size);
    for v in r.stages {
        line += &format!(" {:>8}", cell(v));
    }
    line += &format!(
        " | {:>8} {:>8} {:>8} {:>9}",
        cell(sum),
        cell(r.traced),
        cell(r.whole),
        if r.whole > 0.0 && sum >= 0.0 {
            format!("{:.2}", sum / r.whole)
        } else {
            "-".into()
        }
    );
    for (_, v) in &r.extra {
        line += &format!(" {:>12}", cell(*v));
    }
    if shm && r.stages[2] > 0.0 && n > 1 {
        let per = r.stages[2] / (n - 1) as f64;
        let gbs = (r.size * (n - 1)) as f64 / (r.stages[2] * 1e3);
        line += &format!(" {:>10} {:>9.2}", cell(per), gbs);
    }
    line += &format!(" {:>6}", r.wrong);
    println!("{line}");
}

fn print_header(extra: &[&str], shm: bool) {
    let mut h = format!("{:>9}", "bytes");
    for s in ["stage", "pickup", "post", "wait", "reduce", "tail"] {
        h += &format!(" {s:>8}");
    }
    h += &format!(
        " | {:>8} {:>8} {:>8} {:>9}",
        "sum", "traced", "whole", "sum/whole"
    );
    for e in extra {
        h += &format!(" {e:>12}");
    }
    if shm {
        h += &format!(" {:>10} {:>9}", "copy/peer", "copy GB/s");
    }
    h += &format!(" {:>6}", "#wrong");
    println!("#{}", &h[1..]);
}

pub(super) fn run_stages(
    run: &mut Run,
    arx: &mut Arx,
    dtypes: &[&'static str],
    small_from: Option<usize>,
    max: usize,
) -> Result<u64, String> {
    let world = run.world;
    let dt = if dtypes.len() == 1 {
        dtypes[0]
    } else {
        "bfloat16"
    };
    let small = SMALL
        .iter()
        .filter(|&&s| small_from.is_some_and(|b| s >= b));
    let sizes: Vec<usize> = small.chain(&SIZES).copied().filter(|&s| s <= max).collect();
    let d = arx.describe();
    let hosts = gather_text(world, &host_name());
    let gpu = arx.cuda_context().cloned();
    let devices = match &gpu {
        Some(ctx) => gather_text(world, &gpu::gpu_desc(ctx)).join("; "),
        None => {
            let mut c = gather_text(world, &cpu_desc());
            c.sort();
            c.dedup();
            format!("host CPUs: {}", c.join("; "))
        }
    };
    let rank0 = world.rank() == 0;
    if rank0 {
        common_header(run, &d, &hosts, &devices);
        println!(
            "# --stages: {dt}, one call per row's size; each column: each rank's median over -n calls (µs), the largest over ranks (-a does not apply)"
        );
        println!("#   stage  = partial copied into the send slot + publish (host side)");
        println!("#   pickup = publish -> the proxy's post begins");
        println!("#   post   = the proxy's post (shm: copies to every peer + flag stores; verbs: posting the RDMA writes)");
        println!("#   wait   = own post done -> every peer's flags seen (peers' skew + their post + wire)");
        println!("#   reduce = rank-order sum of N partials, fp32 accumulator (inside the call)");
        println!("#   tail   = reduce done -> return");
        println!("#   sum = the six medians added; traced = whole traced call; whole = untraced call, timed alone; sum/whole = sum / whole");
    }
    if d.fabric == "verbs" {
        wire_probe(arx, world, &sizes)?;
    } else if rank0 {
        println!("# wire: shm fabric, no rails: the proxy's copy is the wire (copy/peer = post / (N-1), copy GB/s = bytes x (N-1) / post)");
    }
    let mut wrong = 0;
    match gpu {
        None => {
            if rank0 {
                println!("#   reduce-alone = the same reduction on partials in ordinary memory (arx::stages::time_reduction), no flags, no peers");
                println!("#");
                print_header(&["reduce-alone"], d.fabric == "shm");
            }
            for &size in &sizes {
                let row = match dt {
                    "float" => host_size::<f32>(run, arx, size)?,
                    "half" => host_size::<f16>(run, arx, size)?,
                    _ => host_size::<bf16>(run, arx, size)?,
                };
                wrong += row.wrong;
                if rank0 {
                    print_row(&row, d.world, d.fabric == "shm");
                }
            }
        }
        Some(ctx) => {
            if rank0 {
                println!("# GPU instance: stage, pickup, wait, reduce and tail run inside the kernel, out of the host clock's sight ('-').");
                println!("#   kernel = CUDA-event time of one arx kernel launched when every peer's flags for its call are already there");
                println!("#            (one rank in turn starts 2 ms after the others; a 64 MiB memset ahead keeps the launch's host time out):");
                println!("#            staging + publish + one pass over present flags + the reduction, on the GPU");
                println!("#   whole  = barrier, one eager call, stream synchronize (launch and synchronize included)");
                println!("#");
                print_header(&["kernel"], false);
            }
            for &size in &sizes {
                let row = match dt {
                    "float" => gpu_size::<f32>(run, arx, &ctx, size)?,
                    "half" => gpu_size::<f16>(run, arx, &ctx, size)?,
                    _ => gpu_size::<bf16>(run, arx, &ctx, size)?,
                };
                wrong += row.wrong;
                if rank0 {
                    print_row(&row, d.world, false);
                }
            }
        }
    }
    Ok(wrong)
}

/// The rail probe at each size's half (one lane's share of a call), printed
/// by rank 0. Collective.
fn wire_probe(arx: &mut Arx, world: &SimpleCommunicator, sizes: &[usize]) -> Result<(), String> {
    let slot = arx.describe().slot_bytes;
    let opts = arx::ProbeOptions {
        sizes: sizes.iter().map(|s| s / 2).filter(|&s| s <= slot).collect(),
        iters: 200,
        warmup: 20,
        ..Default::default()
    };
    let probes = arx.probe_rails(&opts).map_err(|e| e.to_string())?;
    // Each rank measured its own peers; rank 0 prints its own view.
    if world.rank() == 0 {
        println!("# wire (Verbs rail probe, rank 0's view; one-way = half the median ping-pong round trip, per lane, at each size's half):");
        for p in &probes {
            if let Some(via) = p.relayed_by {
                println!("#   peer {} relayed by rank {via}: not probed", p.peer);
                continue;
            }
            let lat: Vec<String> = p
                .latency
                .iter()
                .map(|l| format!("{} B {:.2} us", l.bytes, us(l.median)))
                .collect();
            let bw = p
                .bandwidth
                .as_ref()
                .map_or("-".into(), |b| format!("{:.2} GB/s", b.gbps));
            println!(
                "#   peer {} rail {} lane {} ({} -> {}): one-way {} | bandwidth {bw}",
                p.peer,
                p.rail,
                p.lane,
                p.device,
                p.peer_device,
                lat.join(", ")
            );
        }
    }
    Ok(())
}

const SEED: u64 = 0x57a9_e500;

fn host_size<T: Element>(run: &mut Run, arx: &mut Arx, size: usize) -> Result<Row, String> {
    let (args, world) = (run.args, run.world);
    let count = size / std::mem::size_of::<T>();
    let rank = world.rank() as usize;
    let n = world.size() as usize;
    let iters = args.iters.max(1);
    let input = verify::input::<T>(SEED, size as u64, rank, count);
    let want = verify::expected::<T>(SEED, size as u64, n, count);
    let mut out = vec![T::from_f32(0.0); count];
    let fail = |e: arx::Error| format!("--stages, {size} bytes: {e}");
    for _ in 0..args.warmup {
        arx.allreduce_host(&input, &mut out).map_err(fail)?;
    }
    world.barrier();
    let mut whole = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        arx.allreduce_host(&input, &mut out).map_err(fail)?;
        whole.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let mut wrong = verify::count_wrong(&out, &want) as u64;
    arx.trace_stages(true);
    world.barrier();
    let mut per: [Vec<f64>; 6] = Default::default();
    let mut traced = Vec::with_capacity(iters);
    for _ in 0..iters {
        verify::poison(&mut out);
        arx.allreduce_host(&input, &mut out).map_err(fail)?;
        let s = arx.last_stages();
        for (i, (_, d)) in s.named().iter().enumerate() {
            if let Some(d) = d {
                per[i].push(us(*d));
            }
        }
        if let Some(w) = s.whole {
            traced.push(us(w));
        }
    }
    arx.trace_stages(false);
    wrong += verify::count_wrong(&out, &want) as u64;
    let alone = us(arx::stages::time_reduction::<T>(n, count, iters));
    let mut stages = [0.0; 6];
    for (i, v) in per.iter_mut().enumerate() {
        stages[i] = slowest_median(world, v);
    }
    let mut wrongs = 0u64;
    world.all_reduce_into(&wrong, &mut wrongs, mpi::collective::SystemOperation::sum());
    Ok(Row {
        size,
        stages,
        traced: slowest_median(world, &mut traced),
        whole: slowest_median(world, &mut whole),
        extra: vec![("reduce-alone", stats::scalar(world, Across::Max, alone))],
        wrong: wrongs,
    })
}

fn gpu_size<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    run: &mut Run,
    arx: &mut Arx,
    ctx: &Arc<arx::cudarc::driver::CudaContext>,
    size: usize,
) -> Result<Row, String> {
    use arx::cudarc::driver::sys::CUevent_flags;
    let (args, world) = (run.args, run.world);
    let count = size / std::mem::size_of::<T>();
    let rank = world.rank() as usize;
    let n = world.size() as usize;
    let iters = args.iters.max(n);
    // SAFETY: every slice below is used on `s` only (as in `run_gpu`).
    unsafe { ctx.disable_event_tracking() };
    let s = ctx.new_stream().map_err(cuda("new_stream"))?;
    let input = verify::input::<T>(SEED, size as u64, rank, count);
    let want = verify::expected::<T>(SEED, size as u64, n, count);
    let din = s.clone_htod(&input).map_err(cuda("htod"))?;
    let mut dout = s.alloc_zeros::<T>(count).map_err(cuda("alloc"))?;
    let mut busy = s.alloc_zeros::<u8>(64 << 20).map_err(cuda("alloc"))?;
    let ev0 = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(cuda("event"))?;
    let ev1 = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(cuda("event"))?;
    let fail = |e: arx::Error| format!("--stages, {size} bytes: {e}");
    for _ in 0..args.warmup {
        arx.allreduce(&din, &mut dout, &s).map_err(fail)?;
    }
    s.synchronize().map_err(cuda("synchronize"))?;
    let mut whole = Vec::with_capacity(iters);
    for _ in 0..iters {
        world.barrier();
        let t = Instant::now();
        arx.allreduce(&din, &mut dout, &s).map_err(fail)?;
        s.synchronize().map_err(cuda("synchronize"))?;
        whole.push(t.elapsed().as_secs_f64() * 1e6);
    }
    arx.trace_stages(true);
    let mut kernel = vec![];
    let mut post = vec![];
    for i in 0..iters {
        world.barrier();
        if i % n == rank {
            std::thread::sleep(std::time::Duration::from_millis(2));
            s.memset_zeros(&mut busy).map_err(cuda("memset"))?;
            ev0.record(&s).map_err(cuda("event record"))?;
            arx.allreduce(&din, &mut dout, &s).map_err(fail)?;
            ev1.record(&s).map_err(cuda("event record"))?;
            s.synchronize().map_err(cuda("synchronize"))?;
            kernel.push(f64::from(ev0.elapsed_ms(&ev1).map_err(cuda("elapsed"))?) * 1e3);
        } else {
            arx.allreduce(&din, &mut dout, &s).map_err(fail)?;
            s.synchronize().map_err(cuda("synchronize"))?;
        }
        // Every peer ended this call, so it had this rank's flags: this
        // rank's proxy has posted it.
        world.barrier();
        if let Some(p) = arx.last_stages().post {
            post.push(us(p));
        }
    }
    arx.trace_stages(false);
    arx.check().map_err(fail)?;
    let got = s.clone_dtoh(&dout).map_err(cuda("dtoh"))?;
    let wrong = verify::count_wrong(&got, &want) as u64;
    let mut wrongs = 0u64;
    world.all_reduce_into(&wrong, &mut wrongs, mpi::collective::SystemOperation::sum());
    let mut stages = [-1.0; 6];
    stages[2] = slowest_median(world, &mut post);
    Ok(Row {
        size,
        stages,
        traced: -1.0,
        whole: slowest_median(world, &mut whole),
        extra: vec![("kernel", slowest_median(world, &mut kernel))],
        wrong: wrongs,
    })
}
