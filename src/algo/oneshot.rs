//! The one-shot all-reduce on the host device side: the protocol of
//! `kernels/arx_abi.h`, run by the calling thread on host slices. (Its GPU
//! twin is `kernels/oneshot.cuh`.)
//!
//! Every rank's partial goes to every peer (the proxy posts it), and every
//! rank sums all partials in rank order with an fp32 accumulator, rounding
//! once. A failure is recorded in the control block (`ctrl.status` and the
//! `err_*` words) exactly as the kernel records it, and translated by the
//! one translator, `device::status`.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::abi;
use crate::algo::chunked;
use crate::device::status;
use crate::dtype::{reduce_in_rank_order, Element};
use crate::error::Result;
use crate::layout::{Layout, Placed, Region};
use crate::protocol::{self, Look, Memory};
use crate::proxy::Link;
use crate::spin::{self, Backoff};
use crate::stages::Mark;
use crate::{Config, Staging};

/// What one call needs: the instance's region, layout, settings and proxy.
pub(crate) struct Env<'a> {
    pub region: &'a Region,
    pub layout: &'a Layout,
    pub cfg: &'a Config,
    pub link: &'a Link,
}

impl Env<'_> {
    /// Records a failure the way the kernel does and returns its error.
    pub(crate) fn fail(
        &self,
        code: u32,
        peer: usize,
        lane: u32,
        seq: u64,
        flag: u64,
    ) -> crate::Error {
        status::record(self.region, code, peer as u32, lane, seq, flag);
        status::error(self.region, self.layout, self.link).unwrap_or_else(|| crate::Error::Kernel {
            seq,
            detail: "a failure was recorded but cannot be read back".into(),
        })
    }
}

/// Words of the arrived-flags bit set: two lanes for each of at most
/// `ARX_MAX_WORLD - 1` peers (kept on the stack: no allocation per call).
const FLAG_SET_WORDS: usize = (2 * crate::abi::ARX_MAX_WORLD as usize).div_ceil(64);

/// Runs one call: publish, wait for every peer's flags, reduce by `op` in
/// rank order.
///
/// `input` None means in place (the partial is read from `output`). `more`:
/// this call is a chunk of a longer call and more chunks follow (announced
/// in the flag word, see `algo::chunked`); `output` is at most one slot.
pub(crate) fn host<T: Element>(
    env: &Env<'_>,
    seq: u64,
    input: Option<&[T]>,
    output: &mut [T],
    more: bool,
    op: crate::Op,
) -> Result<()> {
    let Env {
        region,
        layout,
        cfg,
        link,
    } = *env;
    let world = layout.world();
    let count = output.len();
    let bytes = std::mem::size_of_val(output);
    let p = protocol::parity(seq);
    let mem = Placed { region, layout };
    let more = if more { abi::ARX_FLAG_MORE } else { 0 };
    let flag = protocol::flag_word_op(
        seq,
        T::DTYPE.code(),
        op.code(),
        chunked::count_field(count, more),
    );

    // The stage trace (`crate::stages`): one predictable branch when off.
    let trace = link.trace();
    if let Some(t) = trace {
        t.mark(Mark::Entry, seq);
    }
    // 1. Stage the partial, announce the call, publish seq (release).
    let src: &[u8] = match input {
        Some(i) => bytemuck::cast_slice(i),
        None => bytemuck::cast_slice(output),
    };
    // SAFETY: send[p] is ours again: its last use, call seq-2, reached
    // every peer before that peer could end seq-2 and send the seq-1 flag
    // this rank needed to end seq-1. `src` is the caller's memory; the
    // chunking (`algo::chunked`) bounds its length by the slot.
    unsafe { mem.write_send(p, protocol::data_base(flag, layout.slot_bytes()), src) };
    // Marked just before the publish, not after: once `seq` is stored the
    // proxy thread may pick the call up (and mark its pickup) before this
    // thread runs again, and the stages would overlap.
    if let Some(t) = trace {
        t.mark(Mark::Published, seq);
    }
    protocol::publish(&mem, seq, flag, src.len());
    // Post it from this thread rather than waking the proxy (same order:
    // posting is serialised by the engine lock).
    link.pump(true);

    // 2. Wait for both lanes of every peer, bounded.
    wait_flags(env, seq, flag)?;
    if let Some(t) = trace {
        t.mark(Mark::Arrived, seq);
    }

    // 3. Sum in rank order (own partial from the send slot: the same bytes
    //    every peer received).
    let part = |r: usize, at: usize, dst: &mut [u8]| {
        debug_assert!(at + dst.len() <= bytes);
        // SAFETY: every peer's flags for this call were acquired above (and
        // our own slot is ours); these slots are not written again before
        // call seq+2, which cannot start before this call returns.
        unsafe { mem.read_partial(p, r, at, dst) }
    };
    reduce_in_rank_order(op, world, part, output);
    if let Some(t) = trace {
        t.mark(Mark::Reduced, seq);
    }

    // 4. Copy-engine staging: return only once this rank's own sends of
    //    this call completed locally (`ctrl.sent`). On a GPU instance a host
    //    call may be followed by GPU calls whose copy-engine staging
    //    overwrites both send slots while the proxy may still be sending
    //    this call to later peers (they would sum the next call's partial).
    //    On a host instance it makes `ARX_STAGING=copy` mean "my sends are
    //    done when I return".
    if cfg.staging == Staging::CopyEngine {
        wait_sent(env, seq)?;
    }
    // Release as the kernel's store, though the watchdog needs no more than
    // Relaxed (see `Ctrl::done`).
    region.ctrl().done().store(seq, Ordering::Release);
    if let Some(t) = trace {
        t.mark(Mark::End, seq);
    }
    Ok(())
}

