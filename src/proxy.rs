//! The proxy thread: sees each seq the device side publishes and sends that
//! call's partial and flags through the fabric, strictly in order.
//!
//! Why every seq in order: a peer accepts seq+1 on the flag alone; if this
//! rank skipped posting seq, a peer could pair seq+1's flag with stale data.
//!
//! The proxy also runs the watchdog: when the device side has waited on a
//! call for longer than `stall_warn`, it logs what every peer has sent so a
//! hang is diagnosable from any rank's log. Errors from the fabric are
//! recorded here, the abort word is raised so the device side stops waiting,
//! and the next call returns the error.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config::{Config, SpinMode};
use crate::error::{Error, Result};
use crate::fabric::Fabric;
use crate::layout::{peer_flags, Layout, Region};
use crate::protocol;
use crate::spin::Backoff;
use crate::stages::{Mark, Trace};

/// The fabric and how far it has posted. Whoever holds the lock posts every
/// published seq in order: the proxy thread always may, and the Host device
/// side does so right after publishing (saving a thread handoff).
struct Engine {
    fabric: Box<dyn Fabric>,
    posted: u64,
    /// Mirrored in `ctrl.sent`: every call up to it no longer needs its
    /// send slot (see [`next_sent`]).
    sent: u64,
    /// The device side's recorded failure was told to the peers
    /// ([`Fabric::tell_failed`]).
    told: bool,
}

/// State shared by the proxy thread and the device side (through [`Link`]).
struct Shared {
    // Field order is drop order: the fabric (memory registrations, queue
    // pairs a NIC may still write through) goes before the region it
    // targets. A proxy thread left detached by `Proxy::stop` can hold the
    // last reference to this struct, so the order must hold here and not
    // only in `Arx`.
    engine: Mutex<Engine>,
    region: Arc<Region>,
    /// Capacity of one send slot: no published size may exceed it.
    slot_bytes: usize,
    stop: AtomicBool,
    /// False once the proxy thread has left its loop (or unwound).
    running: AtomicBool,
    failed: AtomicBool,
    error: Mutex<Option<Error>>,
    /// The stage trace (`crate::stages`); its proxy marks are made under
    /// the engine lock.
    trace: Trace,
    /// The proxy thread, for [`Link::wake`] (its idle naps are parks).
    thread: std::sync::OnceLock<std::thread::Thread>,
    /// How the proxy thread waits ([`proxy_spin`]), once it has started.
    spin: std::sync::OnceLock<SpinMode>,
}

impl Shared {
    fn new(fabric: Box<dyn Fabric>, region: Arc<Region>, layout: &Layout) -> Self {
        Shared {
            engine: Mutex::new(Engine {
                fabric,
                posted: 0,
                sent: 0,
                told: false,
            }),
            slot_bytes: layout.slot_bytes(),
            region,
            stop: AtomicBool::new(false),
            running: AtomicBool::new(true),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
            trace: Trace::new(),
            thread: std::sync::OnceLock::new(),
            spin: std::sync::OnceLock::new(),
        }
    }

