//! Bounded-politeness spinning for CPU-side waits (proxy, Host device side,
//! bootstrap polls).
//!
//! A wait polls hot for `hot` rounds, then yields the core for a while, then
//! sleeps in short naps. Hot polling gives the lowest latency when every rank
//! has its own core; yielding and napping keep oversubscribed runs (CI runs 8
//! ranks on 2 cores) and long idle periods from starving the thread that
//! would make progress.
//!
//! A thread that shares its one CPU with a thread that never yields (a GPU
//! caller's CUDA synchronize spins) must not poll or yield at all: the
//! scheduler then runs it only at its next tick (4 ms on the H200 machine).
//! [`SpinMode::Nap`] naps from the first idle round; a thread that slept
//! preempts the spinning one when it wakes, so it is late by about a nap.

use std::cell::Cell;
use std::time::{Duration, Instant};

use crate::config::SpinMode;

/// How long a word that looked wrong must keep one value before it is
/// believed ([`settle`]).
pub(crate) const SETTLE: Duration = Duration::from_millis(10);
/// [`settle`]'s bound, past its window, when the word never stops changing.
const SETTLE_MAX: Duration = Duration::from_secs(1);

/// Rounds of `yield_now` after the hot phase, before napping.
const YIELD_ROUNDS: u32 = 2000;
/// Length of one nap once a wait has been idle for long.
const NAP: Duration = Duration::from_micros(50);
/// Length of one nap of [`SpinMode::Nap`], which naps from the first idle
/// round: short, since each one ends in the latency a call sees.
pub(crate) const SHORT_NAP: Duration = Duration::from_micros(20);
/// Timer slack of a thread that naps [`SHORT_NAP`]s
/// ([`tighten_timer_slack`]): Linux's default, 50 us, would stretch each
/// 20 us nap to about 70.
const SHORT_NAP_SLACK_NS: libc::c_ulong = 10_000;

