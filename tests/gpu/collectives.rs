//! The two-shot all-reduce, reduce_scatter and all_gather on the GPU side
//! (`kernels/twoshot.cuh`): the one-shot cases rerun under two-shot;
//! two-shot against one-shot and the reference bit for bit; reduce_scatter
//! and all_gather against an independent reference (`arx::verify`), eager
//! and under graph replay; GPU and host calls of one collective mixed
//! across ranks and calls; ranks on different algorithms failing at once.

use arx::{Algo, Op};

use super::*;

/// Reruns one-shot cases with every instance forced to two-shot: lengths
/// 1 to the slot, out of place, in place, unaligned; graph replays; edge
/// values; two streams; chunked calls eager, in graphs and on a second
/// stream; every op eager and in graphs.
pub(super) fn twoshot_reruns(ctx: &Ctx, st: Staging) -> R {
    let cases: &[(&str, Case)] = &[
        ("lengths", lengths),
        ("graph_replays", graph_replays),
        ("edges", edges),
        ("two_streams", two_streams),
        ("chunked_eager", chunked_eager),
        ("chunked_graph", chunked_graph),
        ("chunked_two_streams", chunked_two_streams),
        ("ops_eager", ops_eager),
        ("ops_graph", ops_graph),
    ];
    with_algo(Algo::TwoShot, || {
        for (name, case) in cases {
            case(ctx, st).map_err(|x| format!("{name} under two-shot: {x}"))?;
        }
        Ok(())
    })
}

fn results_of<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    st: Staging,
    algo: Algo,
    calls: &[(Op, u64, usize)],
) -> R<Vec<Vec<T>>> {
    let (mut arx, s) = build_opts(
        ctx,
        st,
        Duration::from_secs(20),
        Some(SMALL_SLOT),
        Some(algo),
    )?;
    let mut out = Vec::new();
    for &(op, call, n) in calls {
        let (mine, want) = op_data::<T>(ctx, op, call, n);
        let din = up(&s, &mine)?;
        let mut dout = poisoned::<T>(&s, n)?;
        arx.allreduce_op(&din, &mut dout, op, &s)
            .map_err(e("allreduce_op"))?;
        arx.check().map_err(e("check"))?;
        let got = down(&s, &dout)?;
        ctx.fold(&got);
        exact(
            &format!(
                "{} {op} call {call}: {n} x {}",
                algo.name(),
                T::DTYPE.name()
            ),
            op,
            &got,
            &want,
        )?;
        out.push(got);
    }
    Ok(out)
}

fn versus_of<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    st: Staging,
) -> R<usize> {
    // Lengths 1, odd, a multiple of the world (exact shards), chunked.
    let m = SMALL_SLOT / std::mem::size_of::<T>();
    let mut calls = Vec::new();
    for (i, op) in Op::ALL.into_iter().enumerate() {
        for (k, n) in [1, 77, 24 * ctx.n, 2 * m + 3].into_iter().enumerate() {
            calls.push((op, 0x7500_0000 | (i as u64) << 8 | k as u64, n));
        }
    }
    let two = results_of::<T>(ctx, st, Algo::TwoShot, &calls)?;
    let one = results_of::<T>(ctx, st, Algo::OneShot, &calls)?;
    for ((a, b), (op, call, n)) in two.iter().zip(&one).zip(&calls) {
        if bytemuck::cast_slice::<T, u8>(a) != bytemuck::cast_slice::<T, u8>(b) {
            return Err(format!(
                "{op} call {call}: {n} x {}: two-shot and one-shot bits differ",
                T::DTYPE.name()
            ));
        }
    }
    Ok(calls.len())
}

/// Every op and dtype at 1, 77, 24·N and 2m+3 elements: the two-shot
/// result equals the one-shot result bit for bit, and both the reference.
pub(super) fn twoshot_vs_oneshot(ctx: &Ctx, st: Staging) -> R {
    let b = versus_of::<bf16>(ctx, st)?;
    let h = versus_of::<f16>(ctx, st)?;
    let f = versus_of::<f32>(ctx, st)?;
    ctx.say(format!(
        "bf16 {b}, f16 {h}, f32 {f} calls: two-shot == one-shot == reference"
    ));
    Ok(())
}

/// This rank's reduce_scatter input (`N·n` edge values) and its expected
/// block.
fn rs_data<T: Element>(ctx: &Ctx, op: Op, call: u64, n: usize) -> (Vec<T>, Vec<T>) {
    let all = verify::expected_op::<T>(op, true, SEED, call, ctx.n, ctx.n * n);
    (
        verify::input_edges::<T>(SEED, call, ctx.rank, ctx.n * n),
        all[ctx.rank * n..(ctx.rank + 1) * n].to_vec(),
    )
}

/// This rank's all_gather input and every rank's, concatenated.
fn ag_data<T: Element>(ctx: &Ctx, call: u64, n: usize) -> (Vec<T>, Vec<T>) {
    let want: Vec<T> = (0..ctx.n)
        .flat_map(|r| verify::input::<T>(SEED, call, r, n))
        .collect();
    (verify::input::<T>(SEED, call, ctx.rank, n), want)
}

