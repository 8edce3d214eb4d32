//! GPU tests of arx (a `harness = false` test).
//!
//! Run by `cargo test`, this program checks for a usable GPU first: without
//! one it prints `SKIPPED (not passed)` (`scripts/test` says so) and exits 0.
//! With one, it re-launches itself under `mpirun` for every rank count in
//! `ARX_GPU_TEST_RANKS` (default `2,3`; several ranks on one GPU need MPS,
//! which `scripts/gpu-check` starts and where it runs 2, 3, 4 and 8 ranks),
//! bounds each run's time (`ARX_TEST_RUN_SECS`, default 240) and fails if any
//! run fails. The ranks run under `mpirun --bind-to none`, or the binding
//! `ARX_GPU_TEST_BIND` names (`core`: Open MPI's default at 2 ranks, where
//! the Shm proxy must leave the caller's CPU). Every rank checks every result against the independent
//! reference of `arx::verify`, outputs are poisoned before each call, and
//! each case runs with both stagings (SM stores and copy engine). After each
//! case the harness compares the digest of every result the case folded in
//! across ranks (every rank must hold the same bits); cases make no MPI
//! collective of their own besides instances' start-ups.
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
//! GPU runs 20 correct calls; a rank that arrives after the others timed
//! out (its next call fails at once: they told it).
//!
//! The GPU-side ways to get a silent wrong sum that were found by review:
//! calls on two streams with no dependency, a graph replay next to an eager
//! call, two calls on parallel branches of one graph, copy-engine staging
//! right after a host call or right after a failed call while this rank's
//! sends are still in flight (the test-only `ARX_TEST_POST_DELAY_US` makes
//! every post late), −0.0 and the other edge values, and a graph replayed
//! after its instance was dropped.
//!
//! Calls longer than one slot (`chunked.rs`; one launch per chunk): every
//! dtype at 1, m−1, m, m+1, 2m+3 and ~3.5m elements for a chunk of m (a
//! 16 KiB slot), out of place, in place and unaligned, and one 16 MiB call
//! at the default slot; chunked calls captured into graphs (alone and next
//! to an ordinary call) and replayed with new input; chunked calls on a
//! second stream interleaved with ordinary calls on the first; a rank with
//! one chunk more than the others (every rank fails with `CallMismatch` at
//! once); pipelined chunked calls (one-shot and two-shot) back to back with
//! the last rank slowed (`Builder::test_sum_delay`), and captured into
//! graphs replayed on a second stream between eager calls on the first,
//! the last rank slowed; pipelined chunked calls made on the GPU by some
//! ranks and on the host by the others (a GPU rank and a host rank in one
//! call, chunk by chunk), the last rank slowed.
//!
//! Reductions other than sum (`ops.rs`): sum, max, min and avg on every
//! dtype at 1, 77, 1001 and 2m+3 elements, out of place, in place and
//! unaligned, on edge values, bit for bit against `verify::reference_op`;
//! max, min and avg captured into graphs (a chunked call and an in-place
//! call) and replayed with new input; ranks passing different ops (every
//! rank fails with `CallMismatch` naming both ops at once).
//!
//! Two-shot, reduce_scatter and all_gather (`collectives.rs`): the one-shot
//! cases above (lengths, graphs, edges, two streams, chunked, ops) rerun
//! with every instance forced to two-shot; two-shot against one-shot and
//! the reference bit for bit (every op and dtype at 1, 77, 24·N and a
//! chunked length); reduce_scatter (every op) and all_gather on every
//! dtype at 1 to 2c+3 elements per rank, out of place and in place, eager
//! and captured into a graph; GPU and host calls of reduce_scatter,
//! all_gather and all-reduces (one-shot and two-shot under `auto`)
//! alternating across ranks; ranks on different algorithms failing with
//! `CallMismatch` at once. broadcast (`collectives.rs`, `kernels/bcast.cuh`)
//! from every root on every dtype at 0 to 2m+3 elements, out of place, in
//! place and unaligned, bit for bit (NaN payloads too); captured into a
//! graph (chunked, in place, beside an all-reduce) and replayed; GPU and
//! host calls alternating across ranks; ranks disagreeing on the root or
//! the count, or a root that is no rank, failing at once.
//!
//! After each case every rank enters one verdict all-reduce, failing ranks
//! included (`tests/common/verdict.rs`): a rank whose case fails while the
//! others wait in a collective it left aborts the run after a grace period
//! (`ARX_TEST_FAIL_GRACE_SECS`, default 10 s) instead of letting it hang to
//! its bound; `ARX_TEST_HARNESS_SELFTEST=1` adds a case that fails that way
//! on purpose, to see it.
//!
//! Issue 10's one answer at 64 MiB (`collectives.rs`, `large_one_answer`):
//! bf16, f16 and f32 at 64 MiB and one element past one and three slots,
//! sum and max, one-shot, two-shot (also in place) and auto, eager and
//! graph, against the reference of `tests/common/large.rs`; a case named
//! `large: ...`, run only when a word of `ARX_GPU_TEST_CASES` containing
//! `large` selects it (`scripts/gpu-check` with `ARX_GPU_LARGE=1`).
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
    CudaGraph, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use arx::{verify, Arx, DeviceKind, Dtype, Element, Error, Staging};
