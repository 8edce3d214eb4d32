//! Cases where ranks disagree, fail, stop or start late: every rank must
//! get an error naming the rank and the setting or call, in bounded time.

use super::*;

/// Expects an error on this rank; `ok` says which errors are right.
pub(super) fn expect_err(
    what: &str,
    r: arx::Result<()>,
    ok: impl Fn(&Error) -> bool,
) -> Result<(), String> {
    match r {
        Ok(()) => Err(format!("{what}: expected an error, got Ok")),
        Err(e) if ok(&e) => Ok(()),
        Err(e) => Err(format!("{what}: unexpected error: {e}")),
    }
}

pub(super) fn config_mismatch(ctx: &Ctx) -> Result<(), String> {
    let odd = ctx.rank == ctx.n - 1;
    let b = if odd {
        builder().slot_bytes(128 << 10)
    } else {
        builder()
    };
    let t = Instant::now();
    let r = b.build(ctx.world).map(|_| ());
    expect_err(
        "mismatched slot size",
        r,
        |e| matches!(e, Error::Mismatch { what, rank, .. } if *what == "ARX_SLOT_BYTES" && *rank == ctx.n - 1),
    )?;
    // A fabric mismatch is named too.
    let b = if odd {
        builder().fabric(FabricKind::Verbs)
    } else {
        builder().fabric(FabricKind::Shm)
    };
    let r = b.build(ctx.world).map(|_| ());
    expect_err(
        "mismatched fabric",
        r,
        |e| matches!(e, Error::Mismatch { what, rank, .. } if *what == "ARX_FABRIC" && *rank == ctx.n - 1),
    )?;
    if t.elapsed() > Duration::from_secs(30) {
        return Err(format!("mismatch detection took {:?}", t.elapsed()));
    }
    // Slot sizes that round up to the same whole pages agree: the odd rank
    // asks for 100 bytes less than the others, and every rank's slot is
    // the default's pages.
    let b = if odd {
        builder().slot_bytes(arx::DEFAULT_SLOT_BYTES - 100)
    } else {
        builder().slot_bytes(arx::DEFAULT_SLOT_BYTES)
    };
    let mut arx = b
        .build(ctx.world)
        .map_err(|e| format!("slot sizes that round alike: {e}"))?;
    if arx.max_count::<f32>() * 4 != arx::DEFAULT_SLOT_BYTES {
        return Err(format!(
            "slot sizes that round alike: {} f32 elements per slot on rank {}",
            arx.max_count::<f32>(),
            ctx.rank
        ));
    }
    let n = arx.max_count::<f32>();
    checked::<f32>(ctx, &mut arx, 3, n, false)
}

pub(super) fn length_mismatch(ctx: &Ctx) -> Result<(), String> {
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    checked::<f32>(ctx, &mut arx, 1, 100, false)?;
    let count = if ctx.rank == ctx.n - 1 { 101 } else { 100 };
    let input = verify::input::<f32>(SEED, 2, ctx.rank, count);
    let mut out = vec![0f32; count];
    let r = arx.allreduce_host(&input, &mut out);
    let last = ctx.n - 1;
    expect_err("length mismatch", r, |e| match e {
        Error::CallMismatch {
            peer, theirs, ours, ..
        } => {
            if ctx.rank == last {
                ours.count == 101 && theirs.count == 100
            } else {
                *peer == last && theirs.count == 101
            }
        }
        // Ranks that did not look at the odd rank's flag first may time out
        // only if they saw no mismatch at all; that is a failure.
        _ => false,
    })?;
    // The instance stays failed: the next call returns the error again.
    expect_err(
        "call after failure",
        arx.allreduce_host(&input, &mut out),
        |_| true,
    )
}

pub(super) fn dtype_mismatch(ctx: &Ctx) -> Result<(), String> {
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    let r = if ctx.rank == 0 {
        let i = verify::input::<f16>(SEED, 1, ctx.rank, 64);
        arx.allreduce_host(&i, &mut [f16::ZERO; 64])
    } else {
        let i = verify::input::<bf16>(SEED, 1, ctx.rank, 64);
        arx.allreduce_host(&i, &mut [bf16::ZERO; 64])
    };
    expect_err("dtype mismatch", r, |e| match e {
        Error::CallMismatch { theirs, ours, .. } => {
            if ctx.rank == 0 {
                ours.kind == CallKind::Reduce(Dtype::F16)
                    && theirs.kind == CallKind::Reduce(Dtype::Bf16)
            } else {
                theirs.kind == CallKind::Reduce(Dtype::F16)
            }
        }
        _ => false,
    })
}