/// One checked reduce_scatter (`in_place`: on the `N·n` buffer).
fn rs_call<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
    op: Op,
    call: u64,
    n: usize,
    in_place: bool,
) -> R {
    let (mine, want) = rs_data::<T>(ctx, op, call, n);
    let got = if in_place {
        let mut buf = up(s, &mine)?;
        arx.reduce_scatter_in_place_op(&mut buf, op, s)
            .map_err(e("reduce_scatter_in_place_op"))?;
        arx.check().map_err(e("check"))?;
        let all = down(s, &buf)?;
        // The other blocks are left as they were.
        for q in (0..ctx.n).filter(|&q| q != ctx.rank) {
            let r = q * n..(q + 1) * n;
            if bytemuck::cast_slice::<T, u8>(&all[r.clone()])
                != bytemuck::cast_slice::<T, u8>(&mine[r])
            {
                return Err(format!(
                    "reduce_scatter in place call {call}: block {q} changed"
                ));
            }
        }
        all[ctx.rank * n..(ctx.rank + 1) * n].to_vec()
    } else {
        let din = up(s, &mine)?;
        let mut dout = poisoned::<T>(s, n)?;
        arx.reduce_scatter_op(&din, &mut dout, op, s)
            .map_err(e("reduce_scatter_op"))?;
        arx.check().map_err(e("check"))?;
        down(s, &dout)?
    };
    // Not folded into the case's digest: each rank holds another block
    // (checked bit for bit against the reference above instead).
    exact(
        &format!(
            "reduce_scatter {op} call {call}: {n} x {} per rank{}",
            T::DTYPE.name(),
            if in_place { " in place" } else { "" }
        ),
        op,
        &got,
        &want,
    )
}

/// One checked all_gather (`in_place`: on the `N·n` buffer, the other
/// blocks poisoned first).
fn ag_call<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
    call: u64,
    n: usize,
    in_place: bool,
) -> R {
    let (mine, want) = ag_data::<T>(ctx, call, n);
    let got = if in_place {
        let mut h = vec![T::zeroed(); ctx.n * n];
        verify::poison(&mut h);
        h[ctx.rank * n..(ctx.rank + 1) * n].copy_from_slice(&mine);
        let mut buf = up(s, &h)?;
        arx.all_gather_in_place(&mut buf, s)
            .map_err(e("all_gather_in_place"))?;
        arx.check().map_err(e("check"))?;
        down(s, &buf)?
    } else {
        let din = up(s, &mine)?;
        let mut dout = poisoned::<T>(s, ctx.n * n)?;
        arx.all_gather(&din, &mut dout, s)
            .map_err(e("all_gather"))?;
        arx.check().map_err(e("check"))?;
        down(s, &dout)?
    };
    ctx.fold(&got);
    compare(
        &format!(
            "all_gather call {call}: {n} x {} per rank{}",
            T::DTYPE.name(),
            if in_place { " in place" } else { "" }
        ),
        &got,
        &want,
    )
}

fn collectives_of<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
) -> R<usize> {
    // A chunk covers max_count / N elements of every block: 2c+3 makes 3.
    let c = arx.max_count::<T>() / ctx.n;
    let mut calls = 0;
    for (k, n) in [1, 7, 77, 1000, 2 * c + 3].into_iter().enumerate() {
        for in_place in [false, true] {
            let base = 0x5C00_0000
                | (T::DTYPE.code() as u64) << 16
                | (k as u64) << 8
                | u64::from(in_place) << 4;
            for (i, op) in Op::ALL.into_iter().enumerate() {
                rs_call::<T>(ctx, arx, s, op, base | i as u64, n, in_place)?;
                calls += 1;
            }
            ag_call::<T>(ctx, arx, s, base | 0xF, n, in_place)?;
            calls += 1;
        }
    }
    Ok(calls)
}

/// reduce_scatter (every op) and all_gather on every dtype at 1, 7, 77,
/// 1000 and 2c+3 elements per rank (c: a chunk's elements per block),
/// out of place and in place; then an all-reduce on the same instance.
pub(super) fn collectives_eager(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = build_small(ctx, st, Duration::from_secs(20))?;
    let b = collectives_of::<bf16>(ctx, &mut arx, &s)?;
    let h = collectives_of::<f16>(ctx, &mut arx, &s)?;
    let f = collectives_of::<f32>(ctx, &mut arx, &s)?;
    checked_call::<f32>(ctx, &mut arx, &s, 0x5CF0_0000, 1001, Placement::InPlace)
        .map_err(|x| format!("an all-reduce after the collectives: {x}"))?;
    ctx.say(format!(
        "bf16 {b}, f16 {h}, f32 {f} reduce_scatter/all_gather calls bit-exact"
    ));
    Ok(())
}

