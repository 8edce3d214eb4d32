//! The edges of the Shm fabric's shared memory (a `harness = false` test,
//! re-launched under `mpirun` like tests/mpi):
//!
//! 1. A rank leaves `Arx::new` right after rank 0 created the segment,
//!    without taking part in what follows (as a rank that dies there
//!    would): every rank fails, and no segment of the job is left in
//!    `/dev/shm`.
//! 2. A rank's attach fails: the same.
//! 3. `/dev/shm` of 64 MiB (Docker's default) and 8 ranks: `Arx::new` fails
//!    on every rank with an error naming the bytes needed and how to raise
//!    the limit, instead of succeeding and dying of SIGBUS at the first
//!    full-size call; an instance that fits then gives exact results, and
//!    nothing is left behind. This case runs in a private mount namespace
//!    (`unshare -m`, a fresh 64 MiB tmpfs on `/dev/shm`), which needs root;
//!    elsewhere it is reported as SKIPPED, not as passed.
//!
//! 4. Where the proxy and its copy threads run (`mpirun --bind-to core`
//!    at 1 and 2 ranks, 2 ranks bound to one `--cpu-set` CPU, and
//!    `--bind-to none`), by the GPU instance's rule (the test hook
//!    `ARX_TEST_SHM_PLACEMENT=pin` applies it to these host instances): of
//!    the ranks whose main thread is bound to one CPU, as many as there are
//!    CPUs outside every main's have their proxy pinned to one of those,
//!    never two on one CPU, copy threads likewise and never on a main or
//!    proxy CPU; the others' proxies stay on their main's CPU; an unbound
//!    rank's threads keep its CPUs. With every rank bound to one CPU, a
//!    second instance made beside the first puts its proxies on CPUs of
//!    their own outside the first one's threads where enough are free (as
//!    many off the mains' CPUs as free CPUs allow otherwise), and a third,
//!    made once both are dropped, gets the first one's CPU again. By the
//!    host rule (1 rank bound to one core) the threads stay on the main's
//!    CPU. Read from `/proc/self/task`, with an exact call.
//!
//! Cases 1 and 2 use the test-only hook `ARX_TEST_SHM_FAIL=leave:<rank>` /
//! `attach:<rank>` of `src/fabric/shm.rs`.

use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use arx::{verify, Arx, DeviceKind, Error, FabricKind};
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

const SEED: u64 = 0x5eed_54a3;
/// Docker's default `/dev/shm`.
const SMALL_SHM: &str = "64m";
/// Ranks of the small-`/dev/shm` case: 8 x 18 MiB at the default slot.
const SMALL_RANKS: usize = 8;

fn main() -> ExitCode {
    match std::env::var("ARX_TEST_SHM_CHILD").as_deref() {
        Ok("cleanup") => child(cleanup),
        Ok("placement") => child(placement),
        Ok("small") => child(small_shm),
        _ => parent(),
    }
}

// ------------------------------------------------------------------ parent

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// `mpirun -n <n>` of this binary as child `mode`, with `env`.
fn mpirun(n: usize, mode: &str, env: &[(&str, &str)]) -> Command {
    mpirun_bound(n, mode, env, None)
}

