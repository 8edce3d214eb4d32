//! Fabrics: how a rank's partial and its flags reach every peer.
//!
//! A fabric is driven by the proxy thread only. For call `seq` (parity
//! `p = seq & 1`) it moves, for every peer `q` in the order `r+1, r+2, …`
//! and for each lane, the lane's part ([`Layout::lane_range`]) of this rank's
//! `send[p]` into `q`'s `recv[p][r]`, then the flag word into `q`'s
//! `flags[p][r][lane]`, such that the flag is never visible before its data.

use crate::error::Result;

pub(crate) mod delayed;
pub(crate) mod shm;
pub(crate) mod verbs;

#[allow(unused_imports)]
pub(crate) use crate::layout::Layout;

/// The departure word a rank that posted every call through `last` writes
/// into its peers ([`Fabric::tell_departed`]): the top bit set (a region
/// starts zeroed: no departure), then `last`.
pub(crate) fn departed_word(last: u64) -> u64 {
    DEPARTED_MARK | (last & !DEPARTED_MARK)
}

/// The last call a departure word's rank posted, or `None` for no
/// departure (see [`departed_word`]).
pub(crate) fn departed_last(word: u64) -> Option<u64> {
    (word & DEPARTED_MARK != 0).then_some(word & !DEPARTED_MARK)
}

const DEPARTED_MARK: u64 = 1 << 63;

/// One transport, driven by the proxy thread.
pub(crate) trait Fabric: Send {
    /// Short name for logs and the perf header ("shm", "verbs").
    fn name(&self) -> &'static str;
    /// Sends call `seq`'s partial (`bytes` bytes of `send[seq & 1]`) and the
    /// flag word `flag` to every peer. Must not wait on remote progress
    /// without bound.
    fn post(&mut self, seq: u64, bytes: usize, flag: u64) -> Result<()>;
    /// Reaps completions; an error names the peer, lane and device. Keeps
    /// reaping after a failure (returning the failure again), so that WRs
    /// flushed by a broken endpoint stop counting as outstanding. `Ok(true)`
    /// when it posted something of its own (a relay's forward, a delayed
    /// post): the proxy then keeps polling hot instead of backing off, as
    /// after posting a call of this rank (a relayed partial is as urgent
    /// as one's own, and a napping proxy would delay the next one).
    fn progress(&mut self) -> Result<bool>;
    /// True when nothing posted is outstanding any more: every write
    /// completed locally, successfully or flushed by a failure.
    fn quiescent(&self) -> bool;
    /// The last call, at most `posted` (the last seq handed to
    /// [`Fabric::post`]), whose every write has completed locally: its send
    /// slot is no longer read and may be overwritten. Fabrics whose `post`
    /// returns only once its writes are done (Shm) return `posted`.
    fn completed_through(&self, posted: u64) -> u64 {
        posted
    }
    /// Tells every peer it can still reach that this rank's device side
    /// timed out in call `seq` (failures of the fabric itself are told by
    /// the fabric):
    /// poisoned flag words (dtype `INVALID`,
    /// [`FAILED_COUNT`](crate::dtype::FAILED_COUNT)) for `seq` and `seq + 1`
    /// on every lane, so that a peer still waiting on this rank fails at
    /// once naming it instead of at its own timeout. Best effort, once per
    /// instance (the proxy); it never makes a peer accept data (no call's
    /// flag word equals a poisoned one).
    fn tell_failed(&mut self, seq: u64);
    /// Tells every peer it links to directly that this rank closes its
    /// instance having posted every call through `last`: the departure
    /// word ([`departed_word`]) into the peer's `departed[rank]`
    /// ([`Layout::departed_offset`]), which only the peer's proxy reads.
    /// A peer's proxy that finds it while its device side waits for a later
    /// call fails that call at once, naming this rank
    /// (`CallKind::Departed`), instead of at its timeout. Called once, by
    /// `Proxy::depart`, after the proxy thread drained and stopped, and
    /// never on a failed fabric (whose poison told the peers already). A
    /// peer reached only through a relay is not told directly: the relay's
    /// proxy poisons the flag in its own region once it waits for that call
    /// itself, and forwards it like any flag; otherwise the peer times out.
    /// Best effort: the caller waits, bounded, for [`Fabric::quiescent`].
    fn tell_departed(&mut self, last: u64);
    /// One line describing the fabric (devices, GIDs, MTU, segment).
    fn describe(&self) -> String;
    /// Puts the endpoint to `peer` on `lane` into an error state (fault
    /// injection for tests: the next send there fails).
    fn inject_fault(&mut self, peer: usize, lane: usize) -> Result<()> {
        Err(crate::error::Error::Unavailable {
            what: "fault injection",
            reason: format!(
                "the {} fabric has no endpoint to break (peer {peer}, lane {lane})",
                self.name()
            ),
        })
    }
    /// Measures every rail and lane to every directly linked peer (see
    /// [`crate::probe`]). Collective; only while no call is in flight (the
    /// proxy holds the engine lock throughout, so nothing is posted
    /// meanwhile).
    fn probe_rails(
        &mut self,
        opts: &crate::probe::ProbeOptions,
    ) -> Result<Vec<crate::probe::RailProbe>> {
        let _ = opts;
        Err(crate::error::Error::Unavailable {
            what: "rail probe",
            reason: format!("no rails: the {} fabric has none", self.name()),
        })
    }
    /// True when tearing down this rank's endpoints could fail a peer's
    /// sends still awaiting acknowledgement (RC queue pairs): the instance
    /// then closes collectively (drain, barrier, destroy).
    fn needs_collective_close(&self) -> bool {
        false
    }
}

