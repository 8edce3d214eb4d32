//! Two-shot all-reduce, `reduce_scatter` and `all_gather` (issue 10): one
//! answer whatever the algorithm, the chunk count or in place, bit for bit
//! against `verify::reference_op` (which shares no code with the library)
//! on edge-value inputs; and ranks that disagree on the algorithm or the
//! collective all fail at once.

use std::time::{Duration, Instant};

use arx::{Algo, Op, Pattern};

use super::*;

fn bits<T: Element>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

/// The all-reduce of `input` (this rank's edge inputs of call `call`,
/// `op`) by instance `arx`, checked against `want` (the reference);
/// returns its bytes.
#[allow(clippy::too_many_arguments)]
fn reduce_by<T: Element>(
    ctx: &Ctx,
    arx: &mut Arx,
    op: Op,
    call: u64,
    input: &[T],
    want: &[T],
    in_place: bool,
) -> Result<Vec<u8>, String> {
    let count = input.len();
    let mut out = vec![T::from_f32(0.0); count];
    let r = if in_place {
        out.copy_from_slice(input);
        arx.allreduce_host_in_place_op(&mut out, op)
    } else {
        verify::poison(&mut out);
        arx.allreduce_host_op(input, &mut out, op)
    };
    let what = format!(
        "{op} call {call} ({count} x {:?}, {:?}, in place {in_place})",
        T::DTYPE,
        arx.config().algo
    );
    r.map_err(|e| format!("{what}: {e}"))?;
    let wrong = verify::count_wrong_op(op, &out, want);
    if wrong != 0 {
        let i = (0..count)
            .find(|&i| verify::count_wrong_op(op, &out[i..=i], &want[i..=i]) != 0)
            .unwrap_or(0);
        return Err(format!(
            "{what}: {wrong} wrong; first at {i}: got {:?} want {:?}",
            verify::value_of(&out[i]),
            verify::value_of(&want[i]),
        ));
    }
    same_everywhere(ctx, verify::digest(&out))?;
    Ok(bits(&out))
}

fn one_answer_of<T: Element>(ctx: &Ctx, insts: &mut [Arx], call: &mut u64) -> Result<(), String> {
    let m = insts[0].max_count::<T>();
    for op in Op::ALL {
        for count in [1, 77, 1001, 2 * m + 3] {
            *call += 1;
            // One reference for every instance and form of this call.
            let input = verify::input_edges::<T>(SEED, *call, ctx.rank, count);
            let want = verify::expected_op::<T>(op, true, SEED, *call, ctx.n, count);
            let mut first: Option<Vec<u8>> = None;
            for arx in insts.iter_mut() {
                for in_place in [false, true] {
                    let got = reduce_by::<T>(ctx, arx, op, *call, &input, &want, in_place)?;
                    match &first {
                        None => first = Some(got),
                        Some(f) if *f != got => {
                            return Err(format!(
                                "{op} call {call} ({count} x {:?}): {:?} in place {in_place} gave other bits than the first instance",
                                T::DTYPE,
                                arx.config().algo
                            ))
                        }
                        Some(_) => {}
                    }
                }
            }
        }
    }
    Ok(())
}

/// One instance per algorithm (one-shot, two-shot, auto), each with a
/// one-page slot (the longest calls are chunked).
fn three_instances(ctx: &Ctx) -> Result<Vec<Arx>, String> {
    [Algo::OneShot, Algo::TwoShot, Algo::Auto]
        .into_iter()
        .map(|algo| {
            builder()
                .slot_bytes(4096)
                .algo(algo)
                .build(ctx.world)
                .map_err(|e| e.to_string())
        })
        .collect()
}

