//! Cases of the wrong-sum paths found by review (issue "Correct under every
//! legal use"): two streams, graphs, copy staging with late posts, edge
//! values, replay after drop.

use super::*;

// ------------------------------------------ cases of the review's findings

pub(super) fn edges_of<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
    c: u64,
    n: usize,
) -> R {
    let x = verify::input_edges::<T>(SEED, c, ctx.rank, n + 1);
    let want = verify::expected_edges::<T>(SEED, c, ctx.n, n + 1);
    // Aligned: the whole buffers.
    let din = up(s, &x)?;
    let mut dout = poisoned::<T>(s, n + 1)?;
    arx.allreduce(&din, &mut dout, s).map_err(e("allreduce"))?;
    let got = down(s, &dout)?;
    arx.check().map_err(e("check"))?;
    compare(
        &format!("call {c} aligned {n}+1 x {:?}", T::DTYPE),
        &got,
        &want,
    )?;
    ctx.fold(&got);
    // Unaligned: one element in (the kernel's scalar path), in place.
    let mut buf = up(s, &x)?;
    let (p, _g) = buf.device_ptr_mut(s);
    let sz = std::mem::size_of::<T>() as u64;
    // SAFETY: `p + sz` addresses `n` valid elements of `buf`, which lives
    // until after the synchronization below.
    unsafe { arx.allreduce_raw(p + sz, p + sz, n, T::DTYPE, s.cu_stream()) }
        .map_err(e("allreduce_raw"))?;
    drop(_g);
    let got = down(s, &buf)?;
    arx.check().map_err(e("check"))?;
    // The unaligned call sums elements 1..=n of call c's inputs.
    let want_u = verify::reference(
        &(0..ctx.n)
            .map(|r| verify::input_edges::<T>(SEED, c, r, n + 1)[1..].to_vec())
            .collect::<Vec<_>>(),
    );
    ctx.fold(&got[1..]);
    compare(
        &format!("call {c} unaligned in place {n} x {:?}", T::DTYPE),
        &got[1..],
        &want_u,
    )?;
    if verify::count_wrong(&got[..1], &x[..1]) != 0 {
        return Err("the element before an unaligned call was written".into());
    }
    Ok(())
}

/// −0.0 on every rank stays −0.0; NaN, ±Inf, subnormals and overflow follow
/// IEEE arithmetic in rank order.
pub(super) fn edges(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = build(ctx, st, Duration::from_secs(10))?;
    for (i, n) in [1usize, 8, 1000, 4097, 65_535].into_iter().enumerate() {
        let c = 10 * i as u64;
        edges_of::<bf16>(ctx, &mut arx, &s, c, n)?;
        edges_of::<f16>(ctx, &mut arx, &s, c + 1, n)?;
        edges_of::<f32>(ctx, &mut arx, &s, c + 2, n)?;
    }
    // Every element −0.0 on every rank.
    let z = vec![bf16::from_bits(0x8000); 4096];
    let din = up(&s, &z)?;
    let mut dout = poisoned::<bf16>(&s, z.len())?;
    arx.allreduce(&din, &mut dout, &s).map_err(e("allreduce"))?;
    let got = down(&s, &dout)?;
    arx.check().map_err(e("check"))?;
    ctx.fold(&got);
    compare("all -0.0", &got, &z)
}

/// Calls alternate between two streams with nothing ordering them; each
/// call has its own buffers, all enqueued before any is checked.
pub(super) fn two_streams(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, a) = build(ctx, st, Duration::from_secs(10))?;
    let b = arx
        .cuda_context()
        .ok_or("no context")?
        .new_stream()
        .map_err(e("new_stream"))?;
    let n = arx.max_count::<f32>(); // 2^18 with the default slot
    let calls = 16u64;
    let mut bufs = Vec::new();
    for c in 0..calls {
        let (x, _) = call_data::<f32>(ctx, 100 + c, n);
        let s = if c % 2 == 0 { &a } else { &b };
        bufs.push((up(s, &x)?, poisoned::<f32>(s, n)?));
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
        let (_, want) = call_data::<f32>(ctx, 100 + c as u64, n);
        compare(
            &format!("call {c} of 16 on alternating streams"),
            &got,
            &want,
        )?;
    }
    arx.check().map_err(e("check"))
}