    /// Posts every published seq not yet posted, then reaps completions.
    /// Returns true if it posted anything, or the fabric's progress did work
    /// of its own (a relay's forward): the proxy thread then stays hot.
    /// `wait` false: skip if another thread is pumping.
    pub fn pump(&self, wait: bool) -> bool {
        let mut g = match if wait {
            Ok(self.engine.lock().unwrap_or_else(|e| e.into_inner()))
        } else {
            self.engine.try_lock()
        } {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        let region = &*self.region;
        let published = protocol::published(region);
        let mut busy = false;
        // `failed`: Acquire pairs with `record`'s Release store, though only
        // the flag itself is used here (the error is read under its mutex).
        while g.posted < published && !self.failed.load(Ordering::Acquire) {
            let seq = g.posted + 1;
            // meta[p] of seq stays until seq+2 is published, which cannot
            // happen before this post reached every peer. The device side
            // published the byte count with the call; a count past the slot
            // is a bug or a corrupted control block: refuse rather than read
            // past the slot.
            let (flag, bytes) = protocol::announced(region, seq);
            let Ok(bytes) = usize::try_from(bytes) else {
                self.record(Error::Proxy(format!(
                    "call {seq}: published size {bytes} bytes"
                )));
                break;
            };
            if bytes > self.slot_bytes {
                self.record(Error::Proxy(format!(
                    "call {seq}: published size {bytes} bytes exceeds the slot of {} bytes",
                    self.slot_bytes
                )));
                break;
            }
            let traced = self.trace.active();
            if let Some(t) = traced {
                t.mark(Mark::Pickup, seq);
            }
            if let Err(e) = g.fabric.post(seq, bytes, flag) {
                self.record(e);
                break;
            }
            if let Some(t) = traced {
                t.mark(Mark::Posted, seq);
            }
            g.posted = seq;
            busy = true;
        }
        // A timeout the device side recorded: the instance is failed for
        // good and publishes nothing more, so tell the peers, once, after
        // the posts above. A peer still waiting on this rank then fails at
        // once: one that arrived late would otherwise finish that call on
        // this rank's partial and wait out its whole timeout in the next
        // (the poison of the call itself may beat it to the flag: it fails
        // that call). Not after a mismatch: every rank sees the
        // disagreement itself, and a poison would hide it behind "rank r
        // had failed" (a failed fabric tells its peers itself).
        if !g.told {
            if let Some(r) = protocol::recorded(region) {
                g.told = true;
                if r.code == crate::abi::ARX_STATUS_TIMEOUT {
                    g.fabric.tell_failed(r.seq);
                    busy = true;
                }
            }
        }
        match g.fabric.progress() {
            Ok(worked) => busy |= worked,
            Err(e) => self.record(e),
        }
        let sent = next_sent(
            g.sent,
            g.posted,
            protocol::published(region),
            g.fabric.completed_through(g.posted),
            // (`failed`: see the loop above.)
            self.failed.load(Ordering::Acquire) && g.fabric.quiescent(),
        );
        if sent > g.sent {
            g.sent = sent;
            protocol::release_sent(region, sent);
        }
        busy
    }

    /// True once everything published was posted and completed.
    fn drained(&self) -> bool {
        let g = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        g.posted >= protocol::published(&*self.region) && g.fabric.quiescent()
    }

    fn posted(&self) -> u64 {
        self.engine.lock().unwrap_or_else(|e| e.into_inner()).posted
    }

    /// The error the proxy recorded, if any.
    pub fn error(&self) -> Option<Error> {
        // Acquire: pairs with `record`'s Release store (the error itself is
        // under its mutex, which orders it anyway).
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        self.error.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn record(&self, e: Error) {
        let mut g = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            log::error!("arx proxy: {e}");
            *g = Some(e);
        }
        // Release: a thread that sees `failed` (or the abort word, next) and
        // then asks for the error finds it stored above.
        self.failed.store(true, Ordering::Release);
        protocol::raise_abort(&*self.region);
    }
}

/// What `ctrl.sent` says after a pump: the last call whose send slot will
/// not be read again, so that the device side may overwrite it (the GPU
/// side's copy-engine staging fills both slots before its kernel, and the
/// Host side with `ARX_STAGING=copy` returns only once its call is sent).
/// Never decreases.
///
/// * Healthy: the last call whose every write completed locally
///   ([`Fabric::completed_through`]), at most `posted`.
/// * Failed (`failed_idle`: an error is recorded and the fabric has nothing
///   outstanding, flushed writes counted): the proxy posts nothing after an
///   error, so no send slot is ever read again and every `published` call
///   counts as sent. A device side waiting for `sent` is released at once
///   rather than at its timeout, and finds the error through the abort
///   word.
fn next_sent(prev: u64, posted: u64, published: u64, completed: u64, failed_idle: bool) -> u64 {
    let now = if failed_idle {
        published
    } else {
        completed.min(posted)
    };
    prev.max(now)
}

/// Handle to the running proxy thread; stops and joins it on drop.
pub(crate) struct Proxy {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    timeout: Duration,
}

impl Proxy {
    /// Starts the proxy over `fabric`, pinned to `cpu` if given.
    /// `spinning_callers`: the CPUs that this node's callers are bound to
    /// alone when they spin without yielding while calls run (GPU
    /// instances': the CUDA synchronize spins); a proxy that ends up on one
    /// of them alone naps instead of polling ([`proxy_spin`]).
    pub fn start(
        fabric: Box<dyn Fabric>,
        region: Arc<Region>,
        layout: Layout,
        cfg: &Config,
        cpu: Option<usize>,
        spinning_callers: &[usize],
    ) -> Result<Self> {
        let shared = Arc::new(Shared::new(fabric, region, &layout));
        let s = Arc::clone(&shared);
        let cfg2 = cfg.clone();
        let spinning = spinning_callers.to_vec();
        let thread = std::thread::Builder::new()
            .name(format!("arx-proxy-{}", layout.rank()))
            .spawn(move || {
                /// Marks the thread gone however it leaves (also unwinding).
                struct Gone<'a>(&'a AtomicBool);
                impl Drop for Gone<'_> {
                    fn drop(&mut self) {
                        // Release/Acquire (`health`): only the flag is
                        // read; Relaxed would do, this is not a hot path.
                        self.0.store(false, Ordering::Release);
                    }
                }
                let _gone = Gone(&s.running);
                let _ = s.thread.set(std::thread::current());
                if let Some(cpu) = cpu {
                    if let Err(e) = crate::topology::pin_current_thread(cpu) {
                        log::warn!("arx proxy: could not pin to CPU {cpu}: {e}");
                    }
                }
                let (spin, own) = settle_thread_spin(cfg2.spin, &spinning);
                let by_hand = cfg2.proxy_cpu.is_some();
                note_shared_cpu(layout.rank(), cfg2.spin, &spinning, own, by_hand);
                let _ = s.spin.set(spin);
                run(&s, layout, &cfg2, spin)
            })
            .map_err(|e| Error::Os {
                call: "thread spawn",
                object: "arx proxy".into(),
                detail: e.to_string(),
            })?;
        Ok(Proxy {
            shared,
            thread: Some(thread),
            timeout: cfg.timeout,
        })
    }

    /// The device side's handle on this proxy.
    pub fn link(&self) -> Link {
        Link(Arc::clone(&self.shared))
    }
}

