//! The stage trace: where the time of one call goes, measured by the
//! library's own code path (the device side and the proxy record
//! timestamps while [`crate::Arx::trace_stages`] is on), and the
//! rank-order reduction timed alone ([`time_reduction`]).
//!
//! A call's marks, in the order they happen on one rank's clock:
//!
//! ```text
//! entry ─stage─▶ published ─pickup─▶ post begins ─post─▶ posted ─wait─▶ arrived ─reduce─▶ reduced ─tail─▶ end
//! ```
//!
//! * **stage**: the partial copied into `send[seq & 1]` and the call
//!   published (release store of `ctrl.seq`);
//! * **pickup**: publish until the proxy's post of this call begins (the
//!   Host side posts inline under the engine lock, so this is the lock
//!   hand-over; a proxy thread that owned the lock may have posted it);
//! * **post**: the fabric's `post` of this call: for Shm the copies of the
//!   partial into every peer's receive slot and the flag stores; for Verbs
//!   posting the RDMA writes (their wire time is not in it);
//! * **wait**: this rank's post done until the last peer's flag is seen
//!   (the peers' skew, their staging and post, and the wire);
//! * **reduce**: the sum of every partial in rank order, fp32 accumulator;
//! * **tail**: the rest (the done store; copy-engine staging's wait for
//!   this rank's own sends).
//!
//! The stages of one traced call add up to its `whole` exactly (the marks
//! are contiguous); what the trace costs shows as the difference between
//! the whole of traced and untraced calls (`allreduce_perf --stages` prints
//! both). Off, each mark point costs one relaxed load and a predictable
//! branch.
//!
//! The GPU device side publishes, waits and sums in its kernel, where the
//! host clock cannot see: on a GPU instance only **post** (and the proxy's
//! pickup time, unpaired) is recorded; `allreduce_perf --stages` times the
//! kernel with every peer's flags already present by CUDA events instead.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::dtype::{reduce_in_rank_order, Element};

/// A point of a call where the trace takes the time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mark {
    /// The device side entered the (one-slot) call.
    Entry = 0,
    /// The partial is staged and the call published.
    Published,
    /// The proxy's post of the call begins.
    Pickup,
    /// The proxy's post of the call returned.
    Posted,
    /// Every peer's flags of the call were seen.
    Arrived,
    /// The reduction is done.
    Reduced,
    /// The call returns.
    End,
}

const MARKS: usize = Mark::End as usize + 1;

/// The recorder shared by the device side and the proxy of one instance.
///
/// Marks are relaxed stores of (ns since `epoch`, seq): the proxy stores
/// its marks under the engine lock and [`Trace::read`] is called under it
/// (so it sees them whole); the Host side's marks are made by the thread
/// that reads them.
pub(crate) struct Trace {
    on: AtomicBool,
    epoch: Instant,
    ns: [AtomicU64; MARKS],
    seq: [AtomicU64; MARKS],
}