/// Rank 1 refuses its call (its input and output lengths differ; a call
/// longer than the slot is no refusal any more, see `chunked.rs`): it
/// returns the reason, every other rank fails at once naming rank 1.
pub(super) fn one_rank_refuses(ctx: &Ctx) -> Result<(), String> {
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    let count = 3 * arx.max_count::<f32>() + 1; // a chunked call elsewhere
    let input = verify::input::<f32>(SEED, 1, ctx.rank, count);
    let mut out = vec![0f32; if ctx.rank == 1 { count - 1 } else { count }];
    let t = Instant::now();
    let r = arx.allreduce_host(&input, &mut out);
    expect_err("refused on rank 1", r, |e| match e {
        Error::InvalidArgument(m) => ctx.rank == 1 && m.contains("input has"),
        Error::CallMismatch { peer, theirs, .. } => {
            ctx.rank != 1 && *peer == 1 && theirs.kind == CallKind::Refused
        }
        _ => false,
    })?;
    // Refused at once, not by a timeout.
    if t.elapsed() > arx.config().timeout / 2 {
        return Err(format!("the refusal took {:?}", t.elapsed()));
    }
    Ok(())
}

/// Rank 0 stops calling and rank 1 refuses its call: every other rank must
/// fail at once naming rank 1, although rank 0 (silent) comes first in its
/// order of peers. Rank 0 keeps its instance until the others are done (an
/// MPI barrier): dropping it would tell them it left.
pub(super) fn refusal_past_silence(ctx: &Ctx) -> Result<(), String> {
    if ctx.n < 3 {
        return Ok(()); // needs a silent rank, a refusing rank and a witness
    }
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    checked::<f32>(ctx, &mut arx, 1, 100, false)?;
    let result = if ctx.rank == 0 {
        Ok(()) // silent
    } else {
        refused_past_silence(ctx, &mut arx)
    };
    ctx.world.barrier();
    result
}

fn refused_past_silence(ctx: &Ctx, arx: &mut Arx) -> Result<(), String> {
    // Rank 1's input and output lengths differ: refused.
    let input = verify::input::<f32>(SEED, 2, ctx.rank, 100);
    let mut out = vec![0f32; if ctx.rank == 1 { 101 } else { 100 }];
    let t = Instant::now();
    let r = arx.allreduce_host(&input, &mut out);
    expect_err("refusal past a silent rank", r, |e| match e {
        Error::InvalidArgument(_) => ctx.rank == 1,
        Error::CallMismatch { peer, .. } => *peer == 1,
        _ => false,
    })?;
    if t.elapsed() > arx.config().timeout / 2 {
        return Err(format!(
            "took {:?}: the refusal was not seen past the silent rank",
            t.elapsed()
        ));
    }
    Ok(())
}

/// The last rank stops calling but keeps its instance (until the others
/// are done: an MPI barrier): every other rank's call times out, naming it,
/// within the timeout and some slack.
pub(super) fn rank_stops(ctx: &Ctx) -> Result<(), String> {
    let timeout = Duration::from_millis(1500);
    let mut arx = builder()
        .timeout(timeout)
        .build(ctx.world)
        .map_err(|e| e.to_string())?;
    checked::<bf16>(ctx, &mut arx, 1, 512, false)?;
    let result = if ctx.rank == ctx.n - 1 {
        Ok(()) // this rank stops calling
    } else {
        times_out_on_the_last(ctx, &mut arx, timeout)
    };
    ctx.world.barrier();
    result
}

fn times_out_on_the_last(ctx: &Ctx, arx: &mut Arx, timeout: Duration) -> Result<(), String> {
    let input = verify::input::<bf16>(SEED, 2, ctx.rank, 512);
    let mut out = vec![bf16::ZERO; 512];
    let t = Instant::now();
    let r = arx.allreduce_host(&input, &mut out);
    let waited = t.elapsed();
    let last = ctx.n - 1;
    expect_err(
        "peer stopped",
        r,
        |e| matches!(e, Error::Timeout { detail, .. } if detail.contains(&format!("peer {last} lane 0: missing"))),
    )?;
    if waited < timeout || waited > timeout + Duration::from_secs(5) {
        return Err(format!(
            "timed out after {waited:?}, configured {timeout:?}"
        ));
    }
    Ok(())
}

