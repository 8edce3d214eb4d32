//! Calls longer than one slot: split into chunks of at most one slot, each
//! an ordinary one-shot call with its own seq (host side: [`host`]; GPU
//! side: one kernel launch per chunk, `device::gpu::GpuSide::launch`).
//!
//! Why this is enough for every guarantee of a one-shot call to hold for a
//! call of any length:
//! * each element of the result is summed by exactly one chunk, and a
//!   chunk sums its elements exactly as an unchunked call would (the same
//!   partials, rank order, fp32 accumulator, one rounding): the result is
//!   bit-identical to one call, by construction, whatever the slot size;
//! * each chunk is published, sent, flagged, waited for and summed as a
//!   call of its own, so flags, parities (chunk k+1 uses the other send and
//!   receive slots, while the proxy may still be sending chunk k), timeouts,
//!   abort, poison and the order of launches apply per chunk unchanged;
//! * ranks that disagree on the total length differ in the first chunk
//!   whose count differs or where one rank has more chunks to come: every
//!   chunk but the last carries `ARX_FLAG_MORE` in its flag word's count
//!   field, so the flag words differ there and every rank fails at once
//!   with [`crate::Error::CallMismatch`] (the same check as for any two
//!   calls of different lengths), instead of one rank waiting for a chunk
//!   the others never send.
//!
//! A zero-length call is one chunk of zero elements: published and flagged
//! like any call, so the ranks stay in step.

use std::ops::Range;

use crate::abi;
use crate::algo::oneshot::{self, Env};
use crate::algo::twoshot;
use crate::dtype::Element;
use crate::error::Result;

/// One chunk of a call: its elements and whether more chunks follow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// Element range within the call.
    pub range: Range<usize>,
    /// More chunks of the same call follow (`ARX_FLAG_MORE`).
    pub more: bool,
}

/// The chunks of a `count`-element call, at most `per` elements each
/// (`per` ≥ 1); at least one (a zero-length call is one empty chunk).
pub(crate) fn chunks(count: usize, per: usize) -> impl Iterator<Item = Chunk> {
    let per = per.max(1);
    let n = count.div_ceil(per).max(1);
    (0..n).map(move |k| {
        let start = k * per;
        Chunk {
            range: start..count.min(start + per),
            more: k + 1 < n,
        }
    })
}

/// The count field of a one-shot chunk's flag word: its element count,
/// and `ARX_FLAG_MORE` if more chunks follow (`protocol::count_field` with
/// the whole-partial pattern).
pub(crate) fn count_field(count: usize, more: bool) -> usize {
    crate::protocol::count_field(count, more, abi::ARX_PATTERN_WHOLE)
}

/// Runs a call of any length on the host device side: its chunks of at
/// most `per` elements, each by `algo` (one-shot or two-shot, already
/// chosen), as calls `first`, `first + 1`, … (a two-shot chunk takes two).
/// Returns the seq of the last call attempted (the last one, or the one
/// that failed) and the outcome; a failed chunk ends the call.
///
/// `input` None means in place (each chunk's partial is read from its part
/// of `output` before that part is written).
pub(crate) fn host<T: Element>(
    env: &Env<'_>,
    first: u64,
    per: usize,
    input: Option<&[T]>,
    output: &mut [T],
    op: crate::Op,
    algo: crate::Algo,
) -> (u64, Result<()>) {
    let mut seq = first;
    let mut next = first;
    for c in chunks(output.len(), per) {
        seq = next;
        let inp = input.map(|i| &i[c.range.clone()]);
        let out = &mut output[c.range];
        let r = if algo == crate::Algo::TwoShot {
            next += 2;
            let r = twoshot::host(env, seq, inp, out, c.more, op);
            // A failure in either step leaves both seqs used (the second
            // may have been published).
            seq += 1;
            r
        } else {
            next += 1;
            oneshot::host(env, seq, inp, out, c.more, op)
        };
        if r.is_err() {
            return (seq, r);
        }
    }
    (seq, Ok(()))
}

#[cfg(test)]
mod tests {
    use super::{chunks, count_field, Chunk};
    use crate::abi;

    fn all(count: usize, per: usize) -> Vec<(usize, usize, bool)> {
        chunks(count, per)
            .map(|Chunk { range, more }| (range.start, range.end, more))
            .collect()
    }

    #[test]
    fn chunks_cover_the_call_once_in_order() {
        assert_eq!(all(0, 4), [(0, 0, false)]);
        assert_eq!(all(1, 4), [(0, 1, false)]);
        assert_eq!(all(3, 4), [(0, 3, false)]);
        assert_eq!(all(4, 4), [(0, 4, false)]);
        assert_eq!(all(5, 4), [(0, 4, true), (4, 5, false)]);
        assert_eq!(all(8, 4), [(0, 4, true), (4, 8, false)]);
        assert_eq!(all(11, 4), [(0, 4, true), (4, 8, true), (8, 11, false)]);
        for count in 0..200 {
            for per in 1..20 {
                let c = all(count, per);
                assert_eq!(c.len(), count.div_ceil(per).max(1));
                let mut at = 0;
                for (i, &(s, e, more)) in c.iter().enumerate() {
                    assert_eq!(s, at);
                    assert!(e - s <= per && (e > s || count == 0));
                    assert_eq!(more, i + 1 < c.len());
                    at = e;
                }
                assert_eq!(at, count);
            }
        }
    }

    #[test]
    fn the_more_bit_is_the_only_difference() {
        let n = abi::ARX_MAX_CHUNK as usize;
        assert_eq!(count_field(n, false), n);
        assert_eq!(count_field(n, true), n | abi::ARX_FLAG_MORE as usize);
        assert_eq!(
            count_field(7, true) & abi::ARX_FLAG_COUNT_MASK as usize,
            7 | 1 << 27
        );
        // The chunk limit leaves the MORE bit free, fits the count field,
        // and keeps every chunk of every dtype on a 4 KiB boundary.
        assert_eq!(abi::ARX_MAX_CHUNK & abi::ARX_FLAG_MORE, 0);
        assert_eq!(
            (abi::ARX_MAX_CHUNK | abi::ARX_FLAG_MORE) & !abi::ARX_FLAG_COUNT_MASK,
            0
        );
        assert_eq!(abi::ARX_MAX_CHUNK % abi::ARX_SECTION_ALIGN, 0);
    }
}
