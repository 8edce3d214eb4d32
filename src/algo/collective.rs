//! `reduce_scatter` and `all_gather` on the host device side, NCCL's
//! definitions: with `n` elements per rank, `reduce_scatter` reduces `N·n`
//! elements over all ranks and leaves block `r` (elements `r·n..(r+1)·n`)
//! on rank `r`; `all_gather` concatenates every rank's `n` elements in rank
//! order on every rank. In place as NCCL defines it: the rank's own block
//! of the `N·n` buffer is the input of `all_gather` and the output of
//! `reduce_scatter`.
//!
//! Each is one call of the protocol per chunk (pattern SCATTER or GATHER,
//! `kernels/arx_abi.h`): the two steps of the two-shot all-reduce
//! (`algo::twoshot`) on their own. A chunk covers the same `c` elements of
//! every rank's block (`c` at most a slot's elements divided by `N`,
//! [`block_chunks`]), staged as `N` blocks of `c`, so the shard rule (exact
//! blocks when `N` divides the count) gives rank `q` exactly its block. The
//! reduction is the one rule of every algorithm (rank order, fp32
//! accumulator, one rounding): `reduce_scatter`'s block `r` is bit for bit
//! block `r` of the all-reduce of the same inputs.

use std::ops::Range;
use std::sync::atomic::Ordering;

use crate::abi;
use crate::algo::chunked::{self, Chunk};
use crate::algo::oneshot::{wait_flags, wait_sent, Env};
use crate::dtype::{reduce_in_rank_order, Element};
use crate::error::Result;
use crate::layout::Placed;
use crate::protocol::{self, Memory};
use crate::Staging;

/// The chunks of a collective with `n` elements per rank over `world`
/// ranks, when a slot holds `per` elements: each covers the same elements
/// of every rank's block, at most `per / world` of them (at least one).
pub(crate) fn block_chunks(n: usize, world: usize, per: usize) -> impl Iterator<Item = Chunk> {
    chunked::chunks(n, (per / world.max(1)).max(1))
}

/// The buffers of a reduce-scatter or all-gather: `(input, output)`, or
/// one buffer of `N·n` elements in place.
pub(crate) enum Bufs<'a, T> {
    Separate(&'a [T], &'a mut [T]),
    InPlace(&'a mut [T]),
}

/// Ends a call: copy-engine staging waits for its own sends; `done`.
pub(crate) fn finish(env: &Env<'_>, seq: u64) -> Result<()> {
    if env.cfg.staging == Staging::CopyEngine {
        wait_sent(env, seq)?;
    }
    env.region.ctrl().done().store(seq, Ordering::Release);
    Ok(())
}

fn flag_of<T: Element>(seq: u64, op: crate::Op, count: usize, more: bool, pattern: u32) -> u64 {
    protocol::flag_word_op(
        seq,
        T::DTYPE.code(),
        op.code(),
        protocol::count_field(count, more, pattern),
    )
}

