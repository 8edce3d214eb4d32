//! Cases ported from the former `examples/gpu_check` (`check`, `fail`).

use super::*;

// ------------------------------------------- cases of the former gpu_check

/// The kernels' own f32 → bf16/f16 conversions and back, against `half`:
/// every 16-bit pattern (widening), and for every sign and f32 exponent
/// the mantissas around the bf16 and f16 rounding points (ties, ties ± 1,
/// and the ties of every f16 subnormal position) plus 2000 random ones,
/// and the edges (±inf, the f16 and bf16 overflow ties, 2⁻²⁵). The
/// kernel sends pattern i through one of its conversion paths by i % 4
/// (the packed hardware conversion's low or high half, the written-out
/// one), so the list goes four times, shifted by 0-3 leading patterns:
/// every pattern through every path. One rank checks (the GPU is the same
/// for all).
pub(super) fn conversions(ctx: &Ctx, st: Staging) -> R {
    let (arx, _s) = build(ctx, st, Duration::from_secs(20))?;
    if ctx.rank != 0 {
        return Ok(());
    }
    let mut bits: Vec<u32> = (0u32..=0xFFFF).collect();
    let mut rng = StdRng::seed_from_u64(7);
    for sign in [0u32, 0x8000_0000] {
        for exp in 0u32..=255 {
            for m in [
                0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1_8000, 0x0FFF, 0x1000, 0x1001, 0x2000,
                0x3000, 0x7F_FFFF, 0x7F_8000, 0x40_0000, 0x40_1000, 0x3F_F000,
            ] {
                bits.push(sign | exp << 23 | m);
            }
            // f16 subnormal results: the round bit of each position.
            for sh in 13u32..=22 {
                for m in [1u32 << sh, 3 << sh, (1 << sh) - 1, (1 << sh) + 1] {
                    bits.push(sign | exp << 23 | (m & 0x7F_FFFF));
                }
            }
            for _ in 0..2000 {
                bits.push(sign | exp << 23 | rng.gen_range(0..0x80_0000u32));
            }
        }
        for edge in [
            0x7F80_0000u32,
            0x477F_F000,
            0x477F_EFFF,
            0x7F7F_8000,
            0x3300_0000,
        ] {
            bits.push(sign | edge);
        }
    }
    let mut bad = Vec::new();
    let mut nbad = 0usize;
    for shift in 0..4usize {
        // `shift` leading patterns move every pattern to the next path.
        let shifted: Vec<u32> = bits[..shift].iter().chain(&bits).copied().collect();
        let out = arx
            .gpu_convert_check(&shifted)
            .map_err(e("convert check"))?;
        let at = |v: &[u16], i: usize| v[i + shift];
        let at32 = |v: &[u32], i: usize| v[i + shift];
        check_conversions(
            &bits,
            |i| {
                (
                    at(&out.bf16, i),
                    at(&out.f16, i),
                    at32(&out.bf16_back, i),
                    at32(&out.f16_back, i),
                )
            },
            shift,
            &mut bad,
            &mut nbad,
        );
    }
    if nbad > 0 {
        return Err(format!(
            "{nbad} conversions differ from `half`: {}",
            bad.join("; ")
        ));
    }
    ctx.say(format!(
        "{} patterns match `half` bit for bit (4 directions, each pattern through every path)",
        bits.len()
    ));
    Ok(())
}

/// Compares the kernel's conversions of `bits` (`got(i)`: bf16, f16,
/// bf16 → f32, f16 → f32 of pattern i) with `half`'s.
fn check_conversions(
    bits: &[u32],
    got: impl Fn(usize) -> (u16, u16, u32, u32),
    shift: usize,
    bad: &mut Vec<String>,
    nbad: &mut usize,
) {
    for (i, &b) in bits.iter().enumerate() {
        let (g_bf, g_hf, g_bfb, g_hfb) = got(i);
        let f = f32::from_bits(b);
        let h = b as u16;
        let path = (i + shift) % 4;
        let checks = [
            (
                "f32->bf16",
                u32::from(g_bf),
                u32::from(bf16::from_f32(f).to_bits()),
            ),
            (
                "f32->f16",
                u32::from(g_hf),
                u32::from(f16::from_f32(f).to_bits()),
            ),
            ("bf16->f32", g_bfb, bf16::from_bits(h).to_f32().to_bits()),
            ("f16->f32", g_hfb, f16::from_bits(h).to_f32().to_bits()),
        ];
        for (what, got, want) in checks {
            if got != want {
                *nbad += 1;
                if bad.len() < 8 {
                    bad.push(format!(
                        "{what}({b:#010x}, kernel path {path}): gpu {got:#x}, half {want:#x}"
                    ));
                }
            }
        }
    }
}