/// Every op, dtype and length (a one-page slot: the longest calls are
/// chunked) by one-shot, two-shot and the automatic choice, out of place
/// and in place: the same bits everywhere, and right.
pub(super) fn one_answer(ctx: &Ctx) -> Result<(), String> {
    let mut insts = three_instances(ctx)?;
    let mut call = 9000;
    one_answer_of::<bf16>(ctx, &mut insts, &mut call)?;
    one_answer_of::<f16>(ctx, &mut insts, &mut call)?;
    one_answer_of::<f32>(ctx, &mut insts, &mut call)?;
    // The automatic choice just above its threshold against one-shot, on a
    // slot large enough for one call (the same bits by design; that auto
    // runs two-shot there is the unit test's and allreduce_perf's
    // `algo_run`).
    let mut auto = builder()
        .slot_bytes(1 << 20)
        .build(ctx.world)
        .map_err(|e| e.to_string())?;
    let from = arx::host_twoshot_from_bytes(ctx.n, auto.config().fabric).unwrap_or(4096);
    let big = from / 4 + 5;
    let mut one = builder()
        .slot_bytes(1 << 20)
        .algo(Algo::OneShot)
        .build(ctx.world)
        .map_err(|e| e.to_string())?;
    let input = verify::input_edges::<f32>(SEED, 9999, ctx.rank, big);
    let want = verify::expected_op::<f32>(Op::Sum, true, SEED, 9999, ctx.n, big);
    let a = reduce_by::<f32>(ctx, &mut auto, Op::Sum, 9999, &input, &want, false)?;
    let b = reduce_by::<f32>(ctx, &mut one, Op::Sum, 9999, &input, &want, false)?;
    if a != b {
        return Err("the automatic choice gave other bits than one-shot".into());
    }
    Ok(())
}

fn collectives_of<T: Element>(ctx: &Ctx, arx: &mut Arx, call: &mut u64) -> Result<(), String> {
    let m = arx.max_count::<T>();
    for n in [1, 5, 77, 1000, 2 * m / ctx.n + 3] {
        // reduce_scatter of N·n elements, every op.
        for op in Op::ALL {
            *call += 1;
            for in_place in [false, true] {
                rs_call::<T>(ctx, arx, op, *call, n, in_place)?;
            }
        }
        for in_place in [false, true] {
            *call += 1;
            ag_call::<T>(ctx, arx, *call, n, in_place)?;
        }
    }
    Ok(())
}

/// One reduce_scatter of `n` elements per rank (this rank's edge inputs of
/// call `call`, N·n of them), checked against the reference's block of
/// this rank; in place, the other blocks must be left as they were.
fn rs_call<T: Element>(
    ctx: &Ctx,
    arx: &mut Arx,
    op: Op,
    call: u64,
    n: usize,
    in_place: bool,
) -> Result<(), String> {
    let (world, me) = (ctx.n, ctx.rank);
    let input = verify::input_edges::<T>(SEED, call, me, world * n);
    let want = verify::expected_op::<T>(op, true, SEED, call, world, world * n);
    let want = &want[me * n..(me + 1) * n];
    let what = format!(
        "reduce_scatter {op} call {call} ({n} x {:?} per rank, in place {in_place})",
        T::DTYPE
    );
    let got: Vec<T> = if in_place {
        let mut buf = input.clone();
        arx.reduce_scatter_host_in_place_op(&mut buf, op)
            .map_err(|e| format!("{what}: {e}"))?;
        // The other blocks are left as they were.
        for q in (0..world).filter(|&q| q != me) {
            if bits(&buf[q * n..(q + 1) * n]) != bits(&input[q * n..(q + 1) * n]) {
                return Err(format!("{what}: block {q} (not this rank's) changed"));
            }
        }
        buf[me * n..(me + 1) * n].to_vec()
    } else {
        let mut out = vec![T::from_f32(0.0); n];
        verify::poison(&mut out);
        arx.reduce_scatter_host_op(&input, &mut out, op)
            .map_err(|e| format!("{what}: {e}"))?;
        out
    };
    let wrong = verify::count_wrong_op(op, &got, want);
    if wrong != 0 {
        return Err(format!("{what}: {wrong} wrong"));
    }
    Ok(())
}