/// Reduce-scatter of `n` elements per rank (`Separate`: input `N·n`,
/// output `n`; `InPlace`: `N·n`, result in this rank's block) as calls
/// `first`, `first + 1`, … (one per chunk of at most `per / N` elements
/// per rank). Returns the last seq attempted and the outcome.
pub(crate) fn reduce_scatter<T: Element>(
    env: &Env<'_>,
    first: u64,
    per: usize,
    n: usize,
    mut bufs: Bufs<'_, T>,
    op: crate::Op,
) -> (u64, Result<()>) {
    let layout = env.layout;
    let (world, me) = (layout.world(), layout.rank());
    let esize = std::mem::size_of::<T>();
    let mem = Placed {
        region: env.region,
        layout,
    };
    let mut seq = first;
    for (k, c) in block_chunks(n, world, per).enumerate() {
        seq = first + k as u64;
        let ck = c.range.len();
        let p = protocol::parity(seq);
        let flag = flag_of::<T>(seq, op, world * ck, c.more, abi::ARX_PATTERN_SCATTER);
        // Stage block q's part of this chunk as shard q.
        let input: &[T] = match &bufs {
            Bufs::Separate(i, _) => i,
            Bufs::InPlace(b) => b,
        };
        for q in 0..world {
            let piece = &input[q * n + c.range.start..q * n + c.range.end];
            // SAFETY: send[p] is ours again (as for one-shot: call seq-2
            // reached every peer before this rank ended seq-1); the chunk's
            // N·ck elements fit the slot (`block_chunks`).
            unsafe { mem.write_send(p, q * ck * esize, bytemuck::cast_slice(piece)) };
        }
        protocol::publish(&mem, seq, flag, world * ck * esize);
        env.link.pump(true);
        if let Err(e) = wait_flags(env, seq, flag) {
            return (seq, Err(e));
        }
        let at = me * ck * esize;
        let part = |r: usize, off: usize, dst: &mut [u8]| {
            // SAFETY: every peer's flags for this call were acquired; its
            // shard for this rank is at this rank's block offset.
            unsafe { mem.read_partial(p, r, at + off, dst) }
        };
        let out: &mut [T] = match &mut bufs {
            Bufs::Separate(_, o) => &mut o[c.range.clone()],
            Bufs::InPlace(b) => &mut b[me * n + c.range.start..me * n + c.range.end],
        };
        reduce_in_rank_order(op, world, part, out);
        if let Err(e) = finish(env, seq) {
            return (seq, Err(e));
        }
    }
    (seq, Ok(()))
}

/// All-gather of `n` elements per rank (`Separate`: input `n`, output
/// `N·n`; `InPlace`: `N·n`, this rank's block is the input) as calls
/// `first`, `first + 1`, … Returns the last seq attempted and the outcome.
pub(crate) fn all_gather<T: Element>(
    env: &Env<'_>,
    first: u64,
    per: usize,
    n: usize,
    mut bufs: Bufs<'_, T>,
) -> (u64, Result<()>) {
    let layout = env.layout;
    let (world, me) = (layout.world(), layout.rank());
    let esize = std::mem::size_of::<T>();
    let mem = Placed {
        region: env.region,
        layout,
    };
    let mut seq = first;
    for (k, c) in block_chunks(n, world, per).enumerate() {
        seq = first + k as u64;
        let ck = c.range.len();
        let p = protocol::parity(seq);
        // The op travels as sum: an all-gather reduces nothing.
        let flag = flag_of::<T>(
            seq,
            crate::Op::Sum,
            world * ck,
            c.more,
            abi::ARX_PATTERN_GATHER,
        );
        let own: Range<usize> = me * n + c.range.start..me * n + c.range.end;
        {
            let piece: &[T] = match &bufs {
                Bufs::Separate(i, _) => &i[c.range.clone()],
                Bufs::InPlace(b) => &b[own.clone()],
            };
            // SAFETY: send[p] is ours again (as above); it fits the slot.
            unsafe { mem.write_send(p, me * ck * esize, bytemuck::cast_slice(piece)) };
        }
        protocol::publish(&mem, seq, flag, world * ck * esize);
        env.link.pump(true);
        if let Err(e) = wait_flags(env, seq, flag) {
            return (seq, Err(e));
        }
        let out: &mut [T] = match &mut bufs {
            Bufs::Separate(i, o) => {
                o[own.clone()].copy_from_slice(&i[c.range.clone()]);
                o
            }
            Bufs::InPlace(b) => b,
        };
        for q in layout.peers() {
            let dst: &mut [T] = &mut out[q * n + c.range.start..q * n + c.range.end];
            // SAFETY: q's flags for this call were acquired: its block is at
            // its shard's offset, not written again before call seq + 2.
            unsafe { mem.read_partial(p, q, q * ck * esize, bytemuck::cast_slice_mut(dst)) };
        }
        if let Err(e) = finish(env, seq) {
            return (seq, Err(e));
        }
    }
    (seq, Ok(()))
}
