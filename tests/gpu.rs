//! GPU tests of arx (a `harness = false` test).
//!
//! Run by `cargo test`, this program checks for a usable GPU first: without
//! one it prints `SKIPPED (not passed)` (`scripts/test` says so) and exits 0.
//! With one, it re-launches itself under `mpirun` for every rank count in
//! `ARX_GPU_TEST_RANKS` (default `2,3`; several ranks on one GPU need MPS,
//! which `scripts/gpu-check` starts and where it runs 2, 3, 4 and 8 ranks),
//! bounds each run's time (`ARX_TEST_RUN_SECS`, default 240) and fails if any
//! run fails. Every rank checks every result against the independent
//! reference of `arx::verify`, outputs are poisoned before each call, and
//! each case runs with both stagings (SM stores and copy engine). After each
//! case the harness compares the digest of every result the case folded in
//! across ranks (every rank must hold the same bits); cases make no MPI
//! collective of their own, so a rank that leaves a case early cannot hang
//! the others.
//!
//! What the former `examples/gpu_check` checked (`check` and `fail`):
//! the kernels' f32 ↔ bf16/f16 conversions against the `half` crate on
//! 1 098 240 bit patterns; bf16, f16 and f32 at 31 lengths from 1 element to
//! the slot size, each out of place, in place and unaligned (one element off
//! a 16-byte boundary: the kernel's scalar path), on inputs of widely varied
//! magnitude (rounding, ties, subnormals, f16 overflow); bursts of
//! back-to-back calls with one synchronization; one call captured into a CUDA
//! graph and replayed with a new input before every replay; a call mismatch
//! failing every rank with `CallMismatch` at once; a rank that stops calling
//! (every other rank's kernel ends with `Timeout` naming it within the
//! deadline, its output NaN-poisoned), after which a new instance on the same
//! GPU runs 20 correct calls.
//!
//! The GPU-side ways to get a silent wrong sum that were found by review:
//! calls on two streams with no dependency, a graph replay next to an eager
//! call, two calls on parallel branches of one graph, copy-engine staging
//! right after a host call or right after a failed call while this rank's
//! sends are still in flight (the test-only `ARX_TEST_POST_DELAY_US` makes
//! every post late), −0.0 and the other edge values, and a graph replayed
//! after its instance was dropped.
//!
//! `ARX_GPU_TEST_CASES=word,word` runs only the cases whose names contain one
//! of the words, `ARX_GPU_TEST_STAGING=sm|copy` one staging (each case not
//! run is listed as NOT RUN), and `ARX_GPU_TEST_QUICK=1` fewer lengths,
//! burst calls and graph replays.

use std::cell::Cell;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arx::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use arx::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use arx::{verify, Arx, DeviceKind, Dtype, Element, Error, Staging};
use half::{bf16, f16};
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const SEED: u64 = 0x6e0_5eed;

fn main() -> ExitCode {
    if std::env::var_os("ARX_TEST_CHILD").is_some() {
        child()
    } else {
        parent()
    }
}

// ------------------------------------------------------------------ parent

fn parent() -> ExitCode {
    if let Err(e) = arx::gpu_available() {
        println!("gpu test: SKIPPED (not passed): {e}");
        return ExitCode::SUCCESS;
    }
    let ranks: Vec<usize> = std::env::var("ARX_GPU_TEST_RANKS")
        .unwrap_or_else(|_| "2,3".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let limit = Duration::from_secs(
        std::env::var("ARX_TEST_RUN_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(240),
    );
    let exe = std::env::current_exe().expect("the test binary knows its path");
    let mut failed = Vec::new();
    for &n in &ranks {
        let start = Instant::now();
        println!("gpu test: {n} ranks ...");
        let mut cmd = Command::new("mpirun");
        cmd.args(["-n", &n.to_string(), "--oversubscribe", "--bind-to", "none"]);
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            cmd.arg("--allow-run-as-root");
        }
        cmd.args(["--mca", "btl", "self,vader,tcp"]);
        for v in [
            "CUDA_MPS_PIPE_DIRECTORY",
            "CUDA_MPS_LOG_DIRECTORY",
            "LD_LIBRARY_PATH",
            "RUST_LOG",
        ] {
            if std::env::var_os(v).is_some() {
                cmd.args(["-x", v]);
            }
        }
        cmd.arg(&exe)
            .env("ARX_TEST_CHILD", "1")
            .stdin(Stdio::null());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("gpu test: cannot start mpirun ({e})");
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
                Err(_) => break None,
            }
        };
        match status {
            Some(s) if s.success() => {
                println!("gpu test: {n} ranks passed in {:.1?}", start.elapsed())
            }
            Some(s) => {
                println!("gpu test: {n} ranks FAILED ({s})");
                failed.push(n);
            }
            None => {
                println!("gpu test: {n} ranks FAILED (killed after {limit:?})");
                failed.push(n);
            }
        }
    }
    if failed.is_empty() {
        println!("gpu test: all rank counts passed: {ranks:?}");
        ExitCode::SUCCESS
    } else {
        println!("gpu test: failed for rank counts {failed:?}");
        ExitCode::FAILURE
    }
}