/// [`mpirun`] with `--bind-to <bind>` when given (`bind` may carry more
/// mpirun arguments after the binding, split at spaces).
fn mpirun_bound(n: usize, mode: &str, env: &[(&str, &str)], bind: Option<&str>) -> Command {
    let exe = std::env::current_exe().expect("the test binary knows its path");
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", &n.to_string(), "--oversubscribe"]);
    if let Some(b) = bind {
        cmd.arg("--bind-to").args(b.split_whitespace());
    }
    if is_root() {
        cmd.arg("--allow-run-as-root");
    }
    cmd.args(["--mca", "btl", "self,vader,tcp"]);
    cmd.arg(exe)
        .env("ARX_TEST_SHM_CHILD", mode)
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Runs `cmd` with a time bound; Ok when it exits 0.
fn run(mut cmd: Command, limit: Duration) -> Result<(), String> {
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {:?}: {e}", cmd.get_program()))?;
    loop {
        match child.try_wait() {
            Ok(Some(s)) if s.success() => return Ok(()),
            Ok(Some(s)) => return Err(format!("{s}")),
            Ok(None) if start.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("killed after {limit:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(format!("waiting: {e}")),
        }
    }
}

/// Why a private `/dev/shm` cannot be mounted here, if it cannot.
fn private_shm_unavailable() -> Option<String> {
    if !is_root() {
        return Some("needs root (a private mount namespace with its own /dev/shm)".into());
    }
    let probe = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg("mount -t tmpfs -o size=1m tmpfs /dev/shm")
        .stdin(Stdio::null())
        .output();
    match probe {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "`unshare -m` + mount of a tmpfs failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("cannot run unshare: {e}")),
    }
}

fn parent() -> ExitCode {
    let limit = Duration::from_secs(180);
    let mut failed = 0;
    let mut report = |name: &str, r: Result<(), String>, t: Instant| match r {
        Ok(()) => println!("shm test: {name}: ok ({:.1?})", t.elapsed()),
        Err(e) => {
            println!("shm test: {name}: FAILED ({e})");
            failed += 1;
        }
    };

    let t = Instant::now();
    let r = run(
        mpirun(3, "cleanup", &[("ARX_TEST_SHM_FAIL", "leave:2")]),
        limit,
    );
    report(
        "rank 2 leaves Arx::new after the segment was created (3 ranks)",
        r,
        t,
    );

    let t = Instant::now();
    let r = run(
        mpirun(3, "cleanup", &[("ARX_TEST_SHM_FAIL", "attach:1")]),
        limit,
    );
    report("rank 1's attach fails (3 ranks)", r, t);

    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (n, bind, rule) in [
        (1, "core", "pin"),
        (2, "core", "pin"),
        (2, "none", "pin"),
        (1, "core", "host"),
        (2, "core --cpu-set 1", "pin"),
    ] {
        let t = Instant::now();
        let name = format!(
            "proxy and copy threads' CPUs, {n} rank(s), --bind-to {bind}, {} rule",
            if rule == "pin" { "GPU" } else { "host" }
        );
        if bind.starts_with("core") && n.max(2) > cpus {
            println!("shm test: {name}: SKIPPED, not counted as passed: {cpus} CPU(s)");
            continue;
        }
        let env = [
            ("ARX_SHM_COPY_THREADS", ""),
            ("ARX_TEST_SHM_PLACEMENT", rule),
        ];
        report(
            &name,
            run(mpirun_bound(n, "placement", &env, Some(bind)), limit),
            t,
        );
    }

    let name = format!("/dev/shm of {SMALL_SHM}, {SMALL_RANKS} ranks");
    match private_shm_unavailable() {
        Some(why) => println!("shm test: {name}: SKIPPED, not counted as passed: {why}"),
        None => {
            let t = Instant::now();
            let inner = mpirun(SMALL_RANKS, "small", &[]);
            let mut argv = vec![inner.get_program().to_string_lossy().into_owned()];
            argv.extend(inner.get_args().map(|a| a.to_string_lossy().into_owned()));
            // The mount and mpirun share the private namespace; the
            // machine's /dev/shm is untouched.
            let mut cmd = Command::new("unshare");
            cmd.args(["-m", "--propagation", "private", "sh", "-c"])
                .arg(format!(
                    "mount -t tmpfs -o size={SMALL_SHM},mode=1777 tmpfs /dev/shm && exec \"$@\""
                ))
                .arg("sh")
                .args(&argv)
                .env("ARX_TEST_SHM_CHILD", "small")
                .stdin(Stdio::null());
            report(&name, run(cmd, limit), t);
        }
    }

    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        println!("shm test: {failed} case(s) failed");
        ExitCode::FAILURE
    }
}

// ------------------------------------------------------------------ child

struct Ctx<'a> {
    world: &'a SimpleCommunicator,
    rank: usize,
    n: usize,
}

