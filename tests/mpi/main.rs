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
//! the words, or start with it when the word starts with `^` (each case not
//! run is listed as NOT RUN; a word that names no case fails the run, so a
//! renamed case cannot silently drop out of a script's set).
//!
//! After each case every rank enters one verdict all-reduce, failing ranks
//! included (`tests/common/verdict.rs`): a rank whose case fails while the
//! others wait in a collective it left (a digest comparison, an instance's
//! start-up) aborts the run after a grace period (`ARX_TEST_FAIL_GRACE_SECS`,
//! default 10 s) instead of letting it hang to `ARX_TEST_RUN_SECS`;
//! `ARX_TEST_HARNESS_SELFTEST=1` adds a case that fails that way on
//! purpose, to see it (not in any set, so never in CI).
//!
//! Cases named `large: ...` (issue 10's one answer at 64 MiB, minutes at
//! 3 ranks on 2 cores) run only when a word of `ARX_TEST_CASES` containing
//! `large` selects them: never in the full run nor in a script's set.
//!
//! A rank count `N:SET` in `ARX_TEST_RANKS` runs N ranks with only the
//! cases of the named set (below, `SETS`; and of `ARX_TEST_CASES` if set
//! too). The default is `2,3,4,8,16:wide`: every case at 2, 3, 4 and 8
//! ranks, and at 16 ranks (oversubscribed) the set `wide`: every dtype bit
//! for bit at a few lengths, in place, and a call with another length on
//! one rank, so that the layout, the flags and the waits are checked at a
//! world of 16 without running every case there.

use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use arx::{verify, Arx, CallKind, DeviceKind, Dtype, Element, Error, FabricKind, Staging};
use half::{bf16, f16};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

mod chunked;
mod collectives;
mod failures;
#[path = "../common/large.rs"]
mod large;
mod ops;
mod stages;
#[path = "../common/verdict.rs"]
mod verdict;

use chunked::*;
use collectives::*;
use failures::*;
use ops::*;
use stages::*;

const SEED: u64 = 0x5eed_a2c0;

fn main() -> ExitCode {
    if std::env::var_os("ARX_TEST_CHILD").is_some() {
        child()
    } else {
        parent()
    }
}

// ------------------------------------------------------------------ parent

/// Named sets of cases for rank counts written `N:SET` in
/// `ARX_TEST_RANKS`, as `ARX_TEST_CASES` words.
///
/// `wide` at 16 ranks on CI's 2 cores took 14-17 s (debug build): the
/// reference sums of the longest calls (each rank adds 16 seeded inputs)
/// make ranks arrive seconds apart, so arx's watchdog warns ("has waited
/// 2 s") there; calls themselves take about 3 ms at 16 ranks on 2 cores
/// (release `allreduce_perf --median`), the yield-then-nap backoff of
/// `src/spin.rs` letting the rank that is late run.
const SETS: &[(&str, &str)] = &[("wide", "a few lengths,^in place,another length")];

/// `ARX_TEST_RANKS`: "2,3,16:wide" -> [(2, None), (3, None), (16, Some(words))].
fn rank_counts(spec: &str) -> Result<Vec<(usize, Option<&'static str>)>, String> {
    let mut out = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (n, set) = match item.split_once(':') {
            Some((n, set)) => (n, Some(set.trim())),
            None => (item, None),
        };
        let n: usize = n
            .trim()
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("ARX_TEST_RANKS: '{item}' is not a rank count"))?;
        let words = match set {
            None => None,
            Some(set) => Some(
                SETS.iter()
                    .find(|(name, _)| *name == set)
                    .map(|(_, words)| *words)
                    .ok_or_else(|| {
                        format!(
                            "ARX_TEST_RANKS: no set '{set}' (sets: {:?})",
                            SETS.iter().map(|s| s.0).collect::<Vec<_>>()
                        )
                    })?,
            ),
        };
        out.push((n, words));
    }
    Ok(out)
}

