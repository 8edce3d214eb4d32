//! The Shm fabric: every rank of one node maps one POSIX shared-memory
//! segment that holds every rank's region; "sending" is a copy into the
//! peer's receive slot followed by a release store of the flag.
//!
//! Ordering: the data copy happens before the flag's release store in
//! program order, and the receiver reads the flag with an acquire load (the
//! Host device side) or `ld.acquire.sys` (the GPU kernel), so a flag is never
//! visible before its data — the same guarantee RDMA writes on one RC QP give.
//! The send itself is `protocol::post_shm`, which the loom model (`loom/`)
//! checks.
//!
//! # The copy crew
//!
//! One thread copies at about 14 GB/s (an H200 host: 74 µs for a 1 MiB
//! partial, `allreduce_perf --stages`), far below what the node's memory
//! moves. Posts of [`CREW_FROM`] bytes and more (over all peers) are cut
//! into pieces of at most [`PIECE`] bytes (`protocol::split_post`) that the
//! proxy and `ARX_SHM_COPY_THREADS` helper threads claim one at a time; the
//! thread that finishes a (peer, lane) unit's last piece stores its flag
//! (`protocol::post_piece`, also in the loom model: a Relaxed count of
//! unfinished pieces is caught there). The post returns once every piece is
//! copied, as before, so the send slot's reuse rules do not change. Helpers
//! wait as the proxy does (hot polls, then yields), then park until the
//! proxy's next job wakes the first helper, which wakes the next: an idle
//! crew costs no CPU. They inherit the rank's CPU binding; the default
//! gives none to a rank with fewer than four cores of its own, and there is
//! no crew where no post can reach the threshold (slot x peers below it).
//!
//! # The segment's life
//!
//! Rank 0 creates the segment (mode 0600, a random name that starts with
//! `arx-<rank 0's pid>-`) and reserves its memory at once
//! (`posix_fallocate`): a `/dev/shm` too small for the job (Docker's default
//! is 64 MiB) is an error at start-up naming the size needed, not a SIGBUS
//! at the first call that touches an unbacked page.
//!
//! The name is unlinked as soon as every rank has mapped the segment, so
//! nothing is left in `/dev/shm` however the job ends later. Before that,
//! every way out of [`establish`] on every rank unlinks it too (an error of
//! any rank, a timeout waiting for a rank that died), and the name is
//! agreed before the segment exists, so a rank missing at start-up is found
//! before there is anything to remove. What remains possible: if rank 0 is
//! killed by a signal it cannot handle (SIGKILL, or mpirun's SIGTERM when
//! another rank dies) between creating the segment and every rank's attach
//! — two short collectives among ranks that all just answered — and no
//! other rank reaches its own timeout, the segment stays in `/dev/shm` until
//! removed (`rm /dev/shm/arx-<pid>-*`, pid being rank 0's).
//!
//! Test hook (tests only, not a setting): `ARX_TEST_SHM_FAIL=leave:<r>`
//! makes rank r leave [`establish`] with an error right after the name is
//! agreed, without taking part in what follows, as a rank that dies there
//! would; `ARX_TEST_SHM_FAIL=attach:<r>` makes rank r's attach fail. See
//! `tests/shm.rs`.

use std::ffi::{CStr, CString};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::bootstrap::Bootstrap;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::fabric::Fabric;
use crate::layout::{Backing, Layout, Placed, Region};
use crate::protocol::{self, Piece};
use crate::spin::Backoff;
use crate::topology::{CpuClaim, ShmCpus};

/// One mapping of the node's shared segment.
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all cross-process words are
// accessed through `Region`'s atomics.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: we mapped exactly this range.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// Removes the segment's name when dropped, whatever the way out.
struct Unlink(CString);

impl Drop for Unlink {
    fn drop(&mut self) {
        // SAFETY: a NUL-terminated name. ENOENT (another rank was first, or
        // rank 0 never created it) is the expected outcome on all but one
        // rank and needs no report.
        unsafe { libc::shm_unlink(self.0.as_ptr()) };
    }
}

fn segment_name() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "/arx-{}-{:x}-{:08x}",
        std::process::id(),
        nanos,
        rand::random::<u32>()
    )
}

fn cname(name: &str) -> Result<CString> {
    CString::new(name).map_err(|_| Error::InvalidArgument(format!("segment name {name:?}")))
}

/// The test hook's point for this rank (see the module docs).
fn test_hook(rank: usize) -> Option<&'static str> {
    let v = std::env::var("ARX_TEST_SHM_FAIL").ok()?;
    let (point, r) = v.split_once(':')?;
    let point = ["leave", "attach"].into_iter().find(|p| *p == point)?;
    (r.parse::<usize>().ok()? == rank).then_some(point)
}

fn injected(point: &str, rank: usize) -> Error {
    Error::Os {
        call: "ARX_TEST_SHM_FAIL",
        object: format!("rank {rank}"),
        detail: format!("injected failure ({point}; test hook)"),
    }
}