/// A captured call replayed on stream A while eager calls run on stream B.
pub(super) fn graph_and_eager(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, a) = build(ctx, st, Duration::from_secs(10))?;
    let b = arx
        .cuda_context()
        .ok_or("no context")?
        .new_stream()
        .map_err(e("new_stream"))?;
    let n = 1 << 17;
    let mut gin = poisoned::<f32>(&a, n)?;
    let mut gout = poisoned::<f32>(&a, n)?;
    let g = capture(&a, "allreduce under capture", || {
        arx.allreduce(&gin, &mut gout, &a)
    })?;
    for i in 0..8u64 {
        let (xg, wg) = call_data::<f32>(ctx, 200 + 2 * i, n);
        let (xe, we) = call_data::<f32>(ctx, 201 + 2 * i, n);
        a.memcpy_htod(&xg, &mut gin).map_err(e("htod"))?;
        let ein = up(&b, &xe)?;
        let mut eout = poisoned::<f32>(&b, n)?;
        a.synchronize().map_err(e("sync"))?;
        b.synchronize().map_err(e("sync"))?;
        // The same order on every rank: replay, then the eager call.
        g.launch().map_err(e("graph launch"))?;
        arx.allreduce(&ein, &mut eout, &b)
            .map_err(e("eager allreduce"))?;
        compare(&format!("replay {i}"), &down(&a, &gout)?, &wg)?;
        compare(
            &format!("eager call after replay {i}"),
            &down(&b, &eout)?,
            &we,
        )?;
        arx.check().map_err(e("check"))?;
    }
    Ok(())
}

/// One graph with two arx calls on forked streams (parallel branches).
pub(super) fn parallel_branches(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, a) = build(ctx, st, Duration::from_secs(10))?;
    let n = 1 << 16;
    let mut in1 = poisoned::<f32>(&a, n)?;
    let mut in2 = poisoned::<f32>(&a, n)?;
    let mut out1 = poisoned::<f32>(&a, n)?;
    let mut out2 = poisoned::<f32>(&a, n)?;
    let g = capture(&a, "under capture", || {
        let b = a.fork().map_err(e("fork"))?;
        arx.allreduce(&in1, &mut out1, &a)
            .map_err(e("allreduce 1"))?;
        arx.allreduce(&in2, &mut out2, &b)
            .map_err(e("allreduce 2"))?;
        a.join(&b).map_err(e("join"))
    })?;
    for i in 0..6u64 {
        let (x1, w1) = call_data::<f32>(ctx, 300 + 2 * i, n);
        let (x2, w2) = call_data::<f32>(ctx, 301 + 2 * i, n);
        a.memcpy_htod(&x1, &mut in1).map_err(e("htod"))?;
        a.memcpy_htod(&x2, &mut in2).map_err(e("htod"))?;
        g.launch().map_err(e("graph launch"))?;
        compare(&format!("replay {i}, branch 1"), &down(&a, &out1)?, &w1)?;
        compare(&format!("replay {i}, branch 2"), &down(&a, &out2)?, &w2)?;
        arx.check().map_err(e("check"))?;
    }
    Ok(())
}

