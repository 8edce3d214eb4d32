//! The models: threads playing the ranks' device sides and proxies over
//! [`Rank`] regions, calling the library's own protocol steps.
//!
//! Each model checks, in every interleaving loom explores: no payload access
//! races (loom's `UnsafeCell`), every call that completes read exactly the
//! partials of that call (bytes compared), and failures (refused calls,
//! poisoned flags) end the call with an error naming the peer, never with a
//! result. A thread that could wait forever makes loom give up the model
//! (its branch limit), so a lost wake-up fails too.

use loom::thread;
use std::sync::Arc;

use crate::abi;
use crate::protocol::{self, flag_call, flag_seq, flag_word, Look, Memory};
use crate::region::{Rank, Weaken, BYTES};
use crate::sync::atomic::Ordering;

const DTYPE: u32 = abi::ARX_DTYPE_F32;
const COUNT: usize = BYTES / 4;
/// The count of a poisoned flag word (`dtype::POISON_COUNT` in the library).
const POISON_COUNT: usize = abi::ARX_FLAG_POISON_COUNT as usize;

/// The preemption bound of every model, unless `LOOM_MAX_PREEMPTIONS` says
/// otherwise: enough for each protocol step of one thread to be interrupted
/// by another thread's step twice, and what keeps the models within CI's
/// budget (see docs/AARCH64.md for the numbers).
const PREEMPTIONS: usize = 2;

fn check(f: impl Fn() + Sync + Send + 'static) {
    check_bounded(PREEMPTIONS, f)
}

/// [`check`] with another default preemption bound.
fn check_bounded(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(preemptions);
    }
    b.check(f);
}

/// Rank `rank`'s partial of call `seq`: never zero, distinct for every
/// rank and call of the models (so a slot holding call seq - 2's bytes or
/// another rank's is seen).
fn partial(rank: usize, seq: u64) -> [u8; BYTES] {
    std::array::from_fn(|i| ((rank * 61 + seq as usize * 17 + i * 7) % 255 + 1) as u8)
}

/// How one call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Every partial arrived and was read (and checked).
    Ok,
    /// A peer's flag carried another word for this call.
    Mismatch { seq: u64, peer: usize, word: u64 },
    /// The abort word was raised.
    Aborted { seq: u64 },
}

fn ranks(world: usize, weaken: Weaken) -> Arc<Vec<Rank>> {
    Arc::new((0..world).map(|r| Rank::new(world, r, weaken)).collect())
}

/// The peers of `me` in the library's order (`Layout::peers`).
fn peers(ranks: &[Rank], me: usize) -> impl Iterator<Item = (usize, &Rank)> {
    let world = ranks.len();
    (1..world).map(move |k| ((me + k) % world, &ranks[(me + k) % world]))
}

/// The proxy's `Shared::pump` with the Shm fabric (whose post returns once
/// its copies are done, so a posted call is a sent call): posts every call
/// published and not yet posted, in order. Returns true if it posted any.
fn pump(ranks: &[Rank], me: usize, posted: &mut u64) -> bool {
    let m = &ranks[me];
    let published = protocol::published(m);
    let busy = *posted < published;
    while *posted < published {
        let seq = *posted + 1;
        let (flag, bytes) = protocol::announced(m, seq);
        assert_eq!(
            flag_seq(flag),
            seq as u32,
            "rank {me}'s proxy read a stale flag word (call {}'s) for call {seq}",
            flag_seq(flag)
        );
        // SAFETY: call seq is published and every earlier call was posted.
        unsafe {
            protocol::post_shm(
                &m,
                me,
                ranks.len(),
                peers(ranks, me),
                seq,
                bytes as usize,
                flag,
            )
        };
        *posted = seq;
        protocol::release_sent(m, seq);
    }
    busy
}

/// What one step of a thread's work did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Something changed (a call published, posted, a flag taken).
    Progress,
    /// Waiting: nothing it waits for has happened yet.
    Blocked,
    /// Its work is over.
    Done,
}

/// A rank's proxy thread: posts calls until it has posted `calls`.
struct Proxy {
    me: usize,
    calls: u64,
    posted: u64,
}

impl Proxy {
    fn new(me: usize, calls: u64) -> Self {
        Proxy {
            me,
            calls,
            posted: 0,
        }
    }

    fn step(&mut self, ranks: &[Rank]) -> Step {
        if self.posted >= self.calls {
            Step::Done
        } else if pump(ranks, self.me, &mut self.posted) {
            Step::Progress
        } else {
            Step::Blocked
        }
    }
}