/// `(free, total)` bytes of the file system behind `shm_open`.
fn shm_space() -> Option<(u64, u64)> {
    const DIR: &CStr = c"/dev/shm";
    // SAFETY: `st` is plain old data filled by statvfs.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a valid out-parameter.
    if unsafe { libc::statvfs(DIR.as_ptr(), &mut st) } != 0 {
        return None;
    }
    let unit = st.f_frsize as u64;
    Some((st.f_bavail as u64 * unit, st.f_blocks as u64 * unit))
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

/// The error for a segment `/dev/shm` cannot hold: what is needed, what is
/// free, and the two ways out.
fn no_space(name: &str, layout: &Layout, len: usize, detail: &str) -> Error {
    let world = layout.world();
    let slot = layout.slot_bytes();
    let slots = 2 * (world + 1);
    let fixed = layout.region_bytes() - slots * slot;
    let space = match shm_space() {
        Some((free, total)) => {
            // What would fit now: per rank, the fixed part plus the slots.
            let page = layout.page();
            let fit = (free as usize / world).saturating_sub(fixed) / slots / page * page;
            let want = (total.saturating_sub(free) + len as u64).div_ceil(1 << 20);
            format!(
                "/dev/shm has {free} bytes free ({}) of {total} ({}). Raise it to at least \
                 {want} MiB (docker run --shm-size={want}m ..., or mount -o remount,size={want}m \
                 /dev/shm) or lower ARX_SLOT_BYTES ({})",
                mib(free),
                mib(total),
                if fit > 0 {
                    format!("{fit} fits now")
                } else {
                    "not even one page per slot fits now".into()
                }
            )
        }
        None => "/dev/shm's size is unknown (statvfs failed). Raise it (docker run \
                 --shm-size=..., or mount -o remount,size=... /dev/shm) or lower ARX_SLOT_BYTES"
            .into(),
    };
    Error::Os {
        call: "posix_fallocate",
        object: format!("shared segment {name}"),
        detail: format!(
            "{detail}: the shm fabric needs {len} bytes ({}) of /dev/shm: {world} ranks x \
             {} bytes, each {slots} slots of {slot} bytes (2 x (ranks + 1)) and {fixed} bytes \
             of control and flags. {space}",
            mib(len as u64),
            layout.region_bytes()
        ),
    }
}

/// Reserves `len` bytes for the segment behind `fd` (which also sets its
/// size), so that no page of it can be missing later.
fn reserve(fd: libc::c_int, name: &str, layout: &Layout, len: usize) -> Result<()> {
    // tmpfs gives up a large reservation when a signal arrives (EINTR) and
    // releases what it had: try again, a bounded number of times.
    let mut rc = libc::EINTR;
    for _ in 0..100 {
        // SAFETY: fd is open for writing; posix_fallocate returns the error
        // number instead of setting errno.
        rc = unsafe { libc::posix_fallocate(fd, 0, len as libc::off_t) };
        if rc != libc::EINTR {
            break;
        }
    }
    match rc {
        0 => Ok(()),
        libc::ENOSPC | libc::ENOMEM => Err(no_space(
            name,
            layout,
            len,
            &std::io::Error::from_raw_os_error(rc).to_string(),
        )),
        e => Err(Error::Os {
            call: "posix_fallocate",
            object: format!("shared segment {name} ({len} bytes)"),
            detail: std::io::Error::from_raw_os_error(e).to_string(),
        }),
    }
}

/// Creates (rank 0) or opens the segment `name` and maps it.
fn map(name: &str, layout: &Layout, len: usize, create: bool) -> Result<Segment> {
    let c = cname(name)?;
    let flags = if create {
        libc::O_CREAT | libc::O_EXCL | libc::O_RDWR
    } else {
        libc::O_RDWR
    };
    // SAFETY: plain syscalls on a NUL-terminated name; the fd is closed below.
    let fd = unsafe { libc::shm_open(c.as_ptr(), flags, 0o600) };
    if fd < 0 {
        return Err(Error::last_os("shm_open", name));
    }
    let result = (|| {
        if create {
            reserve(fd, name, layout, len)?;
        } else {
            // SAFETY: `st` is plain old data filled by fstat.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: fd is open; st is a valid out-parameter.
            if unsafe { libc::fstat(fd, &mut st) } != 0 {
                return Err(Error::last_os("fstat", name));
            }
            if st.st_size as usize != len {
                return Err(Error::InvalidArgument(format!(
                    "shared segment {name} has {} bytes, expected {len}",
                    st.st_size
                )));
            }
        }
        // SAFETY: a fresh shared mapping of the whole object.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os("mmap", format!("{name} ({len} bytes)")));
        }
        Ok(Segment {
            base: p.cast(),
            len,
        })
    })();
    // SAFETY: fd is ours; the mapping keeps the object alive.
    unsafe { libc::close(fd) };
    result
}

/// The node's segment and a region view of every rank's part.
pub(crate) struct ShmSetup {
    /// Every rank's region, in rank order (ours at `layout.rank()`).
    pub regions: Vec<Arc<Region>>,
    /// The segment's name (already unlinked).
    pub name: String,
}