/// Runs `case` on every rank; fails the process if it failed on any rank.
fn child(case: fn(&Ctx) -> Result<(), String>) -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let universe = mpi::initialize().expect("MPI initialises once");
    let world = universe.world();
    let ctx = Ctx {
        world: &world,
        rank: world.rank() as usize,
        n: world.size() as usize,
    };
    let local = case(&ctx);
    if let Err(e) = &local {
        eprintln!("rank {}: FAILED: {e}", ctx.rank);
    }
    let mut failures = 0u32;
    world.all_reduce_into(
        &u32::from(local.is_err()),
        &mut failures,
        SystemOperation::sum(),
    );
    if failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn builder() -> arx::Builder {
    Arx::builder()
        .device(DeviceKind::Host)
        .fabric(FabricKind::Shm)
        .timeout(Duration::from_millis(2000))
}

/// The `/dev/shm` entries starting with `prefix`.
fn shm_entries(prefix: &str) -> Result<Vec<String>, String> {
    let dir = std::fs::read_dir("/dev/shm").map_err(|e| format!("reading /dev/shm: {e}"))?;
    Ok(dir
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect())
}

/// Segments of this job: their names start with rank 0's pid.
fn job_segments(ctx: &Ctx) -> Result<Vec<String>, String> {
    let mut pid = std::process::id();
    ctx.world.process_at_rank(0).broadcast_into(&mut pid);
    shm_entries(&format!("arx-{pid}-"))
}

