//! `broadcast` on the host device side, NCCL's definition: the root's `n`
//! input elements land in every rank's output of `n` elements (in place
//! when input and output are one buffer; the input is read on the root
//! only). Its GPU twin is `kernels/bcast.cuh`.
//!
//! One call of the protocol per chunk of at most one slot (pattern BCAST,
//! `kernels/arx_abi.h`): the root stages its chunk and announces it as
//! the root (every peer gets the whole partial); every other rank
//! announces the same count with no data. Each rank expects exactly the
//! root's word from the root and the non-root word from every other peer,
//! so ranks that disagree on the count fail at once (the root sees the
//! others' counts too), and so do ranks that disagree on the root: the
//! root bit comes from a rank another rank did not name, or not from the
//! rank it named (the one case some ranks pass: exactly one rank calls
//! itself the root and some others name another; they fail, the root and
//! those who named it get its data). Every chunk is a call of its own, so
//! parities, the relay (which forwards the pattern's range) and failures
//! work as for any call.
//!
//! Non-roots copy `recv[p][root]` out; the root copies its input into its
//! output unless in place. Nothing is reduced: the bits are the root's.

use crate::algo::chunked;
use crate::algo::collective::{finish, Bufs};
use crate::algo::oneshot::{wait_flags_from, Env};
use crate::dtype::Element;
use crate::error::Result;
use crate::layout::Placed;
use crate::protocol::{self, Memory};

/// Broadcast from `root` (`Separate`: input and output of `n` elements;
/// `InPlace`: one buffer, the root's input) as calls `first`, `first + 1`,
/// … (one per chunk of at most `per` elements). Returns the last seq
/// attempted and the outcome.
pub(crate) fn broadcast<T: Element>(
    env: &Env<'_>,
    first: u64,
    per: usize,
    root: usize,
    mut bufs: Bufs<'_, T>,
) -> (u64, Result<()>) {
    let layout = env.layout;
    let me = layout.rank();
    let esize = std::mem::size_of::<T>();
    let mem = Placed {
        region: env.region,
        layout,
    };
    let n = match &bufs {
        Bufs::Separate(_, o) => o.len(),
        Bufs::InPlace(b) => b.len(),
    };
    let mut seq = first;
    for (k, c) in chunked::chunks(n, per).enumerate() {
        seq = first + k as u64;
        let ck = c.range.len();
        let p = protocol::parity(seq);
        let word = |q: usize| protocol::bcast_flag(seq, T::DTYPE.code(), ck, c.more, q, root);
        let mut bytes = 0;
        if me == root {
            let piece: &[T] = match &bufs {
                Bufs::Separate(i, _) => &i[c.range.clone()],
                Bufs::InPlace(b) => &b[c.range.clone()],
            };
            // SAFETY: send[p] is ours again (as for one-shot: call seq-2
            // reached every peer before this rank ended seq-1); the chunk
            // holds at most one slot's worth.
            unsafe { mem.write_send(p, 0, bytemuck::cast_slice(piece)) };
            bytes = ck * esize;
        }
        protocol::publish(&mem, seq, word(me), bytes);
        env.link.pump(true);
        if let Err(e) = wait_flags_from(env, seq, word) {
            return (seq, Err(e));
        }
        match &mut bufs {
            Bufs::Separate(i, o) if me == root => {
                o[c.range.clone()].copy_from_slice(&i[c.range.clone()]);
            }
            Bufs::InPlace(_) if me == root => {}
            Bufs::Separate(_, out) | Bufs::InPlace(out) => {
                let dst: &mut [T] = &mut out[c.range.clone()];
                // SAFETY: the root's flags for this call were acquired: its
                // chunk is at the start of its receive slot, not written
                // again before call seq + 2.
                unsafe { mem.read_partial(p, root, 0, bytemuck::cast_slice_mut(dst)) };
            }
        }
        if let Err(e) = finish(env, seq) {
            return (seq, Err(e));
        }
    }
    (seq, Ok(()))
}
