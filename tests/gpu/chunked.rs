//! Calls longer than one slot on the GPU side: one kernel launch per
//! chunk of one slot on the caller's stream, eager and captured, next to
//! calls on another stream; and ranks that disagree on the total length.

use super::*;

/// Lengths around the chunk `m`: 1, m−1, m, m+1, 2m+3, ~3.5m.
fn chunk_lengths(m: usize) -> [usize; 6] {
    [1, m - 1, m, m + 1, 2 * m + 3, 3 * m + m / 2 + 1]
}

fn chunked_of<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
) -> R<usize> {
    let m = arx.max_count::<T>();
    let mut calls = 0;
    for (k, n) in chunk_lengths(m).into_iter().enumerate() {
        for (j, how) in [
            Placement::OutOfPlace,
            Placement::InPlace,
            Placement::Unaligned,
        ]
        .into_iter()
        .enumerate()
        {
            let call = 0xC_0000 | (T::DTYPE.code() as u64) << 12 | (k as u64) << 4 | j as u64;
            checked_call::<T>(ctx, arx, s, call, n, how)
                .map_err(|x| format!("chunk of {m}: {x}"))?;
            calls += 1;
        }
    }
    Ok(calls)
}

/// Every dtype at every length around the chunk, eager: out of place, in
/// place and unaligned (every chunk then unaligned too: the scalar path);
/// then ordinary calls on the same instance; then (not quick) one 16 MiB
/// f32 call at the default slot (32 chunks of half a slot, 512 KiB).
pub(super) fn chunked_eager(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = build_small(ctx, st, Duration::from_secs(20))?;
    let b = chunked_of::<bf16>(ctx, &mut arx, &s)?;
    let h = chunked_of::<f16>(ctx, &mut arx, &s)?;
    let f = chunked_of::<f32>(ctx, &mut arx, &s)?;
    checked_call::<f32>(ctx, &mut arx, &s, 0xC_F000, 100, Placement::OutOfPlace)
        .map_err(|x| format!("an ordinary call after the chunked ones: {x}"))?;
    checked_call::<bf16>(ctx, &mut arx, &s, 0xC_F001, 7, Placement::InPlace)
        .map_err(|x| format!("an ordinary call after the chunked ones: {x}"))?;
    drop(arx);
    let big = if ctx.quick {
        String::new()
    } else {
        let (mut arx, s) = build(ctx, st, Duration::from_secs(20))?;
        let n = 4 << 20;
        let (x, want) = call_data::<f32>(ctx, 0xC_F100, n);
        let din = up(&s, &x)?;
        let mut dout = poisoned::<f32>(&s, n)?;
        arx.allreduce(&din, &mut dout, &s).map_err(e("allreduce"))?;
        arx.check().map_err(e("check"))?;
        let got = down(&s, &dout)?;
        ctx.fold(&got);
        compare("16 MiB f32 call (32 chunks)", &got, &want)?;
        format!(
            "; one {n} x f32 call (16 MiB, {} chunks of half a slot)",
            n.div_ceil(arx.max_count::<f32>() / 2)
        )
    };
    ctx.say(format!(
        "bf16 {b}, f16 {h}, f32 {f} chunked calls bit-exact (chunks of {} f32, half a slot; out of place, in place, unaligned){big}",
        SMALL_SLOT / 8
    ));
    Ok(())
}