impl Trace {
    pub(crate) fn new() -> Self {
        Trace {
            on: AtomicBool::new(false),
            epoch: Instant::now(),
            ns: std::array::from_fn(|_| AtomicU64::new(0)),
            seq: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// The recorder while tracing is on: the one branch a mark point pays
    /// when it is off. Relaxed: a switch that takes effect from some call
    /// on; no data is read on its account.
    #[inline]
    pub(crate) fn active(&self) -> Option<&Self> {
        if self.on.load(Ordering::Relaxed) {
            Some(self)
        } else {
            None
        }
    }

    pub(crate) fn set(&self, on: bool) {
        // Relaxed: see `active`.
        self.on.store(on, Ordering::Relaxed);
    }

    /// Records `m` of call `seq` now.
    pub(crate) fn mark(&self, m: Mark, seq: u64) {
        let ns = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        // Relaxed: see the type's docs.
        self.ns[m as usize].store(ns, Ordering::Relaxed);
        self.seq[m as usize].store(seq, Ordering::Relaxed);
    }

    /// The stages of the last traced call: the latest call any mark holds
    /// (the device side's end if it recorded one, else the proxy's post).
    /// A stage is present when both of its marks belong to that call.
    pub(crate) fn read(&self) -> Stages {
        let seq_of = |m: Mark| self.seq[m as usize].load(Ordering::Relaxed);
        let ns_of = |m: Mark| self.ns[m as usize].load(Ordering::Relaxed);
        let seq = match seq_of(Mark::End) {
            0 => seq_of(Mark::Posted),
            s => s,
        };
        let span = |a: Mark, b: Mark| {
            (seq != 0 && seq_of(a) == seq && seq_of(b) == seq)
                .then(|| Duration::from_nanos(ns_of(b).saturating_sub(ns_of(a))))
        };
        Stages {
            seq,
            stage: span(Mark::Entry, Mark::Published),
            pickup: span(Mark::Published, Mark::Pickup),
            post: span(Mark::Pickup, Mark::Posted),
            wait: span(Mark::Posted, Mark::Arrived),
            reduce: span(Mark::Arrived, Mark::Reduced),
            tail: span(Mark::Reduced, Mark::End),
            whole: span(Mark::Entry, Mark::End),
        }
    }
}

/// Where the time of one call went on this rank, from the stage trace
/// ([`crate::Arx::trace_stages`], [`crate::Arx::last_stages`]); see the
/// module docs for what each stage covers. `None`: not recorded for this
/// call (the trace was off, or the stage runs in a GPU kernel).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stages {
    /// The call (one slot: a chunk of a longer call) these stages belong
    /// to; 0 when nothing was traced.
    pub seq: u64,
    /// Staging the partial into the send slot and publishing the call.
    pub stage: Option<Duration>,
    /// Publish until the proxy's post of the call begins.
    pub pickup: Option<Duration>,
    /// The proxy's post: Shm, the copies to every peer and the flag
    /// stores; Verbs, posting the RDMA writes.
    pub post: Option<Duration>,
    /// This rank's post done until every peer's flags were seen.
    pub wait: Option<Duration>,
    /// The rank-order reduction of every partial.
    pub reduce: Option<Duration>,
    /// The reduction's end until the call returns.
    pub tail: Option<Duration>,
    /// The whole call, entry to return (the sum of the six stages).
    pub whole: Option<Duration>,
}

impl Stages {
    /// The six stages in call order with their names (as
    /// `allreduce_perf --stages` prints them).
    pub fn named(&self) -> [(&'static str, Option<Duration>); 6] {
        [
            ("stage", self.stage),
            ("pickup", self.pickup),
            ("post", self.post),
            ("wait", self.wait),
            ("reduce", self.reduce),
            ("tail", self.tail),
        ]
    }
}

/// The median time of the reduction the Host device side runs (every
/// rank's partial of `count` elements of `T`, `world` partials, summed in
/// rank order with an fp32 accumulator and rounded once), alone: partials
/// in ordinary memory, no flags, no peers. `iters` timed runs after a few
/// warm-up runs; seeded inputs (`verify::input`).
pub fn time_reduction<T: Element>(world: usize, count: usize, iters: usize) -> Duration {
    let world = world.max(1);
    let parts: Vec<Vec<T>> = (0..world)
        .map(|r| crate::verify::input::<T>(0x57a9e5, 1, r, count))
        .collect();
    let bytes: Vec<&[u8]> = parts.iter().map(|p| bytemuck::cast_slice(p)).collect();
    let mut out = vec![T::from_f32(0.0); count];
    let part = |r: usize, at: usize, dst: &mut [u8]| {
        dst.copy_from_slice(&bytes[r][at..at + dst.len()]);
    };
    let mut times = Vec::with_capacity(iters.max(1));
    for i in 0..iters.max(1) + 3 {
        let t = Instant::now();
        reduce_in_rank_order(crate::Op::Sum, world, part, std::hint::black_box(&mut out));
        if i >= 3 {
            times.push(t.elapsed());
        }
    }
    times.sort();
    times[times.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_of_one_call_make_contiguous_stages_that_sum_to_the_whole() {
        let t = Trace::new();
        assert_eq!(t.read(), Stages::default(), "nothing traced yet");
        for m in [
            Mark::Entry,
            Mark::Published,
            Mark::Pickup,
            Mark::Posted,
            Mark::Arrived,
            Mark::Reduced,
            Mark::End,
        ] {
            t.mark(m, 7);
            crate::spin::sleep(Duration::from_micros(50));
        }
        let s = t.read();
        assert_eq!(s.seq, 7);
        let sum: Duration = s.named().iter().map(|(_, d)| d.unwrap()).sum();
        assert_eq!(Some(sum), s.whole);
        for (name, d) in s.named() {
            assert!(d.unwrap() >= Duration::from_micros(50), "{name}: {d:?}");
        }
    }

    #[test]
    fn a_stage_whose_marks_belong_to_another_call_is_absent() {
        let t = Trace::new();
        // Call 3 on the device side; the proxy already posted call 4 (a
        // GPU instance's kernel may end before its own proxy posted).
        for m in [
            Mark::Entry,
            Mark::Published,
            Mark::Arrived,
            Mark::Reduced,
            Mark::End,
        ] {
            t.mark(m, 3);
        }
        t.mark(Mark::Pickup, 4);
        t.mark(Mark::Posted, 4);
        let s = t.read();
        assert_eq!(s.seq, 3);
        assert!(s.stage.is_some() && s.reduce.is_some() && s.whole.is_some());
        assert_eq!((s.pickup, s.post, s.wait), (None, None, None));

        // Only the proxy's marks (a GPU instance): post alone.
        let t = Trace::new();
        t.mark(Mark::Pickup, 9);
        t.mark(Mark::Posted, 9);
        let s = t.read();
        assert_eq!(s.seq, 9);
        assert!(s.post.is_some());
        assert_eq!((s.stage, s.pickup, s.whole), (None, None, None));
    }

    #[test]
    fn tracing_is_off_until_set() {
        let t = Trace::new();
        assert!(t.active().is_none());
        t.set(true);
        assert!(t.active().is_some());
        t.set(false);
        assert!(t.active().is_none());
    }

    #[test]
    fn the_reduction_alone_takes_time_and_grows_with_its_inputs() {
        let small = time_reduction::<f32>(2, 256, 20);
        let large = time_reduction::<f32>(4, 1 << 16, 5);
        assert!(small > Duration::ZERO, "{small:?}");
        // 512 times the elements: far more than any timer noise.
        assert!(large > small, "small {small:?}, large {large:?}");
    }
}
