//! The stage trace (`Arx::trace_stages`, `Arx::last_stages`) on real
//! ranks: every stage of a traced call present and the stages adding up to
//! the call; the per-stage medians within a wide factor of an untraced
//! call's median (a factor, never a time: the machine may be loaded);
//! nothing traced while off; results still right while traced.

use super::*;

/// Median of `v` (µs).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub(crate) fn stage_trace(ctx: &Ctx) -> Result<(), String> {
    const CALLS: u64 = 40;
    let count = 4096; // 16 KiB of f32: one slot of builder()'s 64 KiB
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    // Untraced calls, each timed alone; the last one's result checked.
    let input = verify::input::<f32>(SEED, 0, ctx.rank, count);
    let mut out = vec![0f32; count];
    let mut whole = vec![];
    for _ in 0..CALLS {
        verify::poison(&mut out);
        let t = Instant::now();
        arx.allreduce_host(&input, &mut out)
            .map_err(|e| e.to_string())?;
        whole.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let want = verify::expected::<f32>(SEED, 0, ctx.n, count);
    if verify::count_wrong(&out, &want) != 0 {
        return Err("untraced call: wrong sum".into());
    }
    if arx.last_stages().seq != 0 {
        return Err(format!("traced while off: {:?}", arx.last_stages()));
    }
    arx.trace_stages(true);
    let mut per: [Vec<f64>; 6] = Default::default();
    for call in CALLS + 1..=2 * CALLS {
        checked::<f32>(ctx, &mut arx, call, count, false)?;
        let s = arx.last_stages();
        if s.seq != call {
            return Err(format!("call {call}: the trace holds call {}", s.seq));
        }
        let mut sum = Duration::ZERO;
        for (i, (name, d)) in s.named().iter().enumerate() {
            let d = d.ok_or_else(|| format!("call {call}: no {name} stage: {s:?}"))?;
            sum += d;
            per[i].push(d.as_secs_f64() * 1e6);
        }
        let w = s
            .whole
            .ok_or_else(|| format!("call {call}: no whole: {s:?}"))?;
        if sum != w {
            return Err(format!("call {call}: stages add to {sum:?}, whole {w:?}"));
        }
        // Staging, posting and reducing 16 KiB each take time on any
        // machine; the clock has nanoseconds.
        for (name, d) in [("stage", s.stage), ("post", s.post), ("reduce", s.reduce)] {
            if d == Some(Duration::ZERO) {
                return Err(format!("call {call}: {name} took no time: {s:?}"));
            }
        }
    }
    arx.trace_stages(false);
    checked::<f32>(ctx, &mut arx, 2 * CALLS + 1, count, false)?;
    if arx.last_stages().seq != 2 * CALLS {
        return Err(format!(
            "traced after it was turned off: {:?}",
            arx.last_stages()
        ));
    }
    let sum: f64 = per.into_iter().map(median).sum();
    let whole = median(whole);
    // The factor is wide on purpose (a loaded, oversubscribed machine:
    // a median of a sum is not the sum of medians when calls stall), yet a
    // stage that lost most of the call, or a unit error, falls outside it.
    if !(whole / 20.0..=whole * 20.0).contains(&sum) {
        return Err(format!(
            "sum of stage medians {sum:.1} us against the whole call's median {whole:.1} us"
        ));
    }
    Ok(())
}