/// A chunked reduce_scatter and an all_gather captured into one graph and
/// replayed with new input before each replay.
pub(super) fn collectives_graph(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = build_small(ctx, st, Duration::from_secs(20))?;
    let replays = if ctx.quick { 5 } else { 30 };
    let n1 = 2 * arx.max_count::<f32>() / ctx.n + 3;
    let n2 = 501;
    let mut in1 = poisoned::<f32>(&s, ctx.n * n1)?;
    let mut out1 = poisoned::<f32>(&s, n1)?;
    let mut in2 = poisoned::<bf16>(&s, n2)?;
    let mut out2 = poisoned::<bf16>(&s, ctx.n * n2)?;
    let g = capture(&s, "collectives under capture", || {
        arx.reduce_scatter(&in1, &mut out1, &s)
            .and_then(|()| arx.all_gather(&in2, &mut out2, &s))
    })?;
    for i in 0..replays as u64 {
        let (x1, w1) = rs_data::<f32>(ctx, Op::Sum, 0x5D00_0000 + 2 * i, n1);
        let (x2, w2) = ag_data::<bf16>(ctx, 0x5D00_0001 + 2 * i, n2);
        s.memcpy_htod(&x1, &mut in1).map_err(e("htod"))?;
        s.memcpy_htod(&x2, &mut in2).map_err(e("htod"))?;
        poison_dev(&s, &mut out1)?;
        poison_dev(&s, &mut out2)?;
        g.launch().map_err(e("graph launch"))?;
        let got1 = down(&s, &out1)?;
        let got2 = down(&s, &out2)?;
        arx.check().map_err(e("check"))?;
        // got1 is this rank's block (differs by rank): not folded.
        ctx.fold(&got2);
        exact(
            &format!("replay {i}: reduce_scatter {n1} x f32"),
            Op::Sum,
            &got1,
            &w1,
        )?;
        compare(&format!("replay {i}: all_gather {n2} x bf16"), &got2, &w2)?;
    }
    rs_call::<f16>(ctx, &mut arx, &s, Op::Max, 0x5DF0_0000, 33, false)
        .map_err(|x| format!("an eager call after the replays: {x}"))?;
    ctx.say(format!(
        "{replays} replays of a {}-chunk reduce_scatter and an all_gather; then an eager call",
        n1.div_ceil(arx.max_count::<f32>() / ctx.n)
    ));
    Ok(())
}

/// Call k runs on the GPU on ranks r with r + k even, on the host on the
/// others: reduce_scatter, all_gather and all-reduces of 1 KiB and 1 MiB
/// (one-shot and, from 3 ranks, two-shot under ARX_ALGO=auto) must agree.
pub(super) fn gpu_and_host_mixed(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = build(ctx, st, Duration::from_secs(20))?;
    let rounds = if ctx.quick { 4 } else { 12 };
    for k in 0..rounds as u64 {
        let gpu = (ctx.rank as u64 + k) % 2 == 0;
        let call = 0x6A00_0000 + 8 * k;
        let n = 300 + k as usize;
        // reduce_scatter
        let (x, want) = rs_data::<f32>(ctx, Op::Sum, call, n);
        let got = if gpu {
            let din = up(&s, &x)?;
            let mut dout = poisoned::<f32>(&s, n)?;
            arx.reduce_scatter(&din, &mut dout, &s)
                .map_err(e("reduce_scatter"))?;
            down(&s, &dout)?
        } else {
            let mut out = vec![0f32; n];
            verify::poison(&mut out);
            arx.reduce_scatter_host(&x, &mut out)
                .map_err(e("reduce_scatter_host"))?;
            out
        };
        arx.check().map_err(e("check"))?;
        exact(
            &format!("round {k} reduce_scatter (gpu {gpu})"),
            Op::Sum,
            &got,
            &want,
        )?;
        // all_gather
        let (x, want) = ag_data::<bf16>(ctx, call + 1, n);
        let got = if gpu {
            let din = up(&s, &x)?;
            let mut dout = poisoned::<bf16>(&s, ctx.n * n)?;
            arx.all_gather(&din, &mut dout, &s)
                .map_err(e("all_gather"))?;
            down(&s, &dout)?
        } else {
            let mut out = vec![bf16::ZERO; ctx.n * n];
            verify::poison(&mut out);
            arx.all_gather_host(&x, &mut out)
                .map_err(e("all_gather_host"))?;
            out
        };
        arx.check().map_err(e("check"))?;
        compare(&format!("round {k} all_gather (gpu {gpu})"), &got, &want)?;
        // all-reduces below and above the two-shot threshold
        for (j, n) in [256usize, 256 << 10].into_iter().enumerate() {
            let (x, want) = call_data::<f32>(ctx, call + 2 + j as u64, n);
            let got = allreduce_either(&mut arx, &s, gpu, &x)?;
            arx.check().map_err(e("check"))?;
            ctx.fold(&got);
            compare(
                &format!("round {k} all-reduce of {n} x f32 (gpu {gpu})"),
                &got,
                &want,
            )?;
        }
    }
    ctx.say(format!(
        "{rounds} rounds of reduce_scatter, all_gather and two all-reduces, GPU and host calls alternating across ranks"
    ));
    Ok(())
}