// ------------------------------------------------------------------ child

struct Ctx<'a> {
    world: &'a SimpleCommunicator,
    rank: usize,
    n: usize,
    /// `ARX_GPU_TEST_QUICK=1`: fewer lengths, burst calls and replays.
    quick: bool,
    /// Digest of the results the running case folded in ([`Ctx::fold`]);
    /// the harness compares it across ranks after the case.
    digest: Cell<Option<u64>>,
}

impl Ctx<'_> {
    /// Adds a result to the case's digest (compared across ranks after
    /// the case, outside it, so that no rank can wait for one that left).
    fn fold<T: Element>(&self, got: &[T]) {
        let d = verify::digest(got);
        let prev = self.digest.get().unwrap_or(0x9E37_79B9_7F4A_7C15);
        self.digest.set(Some(
            (prev.rotate_left(17) ^ d).wrapping_mul(0x0000_0100_0000_01b3),
        ));
    }
    /// Prints on rank 0 only (details under the case's verdict line).
    fn say(&self, s: impl AsRef<str>) {
        if self.rank == 0 {
            println!("      {}", s.as_ref());
        }
    }
}

type R<T = ()> = Result<T, String>;
type Case = fn(&Ctx, Staging) -> R;

fn e<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |x| format!("{what}: {x}")
}