/// Creates the segment on rank 0, attaches every rank, then unlinks it.
/// Collective over `boot`; any rank's failure fails every rank, and no way
/// out leaves the name behind (see the module docs for the one exception).
pub(crate) fn establish(boot: &Bootstrap, layout: &Layout) -> Result<ShmSetup> {
    let per_rank = layout.region_bytes();
    let world = layout.world();
    let rank = boot.rank();
    let len = per_rank
        .checked_mul(world)
        .ok_or_else(|| Error::InvalidArgument("shared segment size overflows".into()))?;
    let hook = test_hook(rank);

    // The name first: a rank that is missing or failed at start-up shows
    // here, while there is nothing to remove yet.
    let mine = if rank == 0 {
        segment_name()
    } else {
        String::new()
    };
    let names = boot.all_gather_bytes("shm segment name", mine.as_bytes())?;
    let name = String::from_utf8_lossy(&names[0]).into_owned();
    // From here every rank removes the name on its way out: rank 0 if a
    // peer fails or never answers, the others if rank 0 dies after creating.
    let unlink = Unlink(cname(&name)?);
    if hook == Some("leave") {
        return Err(injected("leave", rank));
    }

    let created = if rank == 0 {
        map(&name, layout, len, true).map(Some)
    } else {
        Ok(None)
    };
    let created = boot.agree("shm segment create", created)?;
    let attached = match created {
        Some(s) => Ok(s),
        None if hook == Some("attach") => Err(injected("attach", rank)),
        None => map(&name, layout, len, false),
    };
    let seg = Arc::new(boot.agree("shm segment attach", attached)?);
    // Every rank has mapped it: the name is no longer needed.
    drop(unlink);

    let regions = (0..world)
        .map(|r| {
            let owner: Box<dyn Send + Sync> = Box::new(Arc::clone(&seg));
            // SAFETY: rank r's part lies inside the mapping and the Arc
            // keeps it mapped.
            let part = unsafe {
                Region::from_raw(
                    seg.base.add(r * per_rank),
                    per_rank,
                    Backing::Borrowed(owner),
                )
            }?;
            // Whole pages (region sizes are multiples of the agreed page):
            // the GPU side registers each part on its own.
            part.check_pages("shm segment part")?;
            Ok(Arc::new(part))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ShmSetup { regions, name })
}

/// Copies partials and flags into peers' parts of the shared segment.
/// A post's total bytes from which the copy crew shares it. 2 ranks on an
/// H200 host under MPS, three helpers (docs/BENCHMARKS.md, "The Shm copy
/// crew"): at 64 KiB a call took 0.93-0.95x its time without the crew
/// (the proxy's own `post` stage grew, from 3.4-4.9 to 5.1-8.3 µs: it
/// waits for the helper's count after the flags are out); from 128 KiB
/// 0.6-0.8x. Smaller posts were not measured.
pub(crate) const CREW_FROM: usize = 64 << 10;
/// The largest piece one thread of the crew takes at a time.
pub(crate) const PIECE: usize = 32 << 10;

pub(crate) struct ShmFabric {
    layout: Layout,
    regions: Arc<[Arc<Region>]>,
    name: String,
    /// Helper threads that copy pieces of large posts beside the proxy
    /// (none: the proxy copies alone).
    crew: Option<Crew>,
    /// Where the proxy and the crew are pinned, for `describe` (empty
    /// when they are not).
    placement: String,
    /// A post's total bytes from which the crew shares it ([`CREW_FROM`]).
    crew_from: usize,
    /// The crew's piece size ([`PIECE`]).
    piece: usize,
    /// The call timeout: the longest the proxy waits for a helper's piece.
    timeout: Duration,
    /// Test hook: helpers sleep this long after claiming a piece.
    #[cfg(test)]
    stall: Option<Duration>,
    /// The CPUs the proxy and the crew are pinned to, claimed while this
    /// fabric lives so that the process's next instance avoids them
    /// (after `crew`: released once its threads are gone).
    _claim: CpuClaim,
}

/// Whether a post of `layout` can reach the crew's threshold ([`CREW_FROM`]
/// over all peers): if not, no copy thread is started.
pub(crate) fn crew_possible(layout: &Layout) -> bool {
    let largest = layout
        .slot_bytes()
        .saturating_mul(layout.world().saturating_sub(1));
    largest >= CREW_FROM
}

impl ShmFabric {
    /// The fabric over `setup`'s regions, with `place.threads` copy threads
    /// beside the proxy (`ARX_SHM_COPY_THREADS`; none for a rank without
    /// peers), pinned to `place.helpers` when it names CPUs.
    pub(crate) fn new(
        layout: Layout,
        setup: &ShmSetup,
        place: &ShmCpus,
        cfg: &Config,
    ) -> Result<Self> {
        // None where no post can reach the crew's threshold (one rank, or
        // a slot too small for it): idle threads would only take CPU.
        let helpers = if crew_possible(&layout) {
            place.threads
        } else {
            0
        };
        let crew = match helpers {
            0 => None,
            n => Some(Crew::start(
                n,
                &place.helpers,
                &place.spinning_callers,
                layout.rank(),
                cfg,
            )?),
        };
        let pinned_helpers = match crew {
            Some(_) => &place.helpers[..helpers.min(place.helpers.len())],
            None => &[],
        };
        let claim = CpuClaim::new(place.proxy.iter().chain(pinned_helpers).copied().collect());
        Ok(ShmFabric {
            layout,
            regions: setup.regions.clone().into(),
            name: setup.name.clone(),
            placement: match (place.proxy, crew.is_some()) {
                (None, _) => match place.shared {
                    Some(c) => format!("; proxy shares the main thread's CPU {c}"),
                    None => String::new(),
                },
                (Some(p), true) if !place.helpers.is_empty() => format!(
                    "; proxy on CPU {p}, copy threads on CPUs {}",
                    crate::topology::cpu_words(pinned_helpers)
                ),
                (Some(p), _) => format!("; proxy on CPU {p}"),
            },
            crew,
            crew_from: CREW_FROM,
            piece: PIECE,
            timeout: cfg.timeout,
            #[cfg(test)]
            stall: None,
            _claim: claim,
        })
    }

    /// The copy threads beside the proxy.
    pub(crate) fn helpers(&self) -> usize {
        self.crew.as_ref().map_or(0, |c| c.threads.len())
    }

    /// The post of call `seq` shared with the crew: the pieces go to
    /// whichever thread claims them first (this one included), each unit's
    /// flag after its last piece; returns once every piece is copied.
    fn post_shared(&self, crew: &Crew, seq: u64, bytes: usize, flag: u64) -> Result<()> {
        let layout = &self.layout;
        let me = layout.rank();
        let peers: Vec<usize> = layout.peers().collect();
        let (pieces, per_unit) = protocol::split_post(
            me,
            layout.world(),
            &peers,
            bytes,
            flag,
            layout.slot_bytes(),
            self.piece,
        );
        let job = Arc::new(Job {
            flag,
            layout: *layout,
            regions: Arc::clone(&self.regions),
            left: per_unit.into_iter().map(AtomicU32::new).collect(),
            pieces,
            next: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            abandoned: AtomicU32::new(0),
            #[cfg(test)]
            stall: self.stall,
        });
        crew.hand_out(&job);
        // (Test hook: with `stall` set, the helpers take every piece.)
        #[cfg(test)]
        let mine = self.stall.is_none();
        #[cfg(not(test))]
        let mine = true;
        if mine {
            job.work();
        }
        // Acquire: pairs with each helper's Release count of a finished
        // piece, so that the send slot, which the device side may overwrite
        // once this post returns, is no longer read by any helper.
        let total = job.pieces.len();
        let start = Instant::now();
        let mut rounds = 0u32;
        while job.finished.load(Ordering::Acquire) < total {
            if start.elapsed() > self.timeout {
                // No more claims, and no flag from a piece still being
                // copied (it may read the send slot after this returns:
                // `protocol::post_piece`). The peers time out on this call.
                job.abandoned.store(1, Ordering::SeqCst);
                job.next.store(usize::MAX / 2, Ordering::Relaxed);
                return Err(Error::Proxy(format!(
                    "call {seq}: the shm fabric's copy threads finished {} of {total} pieces \
                     within {:?} (ARX_SHM_COPY_THREADS=0 copies on the proxy thread alone)",
                    job.finished.load(Ordering::Acquire),
                    self.timeout
                )));
            }
            // A helper holds a piece: it is copying, or descheduled.
            rounds = rounds.wrapping_add(1);
            if rounds % 64 == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        Ok(())
    }
}

/// One post shared by the crew (`ShmFabric::post_shared`).
struct Job {
    /// The call's flag word (its seq bits give the parity).
    flag: u64,
    /// This rank's layout (its rank is the sender's).
    layout: Layout,
    regions: Arc<[Arc<Region>]>,
    pieces: Vec<Piece>,
    /// Unfinished pieces of each unit (peer, lane).
    left: Vec<AtomicU32>,
    /// The next piece to claim.
    next: AtomicUsize,
    /// Pieces copied.
    finished: AtomicUsize,
    /// 1 once the poster gave up waiting (`post_shared`): no more flags.
    abandoned: AtomicU32,
    /// Test hook: a helper sleeps this long after claiming a piece.
    #[cfg(test)]
    stall: Option<Duration>,
}

impl Job {
    /// Claims and copies pieces until none is left.
    fn work(&self) {
        let layout = &self.layout;
        let me = layout.rank();
        let at = |q: usize| Placed {
            region: &self.regions[q],
            layout,
        };
        loop {
            // Relaxed: a claim only needs to be unique (the job's contents
            // reached this thread with the job itself).
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(pc) = self.pieces.get(i) else {
                return;
            };
            #[cfg(test)]
            if let Some(d) = self.stall {
                if std::thread::current()
                    .name()
                    .is_some_and(|n| n.starts_with("arx-copy"))
                {
                    crate::spin::sleep(d);
                }
            }
            // SAFETY: the call was published and is posted in order (the
            // proxy's contract for `post`); the claim makes this thread the
            // only one to copy piece i; the proxy does not return from the
            // post (and the device side does not reuse the send slot)
            // before `finished` counts every piece.
            unsafe {
                protocol::post_piece(
                    &at(me),
                    me,
                    &at(pc.peer),
                    pc,
                    self.flag,
                    &self.left[pc.unit],
                    &self.abandoned,
                )
            };
            // Release: see `post_shared`'s Acquire load.
            self.finished.fetch_add(1, Ordering::Release);
        }
    }
}

/// What the proxy and its copy threads share.
struct Board {
    /// Bumped for every job handed out.
    generation: AtomicU64,
    /// The latest job.
    job: Mutex<Option<Arc<Job>>>,
    stop: AtomicBool,
    /// The helpers, for waking the next one in line.
    threads: OnceLock<Vec<std::thread::Thread>>,
}

impl Board {
    fn wake(&self, i: usize) {
        if let Some(t) = self.threads.get().and_then(|v| v.get(i)) {
            t.unpark();
        }
    }
}

/// The Shm fabric's copy threads (`ARX_SHM_COPY_THREADS`): they wait
/// like the proxy (hot polls, then yields), then park until the next job
/// or the stop; they take a large post's pieces beside the proxy.
struct Crew {
    board: Arc<Board>,
    threads: Vec<JoinHandle<()>>,
}

impl Crew {
    /// `n` helpers, helper i pinned to `cpus[i]` when `cpus` names it; a
    /// helper bound to nothing but one of `spinning` (CPUs where a GPU
    /// caller spins) naps instead of polling (`proxy::proxy_spin`).
    fn start(
        n: usize,
        cpus: &[usize],
        spinning: &[usize],
        rank: usize,
        cfg: &Config,
    ) -> Result<Self> {
        let board = Arc::new(Board {
            generation: AtomicU64::new(0),
            job: Mutex::new(None),
            stop: AtomicBool::new(false),
            threads: OnceLock::new(),
        });
        let mut crew = Crew {
            board: Arc::clone(&board),
            threads: Vec::with_capacity(n),
        };
        for i in 0..n {
            let b = Arc::clone(&board);
            let (spin, hot) = (cfg.spin, cfg.spin_hot.unwrap_or(64));
            let cpu = cpus.get(i).copied();
            let spinning = spinning.to_vec();
            let t = std::thread::Builder::new()
                .name(format!("arx-copy-{rank}-{i}"))
                .spawn(move || {
                    if let Some(c) = cpu {
                        if let Err(e) = crate::topology::pin_current_thread(c) {
                            log::warn!("arx shm copy thread {i}: could not pin to CPU {c}: {e}");
                        }
                    }
                    // (Before the Backoff below, which then naps too.)
                    crate::proxy::settle_thread_spin(spin, &spinning);
                    helper(&b, i, Backoff::new(spin, hot))
                })
                .map_err(|e| Error::Os {
                    call: "thread spawn",
                    object: format!("arx shm copy thread {i} of {n}"),
                    detail: e.to_string(),
                })?;
            crew.threads.push(t);
        }
        let _ = board
            .threads
            .set(crew.threads.iter().map(|t| t.thread().clone()).collect());
        Ok(crew)
    }

    /// Offers `job` to the helpers; the first one wakes the next.
    fn hand_out(&self, job: &Arc<Job>) {
        *self.board.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::clone(job));
        // Release: a helper that sees the new generation finds the job
        // (the mutex orders it as well).
        self.board.generation.fetch_add(1, Ordering::Release);
        self.board.wake(0);
    }
}

impl Drop for Crew {
    fn drop(&mut self) {
        // Release: pairs with the helpers' Acquire load.
        self.board.stop.store(true, Ordering::Release);
        for t in &self.threads {
            t.thread().unpark();
        }
        for t in self.threads.drain(..) {
            // A helper leaves once unparked (or after the piece it copies);
            // it cannot panic while copying (bounds were checked when the
            // pieces were cut).
            let _ = t.join();
        }
    }
}

/// Helper `i`'s loop: take every job handed out, wake helper `i + 1`, claim
/// pieces until none is left.
fn helper(board: &Board, i: usize, mut backoff: Backoff) {
    let mut seen = 0u64;
    loop {
        // Acquire: see `Crew::drop`.
        if board.stop.load(Ordering::Acquire) {
            return;
        }
        // Acquire: see `Crew::hand_out`.
        let g = board.generation.load(Ordering::Acquire);
        if g == seen {
            // Every job comes with an unpark (`hand_out` wakes helper 0,
            // each helper the next), and so does the stop (`Crew::drop`):
            // an idle helper parks until then. An unpark that comes first
            // makes the next park return at once, so none is lost.
            backoff.idle_until_unparked();
            continue;
        }
        seen = g;
        board.wake(i + 1);
        let job = board.job.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(job) = job {
            job.work();
        }
        backoff.reset();
    }
}

impl Fabric for ShmFabric {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn post(&mut self, seq: u64, bytes: usize, flag: u64) -> Result<()> {
        if let Some(crew) = &self.crew {
            let peers = self.layout.world() - 1;
            if bytes.saturating_mul(peers) >= self.crew_from {
                return self.post_shared(crew, seq, bytes, flag);
            }
        }
        let layout = &self.layout;
        let me = layout.rank();
        let at = |q: usize| Placed {
            region: &self.regions[q],
            layout,
        };
        // SAFETY: the proxy posts every published call in order, once; our
        // send slot of parity p is stable until every peer has our flag for
        // this seq, and the peer reads recv[p][me] only after that flag
        // (kernels/arx_abi.h, rule 5 of DESIGN.md): nothing else touches
        // either range now.
        unsafe {
            protocol::post_shm(
                &at(me),
                me,
                layout.world(),
                layout.peers().map(|q| (q, at(q))),
                seq,
                bytes,
                flag,
            )
        };
        Ok(())
    }

    fn progress(&mut self) -> Result<bool> {
        Ok(false)
    }

    fn quiescent(&self) -> bool {
        true
    }

    fn tell_failed(&mut self, seq: u64) {
        let layout = &self.layout;
        let me = layout.rank();
        for s in [seq, seq + 1] {
            let word =
                protocol::flag_word(s, crate::abi::ARX_DTYPE_INVALID, crate::dtype::FAILED_COUNT);
            for q in layout.peers() {
                let at = Placed {
                    region: &self.regions[q],
                    layout,
                };
                for lane in 0..protocol::LANES {
                    // Relaxed: no data goes with this word (a reader that
                    // sees it fails the call and reads no slot).
                    protocol::Memory::flag(&at, protocol::parity(s), me, lane)
                        .store(word, Ordering::Relaxed);
                }
            }
        }
    }

    fn tell_departed(&mut self, last: u64) {
        let layout = &self.layout;
        let word = super::departed_word(last);
        for q in layout.peers() {
            // Release: pairs with the reader's Acquire (the proxy reads no
            // data on its account, but every flag of ours through `last`
            // was stored before).
            self.regions[q]
                .u64_at(layout.departed_offset(layout.rank()))
                .store(word, Ordering::Release);
        }
    }

    fn probe_rails(
        &mut self,
        _opts: &crate::probe::ProbeOptions,
    ) -> Result<Vec<crate::probe::RailProbe>> {
        Err(crate::error::Error::Unavailable {
            what: "rail probe",
            reason: "no rails: shared memory (every rank on one node)".into(),
        })
    }

    fn describe(&self) -> String {
        let crew = match self.helpers() {
            0 => String::new(),
            n => format!(
                ", {n} copy thread{} beside the proxy from {} KiB",
                if n == 1 { "" } else { "s" },
                self.crew_from >> 10
            ),
        };
        format!(
            "shm segment {} (unlinked), {} ranks x {} bytes{crew}{}",
            self.name,
            self.layout.world(),
            self.layout.region_bytes(),
            self.placement
        )
    }
}

#[cfg(test)]
mod tests {
    //! The copy crew against the proxy copying alone (`protocol::post_shm`)
    //! and against offsets computed here: every byte of every peer's
    //! receive slot and every flag.

    use super::*;
    use crate::abi;
    use crate::config::{Config, Overrides};
    use crate::protocol::{flag_word, Memory};

    const POISON: u8 = 0xA5;

    fn setup(world: usize, slot: usize) -> (Vec<Layout>, ShmSetup) {
        let layouts: Vec<Layout> = (0..world)
            .map(|r| Layout::new(world, r, slot).unwrap())
            .collect();
        let regions = (0..world)
            .map(|_| Arc::new(Region::anonymous(layouts[0].region_bytes()).unwrap()))
            .collect();
        (
            layouts,
            ShmSetup {
                regions,
                name: "test".into(),
            },
        )
    }

    /// Every region: send slots pseudo-random (seeded xorshift), receive
    /// slots poisoned, flags 0.
    fn fill(layouts: &[Layout], s: &ShmSetup, seed: u64) {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let l = &layouts[0];
        let poison = vec![POISON; l.slot_bytes()];
        let mut data = vec![0u8; l.slot_bytes()];
        for r in &s.regions {
            for p in 0..2 {
                for w in data.chunks_mut(8) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
                }
                // SAFETY: no thread copies while the test fills.
                unsafe { r.write(l.send_offset(p), &data) };
                for q in 0..l.world() {
                    // SAFETY: as above.
                    unsafe { r.write(l.recv_offset(p, q), &poison) };
                    for lane in 0..protocol::LANES {
                        Placed {
                            region: r,
                            layout: l,
                        }
                        .flag(p, q, lane)
                        .store(0, Ordering::Relaxed);
                    }
                }
            }
        }
    }

    /// Every region's bytes and flags, for comparing two runs.
    fn snapshot(layouts: &[Layout], s: &ShmSetup) -> Vec<(Vec<u8>, Vec<u64>)> {
        let l = &layouts[0];
        s.regions
            .iter()
            .map(|r| {
                let mut bytes = vec![0u8; l.region_bytes()];
                // SAFETY: nothing copies now.
                unsafe { r.read_into(0, &mut bytes) };
                let at = Placed {
                    region: r,
                    layout: l,
                };
                let flags = (0..2)
                    .flat_map(|p| {
                        (0..l.world())
                            .flat_map(move |q| (0..protocol::LANES).map(move |ln| (p, q, ln)))
                    })
                    .map(|(p, q, ln)| at.flag(p, q, ln).load(Ordering::Relaxed))
                    .collect();
                (bytes, flags)
            })
            .collect()
    }

    fn cfg() -> Config {
        Config::resolve_with(&Overrides::default(), |_| None).unwrap()
    }

    /// `n` copy threads, not pinned.
    fn threads(n: usize) -> ShmCpus {
        ShmCpus {
            threads: n,
            ..ShmCpus::default()
        }
    }

    fn fabric(l: Layout, s: &ShmSetup, helpers: usize, piece: usize) -> ShmFabric {
        let mut f = ShmFabric::new(l, s, &threads(helpers), &cfg()).unwrap();
        f.crew_from = 0;
        f.piece = piece;
        f
    }

    /// The flag words of the cases: a whole partial, a chunk in the high
    /// half, a reduce-scatter step (each peer its shard).
    fn flags(seq: u64, count: usize) -> Vec<u64> {
        let whole = flag_word(seq, abi::ARX_DTYPE_F32, count);
        let scatter = whole
            | (u64::from(abi::ARX_PATTERN_SCATTER & abi::ARX_FLAG_PATTERN_MASK)
                << abi::ARX_FLAG_PATTERN_SHIFT);
        vec![whole, whole | u64::from(abi::ARX_FLAG_HIGH), scatter]
    }

    #[test]
    fn the_crew_copies_what_the_proxy_alone_copies() {
        let slot = 64 << 10;
        for (world, helpers, piece) in [(2, 1, 1000), (3, 3, 4096), (5, 2, 1000)] {
            // Reference: each sender's proxy alone; then the crew, on
            // other regions filled alike.
            let (ls, s) = setup(world, slot);
            let (ls2, s2) = setup(world, slot);
            let mut alone: Vec<ShmFabric> =
                (0..world).map(|r| fabric(ls[r], &s, 0, piece)).collect();
            let mut crew: Vec<ShmFabric> = (0..world)
                .map(|r| fabric(ls2[r], &s2, helpers, piece))
                .collect();
            assert!(crew.iter().all(|f| f.helpers() == helpers));
            for count in [0, 1, 5, 1023, 1025, 4099, slot / 4] {
                for seq in 1..=2u64 {
                    for flag in flags(seq, count) {
                        let seed = (world * 7 + helpers) as u64 * 1_000_003
                            + (piece + count * 3) as u64
                            + seq;
                        fill(&ls, &s, seed);
                        fill(&ls2, &s2, seed);
                        for me in 0..world {
                            alone[me].post(seq, count * 4, flag).unwrap();
                            crew[me].post(seq, count * 4, flag).unwrap();
                        }
                        assert!(
                            snapshot(&ls2, &s2) == snapshot(&ls, &s),
                            "world {world}, {helpers} helpers, piece {piece}, \
                             {count} floats, flag {flag:#x}: the crew's regions differ"
                        );
                    }
                }
            }
        }
    }

    /// Offsets computed here, not by the protocol: a whole partial of
    /// `bytes` lands at offset 0 of each peer's `recv[p][me]` (at half the
    /// slot for a high chunk), the rest of the slot stays poisoned, and
    /// every lane's flag is the call's.
    #[test]
    fn every_byte_and_flag_lands_where_it_belongs() {
        let slot = 256 << 10;
        let world = 3;
        for (i, bytes) in [4usize, 40_000, 65_536, 100_004, 131_072]
            .into_iter()
            .enumerate()
        {
            for high in [false, true] {
                let (ls, s) = setup(world, slot);
                fill(&ls, &s, 77 + i as u64);
                let before = snapshot(&ls, &s);
                let seq = 3 + i as u64;
                let p = protocol::parity(seq);
                let mut flag = flag_word(seq, abi::ARX_DTYPE_F32, bytes / 4);
                if high {
                    flag |= u64::from(abi::ARX_FLAG_HIGH);
                }
                let base = if high { slot / 2 } else { 0 };
                let len = bytes.min(slot - base);
                let mut fabrics: Vec<ShmFabric> =
                    (0..world).map(|r| fabric(ls[r], &s, 2, 4096)).collect();
                // Posts of several senders at once, as on a node.
                std::thread::scope(|sc| {
                    for f in fabrics.iter_mut() {
                        sc.spawn(move || f.post(seq, bytes, flag).unwrap());
                    }
                });
                let after = snapshot(&ls, &s);
                let l = &ls[0];
                for q in 0..world {
                    for src in (0..world).filter(|&src| src != q) {
                        let sent = &before[src].0[l.send_offset(p)..][..slot];
                        let recv = &after[q].0[l.recv_offset(p, src)..][..slot];
                        assert_eq!(&recv[base..base + len], &sent[base..base + len]);
                        assert!(recv[..base].iter().all(|&b| b == POISON));
                        assert!(recv[base + len..].iter().all(|&b| b == POISON));
                        for lane in 0..protocol::LANES {
                            let at = Placed {
                                region: &s.regions[q],
                                layout: l,
                            };
                            assert_eq!(at.flag(p, src, lane).load(Ordering::Relaxed), flag);
                        }
                    }
                    // The other parity's slots are untouched.
                    let o = 1 - p;
                    let r = l.recv_offset(o, 0)..l.recv_offset(o, 0) + world * slot;
                    assert_eq!(after[q].0[r.clone()], before[q].0[r]);
                }
            }
        }
    }

    /// Many posts in a row through one crew (jobs handed out while
    /// helpers still hold the last one), then the fabric dropped: every
    /// helper stops, and every post's bytes arrived.
    #[test]
    fn a_crew_serves_many_posts_and_stops() {
        let slot = 128 << 10;
        let (ls, s) = setup(2, slot);
        let mut f = fabric(ls[0], &s, 3, 4096);
        let l = &ls[0];
        for seq in 1..=200u64 {
            let p = protocol::parity(seq);
            let bytes = 4 * (1 + (seq as usize * 7919) % (slot / 4));
            let data: Vec<u8> = (0..bytes).map(|i| (i as u64 * 31 + seq) as u8).collect();
            // SAFETY: no post in flight.
            unsafe { s.regions[0].write(l.send_offset(p), &data) };
            let flag = flag_word(seq, abi::ARX_DTYPE_F32, bytes / 4);
            f.post(seq, bytes, flag).unwrap();
            let mut got = vec![0u8; bytes];
            // SAFETY: the post returned: nothing copies.
            unsafe { s.regions[1].read_into(l.recv_offset(p, 0), &mut got) };
            assert!(got == data, "call {seq}");
            let at = Placed {
                region: &s.regions[1],
                layout: l,
            };
            assert_eq!(at.flag(p, 0, 1).load(Ordering::Acquire), flag);
        }
        let t = Instant::now();
        drop(f);
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the crew took {:?} to stop",
            t.elapsed()
        );
    }

    /// A helper that holds a piece past the call timeout: the post fails
    /// naming the setting, and the unit it held never gets its flag, not
    /// even once the helper finishes (the device side may have reused the
    /// send slot by then); the crew still stops.
    #[test]
    fn a_stalled_helper_fails_the_post_and_sends_no_flag() {
        let slot = 256 << 10;
        let (ls, s) = setup(2, slot);
        fill(&ls, &s, 5);
        // One piece per lane: the helper claims lane 0's and stalls.
        let mut f = fabric(ls[0], &s, 1, 64 << 10);
        f.timeout = Duration::from_millis(20);
        f.stall = Some(Duration::from_millis(300));
        let bytes = 128 << 10;
        let flag = flag_word(1, abi::ARX_DTYPE_F32, bytes / 4);
        let t = Instant::now();
        let e = f.post(1, bytes, flag).unwrap_err().to_string();
        assert!(
            t.elapsed() < Duration::from_millis(250),
            "{:?}",
            t.elapsed()
        );
        assert!(
            e.contains("ARX_SHM_COPY_THREADS") && e.contains("call 1"),
            "{e}"
        );
        // The helper finishes its piece meanwhile.
        std::thread::sleep(Duration::from_millis(500));
        let at = Placed {
            region: &s.regions[1],
            layout: &ls[0],
        };
        let p = protocol::parity(1);
        for lane in 0..protocol::LANES {
            assert_eq!(
                at.flag(p, 0, lane).load(Ordering::Acquire),
                0,
                "lane {lane} got its flag after the post gave up"
            );
        }
        drop(f);
    }

    /// No crew where no post can reach [`CREW_FROM`]: one rank, or a slot
    /// (as the layout rounds it up to a page) times the peers below it.
    #[test]
    fn no_crew_where_no_post_can_use_it() {
        let cfg = cfg();
        let mut small = 0;
        for (world, slot) in [
            (1, 1 << 20),
            (2, 4096),
            (2, 32 << 10),
            (3, 32 << 10),
            (2, 64 << 10),
        ] {
            let (ls, s) = setup(world, slot);
            let f = ShmFabric::new(ls[0], &s, &threads(2), &cfg).unwrap();
            let reach = ls[0].slot_bytes() * (world - 1);
            let want = if reach >= CREW_FROM { 2 } else { 0 };
            small += usize::from(want == 0);
            assert_eq!(
                f.helpers(),
                want,
                "{world} ranks, slot {}",
                ls[0].slot_bytes()
            );
        }
        // Pages of up to 16 KiB leave the 4 KiB and 32 KiB slots of two
        // ranks below the threshold; 64 KiB pages only one rank.
        assert!(small >= 1);
    }

    #[test]
    fn the_default_leaves_two_cores_to_each_rank() {
        use crate::config::default_copy_threads as d;
        // (CPUs the rank may run on, the node's CPUs, ranks on the node)
        assert_eq!(d(2, 2, 1), 0); // CI's machine
        assert_eq!(d(2, 2, 2), 0);
        assert_eq!(d(4, 4, 1), 1);
        assert_eq!(d(16, 16, 2), 3); // unbound, the H200 machine
        assert_eq!(d(16, 16, 4), 1);
        assert_eq!(d(16, 16, 8), 0);
        assert_eq!(d(1, 16, 2), 0); // --bind-to core
        assert_eq!(d(4, 16, 2), 1); // --map-by slot:PE=4
        assert_eq!(d(8, 16, 2), 3); // PE=8
        assert_eq!(d(8, 16, 4), 1); // four ranks bound to one 8-core socket
        assert_eq!(d(128, 128, 1), 3);
        assert_eq!(d(1, 1, 0), 0);
    }
}