/// A chunked call (2m+3: three launches) captured into one graph and
/// replayed with a new input before each replay; then one graph holding a
/// chunked call and an ordinary one, replayed; then eager calls after the
/// replays.
pub(super) fn chunked_graph(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = build_small(ctx, st, Duration::from_secs(20))?;
    let replays = if ctx.quick { 5 } else { 50 };
    let mb = arx.max_count::<bf16>();
    graph_of::<bf16>(ctx, &mut arx, &s, replays, 2 * mb + 3, 0xD000_0000)?;
    let mf = arx.max_count::<f32>();
    graph_of::<f32>(ctx, &mut arx, &s, replays, 3 * mf + mf / 2 + 1, 0xD100_0000)?;

    // One graph: a chunked f32 call, then an ordinary bf16 call.
    let (n1, n2) = (2 * mf + 3, 1000);
    let mut in1 = poisoned::<f32>(&s, n1)?;
    let mut out1 = poisoned::<f32>(&s, n1)?;
    let mut in2 = poisoned::<bf16>(&s, n2)?;
    let mut out2 = poisoned::<bf16>(&s, n2)?;
    let g = capture(&s, "allreduce under capture", || {
        arx.allreduce(&in1, &mut out1, &s)
            .and_then(|()| arx.allreduce(&in2, &mut out2, &s))
    })?;
    for i in 0..replays as u64 {
        let (x1, w1) = wide_data::<f32>(ctx, 0xD200_0000 + 2 * i, n1);
        let (x2, w2) = wide_data::<bf16>(ctx, 0xD200_0001 + 2 * i, n2);
        s.memcpy_htod(&x1, &mut in1).map_err(e("htod"))?;
        s.memcpy_htod(&x2, &mut in2).map_err(e("htod"))?;
        poison_dev(&s, &mut out1)?;
        poison_dev(&s, &mut out2)?;
        g.launch().map_err(e("graph launch"))?;
        let got1 = down(&s, &out1)?;
        let got2 = down(&s, &out2)?;
        arx.check().map_err(e("check"))?;
        ctx.fold(&got1);
        ctx.fold(&got2);
        compare(&format!("replay {i}: chunked {n1} x f32"), &got1, &w1)?;
        compare(&format!("replay {i}: then {n2} x bf16"), &got2, &w2)?;
    }
    // Eager calls after the replays (the device's call counter advanced by
    // the chunks of every replay).
    checked_call::<f32>(
        ctx,
        &mut arx,
        &s,
        0xD300_0000,
        2 * mf + 3,
        Placement::InPlace,
    )?;
    checked_call::<f16>(ctx, &mut arx, &s, 0xD300_0001, 99, Placement::OutOfPlace)?;
    ctx.say(format!(
        "{replays} replays each: a {}-chunk bf16 call, a {}-chunk f32 call, a graph of a {}-chunk f32 call and a 1000 x bf16 call; then eager calls",
        (2 * mb + 3).div_ceil(mb / 2),
        (3 * mf + mf / 2 + 1).div_ceil(mf / 2),
        n1.div_ceil(mf / 2)
    ));
    Ok(())
}

/// Chunked calls on stream B interleaved with ordinary calls on stream A,
/// nothing ordering the streams but arx: all enqueued before any is
/// checked, each with its own buffers.
pub(super) fn chunked_two_streams(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, a) = build_small(ctx, st, Duration::from_secs(20))?;
    let b = arx
        .cuda_context()
        .ok_or("no context")?
        .new_stream()
        .map_err(e("new_stream"))?;
    let m = arx.max_count::<f32>();
    let calls = 12u64;
    let count = |c: u64| {
        if c % 2 == 0 {
            1000 + c as usize
        } else {
            3 * m + m / 2 + c as usize
        }
    };
    let mut bufs = Vec::new();
    for c in 0..calls {
        let (x, _) = call_data::<f32>(ctx, 0xE000 + c, count(c));
        let s = if c % 2 == 0 { &a } else { &b };
        bufs.push((up(s, &x)?, poisoned::<f32>(s, count(c))?));
    }
    a.synchronize().map_err(e("sync"))?;
    b.synchronize().map_err(e("sync"))?;
    for (c, (din, dout)) in bufs.iter_mut().enumerate() {
        let s = if c % 2 == 0 { &a } else { &b };
        arx.allreduce(din, dout, s).map_err(e("allreduce"))?;
    }
    for (c, (_, dout)) in bufs.iter().enumerate() {
        let s = if c % 2 == 0 { &a } else { &b };
        let got = down(s, dout)?;
        let (_, want) = call_data::<f32>(ctx, 0xE000 + c as u64, count(c as u64));
        ctx.fold(&got);
        compare(
            &format!(
                "call {c} of {calls} ({} x f32 on stream {})",
                count(c as u64),
                if c % 2 == 0 { "A" } else { "B (chunked)" }
            ),
            &got,
            &want,
        )?;
    }
    arx.check().map_err(e("check"))?;
    ctx.say(format!(
        "{calls} calls alternating: ordinary on stream A, 4-chunk on stream B, all bit-exact"
    ));
    Ok(())
}

/// The last rank's call has one chunk more than the others' (equal chunk
/// counts: only the "more chunks follow" mark differs): every rank fails
/// with `CallMismatch` well within the deadline, and the instance stays
/// failed.
pub(super) fn chunked_mismatch(ctx: &Ctx, st: Staging) -> R {
    let timeout = Duration::from_secs(4);
    let last = ctx.n - 1;
    let (mut arx, s) = build_small(ctx, st, timeout)?;
    let m = arx.max_count::<f32>();
    checked_call::<f32>(
        ctx,
        &mut arx,
        &s,
        0xF000_0001,
        2 * m + 1,
        Placement::OutOfPlace,
    )?;
    let n = if ctx.rank == last { 3 * m } else { 2 * m };
    let what = "total-length mismatch";
    let (_, din, mut dout) = expect_mismatch::<f32>(
        ctx,
        &mut arx,
        &s,
        what,
        0xF000_0002,
        n,
        timeout / 2,
        |a, i, o| a.allreduce(i, o, &s),
    )?;
    if arx.allreduce(&din, &mut dout, &s).is_ok() {
        return Err("a failed instance accepted another call".into());
    }
    Ok(())
}