/// Cases 1 and 2: `ARX_TEST_SHM_FAIL` makes one rank fail; every rank must
/// fail and leave nothing behind.
fn cleanup(ctx: &Ctx) -> Result<(), String> {
    let hook = std::env::var("ARX_TEST_SHM_FAIL").map_err(|_| "ARX_TEST_SHM_FAIL unset")?;
    let (_, bad) = hook
        .split_once(':')
        .and_then(|(p, r)| Some((p, r.parse::<usize>().ok()?)))
        .ok_or_else(|| format!("bad hook {hook}"))?;
    // The ranks left behind wait for the missing one until the start-up
    // bound: 10 s rather than the default 60 s (CI time).
    let r = builder()
        .init_timeout(Duration::from_secs(10))
        .build(ctx.world)
        .map(|_| ());
    // Every rank is out of Arx::new before anyone looks at /dev/shm.
    ctx.world.barrier();
    let mut problems = Vec::new();
    match r {
        Ok(()) => problems.push(format!("Arx::new succeeded although rank {bad} failed")),
        Err(e) if ctx.rank == bad && !e.to_string().contains("ARX_TEST_SHM_FAIL") => {
            problems.push(format!("the failing rank got another error: {e}"))
        }
        Err(Error::Timeout { .. } | Error::PeerFailed { .. }) => {}
        Err(e) if ctx.rank == bad => drop(e),
        Err(e) => problems.push(format!("unexpected error: {e}")),
    }
    let left = job_segments(ctx)?;
    if !left.is_empty() {
        problems.push(format!("left in /dev/shm: {left:?}"));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

/// Case 3, in a private 64 MiB `/dev/shm`.
fn small_shm(ctx: &Ctx) -> Result<(), String> {
    // What the default slot needs, from the public layout.
    let per_rank = arx::Layout::new(ctx.n, ctx.rank, arx::DEFAULT_SLOT_BYTES)
        .map_err(|e| e.to_string())?
        .region_bytes();
    let needed = per_rank * ctx.n;
    match builder().build(ctx.world) {
        Ok(mut arx) => {
            // What used to happen: a sparse segment, then SIGBUS at the
            // first call that touches pages /dev/shm cannot back.
            let n = arx.max_count::<f32>();
            let input = verify::input::<f32>(SEED, 1, ctx.rank, n);
            let mut out = vec![0f32; n];
            let r = arx.allreduce_host(&input, &mut out);
            return Err(format!(
                "Arx::new succeeded although the job needs {needed} bytes of /dev/shm \
                 ({SMALL_SHM}); a full-size call then returned {r:?}"
            ));
        }
        Err(e) => {
            let text = e.to_string();
            for want in [
                needed.to_string().as_str(),
                "--shm-size",
                "remount",
                "ARX_SLOT_BYTES",
                "free",
            ] {
                if !text.contains(want) {
                    return Err(format!("the error does not mention {want:?}: {text}"));
                }
            }
            if ctx.rank == 0 {
                println!("  rank 0's error: {text}");
            }
        }
    }
    ctx.world.barrier();
    let left = shm_entries("arx-")?;
    if !left.is_empty() {
        return Err(format!("left in /dev/shm after the failure: {left:?}"));
    }

    // An instance that fits works, at its full size.
    let mut arx = builder()
        .slot_bytes(64 << 10)
        .build(ctx.world)
        .map_err(|e| format!("an instance that fits failed: {e}"))?;
    let n = arx.max_count::<f32>();
    for call in 1..=3u64 {
        let input = verify::input::<f32>(SEED, call, ctx.rank, n);
        let want = verify::expected::<f32>(SEED, call, ctx.n, n);
        let mut out = vec![0f32; n];
        verify::poison(&mut out);
        arx.allreduce_host(&input, &mut out)
            .map_err(|e| format!("call {call}: {e}"))?;
        let wrong = verify::count_wrong(&out, &want);
        if wrong != 0 {
            return Err(format!("call {call}: {wrong} of {n} elements wrong"));
        }
        let d = verify::digest(&out);
        let mut all = vec![0u64; ctx.n];
        ctx.world.all_gather_into(&d, &mut all[..]);
        if all.iter().any(|&x| x != d) {
            return Err(format!("call {call}: digests differ between ranks"));
        }
    }
    drop(arx);
    ctx.world.barrier();
    let left = shm_entries("arx-")?;
    if !left.is_empty() {
        return Err(format!("left in /dev/shm at the end: {left:?}"));
    }
    Ok(())
}

/// The CPUs thread `tid` of this process may run on
/// (`Cpus_allowed_list`).
fn allowed_cpus(tid: &str) -> Result<Vec<usize>, String> {
    let path = format!("/proc/self/task/{tid}/status");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    let list = text
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .ok_or_else(|| format!("{path}: no Cpus_allowed_list"))?;
    cpu_list(list.trim())
}

/// A kernel CPU list ("0-3,8") as CPU numbers.
fn cpu_list(s: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        let num = |x: &str| {
            x.parse::<usize>()
                .map_err(|e| format!("CPU list {s:?}: {e}"))
        };
        match part.split_once('-') {
            Some((a, b)) => out.extend(num(a)?..=num(b)?),
            None => out.push(num(part)?),
        }
    }
    Ok(out)
}

/// This process's threads whose names start with `prefix`, with their CPUs.
fn threads_named(prefix: &str) -> Result<Vec<(String, Vec<usize>)>, String> {
    let mut out = Vec::new();
    let dir = std::fs::read_dir("/proc/self/task").map_err(|e| format!("/proc/self/task: {e}"))?;
    for e in dir.filter_map(|e| e.ok()) {
        let tid = e.file_name().to_string_lossy().into_owned();
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if comm.trim().starts_with(prefix) {
            out.push((comm.trim().to_string(), allowed_cpus(&tid)?));
        }
    }
    Ok(out)
}

/// Case 4: the proxy's and the copy threads' CPUs against the main
/// threads' bindings, learnt from every rank through MPI.
fn placement(ctx: &Ctx) -> Result<(), String> {
    let main = allowed_cpus(&format!("{}", unsafe_gettid()))?;
    let sole = (main.len() == 1).then(|| main[0]);
    // The CPUs this process may use: the node's online CPUs that a thread
    // of it can bind itself to (a cgroup's cpuset leaves some out; a
    // short-lived thread tries each, so this thread's binding stays).
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online")
        .map_err(|e| format!("online CPUs: {e}"))
        .and_then(|s| cpu_list(s.trim()))?;
    let online: Vec<usize> =
        std::thread::spawn(move || online.into_iter().filter(|&c| may_bind_to(c)).collect())
            .join()
            .map_err(|_| "the CPU probe thread panicked".to_string())?;
    let mut arx = builder()
        .build(ctx.world)
        .map_err(|e| format!("Arx::new: {e}"))?;
    // An exact full-slot call first (large enough for the copy threads).
    let n = arx.max_count::<f32>();
    let input = verify::input::<f32>(SEED, 4, ctx.rank, n);
    let want = verify::expected::<f32>(SEED, 4, ctx.n, n);
    let mut out = vec![0f32; n];
    verify::poison(&mut out);
    arx.allreduce_host(&input, &mut out)
        .map_err(|e| format!("call: {e}"))?;
    let wrong = verify::count_wrong(&out, &want);
    if wrong != 0 {
        return Err(format!("{wrong} of {n} elements wrong"));
    }

    let proxies = threads_named(&format!("arx-proxy-{}", ctx.rank))?;
    let [(_, proxy)] = &proxies[..] else {
        return Err(format!("expected one proxy thread, found {proxies:?}"));
    };
    let copies = threads_named(&format!("arx-copy-{}-", ctx.rank))?;
    // Every rank's main CPU (u64::MAX: not bound to one) and pinned proxy
    // CPU (u64::MAX: not pinned to one).
    let one = |v: &[usize]| if v.len() == 1 { v[0] as u64 } else { u64::MAX };
    let mut mains = vec![0u64; ctx.n];
    ctx.world
        .all_gather_into(&sole.map_or(u64::MAX, |c| c as u64), &mut mains[..]);
    let mut proxy_cpus = vec![0u64; ctx.n];
    ctx.world.all_gather_into(&one(proxy), &mut proxy_cpus[..]);
    // Whether each rank's proxy left its main thread's CPUs.
    let mut moved = vec![0u64; ctx.n];
    ctx.world
        .all_gather_into(&u64::from(*proxy != main), &mut moved[..]);
    let mains: Vec<usize> = mains
        .iter()
        .filter(|&&c| c != u64::MAX)
        .map(|&c| c as usize)
        .collect();
    let free: Vec<usize> = online
        .iter()
        .copied()
        .filter(|c| !mains.contains(c))
        .collect();
    let text = format!(
        "rank {}: main CPUs {main:?}, proxy {proxy:?}, copy threads {copies:?}, node mains \
         {mains:?}, proxies {proxy_cpus:?}, usable {online:?}",
        ctx.rank
    );
    if ctx.rank == 0 {
        println!("  {text}");
    }
    // The host rule: the proxy shares the main thread's CPUs, bound or not.
    let gpu_rule = std::env::var("ARX_TEST_SHM_PLACEMENT").as_deref() == Ok("pin");
    let first = (|| {
        if !gpu_rule {
            return (*proxy == main && copies.iter().all(|(_, c)| *c == main))
                .then_some(())
                .ok_or(format!(
                    "a host instance's threads left the main's CPUs: {text}"
                ));
        }
        match sole {
            None if *proxy != main => Err(format!("unbound rank's proxy moved: {text}")),
            None => copies
                .iter()
                .all(|(_, c)| *c == main)
                .then_some(())
                .ok_or(format!("unbound rank's copy threads moved: {text}")),
            Some(c) => {
                // Pinned proxies: exactly as many as free CPUs allow, each on
                // a free CPU of its own; the others stay on their main's CPU.
                let pinned: Vec<u64> = proxy_cpus
                    .iter()
                    .zip(&moved)
                    .filter(|(_, &m)| m == 1)
                    .map(|(&p, _)| p)
                    .collect();
                if pinned.len() != free.len().min(ctx.n) {
                    return Err(format!(
                        "{} proxies pinned off their main's CPU, {} free CPUs for {} ranks: {text}",
                        pinned.len(),
                        free.len(),
                        ctx.n
                    ));
                }
                let mut seen = pinned.clone();
                seen.sort_unstable();
                seen.dedup();
                if seen.len() != pinned.len()
                    || pinned.iter().any(|&p| !free.contains(&(p as usize)))
                {
                    return Err(format!(
                        "pinned proxies share a CPU or sit on a main's CPU: {text}"
                    ));
                }
                if *proxy == [c] {
                    // Sharing: copy threads (only if set by hand) share too.
                    return copies
                        .iter()
                        .all(|(_, k)| *k == [c])
                        .then_some(())
                        .ok_or(format!("a sharing rank's copy threads moved: {text}"));
                }
                for (name, cpus) in &copies {
                    let [k] = cpus[..] else {
                        return Err(format!("{name} not pinned to one CPU: {text}"));
                    };
                    if k == c || mains.contains(&k) || pinned.contains(&(k as u64)) {
                        return Err(format!("{name} on a main or proxy CPU: {text}"));
                    }
                }
                Ok(())
            }
        }
    })();
    // Every rank bound to one CPU and every rank's checks passed (the same
    // answer on every rank): a second instance beside the first, then a
    // third once both are gone.
    let mut all_ok = 0u64;
    ctx.world.all_reduce_into(
        &u64::from(first.is_ok()),
        &mut all_ok,
        SystemOperation::min(),
    );
    if gpu_rule && mains.len() == ctx.n && all_ok == 1 {
        return instances_apart(ctx, arx, proxy, &copies, &free, &text);
    }
    first
}

/// Case 4 with every rank bound to one CPU, after the first instance's
/// own checks: a second instance's proxy avoids the CPUs the first one's
/// threads hold on every rank, where enough are free; a third, made after
/// both are dropped, gets the first one's CPU again (the claims ended).
/// Every step that can fail on one rank is agreed on (`together`) before
/// the next collective, so a failing rank fails every rank instead of
/// leaving the others in a collective.
fn instances_apart(
    ctx: &Ctx,
    first: Arx,
    proxy: &[usize],
    copies: &[(String, Vec<usize>)],
    free: &[usize],
    text: &str,
) -> Result<(), String> {
    // The proxy and at most 15 copy threads (ARX_SHM_COPY_THREADS's bound).
    const MAX: usize = 16;
    let one = |v: &[usize]| if v.len() == 1 { v[0] as u64 } else { u64::MAX };
    // Every rank's first-instance threads' CPUs (u64::MAX: none).
    let mut mine = [u64::MAX; MAX];
    for (w, c) in mine
        .iter_mut()
        .zip(std::iter::once(one(proxy)).chain(copies.iter().map(|(_, c)| one(c))))
    {
        *w = c;
    }
    let mut held = vec![0u64; MAX * ctx.n];
    ctx.world.all_gather_into(&mine[..], &mut held[..]);
    let build = |what: &str| {
        builder()
            .build(ctx.world)
            .map_err(|e| format!("{what} Arx::new: {e}"))
    };
    let second = together(ctx, build("second"))?;
    let both = together(ctx, settled_proxies(ctx, 2))?;
    let other: Vec<usize> = both
        .iter()
        .map(|(_, c)| c.clone())
        .find(|c| c != proxy)
        .unwrap_or_else(|| proxy.to_vec());
    let mut seconds = vec![0u64; ctx.n];
    ctx.world.all_gather_into(&one(&other), &mut seconds[..]);
    drop(second);
    drop(first);
    let third = together(ctx, build("third"))?;
    let now = together(ctx, settled_proxies(ctx, 1))?;
    drop(third);
    let held_cpus: Vec<u64> = held.iter().copied().filter(|&c| c != u64::MAX).collect();
    let text = format!(
        "{text}; first instance's threads on every rank {held_cpus:?}, second proxies \
         {seconds:?}, third proxy {now:?}"
    );
    if ctx.rank == 0 {
        println!("  {text}");
    }
    if both.len() != 2 {
        return Err(format!(
            "{} proxy threads with two instances: {text}",
            both.len()
        ));
    }
    let unclaimed: Vec<u64> = free
        .iter()
        .map(|&c| c as u64)
        .filter(|c| !held_cpus.contains(c))
        .collect();
    if unclaimed.len() >= ctx.n {
        let mut seen = seconds.clone();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != ctx.n || seconds.iter().any(|c| !unclaimed.contains(c)) {
            return Err(format!(
                "second proxies not each on a CPU of their own outside the first instance's \
                 threads ({} such CPUs free): {text}",
                unclaimed.len()
            ));
        }
    } else {
        // As for the first instance: as many off the main threads' CPUs
        // as free CPUs allow.
        let off = seconds
            .iter()
            .filter(|&&c| free.contains(&(c as usize)))
            .count();
        if off != free.len().min(ctx.n) {
            return Err(format!(
                "{off} second proxies off the main threads' CPUs, {} free CPUs for {} ranks: \
                 {text}",
                free.len(),
                ctx.n
            ));
        }
    }
    match &now[..] {
        [(_, c)] if c == proxy => Ok(()),
        _ => Err(format!(
            "after both instances were dropped a new proxy is not where the first was: {text}"
        )),
    }
}

/// This rank's `want` proxy threads and their CPUs, once they are there
/// and their CPUs have stopped changing: a new thread is named before it
/// runs and pins itself after, so a first look may see it still on the
/// main thread's CPU. At most 5 s.
fn settled_proxies(ctx: &Ctx, want: usize) -> Result<Vec<(String, Vec<usize>)>, String> {
    let t = Instant::now();
    let mut last = threads_named(&format!("arx-proxy-{}", ctx.rank))?;
    loop {
        std::thread::sleep(Duration::from_millis(20));
        let found = threads_named(&format!("arx-proxy-{}", ctx.rank))?;
        if (found.len() >= want && found == last) || t.elapsed() > Duration::from_secs(5) {
            return Ok(found);
        }
        last = found;
    }
}

/// `r` where it is Ok on every rank; otherwise an error on every rank (this
/// rank's own, or one naming the failing rank), so that no rank goes on
/// into a collective that a failed rank left.
fn together<T>(ctx: &Ctx, r: Result<T, String>) -> Result<T, String> {
    let failed = if r.is_err() {
        ctx.rank as u64
    } else {
        u64::MAX
    };
    let mut first_failed = 0u64;
    ctx.world
        .all_reduce_into(&failed, &mut first_failed, SystemOperation::min());
    match r {
        Err(e) => Err(e),
        Ok(_) if first_failed != u64::MAX => {
            Err(format!("rank {first_failed} failed at the same step"))
        }
        Ok(v) => Ok(v),
    }
}

/// Whether the calling thread can bind itself to CPU `cpu` (it is then
/// bound there: call it on a thread of its own).
fn may_bind_to(cpu: usize) -> bool {
    if cpu >= libc::CPU_SETSIZE as usize {
        return false;
    }
    // SAFETY: an all-zero cpu_set_t is the empty set; CPU_SET writes below
    // CPU_SETSIZE (checked); sched_setaffinity(0) reads the set given for
    // the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// The calling thread's id.
fn unsafe_gettid() -> i64 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) }
}