/// One all_gather of `n` elements per rank: every rank's exact bits.
fn ag_call<T: Element>(
    ctx: &Ctx,
    arx: &mut Arx,
    call: u64,
    n: usize,
    in_place: bool,
) -> Result<(), String> {
    let (world, me) = (ctx.n, ctx.rank);
    let what = format!(
        "all_gather call {call} ({n} x {:?} per rank, in place {in_place})",
        T::DTYPE
    );
    let mine = verify::input_edges::<T>(SEED, call, me, n);
    let want: Vec<T> = (0..world)
        .flat_map(|q| verify::input_edges::<T>(SEED, call, q, n))
        .collect();
    let mut out = vec![T::from_f32(0.0); world * n];
    verify::poison(&mut out);
    if in_place {
        out[me * n..(me + 1) * n].copy_from_slice(&mine);
        arx.all_gather_host_in_place(&mut out)
    } else {
        arx.all_gather_host(&mine, &mut out)
    }
    .map_err(|e| format!("{what}: {e}"))?;
    if bits(&out) != bits(&want) {
        let i = (0..out.len())
            .find(|&i| bits(&out[i..=i]) != bits(&want[i..=i]))
            .unwrap_or(0);
        return Err(format!(
            "{what}: element {i} (rank {}'s) is {:?}, want {:?}",
            i / n.max(1),
            verify::value_of(&out[i]),
            verify::value_of(&want[i])
        ));
    }
    same_everywhere(ctx, verify::digest(&out))
}

/// reduce_scatter (every op) and all_gather, every dtype, lengths from 1
/// element per rank to longer than one slot, in place and not.
pub(super) fn reduce_scatter_all_gather(ctx: &Ctx) -> Result<(), String> {
    let mut arx = builder()
        .slot_bytes(4096)
        .build(ctx.world)
        .map_err(|e| e.to_string())?;
    let mut call = 12000;
    collectives_of::<bf16>(ctx, &mut arx, &mut call)?;
    collectives_of::<f16>(ctx, &mut arx, &mut call)?;
    collectives_of::<f32>(ctx, &mut arx, &mut call)?;
    // The instance still all-reduces right afterwards.
    checked::<f32>(ctx, &mut arx, 12999, 300, false)
}

/// Rank 0 chooses two-shot, the others one-shot (then: the last rank
/// auto, the others one-shot): start-up fails on every rank at once with
/// `Mismatch` naming `ARX_ALGO` and the first rank that differs (before,
/// it passed start-up and failed at the first call where the algorithms
/// differ, a size that depends on the job). Then every rank agrees and
/// the instance all-reduces right.
pub(super) fn algo_mismatch(ctx: &Ctx) -> Result<(), String> {
    let t = Instant::now();
    let first = if ctx.rank == 0 {
        Algo::TwoShot
    } else {
        Algo::OneShot
    };
    let r = builder().algo(first).build(ctx.world).map(|_| ());
    expect_err("algorithm mismatch at start-up", r, |e| {
        matches!(e, Error::Mismatch { what: "ARX_ALGO", rank: 1, ours, theirs }
            if ours == "twoshot" && theirs == "oneshot")
            && e.to_string().contains("ARX_ALGO")
    })?;
    let last = ctx.n - 1;
    let second = if ctx.rank == last {
        Algo::Auto
    } else {
        Algo::OneShot
    };
    let r = builder().algo(second).build(ctx.world).map(|_| ());
    expect_err("auto against oneshot at start-up", r, |e| {
        matches!(e, Error::Mismatch { what: "ARX_ALGO", rank, ours, theirs }
            if *rank == last && ours == "oneshot" && theirs == "auto")
    })?;
    if t.elapsed() > Duration::from_secs(30) {
        return Err(format!("the algorithm mismatches took {:?}", t.elapsed()));
    }
    let mut arx = builder()
        .algo(Algo::TwoShot)
        .build(ctx.world)
        .map_err(|e| e.to_string())?;
    checked::<f32>(ctx, &mut arx, 77, 4099, false)
}