/// Chunked calls back to back on one stream with nothing between them,
/// the last rank the slow one (`test_sum_delay`: each of its blocks pauses
/// before it sums), so its peers run ahead as far as the pipelined
/// protocol lets them (arx_abi.h, "A call longer than one slot": launch k
/// publishes chunk k + 1 before its sum, never the last chunk). Lengths of
/// 3 to 9 chunks (the last of 1 to 3 elements; now and then just over
/// half a slot, one chunk) alternate with calls of most of one slot; in
/// place and out of place; every output checked at the end. Copy-engine
/// staging runs the same calls unpipelined.
pub(super) fn chunked_back_to_back(ctx: &Ctx, st: Staging) -> R {
    back_to_back(ctx, st, arx::Algo::OneShot, 0xC_B000)
}

/// [`chunked_back_to_back`] with two-shot calls: launch k publishes chunk
/// k + 1's reduce-scatter step once every peer's gather flags of chunk k
/// are in, before it copies the gathered shards out (the last chunk's
/// too); the slow rank pauses before each reduce and each copy out.
pub(super) fn twoshot_back_to_back(ctx: &Ctx, st: Staging) -> R {
    back_to_back(ctx, st, arx::Algo::TwoShot, 0xC_B100)
}

/// The calls of [`chunked_back_to_back`] under `algo`, inputs of calls
/// `first`, `first + 1`, ...
fn back_to_back(ctx: &Ctx, st: Staging, algo: arx::Algo, first: u64) -> R {
    let (mut arx, s) = build_last_slow(ctx, st, algo, Duration::from_micros(500))?;
    let m = arx.max_count::<f32>();
    let calls: u64 = if ctx.quick { 8 } else { 24 };
    let mut keep = Vec::new();
    let mut outs = Vec::new();
    for c in 0..calls {
        let count = if c % 2 == 0 {
            m / 2 * (1 + (c as usize / 2) % 8) + 1 + (c as usize % 3)
        } else {
            m - (c as usize * 31) % (m / 4)
        };
        let call = first + c;
        let (mine, want) = call_data::<f32>(ctx, call, count);
        if c % 4 < 2 {
            let mut buf = up(&s, &mine)?;
            arx.allreduce_in_place(&mut buf, &s)
                .map_err(e("allreduce_in_place"))?;
            outs.push((call, buf, want));
        } else {
            let din = up(&s, &mine)?;
            let mut dout = poisoned::<f32>(&s, count)?;
            arx.allreduce(&din, &mut dout, &s).map_err(e("allreduce"))?;
            keep.push(din);
            outs.push((call, dout, want));
        }
    }
    s.synchronize().map_err(e("synchronize"))?;
    arx.check().map_err(e("check"))?;
    for (call, d, want) in &outs {
        let got = down(&s, d)?;
        ctx.fold(&got);
        compare(
            &format!(
                "{} call {call:#x}: {} x f32 (chunks of {})",
                algo.name(),
                want.len(),
                m / 2
            ),
            &got,
            want,
        )?;
    }
    ctx.say(format!(
        "{calls} {} calls back to back (3..9 chunks of {} f32, or one), rank {} slow",
        algo.name(),
        m / 2,
        ctx.n - 1
    ));
    Ok(())
}

/// Chunked calls captured into CUDA graphs on stream B, each replay
/// followed by an eager call on stream A (alternately chunked and of one
/// slot), everything of a round enqueued before any of it is checked, the
/// last rank slow (as in [`chunked_back_to_back`]); one-shot, then
/// two-shot. The pipelined launches of a replay then sit between eager
/// calls of other lengths and places, ordered by arx alone.
pub(super) fn chunked_graphs_two_streams(ctx: &Ctx, st: Staging) -> R {
    for (algo, first) in [
        (arx::Algo::OneShot, 0xC_C000u64),
        (arx::Algo::TwoShot, 0xC_D000),
    ] {
        graphs_two_streams(ctx, st, algo, first)?;
    }
    Ok(())
}

