//! The stage trace (`Arx::trace_stages`, `Arx::last_stages`) on real
//! ranks: every stage of a traced call present and the stages adding up to
//! the call; the per-stage medians within a wide factor of an untraced
//! call's median (a factor, never a time: the machine may be loaded);
//! nothing traced while off; results still right while traced.
//!
//! Every rank runs every call and reaches every barrier whatever fails (the
//! first failure is kept and returned at the end), so that no rank waits in
//! a collective for one that left.

use super::*;

/// Median of `v` (µs).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

pub(crate) fn stage_trace(ctx: &Ctx) -> Result<(), String> {
    const CALLS: u64 = 40;
    // 16 KiB of f32: one slot of builder()'s 64 KiB. The trace records
    // one-shot calls (a two-shot call has two rounds).
    let count = 4096;
    let mut arx = builder()
        .algo(arx::Algo::OneShot)
        .build(ctx.world)
        .map_err(|e| e.to_string())?;
    let mut first: Option<String> = None;
    let mut fail = |e: String| {
        first.get_or_insert(e);
    };
    // Untraced and traced calls run alike (the same input, the reference
    // computed once, every result checked), so that no rank's checking
    // shows up in a peer's wait on one side only.
    let input = verify::input::<f32>(SEED, 0, ctx.rank, count);
    let want = verify::expected::<f32>(SEED, 0, ctx.n, count);
    let mut out = vec![0f32; count];
    let mut call = |arx: &mut Arx, fail: &mut dyn FnMut(String), n: u64| -> f64 {
        verify::poison(&mut out);
        let t = Instant::now();
        let r = arx.allreduce_host(&input, &mut out);
        let us = t.elapsed().as_secs_f64() * 1e6;
        match r {
            Err(e) => fail(format!("call {n}: {e}")),
            Ok(()) if verify::count_wrong(&out, &want) != 0 => {
                fail(format!("call {n}: wrong sum"));
            }
            Ok(()) => {}
        }
        us
    };

    let mut whole = vec![];
    ctx.world.barrier();
    for n in 1..=CALLS {
        whole.push(call(&mut arx, &mut fail, n));
    }
    if arx.last_stages().seq != 0 {
        fail(format!("traced while off: {:?}", arx.last_stages()));
    }

    arx.trace_stages(true);
    let mut per: [Vec<f64>; 6] = Default::default();
    ctx.world.barrier();
    for n in CALLS + 1..=2 * CALLS {
        call(&mut arx, &mut fail, n);
        let s = arx.last_stages();
        if s.seq != n {
            fail(format!("call {n}: the trace holds call {}", s.seq));
            continue;
        }
        let mut sum = Duration::ZERO;
        for (i, (name, d)) in s.named().iter().enumerate() {
            match d {
                Some(d) => {
                    sum += *d;
                    per[i].push(d.as_secs_f64() * 1e6);
                }
                None => fail(format!("call {n}: no {name} stage: {s:?}")),
            }
        }
        if s.whole != Some(sum) {
            fail(format!(
                "call {n}: stages add to {sum:?}, whole {:?}",
                s.whole
            ));
        }
        // Staging, posting and reducing 16 KiB each take time on any
        // machine; the clock has nanoseconds.
        for (name, d) in [("stage", s.stage), ("post", s.post), ("reduce", s.reduce)] {
            if d == Some(Duration::ZERO) {
                fail(format!("call {n}: {name} took no time: {s:?}"));
            }
        }
    }
    arx.trace_stages(false);
    call(&mut arx, &mut fail, 2 * CALLS + 1);
    if arx.last_stages().seq != 2 * CALLS {
        fail(format!(
            "traced after it was turned off: {:?}",
            arx.last_stages()
        ));
    }

    let sum: f64 = per.into_iter().map(median).sum();
    let whole = median(whole);
    // The factor is wide on purpose (a loaded, oversubscribed machine: a
    // median of a sum is not the sum of medians when calls stall), yet a
    // stage that lost most of the call, or a unit error, falls outside it.
    if !(whole / 20.0..=whole * 20.0).contains(&sum) {
        fail(format!(
            "sum of stage medians {sum:.1} us against the whole call's median {whole:.1} us"
        ));
    }
    first.map_or(Ok(()), Err)
}