/// How a device side stages its partial.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Staging {
    /// Into send[p], then publish (SM staging; the Host side).
    Sm,
    /// Into BOTH send slots, then publish, and the call ends only once
    /// `ctrl.sent` covers it (copy-engine staging, kernels/oneshot.cuh).
    Copy,
}

/// Where a device side is in its current call.
#[derive(Debug)]
enum Phase {
    Publish,
    /// The (peer, lane) flags still missing, in `Layout::peers` order.
    Wait(Vec<(usize, usize)>),
    /// Copy-engine staging: waiting for `ctrl.sent` to cover the call.
    Sent,
    Done,
}

/// A rank's device side making calls 1..=calls: the steps of
/// `algo::oneshot::host` (stage and publish; post inline if `inline`, as
/// the Host side's `link.pump(true)`; wait for both lanes of every peer,
/// each round looking at every flag still missing; read every partial and
/// compare it with the expected bytes). A refused call (`refuse_at`) is
/// announced as `Device::refuse_host` does and ends the device's calls;
/// so does a failed call.
struct Device {
    me: usize,
    calls: u64,
    staging: Staging,
    inline: bool,
    /// Whether peers' flags are waited for (false: the peers only receive).
    wait_peers: bool,
    refuse_at: Option<u64>,
    seq: u64,
    phase: Phase,
    /// Posted inline so far.
    posted: u64,
    out: Vec<Outcome>,
}

impl Device {
    fn new(me: usize, calls: u64) -> Self {
        Device {
            me,
            calls,
            staging: Staging::Sm,
            inline: false,
            wait_peers: true,
            refuse_at: None,
            seq: 1,
            phase: Phase::Publish,
            posted: 0,
            out: Vec::new(),
        }
    }

    fn next_call(&mut self) {
        self.seq += 1;
        self.phase = if self.seq > self.calls {
            Phase::Done
        } else {
            Phase::Publish
        };
    }

    fn end(&mut self, o: Outcome) -> Step {
        self.out.push(o);
        self.phase = Phase::Done;
        Step::Progress
    }

    fn step(&mut self, ranks: &[Rank]) -> Step {
        let (me, seq) = (self.me, self.seq);
        let m = &ranks[me];
        let flag = flag_word(seq, DTYPE, COUNT);
        match &mut self.phase {
            Phase::Done => Step::Done,
            Phase::Publish => {
                if self.refuse_at == Some(seq) {
                    let word = flag_word(seq, abi::ARX_DTYPE_INVALID, COUNT);
                    protocol::publish(m, seq, word, 0);
                    if self.inline {
                        pump(ranks, me, &mut self.posted);
                    }
                    self.phase = Phase::Done;
                    return Step::Progress;
                }
                match self.staging {
                    // SAFETY: send[p] is ours: call seq - 2 reached every
                    // peer (rule 5).
                    Staging::Sm => unsafe {
                        protocol::stage_and_publish(m, seq, flag, &partial(me, seq))
                    },
                    Staging::Copy => {
                        // SAFETY: `sent` covers call seq - 1: the proxy
                        // reads neither slot any more.
                        unsafe {
                            m.write_send(0, 0, &partial(me, seq));
                            m.write_send(1, 0, &partial(me, seq));
                        }
                        protocol::publish(m, seq, flag, BYTES);
                    }
                }
                if self.inline {
                    pump(ranks, me, &mut self.posted);
                }
                self.phase = if self.wait_peers {
                    let world = ranks.len();
                    Phase::Wait(
                        (1..world)
                            .flat_map(|k| (0..2).map(move |lane| ((me + k) % world, lane)))
                            .collect(),
                    )
                } else {
                    Phase::Sent
                };
                Step::Progress
            }
            Phase::Wait(missing) => {
                let before = missing.len();
                let mut i = 0;
                while i < missing.len() {
                    let (q, lane) = missing[i];
                    match protocol::look(m, seq, flag, q, lane) {
                        Look::Missing(_) => i += 1,
                        Look::Arrived => {
                            missing.remove(i);
                        }
                        Look::Mismatch(word) => {
                            return self.end(Outcome::Mismatch { seq, peer: q, word })
                        }
                    }
                }
                if !missing.is_empty() {
                    if protocol::aborted(m) {
                        return self.end(Outcome::Aborted { seq });
                    }
                    return if missing.len() < before {
                        Step::Progress
                    } else {
                        Step::Blocked
                    };
                }
                let p = protocol::parity(seq);
                for src in 0..ranks.len() {
                    let mut got = [0u8; BYTES];
                    // SAFETY: every peer's flags of this call were acquired.
                    unsafe { m.read_partial(p, src, 0, &mut got) };
                    assert_eq!(
                        got,
                        partial(src, seq),
                        "rank {me}, call {seq}: rank {src}'s partial"
                    );
                }
                self.out.push(Outcome::Ok);
                if self.staging == Staging::Copy {
                    self.phase = Phase::Sent;
                } else {
                    self.next_call();
                }
                Step::Progress
            }
            Phase::Sent => {
                if protocol::sent_through(m) < seq {
                    return Step::Blocked;
                }
                if !self.wait_peers {
                    self.out.push(Outcome::Ok);
                }
                self.next_call();
                Step::Progress
            }
        }
    }
}