/// The former gpu_check's lengths: odd ones, vector boundaries, the slot's
/// last two counts.
pub(super) fn length_list(max: usize, quick: bool) -> Vec<usize> {
    let mut v: Vec<usize> = if quick {
        vec![1, 3, 8, 17, 1000, 4097]
    } else {
        vec![
            1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 100, 127, 255, 257, 1000, 1023, 1025,
            2047, 2049, 4095, 4097, 8191, 12345, 65535, 65537, 100003,
        ]
    };
    v.push(max - 1);
    v.push(max);
    v.retain(|&n| n <= max);
    v
}

pub(super) fn lengths_of<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
) -> R<usize> {
    let max = arx.max_count::<T>();
    let mut calls = 0;
    for (k, &n) in length_list(max, ctx.quick).iter().enumerate() {
        for (j, how) in [
            Placement::OutOfPlace,
            Placement::InPlace,
            Placement::Unaligned,
        ]
        .into_iter()
        .enumerate()
        {
            if matches!(how, Placement::Unaligned) && n == max {
                continue; // needs one element of room
            }
            let call = 0x1_0000 | (T::DTYPE.code() as u64) << 12 | (k as u64) << 4 | j as u64;
            checked_call::<T>(ctx, arx, s, call, n, how)?;
            calls += 1;
        }
    }
    Ok(calls)
}

/// bf16, f16 and f32 at every length, out of place, in place and unaligned.
pub(super) fn lengths(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = build(ctx, st, Duration::from_secs(20))?;
    let b = lengths_of::<bf16>(ctx, &mut arx, &s)?;
    let h = lengths_of::<f16>(ctx, &mut arx, &s)?;
    let f = lengths_of::<f32>(ctx, &mut arx, &s)?;
    ctx.say(format!(
        "bf16 {b}, f16 {h}, f32 {f} calls bit-exact (out of place, in place, unaligned; up to {} bf16 elements)",
        arx.max_count::<bf16>()
    ));
    Ok(())
}

/// `calls` back-to-back calls, distinct inputs and outputs, one sync.
pub(super) fn burst_of<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
    calls: usize,
    count: usize,
    first_call: u64,
) -> R {
    let data: Vec<(Vec<T>, Vec<T>)> = (0..calls as u64)
        .map(|i| wide_data::<T>(ctx, first_call + i, count))
        .collect();
    let ins: Vec<CudaSlice<T>> = data.iter().map(|(x, _)| up(s, x)).collect::<R<_>>()?;
    let mut outs: Vec<CudaSlice<T>> = (0..calls)
        .map(|_| poisoned::<T>(s, count))
        .collect::<R<_>>()?;
    s.synchronize().map_err(e("sync"))?;
    for (i, o) in ins.iter().zip(outs.iter_mut()) {
        arx.allreduce(i, o, s).map_err(e("allreduce"))?;
    }
    arx.check().map_err(e("check"))?;
    for (k, (o, (_, want))) in outs.iter().zip(&data).enumerate() {
        let got = down(s, o)?;
        ctx.fold(&got);
        compare(
            &format!("burst call {k} of {calls} ({count} x {})", T::DTYPE.name()),
            &got,
            want,
        )?;
    }
    Ok(())
}

/// 200 back-to-back 8 KB bf16 calls and 50 of 130 KB f32 (quick: 16 and 4).
pub(super) fn bursts(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = build(ctx, st, Duration::from_secs(20))?;
    let n = if ctx.quick { 16 } else { 200 };
    burst_of::<bf16>(ctx, &mut arx, &s, n, 4096, 0x5000_0000)?;
    burst_of::<f32>(ctx, &mut arx, &s, n / 4, 33333, 0x5100_0000)?;
    ctx.say(format!(
        "{n} back-to-back 8 KB bf16 calls and {} 130 KB f32 calls, one sync each burst",
        n / 4
    ));
    Ok(())
}

/// Captures one call into a graph, then replays it `replays` times with a
/// new input before each replay, checking every result.
pub(super) fn graph_of<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
    replays: usize,
    count: usize,
    first_call: u64,
) -> R {
    let mut din = poisoned::<T>(s, count)?;
    let mut dout = poisoned::<T>(s, count)?;
    let g = capture(s, "allreduce under capture", || {
        arx.allreduce(&din, &mut dout, s)
    })?;
    for i in 0..replays as u64 {
        let (x, want) = wide_data::<T>(ctx, first_call + i, count);
        s.memcpy_htod(&x, &mut din).map_err(e("htod"))?;
        poison_dev(s, &mut dout)?;
        g.launch().map_err(e("graph launch"))?;
        let got = down(s, &dout)?;
        arx.check().map_err(e("check"))?;
        ctx.fold(&got);
        compare(
            &format!("graph replay {i} ({count} x {})", T::DTYPE.name()),
            &got,
            &want,
        )?;
    }
    Ok(())
}