/// The last rank drops its instance after a call longer than one slot
/// (pipelined chunks: a peer may still be summing when it leaves) while the
/// others go on: each of their next calls fails at once, naming it, its
/// call `CallKind::Departed` (its departure word, read by their proxies),
/// not at their timeout; and their result of the call it did make is
/// right (its departure fails no call it made). Both algorithms' last
/// steps, one instance each.
pub(super) fn rank_drops_early(ctx: &Ctx) -> Result<(), String> {
    let timeout = Duration::from_secs(5);
    let leaver = ctx.n - 1;
    for (k, algo) in [arx::Algo::OneShot, arx::Algo::TwoShot]
        .into_iter()
        .enumerate()
    {
        let mut arx = builder()
            .slot_bytes(4096)
            .algo(algo)
            .timeout(timeout)
            .build(ctx.world)
            .map_err(|e| e.to_string())?;
        let call = 10 * k as u64;
        let m = arx.max_count::<f32>();
        checked::<f32>(ctx, &mut arx, call + 1, 100, false)?;
        checked::<f32>(ctx, &mut arx, call + 2, 3 * m + 5, false)
            .map_err(|e| format!("{algo:?}: the leaver's last call: {e}"))?;
        if ctx.rank == leaver {
            drop(arx);
            continue;
        }
        for (i, count) in [100, 3 * m + 5].into_iter().enumerate() {
            let input = verify::input::<f32>(SEED, call + 3 + i as u64, ctx.rank, count);
            let mut out = vec![0f32; count];
            let t = Instant::now();
            let r = arx.allreduce_host(&input, &mut out);
            let took = t.elapsed();
            expect_err(
                &format!("{algo:?}: call {} after rank {leaver} left", i + 1),
                r,
                |e| match e {
                    // The first: its flag's place holds the poison.
                    Error::CallMismatch { peer, theirs, .. } if i == 0 => {
                        *peer == leaver && theirs.kind == CallKind::Departed
                    }
                    // The next: the instance failed for good.
                    _ => i > 0,
                },
            )?;
            if took > timeout / 2 {
                return Err(format!(
                    "{algo:?}: call {} after rank {leaver} left failed after {took:?}, not at \
                     once (timeout {timeout:?})",
                    i + 1
                ));
            }
        }
    }
    Ok(())
}

/// Two instances dropped in opposite orders on even and odd ranks (the
/// docs allow it: over RDMA each collective close may then wait up to the
/// timeout, and a departure word may go to a peer that already closed):
/// the drops end within their bounds, and a new instance's call is right.
pub(super) fn drops_in_other_orders(ctx: &Ctx) -> Result<(), String> {
    let timeout = Duration::from_millis(1500);
    let mut a = builder()
        .timeout(timeout)
        .build(ctx.world)
        .map_err(|e| e.to_string())?;
    let mut b = builder()
        .timeout(timeout)
        .build(ctx.world)
        .map_err(|e| e.to_string())?;
    checked::<f32>(ctx, &mut a, 1, 300, false)?;
    checked::<f32>(ctx, &mut b, 2, 300, false)?;
    let t = Instant::now();
    if ctx.rank % 2 == 0 {
        drop(a);
        drop(b);
    } else {
        drop(b);
        drop(a);
    }
    // Each close waits at most about one timeout (and the proxy's stop
    // one more second when its drain is stuck).
    let took = t.elapsed();
    if took > 2 * (2 * timeout + Duration::from_secs(1)) {
        return Err(format!("the two drops took {took:?} (timeout {timeout:?})"));
    }
    ctx.world.barrier();
    let mut c = builder().build(ctx.world).map_err(|e| e.to_string())?;
    checked::<bf16>(ctx, &mut c, 3, 1000, false)
}