/// One model thread's work.
enum Work {
    Device(Device),
    Proxy(Proxy),
}

impl Work {
    fn step(&mut self, ranks: &[Rank]) -> Step {
        match self {
            Work::Device(d) => d.step(ranks),
            Work::Proxy(p) => p.step(ranks),
        }
    }
}

/// Rounds a thread may find itself blocked in a row (yielding between
/// them) before it stops and leaves the rest of its work to the end of
/// the execution (see [`run`]).
const SPINS: usize = 0;

/// Runs every piece of `work` on a thread of its own, then, once all have
/// stopped, finishes what is left on this thread, and checks that no
/// device side would wait for ever.
///
/// Why threads stop when blocked instead of spinning: loom cannot explore
/// several threads that spin at once (its scheduler alternates between the
/// spinners without bound, tokio-rs/loom#53). So a thread that finds
/// nothing to do for more than [`SPINS`] rounds in a row stops, and once
/// every thread has ended (so every write is visible), this thread runs
/// the remaining steps of every piece in turn until none progresses. Races
/// and wrong bytes are found while threads overlap; a wait that nothing
/// can end (a lost or overwritten flag) is found at the end: some device
/// side is not done.
fn run(ranks: &Arc<Vec<Rank>>, work: Vec<Work>) -> Vec<Work> {
    run_with(ranks, work, None)
}

/// [`run`], with one more thread (started by the caller, doing work of its
/// own) joined before the rest is finished.
fn run_with(
    ranks: &Arc<Vec<Rank>>,
    work: Vec<Work>,
    other: Option<thread::JoinHandle<()>>,
) -> Vec<Work> {
    let threads: Vec<_> = work
        .into_iter()
        .map(|mut w| {
            let ranks = Arc::clone(ranks);
            thread::spawn(move || {
                let mut blocked = 0;
                loop {
                    match w.step(&ranks) {
                        Step::Done => break,
                        Step::Progress => blocked = 0,
                        Step::Blocked if blocked == SPINS => break,
                        Step::Blocked => {
                            blocked += 1;
                            thread::yield_now();
                        }
                    }
                }
                w
            })
        })
        .collect();
    let mut work: Vec<Work> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    if let Some(t) = other {
        t.join().unwrap();
    }
    loop {
        let mut progress = false;
        for w in work.iter_mut() {
            while w.step(ranks) == Step::Progress {
                progress = true;
            }
        }
        if !progress {
            break;
        }
    }
    for w in &work {
        if let Work::Device(d) = w {
            assert!(
                matches!(d.phase, Phase::Done),
                "rank {} would wait for ever in call {} ({:?}); its calls ended {:?}",
                d.me,
                d.seq,
                d.phase,
                d.out
            );
        }
    }
    work
}

/// The outcomes of every device side in `work`, in order.
fn outcomes(work: &[Work]) -> Vec<Vec<Outcome>> {
    work.iter()
        .filter_map(|w| match w {
            Work::Device(d) => Some(d.out.clone()),
            Work::Proxy(_) => None,
        })
        .collect()
}

/// Two ranks, each with a device thread and a proxy thread (publish →
/// proxy → flag → reader), three calls: call 3 reuses call 1's slots and
/// flags (parity reuse: seq and seq + 2).
fn two_ranks_handoff(weaken: Weaken) {
    let calls = 3;
    check(move || {
        let ranks = ranks(2, weaken);
        let work = (0..2)
            .flat_map(|me| {
                [
                    Work::Device(Device::new(me, calls)),
                    Work::Proxy(Proxy::new(me, calls)),
                ]
            })
            .collect();
        let work = run(&ranks, work);
        assert_eq!(outcomes(&work), vec![vec![Outcome::Ok; calls as usize]; 2]);
    });
}

