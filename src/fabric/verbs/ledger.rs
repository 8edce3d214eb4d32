//! Send accounting without a device: the per-QP [`Ledger`] (selective
//! signalling and per-call completion), and how deep a completion queue
//! must be for every WR a failure can flush ([`cq_depth`]).

use super::{RQ_DEPTH, SIGNAL_EVERY, SQ_DEPTH};

/// Most WRs in one chain (a call's data and flag; poisoned flags: 2 calls × 2
/// lanes).
pub(super) const MAX_CHAIN: usize = 4;

/// Entries a completion queue shared by `qps` QPs needs. A QP in error
/// completes every WR it has outstanding (a flush), signalled or not, so the
/// queue must hold every WR that can be outstanding on all of them: the send
/// queue as [`Ledger::has_room`] bounds it, and the receive queue (no receive
/// is ever posted; counted all the same). A full CQ drops completions — the
/// poisoned flags' that tell peers about a failure among them.
pub(super) fn cq_depth(qps: usize) -> usize {
    (qps * (SQ_DEPTH + RQ_DEPTH) as usize).max(16)
}

/// The send accounting of one QP, kept apart from the verbs calls so that
/// it can be tested without a device: WR counts, which WRs to signal, and
/// which call each outstanding WR completes.
///
/// WRs are counted from 1 per QP. The completion of WR `c` (signalled, or
/// flushed by a QP in error) retires every WR up to `c`: RC completes one
/// QP's WRs in order.
#[derive(Debug)]
pub(super) struct Ledger {
    /// WRs ever posted; WRs known complete; count at the last signalled WR.
    posted: u64,
    completed: u64,
    signaled: u64,
    /// Most WRs outstanding (the send queue depth granted, at most
    /// [`SQ_DEPTH`]).
    depth: u64,
    /// The last call with a WR on this QP.
    last_seq: u64,
    /// Every WR of this call and of the calls before it has completed.
    done_seq: u64,
    /// `seq_at[c % depth]`: the call complete on this QP once WR `c`
    /// completes. Unique among outstanding WRs: at most `depth` are.
    seq_at: Box<[u64]>,
}

impl Ledger {
    pub(super) fn new(depth: u64) -> Self {
        let depth = depth.max(1);
        Ledger {
            posted: 0,
            completed: 0,
            signaled: 0,
            depth,
            last_seq: 0,
            done_seq: 0,
            seq_at: vec![0; depth as usize].into_boxed_slice(),
        }
    }

    pub(super) fn outstanding(&self) -> u64 {
        self.posted - self.completed
    }

    /// True if `n` more WRs fit without overfilling the send queue.
    pub(super) fn has_room(&self, n: u64) -> bool {
        self.outstanding() + n <= self.depth
    }

    /// Which WRs of a chain of `len` to signal (bit k: WR k): one every
    /// [`SIGNAL_EVERY`], the one that fills the queue (a full queue must be
    /// able to drain), and the last when `signal_last` (per-call completion,
    /// or a tail that must complete observably).
    pub(super) fn plan(&self, len: usize, signal_last: bool) -> u32 {
        let mut signaled = self.signaled;
        let mut bits = 0;
        for k in 0..len {
            let count = self.posted + k as u64 + 1;
            if count - signaled >= SIGNAL_EVERY
                || count - self.completed >= self.depth
                || (signal_last && k + 1 == len)
            {
                bits |= 1 << k;
                signaled = count;
            }
        }
        bits
    }

    /// Records that the first `n` WRs of a chain of `len` planned as `plan`
    /// were posted. The chain's last WR completes call `seq`; its other WRs
    /// (and every WR of a chain with `seq` None: a re-written flag, poisoned
    /// flags) complete only what this QP had before.
    pub(super) fn commit(&mut self, n: usize, len: usize, plan: u32, seq: Option<u64>) {
        let before = self.last_seq;
        for k in 0..n {
            let count = self.posted + 1;
            let upto = match seq {
                Some(s) if k + 1 == len => s,
                _ => before,
            };
            self.seq_at[(count % self.depth) as usize] = upto;
            if plan & (1 << k) != 0 {
                self.signaled = count;
            }
            self.posted = count;
        }
        if n == len {
            if let Some(s) = seq {
                self.last_seq = s;
            }
        }
    }