/// The last rank chooses one-shot, the others two-shot: start-up fails on
/// every rank (a GPU instance's too) with a mismatch naming `ARX_ALGO`
/// and the last rank, well within the start-up bound.
pub(super) fn algo_mismatch(ctx: &Ctx, st: Staging) -> R {
    let last = ctx.n - 1;
    let algo = if ctx.rank == last {
        Algo::OneShot
    } else {
        Algo::TwoShot
    };
    let t = Instant::now();
    match build_opts(ctx, st, Duration::from_secs(4), None, Some(algo)) {
        Ok(_) => Err("ranks on different algorithms: start-up returned Ok".into()),
        Err(m) if m.contains("ARX_ALGO") && m.contains(&format!("rank {last}")) => {
            if t.elapsed() > Duration::from_secs(30) {
                return Err(format!("the algorithm mismatch took {:?}", t.elapsed()));
            }
            Ok(())
        }
        Err(m) => Err(format!("ranks on different algorithms: {m}")),
    }
}

/// The last rank reduce-scatters (in place) what the others all-reduce
/// two-shot: the same steps and bytes, told apart only by the flag word's
/// `ARX_FLAG_ALLREDUCE` (the kernel's and the host side's), so every rank
/// fails at once with `CallMismatch` naming the two-shot step; without
/// the bit every rank returned Ok.
pub(super) fn twoshot_vs_reduce_scatter(ctx: &Ctx, st: Staging) -> R {
    let timeout = Duration::from_secs(4);
    let (mut arx, s) = build_opts(ctx, st, timeout, None, Some(Algo::TwoShot))?;
    let lone = ctx.rank == ctx.n - 1;
    let (msg, _, _) = expect_mismatch::<f32>(
        ctx,
        &mut arx,
        &s,
        "a reduce_scatter against a two-shot all-reduce",
        0x7700_0101,
        1024 * ctx.n,
        timeout / 2,
        |a, i, o| {
            if lone {
                a.reduce_scatter_in_place(o, &s)
            } else {
                a.allreduce(i, o, &s)
            }
        },
    )?;
    if !msg.contains("two-shot allreduce") || !msg.contains("a reduce_scatter") {
        return Err(format!("the mismatch does not name both calls: {msg}"));
    }
    Ok(())
}

/// Two-shot under sustained load, the shape that stalled in
/// `allreduce_perf -A twoshot -G 10` (3 and 4 ranks under MPS): ten
/// calls of one size captured into one graph, replayed back to back with
/// no host work in between, every output checked after each batch. Sizes
/// 256 KB and 128 KB of bf16 (one chunk of the default slot: the gather
/// step published by another block than the scatter step); quick: fewer
/// replays. Bounded: 20000 calls in all at full length (a few seconds).
pub(super) fn twoshot_sustained(ctx: &Ctx, st: Staging) -> R {
    const CALLS: usize = 10;
    let (batches, per_batch) = if ctx.quick { (2, 20) } else { (10, 100) };
    let (mut arx, s) = build_opts(ctx, st, Duration::from_secs(10), None, Some(Algo::TwoShot))?;
    let mut total = 0usize;
    for (k, count) in [131072usize, 65536].into_iter().enumerate() {
        let first = 0x6100_0000 + ((k as u64) << 16);
        let data: Vec<(Vec<bf16>, Vec<bf16>)> = (0..CALLS as u64)
            .map(|i| wide_data::<bf16>(ctx, first + i, count))
            .collect();
        let ins: Vec<CudaSlice<bf16>> = data.iter().map(|(x, _)| up(&s, x)).collect::<R<_>>()?;
        let mut outs: Vec<CudaSlice<bf16>> = (0..CALLS)
            .map(|_| poisoned::<bf16>(&s, count))
            .collect::<R<_>>()?;
        let g = capture(&s, "under capture", || {
            ins.iter()
                .zip(outs.iter_mut())
                .try_for_each(|(i, o)| arx.allreduce(i, o, &s).map_err(e("allreduce")))
        })?;
        for b in 0..batches {
            for o in outs.iter_mut() {
                poison_dev(&s, o)?;
            }
            for _ in 0..per_batch {
                g.launch().map_err(e("graph launch"))?;
            }
            s.synchronize().map_err(e("sync"))?;
            arx.check().map_err(|x| {
                format!("{count} x bf16, batch {b} of {per_batch} replays of {CALLS} calls: {x}")
            })?;
            for (c, (o, (_, want))) in outs.iter().zip(&data).enumerate() {
                let got = down(&s, o)?;
                compare(
                    &format!("{count} x bf16, batch {b}, call {c} of the graph"),
                    &got,
                    want,
                )?;
                if b + 1 == batches {
                    ctx.fold(&got);
                }
            }
            total += per_batch * CALLS;
        }
        drop(g);
    }
    ctx.say(format!(
        "{total} two-shot calls (256 KB and 128 KB bf16) in graphs of {CALLS}, replayed back to back"
    ));
    Ok(())
}