#[test]
fn publish_proxy_flag_reader_two_ranks_three_calls() {
    two_ranks_handoff(Weaken::default());
}

/// Two ranks, each one thread that posts inline right after publishing
/// (the Host device side), three calls.
#[test]
fn two_ranks_posting_inline_three_calls() {
    inline(2, 3, None);
}

/// Three ranks posting inline, one call: every rank receives from two
/// senders and sends to two peers in turn (`r+1, r+2`). One call only: with
/// three threads the model grows fast (the numbers are in docs/AARCH64.md).
#[test]
fn three_ranks_posting_inline_one_call() {
    inline(3, 1, Some(1));
}

/// `world` ranks, each one thread posting inline, `calls` calls, under
/// `preemptions` (default: [`PREEMPTIONS`]).
fn inline(world: usize, calls: u64, preemptions: Option<usize>) {
    let f = move || {
        let ranks = ranks(world, Weaken::default());
        let work = (0..world)
            .map(|me| {
                Work::Device(Device {
                    inline: true,
                    ..Device::new(me, calls)
                })
            })
            .collect();
        let work = run(&ranks, work);
        assert_eq!(
            outcomes(&work),
            vec![vec![Outcome::Ok; calls as usize]; world]
        );
    };
    match preemptions {
        Some(p) => check_bounded(p, f),
        None => check(f),
    }
}

/// Copy-engine staging: rank 0's device side copies each call's partial
/// into BOTH send slots before publishing it and ends the call only once
/// the proxy's `ctrl.sent` covers it. Rank 1 only receives; what it
/// received is checked at the end.
fn copy_staging(weaken: Weaken) {
    check(move || {
        const CALLS: u64 = 3;
        let ranks = ranks(2, weaken);
        let work = vec![
            Work::Device(Device {
                staging: Staging::Copy,
                wait_peers: false,
                ..Device::new(0, CALLS)
            }),
            Work::Proxy(Proxy::new(0, CALLS)),
        ];
        let work = run(&ranks, work);
        assert_eq!(outcomes(&work), [[Outcome::Ok; CALLS as usize]]);
        for seq in CALLS - 1..=CALLS {
            let mut got = [0u8; BYTES];
            // SAFETY: every thread has ended.
            unsafe { ranks[1].read_partial(protocol::parity(seq), 0, 0, &mut got) };
            assert_eq!(got, partial(0, seq), "rank 1 received call {seq}");
        }
    });
}

#[test]
fn copy_staging_overwrites_slots_only_after_sent() {
    copy_staging(Weaken::default());
}

/// Rank 1 refuses call 3 (`Device::refuse_host`: dtype INVALID, no data),
/// the call that reuses call 1's parity: rank 0 must fail call 3 naming
/// rank 1 and its refused call, after two correct calls.
#[test]
fn a_refused_call_fails_the_peer_at_once() {
    check(|| {
        let ranks = ranks(2, Weaken::default());
        let work = (0..2)
            .flat_map(|me| {
                [
                    Work::Device(Device {
                        refuse_at: (me == 1).then_some(3),
                        ..Device::new(me, 3)
                    }),
                    Work::Proxy(Proxy::new(me, 3)),
                ]
            })
            .collect();
        let work = run(&ranks, work);
        let refused = flag_word(3, abi::ARX_DTYPE_INVALID, COUNT);
        assert_eq!(
            outcomes(&work),
            [
                vec![
                    Outcome::Ok,
                    Outcome::Ok,
                    Outcome::Mismatch {
                        seq: 3,
                        peer: 1,
                        word: refused
                    }
                ],
                vec![Outcome::Ok; 2]
            ]
        );
    });
}