fn parent() -> ExitCode {
    let spec = std::env::var("ARX_TEST_RANKS").unwrap_or_else(|_| "2,3,4,8,16:wide".into());
    let ranks = match rank_counts(&spec) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("mpi test: {e}");
            return ExitCode::FAILURE;
        }
    };
    let limit = Duration::from_secs(
        std::env::var("ARX_TEST_RUN_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(600),
    );
    let exe = std::env::current_exe().expect("the test binary knows its path");
    let mut failed = Vec::new();
    for &(n, set) in &ranks {
        let start = Instant::now();
        match set {
            Some(words) => println!("mpi test: {n} ranks, cases: {words} ..."),
            None => println!("mpi test: {n} ranks ..."),
        }
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
        if let Some(words) = set {
            cmd.env("ARX_TEST_SET_CASES", words);
        }
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
        println!("mpi test: all rank counts passed: {spec}");
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
    let verdict = verdict::Verdict::new(&world);
    let mut cases: Vec<(&str, Case)> =
        vec![
        ("every dtype and length, bit for bit", correctness),
        ("every dtype at a few lengths, bit for bit", few_lengths),
        ("in place", in_place),
        (
            "edge values: -0.0, NaN, Inf, subnormals, overflow",
            edge_values,
        ),
        ("burst of mixed sizes and dtypes", burst),
        ("two instances side by side", two_instances),
        (
            "instances on split communicators (tp and dp groups), interleaved",
            split_instances,
        ),
        (
            "stage trace: every stage, adding up to the call",
            stage_trace,
        ),
        ("one rank configured differently", config_mismatch),
        ("one rank calls with another length", length_mismatch),
        ("one rank calls with another dtype", dtype_mismatch),
        ("one rank refuses its call", one_rank_refuses),
        (
            "max, min, avg: every dtype and length, bit for bit",
            ops_bit_for_bit,
        ),
        ("one rank calls with another op", op_mismatch),
        (
            "calls longer than one slot, every dtype, bit for bit",
            chunked_lengths,
        ),
        (
            "a chunked call gives the bits of one call",
            chunked_same_bits,
        ),
        (
            "one rank's chunked call has another total length",
            chunked_length_mismatch,
        ),
        (
            "pipelined chunks back to back, one-shot and two-shot",
            pipelined_back_to_back,
        ),
        (
            "one answer: one-shot, two-shot, auto, chunked, in place, bit for bit",
            one_answer,
        ),
        (
            "reduce_scatter and all_gather, every dtype and length, bit for bit",
            reduce_scatter_all_gather,
        ),
        ("ranks that choose other algorithms fail at start-up", algo_mismatch),
        (
            "a random sequence of every collective, op, dtype and length on three instances",
            random_sequence,
        ),
        ("one rank calls another collective", collective_mismatch),
        (
            "one rank reduce-scatters what the others all-reduce two-shot",
            twoshot_vs_reduce_scatter,
        ),
        (
            "broadcast: every dtype, length and root, bit for bit",
            broadcast_bit_for_bit,
        ),
        (
            "broadcast: ranks disagree on the root, count or collective",
            broadcast_mismatch,
        ),
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
            "a rank that drops its instance early: the others fail at once",
            rank_drops_early,
        ),
        (
            "instances dropped in other orders on other ranks, then a new one",
            drops_in_other_orders,
        ),
        (
            "a late rank's next call fails at once",
            late_rank_fails_next_call_at_once,
        ),
        ("a forked child's calls, barrier, check and trace are refused", forked_child),
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
        (
            "large: one answer at 64 MiB and odd lengths past slots, every algorithm, bit for bit",
            large_one_answer,
        ),
    ];
    if std::env::var_os("ARX_TEST_HARNESS_SELFTEST").is_some() {
        // Fails on purpose: see `harness_self_test`.
        cases.push((
            "harness self-test: the last rank fails, the others wait in a collective",
            harness_self_test,
        ));
    }
    // ARX_TEST_CASES=word,word runs only the cases whose names contain one
    // of the words (for working on one case, and the scripts' named sets;
    // the full run sets nothing); ARX_TEST_SET_CASES (from the parent, for
    // a rank count `N:SET`) narrows it further.
    let names: Vec<&str> = cases.iter().map(|c| c.0).collect();
    let mut filters = Vec::new();
    for var in ["ARX_TEST_CASES", "ARX_TEST_SET_CASES"] {
        // Empty: no filter (scripts pass their set's words, empty for all).
        if let Some(v) = std::env::var(var).ok().filter(|v| !v.trim().is_empty()) {
            match case_filter(&v, &names) {
                Ok(words) => filters.push((var, words)),
                Err(e) => {
                    if ctx.rank == 0 {
                        eprintln!("mpi test: {var}: {e}");
                    }
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    // Cases named "large: ..." take minutes: they run only when a word of
    // ARX_TEST_CASES containing "large" selects them (never in the full run
    // nor a script's set).
    let asked_large =
        std::env::var("ARX_TEST_CASES").is_ok_and(|v| v.split(',').any(|w| w.contains("large")));
    let mut all_ok = true;
    for &(name, case) in &cases {
        if let Some((var, _)) = filters.iter().find(|(_, w)| !selects(w, name)) {
            if ctx.rank == 0 {
                println!("  [{} ranks] {name}: NOT RUN (filtered by {var})", ctx.n);
            }
            continue;
        }
        if name.starts_with("large:") && !asked_large {
            if ctx.rank == 0 {
                println!(
                    "  [{} ranks] {name}: NOT RUN (on request only: ARX_TEST_CASES=large)",
                    ctx.n
                );
            }
            continue;
        }
        let t = Instant::now();
        let local = case(&ctx);
        if let Err(e) = &local {
            eprintln!("rank {}: case '{name}' FAILED: {e}", ctx.rank);
        }
        // Every rank enters it, failing ranks included (verdict.rs).
        let failures = verdict.agree(local.is_err(), name);
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

/// The words of a case filter; every word must select some case, so that a
/// renamed case fails a script's set instead of silently not running.
fn case_filter(spec: &str, names: &[&str]) -> Result<Vec<String>, String> {
    let words: Vec<String> = spec
        .split(',')
        .map(|w| w.trim().to_string())
        .filter(|w| !w.is_empty())
        .collect();
    if words.is_empty() {
        return Err(format!("'{spec}' names no case"));
    }
    for w in &words {
        if !names.iter().any(|n| selects(std::slice::from_ref(w), n)) {
            return Err(format!("'{w}' matches no case name"));
        }
    }
    Ok(words)
}

/// A word selects a case whose name contains it, or, written `^word`,
/// whose name starts with it.
fn selects(words: &[String], name: &str) -> bool {
    words.iter().any(|w| match w.strip_prefix('^') {
        Some(prefix) => name.starts_with(prefix),
        None => name.contains(w.as_str()),
    })
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

/// Only with `ARX_TEST_HARNESS_SELFTEST` set (never in CI's sets): the
/// last rank's check fails while the others go on into a digest comparison
/// (an MPI collective) that the failing rank never enters. The run must
/// fail within the grace period of `verdict.rs` on every rank (before it,
/// it hung until `ARX_TEST_RUN_SECS`).
fn harness_self_test(ctx: &Ctx) -> Result<(), String> {
    if ctx.rank == ctx.n - 1 {
        return Err("a deliberate failure on the last rank (ARX_TEST_HARNESS_SELFTEST)".into());
    }
    same_everywhere(ctx, 0x5e1f)
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

/// Every dtype at the shortest, odd, lane-splitting and longest lengths
/// (the `wide` set: a 16-rank world checks the layout and flags with it
/// without `correctness`'s 60 calls).
fn few_lengths(ctx: &Ctx) -> Result<(), String> {
    fn of<T: Element>(ctx: &Ctx, arx: &mut Arx, call: &mut u64) -> Result<(), String> {
        for count in [1, 3, 17, 1000, 4097, arx.max_count::<T>()] {
            *call += 1;
            checked::<T>(ctx, arx, *call, count, false)?;
        }
        Ok(())
    }
    let mut arx = builder().build(ctx.world).map_err(|e| e.to_string())?;
    let mut call = 700;
    of::<bf16>(ctx, &mut arx, &mut call)?;
    of::<f16>(ctx, &mut arx, &mut call)?;
    of::<f32>(ctx, &mut arx, &mut call)
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

/// Instances on sub-communicators, as a tensor-parallel + data-parallel
/// job makes them: "tp" groups of two consecutive ranks and "dp" groups of
/// ranks of one parity (with an odd world, a group of one), each rank in
/// one of each, the calls interleaved (the dp instance's bf16 calls
/// chunked). Every group's inputs differ (the call number holds the
/// group), so a call that saw another group's slots or segment is wrong;
/// each result is checked against the reference and across its group.
fn split_instances(ctx: &Ctx) -> Result<(), String> {
    use mpi::topology::Color;
    let (tg, dg) = (ctx.rank / 2, ctx.rank % 2);
    let split = |color: usize, what: &str| {
        ctx.world
            .split_by_color(Color::with_value(color as i32))
            .ok_or_else(|| format!("MPI_Comm_split ({what}) gave no communicator"))
    };
    let (tp, dp) = (split(tg, "tp")?, split(dg, "dp")?);
    let sub = |c| Ctx {
        world: c,
        rank: c.rank() as usize,
        n: c.size() as usize,
    };
    let (tctx, dctx) = (sub(&tp), sub(&dp));
    let mut t = builder().build(&tp).map_err(|e| format!("tp: {e}"))?;
    let mut d = builder()
        .slot_bytes(8192)
        .build(&dp)
        .map_err(|e| format!("dp: {e}"))?;
    for k in 0..8u64 {
        let (tc, dc) = (0x5000 + 100 * tg as u64 + k, 0x6000 + 100 * dg as u64 + k);
        checked::<f32>(&tctx, &mut t, tc, 3000 + k as usize, false)
            .map_err(|e| format!("tp: {e}"))?;
        checked::<bf16>(&dctx, &mut d, dc, 2 * 4096 + 3, k % 2 == 0)
            .map_err(|e| format!("dp: {e}"))?;
        checked::<f16>(&tctx, &mut t, tc + 50, 17, true).map_err(|e| format!("tp: {e}"))?;
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
