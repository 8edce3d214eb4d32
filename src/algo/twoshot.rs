//! The two-shot all-reduce on the host device side: a reduce-scatter step
//! then an all-gather step, each an ordinary call of the protocol with its
//! own seq (`kernels/arx_abi.h`; its GPU twin is `kernels/twoshot.cuh`).
//!
//! 1. Call `seq`, pattern SCATTER: the partial is staged as for one-shot
//!    (out of place, and in the GPU kernel, every shard but this rank's
//!    own, which the reduce reads from the input), and the proxy sends
//!    peer `q` only shard `q` ([`protocol::dest_range`]). Every rank reduces its own shard over all
//!    ranks, in rank order, with the one rule of every algorithm
//!    ([`reduce_in_rank_order`]): the bits equal one-shot's.
//! 2. Call `seq + 1`, pattern GATHER: the reduced shard is written at its
//!    offset in `send[p ^ 1]` and the proxy sends it to every peer; every
//!    rank copies the peers' shards out of `recv[p ^ 1]`.
//!
//! Why `send[p ^ 1]` is free in step 2: its last use was call `seq - 1`,
//! and every peer's flag of call `seq` (all arrived before step 2) was
//! sent only after that peer had ended `seq - 1`, which needed this rank's
//! `seq - 1` data: every byte of `send[p ^ 1]` the proxy or the NIC had to
//! read for it has been delivered. Why `recv[p ^ 1][q]` is free for peer
//! `q`'s step 2: `q` sends it only after it has this rank's flag of step 1,
//! sent after this rank ended `seq - 1` (the rule of any two consecutive
//! calls).
//!
//! Bytes sent per rank: `2(N-1)/N·S` against one-shot's `(N-1)·S`; two
//! round trips against one.

use std::sync::atomic::Ordering;

use crate::abi;
use crate::algo::chunked;
use crate::algo::oneshot::{wait_flags, wait_sent, Env};
use crate::dtype::{reduce_in_rank_order, Element};
use crate::error::Result;
use crate::layout::Placed;
use crate::protocol::{self, Memory};
use crate::Staging;

/// Runs one two-shot all-reduce as calls `seq` and `seq + 1` (`output` at
/// most one slot; `input` None: in place). `more`: more chunks of the same
/// call follow (both steps carry it).
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
        link,
        ..
    } = *env;
    let (world, me) = (layout.world(), layout.rank());
    let count = output.len();
    let esize = std::mem::size_of::<T>();
    let mem = Placed { region, layout };
    // Both steps say they are a two-shot all-reduce's (ARX_FLAG_ALLREDUCE):
    // a peer that reduce-scatters or all-gathers instead fails at once.
    let word = |s: u64, pattern: u32| {
        protocol::flag_word_op(
            s,
            T::DTYPE.code(),
            op.code(),
            protocol::count_field(count, more, pattern) | abi::ARX_FLAG_ALLREDUCE as usize,
        )
    };
    let mine = protocol::shard(count, world, esize, me);

    // Step 1: reduce-scatter.
    let p = protocol::parity(seq);
    let flag = word(seq, abi::ARX_PATTERN_SCATTER);
    let at = mine.start * esize;
    let own = at..mine.end * esize;
    // Out of place, this rank's own shard is summed straight from `input`:
    // only the peers' shards are staged (the proxy sends each peer its
    // shard and nothing else, `protocol::dest_range`), which saves copying
    // 1/N of the call. In place, the sum overwrites `output`, so the whole
    // partial is staged first.
    let own_input: Option<&[u8]> = input.map(|i| &bytemuck::cast_slice(i)[own.clone()]);
    match input {
        Some(i) => {
            let src: &[u8] = bytemuck::cast_slice(i);
            // SAFETY: send[p] is ours again (its last use, call seq-2,
            // reached every peer before this rank could end seq-1, as for
            // one-shot); `src` fits the slot (the chunking bounds it).
            unsafe { stage_peers_shards(&mem, seq, flag, src, own.clone()) };
        }
        None => {
            let src: &[u8] = bytemuck::cast_slice(output);
            // SAFETY: send[p] is ours again (its last use, call seq-2,
            // reached every peer before this rank could end seq-1, as for
            // one-shot); `src` fits the slot (the chunking bounds it).
            unsafe { protocol::stage_and_publish(&mem, seq, flag, src) };
        }
    }
    link.pump(true);
    wait_flags(env, seq, flag)?;
    let part = |r: usize, off: usize, dst: &mut [u8]| match own_input {
        Some(mine) if r == me => dst.copy_from_slice(&mine[off..off + dst.len()]),
        // SAFETY: every peer's flags for call seq were acquired; they sent
        // this rank's shard at its own offset, which nobody writes before
        // call seq + 2.
        _ => unsafe { mem.read_partial(p, r, at + off, dst) },
    };
    reduce_in_rank_order(op, world, part, &mut output[mine.clone()]);

    // Step 2: all-gather.
    let seq2 = seq + 1;
    let p2 = protocol::parity(seq2);
    let flag2 = word(seq2, abi::ARX_PATTERN_GATHER);
    // SAFETY: send[p2] is free (module docs); the shard fits the slot.
    unsafe { mem.write_send(p2, at, bytemuck::cast_slice(&output[mine.clone()])) };
    protocol::publish(&mem, seq2, flag2, std::mem::size_of_val(output));
    link.pump(true);
    wait_flags(env, seq2, flag2)?;
    for q in layout.peers() {
        let s = protocol::shard(count, world, esize, q);
        let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut output[s.clone()]);
        // SAFETY: q's flags of call seq2 were acquired: its shard is there,
        // and nothing writes it before call seq2 + 2.
        unsafe { mem.read_partial(p2, q, s.start * esize, dst) };
    }

    // Copy-engine staging: as one-shot, own sends done on return.
    if env.cfg.staging == Staging::CopyEngine {
        wait_sent(env, seq2)?;
    }
    region.ctrl().done().store(seq2, Ordering::Release);
    Ok(())
}