/// Rank 1's fabric fails in call 2 after lane 0's part and flag reached
/// rank 0; as the Verbs fabric does, it then writes poisoned flags (dtype
/// INVALID, count `POISON_COUNT`) for calls 2 and 3 on both lanes, in order
/// after its earlier writes (one RC QP: modelled by Release stores). Rank 0
/// (posting inline) must end with an error naming rank 1's poisoned flag,
/// whatever it had read of call 1 by then (call 1 ends correct or failed,
/// never wrong), and no call may wait for ever.
#[test]
fn poisoned_flags_fail_the_peer_at_once() {
    check(|| {
        let ranks = ranks(2, Weaken::default());
        // SAFETY: no thread runs yet.
        unsafe {
            ranks[1].write_send(1, 0, &partial(1, 1));
            ranks[1].write_send(0, 0, &partial(1, 2));
        }
        let a = Arc::clone(&ranks);
        let failing = thread::spawn(move || {
            let (m, peer) = (&a[1], &a[0]);
            let word = |s: u64| flag_word(s, DTYPE, COUNT);
            // SAFETY: the slots were staged before the threads started;
            // rank 0 reads them only after the flags.
            unsafe {
                protocol::post_shm(&m, 1, 2, [(0, peer)], 1, BYTES, word(1));
                m.copy_send(0, protocol::lane_range(BYTES, 0), peer, 1);
            }
            peer.flag(0, 1, 0).store(word(2), Ordering::Release);
            for s in [2, 3] {
                let poison = flag_word(s, abi::ARX_DTYPE_INVALID, POISON_COUNT);
                for lane in 0..2 {
                    peer.flag(protocol::parity(s), 1, lane)
                        .store(poison, Ordering::Release);
                }
            }
        });
        let work = vec![Work::Device(Device {
            inline: true,
            ..Device::new(0, 2)
        })];
        // `run` finishes rank 0's calls only after its own threads; the
        // failing rank may still be writing then: join it first.
        let work = run_with(&ranks, work, Some(failing));
        let out = &outcomes(&work)[0];
        match out.last() {
            Some(&Outcome::Mismatch { peer: 1, word, .. }) => {
                assert_eq!(
                    (
                        flag_call(word).0,
                        word as usize & abi::ARX_FLAG_COUNT_MASK as usize
                    ),
                    (abi::ARX_DTYPE_INVALID, POISON_COUNT),
                    "{out:?}"
                );
            }
            other => panic!("rank 0 ended with {other:?}, not rank 1's poisoned flag ({out:?})"),
        }
    });
}

/// Two failures recorded at once (`status::record`, the kernel's
/// `arx_fail`) while another thread reads (`status::error`): the first
/// claim wins, and a reader that sees a code sees that failure's details.
fn status_record(weaken: Weaken) {
    use crate::protocol::{record, recorded, Recorded};
    check(move || {
        let r = Arc::new(Rank::new(1, 0, weaken));
        let fail = |code, peer, seq| Recorded {
            code,
            peer,
            lane: peer + 1,
            seq,
            flag: flag_word(seq, DTYPE, peer as usize),
        };
        let a = fail(abi::ARX_STATUS_TIMEOUT, 3, 11);
        let b = fail(abi::ARX_STATUS_MISMATCH, 5, 12);
        let threads: Vec<_> = [a, b]
            .into_iter()
            .map(|f| {
                let r = Arc::clone(&r);
                thread::spawn(move || record(&*r, f.code, f.peer, f.lane, f.seq, f.flag))
            })
            .collect();
        let seen = loop {
            if let Some(s) = recorded(&*r) {
                break s;
            }
            thread::yield_now();
        };
        assert!(
            seen == a || seen == b,
            "read {seen:?}: a code with another failure's details"
        );
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(recorded(&*r), Some(seen), "the first failure stays");
    });
}

#[test]
fn a_recorded_failure_is_read_whole() {
    status_record(Weaken::default());
}

// Each ordering the models depend on, weakened to Relaxed: the model fails.

/// Runs a model that must fail, and checks that it failed for one of the
/// `reasons` (loom's "Causality violation" for a race on the payload, or
/// one of the models' own assertions).
fn fails(what: &str, model: impl FnOnce(), reasons: &[&str]) {
    let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(model))
        .expect_err(&format!("the model passed with {what}"));
    let msg = e
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| e.downcast_ref::<&str>().copied())
        .unwrap_or("(no message)");
    assert!(
        reasons.iter().any(|r| msg.contains(r)),
        "with {what} the model failed, but not for {reasons:?}: {msg}"
    );
    println!(
        "{what}: the model failed as it must: {}",
        msg.lines().next().unwrap_or("")
    );
}

const RACE: &str = "Causality violation";

#[test]
fn weakened_flag_store_is_caught() {
    let w = Weaken {
        flag_store: true,
        ..Weaken::default()
    };
    fails("Relaxed flag stores", || two_ranks_handoff(w), &[RACE]);
}

