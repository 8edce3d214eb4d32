//! Calls longer than one slot: split into chunks of half a slot, each a
//! call of its own, pipelined (kernels/arx_abi.h). A small slot keeps these quick; lengths are
//! derived from `max_count` (the chunk), so a larger page (aarch64) only
//! makes the chunk larger.

use super::*;

/// Lengths around the slot's `m` elements: 1, m−1, m, m+1 (three
/// half-slot chunks, the shortest pipeline), 2m+3, ~3.5m, ~10m (21 chunks:
/// every place of the four reused five times).
fn chunk_lengths(m: usize) -> [usize; 7] {
    [1, m - 1, m, m + 1, 2 * m + 3, 3 * m + m / 2 + 1, 10 * m + 7]
}

/// The slot of these cases: one page (4 KiB here; the layout rounds up to
/// the page, so it is the kernel's page on other machines).
const SMALL_SLOT: usize = 4096;

/// Every length around the chunk; out of place and in place alternate
/// (`first_in_place` says which comes first), so each placement meets
/// every kind of length across the dtypes while the case stays short over
/// soft-RoCE (where the reference's cost in a debug build under emulation
/// dominates).
fn chunked_lengths_of<T: Element>(
    ctx: &Ctx,
    arx: &mut Arx,
    call: &mut u64,
    first_in_place: bool,
) -> Result<(), String> {
    let m = arx.max_count::<T>();
    for (i, count) in chunk_lengths(m).into_iter().enumerate() {
        *call += 1;
        let in_place = (i % 2 == 0) == first_in_place;
        checked::<T>(ctx, arx, *call, count, in_place)
            .map_err(|e| format!("chunk of {m} elements: {e}"))?;
    }
    Ok(())
}

/// Every dtype at every length around the chunk, out of place and in
/// place, bit for bit against the independent reference; then a call of
/// one slot or less on the same instance is right (the instance is not
/// left out of step).
pub(super) fn chunked_lengths(ctx: &Ctx) -> Result<(), String> {
    let mut arx = builder()
        .slot_bytes(SMALL_SLOT)
        .build(ctx.world)
        .map_err(|e| e.to_string())?;
    let mut call = 5000;
    chunked_lengths_of::<bf16>(ctx, &mut arx, &mut call, false)?;
    chunked_lengths_of::<f16>(ctx, &mut arx, &mut call, true)?;
    chunked_lengths_of::<f32>(ctx, &mut arx, &mut call, false)?;
    // The longest again in place for f32 (every length of f32 then has
    // run in both placements but 1, m and 2m+3).
    let m = arx.max_count::<f32>();
    checked::<f32>(ctx, &mut arx, 5050, 3 * m + m / 2 + 1, true)?;
    // Ordinary calls after the chunked ones, and chunked ones after them.
    checked::<f32>(ctx, &mut arx, 5100, 100, false)?;
    checked::<bf16>(ctx, &mut arx, 5101, 3, true)?;
    let m = arx.max_count::<f32>();
    checked::<f32>(ctx, &mut arx, 5102, 2 * m + 3, false)?;
    checked::<f16>(ctx, &mut arx, 5103, 77, false)
}