/// Two-shot in place under sustained load, the other shape that stalled in
/// `allreduce_perf -A twoshot -G 10` (65536 bf16, 3 ranks, in place): each
/// graph holds, per call, a device copy of the call's pristine input into
/// its buffer and the in-place call, so replays run back to back with no
/// host work and every replay reduces the same inputs; every buffer is
/// checked after each batch. Bounded: 10000 calls at full length. (The
/// stall it guards against, an election race between the two calls of one
/// launch, came about once in 80000 calls: this case alone does not
/// reproduce it reliably; `ARX_PERF_STALL=1 scripts/gpu-perf` does.)
pub(super) fn twoshot_sustained_in_place(ctx: &Ctx, st: Staging) -> R {
    const CALLS: usize = 10;
    const COUNT: usize = 65536;
    let (batches, per_batch) = if ctx.quick { (2, 20) } else { (10, 100) };
    let (mut arx, s) = build_opts(ctx, st, Duration::from_secs(10), None, Some(Algo::TwoShot))?;
    let data: Vec<(Vec<bf16>, Vec<bf16>)> = (0..CALLS as u64)
        .map(|i| wide_data::<bf16>(ctx, 0x6200_0000 + i, COUNT))
        .collect();
    let pristine: Vec<CudaSlice<bf16>> = data.iter().map(|(x, _)| up(&s, x)).collect::<R<_>>()?;
    let mut bufs: Vec<CudaSlice<bf16>> = (0..CALLS)
        .map(|_| poisoned::<bf16>(&s, COUNT))
        .collect::<R<_>>()?;
    let g = capture(&s, "under capture", || {
        pristine.iter().zip(bufs.iter_mut()).try_for_each(|(p, b)| {
            s.memcpy_dtod(p, b).map_err(e("memcpy_dtod"))?;
            arx.allreduce_in_place(b, &s)
                .map_err(e("allreduce_in_place"))
        })
    })?;
    let mut total = 0usize;
    for b in 0..batches {
        for _ in 0..per_batch {
            g.launch().map_err(e("graph launch"))?;
        }
        s.synchronize().map_err(e("sync"))?;
        arx.check().map_err(|x| {
            format!(
                "{COUNT} x bf16 in place, batch {b} of {per_batch} replays of {CALLS} calls: {x}"
            )
        })?;
        for (c, (o, (_, want))) in bufs.iter().zip(&data).enumerate() {
            let got = down(&s, o)?;
            compare(
                &format!("{COUNT} x bf16 in place, batch {b}, call {c} of the graph"),
                &got,
                want,
            )?;
            if b + 1 == batches {
                ctx.fold(&got);
            }
        }
        total += per_batch * CALLS;
    }
    drop(g);
    ctx.say(format!(
        "{total} in-place two-shot calls (128 KB bf16) in graphs of {CALLS}, replayed back to back"
    ));
    Ok(())
}

/// Issue 10's "one answer" at large sizes on the GPU side (on request
/// only: `ARX_GPU_TEST_CASES=large`): 64 MiB calls, and calls one element
/// longer than one and three slots, of bf16, f16 and f32, sum and max, by
/// one-shot, two-shot (also in place) and the automatic choice, each on an
/// instance of the default slot, eager and as a captured graph replayed
/// into a poisoned output; every result's bytes equal the reference of
/// `tests/common/large.rs` (written without the library), hence equal
/// across algorithms, launch modes and ranks.
pub(super) fn large_one_answer(ctx: &Ctx, st: Staging) -> R {
    large::self_check().map_err(|x| format!("the reference's own check: {x}"))?;
    let mut insts = Vec::new();
    for algo in [Algo::OneShot, Algo::TwoShot, Algo::Auto] {
        let (arx, s) = build_opts(ctx, st, Duration::from_secs(60), None, Some(algo))?;
        insts.push((algo, arx, s));
    }
    let mut call = 0x7a00_0000;
    let b = large_of::<bf16>(ctx, &mut insts, &mut call)?;
    let h = large_of::<f16>(ctx, &mut insts, &mut call)?;
    let f = large_of::<f32>(ctx, &mut insts, &mut call)?;
    ctx.say(format!(
        "bf16 {b}, f16 {h}, f32 {f} calls (up to 64 MiB; eager and graph) == reference"
    ));
    Ok(())
}