/// Out of place: [`protocol::stage_and_publish`] less this rank's own
/// shard (`own`, bytes of `src`), which no peer is sent
/// ([`protocol::dest_range`]) and the sum reads from the input instead.
///
/// # Safety
/// As `stage_and_publish`'s: call `seq`'s place is this rank's to write.
unsafe fn stage_peers_shards<M: Memory + ?Sized>(
    m: &M,
    seq: u64,
    flag: u64,
    src: &[u8],
    own: std::ops::Range<usize>,
) {
    let (p, base) = (
        protocol::parity(seq),
        protocol::data_base(flag, m.slot_bytes()),
    );
    // SAFETY: the caller's contract; both pieces lie within `src.len()`
    // bytes from the call's place.
    unsafe {
        m.write_send(p, base, &src[..own.start]);
        m.write_send(p, base + own.end, &src[own.end..]);
    }
    protocol::publish(m, seq, flag, src.len());
}

/// A two-shot all-reduce longer than one slot: the chunks `cs`
/// ([`chunked::call_chunks`]), chunk `k` as calls `first + 2k` (SCATTER)
/// and `first + 2k + 1` (GATHER), pipelined (`kernels/arx_abi.h`, "A call
/// longer than one slot"): chunk `k + 1`'s reduce-scatter step is
/// published once every peer's gather flags of chunk `k` are there, and
/// the proxy thread sends it while this thread copies chunk `k`'s gathered
/// shards out. Returns the seq of the last call published and the outcome.
pub(crate) fn pipelined<T: Element>(
    env: &Env<'_>,
    first: u64,
    cs: &[chunked::Chunk],
    io: &mut chunked::Io<'_, T>,
    op: crate::Op,
) -> (u64, Result<()>) {
    let Env {
        region,
        layout,
        link,
        ..
    } = *env;
    let (world, me) = (layout.world(), layout.rank());
    let esize = std::mem::size_of::<T>();
    let mem = Placed { region, layout };
    let m = cs.len();
    let word = |s: u64, k: usize, pattern: u32| {
        let c = &cs[k];
        protocol::flag_word_op(
            s,
            T::DTYPE.code(),
            op.code(),
            protocol::count_field(c.range.len(), c.more, pattern)
                | (c.bits() & abi::ARX_FLAG_HIGH) as usize
                | abi::ARX_FLAG_ALLREDUCE as usize,
        )
    };
    // Out of place, each chunk's own shard is summed straight from the
    // input and only the peers' shards are staged (as `host`).
    let input = io.input;
    let scatter = |io: &chunked::Io<'_, T>, k: usize| {
        let s = first + 2 * k as u64;
        let f = word(s, k, abi::ARX_PATTERN_SCATTER);
        let src = io.partial(cs[k].range.clone());
        // Chunk k's reduce-scatter place (parity of `s`, half k & 1) is
        // free: it was last used by chunk k - 2 (or an earlier call, which
        // every peer ended before it published this call's first step);
        // this rank has every peer's gather flag of chunk k - 1, which a
        // peer publishes only after it reduced chunk k - 1 (and so k - 2),
        // and which it could send only after this rank's chunk k - 2 data
        // had reached it. The partial fits half a slot.
        if input.is_some() {
            let own = protocol::shard(cs[k].range.len(), world, esize, me);
            // SAFETY: the place is free (above).
            unsafe { stage_peers_shards(&mem, s, f, src, own.start * esize..own.end * esize) };
        } else {
            // SAFETY: the place is free (above).
            unsafe { protocol::stage_and_publish(&mem, s, f, src) };
        }
    };
    scatter(io, 0);
    link.pump(true);
    for (k, chunk) in cs.iter().enumerate() {
        let (s1, s2) = (first + 2 * k as u64, first + 2 * k as u64 + 1);
        let range = chunk.range.clone();
        let count = range.len();
        let (f1, f2) = (
            word(s1, k, abi::ARX_PATTERN_SCATTER),
            word(s2, k, abi::ARX_PATTERN_GATHER),
        );
        let base = protocol::data_base(f1, layout.slot_bytes());
        let mine = protocol::shard(count, world, esize, me);
        let at = mine.start * esize;
        if let Err(e) = wait_flags(env, s1, f1) {
            return (s1, Err(e));
        }
        if let Some(d) = env.cfg.sum_delay {
            crate::spin::sleep(d);
        }
        let own_input: Option<&[u8]> =
            input.map(|i| &bytemuck::cast_slice(&i[range.clone()])[at..mine.end * esize]);
        let out = &mut io.output[range];
        let part = |r: usize, off: usize, dst: &mut [u8]| match own_input {
            Some(own) if r == me => dst.copy_from_slice(&own[off..off + dst.len()]),
            // SAFETY: every peer's flags of call s1 were acquired; this
            // rank's shard is not written again before chunk k + 2's
            // reduce-scatter, which needs this rank's gather flag of
            // chunk k + 1.
            _ => unsafe { mem.read_partial(protocol::parity(s1), r, base + at + off, dst) },
        };
        reduce_in_rank_order(op, world, part, &mut out[mine.clone()]);
        // SAFETY: the gather place (parity of s2, half k & 1) was last used
        // by chunk k - 2's gather step, whose sends reached every peer
        // before that peer published chunk k's reduce-scatter step (it had
        // waited for them), which this rank has; the shard fits.
        unsafe {
            mem.write_send(
                protocol::parity(s2),
                base + at,
                bytemuck::cast_slice(&out[mine.clone()]),
            )
        };
        protocol::publish(&mem, s2, f2, std::mem::size_of_val(out));
        link.pump(true);
        if let Err(e) = wait_flags(env, s2, f2) {
            return (s2, Err(e));
        }
        if k + 1 < m {
            scatter(io, k + 1);
            link.wake();
        }
        if let Some(d) = env.cfg.sum_delay {
            crate::spin::sleep(d);
        }
        let out = &mut io.output[chunk.range.clone()];
        for q in layout.peers() {
            let sh = protocol::shard(count, world, esize, q);
            let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut out[sh.clone()]);
            // SAFETY: q's flags of call s2 were acquired: its shard is
            // there, and nothing writes it before chunk k + 2's gather
            // step, which needs this rank's reduce-scatter flag of chunk
            // k + 2, published after this copy.
            unsafe { mem.read_partial(protocol::parity(s2), q, base + sh.start * esize, dst) };
        }
    }
    let last = first + 2 * m as u64 - 1;
    if env.cfg.staging == Staging::CopyEngine {
        if let Err(e) = wait_sent(env, last) {
            return (last, Err(e));
        }
    }
    region.ctrl().done().store(last, Ordering::Release);
    (last, Ok(()))
}