/// Rank 0 calls all_gather, the others reduce_scatter of the same total:
/// every rank fails at once. Then (a fresh instance) rank 0 passes a
/// reduce_scatter input of the wrong length: it gets `InvalidArgument`,
/// its peers fail at once naming it.
pub(super) fn collective_mismatch(ctx: &Ctx) -> Result<(), String> {
    let n = 16;
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    let timeout = arx.config().timeout;
    let t = Instant::now();
    let r = if ctx.rank == 0 {
        let mine = verify::input::<f32>(SEED, 2, ctx.rank, n);
        let mut out = vec![0f32; ctx.n * n];
        arx.all_gather_host(&mine, &mut out)
    } else {
        let input = verify::input::<f32>(SEED, 2, ctx.rank, ctx.n * n);
        let mut out = vec![0f32; n];
        arx.reduce_scatter_host(&input, &mut out)
    };
    expect_err(
        "collective mismatch",
        r,
        |e| matches!(e, Error::CallMismatch { ours, theirs, .. } if ours.pattern != theirs.pattern),
    )?;
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    let len = if ctx.rank == 0 {
        ctx.n * n + 1
    } else {
        ctx.n * n
    };
    let input = verify::input::<f32>(SEED, 3, ctx.rank, len);
    let mut out = vec![0f32; n];
    let r = arx.reduce_scatter_host(&input, &mut out);
    expect_err("reduce_scatter length", r, |e| match e {
        Error::InvalidArgument(m) => ctx.rank == 0 && m.contains("reduce_scatter"),
        Error::CallMismatch { peer: 0, .. } => ctx.rank != 0,
        _ => false,
    })?;
    if t.elapsed() > timeout / 2 {
        return Err(format!("the mismatches took {:?}", t.elapsed()));
    }
    Ok(())
}

/// The last rank reduce-scatters (then would all-gather) what the others
/// all-reduce two-shot: the same steps, moving the same bytes, so the flag
/// words differ only in `ARX_FLAG_ALLREDUCE`. Every rank fails its first
/// call at once with a mismatch naming the two-shot step, in one slot and
/// in a call of several chunks; no rank returns Ok (before ABI 9 every rank
/// did, the all-reduce ranks with the lone rank's unrelated data in its
/// shard).
pub(super) fn twoshot_vs_reduce_scatter(ctx: &Ctx) -> Result<(), String> {
    let lone = ctx.rank == ctx.n - 1;
    for (k, per) in [16usize, 24 << 10].into_iter().enumerate() {
        let mut arx = builder()
            .algo(Algo::TwoShot)
            .slot_bytes(64 << 10)
            .build(ctx.world)
            .map_err(|e| e.to_string())?;
        let timeout = arx.config().timeout;
        let total = ctx.n * per;
        let input = verify::input::<f32>(SEED, 40 + k as u64, ctx.rank, total);
        let t = Instant::now();
        let r = if lone {
            let mut out = vec![f32::NAN; per];
            arx.reduce_scatter_host(&input, &mut out)
                .and_then(|()| arx.all_gather_host(&out.clone(), &mut vec![0f32; total]))
        } else {
            let mut out = vec![f32::NAN; total];
            arx.allreduce_host(&input, &mut out)
        };
        let what = format!("{per} x {} f32, chunked: {}", ctx.n, k == 1);
        expect_err(&what, r, |e| match e {
            Error::CallMismatch { ours, theirs, .. } => {
                let two = |p: Pattern| p == Pattern::TwoShotScatter;
                two(ours.pattern) != two(theirs.pattern)
                    && e.to_string()
                        .contains("reduce-scatter step of a two-shot allreduce")
                    && e.to_string().contains("a reduce_scatter")
            }
            _ => false,
        })?;
        if t.elapsed() > timeout / 2 {
            return Err(format!("{what}: the mismatch took {:?}", t.elapsed()));
        }
    }
    Ok(())
}