/// A fabric for unit tests of the proxy and the device sides: posts go
/// nowhere, and the test decides how far they have completed.
#[cfg(test)]
pub(crate) mod fake {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    use super::Fabric;
    use crate::error::{Error, Result};

    /// What a test controls: the last call completed locally, and whether
    /// posting fails from some call on.
    #[derive(Default)]
    pub(crate) struct Control {
        /// Calls up to this one have completed locally.
        pub completed: AtomicU64,
        /// `post` of this call (and later) fails; 0: never.
        pub fail_at: AtomicU64,
        /// The next `progress` reports work of its own (as a relay's
        /// forward), once.
        pub work: AtomicBool,
        /// The call `tell_failed` was given (0: not called).
        pub told: AtomicU64,
        /// The departure word `tell_departed` was given (0: not called).
        pub departed: AtomicU64,
    }

    pub(crate) struct FakeFabric {
        pub control: Arc<Control>,
        posted: u64,
    }

    impl FakeFabric {
        pub(crate) fn new() -> (Self, Arc<Control>) {
            let control = Arc::new(Control::default());
            (
                FakeFabric {
                    control: Arc::clone(&control),
                    posted: 0,
                },
                control,
            )
        }
    }

    /// Rank 0 of 2 (slots of `slot_bytes`) with a running proxy over a fake
    /// fabric, settings from `o`: the region, its layout, the settings, the
    /// fabric's control and the proxy.
    pub(crate) fn proxy_rig(
        slot_bytes: usize,
        o: &crate::config::Overrides,
    ) -> (
        Arc<crate::layout::Region>,
        crate::layout::Layout,
        crate::config::Config,
        Arc<Control>,
        crate::proxy::Proxy,
    ) {
        let layout = crate::layout::Layout::new(2, 0, slot_bytes).unwrap();
        let region = Arc::new(crate::layout::Region::anonymous(layout.region_bytes()).unwrap());
        let cfg = crate::config::Config::resolve_with(o, |_| None).unwrap();
        let (fabric, control) = FakeFabric::new();
        let proxy = crate::proxy::Proxy::start(
            Box::new(fabric),
            Arc::clone(&region),
            layout,
            &cfg,
            None,
            &[],
        )
        .unwrap();
        (region, layout, cfg, control, proxy)
    }

    impl Fabric for FakeFabric {
        fn name(&self) -> &'static str {
            "fake"
        }
        fn post(&mut self, seq: u64, _bytes: usize, _flag: u64) -> Result<()> {
            let fail_at = self.control.fail_at.load(Ordering::Acquire);
            if fail_at != 0 && seq >= fail_at {
                return Err(Error::Proxy(format!("fake post of call {seq} failed")));
            }
            self.posted = seq;
            Ok(())
        }
        fn progress(&mut self) -> Result<bool> {
            // A test's "work": one report per request.
            Ok(self.control.work.swap(false, Ordering::AcqRel))
        }
        fn quiescent(&self) -> bool {
            self.control.completed.load(Ordering::Acquire) >= self.posted
        }
        fn completed_through(&self, posted: u64) -> u64 {
            posted.min(self.control.completed.load(Ordering::Acquire))
        }
        fn tell_failed(&mut self, seq: u64) {
            self.control.told.store(seq, Ordering::Release);
        }
        fn tell_departed(&mut self, last: u64) {
            self.control
                .departed
                .store(super::departed_word(last), Ordering::Release);
        }
        fn describe(&self) -> String {
            "fake".into()
        }
    }
}