fn large_of<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    insts: &mut [(Algo, Arx, Arc<CudaStream>)],
    call: &mut u64,
) -> R<usize> {
    let m = insts[0].1.max_count::<T>();
    let big = (64 << 20) / std::mem::size_of::<T>();
    let mut calls = 0;
    for count in [m + 1, 3 * m + 1, big] {
        *call += 1;
        let inputs = large::inputs::<T>(SEED, *call, ctx.n, count);
        let mine = &inputs[ctx.rank];
        for op in [Op::Sum, Op::Max] {
            let want = large::reference(op, &inputs);
            for (algo, arx, s) in insts.iter_mut() {
                let what = |how: &str| {
                    format!(
                        "{op} call {call} ({count} x {}, {}, {how})",
                        T::DTYPE.name(),
                        algo.name()
                    )
                };
                let same = |how: &str, got: &[T]| match large::first_diff(got, &want) {
                    None => Ok(()),
                    Some(i) => Err(format!(
                        "{}: first wrong at {i}: got bits {:02x?}, want {:02x?}",
                        what(how),
                        bytemuck::bytes_of(&got[i]),
                        bytemuck::bytes_of(&want[i])
                    )),
                };
                // Eager, out of place.
                let din = up(s, mine)?;
                let mut dout = poisoned::<T>(s, count)?;
                arx.allreduce_op(&din, &mut dout, op, s)
                    .map_err(|x| format!("{}: {x}", what("eager")))?;
                arx.check().map_err(|x| format!("{}: {x}", what("eager")))?;
                let got = down(s, &dout)?;
                same("eager", &got)?;
                ctx.fold(&got);
                // The same call captured, replayed into a poisoned output.
                poison_dev(s, &mut dout)?;
                let g = capture(s, &what("under capture"), || {
                    arx.allreduce_op(&din, &mut dout, op, s)
                })?;
                g.launch().map_err(e("graph launch"))?;
                let got = down(s, &dout)?;
                arx.check().map_err(|x| format!("{}: {x}", what("graph")))?;
                same("graph", &got)?;
                drop(g);
                calls += 2;
                if *algo == Algo::TwoShot {
                    let mut buf = up(s, mine)?;
                    arx.allreduce_in_place_op(&mut buf, op, s)
                        .map_err(|x| format!("{}: {x}", what("in place")))?;
                    arx.check()
                        .map_err(|x| format!("{}: {x}", what("in place")))?;
                    same("in place", &down(s, &buf)?)?;
                    calls += 1;
                }
            }
        }
    }
    Ok(calls)
}

/// Rank `rank`'s input of broadcast call `call`: edge values and, at
/// seeded positions, raw bit patterns (NaN payloads, signalling and
/// negative NaNs, subnormals) that must arrive bit for bit; never the
/// poison (all ones). The same generator as tests/mpi's.
fn bcast_input<T: Element>(call: u64, rank: usize, n: usize) -> Vec<T> {
    let mut v = verify::input_edges::<T>(SEED, call, rank, n);
    let size = std::mem::size_of::<T>();
    let raw: &[u32] = if size == 4 {
        &[
            0x7f80_0001,
            0xffc0_dead,
            0x7fbf_ffff,
            0x8000_0001,
            0x0000_0001,
        ]
    } else {
        &[0x7c01, 0xfc01, 0x7f81, 0xff81, 0x8001, 0x7dea]
    };
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut v);
    for i in 0..n {
        let k = (call as usize).wrapping_mul(31).wrapping_add(i * 7) % 11;
        if k < raw.len() {
            let w = raw[(k + rank) % raw.len()].to_le_bytes();
            bytes[i * size..(i + 1) * size].copy_from_slice(&w[..size]);
        }
    }
    v
}

/// `got` holds exactly `want`'s bits (a NaN's payload included).
fn same_bits<T: Element>(what: &str, got: &[T], want: &[T]) -> R {
    let (g, w): (&[u8], &[u8]) = (bytemuck::cast_slice(got), bytemuck::cast_slice(want));
    if g == w {
        return Ok(());
    }
    let size = std::mem::size_of::<T>();
    let i = (0..got.len().min(want.len()))
        .find(|&i| g[i * size..(i + 1) * size] != w[i * size..(i + 1) * size])
        .unwrap_or(0);
    Err(format!(
        "{what}: {} elements, want {}; first difference at {i}: {:02x?} want {:02x?}",
        got.len(),
        want.len(),
        g.get(i * size..(i + 1) * size),
        w.get(i * size..(i + 1) * size),
    ))
}