/// 1000 replays of an 8 KB bf16 call and 100 of a 400 KB f32 call (quick:
/// 50 and 5), a new input before each.
pub(super) fn graph_replays(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = build(ctx, st, Duration::from_secs(20))?;
    let n = if ctx.quick { 50 } else { 1000 };
    graph_of::<bf16>(ctx, &mut arx, &s, n, 4096, 0x7000_0000)?;
    graph_of::<f32>(ctx, &mut arx, &s, n / 10, 100_000, 0x7100_0000)?;
    ctx.say(format!(
        "1 call captured, {n} replays (8 KB bf16) + {} (400 KB f32), new input before each, all bit-exact",
        n / 10
    ));
    Ok(())
}

/// The last rank calls with one element more: every rank fails with
/// `CallMismatch` well within the deadline, and the failed instance
/// refuses the next call at once.
pub(super) fn mismatch(ctx: &Ctx, st: Staging) -> R {
    let timeout = Duration::from_secs(2);
    let last = ctx.n - 1;
    let (mut arx, s) = build(ctx, st, timeout)?;
    checked_call::<bf16>(ctx, &mut arx, &s, 0x8000_0001, 1000, Placement::OutOfPlace)?;
    let n = if ctx.rank == last { 1001 } else { 1000 };
    let (_, din, mut dout) = expect_mismatch::<bf16>(
        ctx,
        &mut arx,
        &s,
        "mismatch",
        0x8000_0002,
        n,
        timeout,
        |a, i, o| a.allreduce(i, o, &s),
    )?;
    // Later calls return the sticky error at once.
    if arx.allreduce(&din, &mut dout, &s).is_ok() {
        return Err("a failed instance accepted another call".into());
    }
    Ok(())
}

/// One all-reduce of 4096 f32 (seeded input `call`, poisoned output), its
/// result checked with `arx.check()`, timed from the call to the check:
/// the result, the time and the output as it came back.
fn timed_call(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
    call: u64,
) -> R<(arx::Result<()>, Duration, Vec<f32>)> {
    let din = up(s, &wide::<f32>(call, ctx.rank, 4096))?;
    let mut dout = poisoned::<f32>(s, 4096)?;
    s.synchronize().map_err(e("sync"))?;
    let t = Instant::now();
    let r = arx.allreduce(&din, &mut dout, s).and_then(|()| arx.check());
    let took = t.elapsed();
    Ok((r, took, down(s, &dout)?))
}

/// The last rank skips a call: every other rank's kernel exits with a
/// `Timeout` naming it within the 2 s deadline (+1 s), its output
/// NaN-poisoned. Then a new instance on the same GPU (and MPS) runs 20
/// bit-exact calls.
pub(super) fn stopped_rank(ctx: &Ctx, st: Staging) -> R {
    let timeout = Duration::from_secs(2);
    let last = ctx.n - 1;
    {
        let (mut arx, s) = build(ctx, st, timeout)?;
        for k in 0..3 {
            checked_call::<f32>(
                ctx,
                &mut arx,
                &s,
                0x9000_0000 + k,
                4096,
                Placement::OutOfPlace,
            )?;
        }
        if ctx.rank == last {
            // Alive with its instance but not calling, until the others'
            // deadline has passed (as in the former gpu_check, where this
            // rank waited in a collective meanwhile).
            std::thread::sleep(timeout + Duration::from_secs(2));
        } else {
            let (r, waited, out) = timed_call(ctx, &mut arx, &s, 0x9000_0099)?;
            let nan = out.iter().all(|x| x.is_nan());
            let msg = match &r {
                Ok(()) => "no error".to_string(),
                Err(x) => x.to_string(),
            };
            let ok = matches!(&r, Err(Error::Timeout { .. }))
                && msg.contains(&format!("peer {last}"))
                && waited < timeout + Duration::from_secs(1)
                && nan;
            if !ok {
                return Err(format!(
                    "rank {last} stopped: waited {waited:.2?} (deadline {timeout:?}), output all NaN {nan}: {msg}"
                ));
            }
            ctx.say(format!(
                "rank {last} skipped a call; rank 0's kernel exited with Timeout after {waited:.2?} (deadline {timeout:?}), output NaN; it says: {msg}"
            ));
        }
    }
    let (mut arx, s) = build(ctx, st, Duration::from_secs(10))?;
    for k in 0..20 {
        checked_call::<bf16>(
            ctx,
            &mut arx,
            &s,
            0x9100_0000 + k,
            3000,
            Placement::OutOfPlace,
        )
        .map_err(|m| format!("after the stopped rank: {m}"))?;
    }
    ctx.say("then a new instance on the same GPU ran 20 bit-exact calls");
    Ok(())
}