/// A rank that arrives after its peers' call timeout ran out may finish that
/// call on their partials (with the right sum) or fail it, but its next call
/// fails at once, naming a peer that had failed: the peers that timed out
/// told it (poisoned flags, `Fabric::tell_failed`) rather than leaving it to
/// wait out its own timeout. Every rank keeps its instance until the late
/// one is done (an MPI barrier), as a job whose ranks go on calling would.
pub(super) fn late_rank_fails_next_call_at_once(ctx: &Ctx) -> Result<(), String> {
    let timeout = Duration::from_millis(1500);
    let mut arx = builder()
        .timeout(timeout)
        .build(ctx.world)
        .map_err(|e| e.to_string())?;
    checked::<f32>(ctx, &mut arx, 1, 512, false)?;
    let late = ctx.n - 1;
    let told = |e: &Error| {
        matches!(e, Error::CallMismatch { theirs, peer, .. }
            if theirs.kind == CallKind::Failed && *peer != late)
    };
    let input = verify::input::<f32>(SEED, 2, ctx.rank, 512);
    let mut out = vec![0f32; 512];
    verify::poison(&mut out);
    let result = if ctx.rank == late {
        std::thread::sleep(timeout + Duration::from_millis(1000));
        match arx.allreduce_host(&input, &mut out) {
            Ok(()) => {
                let want = verify::expected::<f32>(SEED, 2, ctx.n, 512);
                match verify::count_wrong(&out, &want) {
                    0 => Ok(()),
                    n => Err(format!("the late call returned Ok with {n} wrong")),
                }
            }
            Err(e) if told(&e) => Ok(()),
            Err(e) => Err(format!("the late call: unexpected error: {e}")),
        }
        .and_then(|()| {
            let input = verify::input::<f32>(SEED, 3, ctx.rank, 512);
            let t = Instant::now();
            let r = arx.allreduce_host(&input, &mut out);
            let took = t.elapsed();
            expect_err("the call after the late one", r, told)?;
            if took > timeout / 2 {
                return Err(format!(
                    "the call after the late one failed after {took:?}, not at once (timeout {timeout:?})"
                ));
            }
            Ok(())
        })
    } else {
        // Timed out, or told by another rank that timed out first.
        expect_err(
            "a call the last rank is late for",
            arx.allreduce_host(&input, &mut out),
            |e| matches!(e, Error::Timeout { .. }) || told(e),
        )
    };
    ctx.world.barrier();
    result
}

/// The start-up timeout bounds start-up: the last rank arrives after every
/// other rank's (short) start-up timeout ran out; every rank, the late one
/// included, returns a timeout within its bound. The call timeout stays
/// long, to show that it is not the bound here.
pub(super) fn bootstrap_timeout(ctx: &Ctx) -> Result<(), String> {
    let init = Duration::from_millis(1500);
    let late = ctx.rank == ctx.n - 1;
    if late {
        // Arrive after everyone else gave up. The late rank's start-up still
        // matches the others' posted requests on arx's channel, so MPI's
        // collectives (there, and on the world communicator) stay in step.
        std::thread::sleep(init + Duration::from_millis(1500));
    }
    let t = Instant::now();
    let r = builder()
        .timeout(Duration::from_secs(60))
        .init_timeout(init)
        .build(ctx.world)
        .map(|_| ());
    let waited = t.elapsed();
    expect_err(
        "bootstrap with a missing rank",
        r,
        |e| matches!(e, Error::Timeout { during, .. } if during.starts_with("start-up")),
    )?;
    if waited > init + Duration::from_secs(5) {
        return Err(format!(
            "start-up gave up after {waited:?}, configured {init:?}"
        ));
    }
    Ok(())
}

/// Expects every rank to fail at once with a mismatch naming `what` and the
/// last rank.
pub(super) fn mismatch_named(
    ctx: &Ctx,
    label: &str,
    r: arx::Result<()>,
    waited: Duration,
    what: &str,
) -> Result<(), String> {
    let odd = ctx.n - 1;
    expect_err(
        label,
        r,
        |e| matches!(e, Error::Mismatch { what: w, rank, .. } if *w == what && *rank == odd),
    )?;
    // Detected from the exchanged settings, not by a timeout (the start-up
    // bound is 20 s here).
    if waited > Duration::from_secs(10) {
        return Err(format!("{label}: took {waited:?}"));
    }
    Ok(())
}

/// The last rank asks for another device side than the others: every rank
/// fails at once naming that rank and ARX_DEVICE (whether or not a GPU is
/// present: the settings are compared before any GPU is probed).
pub(super) fn device_mismatch(ctx: &Ctx) -> Result<(), String> {
    let odd = ctx.rank == ctx.n - 1;
    for (theirs, ours) in [
        (DeviceKind::Gpu, DeviceKind::Auto),
        (DeviceKind::Host, DeviceKind::Auto),
        (DeviceKind::Gpu, DeviceKind::Host),
    ] {
        let t = Instant::now();
        let r = builder()
            .device(if odd { theirs } else { ours })
            .build(ctx.world)
            .map(|_| ());
        let label = format!("device {theirs:?} on the last rank, {ours:?} elsewhere");
        mismatch_named(ctx, &label, r, t.elapsed(), "ARX_DEVICE")?;
    }
    // The ranks stay in step: an agreeing instance works afterwards.
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    checked::<f32>(ctx, &mut arx, 1, 777, false)
}