/// One checked broadcast of `n` elements from `root` (`how`: out of
/// place, in place, or one element past a 16-byte boundary through
/// `broadcast_raw`); a non-root's output (its buffer, in place) poisoned.
#[allow(clippy::too_many_arguments)]
fn bcast_call<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
    call: u64,
    n: usize,
    root: usize,
    how: Placement,
) -> R {
    let mine = bcast_input::<T>(call, ctx.rank, n);
    let want = bcast_input::<T>(call, root, n);
    let got: Vec<T> = match how {
        Placement::OutOfPlace => {
            let din = up(s, &mine)?;
            let mut dout = poisoned::<T>(s, n)?;
            arx.broadcast(&din, &mut dout, root, s)
                .map_err(e("broadcast"))?;
            arx.check().map_err(e("check"))?;
            // The input is left as it was.
            same_bits("broadcast input", &down(s, &din)?, &mine)?;
            down(s, &dout)?
        }
        Placement::InPlace => {
            let mut buf = if ctx.rank == root {
                up(s, &mine)?
            } else {
                poisoned::<T>(s, n)?
            };
            arx.broadcast_in_place(&mut buf, root, s)
                .map_err(e("broadcast_in_place"))?;
            arx.check().map_err(e("check"))?;
            down(s, &buf)?
        }
        Placement::Unaligned => {
            let mut padded = vec![verify::round_to::<T>(1.0)];
            padded.extend_from_slice(&mine);
            let din = up(s, &padded)?;
            let mut dout = poisoned::<T>(s, n + 1)?;
            {
                let (pi, _gi) = din.device_ptr(s);
                let (po, _go) = dout.device_ptr_mut(s);
                let sz = std::mem::size_of::<T>() as u64;
                // SAFETY: both allocations hold n+1 elements, so the
                // addresses one element in are valid for `n`; they live
                // until after `check` below synchronized the stream.
                unsafe { arx.broadcast_raw(pi + sz, po + sz, n, T::DTYPE, root, s.cu_stream()) }
                    .map_err(e("broadcast_raw"))?;
            }
            arx.check().map_err(e("check"))?;
            let v = down(s, &dout)?;
            if bytemuck::bytes_of(&v[0]).iter().any(|&b| b != 0xff) {
                return Err(format!(
                    "broadcast of {n} x {} unaligned: the element before the output was written",
                    T::DTYPE.name()
                ));
            }
            v[1..].to_vec()
        }
    };
    ctx.fold(&got);
    same_bits(
        &format!(
            "broadcast call {call}: {n} x {} from root {root} ({how:?})",
            T::DTYPE.name()
        ),
        &got,
        &want,
    )
}

fn broadcasts_of<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
) -> R<usize> {
    let m = arx.max_count::<T>();
    let mut calls = 0;
    for (k, n) in [0, 1, 7, 77, 1000, 2 * m + 3].into_iter().enumerate() {
        for root in 0..ctx.n {
            for (j, how) in [
                Placement::OutOfPlace,
                Placement::InPlace,
                Placement::Unaligned,
            ]
            .into_iter()
            .enumerate()
            {
                // CUDA allocations of 0 elements: the zero-length call
                // runs through broadcast_raw only.
                if n == 0 && !matches!(how, Placement::Unaligned) {
                    continue;
                }
                let call = 0x5E00_0000
                    | (T::DTYPE.code() as u64) << 20
                    | (k as u64) << 16
                    | (root as u64) << 4
                    | j as u64;
                bcast_call::<T>(ctx, arx, s, call, n, root, how)?;
                calls += 1;
            }
        }
    }
    Ok(calls)
}

/// broadcast from every root on every dtype at 0, 1, 7, 77, 1000 and 2m+3
/// elements (m: one chunk), out of place, in place and unaligned, bit for
/// bit (NaN payloads included); then an all-reduce on the same instance.
pub(super) fn broadcast_eager(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = build_small(ctx, st, Duration::from_secs(20))?;
    let b = broadcasts_of::<bf16>(ctx, &mut arx, &s)?;
    let h = broadcasts_of::<f16>(ctx, &mut arx, &s)?;
    let f = broadcasts_of::<f32>(ctx, &mut arx, &s)?;
    checked_call::<f32>(ctx, &mut arx, &s, 0x5EF0_0000, 1001, Placement::InPlace)
        .map_err(|x| format!("an all-reduce after the broadcasts: {x}"))?;
    ctx.say(format!(
        "bf16 {b}, f16 {h}, f32 {f} broadcast calls bit-exact"
    ));
    Ok(())
}

/// A chunked broadcast (f32, from the last rank) and an in-place one
/// (bf16, from rank 0) captured into one graph next to an all-reduce, and
/// replayed with new input before each replay.
pub(super) fn broadcast_graph(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = build_small(ctx, st, Duration::from_secs(20))?;
    let replays = if ctx.quick { 5 } else { 30 };
    let n1 = 2 * arx.max_count::<f32>() + 3;
    let (n2, n3) = (501, 300);
    let r1 = ctx.n - 1;
    let mut in1 = poisoned::<f32>(&s, n1)?;
    let mut out1 = poisoned::<f32>(&s, n1)?;
    let mut buf2 = poisoned::<bf16>(&s, n2)?;
    let mut in3 = poisoned::<f32>(&s, n3)?;
    let mut out3 = poisoned::<f32>(&s, n3)?;
    let g = capture(&s, "broadcasts under capture", || {
        arx.broadcast(&in1, &mut out1, r1, &s)
            .and_then(|()| arx.broadcast_in_place(&mut buf2, 0, &s))
            .and_then(|()| arx.allreduce(&in3, &mut out3, &s))
    })?;
    for i in 0..replays as u64 {
        let c = 0x5F00_0000 + 4 * i;
        let x1 = bcast_input::<f32>(c, ctx.rank, n1);
        let x2 = if ctx.rank == 0 {
            bcast_input::<bf16>(c + 1, 0, n2)
        } else {
            let mut p = vec![bf16::ZERO; n2];
            verify::poison(&mut p);
            p
        };
        let (x3, w3) = call_data::<f32>(ctx, c + 2, n3);
        s.memcpy_htod(&x1, &mut in1).map_err(e("htod"))?;
        s.memcpy_htod(&x2, &mut buf2).map_err(e("htod"))?;
        s.memcpy_htod(&x3, &mut in3).map_err(e("htod"))?;
        poison_dev(&s, &mut out1)?;
        poison_dev(&s, &mut out3)?;
        g.launch().map_err(e("graph launch"))?;
        let got1 = down(&s, &out1)?;
        let got2 = down(&s, &buf2)?;
        let got3 = down(&s, &out3)?;
        arx.check().map_err(e("check"))?;
        ctx.fold(&got1);
        ctx.fold(&got2);
        ctx.fold(&got3);
        same_bits(
            &format!("replay {i}: broadcast {n1} x f32 from {r1}"),
            &got1,
            &bcast_input::<f32>(c, r1, n1),
        )?;
        same_bits(
            &format!("replay {i}: broadcast in place {n2} x bf16 from 0"),
            &got2,
            &bcast_input::<bf16>(c + 1, 0, n2),
        )?;
        compare(&format!("replay {i}: all-reduce {n3} x f32"), &got3, &w3)?;
    }
    bcast_call::<f16>(ctx, &mut arx, &s, 0x5FF0_0000, 33, 0, Placement::OutOfPlace)
        .map_err(|x| format!("an eager call after the replays: {x}"))?;
    ctx.say(format!(
        "{replays} replays of a {}-chunk broadcast, an in-place broadcast and an all-reduce; then an eager call",
        n1.div_ceil(arx.max_count::<f32>())
    ));
    Ok(())
}