fn child() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let ctx = Ctx {
        world: &world,
        rank: world.rank() as usize,
        n: world.size() as usize,
        quick: std::env::var("ARX_GPU_TEST_QUICK").is_ok_and(|v| v != "0" && !v.is_empty()),
        digest: Cell::new(None),
    };
    let cases: &[(&str, Case)] = &[
        (
            "the kernels' conversions against the half crate",
            conversions,
        ),
        (
            "every dtype at every length: out of place, in place, unaligned",
            lengths,
        ),
        ("bursts of back-to-back calls, one sync", bursts),
        (
            "one call captured into a graph, replayed with new input each time",
            graph_replays,
        ),
        ("a call mismatch fails every rank at once", mismatch),
        (
            "a stopped rank: Timeout within the deadline, then 20 correct calls",
            stopped_rank,
        ),
        (
            "edge values (-0.0, NaN, Inf, subnormals), aligned and not",
            edges,
        ),
        ("calls on two streams with no dependency", two_streams),
        (
            "graph replay on one stream, eager calls on another",
            graph_and_eager,
        ),
        (
            "two calls on parallel branches of one graph",
            parallel_branches,
        ),
        (
            "a GPU call right after a host call, posts late",
            after_host_call,
        ),
        (
            "calls queued behind a failed call, posts late",
            after_failed_call,
        ),
        (
            "a graph replayed after its instance was dropped",
            replay_after_drop,
        ),
    ];
    // ARX_GPU_TEST_CASES=word,word runs only the cases whose names contain
    // one of the words; ARX_GPU_TEST_STAGING=sm|copy only one staging.
    let only: Option<Vec<String>> = std::env::var("ARX_GPU_TEST_CASES")
        .ok()
        .map(|v| v.split(',').map(|w| w.trim().to_string()).collect());
    let stagings: Vec<Staging> = match std::env::var("ARX_GPU_TEST_STAGING").as_deref() {
        Ok("sm") => vec![Staging::Sm],
        Ok("copy") => vec![Staging::CopyEngine],
        _ => vec![Staging::Sm, Staging::CopyEngine],
    };
    if ctx.rank == 0 {
        println!(
            "gpu test: {} ranks, stagings {stagings:?}{}",
            ctx.n,
            if ctx.quick { ", quick" } else { "" }
        );
    }
    let mut all_ok = true;
    for staging in stagings {
        for (name, case) in cases {
            if let Some(words) = &only {
                if !words.iter().any(|w| name.contains(w.as_str())) {
                    if ctx.rank == 0 {
                        println!(
                            "  [{} ranks, {staging:?}] {name}: NOT RUN (filtered)",
                            ctx.n
                        );
                    }
                    continue;
                }
            }
            let t = Instant::now();
            ctx.digest.set(None);
            let local = case(&ctx, staging);
            if let Err(e) = &local {
                eprintln!("rank {}: case '{name}' ({staging:?}) FAILED: {e}", ctx.rank);
            }
            let mut failures = 0u32;
            world.all_reduce_into(
                &u32::from(local.is_err()),
                &mut failures,
                SystemOperation::sum(),
            );
            // Every rank gathers every rank's digest (present, value) and
            // decides alike: a case that folded results must have the same
            // digest on every rank.
            let d = ctx.digest.take();
            let mine = [u64::from(d.is_some()), d.unwrap_or(0)];
            let mut all = vec![0u64; 2 * ctx.n];
            world.all_gather_into(&mine[..], &mut all[..]);
            let digests_differ = all.chunks(2).any(|c| c != &all[..2]);
            if ctx.rank == 0 {
                let verdict = if failures != 0 {
                    format!("FAILED on {failures} rank(s)")
                } else if digests_differ {
                    let ds: Vec<String> = all
                        .chunks(2)
                        .map(|c| match c[0] {
                            0 => "none".to_string(),
                            _ => format!("{:016x}", c[1]),
                        })
                        .collect();
                    format!("FAILED: the ranks' result digests differ: {ds:?}")
                } else if mine[0] == 1 {
                    format!("ok, every rank's results hash to {:016x}", mine[1])
                } else {
                    "ok".to_string()
                };
                println!(
                    "  [{} ranks, {staging:?}] {name}: {verdict} ({:.2?})",
                    ctx.n,
                    t.elapsed()
                );
            }
            all_ok &= failures == 0 && !digests_differ;
            world.barrier();
        }
    }
    if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn build(ctx: &Ctx, staging: Staging, timeout: Duration) -> R<(Arx, Arc<CudaStream>)> {
    let arx = Arx::builder()
        .device(DeviceKind::Gpu)
        .staging(staging)
        .timeout(timeout)
        .build(ctx.world)
        .map_err(e("Arx::new"))?;
    let cuda = arx.cuda_context().ok_or("no CUDA context")?.clone();
    // Cudarc's own cross-stream tracking would add waits of its own: off,
    // so that only arx orders its calls here.
    // SAFETY: no cudarc slice is shared between streams without the test
    // synchronizing first.
    unsafe { cuda.disable_event_tracking() };
    let s = cuda.new_stream().map_err(e("new_stream"))?;
    Ok((arx, s))
}

fn up<T: DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> R<CudaSlice<T>> {
    s.clone_htod(v).map_err(e("clone_htod"))
}

fn poisoned<T: Element + DeviceRepr + ValidAsZeroBits>(
    s: &Arc<CudaStream>,
    n: usize,
) -> R<CudaSlice<T>> {
    let mut h = vec![T::zeroed(); n];
    verify::poison(&mut h);
    up(s, &h)
}

/// Overwrites `d` with the poison of `verify::poison`.
fn poison_dev<T: Element + DeviceRepr>(s: &Arc<CudaStream>, d: &mut CudaSlice<T>) -> R {
    let mut h = vec![T::zeroed(); d.len()];
    verify::poison(&mut h);
    s.memcpy_htod(&h, d).map_err(e("poison"))
}

fn down<T: DeviceRepr + Default + Clone>(s: &Arc<CudaStream>, d: &CudaSlice<T>) -> R<Vec<T>> {
    let v = s.clone_dtoh(d).map_err(e("dtoh"))?;
    s.synchronize().map_err(e("synchronize"))?;
    Ok(v)
}