pub(super) fn staging_mismatch(ctx: &Ctx) -> Result<(), String> {
    let odd = ctx.rank == ctx.n - 1;
    let t = Instant::now();
    let r = builder()
        .staging(if odd {
            Staging::CopyEngine
        } else {
            Staging::Sm
        })
        .build(ctx.world)
        .map(|_| ());
    mismatch_named(ctx, "staging", r, t.elapsed(), "ARX_STAGING")
}

/// One rank's setting is rejected locally: that rank returns its own error,
/// every other rank fails at once naming it.
pub(super) fn one_rank_bad_setting(ctx: &Ctx) -> Result<(), String> {
    let odd = ctx.n - 1;
    let b = if ctx.rank == odd {
        builder().slot_bytes(0)
    } else {
        builder()
    };
    let t = Instant::now();
    let r = b.build(ctx.world).map(|_| ());
    expect_err("slot size 0 on the last rank", r, |e| match e {
        Error::Config { .. } => ctx.rank == odd,
        Error::PeerFailed { peer, .. } => ctx.rank != odd && *peer == odd,
        _ => false,
    })?;
    if t.elapsed() > Duration::from_secs(10) {
        return Err(format!("took {:?}", t.elapsed()));
    }
    Ok(())
}

/// Duration::MAX and ZERO are refused on every rank with an error naming
/// the option; nothing panics (Duration::MAX used to overflow an Instant in
/// the proxy's stop).
pub(super) fn timeouts_out_of_range(ctx: &Ctx) -> Result<(), String> {
    for t in [
        Duration::MAX,
        Duration::ZERO,
        Duration::from_secs(25 * 3600),
    ] {
        let r = builder().timeout(t).build(ctx.world).map(|_| ());
        expect_err(
            &format!("timeout {t:?}"),
            r,
            |e| matches!(e, Error::Config { name, .. } if *name == "Builder::timeout"),
        )?;
        let r = builder().init_timeout(t).build(ctx.world).map(|_| ());
        expect_err(
            &format!("init_timeout {t:?}"),
            r,
            |e| matches!(e, Error::Config { name, .. } if *name == "Builder::init_timeout"),
        )?;
        let r = builder().stall_warn(t).build(ctx.world).map(|_| ());
        expect_err(
            &format!("stall_warn {t:?}"),
            r,
            |e| matches!(e, Error::Config { name, .. } if *name == "Builder::stall_warn"),
        )?;
    }
    // The bounds themselves are accepted.
    let mut arx = builder()
        .timeout(arx::MAX_TIMEOUT)
        .init_timeout(arx::MAX_TIMEOUT)
        .build(ctx.world)
        .map_err(|e| format!("timeout of 24 h: {e}"))?;
    checked::<f32>(ctx, &mut arx, 1, 100, false)
}

/// Set-up may take longer than the call timeout: the last rank arrives
/// 2.5 s late with a 1 s call timeout, and start-up still succeeds (it is
/// bounded by the start-up timeout instead).
pub(super) fn slow_start_up(ctx: &Ctx) -> Result<(), String> {
    let timeout = Duration::from_millis(1000);
    if ctx.rank == ctx.n - 1 {
        std::thread::sleep(timeout + Duration::from_millis(1500));
    }
    let mut arx = builder()
        .timeout(timeout)
        .build(ctx.world)
        .map_err(|e| e.to_string())?;
    checked::<bf16>(ctx, &mut arx, 1, 1000, false)
}

/// Start-up bounded by `init`, the calls by the usual timeout.
pub(super) fn short_start_up(init: Duration) -> arx::Builder {
    builder().init_timeout(init)
}

/// The last rank arrives late; every rank retries at once on a timeout, as
/// a program would, doubling its start-up bound each time (so that a slow
/// machine's set-up, bounded by the same timeout, does not decide the
/// outcome). Every rank must end with a working instance.
pub(super) fn retry_immediately(ctx: &Ctx) -> Result<(), String> {
    if ctx.rank == ctx.n - 1 {
        std::thread::sleep(Duration::from_secs(4));
    }
    let t = Instant::now();
    let mut init = Duration::from_millis(1500);
    let mut attempts = 0;
    let mut arx = loop {
        attempts += 1;
        match short_start_up(init).build(ctx.world) {
            Ok(a) => break a,
            Err(Error::Timeout { .. }) if attempts < 7 => init *= 2,
            Err(e) => return Err(format!("attempt {attempts} after {:?}: {e}", t.elapsed())),
        }
    };
    checked::<f32>(ctx, &mut arx, 1, 1000, false)
}