/// A one-shot all-reduce longer than one slot: the chunks `cs`
/// ([`chunked::call_chunks`]) as calls `first`, `first + 1`, …, pipelined
/// (`kernels/arx_abi.h`, "A call longer than one slot"): chunk `j + 1` is
/// published once every peer's flags of chunk `j` are there and before
/// chunk `j` is summed, so the proxy thread sends it meanwhile; the last
/// chunk only after the sum of the one before. Returns the seq of the last
/// call published and the outcome.
pub(crate) fn pipelined<T: Element>(
    env: &Env<'_>,
    first: u64,
    cs: &[chunked::Chunk],
    io: &mut chunked::Io<'_, T>,
    op: crate::Op,
) -> (u64, Result<()>) {
    let mem = Placed {
        region: env.region,
        layout: env.layout,
    };
    let world = env.layout.world();
    let m = cs.len();
    let flag = |j: usize| {
        protocol::flag_word_op(
            first + j as u64,
            T::DTYPE.code(),
            op.code(),
            chunked::count_field(cs[j].range.len(), cs[j].bits()),
        )
    };
    let publish = |io: &chunked::Io<'_, T>, j: usize| {
        // SAFETY: chunk j's place (its parity's slot, its half) was last
        // used by chunk j - 4 (or by an earlier call, which every peer
        // ended before it published this call's first chunk), and this
        // rank has every peer's flag of chunk j - 1, which a peer
        // publishes only after its sum of chunk j - 3 (kernels/arx_abi.h):
        // no peer reads that place any more, and this rank's own sends of
        // chunk j - 4 reached every peer before those flags could be sent.
        // The partial fits half a slot (`call_chunks`).
        unsafe {
            protocol::stage_and_publish(
                &mem,
                first + j as u64,
                flag(j),
                io.partial(cs[j].range.clone()),
            )
        };
    };
    publish(io, 0);
    env.link.pump(true);
    for (j, chunk) in cs.iter().enumerate() {
        let seq = first + j as u64;
        let f = flag(j);
        if let Err(e) = wait_flags(env, seq, f) {
            return (seq, Err(e));
        }
        let early = j + 2 < m;
        if early {
            // The proxy thread posts it while this thread sums chunk j.
            publish(io, j + 1);
            env.link.wake();
        }
        if let Some(d) = env.cfg.sum_delay {
            crate::spin::sleep(d);
        }
        let base = protocol::data_base(f, env.layout.slot_bytes());
        let range = chunk.range.clone();
        let part = |r: usize, at: usize, dst: &mut [u8]| {
            // SAFETY: every peer's flags of chunk j were acquired; its
            // place is not written again before chunk j + 4 is published,
            // which needs this rank's flag of chunk j + 3.
            unsafe { mem.read_partial(protocol::parity(seq), r, base + at, dst) }
        };
        reduce_in_rank_order(op, world, part, &mut io.output[range]);
        if !early && j + 1 < m {
            // The last chunk: after the sum of this one (see above).
            publish(io, j + 1);
            env.link.pump(true);
        }
    }
    let last = first + m as u64 - 1;
    if env.cfg.staging == Staging::CopyEngine {
        if let Err(e) = wait_sent(env, last) {
            return (last, Err(e));
        }
    }
    env.region.ctrl().done().store(last, Ordering::Release);
    (last, Ok(()))
}

