//! Bounded-politeness spinning for CPU-side waits (proxy, Host device side,
//! bootstrap polls).
//!
//! A wait polls hot for `hot` rounds, then yields the core for a while, then
//! sleeps in short naps. Hot polling gives the lowest latency when every rank
//! has its own core; yielding and napping keep oversubscribed runs (CI runs 8
//! ranks on 2 cores) and long idle periods from starving the thread that
//! would make progress.

use std::time::Duration;

use crate::config::SpinMode;

/// Rounds of `yield_now` after the hot phase, before napping.
const YIELD_ROUNDS: u32 = 2000;
/// Length of one nap once a wait has been idle for long.
const NAP: Duration = Duration::from_micros(50);

/// One wait's spin state.
pub(crate) struct Backoff {
    mode: SpinMode,
    hot: u32,
    rounds: u32,
}

impl Backoff {
    pub(crate) fn new(mode: SpinMode, hot: u32) -> Self {
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
            std::thread::sleep(NAP);
        }
    }

    /// [`Backoff::idle`] whose naps are parks, ended early by an unpark
    /// (the proxy thread's, `proxy::Link::wake`). Only for threads arx
    /// owns: on a caller's thread a park could consume an unpark meant for
    /// the caller's own code.
    #[inline]
    pub(crate) fn idle_parked(&mut self) {
        if self.spin() {
            std::thread::park_timeout(NAP);
        }
    }

    /// Spins or yields once; true when it is time to nap instead.
    #[inline]
    fn spin(&mut self) -> bool {
        self.rounds = self.rounds.saturating_add(1);
        if self.mode == SpinMode::Hot || self.rounds <= self.hot {
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