thread_local! {
    /// Set on a thread that shares its CPU with one that never yields
    /// ([`nap_on_this_thread`]).
    static NAPS: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread as one that shares its only CPU with a thread
/// that never yields (a GPU instance's proxy on its caller's CPU): every
/// [`SpinMode::Adaptive`] wait it starts from now on is a
/// [`SpinMode::Nap`] one, also the fabric's own waits inside a post (a
/// full send queue, a relay), and its timer slack narrows
/// ([`tighten_timer_slack`]). Returns false if the kernel refused the
/// slack.
pub(crate) fn nap_on_this_thread() -> bool {
    NAPS.with(|n| n.set(true));
    tighten_timer_slack()
}

/// One wait's spin state.
pub(crate) struct Backoff {
    mode: SpinMode,
    hot: u32,
    rounds: u32,
}

impl Backoff {
    pub(crate) fn new(mode: SpinMode, hot: u32) -> Self {
        let mode = if mode == SpinMode::Adaptive && NAPS.with(Cell::get) {
            SpinMode::Nap
        } else {
            mode
        };
        Backoff {
            mode,
            hot,
            rounds: 0,
        }
    }

    /// Called after a poll that found nothing to do.
    #[inline]
    pub(crate) fn idle(&mut self) {
        if self.spin() {
            sleep(self.nap());
        }
    }

    /// The length of this wait's naps.
    #[inline]
    fn nap(&self) -> Duration {
        if self.mode == SpinMode::Nap {
            SHORT_NAP
        } else {
            NAP
        }
    }

    /// [`Backoff::idle`] whose naps are parks, ended early by an unpark
    /// (the proxy thread's, `proxy::Link::wake`). Only for threads arx
    /// owns: on a caller's thread a park could consume an unpark meant for
    /// the caller's own code.
    #[inline]
    pub(crate) fn idle_parked(&mut self) {
        if self.spin() {
            std::thread::park_timeout(self.nap());
        }
    }

    /// [`Backoff::idle`] whose naps are parks without a deadline: for a
    /// thread arx owns whose every reason to run comes with an unpark (the
    /// Shm fabric's copy threads: a job, or the stop), so that an idle one
    /// costs no CPU at all.
    #[inline]
    pub(crate) fn idle_until_unparked(&mut self) {
        if self.spin() {
            std::thread::park();
        }
    }

    /// Spins or yields once; true when it is time to nap instead.
    #[inline]
    fn spin(&mut self) -> bool {
        self.rounds = self.rounds.saturating_add(1);
        if self.mode == SpinMode::Nap {
            true
        } else if self.mode == SpinMode::Hot || self.rounds <= self.hot {
            std::hint::spin_loop();
            false
        } else if self.rounds <= self.hot.saturating_add(YIELD_ROUNDS) {
            std::thread::yield_now();
            false
        } else {
            true
        }
    }

    /// Called after a poll that made progress.
    #[inline]
    pub(crate) fn reset(&mut self) {
        self.rounds = 0;
    }
}

/// Sets the calling thread's timer slack to [`SHORT_NAP_SLACK_NS`], for a
/// thread that waits in [`SpinMode::Nap`]'s short naps (each nap's end is
/// then late by at most that much, not by Linux's default 50 us). Only
/// this thread's timers change. Returns false if the kernel refused.
fn tighten_timer_slack() -> bool {
    // SAFETY: PR_SET_TIMERSLACK takes one integer argument and changes only
    // the calling thread's timer slack; no memory is passed.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, SHORT_NAP_SLACK_NS, 0, 0, 0) == 0 }
}

/// Sleeps for `d`, to a deadline on the monotonic clock.
///
/// Not `std::thread::sleep`: that resumes an interrupted `nanosleep` with
/// the remaining time the kernel reports, which counts the thread's timer
/// slack (50 us by default). Under signals more frequent than the slack (a
/// sampling profiler's timer, a 20 us `SIGALRM` without `SA_RESTART`) the
/// remaining time grows with each interruption and the sleep never ends:
/// capi/tests/signals_host hung in about one start-up in four, in a
/// bootstrap wait whose bound is checked only between naps. Resuming to the
/// same absolute deadline ends whatever the signals.
pub(crate) fn sleep(d: Duration) {
    // SAFETY: clock_gettime and clock_nanosleep read and write only the
    // timespec given; CLOCK_MONOTONIC always exists on Linux.
    unsafe {
        let mut t: libc::timespec = std::mem::zeroed();
        if libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) != 0 {
            return;
        }
        let ns = t.tv_nsec as u64 + u64::from(d.subsec_nanos());
        let secs = i64::try_from(d.as_secs()).unwrap_or(i64::MAX / 2);
        let add = secs.saturating_add((ns / 1_000_000_000) as i64);
        t.tv_sec = t.tv_sec.saturating_add(add as libc::time_t);
        t.tv_nsec = (ns % 1_000_000_000) as _;
        while libc::clock_nanosleep(
            libc::CLOCK_MONOTONIC,
            libc::TIMER_ABSTIME,
            &t,
            std::ptr::null_mut(),
        ) == libc::EINTR
        {}
    }
}

