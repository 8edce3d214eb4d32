//! Reductions other than sum on the GPU side (`Op`): every op × dtype ×
//! length (1, odd, longer than one slot: chunked) out of place, in place
//! and unaligned, eager and under graph replay, on edge-value inputs
//! (−0.0/+0.0 ties, NaN on one rank, ±Inf, subnormals, overflow), bit for
//! bit against `verify::reference_op` (NaN by its canonical bits: the
//! same bits the host side gives, tests/mpi `ops`); and ranks that pass
//! different ops all fail at once.

use arx::Op;

use super::*;

pub(super) fn op_data<T: Element>(ctx: &Ctx, op: Op, call: u64, n: usize) -> (Vec<T>, Vec<T>) {
    (
        verify::input_edges::<T>(SEED, call, ctx.rank, n),
        verify::expected_op::<T>(op, true, SEED, call, ctx.n, n),
    )
}

pub(super) fn exact<T: Element>(what: &str, op: Op, got: &[T], want: &[T]) -> R {
    let wrong = verify::count_wrong_op(op, got, want);
    if wrong == 0 {
        return Ok(());
    }
    let i = (0..got.len().min(want.len()))
        .find(|&i| verify::count_wrong_op(op, &got[i..=i], &want[i..=i]) != 0)
        .unwrap_or(0);
    Err(format!(
        "{what}: {wrong} wrong; first at {i}: got {:?} want {:?}",
        bytemuck::bytes_of(&got[i]),
        bytemuck::bytes_of(&want[i])
    ))
}

fn op_call<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
    op: Op,
    call: u64,
    count: usize,
    how: Placement,
) -> R {
    let (mine, want) = op_data::<T>(ctx, op, call, count);
    let got: Vec<T> = match how {
        Placement::OutOfPlace => {
            let din = up(s, &mine)?;
            let mut dout = poisoned::<T>(s, count)?;
            arx.allreduce_op(&din, &mut dout, op, s)
                .map_err(e("allreduce_op"))?;
            arx.check().map_err(e("check"))?;
            down(s, &dout)?
        }
        Placement::InPlace => {
            let mut buf = up(s, &mine)?;
            arx.allreduce_in_place_op(&mut buf, op, s)
                .map_err(e("allreduce_in_place_op"))?;
            arx.check().map_err(e("check"))?;
            down(s, &buf)?
        }
        Placement::Unaligned => {
            let mut padded = vec![verify::round_to::<T>(0.0)];
            padded.extend_from_slice(&mine);
            let din = up(s, &padded)?;
            let mut dout = poisoned::<T>(s, count + 1)?;
            {
                let (pi, _gi) = din.device_ptr(s);
                let (po, _go) = dout.device_ptr_mut(s);
                let sz = std::mem::size_of::<T>() as u64;
                // SAFETY: both allocations hold count+1 elements, so the
                // addresses one element in are valid for `count`; they live
                // until after `check` below synchronized the stream.
                unsafe {
                    arx.allreduce_raw_op(pi + sz, po + sz, count, T::DTYPE, op, s.cu_stream())
                }
                .map_err(e("allreduce_raw_op"))?;
            }
            arx.check().map_err(e("check"))?;
            down(s, &dout)?[1..].to_vec()
        }
    };
    ctx.fold(&got);
    exact(
        &format!("{op} call {call}: {count} x {} ({how:?})", T::DTYPE.name()),
        op,
        &got,
        &want,
    )
}

pub(super) fn ops_of<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
) -> R<usize> {
    let m = arx.max_count::<T>();
    let mut calls = 0;
    for op in Op::ALL {
        for (k, n) in [1, 77, 1001, 2 * m + 3].into_iter().enumerate() {
            for (j, how) in [
                Placement::OutOfPlace,
                Placement::InPlace,
                Placement::Unaligned,
            ]
            .into_iter()
            .enumerate()
            {
                let call = 0x0A_0000u64 | u64::from(op.code()) << 16;
                let call = call | u64::from(T::DTYPE.code()) << 12 | (k as u64) << 4 | j as u64;
                op_call::<T>(ctx, arx, s, op, call, n, how)?;
                calls += 1;
            }
        }
    }
    Ok(calls)
}