#[test]
fn weakened_flag_load_is_caught() {
    let w = Weaken {
        flag_load: true,
        ..Weaken::default()
    };
    fails("Relaxed flag loads", || two_ranks_handoff(w), &[RACE]);
}

#[test]
fn weakened_seq_store_is_caught() {
    let w = Weaken {
        seq_store: true,
        ..Weaken::default()
    };
    // The proxy copies a partial still being staged, or reads the flag
    // word of an older call: either is found first, depending on loom's
    // order of exploration.
    fails(
        "a Relaxed store of ctrl.seq",
        || two_ranks_handoff(w),
        &[RACE, "stale flag word"],
    );
}

#[test]
fn weakened_sent_store_is_caught() {
    let w = Weaken {
        sent_store: true,
        ..Weaken::default()
    };
    fails("a Relaxed store of ctrl.sent", || copy_staging(w), &[RACE]);
}

#[test]
fn weakened_status_store_is_caught() {
    let w = Weaken {
        status_store: true,
        ..Weaken::default()
    };
    fails(
        "a Relaxed store of ctrl.status",
        || status_record(w),
        &["another failure's details"],
    );
}

/// The Shm fabric's copy crew (`fabric::shm`): rank 1's partial is posted
/// by two threads, in pieces of 8 bytes (two per lane), each lane's pieces
/// split between the threads, and the last thread to finish a lane's
/// pieces stores its flag (`protocol::post_piece`). Rank 0 reads each lane
/// once its flag is there: every byte must be call 1's, whichever thread
/// copied it. `left_weak`: the count of unfinished pieces is Relaxed.
fn crew(left_weak: bool) {
    check(move || {
        let ranks = ranks(2, Weaken::default());
        let flag = flag_word(1, DTYPE, COUNT);
        let want = partial(1, 1);
        let p = protocol::parity(1);
        // SAFETY: staged before the threads start.
        unsafe { ranks[1].write_send(p, 0, &want) };
        let (pieces, per_unit) = protocol::split_post(1, 2, &[0], BYTES, flag, BYTES, 8);
        assert_eq!(pieces.len(), 4);
        assert_eq!(per_unit, vec![2, 2]);
        let weak = crate::sync::atomic::Weak {
            loads: left_weak,
            stores: left_weak,
        };
        let left: Arc<Vec<crate::sync::atomic::AtomicU32>> = Arc::new(
            per_unit
                .iter()
                .map(|&n| crate::sync::atomic::AtomicU32::weakened(n, weak))
                .collect(),
        );
        let pieces = Arc::new(pieces);
        let abandoned = Arc::new(crate::sync::atomic::AtomicU32::new(0));
        // Thread A copies pieces 0 and 3, thread B pieces 1 and 2: each
        // lane has one piece from each.
        let copiers: Vec<_> = [[0usize, 3], [1, 2]]
            .into_iter()
            .map(|mine| {
                let (ranks, pieces, left, abandoned) = (
                    Arc::clone(&ranks),
                    Arc::clone(&pieces),
                    Arc::clone(&left),
                    Arc::clone(&abandoned),
                );
                thread::spawn(move || {
                    for i in mine {
                        let pc = &pieces[i];
                        // SAFETY: the partial was staged before; each piece is
                        // copied once; rank 0 reads only after the flag.
                        unsafe {
                            protocol::post_piece(
                                &ranks[1],
                                1,
                                &ranks[0],
                                pc,
                                flag,
                                &left[pc.unit],
                                &abandoned,
                            )
                        };
                    }
                })
            })
            .collect();
        let m = &ranks[0];
        for lane in 0..2 {
            while protocol::look(m, 1, flag, 1, lane) != Look::Arrived {
                thread::yield_now();
            }
            let r = protocol::lane_range(BYTES, lane);
            let mut got = vec![0u8; r.len()];
            // SAFETY: the lane's flag was acquired.
            unsafe { m.read_partial(p, 1, r.start, &mut got) };
            assert_eq!(got, want[r].to_vec(), "lane {lane}: not call 1's bytes");
        }
        for c in copiers {
            c.join().unwrap();
        }
    });
}

#[test]
fn a_crew_of_two_posts_one_partial() {
    crew(false);
}

#[test]
fn weakened_piece_count_is_caught() {
    fails(
        "a Relaxed count of unfinished pieces",
        || crew(true),
        &[RACE],
    );
}