/// The last rank arrives after every other rank's start-up timed out; the
/// late rank's own start-up times out too. Then every rank retries, and the
/// retry works.
pub(super) fn retry_after(ctx: &Ctx, comm: &SimpleCommunicator) -> Result<(), String> {
    let init = Duration::from_millis(1500);
    if ctx.rank == ctx.n - 1 {
        std::thread::sleep(init + Duration::from_millis(1500));
    }
    let r = short_start_up(init).build(comm).map(|_| ());
    expect_err("start-up with a late rank", r, |e| {
        matches!(e, Error::Timeout { .. })
    })?;
    // The program agrees that start-up failed, on its own communicator.
    ctx.world.barrier();
    let mut arx = builder().build(comm).map_err(|e| format!("retry: {e}"))?;
    checked::<f32>(ctx, &mut arx, 1, 1000, false)?;
    checked::<bf16>(ctx, &mut arx, 2, 4097, true)
}

pub(super) fn retry_after_timeout(ctx: &Ctx) -> Result<(), String> {
    retry_after(ctx, ctx.world)
}

pub(super) fn retry_on_fresh_comm(ctx: &Ctx) -> Result<(), String> {
    let comm = ctx.world.duplicate();
    retry_after(ctx, &comm)
}

/// Rank 0 forks after making its instance; the child's call fails at once
/// with an error that says so (before, it published into the parent's
/// region, and the peers' next call returned Ok with the child's data),
/// and the child's drop of its copy frees nothing of the parent's. Then
/// every rank's call is exact, rank 0's from the parent.
pub(super) fn forked_child(ctx: &Ctx) -> Result<(), String> {
    let n = 1000;
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    // A traced call first, so that the parent has a trace to show.
    arx.trace_stages(true);
    checked::<f32>(ctx, &mut arx, 76, n, false)?;
    arx.trace_stages(false);
    if ctx.rank == 0 {
        if arx.last_stages().seq == 0 {
            return Err("the traced call left no trace".into());
        }
        // SAFETY: the child runs calls that arx refuses and a drop of its
        // copy of the instance (none touches MPI or the parent's threads),
        // then leaves with _exit.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err("fork failed".into());
        }
        if pid == 0 {
            let fork =
                |r: arx::Result<()>| matches!(&r, Err(Error::Proxy(m)) if m.contains("fork"));
            let input = verify::input::<f32>(SEED, 77, 0, n);
            let mut out = vec![0f32; n];
            // Each refused as a fork (bit k of the exit status if not):
            // a call, the barrier (MPI), check and async_error, the
            // trace (a lock the parent's proxy may have held).
            let mut bad = 0;
            bad |= i32::from(!fork(arx.allreduce_host(&input, &mut out)));
            bad |= i32::from(!fork(arx.barrier())) << 1;
            bad |= i32::from(!fork(arx.check())) << 2;
            bad |= i32::from(!fork(arx.async_error())) << 3;
            bad |= i32::from(arx.last_stages().seq != 0) << 4;
            drop(arx);
            // SAFETY: leaves the child at once (no destructors, no MPI).
            unsafe { libc::_exit(bad) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        if unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
            return Err("waitpid failed".into());
        }
        if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
            return Err(format!(
                "the forked child's calls were not all refused naming the fork (status \
                 {status}; exit bits: 1 call, 2 barrier, 4 check, 8 async_error, 16 trace)"
            ));
        }
    }
    for call in [78u64, 79] {
        let input = verify::input::<f32>(SEED, call, ctx.rank, n);
        let mut out = vec![f32::NAN; n];
        arx.allreduce_host(&input, &mut out)
            .map_err(|e| format!("call {call} after the fork: {e}"))?;
        let want = verify::expected::<f32>(SEED, call, ctx.n, n);
        if bytemuck::cast_slice::<f32, u8>(&out) != bytemuck::cast_slice::<f32, u8>(&want) {
            return Err(format!("call {call} after the fork: wrong sum"));
        }
    }
    Ok(())
}
