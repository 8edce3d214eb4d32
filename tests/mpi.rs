//! MPI tests of arx (a `harness = false` test).
//!
//! Run by `cargo test`, this program re-launches itself under `mpirun` for
//! every rank count in `ARX_TEST_RANKS` (default `2,3,4,8`, oversubscribed),
//! bounds each run's time, and fails if any run fails. Under mpirun (the
//! child, marked by `ARX_TEST_CHILD=1`) every rank runs the cases below; the
//! fabric and device side come from the environment (`ARX_FABRIC`, ...), so
//! the same cases run over Shm here and over Verbs in the soft-RoCE VM.
//!
//! Every check is made on every rank: inputs are seeded per rank, every rank
//! computes the expected sum independently, outputs are poisoned before each
//! call, and the ranks' digests of every result are compared.
//!
//! Set-up is never bounded by a short timeout unless the case is about
//! that bound: a case with a short call timeout starts with the default
//! start-up timeout, so that a slow machine (CI's VM) does not decide it.
//! `ARX_TEST_CASES=word,word` runs only the cases whose names contain one of
//! the words (each case not run is listed as NOT RUN).

use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use arx::{verify, Arx, CallKind, DeviceKind, Dtype, Element, Error, FabricKind, Staging};
use half::{bf16, f16};
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

const SEED: u64 = 0x5eed_a2c0;

fn main() -> ExitCode {
    if std::env::var_os("ARX_TEST_CHILD").is_some() {
        child()
    } else {
        parent()
    }
}

// ------------------------------------------------------------------ parent

fn parent() -> ExitCode {
    let ranks: Vec<usize> = std::env::var("ARX_TEST_RANKS")
        .unwrap_or_else(|_| "2,3,4,8".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let limit = Duration::from_secs(
        std::env::var("ARX_TEST_RUN_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(600),
    );
    let exe = std::env::current_exe().expect("the test binary knows its path");
    let mut failed = Vec::new();
    for &n in &ranks {
        let start = Instant::now();
        println!("mpi test: {n} ranks ...");
        let mut cmd = Command::new("mpirun");
        cmd.args(["-n", &n.to_string(), "--oversubscribe"]);
        // SAFETY-free check of root: mpirun refuses root without this flag.
        if unsafe_is_root() {
            cmd.arg("--allow-run-as-root");
        }
        // Open MPI: quiet about missing high-speed transports on CI machines.
        cmd.args(["--mca", "btl", "self,vader,tcp"]);
        cmd.arg(&exe)
            .env("ARX_TEST_CHILD", "1")
            .stdin(Stdio::null());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("mpi test: cannot start mpirun ({e}); install Open MPI (scripts/setup)");
                return ExitCode::FAILURE;
            }
        };
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) if start.elapsed() > limit => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => {
                    eprintln!("mpi test: waiting for mpirun: {e}");
                    break None;
                }
            }
        };
        match status {
            Some(s) if s.success() => {
                println!("mpi test: {n} ranks passed in {:.1?}", start.elapsed())
            }
            Some(s) => {
                println!("mpi test: {n} ranks FAILED ({s})");
                failed.push(n);
            }
            None => {
                println!("mpi test: {n} ranks FAILED (killed after {limit:?})");
                failed.push(n);
            }
        }
    }
    if failed.is_empty() {
        println!("mpi test: all rank counts passed: {ranks:?}");
        ExitCode::SUCCESS
    } else {
        println!("mpi test: failed for rank counts {failed:?}");
        ExitCode::FAILURE
    }
}

fn unsafe_is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

// ------------------------------------------------------------------ child

struct Ctx<'a> {
    world: &'a SimpleCommunicator,
    rank: usize,
    n: usize,
}

type Case = fn(&Ctx) -> Result<(), String>;