    /// WR `count` completed (successfully or flushed): every WR up to it is
    /// retired. Counts not outstanding (stale or foreign) change nothing.
    pub(super) fn complete(&mut self, count: u64) {
        if count > self.completed && count <= self.posted {
            self.completed = count;
            self.done_seq = self.seq_at[(count % self.depth) as usize];
        }
    }

    /// WRs known complete (every WR up to this count).
    pub(super) fn completed(&self) -> u64 {
        self.completed
    }

    /// WRs ever posted on this QP (the count of the last one).
    pub(super) fn posted(&self) -> u64 {
        self.posted
    }

    /// Most WRs outstanding at once.
    pub(super) fn depth(&self) -> u64 {
        self.depth
    }

    /// Every WR of this call and of the calls before it has completed.
    pub(super) fn done_seq(&self) -> u64 {
        self.done_seq
    }

    /// WRs were posted after the last signalled one: they complete
    /// observably only once a later WR is signalled.
    pub(super) fn has_tail(&self) -> bool {
        self.signaled != self.posted
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// A model of one QP on an RC provider: WRs complete in order; a
    /// completion is reported for a signalled WR, or for every WR once the
    /// QP is in error (flush).
    struct Model {
        ledger: Ledger,
        /// (count, call it belongs to or None, signalled) of every WR posted.
        wrs: Vec<(u64, Option<u64>, bool)>,
        /// WRs the "NIC" has executed.
        executed: usize,
        /// The last call whose every WR the NIC has executed.
        truly_done: u64,
    }

    impl Model {
        fn new(depth: u64) -> Self {
            Model {
                ledger: Ledger::new(depth),
                wrs: Vec::new(),
                executed: 0,
                truly_done: 0,
            }
        }

        /// Posts call `seq` (`len` WRs) or, with `seq` None, an extra
        /// chain; false when the queue has no room.
        fn post(&mut self, len: usize, signal_last: bool, seq: Option<u64>) -> bool {
            if !self.ledger.has_room(len as u64) {
                return false;
            }
            let plan = self.ledger.plan(len, signal_last);
            for k in 0..len {
                let count = self.ledger.posted + k as u64 + 1;
                let call = if k + 1 == len { seq } else { None };
                self.wrs.push((count, call, plan & (1 << k) != 0));
            }
            self.ledger.commit(len, len, plan, seq);
            true
        }

        /// The NIC executes `n` more WRs; their completions are reaped.
        fn run(&mut self, n: usize, flushed: bool) {
            let end = self.executed.saturating_add(n).min(self.wrs.len());
            for &(count, call, signalled) in &self.wrs[self.executed..end] {
                // Calls are posted in order, each ending with its WR.
                if let Some(c) = call {
                    self.truly_done = c;
                }
                if signalled || flushed {
                    self.ledger.complete(count);
                }
            }
            self.executed = end;
        }
    }

    #[test]
    fn per_call_signalling_completes_every_call_without_a_flush() {
        let mut m = Model::new(u64::from(SQ_DEPTH));
        for seq in 1..=1000u64 {
            // Calls alternate between data + flag and a flag alone.
            let len = if seq % 3 == 0 { 1 } else { 2 };
            assert!(m.post(len, true, Some(seq)));
            m.run(len, false);
            assert_eq!(m.ledger.done_seq, seq, "call {seq}");
            assert_eq!(m.ledger.outstanding(), 0);
        }
    }

    #[test]
    fn done_seq_never_runs_ahead_of_the_nic() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0xa5c3);
        for signal_last in [false, true] {
            let mut m = Model::new(u64::from(SQ_DEPTH));
            let mut seq = 0;
            for _ in 0..20_000 {
                match rng.gen_range(0..10) {
                    0..=4 => {
                        let len = rng.gen_range(1..=2);
                        if m.post(len, signal_last, Some(seq + 1)) {
                            seq += 1;
                        }
                    }
                    // A re-written flag (tail flush, kick).
                    5 => {
                        m.post(1, true, None);
                    }
                    _ => m.run(rng.gen_range(0..4), false),
                }
                assert!(m.ledger.done_seq <= m.truly_done);
                assert!(m.ledger.outstanding() <= m.ledger.depth);
                if signal_last && m.executed == m.wrs.len() {
                    assert_eq!(m.ledger.done_seq, seq);
                }
            }
            // An idle QP whose tail was flushed has completed everything.
            m.run(usize::MAX, false);
            m.post(1, true, None);
            m.run(1, false);
            assert_eq!(m.ledger.done_seq, seq);
            assert_eq!(m.ledger.outstanding(), 0);
        }
    }

    #[test]
    fn signal_every_16_and_when_filling_the_queue() {
        let mut m = Model::new(u64::from(SQ_DEPTH));
        for seq in 1..=8 {
            m.post(2, false, Some(seq));
        }
        let signalled: Vec<u64> = m.wrs.iter().filter(|w| w.2).map(|w| w.0).collect();
        assert_eq!(signalled, [16]);
        // Nothing completes: the WR that fills the queue is signalled.
        let mut m = Model::new(8);
        for seq in 1..=4 {
            assert!(m.post(2, false, Some(seq)));
        }
        assert!(!m.post(1, false, Some(5)));
        assert!(m.wrs.last().unwrap().2, "the WR filling the queue");
        m.run(8, false);
        assert_eq!((m.ledger.outstanding(), m.ledger.done_seq), (0, 4));
    }

    #[test]
    fn a_flushed_queue_has_nothing_outstanding() {
        let mut m = Model::new(u64::from(SQ_DEPTH));
        let mut seq = 0;
        while m.post(2, false, Some(seq + 1)) {
            seq += 1;
        }
        m.run(5, false);
        assert!(m.ledger.outstanding() > 0);
        // The QP goes to error: every WR left completes (flushed).
        m.run(usize::MAX, true);
        assert_eq!(m.ledger.outstanding(), 0);
        assert_eq!(m.ledger.done_seq, seq);
        // A stale or foreign count changes nothing.
        m.ledger.complete(3);
        m.ledger.complete(u64::MAX);
        assert_eq!(
            (m.ledger.completed, m.ledger.done_seq),
            (m.ledger.posted, seq)
        );
    }

    #[test]
    fn a_partly_posted_chain_counts_what_was_posted() {
        let mut l = Ledger::new(16);
        let plan = l.plan(2, true);
        l.commit(2, 2, plan, Some(1));
        let plan = l.plan(2, true);
        // The provider took the data WR of call 2 but not its flag.
        l.commit(1, 2, plan, Some(2));
        assert_eq!((l.posted, l.last_seq), (3, 1));
        l.complete(3);
        assert_eq!((l.outstanding(), l.done_seq), (0, 1));
    }

    /// Every WR the ledger lets a QP have outstanding gets a completion
    /// when the QP fails (flush): a CQ shared by `qps` QPs must hold them
    /// all, whatever the mix of calls, re-written flags and poisoned flags.
    #[test]
    fn cq_holds_every_wr_that_a_failure_can_flush() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x0cc0);
        // QPs sharing one CQ: a peer per lane, or both lanes on one device,
        // from 2 ranks to the largest world.
        let max_qps = 2 * (crate::abi::ARX_MAX_WORLD as usize - 1);
        for qps in [1, 2, 3, 4, 7, 14, 15, 30, 62, max_qps] {
            let mut worst = 0u64;
            for signal_last in [false, true] {
                let mut models: Vec<Model> =
                    (0..qps).map(|_| Model::new(u64::from(SQ_DEPTH))).collect();
                let mut seq = 0;
                // Post calls until some QP is full, as the proxy does (a
                // call goes to every QP), with a few re-written flags.
                loop {
                    seq += 1;
                    let len = rng.gen_range(1..=2);
                    if !models.iter().all(|m| m.ledger.has_room(len as u64)) {
                        break;
                    }
                    for m in &mut models {
                        assert!(m.post(len, signal_last, Some(seq)));
                        if rng.gen_range(0..20) == 0 {
                            m.post(1, true, None);
                        }
                    }
                }
                // Then a failure: poisoned flags where room is left, and
                // every QP fills up to its limit.
                for m in &mut models {
                    m.post(MAX_CHAIN, true, None);
                    while m.post(1, true, None) {}
                }
                let flushed: u64 = models.iter().map(|m| m.ledger.outstanding()).sum();
                worst = worst.max(flushed);
                assert!(
                    flushed + (qps as u64) * u64::from(RQ_DEPTH) <= cq_depth(qps) as u64,
                    "{qps} QPs: {flushed} completions, CQ of {}",
                    cq_depth(qps)
                );
            }
            // The bound is reached: nothing smaller would do.
            assert_eq!(worst, qps as u64 * u64::from(SQ_DEPTH));
        }
    }
}