fn compare<T: Element>(what: &str, got: &[T], want: &[T]) -> R {
    let wrong = verify::count_wrong(got, want);
    if wrong == 0 {
        return Ok(());
    }
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} elements, expected {}",
            got.len(),
            want.len()
        ));
    }
    let i = verify::first_wrong(got, want).unwrap_or(0);
    Err(format!(
        "{what}: {wrong} of {} wrong; first at {i}: got {} ({:02x?}) want {} ({:02x?})",
        got.len(),
        verify::value_of(&got[i]),
        bytemuck::bytes_of(&got[i]),
        verify::value_of(&want[i]),
        bytemuck::bytes_of(&want[i])
    ))
}

/// Rank `r`'s input for call `c` and every rank's expected sum.
fn call_data<T: Element>(ctx: &Ctx, c: u64, n: usize) -> (Vec<T>, Vec<T>) {
    (
        verify::input::<T>(SEED, c, ctx.rank, n),
        verify::expected::<T>(SEED, c, ctx.n, n),
    )
}

/// Rank `rank`'s input for call `call`, of widely varied magnitude (the
/// former gpu_check's inputs): finite values m·2^e with e over most of the
/// type's range, so that sums exercise rounding, ties, subnormals and (f16)
/// overflow to infinity, and a few small integers, so that cancellations
/// are likely. Rounded to `T` by the reference's own rounding.
fn wide<T: Element>(call: u64, rank: usize, count: usize) -> Vec<T> {
    let mut rng = StdRng::seed_from_u64(
        SEED ^ call.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (rank as u64 + 1).wrapping_mul(0xC2B2_AE3D_27D4_EB4F),
    );
    let (lo, hi) = match T::DTYPE {
        Dtype::F16 => (-20, 15),
        Dtype::Bf16 => (-40, 40),
        Dtype::F32 => (-60, 60),
    };
    (0..count)
        .map(|_| {
            let m: f32 = rng.gen_range(1.0..2.0);
            let s = if rng.gen_bool(0.5) { -1.0 } else { 1.0 };
            let x = s * m * 2f32.powi(rng.gen_range(lo..=hi));
            if rng.gen_ratio(1, 16) {
                verify::round_to(rng.gen_range(-4i32..=4) as f32)
            } else {
                verify::round_to(x)
            }
        })
        .collect()
}

/// This rank's [`wide`] input for call `call` and the reference sum of
/// every rank's.
fn wide_data<T: Element>(ctx: &Ctx, call: u64, count: usize) -> (Vec<T>, Vec<T>) {
    let parts: Vec<Vec<T>> = (0..ctx.n).map(|r| wide::<T>(call, r, count)).collect();
    let want = verify::reference(&parts);
    (parts[ctx.rank].clone(), want)
}

#[derive(Clone, Copy, Debug)]
enum Placement {
    OutOfPlace,
    InPlace,
    /// Input and output one element past a 16-byte boundary
    /// (`allreduce_raw`): the kernel's scalar path.
    Unaligned,
}

/// One checked call of `count` elements on [`wide`] input `call`, its
/// output poisoned first; the result is folded into the case's digest.
fn checked_call<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
    call: u64,
    count: usize,
    how: Placement,
) -> R {
    let (mine, want) = wide_data::<T>(ctx, call, count);
    let got: Vec<T> = match how {
        Placement::OutOfPlace => {
            let din = up(s, &mine)?;
            let mut dout = poisoned::<T>(s, count)?;
            arx.allreduce(&din, &mut dout, s).map_err(e("allreduce"))?;
            arx.check().map_err(e("check"))?;
            down(s, &dout)?
        }
        Placement::InPlace => {
            let mut buf = up(s, &mine)?;
            arx.allreduce_in_place(&mut buf, s)
                .map_err(e("allreduce_in_place"))?;
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
                unsafe { arx.allreduce_raw(pi + sz, po + sz, count, T::DTYPE, s.cu_stream()) }
                    .map_err(e("allreduce_raw"))?;
            }
            arx.check().map_err(e("check"))?;
            let v = down(s, &dout)?;
            if bytemuck::bytes_of(&v[0]).iter().any(|&b| b != 0xff) {
                return Err(format!(
                    "{count} x {} unaligned: the element before the output was written",
                    T::DTYPE.name()
                ));
            }
            v[1..].to_vec()
        }
    };
    ctx.fold(&got);
    compare(
        &format!("call {call}: {count} x {} ({how:?})", T::DTYPE.name()),
        &got,
        &want,
    )
}