fn child() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let ctx = Ctx {
        world: &world,
        rank: world.rank() as usize,
        n: world.size() as usize,
    };
    let cases: &[(&str, Case)] = &[
        ("every dtype and length, bit for bit", correctness),
        ("in place", in_place),
        (
            "edge values: -0.0, NaN, Inf, subnormals, overflow",
            edge_values,
        ),
        ("burst of mixed sizes and dtypes", burst),
        ("two instances side by side", two_instances),
        ("one rank configured differently", config_mismatch),
        ("one rank calls with another length", length_mismatch),
        ("one rank calls with another dtype", dtype_mismatch),
        ("one rank's call is too long", too_long),
        (
            "a refusal is seen while another rank is silent (3+ ranks)",
            refusal_past_silence,
        ),
        ("one rank asks for another device side", device_mismatch),
        ("one rank asks for another GPU staging", staging_mismatch),
        ("one rank's setting is out of range", one_rank_bad_setting),
        ("timeouts out of range are refused", timeouts_out_of_range),
        ("start-up slower than the call timeout", slow_start_up),
        ("one rank stops calling", rank_stops),
        (
            "a late rank at start-up; the others retry at once",
            retry_immediately,
        ),
        (
            "every rank timed out at start-up, then all retry",
            retry_after_timeout,
        ),
        (
            "every rank timed out at the first start-up on a communicator, then all retry",
            retry_on_fresh_comm,
        ),
        ("one rank never arrives at start-up", bootstrap_timeout),
    ];
    // ARX_TEST_CASES=word,word runs only the cases whose names contain one
    // of the words (for working on one case; the full run sets nothing).
    let only: Option<Vec<String>> = std::env::var("ARX_TEST_CASES")
        .ok()
        .map(|s| s.split(',').map(|w| w.trim().to_string()).collect());
    let mut all_ok = true;
    for (name, case) in cases {
        if let Some(words) = &only {
            if !words.iter().any(|w| name.contains(w.as_str())) {
                if ctx.rank == 0 {
                    println!(
                        "  [{} ranks] {name}: NOT RUN (filtered by ARX_TEST_CASES)",
                        ctx.n
                    );
                }
                continue;
            }
        }
        let t = Instant::now();
        let local = case(&ctx);
        if let Err(e) = &local {
            eprintln!("rank {}: case '{name}' FAILED: {e}", ctx.rank);
        }
        let mut failures = 0u32;
        world.all_reduce_into(
            &u32::from(local.is_err()),
            &mut failures,
            SystemOperation::sum(),
        );
        if ctx.rank == 0 {
            let verdict = if failures == 0 {
                "ok".to_string()
            } else {
                format!("FAILED on {failures} rank(s)")
            };
            println!(
                "  [{} ranks] {name}: {verdict} ({:.2?})",
                ctx.n,
                t.elapsed()
            );
        }
        all_ok &= failures == 0;
        world.barrier();
    }
    if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn builder() -> arx::Builder {
    // A small slot keeps 8 oversubscribed ranks quick; the fabric comes from
    // the environment (ARX_FABRIC) so CI's VM runs these over Verbs.
    let timeout = std::env::var("ARX_TIMEOUT_MS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    Arx::builder()
        .slot_bytes(64 << 10)
        .timeout(Duration::from_millis(timeout))
}

/// Gathers a digest from every rank and checks they are all equal.
fn same_everywhere(ctx: &Ctx, d: u64) -> Result<(), String> {
    let mut all = vec![0u64; ctx.n];
    ctx.world.all_gather_into(&d, &mut all[..]);
    if all.iter().all(|&x| x == d) {
        Ok(())
    } else {
        Err(format!("result digests differ between ranks: {all:x?}"))
    }
}

/// One checked call: seeded input, poisoned output, reference, digest.
fn checked<T: Element>(
    ctx: &Ctx,
    arx: &mut Arx,
    call: u64,
    count: usize,
    in_place: bool,
) -> Result<(), String> {
    let input = verify::input::<T>(SEED, call, ctx.rank, count);
    let want = verify::expected::<T>(SEED, call, ctx.n, count);
    check_call(ctx, arx, call, input, want, in_place)
}

/// One call on given inputs, checked against `want` (from the independent
/// reference in `arx::verify`) and across ranks.
fn check_call<T: Element>(
    ctx: &Ctx,
    arx: &mut Arx,
    call: u64,
    input: Vec<T>,
    want: Vec<T>,
    in_place: bool,
) -> Result<(), String> {
    let count = input.len();
    let mut out = vec![T::from_f32(0.0); count];
    let r = if in_place {
        out.copy_from_slice(&input);
        arx.allreduce_host_in_place(&mut out)
    } else {
        verify::poison(&mut out);
        arx.allreduce_host(&input, &mut out)
    };
    r.map_err(|e| format!("call {call} ({count} x {:?}): {e}", T::DTYPE))?;
    let wrong = verify::count_wrong(&out, &want);
    if wrong != 0 {
        let i = verify::first_wrong(&out, &want).unwrap_or(0);
        return Err(format!(
            "call {call} ({count} x {:?}): {wrong} wrong; first at {i}: got {:?} ({:?}) want {:?} ({:?})",
            T::DTYPE,
            verify::value_of(&out[i]),
            bytemuck::bytes_of(&out[i]),
            verify::value_of(&want[i]),
            bytemuck::bytes_of(&want[i]),
        ));
    }
    same_everywhere(ctx, verify::digest(&out))
}

fn lengths(max: usize) -> Vec<usize> {
    let mut v = vec![
        1,
        2,
        3,
        7,
        8,
        9,
        15,
        16,
        17,
        31,
        33,
        63,
        100,
        255,
        257,
        1000,
        4095,
        4097,
        max - 1,
        max,
    ];
    v.retain(|&l| l >= 1 && l <= max);
    v
}

fn correctness(ctx: &Ctx) -> Result<(), String> {
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    let mut call = 0;
    for count in lengths(arx.max_count::<bf16>()) {
        call += 1;
        checked::<bf16>(ctx, &mut arx, call, count, false)?;
    }
    for count in lengths(arx.max_count::<f16>()) {
        call += 1;
        checked::<f16>(ctx, &mut arx, call, count, false)?;
    }
    for count in lengths(arx.max_count::<f32>()) {
        call += 1;
        checked::<f32>(ctx, &mut arx, call, count, false)?;
    }
    Ok(())
}

fn in_place(ctx: &Ctx) -> Result<(), String> {
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    for (i, count) in [1usize, 17, 1000, 4097].into_iter().enumerate() {
        let c = 100 + 3 * i as u64;
        checked::<bf16>(ctx, &mut arx, c, count, true)?;
        checked::<f16>(ctx, &mut arx, c + 1, count, true)?;
        checked::<f32>(ctx, &mut arx, c + 2, count, true)?;
    }
    Ok(())
}

/// −0.0 on every rank must stay −0.0 (the sum is `((p0 + p1) + …)`, not
/// `((0 + p0) + p1) …`), and NaN, ±Inf, subnormals and overflow follow
/// IEEE arithmetic in rank order.
fn edge_values(ctx: &Ctx) -> Result<(), String> {
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    for (i, count) in [1usize, 16, 1000, 4097].into_iter().enumerate() {
        let c = 500 + 3 * i as u64;
        let e = |c| verify::input_edges::<bf16>(SEED, c, ctx.rank, count);
        check_call(
            ctx,
            &mut arx,
            c,
            e(c),
            verify::expected_edges(SEED, c, ctx.n, count),
            false,
        )?;
        let e = verify::input_edges::<f16>(SEED, c + 1, ctx.rank, count);
        let w = verify::expected_edges(SEED, c + 1, ctx.n, count);
        check_call(ctx, &mut arx, c + 1, e, w, i % 2 == 1)?;
        let e = verify::input_edges::<f32>(SEED, c + 2, ctx.rank, count);
        let w = verify::expected_edges(SEED, c + 2, ctx.n, count);
        check_call(ctx, &mut arx, c + 2, e, w, false)?;
    }
    // Every rank passes −0.0 everywhere.
    let z = vec![bf16::from_bits(0x8000); 777];
    check_call(ctx, &mut arx, 600, z.clone(), z, false)?;
    let z = vec![-0.0f32; 333];
    check_call(ctx, &mut arx, 601, z.clone(), z, true)
}

fn burst(ctx: &Ctx) -> Result<(), String> {
    use rand::{Rng, SeedableRng};
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    // The same sequence of (dtype, length) on every rank.
    let mut rng = rand::rngs::StdRng::seed_from_u64(SEED);
    let calls = if ctx.n > 4 { 60 } else { 150 };
    for call in 0..calls {
        let in_place = rng.gen_bool(0.25);
        let (max16, max32) = (arx.max_count::<bf16>(), arx.max_count::<f32>());
        match rng.gen_range(0..3) {
            0 => checked::<bf16>(
                ctx,
                &mut arx,
                1000 + call,
                rng.gen_range(1..=max16),
                in_place,
            )?,
            1 => checked::<f16>(
                ctx,
                &mut arx,
                1000 + call,
                rng.gen_range(1..=2048),
                in_place,
            )?,
            _ => checked::<f32>(
                ctx,
                &mut arx,
                1000 + call,
                rng.gen_range(1..=max32),
                in_place,
            )?,
        }
    }
    Ok(())
}

fn two_instances(ctx: &Ctx) -> Result<(), String> {
    let mut a = builder().build(ctx.world).map_err(|e| e.to_string())?;
    let mut b = builder()
        .slot_bytes(8192)
        .build(ctx.world)
        .map_err(|e| e.to_string())?;
    for call in 0..10 {
        checked::<f32>(ctx, &mut a, 2000 + call, 3000, false)?;
        checked::<bf16>(ctx, &mut b, 3000 + call, 4096, call % 2 == 0)?;
    }
    Ok(())
}

/// Expects an error on this rank; `ok` says which errors are right.
fn expect_err(what: &str, r: arx::Result<()>, ok: impl Fn(&Error) -> bool) -> Result<(), String> {
    match r {
        Ok(()) => Err(format!("{what}: expected an error, got Ok")),
        Err(e) if ok(&e) => Ok(()),
        Err(e) => Err(format!("{what}: unexpected error: {e}")),
    }
}

fn config_mismatch(ctx: &Ctx) -> Result<(), String> {
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
    Ok(())
}

fn length_mismatch(ctx: &Ctx) -> Result<(), String> {
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

fn dtype_mismatch(ctx: &Ctx) -> Result<(), String> {
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

fn too_long(ctx: &Ctx) -> Result<(), String> {
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    let max = arx.max_count::<f32>();
    let count = if ctx.rank == 1 { max + 1 } else { max };
    let input = verify::input::<f32>(SEED, 1, ctx.rank, count);
    let mut out = vec![0f32; count];
    let t = Instant::now();
    let r = arx.allreduce_host(&input, &mut out);
    expect_err("too long on rank 1", r, |e| match e {
        Error::InvalidArgument(m) => ctx.rank == 1 && m.contains("exceed"),
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
/// order of peers.
fn refusal_past_silence(ctx: &Ctx) -> Result<(), String> {
    if ctx.n < 3 {
        return Ok(()); // needs a silent rank, a refusing rank and a witness
    }
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    checked::<f32>(ctx, &mut arx, 1, 100, false)?;
    if ctx.rank == 0 {
        return Ok(()); // silent
    }
    let max = arx.max_count::<f32>();
    let count = if ctx.rank == 1 { max + 1 } else { 100 };
    let input = verify::input::<f32>(SEED, 2, ctx.rank, count);
    let mut out = vec![0f32; count];
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

fn rank_stops(ctx: &Ctx) -> Result<(), String> {
    let timeout = Duration::from_millis(1500);
    let mut arx = builder()
        .timeout(timeout)
        .build(ctx.world)
        .map_err(|e| e.to_string())?;
    checked::<bf16>(ctx, &mut arx, 1, 512, false)?;
    if ctx.rank == ctx.n - 1 {
        return Ok(()); // this rank stops calling
    }
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

/// The start-up timeout bounds start-up: the last rank arrives after every
/// other rank's (short) start-up timeout ran out; every rank, the late one
/// included, returns a timeout within its bound. The call timeout stays
/// long, to show that it is not the bound here.
fn bootstrap_timeout(ctx: &Ctx) -> Result<(), String> {
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
fn mismatch_named(
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
fn device_mismatch(ctx: &Ctx) -> Result<(), String> {
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

fn staging_mismatch(ctx: &Ctx) -> Result<(), String> {
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
fn one_rank_bad_setting(ctx: &Ctx) -> Result<(), String> {
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
fn timeouts_out_of_range(ctx: &Ctx) -> Result<(), String> {
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
fn slow_start_up(ctx: &Ctx) -> Result<(), String> {
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
fn short_start_up(init: Duration) -> arx::Builder {
    builder().init_timeout(init)
}

/// The last rank arrives late; every rank retries at once on a timeout, as
/// a program would, doubling its start-up bound each time (so that a slow
/// machine's set-up, bounded by the same timeout, does not decide the
/// outcome). Every rank must end with a working instance.
fn retry_immediately(ctx: &Ctx) -> Result<(), String> {
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
fn retry_after(ctx: &Ctx, comm: &SimpleCommunicator) -> Result<(), String> {
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

fn retry_after_timeout(ctx: &Ctx) -> Result<(), String> {
    retry_after(ctx, ctx.world)
}

fn retry_on_fresh_comm(ctx: &Ctx) -> Result<(), String> {
    let comm = ctx.world.duplicate();
    retry_after(ctx, &comm)
}