/// Step 3's wait: until both lanes of every peer carry call `seq`'s flag
/// word `flag`, bounded by the timeout and the abort word. A peer's word
/// that disagrees (another count, dtype, op or pattern, a refusal, a
/// poison) fails the call at once naming it. On return every peer's data
/// for the call may be read.
pub(crate) fn wait_flags(env: &Env<'_>, seq: u64, flag: u64) -> Result<()> {
    wait_flags_from(env, seq, |_| flag)
}

/// [`wait_flags`] where peer `q`'s word is `expect(q)` (a broadcast's
/// root announces itself, its other ranks do not).
pub(crate) fn wait_flags_from(
    env: &Env<'_>,
    seq: u64,
    expect: impl Fn(usize) -> u64,
) -> Result<()> {
    let Env {
        region,
        layout,
        cfg,
        link,
    } = *env;
    let world = layout.world();
    let mem = Placed { region, layout };
    // Every round looks at every flag still missing, so that a peer
    // reporting a failure (or a mismatched call) is seen even while another
    // peer is silent. A flag that arrived is not read again: its data is
    // ours for this call.
    // The bound counts from the first round that found a flag missing:
    // a call whose flags are all there reads no clock.
    let mut start = None;
    let mut backoff = Backoff::new(cfg.spin, cfg.spin_hot.unwrap_or(64));
    let flags = (world - 1) * 2;
    let mut arrived = [0u64; FLAG_SET_WORDS];
    let mut missing = flags;
    while missing > 0 {
        let before = missing;
        for i in 0..flags {
            if arrived[i / 64] & (1 << (i % 64)) != 0 {
                continue;
            }
            // Flag i: peer number i / 2 in `Layout::peers` order, lane i % 2.
            let (q, lane) = (layout.peer(i / 2), i % 2);
            match protocol::look(&mem, seq, expect(q), q, lane) {
                Look::Missing(_) => continue,
                Look::Mismatch(f) => {
                    // A word still landing in pieces (an RDMA write need
                    // not land as one store; were its seq half to land
                    // before the rest) is not a mismatch: judged once it
                    // has settled (`spin::settle`).
                    let word = || {
                        mem.flag(protocol::parity(seq), q, lane)
                            .load(Ordering::Acquire)
                    };
                    let good = |w| !matches!(protocol::judge(w, seq, expect(q)), Look::Mismatch(_));
                    match protocol::judge(spin::settle(word, f, good, cfg.settle), seq, expect(q)) {
                        Look::Missing(_) => continue,
                        Look::Mismatch(f) => {
                            return Err(env.fail(abi::ARX_STATUS_MISMATCH, q, lane as u32, seq, f));
                        }
                        Look::Arrived => {}
                    }
                }
                Look::Arrived => {}
            }
            arrived[i / 64] |= 1 << (i % 64);
            missing -= 1;
        }
        if missing == 0 {
            break;
        }
        if missing < before {
            backoff.reset();
        }
        // Keep our own sends moving (verbs completions, a full send queue)
        // while waiting.
        link.pump(false);
        let start = *start.get_or_insert_with(Instant::now);
        if protocol::aborted(region) || start.elapsed() > cfg.timeout {
            let code = if protocol::aborted(region) {
                abi::ARX_STATUS_ABORTED
            } else {
                abi::ARX_STATUS_TIMEOUT
            };
            // Name the first missing peer and lane, as the kernel does.
            let i = (0..flags)
                .find(|&i| arrived[i / 64] & (1 << (i % 64)) == 0)
                .unwrap_or(0);
            let (q, lane) = (layout.peer(i / 2), i % 2);
            let f = match protocol::look(&mem, seq, expect(q), q, lane) {
                Look::Missing(f) | Look::Mismatch(f) => f,
                Look::Arrived => expect(q),
            };
            return Err(env.fail(code, q, lane as u32, seq, f));
        }
        backoff.idle();
    }

    Ok(())
}