use half::{bf16, f16};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod checks;
mod chunked;
mod collectives;
#[path = "../common/large.rs"]
mod large;
mod ops;
#[path = "../common/verdict.rs"]
mod verdict;
mod wrong_sum;

use checks::*;
use chunked::*;
use collectives::*;
use ops::*;
use wrong_sum::*;

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
        let bind = std::env::var("ARX_GPU_TEST_BIND").unwrap_or_else(|_| "none".into());
        cmd.args(["-n", &n.to_string(), "--oversubscribe", "--bind-to", &bind]);
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

/// Only with `ARX_TEST_HARNESS_SELFTEST` set (never in scripts/gpu-check's
/// runs): the last rank fails while the others wait in an MPI barrier (as
/// in an instance's start-up) that it never enters. The run must fail
/// within the grace period of `verdict.rs` on every rank (before it, it
/// hung until `ARX_TEST_RUN_SECS`).
fn harness_self_test(ctx: &Ctx, _: Staging) -> R {
    if ctx.rank == ctx.n - 1 {
        return Err("a deliberate failure on the last rank (ARX_TEST_HARNESS_SELFTEST)".into());
    }
    ctx.world.barrier();
    Ok(())
}

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
    let verdict = verdict::Verdict::new(&world);
    let mut cases: Vec<(&str, Case)> = vec![
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
        ("a late rank's next call fails at once", late_rank),
        (
            "a rank that drops its instance early: the others fail at once",
            rank_drops_early,
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
            "captured calls: event records off the kernels' path, one chain",
            records_off_the_path,
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
        (
            "calls longer than one slot: every dtype and length, eager",
            chunked_eager,
        ),
        (
            "calls longer than one slot captured into graphs and replayed",
            chunked_graph,
        ),
        (
            "chunked calls on a second stream between calls on the first",
            chunked_two_streams,
        ),
        (
            "a chunked call with another total length fails every rank at once",
            chunked_mismatch,
        ),
        (
            "pipelined chunked calls back to back, one rank slow",
            chunked_back_to_back,
        ),
        (
            "two-shot: pipelined chunked calls back to back, one rank slow",
            twoshot_back_to_back,
        ),
        (
            "chunked calls in graphs on a second stream between eager calls on the first, one rank slow: one-shot and two-shot",
            chunked_graphs_two_streams,
        ),
        (
            "pipelined chunked calls, GPU on some ranks and host on others, one rank slow: one-shot and two-shot",
            chunked_gpu_and_host,
        ),
        (
            "max, min, avg: every dtype, length and placement, eager",
            ops_eager,
        ),
        ("max, min, avg captured into graphs and replayed", ops_graph),
        ("ranks that pass different ops fail at once", ops_mismatch),
        (
            "two-shot: the one-shot cases rerun with ARX_ALGO=twoshot",
            twoshot_reruns,
        ),
        (
            "two-shot, one-shot and the reference agree bit for bit",
            twoshot_vs_oneshot,
        ),
        (
            "two-shot: graphs of 10 calls at 256 and 128 KB replayed back to back",
            twoshot_sustained,
        ),
        (
            "two-shot: graphs of 10 in-place calls at 128 KB replayed back to back",
            twoshot_sustained_in_place,
        ),
        (
            "reduce_scatter and all_gather: every dtype, length, placement",
            collectives_eager,
        ),
        (
            "reduce_scatter and all_gather captured into a graph",
            collectives_graph,
        ),
        (
            "GPU and host calls of one collective interleaved across ranks",
            gpu_and_host_mixed,
        ),
        (
            "ranks on different all-reduce algorithms fail at start-up",
            algo_mismatch,
        ),
        (
            "a reduce_scatter against a two-shot all-reduce fails at once",
            twoshot_vs_reduce_scatter,
        ),
        (
            "large: one answer at 64 MiB and odd lengths past slots, every algorithm, eager and graph",
            large_one_answer,
        ),
        (
            "broadcast: every dtype, length, root, placement, bit for bit",
            broadcast_eager,
        ),
        (
            "broadcast captured into a graph with an all-reduce",
            broadcast_graph,
        ),
        (
            "broadcast: GPU and host calls interleaved across ranks",
            broadcast_mixed,
        ),
        (
            "broadcast: ranks that disagree on the root or count fail at once",
            broadcast_mismatch,
        ),
    ];
    if std::env::var_os("ARX_TEST_HARNESS_SELFTEST").is_some() {
        // Fails on purpose: see `harness_self_test`.
        cases.push((
            "harness self-test: the last rank fails, the others wait in a collective",
            harness_self_test,
        ));
    }
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
    // Cases named "large: ..." run only when a word of ARX_GPU_TEST_CASES
    // containing "large" selects them (never in scripts/gpu-check's runs).
    let asked_large = only
        .as_ref()
        .is_some_and(|ws| ws.iter().any(|w| w.contains("large")));
    let mut all_ok = true;
    for staging in stagings {
        for &(name, case) in &cases {
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
            if name.starts_with("large:") && !asked_large {
                if ctx.rank == 0 {
                    println!(
                        "  [{} ranks, {staging:?}] {name}: NOT RUN (on request only: ARX_GPU_TEST_CASES=large)",
                        ctx.n
                    );
                }
                continue;
            }
            let t = Instant::now();
            ctx.digest.set(None);
            let local = case(&ctx, staging);
            if let Err(e) = &local {
                eprintln!("rank {}: case '{name}' ({staging:?}) FAILED: {e}", ctx.rank);
            }
            // Every rank enters it, failing ranks included (verdict.rs).
            let failures = verdict.agree(local.is_err(), name);
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

/// The slot of the chunked cases (16 KiB: 4096 f32 per chunk), so that a
/// few thousand elements make several chunks.
const SMALL_SLOT: usize = 16 << 10;

thread_local! {
    /// The all-reduce algorithm every instance the cases build runs
    /// (None: `ARX_ALGO` or its default); see [`with_algo`].
    static ALGO: Cell<Option<arx::Algo>> = const { Cell::new(None) };
    /// `Builder::test_sum_delay` of the instances built meanwhile; see
    /// [`with_sum_delay`].
    static SUM_DELAY: Cell<Option<Duration>> = const { Cell::new(None) };
}

/// Runs `f` with every instance it builds slowed by `d` before each sum
/// (`Builder::test_sum_delay`; None: not slowed).
fn with_sum_delay<T>(d: Option<Duration>, f: impl FnOnce() -> T) -> T {
    let before = SUM_DELAY.with(|a| a.replace(d));
    let r = f();
    SUM_DELAY.with(|a| a.set(before));
    r
}

/// Runs `f` with every instance it builds forced to `algo` (how the
/// two-shot cases rerun the one-shot cases).
fn with_algo<T>(algo: arx::Algo, f: impl FnOnce() -> T) -> T {
    let before = ALGO.with(|a| a.replace(Some(algo)));
    let r = f();
    ALGO.with(|a| a.set(before));
    r
}

fn build(ctx: &Ctx, staging: Staging, timeout: Duration) -> R<(Arx, Arc<CudaStream>)> {
    build_opts(ctx, staging, timeout, None, None)
}

/// [`build`] with the small slot of the chunked cases.
fn build_small(ctx: &Ctx, st: Staging, timeout: Duration) -> R<(Arx, Arc<CudaStream>)> {
    build_opts(ctx, st, timeout, Some(SMALL_SLOT), None)
}

/// [`build`] with a slot size and an algorithm (None: the defaults, or
/// the algorithm of [`with_algo`]).
fn build_opts(
    ctx: &Ctx,
    staging: Staging,
    timeout: Duration,
    slot: Option<usize>,
    algo: Option<arx::Algo>,
) -> R<(Arx, Arc<CudaStream>)> {
    let mut b = Arx::builder()
        .device(DeviceKind::Gpu)
        .staging(staging)
        .timeout(timeout);
    if let Some(s) = slot {
        b = b.slot_bytes(s);
    }
    if let Some(a) = algo.or_else(|| ALGO.with(Cell::get)) {
        b = b.algo(a);
    }
    if let Some(d) = SUM_DELAY.with(Cell::get) {
        b = b.test_sum_delay(d);
    }
    let arx = b.build(ctx.world).map_err(e("Arx::new"))?;
    let cuda = arx.cuda_context().ok_or("no CUDA context")?.clone();
    // Cudarc's own cross-stream tracking would add waits of its own: off,
    // so that only arx orders its calls here.
    // SAFETY: no cudarc slice is shared between streams without the test
    // synchronizing first.
    unsafe { cuda.disable_event_tracking() };
    let s = cuda.new_stream().map_err(e("new_stream"))?;
    Ok((arx, s))
}

/// [`build_opts`] with the small slot of the chunked cases, `algo`, a 30 s
/// timeout, and this rank slowed by `delay` before each sum if it is the
/// last rank (the pipelined-chunk cases' one slow rank).
fn build_last_slow(
    ctx: &Ctx,
    st: Staging,
    algo: arx::Algo,
    delay: Duration,
) -> R<(Arx, Arc<CudaStream>)> {
    let slow = ctx.rank == ctx.n - 1;
    with_sum_delay(slow.then_some(delay), || {
        build_opts(
            ctx,
            st,
            Duration::from_secs(30),
            Some(SMALL_SLOT),
            Some(algo),
        )
    })
}

/// One f32 all-reduce of `x` on the GPU side (`gpu`: device buffers on
/// `s`, the output poisoned) or the host side (a poisoned host output);
/// returns the output.
fn allreduce_either(arx: &mut Arx, s: &Arc<CudaStream>, gpu: bool, x: &[f32]) -> R<Vec<f32>> {
    if gpu {
        let din = up(s, x)?;
        let mut dout = poisoned::<f32>(s, x.len())?;
        arx.allreduce(&din, &mut dout, s).map_err(e("allreduce"))?;
        down(s, &dout)
    } else {
        let mut out = vec![0f32; x.len()];
        verify::poison(&mut out);
        arx.allreduce_host(x, &mut out)
            .map_err(e("allreduce_host"))?;
        Ok(out)
    }
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

/// Captures into a graph what `calls` enqueues on `s`, the stream
/// synchronized first (the set-up every graph case shares); `what` names
/// the calls in an error.
fn capture<E: std::fmt::Display>(
    s: &Arc<CudaStream>,
    what: &str,
    calls: impl FnOnce() -> Result<(), E>,
) -> R<CudaGraph> {
    s.synchronize().map_err(e("sync"))?;
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(e("begin_capture"))?;
    let r = calls();
    let g = s
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(e("end_capture"))?;
    r.map_err(|x| format!("{what}: {x}"))?;
    g.ok_or_else(|| "empty graph".into())
}

/// The set-up and verdict every mismatch case shares: this rank's input
/// of `n` elements for call `call` and a poisoned output are uploaded and
/// the stream synchronized; `f` enqueues the call on them and `check`
/// waits for it. Err unless it failed with `CallMismatch` within `bound`;
/// else rank 0 shows the error, and the error's text and the buffers are
/// returned (for more checks, and a later call that must fail at once).
#[allow(clippy::too_many_arguments)]
fn expect_mismatch<T: Element + DeviceRepr + ValidAsZeroBits>(
    ctx: &Ctx,
    arx: &mut Arx,
    s: &Arc<CudaStream>,
    what: &str,
    call: u64,
    n: usize,
    bound: Duration,
    f: impl FnOnce(&mut Arx, &CudaSlice<T>, &mut CudaSlice<T>) -> arx::Result<()>,
) -> R<(String, CudaSlice<T>, CudaSlice<T>)> {
    let din = up(s, &verify::input::<T>(SEED, call, ctx.rank, n))?;
    let mut dout = poisoned::<T>(s, n)?;
    s.synchronize().map_err(e("sync"))?;
    let t = Instant::now();
    let r = f(arx, &din, &mut dout).and_then(|()| arx.check());
    let took = t.elapsed();
    let msg = match &r {
        Ok(()) => "no error".to_string(),
        Err(x) => x.to_string(),
    };
    if !matches!(&r, Err(Error::CallMismatch { .. })) || took >= bound {
        return Err(format!(
            "{what} not reported as CallMismatch within {bound:?} (after {took:.2?}): {msg}"
        ));
    }
    ctx.say(format!(
        "rank 0 failed in {:.1} ms and says: {msg}",
        took.as_secs_f64() * 1e3
    ));
    Ok((msg, din, dout))
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