/// Issue 10's "one answer" at large sizes (on request only: see
/// `main.rs`, `ARX_TEST_CASES=large`): 64 MiB calls, and calls one element
/// longer than one and three slots, of bf16, f16 and f32, sum and max, by
/// one-shot, two-shot (also in place) and the automatic choice, each on an
/// instance of the default slot; every result's bytes equal the reference
/// of `tests/common/large.rs` (rank-order f32 sum rounded once, IEEE
/// maximum, written without the library), hence equal across algorithms
/// and ranks.
pub(super) fn large_one_answer(ctx: &Ctx) -> Result<(), String> {
    large::self_check().map_err(|e| format!("the reference's own check: {e}"))?;
    let mut insts = Vec::new();
    for algo in [Algo::OneShot, Algo::TwoShot, Algo::Auto] {
        let arx = builder()
            .slot_bytes(arx::DEFAULT_SLOT_BYTES)
            .algo(algo)
            .build(ctx.world)
            .map_err(|e| e.to_string())?;
        insts.push((algo, arx));
    }
    let mut call = 20_000;
    large_of::<bf16>(ctx, &mut insts, &mut call)?;
    large_of::<f16>(ctx, &mut insts, &mut call)?;
    large_of::<f32>(ctx, &mut insts, &mut call)
}

