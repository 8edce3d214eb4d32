//! The two-shot all-reduce on the host device side: a reduce-scatter step
//! then an all-gather step, each an ordinary call of the protocol with its
//! own seq (`kernels/arx_abi.h`; its GPU twin is `kernels/twoshot.cuh`).
//!
//! 1. Call `seq`, pattern SCATTER: the whole partial is staged as for
//!    one-shot, but the proxy sends peer `q` only shard `q`
//!    ([`protocol::dest_range`]). Every rank reduces its own shard over all
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
    let word = |s: u64, pattern: u32| {
        protocol::flag_word_op(
            s,
            T::DTYPE.code(),
            op.code(),
            protocol::count_field(count, more, pattern),
        )
    };
    let mine = protocol::shard(count, world, esize, me);

    // Step 1: reduce-scatter.
    let p = protocol::parity(seq);
    let flag = word(seq, abi::ARX_PATTERN_SCATTER);
    let src: &[u8] = match input {
        Some(i) => bytemuck::cast_slice(i),
        None => bytemuck::cast_slice(output),
    };
    // SAFETY: send[p] is ours again (its last use, call seq-2, reached every
    // peer before this rank could end seq-1, as for one-shot); `src` fits
    // the slot (the chunking bounds it).
    unsafe { protocol::stage_and_publish(&mem, seq, flag, src) };
    link.pump(true);
    wait_flags(env, seq, flag)?;
    let at = mine.start * esize;
    let part = |r: usize, off: usize, dst: &mut [u8]| {
        // SAFETY: every peer's flags for call seq were acquired; they sent
        // this rank's shard at its own offset, which nobody writes before
        // call seq + 2.
        unsafe { mem.read_partial(p, r, at + off, dst) }
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