// ------------------------------------------- cases of the former gpu_check

/// The kernels' own f32 → bf16/f16 conversions and back, against `half`:
/// every 16-bit pattern (widening), and for every sign and f32 exponent
/// the mantissas around the bf16 and f16 rounding points (ties, ties ± 1)
/// plus 2000 random ones. One rank checks (the GPU is the same for all).
fn conversions(ctx: &Ctx, st: Staging) -> R {
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
            for _ in 0..2000 {
                bits.push(sign | exp << 23 | rng.gen_range(0..0x80_0000u32));
            }
        }
    }
    let out = arx.gpu_convert_check(&bits).map_err(e("convert check"))?;
    let mut bad = Vec::new();
    let mut nbad = 0usize;
    for (i, &b) in bits.iter().enumerate() {
        let f = f32::from_bits(b);
        let h = b as u16;
        let checks = [
            (
                "f32->bf16",
                u32::from(out.bf16[i]),
                u32::from(bf16::from_f32(f).to_bits()),
            ),
            (
                "f32->f16",
                u32::from(out.f16[i]),
                u32::from(f16::from_f32(f).to_bits()),
            ),
            (
                "bf16->f32",
                out.bf16_back[i],
                bf16::from_bits(h).to_f32().to_bits(),
            ),
            (
                "f16->f32",
                out.f16_back[i],
                f16::from_bits(h).to_f32().to_bits(),
            ),
        ];
        for (what, got, want) in checks {
            if got != want {
                nbad += 1;
                if bad.len() < 8 {
                    bad.push(format!("{what}({b:#010x}): gpu {got:#x}, half {want:#x}"));
                }
            }
        }
    }
    if nbad > 0 {
        return Err(format!(
            "{nbad} conversions differ from `half`: {}",
            bad.join("; ")
        ));
    }
    ctx.say(format!(
        "{} patterns match `half` bit for bit (4 directions)",
        bits.len()
    ));
    Ok(())
}