/// Re-reads a word that a peer's write may still be landing in, until a
/// read made at least `window` after the word last changed still shows the
/// same value, or `good` accepts it; returns the last value read (bounded
/// by the window plus one second when the word never stops changing).
/// [`SETTLE`] is the window arx uses.
///
/// An 8-byte RDMA write need not land as one store: soft-RoCE in an
/// emulated machine copies it in pieces (CI once read a probe word whose
/// digest had its upper 16 bits still zero). A real NIC's aligned 8-byte
/// write lands whole, and a word that is simply not there yet needs no
/// settling; so only a word that would fail the call (a flag of this call
/// with another count, a probe word with other options) is settled, and
/// the window is spent only on the way to an error. The clock is read
/// before each read of the word, so a reader descheduled for longer than
/// the window still reads the word once more before believing it.
pub(crate) fn settle(
    mut read: impl FnMut() -> u64,
    first: u64,
    good: impl Fn(u64) -> bool,
    window: Duration,
) -> u64 {
    let start = Instant::now();
    let mut w = first;
    let mut since = start;
    loop {
        if good(w) {
            return w;
        }
        let t = Instant::now();
        if t - start >= SETTLE_MAX + window {
            return w;
        }
        let now = read();
        if now != w {
            w = now;
            since = Instant::now();
        } else if t - since >= window {
            return w;
        } else {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{settle, sleep, SETTLE, SETTLE_MAX};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    #[test]
    fn each_mode_polls_yields_and_naps_in_its_order() {
        use super::{Backoff, NAP, SHORT_NAP, YIELD_ROUNDS};
        use crate::config::SpinMode;
        // Nap: a nap from the first idle round, a short one.
        let mut b = Backoff::new(SpinMode::Nap, 1000);
        assert!(b.spin() && b.spin());
        assert_eq!(b.nap(), SHORT_NAP);
        // Adaptive: `hot` polls and the yields first, then naps of NAP.
        let mut b = Backoff::new(SpinMode::Adaptive, 3);
        let rounds = (0..3 + YIELD_ROUNDS).filter(|_| b.spin()).count();
        assert_eq!(rounds, 0);
        assert!(b.spin());
        assert_eq!(b.nap(), NAP);
        b.reset();
        assert!(!b.spin(), "a reset wait polls hot again");
        // Hot: never naps.
        let mut b = Backoff::new(SpinMode::Hot, 0);
        assert!((0..3 * YIELD_ROUNDS).all(|_| !b.spin()));
        assert!(SHORT_NAP < NAP);
    }

    #[test]
    fn a_napping_thread_turns_its_adaptive_waits_into_naps() {
        use super::{nap_on_this_thread, Backoff, SHORT_NAP};
        use crate::config::SpinMode;
        let (inside, hot) = std::thread::spawn(|| {
            assert!(nap_on_this_thread());
            let mut a = Backoff::new(SpinMode::Adaptive, 1000);
            let mut h = Backoff::new(SpinMode::Hot, 1000);
            ((a.spin(), a.nap()), h.spin())
        })
        .join()
        .unwrap();
        assert_eq!(inside, (true, SHORT_NAP), "an adaptive wait naps at once");
        assert!(!hot, "an explicit hot wait stays hot");
        // This thread was not marked.
        assert!(!Backoff::new(SpinMode::Adaptive, 1000).spin());
    }

    #[test]
    fn the_timer_slack_narrows_for_this_thread_only() {
        use super::{tighten_timer_slack, SHORT_NAP_SLACK_NS};
        // SAFETY: PR_GET_TIMERSLACK takes no pointer; it returns the slack.
        let get = || unsafe { libc::prctl(libc::PR_GET_TIMERSLACK, 0, 0, 0, 0) };
        let before = get();
        let inside = std::thread::spawn(move || {
            assert!(tighten_timer_slack());
            get()
        })
        .join()
        .unwrap();
        assert_eq!(inside as libc::c_ulong, SHORT_NAP_SLACK_NS);
        assert_eq!(get(), before, "another thread's slack changed");
    }

    #[test]
    fn the_largest_sleep_neither_overflows_nor_ends_at_once() {
        // A deadline past the clock's range saturates instead of wrapping
        // to the past (which ended the sleep at once, or panicked in a
        // debug build).
        let h = std::thread::spawn(|| sleep(Duration::new(i64::MAX as u64, 999_999_999)));
        std::thread::sleep(Duration::from_millis(200));
        assert!(!h.is_finished(), "the sleep ended at once");
    }

    static HITS: AtomicUsize = AtomicUsize::new(0);

    extern "C" fn count(_: libc::c_int) {
        HITS.fetch_add(1, Ordering::Relaxed);
    }

    /// Naps and a longer sleep under a 20 us timer signal aimed at the
    /// sleeping thread alone (no `SA_RESTART`): they end, and about on
    /// time. `std::thread::sleep` in their place never returns.
    #[test]
    fn sleeps_end_under_a_dense_timer_signal() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // SAFETY: a handler that only bumps an atomic (async-signal
            // safe) for a real-time signal nothing else here uses; the
            // timer is aimed at this thread (SIGEV_THREAD_ID) and deleted
            // before the thread ends.
            let r = unsafe {
                let sig = libc::SIGRTMIN() + 5;
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = count as extern "C" fn(libc::c_int) as usize;
                assert_eq!(libc::sigaction(sig, &sa, std::ptr::null_mut()), 0);
                let mut ev: libc::sigevent = std::mem::zeroed();
                ev.sigev_notify = libc::SIGEV_THREAD_ID;
                ev.sigev_signo = sig;
                ev.sigev_notify_thread_id = libc::syscall(libc::SYS_gettid) as libc::c_int;
                let mut timer: libc::timer_t = std::mem::zeroed();
                assert_eq!(
                    libc::timer_create(libc::CLOCK_MONOTONIC, &mut ev, &mut timer),
                    0
                );
                let every = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 20_000,
                };
                let spec = libc::itimerspec {
                    it_interval: every,
                    it_value: every,
                };
                assert_eq!(
                    libc::timer_settime(timer, 0, &spec, std::ptr::null_mut()),
                    0
                );
                let start = Instant::now();
                for _ in 0..2000 {
                    sleep(Duration::from_micros(50));
                }
                let naps = start.elapsed();
                let start = Instant::now();
                sleep(Duration::from_millis(30));
                let long = start.elapsed();
                libc::timer_delete(timer);
                (naps, long)
            };
            let _ = tx.send(r);
        });
        let (naps, long) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("sleeps under a 20 us timer signal did not end in 30 s");
        assert!(
            HITS.load(Ordering::Relaxed) > 100,
            "the timer signal did not arrive"
        );
        assert!(
            naps >= Duration::from_millis(100),
            "2000 naps of 50 us in {naps:?}"
        );
        assert!(
            long >= Duration::from_millis(30),
            "a 30 ms sleep took {long:?}"
        );
    }

    /// The word CI read: the low half and two bytes of the high half of
    /// `48f7a6eb_00000001` landed, the last two bytes not yet.
    const WHOLE: u64 = 0x48f7_a6eb_0000_0001;
    const TORN: u64 = 0x0000_a6eb_0000_0001;

    fn digest_is(d: u32) -> impl Fn(u64) -> bool {
        move |w| (w >> 32) as u32 == d
    }

    #[test]
    fn a_word_landing_in_pieces_is_read_whole() {
        // The word lands in two more pieces, 2 ms apart (one byte each).
        let t = Instant::now();
        let mut whole_reads = 0;
        let read = || {
            let e = t.elapsed();
            if e < Duration::from_millis(2) {
                TORN
            } else if e < Duration::from_millis(4) {
                0x00f7_a6eb_0000_0001
            } else {
                whole_reads += 1;
                WHOLE
            }
        };
        let w = settle(read, TORN, digest_is(0x48f7_a6eb), SETTLE);
        assert_eq!(w, WHOLE, "{w:016x}");
        // Accepted at its first whole read, not after a window.
        assert_eq!(whole_reads, 1);
    }

    #[test]
    fn a_word_that_stays_wrong_is_believed_after_the_settle_time() {
        let t = Instant::now();
        let w = settle(|| TORN, TORN, digest_is(0x48f7_a6eb), SETTLE);
        assert_eq!(w, TORN);
        let e = t.elapsed();
        // Believed after the window, not at the bound for a changing word.
        assert!(e >= SETTLE && e < SETTLE_MAX, "{e:?}");
    }

    #[test]
    fn a_word_that_never_stops_changing_is_bounded() {
        let t = Instant::now();
        let mut n = 0u64;
        let w = settle(
            || {
                n += 1;
                n
            },
            0,
            |_| false,
            SETTLE,
        );
        assert!(w > 0);
        let e = t.elapsed();
        assert!(
            e >= Duration::from_millis(900) && e < Duration::from_secs(5),
            "{e:?}"
        );
    }

    #[test]
    fn a_good_word_returns_without_reading() {
        let w = settle(|| panic!("read"), WHOLE, digest_is(0x48f7_a6eb), SETTLE);
        assert_eq!(w, WHOLE);
    }
}