/// The last rank drops its instance after a call longer than one slot
/// (pipelined chunks; small slots) while the others call again: their
/// call fails at once naming it, its call `CallKind::Departed` (their
/// proxies read its departure word and poison its flag for the kernel),
/// not at the kernel's deadline; the call it made was right everywhere.
pub(super) fn rank_drops_early(ctx: &Ctx, st: Staging) -> R {
    let timeout = Duration::from_secs(4);
    let last = ctx.n - 1;
    let (mut arx, s) = build_small(ctx, st, timeout)?;
    let m = arx.max_count::<f32>();
    checked_call::<f32>(ctx, &mut arx, &s, 0x9300_0000, 4096, Placement::OutOfPlace)?;
    checked_call::<f32>(
        ctx,
        &mut arx,
        &s,
        0x9300_0001,
        3 * m + 5,
        Placement::OutOfPlace,
    )
    .map_err(|x| format!("the leaver's last call: {x}"))?;
    if ctx.rank == last {
        drop(arx);
        return Ok(());
    }
    let (r, took, _) = timed_call(ctx, &mut arx, &s, 0x9300_0002)?;
    match r {
        Err(Error::CallMismatch { peer, theirs, .. })
            if peer == last && theirs.kind == arx::CallKind::Departed && took < timeout / 2 =>
        {
            ctx.say(format!(
                "rank {last} dropped its instance; the next call failed after {took:.2?}"
            ));
            Ok(())
        }
        Err(x) => Err(format!(
            "the call after rank {last} left: after {took:.2?} (timeout {timeout:?}): {x}"
        )),
        Ok(()) => Err(format!("the call after rank {last} left returned Ok")),
    }
}

/// The last rank arrives after every other rank's kernel timed out: its
/// late call may still be summed (right bits) or fail at once, and its next
/// call fails at once naming a peer that timed out (the peers' proxies
/// poisoned their flags, `CallKind::Failed`), not after its own deadline.
/// Every rank keeps its instance until the late rank is done.
pub(super) fn late_rank(ctx: &Ctx, st: Staging) -> R {
    let timeout = Duration::from_secs(2);
    let last = ctx.n - 1;
    let (mut arx, s) = build(ctx, st, timeout)?;
    checked_call::<f32>(ctx, &mut arx, &s, 0x9200_0000, 4096, Placement::OutOfPlace)?;
    let told = |e: &Error| {
        matches!(e, Error::CallMismatch { theirs, peer, .. }
            if theirs.kind == arx::CallKind::Failed && *peer != last)
    };
    let (x, want) = wide_data::<f32>(ctx, 0x9200_0001, 4096);
    let din = up(&s, &x)?;
    let mut dout = poisoned::<f32>(&s, 4096)?;
    s.synchronize().map_err(e("sync"))?;
    let result = if ctx.rank == last {
        std::thread::sleep(timeout + Duration::from_secs(2));
        let r = arx
            .allreduce(&din, &mut dout, &s)
            .and_then(|()| arx.check());
        let first = match r {
            Ok(()) => compare("the late call", &down(&s, &dout)?, &want),
            Err(x) if told(&x) => Ok(()),
            Err(x) => Err(format!("the late call: unexpected error: {x}")),
        };
        first.and_then(|()| {
            let t = Instant::now();
            let r = arx
                .allreduce(&din, &mut dout, &s)
                .and_then(|()| arx.check());
            let took = t.elapsed();
            match r {
                Err(x) if told(&x) && took < timeout / 2 => {
                    ctx.say(format!(
                        "the late rank's next call failed after {took:.2?}: {x}"
                    ));
                    Ok(())
                }
                Err(x) => Err(format!(
                    "the call after the late one: after {took:.2?}: {x}"
                )),
                Ok(()) => Err("the call after the late one returned Ok".into()),
            }
        })
    } else {
        match arx
            .allreduce(&din, &mut dout, &s)
            .and_then(|()| arx.check())
        {
            Err(Error::Timeout { .. }) => Ok(()),
            Err(x) if told(&x) => Ok(()),
            Err(x) => Err(format!("a call the last rank is late for: {x}")),
            Ok(()) => Err("a call the last rank is late for returned Ok".into()),
        }
    };
    ctx.world.barrier();
    result
}