/// The device side's handle on the proxy: post what was published from the
/// calling thread, and learn the proxy's health. Nothing else of the
/// proxy's state is reachable through it.
#[derive(Clone)]
pub(crate) struct Link(Arc<Shared>);

impl Link {
    /// Posts every published call not yet posted, then reaps completions
    /// (see `Shared::pump`). `wait` false: skip if the proxy is pumping.
    pub fn pump(&self, wait: bool) -> bool {
        self.0.pump(wait)
    }
    /// Ends the proxy thread's idle nap, if it naps: something was
    /// published that this thread will not post itself (a pipelined chunk,
    /// posted while this thread sums the previous one).
    pub fn wake(&self) {
        if let Some(t) = self.0.thread.get() {
            t.unpark();
        }
    }
    /// The error the proxy recorded, if any.
    pub fn error(&self) -> Option<Error> {
        self.0.error()
    }
    /// The stage trace while it is on (one relaxed load when off).
    #[inline]
    pub fn trace(&self) -> Option<&Trace> {
        self.0.trace.active()
    }
    /// Ok while the proxy runs and has recorded no error.
    pub fn health(&self) -> Result<()> {
        if let Some(e) = self.0.error() {
            return Err(e);
        }
        if !self.0.running.load(Ordering::Acquire) {
            return Err(Error::Proxy("the proxy thread has exited".into()));
        }
        Ok(())
    }
}

impl Proxy {
    /// In a forked child: forgets the thread's handle (the thread is the
    /// parent's) without stopping or waiting for it.
    pub(crate) fn abandon(&mut self) {
        std::mem::forget(self.thread.take());
    }