/// Three calls captured on one stream: the event record node that orders
/// each call against later launches is off the path of what follows the
/// call (no kernel depends on a record: docs/GPU.md, 0.6 µs per captured
/// call), and the records form one chain, one per call, each after its
/// call's kernel, so a replay's last record follows all three. Then the
/// graph replays right.
pub(super) fn records_off_the_path(ctx: &Ctx, st: Staging) -> R {
    use arx::cudarc::driver::sys::{self, CUgraphNodeType as T};
    let (mut arx, a) = build(ctx, st, Duration::from_secs(10))?;
    let n = 4096;
    let mut din = [
        poisoned::<f32>(&a, n)?,
        poisoned::<f32>(&a, n)?,
        poisoned::<f32>(&a, n)?,
    ];
    let mut dout = [
        poisoned::<f32>(&a, n)?,
        poisoned::<f32>(&a, n)?,
        poisoned::<f32>(&a, n)?,
    ];
    let g = capture(&a, "three calls under capture", || -> R {
        for (x, y) in din.iter().zip(dout.iter_mut()) {
            arx.allreduce(x, y, &a).map_err(e("allreduce"))?;
        }
        Ok(())
    })?;
    let cu = |what: &str, r: sys::CUresult| -> R { r.result().map_err(|x| format!("{what}: {x}")) };
    let graph = g.cu_graph();
    let mut count = 0usize;
    // SAFETY: the graph lives as long as `g`; the out-pointers are valid.
    cu("cuGraphGetNodes", unsafe {
        sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count)
    })?;
    let mut nodes = vec![std::ptr::null_mut(); count];
    // SAFETY: as above, `nodes` holds `count` entries.
    cu("cuGraphGetNodes", unsafe {
        sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count)
    })?;
    let kind = |node: sys::CUgraphNode| -> R<T> {
        let mut t = T::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: a node of `graph`; valid out-pointer.
        cu("cuGraphNodeGetType", unsafe {
            sys::cuGraphNodeGetType(node, &mut t)
        })?;
        Ok(t)
    };
    let deps = |node: sys::CUgraphNode| -> R<Vec<sys::CUgraphNode>> {
        let mut k = 0usize;
        // SAFETY: as above; a first call for the count.
        cu("cuGraphNodeGetDependencies", unsafe {
            sys::cuGraphNodeGetDependencies_v2(
                node,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut k,
            )
        })?;
        let mut d = vec![std::ptr::null_mut(); k];
        // SAFETY: `d` holds `k` entries.
        cu("cuGraphNodeGetDependencies", unsafe {
            sys::cuGraphNodeGetDependencies_v2(node, d.as_mut_ptr(), std::ptr::null_mut(), &mut k)
        })?;
        Ok(d)
    };
    let mut records = Vec::new();
    let mut kernels = 0;
    for &node in &nodes {
        match kind(node)? {
            T::CU_GRAPH_NODE_TYPE_KERNEL => {
                kernels += 1;
                for d in deps(node)? {
                    if kind(d)? == T::CU_GRAPH_NODE_TYPE_EVENT_RECORD {
                        return Err("a kernel depends on an event record node".into());
                    }
                }
            }
            T::CU_GRAPH_NODE_TYPE_EVENT_RECORD => records.push(node),
            _ => {}
        }
    }
    if kernels != 3 || records.len() != 3 {
        return Err(format!(
            "{kernels} kernels and {} event records, want 3 and 3",
            records.len()
        ));
    }
    // Each record follows one kernel; all but the first follow a record.
    let mut firsts = 0;
    for &r in &records {
        let d = deps(r)?;
        let ks = d
            .iter()
            .filter(|&&x| kind(x) == Ok(T::CU_GRAPH_NODE_TYPE_KERNEL))
            .count();
        let rs = d
            .iter()
            .filter(|&&x| kind(x) == Ok(T::CU_GRAPH_NODE_TYPE_EVENT_RECORD))
            .count();
        match (ks, rs) {
            (1, 0) => firsts += 1,
            (1, 1) => {}
            _ => return Err(format!("a record depends on {ks} kernels and {rs} records")),
        }
    }
    if firsts != 1 {
        return Err(format!("the records form {firsts} chains, want one"));
    }
    for i in 0..3u64 {
        let mut wants = Vec::new();
        for (j, x) in din.iter_mut().enumerate() {
            let (xi, w) = call_data::<f32>(ctx, 500 + 3 * i + j as u64, n);
            a.memcpy_htod(&xi, x).map_err(e("htod"))?;
            wants.push(w);
        }
        a.synchronize().map_err(e("sync"))?;
        g.launch().map_err(e("graph launch"))?;
        for (j, (y, w)) in dout.iter().zip(&wants).enumerate() {
            compare(&format!("replay {i}, call {j}"), &down(&a, y)?, w)?;
        }
        arx.check().map_err(e("check"))?;
    }
    Ok(())
}

/// Sets the test-only post delay for instances built inside `f`.
pub(super) fn with_post_delay<T>(us: u64, f: impl FnOnce() -> T) -> T {
    std::env::set_var("ARX_TEST_POST_DELAY_US", us.to_string());
    let r = f();
    std::env::remove_var("ARX_TEST_POST_DELAY_US");
    r
}

