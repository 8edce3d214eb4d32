//! Reductions other than sum (`Op`): every op × dtype × length (1, odd,
//! longer than one slot), in place and out of place, on edge-value inputs
//! (−0.0/+0.0 ties, NaN on one rank, ±Inf, subnormals, overflow), bit for
//! bit against `verify::reference_op` (which shares no code with the
//! library), NaN compared by its bits as the canonical NaN; and ranks that
//! pass different ops all fail at once.

use std::time::Instant;

use arx::Op;

use super::*;

/// One checked call of `op`: edge inputs, poisoned output (in place: the
/// input), exact bits, the same digest on every rank.
fn op_call<T: Element>(
    ctx: &Ctx,
    arx: &mut Arx,
    op: Op,
    call: u64,
    count: usize,
    in_place: bool,
) -> Result<(), String> {
    let input = verify::input_edges::<T>(SEED, call, ctx.rank, count);
    let want = verify::expected_op::<T>(op, true, SEED, call, ctx.n, count);
    let mut out = vec![T::from_f32(0.0); count];
    let r = if in_place {
        out.copy_from_slice(&input);
        arx.allreduce_host_in_place_op(&mut out, op)
    } else {
        verify::poison(&mut out);
        arx.allreduce_host_op(&input, &mut out, op)
    };
    let what = format!(
        "{op} call {call} ({count} x {:?}, in place {in_place})",
        T::DTYPE
    );
    r.map_err(|e| format!("{what}: {e}"))?;
    let wrong = verify::count_wrong_op(op, &out, &want);
    if wrong != 0 {
        let i = (0..count)
            .find(|&i| verify::count_wrong_op(op, &out[i..=i], &want[i..=i]) != 0)
            .unwrap_or(0);
        return Err(format!(
            "{what}: {wrong} wrong; first at {i}: got {:?} ({:?}) want {:?} ({:?})",
            verify::value_of(&out[i]),
            bytemuck::bytes_of(&out[i]),
            verify::value_of(&want[i]),
            bytemuck::bytes_of(&want[i]),
        ));
    }
    same_everywhere(ctx, verify::digest(&out))
}

fn ops_of<T: Element>(ctx: &Ctx, arx: &mut Arx, call: &mut u64) -> Result<(), String> {
    let m = arx.max_count::<T>();
    for op in Op::ALL {
        for in_place in [false, true] {
            for count in [1, 77, 1001, 2 * m + 3] {
                *call += 1;
                op_call::<T>(ctx, arx, op, *call, count, in_place)?;
            }
        }
    }
    Ok(())
}

/// Every op, dtype and length (a one-page slot, so the longest calls are
/// chunked), then a plain sum on the same instance is still right.
pub(super) fn ops_bit_for_bit(ctx: &Ctx) -> Result<(), String> {
    let mut arx = builder()
        .slot_bytes(4096)
        .build(ctx.world)
        .map_err(|e| e.to_string())?;
    let mut call = 7000;
    ops_of::<bf16>(ctx, &mut arx, &mut call)?;
    ops_of::<f16>(ctx, &mut arx, &mut call)?;
    ops_of::<f32>(ctx, &mut arx, &mut call)?;
    checked::<f32>(ctx, &mut arx, 7999, 300, false)
}

/// Rank 0 asks for max, the others for sum (and rank 2, if any, for min):
/// every rank fails the call at once with `CallMismatch`, its message
/// naming both ops; nothing waits for the timeout.
pub(super) fn op_mismatch(ctx: &Ctx) -> Result<(), String> {
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    let mine = match ctx.rank {
        0 => Op::Max,
        2 => Op::Min,
        _ => Op::Sum,
    };
    let input = verify::input::<f32>(SEED, 1, ctx.rank, 64);
    let mut out = vec![0f32; 64];
    let t = Instant::now();
    let r = arx.allreduce_host_op(&input, &mut out, mine);
    let timeout = arx.config().timeout;
    expect_err("op mismatch", r, |e| match e {
        Error::CallMismatch { ours, theirs, .. } => {
            let msg = e.to_string();
            ours.op == mine
                && theirs.op != mine
                && ours.kind == theirs.kind
                && ours.count == theirs.count
                && msg.contains(&format!("{mine} of 64"))
                && msg.contains(&format!("{} of 64", theirs.op))
        }
        _ => false,
    })?;
    if t.elapsed() > timeout / 2 {
        return Err(format!("the op mismatch took {:?}", t.elapsed()));
    }
    Ok(())
}