    /// Stops the thread after it has drained what was published (bounded by
    /// the timeout) and joins it. The fabric stays alive until the proxy is
    /// dropped, so that the caller can close collectively in between.
    pub fn stop(&mut self) {
        // Release/Acquire (`run`): the thread then only reads what it reads
        // under the engine lock anyway; Relaxed would do.
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            // Checked: no timeout may make this overflow (the settings are
            // bounded, but a panic in Drop would abort an unwinding thread).
            // Without a representable deadline, do not wait at all.
            let now = Instant::now();
            let deadline = self
                .timeout
                .checked_add(Duration::from_secs(1))
                .and_then(|d| now.checked_add(d))
                .unwrap_or(now);
            while !t.is_finished() && Instant::now() < deadline {
                crate::spin::sleep(Duration::from_millis(1));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                log::error!(
                    "arx proxy did not stop within {:?}; leaving it detached",
                    self.timeout
                );
            }
        }
    }

    /// Fault injection for tests: see [`Fabric::inject_fault`].
    pub fn inject_fault(&self, peer: usize, lane: usize) -> Result<()> {
        self.shared
            .engine
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .fabric
            .inject_fault(peer, lane)
    }

    /// The rail probe ([`Fabric::probe_rails`]) under the engine lock, so
    /// that the proxy thread posts and reaps nothing meanwhile. Posts what
    /// was published first; refuses while a call is still in flight (not
    /// done on this rank) or after the proxy recorded an error.
    pub fn probe_rails(
        &self,
        opts: &crate::probe::ProbeOptions,
    ) -> Result<Vec<crate::probe::RailProbe>> {
        self.shared.pump(true);
        if let Some(e) = self.shared.error() {
            return Err(e);
        }
        let mut g = self.shared.engine.lock().unwrap_or_else(|e| e.into_inner());
        let published = protocol::published(&*self.shared.region);
        // Acquire: pairs with the device side's release of `done`.
        let done = self.shared.region.ctrl().done().load(Ordering::Acquire);
        if g.posted < published || done < published {
            return Err(Error::InvalidArgument(format!(
                "probe_rails while call {published} is in flight (posted through {}, done \
                 through {done}): synchronize the streams of every call first",
                g.posted
            )));
        }
        g.fabric.probe_rails(opts)
    }

    /// Turns the stage trace on or off.
    pub fn set_trace(&self, on: bool) {
        self.shared.trace.set(on);
    }

    /// The last traced call's stages, read under the engine lock (so the
    /// proxy's marks of a call are seen whole).
    pub fn stages(&self) -> crate::stages::Stages {
        let _g = self.shared.engine.lock().unwrap_or_else(|e| e.into_inner());
        self.shared.trace.read()
    }

    /// Tells the peers this rank closes its instance
    /// ([`Fabric::tell_departed`], with the last call posted), then waits,
    /// bounded by the timeout, until the words are out (a Verbs write is
    /// acknowledged), unless the drain before did not finish. After
    /// [`Proxy::stop`]: the thread has posted what was published.
    pub fn depart(&self) {
        let mut g = self.shared.engine.lock().unwrap_or_else(|e| e.into_inner());
        let last = g.posted;
        // A drain that ran out of time (writes still outstanding) was
        // waited for once already: the words go out, unawaited.
        let drained = g.fabric.quiescent();
        g.fabric.tell_departed(last);
        if !drained {
            return;
        }
        // (Checked as in `stop`: no deadline, no wait.)
        let now = Instant::now();
        let deadline = now.checked_add(self.timeout).unwrap_or(now);
        while !g.fabric.quiescent() {
            if let Err(e) = g.fabric.progress() {
                log::debug!("arx: the departure words may not all have reached the peers: {e}");
                return;
            }
            if Instant::now() > deadline {
                log::debug!("arx: the departure words were not acknowledged within the timeout");
                return;
            }
            crate::spin::sleep(Duration::from_micros(50));
        }
    }

    /// True when the fabric wants a collective close (see [`Fabric`]).
    pub fn needs_collective_close(&self) -> bool {
        self.shared
            .engine
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .fabric
            .needs_collective_close()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The spin mode of a thread arx owns (the proxy, a copy thread):
/// [`SpinMode::Adaptive`] (the default) becomes [`SpinMode::Nap`] when the
/// thread runs on nothing but a CPU where a caller spins without yielding
/// (`spinning`: this node's GPU callers bound to one CPU each, its own
/// caller or another rank's; `own`: the thread's sole CPU, if it has one).
/// A polling or yielding thread there runs only when the scheduler takes
/// the CPU from the caller at its tick: 4 ms per GPU call on the H200
/// machine. A thread that only naps has slept when it wakes, so it usually
/// takes the CPU from the spinning caller within its nap (measured: 35 us
/// per 8 KB call, docs/BENCHMARKS.md; a few calls still wait a tick). Any
/// other mode is the configured one.
pub(crate) fn proxy_spin(configured: SpinMode, spinning: &[usize], own: Option<usize>) -> SpinMode {
    match (configured, own) {
        (SpinMode::Adaptive, Some(o)) if spinning.contains(&o) => SpinMode::Nap,
        _ => configured,
    }
}

/// [`proxy_spin`] for the calling thread, arx's own, once pinned: from
/// where it really runs (a pin can fail, an unpinned thread inherits the
/// caller's binding). A thread that is to nap is marked
/// ([`crate::spin::nap_on_this_thread`]), so that every wait it starts
/// naps, the fabric's own too. Returns the mode and the thread's sole CPU.
pub(crate) fn settle_thread_spin(
    configured: SpinMode,
    spinning: &[usize],
) -> (SpinMode, Option<usize>) {
    let own = crate::topology::sole_bound_cpu();
    let spin = proxy_spin(configured, spinning, own);
    if spin == SpinMode::Nap && !crate::spin::nap_on_this_thread() {
        log::debug!("arx: the timer slack of a napping thread stays as it was (prctl refused)");
    }
    (spin, own)
}

/// Says, once per instance, what a proxy sharing a spinning caller's CPU
/// costs.
fn note_shared_cpu(
    rank: usize,
    configured: SpinMode,
    spinning: &[usize],
    own: Option<usize>,
    by_hand: bool,
) {
    let Some(c) = own.filter(|c| spinning.contains(c)) else {
        return;
    };
    let advice = if by_hand {
        "ARX_PROXY_CPU put it there: name a CPU no rank is bound to, or unset it"
    } else {
        "give each rank two CPUs or more (mpirun --map-by slot:PE=2 or --bind-to none, srun \
         -c 2), or set ARX_PROXY_CPU to a CPU no rank is bound to"
    };
    match configured {
        SpinMode::Adaptive => log::warn!(
            "arx: rank {rank}: the proxy shares CPU {c} with a caller whose CUDA synchronize \
             spins: it naps {} us between polls (ARX_SPIN=nap), so each GPU call waits about \
             that much longer (more now and then); {advice}",
            crate::spin::SHORT_NAP.as_micros()
        ),
        SpinMode::Hot => log::warn!(
            "arx: rank {rank}: the proxy shares CPU {c} with a caller whose CUDA synchronize \
             spins, and ARX_SPIN=hot keeps it polling: each GPU call can wait for a \
             scheduler tick (about 4 ms); unset ARX_SPIN; {advice}"
        ),
        SpinMode::Nap => log::info!(
            "arx: rank {rank}: the proxy shares CPU {c} with a spinning caller and naps \
             between polls (ARX_SPIN=nap)"
        ),
    }
}

fn run(s: &Shared, layout: Layout, cfg: &Config, spin: SpinMode) {
    let mut backoff = Backoff::new(spin, cfg.spin_hot.unwrap_or(64));
    let mut watch = Watchdog::new(cfg.stall_warn);
    let mut departures = Departures::new(layout.world());
    let mut stop_at: Option<Instant> = None;
    loop {
        let busy = s.pump(false);
        // (`stop`, `failed`: see `Proxy::stop` and `Shared::record`.)
        if s.stop.load(Ordering::Acquire) {
            // Drain: post everything published and wait for local
            // completions so peers get their last flags, within the timeout.
            let t = *stop_at.get_or_insert_with(Instant::now);
            // Pump once more after `stop` was seen: the fabric may still owe
            // peers writes for data that arrived before the instance was
            // dropped (a relay forwards a neighbour's last partial; the
            // pump above may have run before it arrived).
            s.pump(true);
            if s.drained() || s.failed.load(Ordering::Acquire) {
                return;
            }
            if t.elapsed() > cfg.timeout {
                log::warn!("arx proxy: stopped before every send completed");
                return;
            }
        }
        // The device side's progress, read once for both checks. Relaxed
        // would do: two counters compared, no data read on their account.
        let ctrl = s.region.ctrl();
        let done = ctrl.done().load(Ordering::Acquire);
        let published = ctrl.seq().load(Ordering::Acquire);
        let now = Instant::now();
        watch.check(s, &layout, done, published, now);
        departures.check(s, &layout, done, published, now);
        if busy {
            backoff.reset();
        } else {
            backoff.idle_parked();
        }
    }
}

/// How often, at most, the proxy reads the peers' departure words while
/// the device side waits for a call.
const DEPARTURES_EVERY: Duration = Duration::from_micros(200);

/// Fails a call at once when a peer it waits for closed its instance
/// before that call ([`Fabric::tell_departed`]): the peer's departure word
/// names the last call it posted; a call after it can never get that
/// peer's flag, so the proxy writes a poisoned word (dtype `INVALID`,
/// [`DEPARTED_COUNT`](crate::dtype::DEPARTED_COUNT)) for the call into the
/// peer's flags in this rank's own region, and the device side (Host or
/// GPU) fails the call naming the peer (`CallKind::Departed`).
///
/// Written here, by the receiver, and only for the last call the device
/// side has published (it may still be summing the one before, pipelined):
/// that call's flag place last held the peer's flag of the call two
/// before, which the device side had seen before it published the call in
/// between (kernels/arx_abi.h), and the peer writes nothing more. A
/// departing rank must not poison its peers itself: it does not know how
/// far they are, and a peer still summing the call before last (pipelined
/// chunks) may still read the flag a poison would overwrite.
struct Departures {
    /// Per peer: the call a poisoned word was written for (0: none).
    poisoned: Vec<u64>,
    next: Instant,
}

impl Departures {
    fn new(world: usize) -> Self {
        Departures {
            poisoned: vec![0; world],
            next: Instant::now(),
        }
    }

    /// `done`, `published`: the device side's counters; `now`: the time.
    fn check(&mut self, s: &Shared, layout: &Layout, done: u64, published: u64, now: Instant) {
        if published <= done || now < self.next {
            return;
        }
        self.next = now + DEPARTURES_EVERY;
        for q in layout.peers() {
            // Acquire: pairs with the departing rank's Release (Shm); over
            // RDMA the word lands after the rank's last flags.
            let w = s
                .region
                .u64_at(layout.departed_offset(q))
                .load(Ordering::Acquire);
            let Some(last) = crate::fabric::departed_last(w) else {
                continue;
            };
            if published <= last || self.poisoned[q] >= published {
                continue;
            }
            self.poisoned[q] = published;
            let word = protocol::flag_word(
                published,
                crate::abi::ARX_DTYPE_INVALID,
                crate::dtype::DEPARTED_COUNT,
            );
            for lane in 0..protocol::LANES {
                let at = s
                    .region
                    .u64_at(layout.flag_offset(protocol::parity(published), q, lane));
                // A word for this call is there already: the peer's own
                // poison (it had timed out in a call, `tell_failed`), which
                // says more. (Relaxed: no data goes with either word.)
                if protocol::flag_seq(at.load(Ordering::Relaxed)) == published as u32 {
                    continue;
                }
                // Relaxed: no data goes with this word (a reader that sees
                // it fails the call and reads no slot). The peer writes
                // nothing more that could race with it.
                at.store(word, Ordering::Relaxed);
            }
            log::warn!(
                "arx: rank {}: rank {q} closed its instance after call {last}; call \
                 {published}, which waits for it, fails",
                layout.rank()
            );
        }
    }
}

/// Logs every peer's flags when a call waits for too long.
struct Watchdog {
    after: Duration,
    last_done: u64,
    last_published: u64,
    since: Instant,
    warned: bool,
}

impl Watchdog {
    fn new(after: Duration) -> Self {
        Watchdog {
            after,
            last_done: 0,
            last_published: 0,
            since: Instant::now(),
            warned: false,
        }
    }

    /// The call to warn about, if the device side has made no progress
    /// for `after`: neither finished a call (`done`) nor published one. A
    /// pipelined call longer than one slot publishes chunk after chunk and
    /// stores `done` only at its end, so a long call that moves is not a
    /// stall (it was reported as one: a 256 MiB call of 512 chunks on a
    /// loaded machine).
    fn observe(&mut self, done: u64, published: u64, now: Instant) -> Option<u64> {
        if done != self.last_done || published != self.last_published || published <= done {
            self.last_done = done;
            self.last_published = published;
            self.since = now;
            self.warned = false;
            return None;
        }
        if self.warned || now.duration_since(self.since) < self.after {
            return None;
        }
        self.warned = true;
        Some(done + 1)
    }

    /// `done`, `published`: the device side's counters; `now`: the time.
    fn check(&mut self, s: &Shared, layout: &Layout, done: u64, published: u64, now: Instant) {
        let Some(waiting) = self.observe(done, published, now) else {
            return;
        };
        log::warn!(
            "arx watchdog: rank {} has waited {:?} on call {waiting} (posted up to {}); peers' flags: {}",
            layout.rank(),
            self.since.elapsed(),
            s.posted(),
            peer_flags(&s.region, layout, waiting)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Overrides;
    use crate::fabric::fake::FakeFabric;
    use crate::layout::{flag_word, Backing};

    type Log = Arc<Mutex<Vec<&'static str>>>;

    /// A fabric that records when it is dropped, standing in for the Verbs
    /// fabric's memory registrations and queue pairs.
    struct Recorder(Log);

    impl Fabric for Recorder {
        fn name(&self) -> &'static str {
            "recorder"
        }
        fn post(&mut self, _seq: u64, _bytes: usize, _flag: u64) -> Result<()> {
            Ok(())
        }
        fn progress(&mut self) -> Result<bool> {
            Ok(false)
        }
        fn quiescent(&self) -> bool {
            true
        }
        fn tell_failed(&mut self, _seq: u64) {}
        fn tell_departed(&mut self, _last: u64) {}
        fn describe(&self) -> String {
            String::new()
        }
    }

    impl Drop for Recorder {
        fn drop(&mut self) {
            self.0.lock().unwrap().push("fabric");
        }
    }

    #[test]
    fn adaptive_naps_only_on_a_spinning_callers_cpu() {
        use SpinMode::{Adaptive, Hot, Nap};
        // (configured, the node's spinning callers' CPUs, the thread's
        // sole CPU) -> mode
        let cases: [(SpinMode, &[usize], Option<usize>, SpinMode); 8] = [
            (Adaptive, &[3], Some(3), Nap),
            (Adaptive, &[2, 3], Some(2), Nap), // another rank's caller
            (Adaptive, &[3], Some(4), Adaptive),
            (Adaptive, &[3], None, Adaptive), // the thread may run elsewhere
            (Adaptive, &[], Some(3), Adaptive), // host callers post themselves
            (Hot, &[3], Some(3), Hot),        // asked for: kept (and warned)
            (Nap, &[], None, Nap),
            (Nap, &[3], Some(4), Nap),
        ];
        for (configured, callers, own, want) in cases {
            assert_eq!(
                proxy_spin(configured, callers, own),
                want,
                "{configured:?} callers {callers:?} thread {own:?}"
            );
        }
    }

    /// The CPUs this test may bind threads to (from its own binding).
    fn usable_cpus() -> Vec<usize> {
        // SAFETY: an all-zero cpu_set_t is the empty set; sched_getaffinity
        // writes at most its size for the calling thread; CPU_ISSET reads
        // below CPU_SETSIZE.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                return Vec::new();
            }
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect()
        }
    }

    /// The proxy thread judges where it really runs: pinned to a spinning
    /// caller's CPU, or unpinned and inheriting a caller's one-CPU
    /// binding, it naps; pinned elsewhere it keeps the configured mode.
    #[test]
    fn a_proxy_on_a_spinning_callers_cpu_naps() {
        let cpus = usable_cpus();
        let Some(&c0) = cpus.first() else {
            panic!("no CPU this test may use");
        };
        let cfg = Config::resolve_with(&Overrides::default(), |_| None).unwrap();
        assert_eq!(cfg.spin, SpinMode::Adaptive);
        let start = move |cpu: Option<usize>, callers: Vec<usize>| {
            let layout = Layout::new(2, 0, 4096).unwrap();
            let region = Arc::new(Region::anonymous(layout.region_bytes()).unwrap());
            let (fabric, _control) = FakeFabric::new();
            let proxy =
                Proxy::start(Box::new(fabric), region, layout, &cfg, cpu, &callers).unwrap();
            let t = Instant::now();
            while proxy.shared.spin.get().is_none() {
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "the proxy never started"
                );
                std::thread::yield_now();
            }
            *proxy.shared.spin.get().unwrap()
        };
        assert_eq!(
            start(Some(c0), vec![c0]),
            SpinMode::Nap,
            "pinned onto the caller's CPU"
        );
        assert_eq!(
            start(Some(c0), vec![]),
            SpinMode::Adaptive,
            "no spinning caller"
        );
        // Unpinned, started from a thread bound to c0 alone: inherits it.
        let start2 = start.clone();
        let inherited = std::thread::spawn(move || {
            crate::topology::pin_current_thread(c0).unwrap();
            start2(None, vec![c0])
        })
        .join()
        .unwrap();
        assert_eq!(inherited, SpinMode::Nap, "inherited the caller's one CPU");
        if let Some(&c1) = cpus.get(1) {
            assert_eq!(
                start(Some(c1), vec![c0]),
                SpinMode::Adaptive,
                "a CPU of its own"
            );
            assert_eq!(
                start(Some(c1), vec![c0, c1]),
                SpinMode::Nap,
                "another caller's CPU"
            );
        }
    }

    #[test]
    fn the_fabric_is_dropped_before_the_region() {
        let log: Log = Arc::default();
        let layout = Layout::new(2, 0, 4096).unwrap();
        let len = layout.region_bytes();
        let mem = Region::anonymous(len).unwrap();
        let l = Arc::clone(&log);
        // SAFETY: `mem` stays mapped until the closure (the region's
        // release) drops it.
        let region = unsafe {
            Region::from_raw(
                mem.as_ptr(),
                len,
                Backing::Custom(Some(Box::new(move || {
                    l.lock().unwrap().push("region");
                    drop(mem);
                }))),
            )
        }
        .unwrap();
        let cfg = Config::resolve_with(&Overrides::default(), |_| None).unwrap();
        // The proxy's shared state holds the only reference to the region,
        // as it does when a detached proxy thread outlives its `Arx`.
        let proxy = Proxy::start(
            Box::new(Recorder(Arc::clone(&log))),
            Arc::new(region),
            layout,
            &cfg,
            None,
            &[],
        )
        .unwrap();
        drop(proxy);
        assert_eq!(*log.lock().unwrap(), ["fabric", "region"]);
    }

    #[test]
    fn the_fabrics_own_work_counts_as_busy() {
        // A relay forwards a neighbour's partial from `progress`; if that
        // did not count, the proxy would back off into naps between
        // relayed partials. Pumped here without a proxy thread, so nothing
        // else consumes the fabric's report.
        let layout = Layout::new(2, 0, 4096).unwrap();
        let region = Arc::new(Region::anonymous(layout.region_bytes()).unwrap());
        let (fabric, control) = FakeFabric::new();
        let s = Shared::new(Box::new(fabric), Arc::clone(&region), &layout);
        assert!(!s.pump(true), "nothing published, nothing forwarded");
        control.work.store(true, Ordering::Release);
        assert!(s.pump(true), "the fabric forwarded something");
        assert!(!s.pump(true), "idle again");
        protocol::publish(&*region, 1, flag_word(1, 3, 8), 32);
        assert!(s.pump(true), "posted call 1");
        assert!(!s.pump(true), "nothing new");
    }

    #[test]
    fn sent_follows_completion_and_never_goes_back() {
        // Healthy: what the fabric completed, never beyond what was posted.
        assert_eq!(next_sent(0, 5, 6, 3, false), 3);
        assert_eq!(next_sent(3, 5, 6, 9, false), 5);
        assert_eq!(next_sent(4, 5, 6, 2, false), 4);
        // Nothing posted yet.
        assert_eq!(next_sent(0, 0, 1, 0, false), 0);
    }

    #[test]
    fn sent_after_a_failure_covers_every_published_call_once_idle() {
        // Failed with writes still outstanding (failed_idle false): only
        // what completed; a send slot may still be read.
        assert_eq!(next_sent(2, 7, 9, 4, false), 4);
        // Failed and idle: calls 8 and 9 were never posted and never will
        // be; the writes of calls 5 to 7 completed or were flushed.
        assert_eq!(next_sent(4, 7, 9, 4, true), 9);
        // A call published after the failure is released too.
        assert_eq!(next_sent(9, 7, 10, 4, true), 10);
    }

    /// A timeout the device side records is told to the peers once, with
    /// its call; a mismatch is not (every rank sees it itself).
    #[test]
    fn a_recorded_timeout_is_told_to_the_peers_and_a_mismatch_is_not() {
        for (code, told) in [
            (crate::abi::ARX_STATUS_TIMEOUT, 7),
            (crate::abi::ARX_STATUS_MISMATCH, 0),
        ] {
            let (region, _layout, _cfg, control, proxy) =
                crate::fabric::fake::proxy_rig(4096, &Overrides::default());
            protocol::record(&*region, code, 1, 0, 7, 0);
            proxy.link().wake();
            let deadline = Instant::now() + Duration::from_millis(500);
            while control.told.load(Ordering::Acquire) == 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(control.told.load(Ordering::Acquire), told, "status {code}");
        }
    }

    /// A peer's departure word fails the call the device side waits for
    /// when the peer posted only calls before it (the proxy poisons the
    /// peer's flag of that call in this rank's region, keeping a word of
    /// that call already there: the peer's own "failed" poison), and
    /// leaves it alone when the peer had posted that call; `depart` hands
    /// the fabric the last call posted.
    #[test]
    fn a_departed_peer_fails_only_the_calls_it_never_made() {
        let departed = flag_word(
            2,
            crate::abi::ARX_DTYPE_INVALID,
            crate::dtype::DEPARTED_COUNT,
        );
        let failed = flag_word(2, crate::abi::ARX_DTYPE_INVALID, crate::dtype::FAILED_COUNT);
        assert_eq!(
            crate::CallDesc::of_flag(departed).kind,
            crate::CallKind::Departed
        );
        for preloaded in [0, failed] {
            let (region, layout, _cfg, control, proxy) =
                crate::fabric::fake::proxy_rig(4096, &Overrides::default());
            let ctrl = region.ctrl();
            for seq in 1..=2u64 {
                ctrl.meta((seq & 1) as usize).store(
                    flag_word(seq, crate::abi::ARX_DTYPE_F32, 8),
                    Ordering::Relaxed,
                );
            }
            let flag = |lane| region.u64_at(layout.flag_offset(0, 1, lane));
            flag(0).store(preloaded, Ordering::Relaxed);
            ctrl.done().store(1, Ordering::Release);
            ctrl.seq().store(2, Ordering::Release);
            let flags = || [0, 1].map(|lane| flag(lane).load(Ordering::Acquire));
            let tell = |last| {
                region
                    .u64_at(layout.departed_offset(1))
                    .store(crate::fabric::departed_word(last), Ordering::Release);
                proxy.link().wake();
            };
            // The peer posted call 2: nothing to fail (the proxy checks
            // every 200 us while the call is in flight).
            tell(2);
            std::thread::sleep(Duration::from_millis(30));
            assert_eq!(flags(), [preloaded, 0], "the peer posted call 2");
            // It posted call 1 only.
            tell(1);
            let want = [if preloaded == 0 { departed } else { failed }, departed];
            let deadline = Instant::now() + Duration::from_millis(500);
            while flags() != want && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(flags(), want, "the peer posted call 1 only");
            // This rank leaves: its fabric is told the last call it posted
            // (both posts complete first, so that neither `stop`'s drain
            // nor `depart` waits for them).
            control.completed.store(2, Ordering::Release);
            let mut proxy = proxy;
            proxy.stop();
            proxy.depart();
            assert_eq!(
                crate::fabric::departed_last(control.departed.load(Ordering::Acquire)),
                Some(2)
            );
        }
    }

    /// A proxy whose fabric fails posting call 2 while call 1's writes are
    /// outstanding: `sent` must not cover call 1 before its writes are done
    /// (or flushed), and must then cover every published call, so that a
    /// device side waiting for it is released before its timeout.
    #[test]
    fn a_failed_proxy_releases_sent_once_nothing_is_outstanding() {
        let o = Overrides {
            timeout: Some(Duration::from_secs(10)),
            ..Default::default()
        };
        // (Nothing is published before fail_at is set: no post can precede it.)
        let (region, _layout, _cfg, control, proxy) = crate::fabric::fake::proxy_rig(4096, &o);
        control.fail_at.store(2, Ordering::Release);
        let ctrl = region.ctrl();
        for seq in 1..=3u64 {
            ctrl.meta((seq & 1) as usize).store(
                flag_word(seq, crate::abi::ARX_DTYPE_F32, 8),
                Ordering::Relaxed,
            );
        }
        ctrl.seq().store(3, Ordering::Release);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !protocol::aborted(&*region) {
            assert!(Instant::now() < deadline, "the failure was never recorded");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(proxy.link().error().is_some());
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            protocol::sent_through(&*region),
            0,
            "call 1 still in flight"
        );
        // Call 1's writes complete (or are flushed): nothing is outstanding.
        control.completed.store(1, Ordering::Release);
        while protocol::sent_through(&*region) < 3 {
            assert!(
                Instant::now() < deadline,
                "sent stayed at {}",
                protocol::sent_through(&*region)
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(protocol::sent_through(&*region), 3);
    }

    #[test]
    fn watchdog_warns_on_a_stall_not_on_a_long_call_that_publishes() {
        let after = Duration::from_millis(100);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut w = Watchdog::new(after);
        w.since = t0;
        // Call 1 published, nothing done: a stall once `after` has passed.
        assert_eq!(w.observe(0, 1, at(0)), None);
        assert_eq!(w.observe(0, 1, at(50)), None);
        assert_eq!(w.observe(0, 1, at(150)), Some(1));
        // Once per stall.
        assert_eq!(w.observe(0, 1, at(300)), None);
        // A pipelined call: chunks published one after another, `done`
        // only at the end: never a warning while it publishes.
        for k in 0..20u64 {
            assert_eq!(w.observe(1, 2 + k, at(400 + 60 * k)), None, "chunk {k}");
        }
        // It stops publishing: a stall again.
        assert_eq!(w.observe(1, 21, at(1600)), None);
        assert_eq!(w.observe(1, 21, at(1750)), Some(2));
        // Everything done: idle, no warning however long.
        assert_eq!(w.observe(21, 21, at(1800)), None);
        assert_eq!(w.observe(21, 21, at(9000)), None);
    }
}