/// Every op, dtype, length and placement, eager; then a plain sum.
pub(super) fn ops_eager(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = build_small(ctx, st, Duration::from_secs(20))?;
    let b = ops_of::<bf16>(ctx, &mut arx, &s)?;
    let h = ops_of::<f16>(ctx, &mut arx, &s)?;
    let f = ops_of::<f32>(ctx, &mut arx, &s)?;
    checked_call::<f32>(ctx, &mut arx, &s, 0x0E_F000, 100, Placement::OutOfPlace)
        .map_err(|x| format!("a sum after the other ops: {x}"))?;
    ctx.say(format!(
        "sum/max/min/avg: bf16 {b}, f16 {h}, f32 {f} calls bit-exact on edge values"
    ));
    Ok(())
}

/// For each op and dtype: a chunked call (2m+3) and a short one captured
/// into one graph, replayed with new input before each replay.
pub(super) fn ops_graph(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = build_small(ctx, st, Duration::from_secs(20))?;
    let replays = if ctx.quick { 2 } else { 5 };
    for op in [Op::Max, Op::Min, Op::Avg] {
        graph_op::<bf16>(ctx, &mut arx, &s, op, replays)?;
        graph_op::<f16>(ctx, &mut arx, &s, op, replays)?;
        graph_op::<f32>(ctx, &mut arx, &s, op, replays)?;
    }
    ctx.say(format!(
        "max/min/avg x bf16/f16/f32: {replays} replays of a graph (chunked call + 77-element call in place), bit-exact"
    ));
    Ok(())
}

fn graph_op<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
    op: Op,
    replays: u64,
) -> R {
    let (n1, n2) = (2 * arx.max_count::<T>() + 3, 77);
    let mut in1 = poisoned::<T>(s, n1)?;
    let mut out1 = poisoned::<T>(s, n1)?;
    let mut buf2 = poisoned::<T>(s, n2)?;
    let g = capture(s, "allreduce_op under capture", || {
        arx.allreduce_op(&in1, &mut out1, op, s)
            .and_then(|()| arx.allreduce_in_place_op(&mut buf2, op, s))
    })?;
    let base = 0x0F00_0000 | u64::from(op.code()) << 20 | u64::from(T::DTYPE.code()) << 16;
    for i in 0..replays {
        let (x1, w1) = op_data::<T>(ctx, op, base + 2 * i, n1);
        let (x2, w2) = op_data::<T>(ctx, op, base + 2 * i + 1, n2);
        s.memcpy_htod(&x1, &mut in1).map_err(e("htod"))?;
        s.memcpy_htod(&x2, &mut buf2).map_err(e("htod"))?;
        poison_dev(s, &mut out1)?;
        g.launch().map_err(e("graph launch"))?;
        let got1 = down(s, &out1)?;
        let got2 = down(s, &buf2)?;
        arx.check().map_err(e("check"))?;
        ctx.fold(&got1);
        ctx.fold(&got2);
        let t = T::DTYPE.name();
        exact(&format!("{op} replay {i}: {n1} x {t}"), op, &got1, &w1)?;
        exact(
            &format!("{op} replay {i}: {n2} x {t} in place"),
            op,
            &got2,
            &w2,
        )?;
    }
    Ok(())
}

/// Rank 0 passes max, the others sum: every rank fails with
/// `CallMismatch` naming the ops, well within the deadline.
pub(super) fn ops_mismatch(ctx: &Ctx, st: Staging) -> R {
    let timeout = Duration::from_secs(4);
    let (mut arx, s) = build_small(ctx, st, timeout)?;
    let op = if ctx.rank == 0 { Op::Max } else { Op::Sum };
    let (msg, _, _) = expect_mismatch::<f32>(
        ctx,
        &mut arx,
        &s,
        "op mismatch",
        0x0F_F001,
        64,
        timeout / 2,
        |a, i, o| a.allreduce_op(i, o, op, &s),
    )?;
    if !msg.contains("max of 64") || !msg.contains("sum of 64") {
        return Err(format!(
            "op mismatch: the error does not name both ops: {msg}"
        ));
    }
    Ok(())
}