fn large_of<T: Element>(
    ctx: &Ctx,
    insts: &mut [(Algo, Arx)],
    call: &mut u64,
) -> Result<(), String> {
    let m = insts[0].1.max_count::<T>();
    let big = (64 << 20) / std::mem::size_of::<T>();
    for count in [m + 1, 3 * m + 1, big] {
        *call += 1;
        let inputs = large::inputs::<T>(SEED, *call, ctx.n, count);
        let mine = &inputs[ctx.rank];
        let mut out = vec![T::from_f32(0.0); count];
        for op in [Op::Sum, Op::Max] {
            let want = large::reference(op, &inputs);
            for (algo, arx) in insts.iter_mut() {
                let forms: &[bool] = if *algo == Algo::TwoShot {
                    &[false, true]
                } else {
                    &[false]
                };
                for &in_place in forms {
                    let what = format!(
                        "{op} call {call} ({count} x {:?}, {algo:?}, in place {in_place})",
                        T::DTYPE
                    );
                    let r = if in_place {
                        out.copy_from_slice(mine);
                        arx.allreduce_host_in_place_op(&mut out, op)
                    } else {
                        verify::poison(&mut out);
                        arx.allreduce_host_op(mine, &mut out, op)
                    };
                    r.map_err(|e| format!("{what}: {e}"))?;
                    if let Some(i) = large::first_diff(&out, &want) {
                        return Err(format!(
                            "{what}: first wrong at {i}: got bits {:02x?}, want {:02x?}",
                            bytemuck::bytes_of(&out[i]),
                            bytemuck::bytes_of(&want[i])
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// Rank `rank`'s input of broadcast call `call`: edge values
/// (`verify::input_edges`: -0.0, ±Inf, NaN, subnormals) and, at seeded
/// positions, raw bit patterns a reduction would not keep (NaN payloads,
/// signalling NaNs, negative NaNs) that a broadcast must move bit for bit.
/// Never the poison pattern (all ones).
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
        // f16 and bf16 signalling NaNs, negative NaNs and subnormals.
        &[0x7c01, 0xfc01, 0x7f81, 0xff81, 0x8001, 0x7dea]
    };
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut v);
    for i in 0..n {
        // Positions depend on (call, i); values on the rank too.
        let k = (call as usize).wrapping_mul(31).wrapping_add(i * 7) % 11;
        if k < raw.len() {
            let w = raw[(k + rank) % raw.len()].to_le_bytes();
            bytes[i * size..(i + 1) * size].copy_from_slice(&w[..size]);
        }
    }
    v
}

fn broadcasts_of<T: Element>(ctx: &Ctx, arx: &mut Arx, call: &mut u64) -> Result<(), String> {
    let m = arx.max_count::<T>();
    for n in [0, 1, 77, 1001, 2 * m + 3] {
        for root in 0..ctx.n {
            for in_place in [false, true] {
                *call += 1;
                bc_call::<T>(ctx, arx, *call, n, root, in_place)?;
            }
        }
    }
    Ok(())
}

/// One broadcast of `n` elements from `root`: the root's bits on every
/// rank (NaN payloads included), the input left as it was.
fn bc_call<T: Element>(
    ctx: &Ctx,
    arx: &mut Arx,
    call: u64,
    n: usize,
    root: usize,
    in_place: bool,
) -> Result<(), String> {
    let me = ctx.rank;
    let what = format!(
        "broadcast call {call} ({n} x {:?} from root {root}, in place {in_place})",
        T::DTYPE
    );
    // Every rank has its own input (the non-roots' must be ignored) and
    // computes the root's on its own.
    let mine = bcast_input::<T>(call, me, n);
    let want = bcast_input::<T>(call, root, n);
    let mut out = vec![T::from_f32(0.0); n];
    verify::poison(&mut out);
    if in_place {
        // A non-root's buffer stays poisoned: every element must be
        // written.
        if me == root {
            out.copy_from_slice(&mine);
        }
        arx.broadcast_host_in_place(&mut out, root)
    } else {
        arx.broadcast_host(&mine, &mut out, root)
    }
    .map_err(|e| format!("{what}: {e}"))?;
    if bits(&out) != bits(&want) {
        let i = (0..n)
            .find(|&i| bits(&out[i..=i]) != bits(&want[i..=i]))
            .unwrap_or(0);
        return Err(format!(
            "{what}: element {i} is {:?} ({:02x?}), want {:?} ({:02x?})",
            verify::value_of(&out[i]),
            bits(&out[i..=i]),
            verify::value_of(&want[i]),
            bits(&want[i..=i]),
        ));
    }
    // The input is left as it was.
    if bits(&mine) != bits(&bcast_input::<T>(call, me, n)) {
        return Err(format!("{what}: the input changed"));
    }
    same_everywhere(ctx, verify::digest(&out))
}

/// broadcast from every root, every dtype, lengths 0 to longer than one
/// slot (chunked), in place and not: the root's bits on every rank (NaN
/// payloads included); then the instance still all-reduces right.
pub(super) fn broadcast_bit_for_bit(ctx: &Ctx) -> Result<(), String> {
    let mut arx = builder()
        .slot_bytes(4096)
        .build(ctx.world)
        .map_err(|e| e.to_string())?;
    let mut call = 14000;
    broadcasts_of::<bf16>(ctx, &mut arx, &mut call)?;
    broadcasts_of::<f16>(ctx, &mut arx, &mut call)?;
    broadcasts_of::<f32>(ctx, &mut arx, &mut call)?;
    checked::<f32>(ctx, &mut arx, 14999, 300, false)?;
    // Broadcast and all-reduce calls interleaved on one instance.
    let mine = bcast_input::<f32>(14998, ctx.rank, 500);
    let mut out = vec![0f32; 500];
    verify::poison(&mut out);
    arx.broadcast_host(&mine, &mut out, ctx.n - 1)
        .map_err(|e| e.to_string())?;
    if bits(&out) != bits(&bcast_input::<f32>(14998, ctx.n - 1, 500)) {
        return Err("broadcast after an all-reduce: wrong bits".into());
    }
    checked::<bf16>(ctx, &mut arx, 14997, 1000, true)
}

/// Ranks that disagree on a broadcast fail at once, every one of them,
/// naming a peer: on the root (rank 0 names rank 1, the others rank 0), on
/// the count (the last rank asks for one element more: the root sees it
/// too), on the collective (rank 0 broadcasts, the others all-gather), and
/// a root that is no rank (rank 0: `InvalidArgument`; its peers fail
/// naming it). At 3+ ranks, the one case where some ranks pass (one rank
/// names itself, others another rank): the passing ranks get the right
/// data, the others fail at once. A fresh instance for each (a failure
/// sticks).
pub(super) fn broadcast_mismatch(ctx: &Ctx) -> Result<(), String> {
    let (world, me) = (ctx.n, ctx.rank);
    let n = 100;
    let bcast = |arx: &mut Arx, n: usize, root: usize| {
        let mine = verify::input::<f32>(SEED, 7, me, n);
        let mut out = vec![0f32; n];
        verify::poison(&mut out);
        let r = arx.broadcast_host(&mine, &mut out, root);
        if r.is_ok() {
            // Never Ok with a wrong result (the test then reports the Ok).
            assert_eq!(bits(&out), bits(&verify::input::<f32>(SEED, 7, root, n)));
        }
        r
    };
    let mismatch = |e: &Error| match e {
        // `ours` is this rank's own word, not what it expected of the
        // peer: a non-root's and a peer's non-root word may be equal.
        Error::CallMismatch {
            peer, ours, theirs, ..
        } => {
            *peer != me
                && *peer < world
                && matches!(ours.pattern, Pattern::Broadcast { .. })
                && matches!(theirs.pattern, Pattern::Broadcast { .. })
        }
        _ => false,
    };
    let mut took = Vec::new();

    // The root: rank 0 names rank 1, every other rank names rank 0.
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    let timeout = arx.config().timeout;
    let t = Instant::now();
    let root = usize::from(me == 0);
    expect_err("broadcast root mismatch", bcast(&mut arx, n, root), |e| {
        mismatch(e) && e.to_string().contains("broadcast")
    })?;
    took.push(t.elapsed());

    // Every rank names itself.
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    let t = Instant::now();
    expect_err(
        "broadcast, every rank its own root",
        bcast(&mut arx, n, me),
        mismatch,
    )?;
    took.push(t.elapsed());

    // The count: the last rank asks for one more element (root 0).
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    let t = Instant::now();
    let len = if me == world - 1 { n + 1 } else { n };
    expect_err(
        "broadcast count mismatch",
        bcast(&mut arx, len, 0),
        mismatch,
    )?;
    took.push(t.elapsed());

    // The collective: rank 0 broadcasts, the others all-gather.
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    let t = Instant::now();
    let r = if me == 0 {
        bcast(&mut arx, world * n, 0)
    } else {
        let mine = verify::input::<f32>(SEED, 8, me, n);
        let mut out = vec![0f32; world * n];
        arx.all_gather_host(&mine, &mut out)
    };
    expect_err("broadcast against all_gather", r, |e| {
        matches!(e, Error::CallMismatch { peer, ours, theirs, .. }
            if *peer != me && ours.pattern != theirs.pattern)
    })?;
    took.push(t.elapsed());

    // A root that is no rank, on rank 0 only.
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    let t = Instant::now();
    let root = if me == 0 { world } else { 0 };
    expect_err(
        "broadcast root out of range",
        bcast(&mut arx, n, root),
        |e| match e {
            Error::InvalidArgument(m) => me == 0 && m.contains("root"),
            Error::CallMismatch { peer: 0, .. } => me != 0,
            _ => false,
        },
    )?;
    // In place too (a fresh instance: the refusal sticks).
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    let mut buf = vec![1f32; n];
    let r = arx.broadcast_host_in_place(&mut buf, if me == 0 { usize::MAX } else { 0 });
    expect_err("in-place broadcast root out of range", r, |e| match e {
        Error::InvalidArgument(m) => me == 0 && m.contains("root"),
        Error::CallMismatch { peer: 0, .. } => me != 0,
        _ => false,
    })?;
    took.push(t.elapsed());

    // The one disagreement on the root that lets some ranks pass (3+
    // ranks): rank 0 names itself, rank 1 names rank 0, the others rank
    // 1. Ranks 0 and 1 get rank 0's data (checked in `bcast`); the others
    // fail at once naming a peer. Nothing waits for the timeout.
    if world >= 3 {
        let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
        let t = Instant::now();
        let root = usize::from(me >= 2);
        let r = bcast(&mut arx, n, root);
        if me < 2 {
            r.map_err(|e| format!("a lone root and a rank that named it: {e}"))?;
        } else {
            expect_err("a lone root, this rank named another", r, mismatch)?;
        }
        took.push(t.elapsed());
    }

    if let Some(d) = took.iter().find(|d| **d > timeout / 2) {
        return Err(format!("a broadcast mismatch took {d:?} (times: {took:?})"));
    }
    Ok(())
}

/// A seeded random sequence of calls, the same on every rank: every
/// collective (all-reduce, reduce_scatter, all_gather, broadcast from any
/// root), op, dtype and length (1 element to past two slots, with the
/// slot's edges often), in place or not, each on one of three instances
/// (one-shot, two-shot, auto; one-page slots, so long calls are chunked)
/// picked at random. Each result is checked as in the per-collective
/// cases, which move from one kind of call to another only at their block
/// boundaries; here the protocol's state (parity, chunk and pipeline
/// counters, flag patterns) goes from any kind of call to any other.
pub(super) fn random_sequence(ctx: &Ctx) -> Result<(), String> {
    use rand::{Rng, SeedableRng};
    let mut insts = three_instances(ctx)?;
    // Every draw is made on every rank in the same order (nothing below
    // draws on a rank-dependent branch), so the ranks agree on each call.
    let mut rng = rand::rngs::StdRng::seed_from_u64(SEED ^ 0x5e9);
    let calls = if ctx.n > 4 { 80 } else { 200 };
    let mut kinds = [0usize; 4];
    for k in 0..calls {
        let call = 30_000 + k;
        let which = rng.gen_range(0..insts.len());
        let dtype = rng.gen_range(0..3);
        let kind = rng.gen_range(0..4);
        kinds[kind] += 1;
        let arx = &mut insts[which];
        let r = match dtype {
            0 => random_call::<bf16>(ctx, arx, call, kind, &mut rng),
            1 => random_call::<f16>(ctx, arx, call, kind, &mut rng),
            _ => random_call::<f32>(ctx, arx, call, kind, &mut rng),
        };
        r.map_err(|e| format!("call {k} of the sequence, instance {which}: {e}"))?;
    }
    if kinds.contains(&0) {
        return Err(format!("the sequence left out a collective: {kinds:?}"));
    }
    Ok(())
}

/// One call of `random_sequence`: collective `kind` (0 all-reduce, 1
/// reduce_scatter, 2 all_gather, 3 broadcast) with its length, op, form
/// and root drawn from `rng`, checked by the per-collective helpers.
fn random_call<T: Element>(
    ctx: &Ctx,
    arx: &mut Arx,
    call: u64,
    kind: usize,
    rng: &mut rand::rngs::StdRng,
) -> Result<(), String> {
    use rand::Rng;
    let m = arx.max_count::<T>();
    // The total length: short, around one slot, anything up to three
    // slots, or just past two.
    let total = match rng.gen_range(0..4) {
        0 => rng.gen_range(1..=16),
        1 => rng.gen_range(m - 2..=m + 2),
        2 => rng.gen_range(1..=3 * m),
        _ => 2 * m + rng.gen_range(0..5),
    };
    let op = Op::ALL[rng.gen_range(0..Op::ALL.len())];
    let in_place = rng.gen_bool(0.5);
    let root = rng.gen_range(0..ctx.n);
    // reduce_scatter and all_gather: about `total` elements in all.
    let per = (total / ctx.n).max(1);
    match kind {
        0 => {
            let input = verify::input_edges::<T>(SEED, call, ctx.rank, total);
            let want = verify::expected_op::<T>(op, true, SEED, call, ctx.n, total);
            reduce_by::<T>(ctx, arx, op, call, &input, &want, in_place).map(|_| ())
        }
        1 => rs_call::<T>(ctx, arx, op, call, per, in_place),
        2 => ag_call::<T>(ctx, arx, call, per, in_place),
        _ => bc_call::<T>(ctx, arx, call, total, root, in_place),
    }
}