/// Rank 0 arrives late at a host call, so it returns (it has every peer's
/// flag) before its own late post read its send slot; its next GPU call
/// must not overwrite that slot first.
pub(super) fn after_host_call(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = with_post_delay(100_000, || build(ctx, st, Duration::from_secs(10)))?;
    let n = 8192;
    for i in 0..4u64 {
        let (x, want) = call_data::<f32>(ctx, 400 + 2 * i, n);
        let mut out = vec![0f32; n];
        verify::poison(&mut out);
        if ctx.rank == 0 {
            std::thread::sleep(Duration::from_millis(30));
        }
        arx.allreduce_host(&x, &mut out).map_err(e("host call"))?;
        // Enqueued at once: with copy-engine staging its copies run now.
        let (xg, wg) = call_data::<f32>(ctx, 401 + 2 * i, n);
        let din = up(&s, &xg)?;
        let mut dout = poisoned::<f32>(&s, n)?;
        arx.allreduce(&din, &mut dout, &s).map_err(e("GPU call"))?;
        compare(&format!("host call {i}"), &out, &want)?;
        compare(
            &format!("GPU call after host call {i}"),
            &down(&s, &dout)?,
            &wg,
        )?;
        arx.check().map_err(e("check"))?;
    }
    Ok(())
}

/// Rank 0's first call times out (its peers come late) while its own post
/// is still queued (posts are 300 ms late, its timeout is 250 ms); its next
/// call is already enqueued behind it. The peers, with a long timeout,
/// complete the first call with rank 0's data: that data must be the failed
/// call's, not the next call's. (No collective inside: ranks leave this
/// case at different times.)
pub(super) fn after_failed_call(ctx: &Ctx, st: Staging) -> R {
    let short = Duration::from_millis(250);
    let t = if ctx.rank == 0 {
        short
    } else {
        Duration::from_secs(10)
    };
    let (mut arx, s) = with_post_delay(300_000, || build(ctx, st, t))?;
    let n = 4096;
    let (x1, w1) = call_data::<f32>(ctx, 501, n);
    let d1 = up(&s, &x1)?;
    let mut o1 = poisoned::<f32>(&s, n)?;
    s.synchronize().map_err(e("sync"))?;
    if ctx.rank == 0 {
        let (x2, _) = call_data::<f32>(ctx, 502, n);
        let d2 = up(&s, &x2)?;
        let mut o2 = poisoned::<f32>(&s, n)?;
        s.synchronize().map_err(e("sync"))?;
        arx.allreduce(&d1, &mut o1, &s).map_err(e("call 1"))?;
        arx.allreduce(&d2, &mut o2, &s).map_err(e("call 2"))?;
        match arx.check() {
            Err(Error::Timeout { .. }) => {}
            other => return Err(format!("rank 0: expected a timeout, got {other:?}")),
        }
        for (what, o) in [("call 1", &o1), ("call 2", &o2)] {
            if !down(&s, o)?.iter().all(|v| v.is_nan()) {
                return Err(format!("rank 0: {what} failed but its output is not NaN"));
            }
        }
    } else {
        std::thread::sleep(short * 3);
        arx.allreduce(&d1, &mut o1, &s).map_err(e("call 1"))?;
        let got = down(&s, &o1)?;
        // Ok with the right sum, or an error (never Ok with a wrong sum).
        if arx.check().is_ok() {
            compare("call 1 (rank 0 failed after publishing it)", &got, &w1)?;
        }
    }
    Ok(())
}

/// A graph holding an instance's call is replayed after the instance was
/// dropped: no fault, NaN output; a new instance then works.
pub(super) fn replay_after_drop(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = build(ctx, st, Duration::from_secs(10))?;
    let n = 2048;
    let (x, w) = call_data::<bf16>(ctx, 600, n);
    let din = up(&s, &x)?;
    let mut dout = poisoned::<bf16>(&s, n)?;
    let g = capture(&s, "allreduce under capture", || {
        arx.allreduce(&din, &mut dout, &s)
    })?;
    g.launch().map_err(e("graph launch"))?;
    compare("replay before drop", &down(&s, &dout)?, &w)?;
    arx.check().map_err(e("check"))?;
    drop(arx);
    s.memcpy_htod(&vec![bf16::from_f32(1.5); n], &mut dout)
        .map_err(e("htod"))?;
    g.launch().map_err(e("graph launch after drop"))?;
    let got = down(&s, &dout)?;
    if !got.iter().all(|v| v.is_nan()) {
        return Err("a replay after drop did not write NaN".into());
    }
    drop(g);
    // The GPU and MPI are still usable.
    let (mut arx, s) = build(ctx, st, Duration::from_secs(10))?;
    let (x, w) = call_data::<bf16>(ctx, 601, n);
    let din = up(&s, &x)?;
    let mut dout = poisoned::<bf16>(&s, n)?;
    arx.allreduce(&din, &mut dout, &s).map_err(e("allreduce"))?;
    compare("a new instance after the drop", &down(&s, &dout)?, &w)?;
    arx.check().map_err(e("check"))
}