/// Call k from root k mod N runs on the GPU on ranks r with r + k even,
/// on the host on the others: one protocol, the root's bits everywhere.
pub(super) fn broadcast_mixed(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = build_small(ctx, st, Duration::from_secs(20))?;
    let rounds = if ctx.quick { 4 } else { 12 };
    for k in 0..rounds as u64 {
        let gpu = (ctx.rank as u64 + k) % 2 == 0;
        let root = k as usize % ctx.n;
        let call = 0x6B00_0000 + k;
        let n = 300 + 997 * k as usize;
        let x = bcast_input::<f32>(call, ctx.rank, n);
        let got = if gpu {
            let din = up(&s, &x)?;
            let mut dout = poisoned::<f32>(&s, n)?;
            arx.broadcast(&din, &mut dout, root, &s)
                .map_err(e("broadcast"))?;
            down(&s, &dout)?
        } else {
            let mut out = vec![0f32; n];
            verify::poison(&mut out);
            arx.broadcast_host(&x, &mut out, root)
                .map_err(e("broadcast_host"))?;
            out
        };
        arx.check().map_err(e("check"))?;
        ctx.fold(&got);
        same_bits(
            &format!("round {k} broadcast of {n} x f32 from {root} (gpu {gpu})"),
            &got,
            &bcast_input::<f32>(call, root, n),
        )?;
    }
    ctx.say(format!(
        "{rounds} broadcasts, GPU and host calls alternating across ranks, every root"
    ));
    Ok(())
}

/// Ranks that disagree on a GPU broadcast fail at once, every one: on the
/// root (rank 0 names rank 1, the others rank 0), on the count (the last
/// rank asks for one element more), and a root that is no rank on rank 0
/// (`InvalidArgument` there; its peers fail naming it). A fresh instance
/// each (a failure sticks).
pub(super) fn broadcast_mismatch(ctx: &Ctx, st: Staging) -> R {
    let timeout = Duration::from_secs(4);
    let me = ctx.rank;
    let n = 4096;
    let shapes: [(&str, usize, usize); 3] = [
        ("root", n, usize::from(me == 0)),
        ("count", if me == ctx.n - 1 { n + 1 } else { n }, 0),
        ("root out of range", n, if me == 0 { ctx.n } else { 0 }),
    ];
    for (what, len, root) in shapes {
        let (mut arx, s) = build_opts(ctx, st, timeout, None, None)?;
        let din = up(&s, &verify::input::<f32>(SEED, 0x7800_0001, me, len))?;
        let mut dout = poisoned::<f32>(&s, len)?;
        s.synchronize().map_err(e("sync"))?;
        let t = Instant::now();
        let r = arx
            .broadcast(&din, &mut dout, root, &s)
            .and_then(|()| arx.check());
        let took = t.elapsed();
        let ok = match &r {
            Err(Error::CallMismatch { peer, .. }) => *peer != me && *peer < ctx.n,
            Err(Error::InvalidArgument(m)) => {
                what == "root out of range" && me == 0 && m.contains("root")
            }
            _ => false,
        };
        if !ok || took >= timeout / 2 {
            return Err(format!(
                "broadcast {what} mismatch: not a CallMismatch (or this rank's InvalidArgument) within {:?} (after {took:.2?}): {r:?}",
                timeout / 2
            ));
        }
        if me == 0 {
            ctx.say(format!(
                "{what}: rank 0 failed in {:.1} ms: {}",
                took.as_secs_f64() * 1e3,
                r.err().map(|x| x.to_string()).unwrap_or_default()
            ));
        }
    }
    Ok(())
}