/// Waits until the proxy reports every send of `seq` complete
/// (`ctrl.sent >= seq`), pumping it meanwhile; bounded by the timeout and
/// the abort word (the proxy also releases `sent` after a failure, once
/// nothing it posted is outstanding).
pub(crate) fn wait_sent(env: &Env<'_>, seq: u64) -> Result<()> {
    let region = env.region;
    let start = Instant::now();
    let mut backoff = Backoff::new(env.cfg.spin, env.cfg.spin_hot.unwrap_or(64));
    loop {
        if protocol::sent_through(region) >= seq {
            return Ok(());
        }
        if env.link.pump(false) {
            backoff.reset();
        }
        // Own sends: the kernel's convention (peer = this rank, no lane).
        let me = env.layout.rank();
        if protocol::aborted(region) {
            return Err(env.fail(abi::ARX_STATUS_ABORTED, me, u32::MAX, seq, 0));
        }
        if start.elapsed() > env.cfg.timeout {
            return Err(env.fail(abi::ARX_STATUS_TIMEOUT, me, u32::MAX, seq, 0));
        }
        backoff.idle();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::Duration;

    use super::{host, Env};
    use crate::config::{Config, Overrides, Staging};
    use crate::dtype::Element;
    use crate::error::{Error, Result};
    use crate::fabric::fake::{proxy_rig, Control};
    use crate::layout::{flag_word, Layout, Region};
    use crate::proxy::Proxy;
    use crate::verify;

    const SEED: u64 = 0x5eed_0003;
    const COUNT: usize = 1000;

    /// Rank 0 of 2 with a proxy over a fake fabric; rank 1 is played by
    /// the test, writing its partial and flags into rank 0's region.
    struct Rig {
        region: Arc<Region>,
        layout: Layout,
        cfg: Config,
        control: Arc<Control>,
        proxy: Proxy,
    }

    fn rig(staging: Staging, timeout: Duration) -> Rig {
        rig_with(Overrides {
            staging: Some(staging),
            timeout: Some(timeout),
            ..Default::default()
        })
    }

    fn rig_with(o: Overrides) -> Rig {
        let (region, layout, cfg, control, proxy) = proxy_rig(64 << 10, &o);
        Rig {
            region,
            layout,
            cfg,
            control,
            proxy,
        }
    }

    impl Rig {
        /// Rank 1's partial of call `seq` and its flags, as its proxy
        /// would write them.
        fn peer_sends(&self, seq: u64) {
            let p = (seq & 1) as usize;
            let part = verify::input::<f32>(SEED, seq, 1, COUNT);
            // SAFETY: the test plays rank 1's proxy: nobody else writes this
            // receive slot, and rank 0 reads it only after the flags below.
            unsafe {
                self.region
                    .write(self.layout.recv_offset(p, 1), bytemuck::cast_slice(&part));
            }
            self.peer_flags(seq, flag_word(seq, f32::DTYPE.code(), COUNT));
        }

        /// Rank 1's flag word `w`, on both lanes, in call `seq`'s place.
        fn peer_flags(&self, seq: u64, w: u64) {
            for lane in 0..2 {
                self.region
                    .u64_at(self.layout.flag_offset((seq & 1) as usize, 1, lane))
                    .store(w, Ordering::Release);
            }
        }

        /// Rank 0's call `seq` on seeded input into a poisoned output.
        fn call(&self, seq: u64) -> (Result<()>, Vec<f32>) {
            self.chunk(seq, false)
        }

        /// As `call`, announced as a chunk with more to follow if `more`.
        fn chunk(&self, seq: u64, more: bool) -> (Result<()>, Vec<f32>) {
            let input = verify::input::<f32>(SEED, seq, 0, COUNT);
            let mut out = vec![0f32; COUNT];
            verify::poison(&mut out);
            let link = self.proxy.link();
            let env = Env {
                region: &self.region,
                layout: &self.layout,
                cfg: &self.cfg,
                link: &link,
            };
            let r = host(&env, seq, Some(&input), &mut out, more, crate::Op::Sum);
            (r, out)
        }

        fn sent(&self) -> u64 {
            crate::protocol::sent_through(&*self.region)
        }
    }

    fn assert_sum(seq: u64, out: &[f32]) {
        let want = verify::expected::<f32>(SEED, seq, 2, COUNT);
        assert_eq!(verify::count_wrong(out, &want), 0, "call {seq}: wrong sum");
    }

    #[test]
    fn copy_staging_returns_only_once_own_sends_completed() {
        let r = rig(Staging::CopyEngine, Duration::from_secs(10));
        for seq in 1..=3 {
            r.peer_sends(seq);
            // The fabric completes the call's writes a while after the
            // peer's flags are there.
            let control = Arc::clone(&r.control);
            let release = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                control.completed.store(seq, Ordering::Release);
            });
            let (res, out) = r.call(seq);
            let sent = r.sent();
            release.join().unwrap();
            res.unwrap();
            assert!(sent >= seq, "call {seq} returned with ctrl.sent = {sent}");
            assert_sum(seq, &out);
        }
    }

    #[test]
    fn copy_staging_times_out_naming_its_own_sends() {
        let r = rig(Staging::CopyEngine, Duration::from_millis(300));
        r.peer_sends(1);
        let (res, out) = r.call(1);
        match res {
            Err(Error::Timeout { during, detail, .. }) => {
                assert!(during.contains("own sends"), "{during}");
                assert!(
                    detail.contains("rank 0, call 1") && detail.contains("own proxy"),
                    "{detail}"
                );
            }
            other => panic!("expected a timeout on this rank's own sends, got {other:?}"),
        }
        // The sum itself was complete; only the sends were not.
        assert_sum(1, &out);
        r.control.completed.store(1, Ordering::Release);
    }

    #[test]
    fn copy_staging_after_a_failure_returns_at_once() {
        // The peer is silent and this rank's post fails: the error, at once.
        let r = rig(Staging::CopyEngine, Duration::from_secs(10));
        r.control.fail_at.store(1, Ordering::Release);
        let t = std::time::Instant::now();
        let (res, _) = r.call(1);
        assert!(
            matches!(&res, Err(Error::Proxy(m)) if m.contains("call 1")),
            "{res:?}"
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());

        // The peer's partial arrived but this rank's post fails: the sum is
        // right, the proxy releases `sent` (nothing is outstanding) and the
        // call returns at once, Ok (the error comes with the next call) or
        // with the error; never a wrong sum, never the timeout.
        let r = rig(Staging::CopyEngine, Duration::from_secs(10));
        r.control.fail_at.store(1, Ordering::Release);
        r.peer_sends(1);
        let t = std::time::Instant::now();
        let (res, out) = r.call(1);
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        match res {
            Ok(()) => assert_sum(1, &out),
            Err(Error::Proxy(m)) => assert!(m.contains("call 1"), "{m}"),
            Err(e) => panic!("unexpected error {e}"),
        }
        assert!(r.proxy.link().error().is_some());
    }

    /// A flag word read while it still lands in pieces (an RDMA write
    /// need not land as one store: soft-RoCE under emulation copies it
    /// piecewise), here the seq half first and the count still the old
    /// word's, is not a mismatch: the call waits for the word to settle
    /// and returns the right sum.
    #[test]
    fn a_flag_landing_in_pieces_is_not_a_mismatch() {
        // A settle window far longer than the writer's 3 ms, however late
        // a loaded machine runs the writer thread.
        let r = rig_with(Overrides {
            staging: Some(Staging::Sm),
            timeout: Some(Duration::from_secs(30)),
            settle: Some(Duration::from_secs(20)),
            ..Default::default()
        });
        let seq = 1;
        let whole = flag_word(seq, f32::DTYPE.code(), COUNT);
        // Region words start at 0: the seq half landed, the rest not yet.
        let torn = whole & !0xffff_ffff;
        r.peer_sends(seq);
        r.peer_flags(seq, torn);
        let (res, out) = std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(3));
                r.peer_flags(seq, whole);
            });
            r.call(seq)
        });
        res.unwrap();
        assert_sum(seq, &out);
        r.control.completed.store(seq, Ordering::Release);
    }

    /// A word that stays wrong is still a mismatch, once settled.
    #[test]
    fn a_settled_wrong_count_fails_naming_the_peer() {
        let r = rig(Staging::Sm, Duration::from_secs(10));
        r.peer_sends(1);
        r.peer_flags(1, flag_word(1, f32::DTYPE.code(), COUNT - 1));
        let t = std::time::Instant::now();
        let (res, _) = r.call(1);
        let e = t.elapsed();
        assert!(
            e >= crate::spin::SETTLE && e < Duration::from_secs(5),
            "{e:?}"
        );
        match res {
            Err(Error::CallMismatch {
                peer: 1,
                seq: 1,
                theirs,
                ..
            }) => {
                assert_eq!(theirs.count, COUNT - 1, "{theirs:?}");
            }
            other => panic!("expected a mismatch naming peer 1, got {other:?}"),
        }
        r.control.completed.store(1, Ordering::Release);
    }

    /// A peer whose fabric failed in call 2 poisons calls 2 and 3 (the
    /// Verbs fabric's `poison`); the poison for call 3 overwrites its flags
    /// of call 1 before this rank read them. The call must fail at once,
    /// naming the peer, not wait for its timeout (found by the loom model,
    /// `poisoned_flags_fail_the_peer_at_once`).
    #[test]
    fn a_poisoned_flag_two_calls_ahead_fails_the_call_at_once() {
        let r = rig(Staging::Sm, Duration::from_secs(10));
        let poison = flag_word(3, crate::abi::ARX_DTYPE_INVALID, crate::dtype::POISON_COUNT);
        r.peer_flags(1, poison);
        let t = std::time::Instant::now();
        let (res, _) = r.call(1);
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        match res {
            Err(Error::CallMismatch {
                peer: 1,
                seq: 1,
                theirs,
                ..
            }) => {
                assert_eq!(theirs.kind, crate::CallKind::FabricFailed, "{theirs:?}");
            }
            other => panic!("expected a mismatch naming peer 1, got {other:?}"),
        }
        r.control.completed.store(1, Ordering::Release);
    }

    /// Rank 0's chunk says more chunks follow, the peer's same-length call
    /// ends there (its total length is shorter): a mismatch at once,
    /// naming the peer, with both sides' "more" marks in the error.
    #[test]
    fn a_chunk_whose_peer_has_no_more_fails_at_once() {
        let r = rig(Staging::Sm, Duration::from_secs(10));
        r.peer_sends(1);
        let t = std::time::Instant::now();
        let (res, _) = r.chunk(1, true);
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        match res {
            Err(Error::CallMismatch {
                peer: 1,
                seq: 1,
                ours,
                theirs,
                ..
            }) => {
                assert_eq!((ours.count, ours.more), (COUNT, true), "{ours:?}");
                assert_eq!((theirs.count, theirs.more), (COUNT, false), "{theirs:?}");
            }
            other => panic!("expected a mismatch naming peer 1, got {other:?}"),
        }
        r.control.completed.store(1, Ordering::Release);
    }

    /// The stage trace records every stage of a host call through the real
    /// path (the proxy's post included), contiguous; and nothing while off.
    #[test]
    fn the_stage_trace_covers_a_host_call() {
        let r = rig(Staging::Sm, Duration::from_secs(10));
        r.peer_sends(1);
        r.call(1).0.unwrap();
        assert_eq!(r.proxy.stages().seq, 0, "traced while off");
        r.proxy.set_trace(true);
        r.peer_sends(2);
        let (res, out) = r.call(2);
        res.unwrap();
        assert_sum(2, &out);
        let s = r.proxy.stages();
        assert_eq!(s.seq, 2);
        let sum: Duration = s.named().iter().map(|(n, d)| d.expect(n)).sum();
        assert_eq!(Some(sum), s.whole);
        assert!(sum > Duration::ZERO);
        r.control.completed.store(2, Ordering::Release);
    }

    #[test]
    fn sm_staging_does_not_wait_for_own_sends() {
        let r = rig(Staging::Sm, Duration::from_secs(10));
        r.peer_sends(1);
        let (res, out) = r.call(1);
        res.unwrap();
        assert_sum(1, &out);
        assert_eq!(r.sent(), 0, "nothing completed, yet sent moved");
        r.control.completed.store(1, Ordering::Release);
    }
}