fn graphs_two_streams(ctx: &Ctx, st: Staging, algo: arx::Algo, first: u64) -> R {
    let (mut arx, a) = build_last_slow(ctx, st, algo, Duration::from_micros(300))?;
    let b = arx
        .cuda_context()
        .ok_or("no context")?
        .new_stream()
        .map_err(e("new_stream"))?;
    let m = arx.max_count::<f32>();
    // 3, 5 and 8 chunks of m / 2.
    let lens = [m + 1, 2 * m + 3, 3 * m + m / 2 + 1];
    let mut graphs = Vec::new();
    for &n in &lens {
        let din = poisoned::<f32>(&b, n)?;
        let mut dout = poisoned::<f32>(&b, n)?;
        let g = capture(&b, "a chunked allreduce under capture", || {
            arx.allreduce(&din, &mut dout, &b)
        })?;
        graphs.push((n, din, dout, g));
    }
    let eager_len = |g: usize| if g % 2 == 0 { 2 * m + 5 + g } else { 1000 + g };
    let rounds: u64 = if ctx.quick { 2 } else { 6 };
    for r in 0..rounds {
        let call = |g: usize, eager: bool| first + r * 16 + 2 * g as u64 + u64::from(eager);
        let mut wants = Vec::new();
        for (g, (n, din, dout, _)) in graphs.iter_mut().enumerate() {
            let (x, want) = call_data::<f32>(ctx, call(g, false), *n);
            b.memcpy_htod(&x, din).map_err(e("htod"))?;
            poison_dev(&b, dout)?;
            wants.push(want);
        }
        let mut eager = Vec::new();
        for g in 0..graphs.len() {
            let (x, want) = call_data::<f32>(ctx, call(g, true), eager_len(g));
            eager.push((up(&a, &x)?, poisoned::<f32>(&a, eager_len(g))?, want));
        }
        a.synchronize().map_err(e("sync"))?;
        b.synchronize().map_err(e("sync"))?;
        // The same order on every rank: replay g on B, eager call g on A.
        for ((_, _, _, g), (ein, eout, _)) in graphs.iter().zip(eager.iter_mut()) {
            g.launch().map_err(e("graph launch"))?;
            arx.allreduce(ein, eout, &a).map_err(e("eager allreduce"))?;
        }
        for (g, ((n, _, dout, _), want)) in graphs.iter().zip(&wants).enumerate() {
            let got = down(&b, dout)?;
            ctx.fold(&got);
            compare(
                &format!(
                    "{} round {r}: replay of the {n} x f32 graph {g} (stream B)",
                    algo.name()
                ),
                &got,
                want,
            )?;
        }
        for (g, (_, eout, want)) in eager.iter().enumerate() {
            let got = down(&a, eout)?;
            ctx.fold(&got);
            compare(
                &format!(
                    "{} round {r}: eager {} x f32 after replay {g} (stream A)",
                    algo.name(),
                    eager_len(g)
                ),
                &got,
                want,
            )?;
        }
        arx.check().map_err(e("check"))?;
    }
    ctx.say(format!(
        "{} {rounds} rounds: graphs of {lens:?} x f32 (chunks of {}) replayed on stream B, each followed by an eager call on stream A, rank {} slow",
        algo.name(),
        m / 2,
        ctx.n - 1
    ));
    Ok(())
}

/// Pipelined chunked calls made on the GPU by some ranks and on the host
/// by the others, alternating per call (one instance, the host calls'
/// `allreduce_host`), the last rank slow on both sides; one-shot, then
/// two-shot: both sides publish their chunks in the same order
/// (kernels/arx_abi.h, "A call longer than one slot"), so a GPU rank and
/// a host rank take part in one call chunk by chunk.
pub(super) fn chunked_gpu_and_host(ctx: &Ctx, st: Staging) -> R {
    let rounds: u64 = if ctx.quick { 4 } else { 10 };
    for (algo, first) in [
        (arx::Algo::OneShot, 0xC_E000u64),
        (arx::Algo::TwoShot, 0xC_E100),
    ] {
        let (mut arx, s) = build_last_slow(ctx, st, algo, Duration::from_micros(300))?;
        let m = arx.max_count::<f32>();
        for k in 0..rounds {
            let gpu = (ctx.rank as u64 + k) % 2 == 0;
            // 3 to 7 chunks of m / 2, the last of 1 to 3 elements.
            let n = m / 2 * (2 + k as usize % 5) + 1 + k as usize % 3;
            let (x, want) = call_data::<f32>(ctx, first + k, n);
            let got = allreduce_either(&mut arx, &s, gpu, &x)?;
            arx.check().map_err(e("check"))?;
            ctx.fold(&got);
            compare(
                &format!(
                    "{} round {k}: {n} x f32 on the {}",
                    algo.name(),
                    if gpu { "GPU" } else { "host" }
                ),
                &got,
                &want,
            )?;
        }
    }
    ctx.say(format!(
        "{rounds} chunked calls per algorithm (3..7 chunks), GPU and host ranks alternating, rank {} slow",
        ctx.n - 1
    ));
    Ok(())
}