/// The same inputs (edge values: −0.0, NaN, ±Inf, subnormals, overflow)
/// through an instance whose slot holds the whole call and one that splits
/// it into chunks give the same bits, and both match the reference.
pub(super) fn chunked_same_bits(ctx: &Ctx) -> Result<(), String> {
    let mut small = builder()
        .slot_bytes(SMALL_SLOT)
        .build(ctx.world)
        .map_err(|e| e.to_string())?;
    let mut whole = builder().build(ctx.world).map_err(|e| e.to_string())?;
    let m = small.max_count::<f32>();
    let count = 3 * m + 5;
    if count > whole.max_count::<f32>() {
        return Err(format!(
            "the whole call ({count} x f32) does not fit the large slot"
        ));
    }
    for (i, c) in [5200u64, 5201].into_iter().enumerate() {
        let input = verify::input_edges::<f32>(SEED, c, ctx.rank, count);
        let want = verify::expected_edges::<f32>(SEED, c, ctx.n, count);
        let mut a = vec![0f32; count];
        let mut b = vec![0f32; count];
        verify::poison(&mut a);
        verify::poison(&mut b);
        if i == 0 {
            small.allreduce_host(&input, &mut a)
        } else {
            a.copy_from_slice(&input);
            small.allreduce_host_in_place(&mut a)
        }
        .map_err(|e| format!("chunked call {c}: {e}"))?;
        whole
            .allreduce_host(&input, &mut b)
            .map_err(|e| format!("whole call {c}: {e}"))?;
        let wrong = verify::count_wrong(&a, &want);
        if wrong != 0 {
            return Err(format!(
                "chunked call {c}: {wrong} wrong against the reference"
            ));
        }
        let differ = a
            .iter()
            .zip(&b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        if differ != 0 {
            return Err(format!(
                "call {c}: {differ} elements differ in their bits between the chunked and the whole call"
            ));
        }
        same_everywhere(ctx, verify::digest(&a))?;
    }
    Ok(())
}

/// The last rank's call differs in total length from the others': every
/// rank must fail with a call mismatch (naming the last rank, or on the
/// last rank naming a peer), at once rather than by the call timeout, for:
/// one chunk more at equal chunk counts (only the "more chunks follow"
/// mark differs), a last chunk of another length, and an empty call
/// against a chunked one. Each on a fresh instance (a failed one stays
/// failed, which is checked too).
pub(super) fn chunked_length_mismatch(ctx: &Ctx) -> Result<(), String> {
    let last = ctx.n - 1;
    // (what, the others' length, the last rank's), in chunks of m.
    type Lengths = fn(usize) -> (usize, usize);
    let cases: [(&str, Lengths); 3] = [
        ("one more chunk", |m| (2 * m, 3 * m)),
        ("another last chunk", |m| (2 * m + 3, 2 * m + 5)),
        ("empty against chunked", |m| (0, m + 1)),
    ];
    for (what, lengths) in cases {
        let mut arx = builder()
            .slot_bytes(SMALL_SLOT)
            .build(ctx.world)
            .map_err(|e| e.to_string())?;
        let m = arx.max_count::<f32>();
        let (ours, odd) = lengths(m);
        // A chunked call that agrees first.
        checked::<f32>(ctx, &mut arx, 5300, 2 * m + 1, false)?;
        let count = if ctx.rank == last { odd } else { ours };
        let input = verify::input::<f32>(SEED, 5301, ctx.rank, count);
        let mut out = vec![0f32; count];
        verify::poison(&mut out);
        let t = Instant::now();
        let r = arx.allreduce_host(&input, &mut out);
        let waited = t.elapsed();
        expect_err(what, r, |e| match e {
            Error::CallMismatch {
                peer, ours, theirs, ..
            } => {
                let named = if ctx.rank == last {
                    *peer != last
                } else {
                    *peer == last
                };
                named
                    && ours != theirs
                    && ours.kind == CallKind::Reduce(Dtype::F32)
                    && theirs.kind == CallKind::Reduce(Dtype::F32)
            }
            _ => false,
        })?;
        if waited > arx.config().timeout / 2 {
            return Err(format!(
                "{what}: the mismatch took {waited:?} (call timeout {:?}): found by a timeout, not at once",
                arx.config().timeout
            ));
        }
        expect_err(
            &format!("{what}: a call after the failure"),
            arx.allreduce_host(&[1.0f32], &mut [0f32]),
            |e| matches!(e, Error::CallMismatch { .. }),
        )?;
    }
    Ok(())
}

/// Pipelined chunks back to back: calls of 1 to 5 slots (3 to 10
/// half-slot chunks, the last one tiny), each followed by a call of one whole slot (which
/// uses both halves of its slots right after a pipelined call), through
/// one-shot and two-shot, in place and out of place, with no
/// synchronisation between the calls (a rank may run ahead into its next
/// call while a peer still sums); every output is kept and checked
/// afterwards against the independent reference. A chunk published into a
/// place a peer still reads shows up here as wrong elements (checked by
/// breaking the placement rule and the last chunk's rule: both failed
/// this case at 4 or 8 ranks).
pub(super) fn pipelined_back_to_back(ctx: &Ctx) -> Result<(), String> {
    const PIPE_SLOT: usize = 32 << 10;
    for (k, algo) in [arx::Algo::OneShot, arx::Algo::TwoShot]
        .into_iter()
        .enumerate()
    {
        let mut b = builder().slot_bytes(PIPE_SLOT).algo(algo);
        if ctx.rank == ctx.n - 1 {
            // The last rank is the slow one: it pauses before every
            // pipelined sum and copy, its peers run ahead as far as the
            // protocol lets them.
            b = b.test_sum_delay(std::time::Duration::from_millis(2));
        }
        let mut arx = b.build(ctx.world).map_err(|e| e.to_string())?;
        let m = arx.max_count::<f32>();
        let calls = 20u64;
        let first = 5400 + 100 * k as u64;
        let mut outs = Vec::new();
        for c in first..first + calls {
            // The length (the same on every rank) from the call number:
            // chunked, its last chunk of 1 to 3 elements (a peer may still
            // sum the full chunk before it when this rank is done), then
            // most of one whole slot.
            let count = if c % 2 == 0 {
                m / 2 * (2 + (c as usize / 2) % 8) + 1 + (c as usize % 3)
            } else {
                m - (c as usize * 31) % (m / 4)
            };
            let input = verify::input::<f32>(SEED, c, ctx.rank, count);
            let mut out = input.clone();
            let r = if c % 4 < 2 {
                arx.allreduce_host_in_place(&mut out)
            } else {
                verify::poison(&mut out);
                arx.allreduce_host(&input, &mut out)
            };
            r.map_err(|e| format!("{algo:?} call {c} ({count} x f32): {e}"))?;
            outs.push((c, out));
        }
        for (c, out) in outs {
            let want = verify::expected::<f32>(SEED, c, ctx.n, out.len());
            let wrong = verify::count_wrong(&out, &want);
            if wrong != 0 {
                let i = verify::first_wrong(&out, &want).unwrap_or(0);
                return Err(format!(
                    "{algo:?} call {c} ({} x f32, slot of {m}): {wrong} wrong; first at {i}: got {} want {}",
                    out.len(),
                    out[i],
                    want[i]
                ));
            }
            same_everywhere(ctx, verify::digest(&out))?;
        }
    }
    Ok(())
}