/// The former gpu_check's lengths: odd ones, vector boundaries, the slot's
/// last two counts.
fn length_list(max: usize, quick: bool) -> Vec<usize> {
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

fn lengths_of<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
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
fn lengths(ctx: &Ctx, st: Staging) -> R {
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
fn burst_of<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
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
fn bursts(ctx: &Ctx, st: Staging) -> R {
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
fn graph_of<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
    replays: usize,
    count: usize,
    first_call: u64,
) -> R {
    let mut din = poisoned::<T>(s, count)?;
    let mut dout = poisoned::<T>(s, count)?;
    s.synchronize().map_err(e("sync"))?;
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(e("begin_capture"))?;
    let r = arx.allreduce(&din, &mut dout, s);
    let g = s
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(e("end_capture"))?;
    r.map_err(e("allreduce under capture"))?;
    let g = g.ok_or("empty graph")?;
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
fn graph_replays(ctx: &Ctx, st: Staging) -> R {
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
fn mismatch(ctx: &Ctx, st: Staging) -> R {
    let timeout = Duration::from_secs(2);
    let last = ctx.n - 1;
    let (mut arx, s) = build(ctx, st, timeout)?;
    checked_call::<bf16>(ctx, &mut arx, &s, 0x8000_0001, 1000, Placement::OutOfPlace)?;
    let n = if ctx.rank == last { 1001 } else { 1000 };
    let din = up(&s, &verify::input::<bf16>(SEED, 0x8000_0002, ctx.rank, n))?;
    let mut dout = poisoned::<bf16>(&s, n)?;
    s.synchronize().map_err(e("sync"))?;
    let t = Instant::now();
    let r = arx
        .allreduce(&din, &mut dout, &s)
        .and_then(|()| arx.check());
    let took = t.elapsed();
    let msg = match &r {
        Ok(()) => "no error".to_string(),
        Err(x) => x.to_string(),
    };
    if !matches!(&r, Err(Error::CallMismatch { .. })) || took >= timeout {
        return Err(format!(
            "mismatch not reported as CallMismatch within {timeout:?} (after {took:.2?}): {msg}"
        ));
    }
    ctx.say(format!(
        "rank 0 failed in {:.1} ms and says: {msg}",
        took.as_secs_f64() * 1e3
    ));
    // Later calls return the sticky error at once.
    if arx.allreduce(&din, &mut dout, &s).is_ok() {
        return Err("a failed instance accepted another call".into());
    }
    Ok(())
}

/// The last rank skips a call: every other rank's kernel exits with a
/// `Timeout` naming it within the 2 s deadline (+1 s), its output
/// NaN-poisoned. Then a new instance on the same GPU (and MPS) runs 20
/// bit-exact calls.
fn stopped_rank(ctx: &Ctx, st: Staging) -> R {
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
            let din = up(&s, &wide::<f32>(0x9000_0099, ctx.rank, 4096))?;
            let mut dout = poisoned::<f32>(&s, 4096)?;
            s.synchronize().map_err(e("sync"))?;
            let t = Instant::now();
            let r = arx
                .allreduce(&din, &mut dout, &s)
                .and_then(|()| arx.check());
            let waited = t.elapsed();
            let out = down(&s, &dout)?;
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

// ------------------------------------------ cases of the review's findings

fn edges_of<T: Element + DeviceRepr + ValidAsZeroBits + Default>(
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
fn edges(ctx: &Ctx, st: Staging) -> R {
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
fn two_streams(ctx: &Ctx, st: Staging) -> R {
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
fn graph_and_eager(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, a) = build(ctx, st, Duration::from_secs(10))?;
    let b = arx
        .cuda_context()
        .ok_or("no context")?
        .new_stream()
        .map_err(e("new_stream"))?;
    let n = 1 << 17;
    let mut gin = poisoned::<f32>(&a, n)?;
    let mut gout = poisoned::<f32>(&a, n)?;
    a.synchronize().map_err(e("sync"))?;
    a.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(e("begin_capture"))?;
    let r = arx.allreduce(&gin, &mut gout, &a);
    let g = a
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(e("end_capture"))?;
    r.map_err(e("allreduce under capture"))?;
    let g = g.ok_or("empty graph")?;
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
fn parallel_branches(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, a) = build(ctx, st, Duration::from_secs(10))?;
    let n = 1 << 16;
    let mut in1 = poisoned::<f32>(&a, n)?;
    let mut in2 = poisoned::<f32>(&a, n)?;
    let mut out1 = poisoned::<f32>(&a, n)?;
    let mut out2 = poisoned::<f32>(&a, n)?;
    a.synchronize().map_err(e("sync"))?;
    a.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(e("begin_capture"))?;
    let captured = (|| {
        let b = a.fork().map_err(e("fork"))?;
        arx.allreduce(&in1, &mut out1, &a)
            .map_err(e("allreduce 1"))?;
        arx.allreduce(&in2, &mut out2, &b)
            .map_err(e("allreduce 2"))?;
        a.join(&b).map_err(e("join"))
    })();
    let g = a
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(e("end_capture"))?;
    captured?;
    let g = g.ok_or("empty graph")?;
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

/// Sets the test-only post delay for instances built inside `f`.
fn with_post_delay<T>(us: u64, f: impl FnOnce() -> T) -> T {
    std::env::set_var("ARX_TEST_POST_DELAY_US", us.to_string());
    let r = f();
    std::env::remove_var("ARX_TEST_POST_DELAY_US");
    r
}

/// Rank 0 arrives late at a host call, so it returns (it has every peer's
/// flag) before its own late post read its send slot; its next GPU call
/// must not overwrite that slot first.
fn after_host_call(ctx: &Ctx, st: Staging) -> R {
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
fn after_failed_call(ctx: &Ctx, st: Staging) -> R {
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
fn replay_after_drop(ctx: &Ctx, st: Staging) -> R {
    let (mut arx, s) = build(ctx, st, Duration::from_secs(10))?;
    let n = 2048;
    let (x, w) = call_data::<bf16>(ctx, 600, n);
    let din = up(&s, &x)?;
    let mut dout = poisoned::<bf16>(&s, n)?;
    s.synchronize().map_err(e("sync"))?;
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(e("begin_capture"))?;
    let r = arx.allreduce(&din, &mut dout, &s);
    let g = s
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(e("end_capture"))?;
    r.map_err(e("allreduce under capture"))?;
    let g = g.ok_or("empty graph")?;
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
