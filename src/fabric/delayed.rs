//! A test-only fabric wrapper that performs every post late.
//!
//! `ARX_TEST_POST_DELAY_US=N` (read at start-up, logged, never for
//! production) wraps the chosen fabric: each post is queued and handed to
//! the real fabric only `N` µs later, by the proxy's progress loop, in post
//! order. The real fabric then reads the send slot late, as a busy NIC's DMA
//! engine would. This widens the window in which a device side that
//! overwrites a send slot too early (before `ctrl.sent` covers the call) is
//! caught: a peer then receives the new data under the old call's flag.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::fabric::Fabric;

/// The variable that enables the wrapper.
pub(crate) const VAR: &str = "ARX_TEST_POST_DELAY_US";

/// The delay set by [`VAR`], if any.
pub(crate) fn from_env() -> Option<Duration> {
    let v = std::env::var(VAR).ok()?;
    let us: u64 = v.trim().parse().ok().filter(|&us| us > 0)?;
    log::warn!("arx: {VAR}={us}: every post is delayed (a test setting, never for production)");
    Some(Duration::from_micros(us))
}

/// Wraps `inner` so that each post reaches it `delay` late.
pub(crate) struct Delayed {
    inner: Box<dyn Fabric>,
    delay: Duration,
    /// (due, seq, bytes, flag), in post order.
    queue: VecDeque<(Instant, u64, usize, u64)>,
}

impl Delayed {
    pub(crate) fn new(inner: Box<dyn Fabric>, delay: Duration) -> Self {
        Delayed {
            inner,
            delay,
            queue: VecDeque::new(),
        }
    }
}

impl Fabric for Delayed {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn post(&mut self, seq: u64, bytes: usize, flag: u64) -> Result<()> {
        self.queue
            .push_back((Instant::now() + self.delay, seq, bytes, flag));
        Ok(())
    }
    fn progress(&mut self) -> Result<bool> {
        let mut posted = false;
        while let Some(&(due, seq, bytes, flag)) = self.queue.front() {
            if Instant::now() < due {
                break;
            }
            self.queue.pop_front();
            self.inner.post(seq, bytes, flag)?;
            posted = true;
        }
        Ok(self.inner.progress()? || posted)
    }
    fn quiescent(&self) -> bool {
        self.queue.is_empty() && self.inner.quiescent()
    }
    fn completed_through(&self, posted: u64) -> u64 {
        // Only what was handed to the real fabric can have completed.
        let handed = self
            .queue
            .front()
            .map_or(posted, |&(_, seq, _, _)| seq.saturating_sub(1));
        self.inner.completed_through(handed)
    }
    fn tell_departed(&mut self, last: u64) {
        // The proxy drained this fabric first: nothing is queued here
        // (unless the drain ran out of time: those posts never go).
        self.inner.tell_departed(last)
    }
    fn tell_failed(&mut self, seq: u64) {
        // At once: a post still queued here for `seq` may overwrite the
        // poison of `seq` later, not that of `seq + 1`.
        self.inner.tell_failed(seq)
    }
    fn describe(&self) -> String {
        format!(
            "{} (every post delayed by {:?}: {VAR})",
            self.inner.describe(),
            self.delay
        )
    }
    fn inject_fault(&mut self, peer: usize, lane: usize) -> Result<()> {
        self.inner.inject_fault(peer, lane)
    }
    fn needs_collective_close(&self) -> bool {
        self.inner.needs_collective_close()
    }
}
