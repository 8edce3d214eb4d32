//! Calls longer than one slot: split into chunks of half a slot, each an
//! ordinary one-shot or two-shot call with its own seq, and pipelined on
//! the host side: chunk `j + 1` is published as soon as every peer's flags
//! of chunk `j` are there, so its sends (the proxy thread's copies, the
//! NIC's writes) overlap chunk `j`'s sum ([`host`]). On the GPU side each
//! chunk is one kernel launch (`device::gpu::GpuSide::launch`,
//! `launch_collective`); with SM staging a chunk's launch stages and
//! publishes the next chunk in the host side's order (kernels/oneshot.cuh;
//! a two-shot chunk's: its reduce-scatter step, kernels/twoshot.cuh);
//! copy-engine staging is not overlapped.
//!
//! Chunk `j` sits in the half `(j >> 1) & 1` of its parity's slots
//! (`ARX_FLAG_HIGH` in its flag word, `kernels/arx_abi.h`), so four
//! consecutive chunks have four distinct places; the header says why that
//! makes the early publish safe, and why the last chunk is published only
//! after the sum of the one before (so that a call that ends leaves every
//! slot free for the next call, whatever its size).
//!
//! Why this is enough for every guarantee of a one-slot call to hold for
//! a call of any length:
//! * each element of the result is summed by exactly one chunk, and a
//!   chunk sums its elements exactly as an unchunked call would (the same
//!   partials, rank order, fp32 accumulator, one rounding): the result is
//!   bit-identical to one call, by construction, whatever the slot size;
//! * each chunk is published, sent, flagged, waited for and summed as a
//!   call of its own, so flags, parities, timeouts, abort, poison and the
//!   order of launches apply per chunk unchanged;
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
    /// Its data sits in the second half of its slots (`ARX_FLAG_HIGH`).
    pub high: bool,
}

impl Chunk {
    /// The count-field bits of the chunk's flag word (`ARX_FLAG_MORE`,
    /// `ARX_FLAG_HIGH`), as `arx_params_t.more` carries them.
    pub(crate) fn bits(&self) -> u32 {
        let more = if self.more { abi::ARX_FLAG_MORE } else { 0 };
        let high = if self.high { abi::ARX_FLAG_HIGH } else { 0 };
        more | high
    }
}

/// The chunks of a `count`-element call, at most `per` elements each
/// (`per` ≥ 1), all at the start of their slots; at least one (a
/// zero-length call is one empty chunk). The reduce-scatter and all-gather
/// chunks (`algo::collective`).
pub(crate) fn chunks(count: usize, per: usize) -> impl Iterator<Item = Chunk> {
    let per = per.max(1);
    let n = count.div_ceil(per).max(1);
    (0..n).map(move |k| {
        let start = k * per;
        Chunk {
            range: start..count.min(start + per),
            more: k + 1 < n,
            high: false,
        }
    })
}

/// The chunks of a `count`-element all-reduce when one slot holds `whole`
/// elements and each chunk takes `calls` calls (1: one-shot, 2:
/// two-shot): the call itself when it fits, else chunks of `whole / 2`
/// elements, the one of call `j` (counted from the call's first) in the
/// half `(j >> 1) & 1` of its slots — a one-shot's chunk `k` in half
/// `(k >> 1) & 1`, a two-shot's in half `k & 1`.
pub(crate) fn call_chunks(count: usize, whole: usize, calls: usize) -> impl Iterator<Item = Chunk> {
    let one = fits_one_slot(count, whole);
    let whole = whole.max(2);
    let per = if one { whole } else { whole / 2 };
    chunks(count, per).enumerate().map(move |(k, mut c)| {
        c.high = !one && ((k * calls) >> 1) & 1 == 1;
        c
    })
}

/// Whether a `count`-element call is one chunk of [`call_chunks`] (the
/// call itself) when one slot holds `whole` elements.
pub(crate) fn fits_one_slot(count: usize, whole: usize) -> bool {
    count <= whole.max(2)
}

/// The count field of a one-shot chunk's flag word: its element count and
/// its bits ([`Chunk::bits`]), with the whole-partial pattern.
pub(crate) fn count_field(count: usize, bits: u32) -> usize {
    crate::protocol::count_field(
        count,
        bits & abi::ARX_FLAG_MORE != 0,
        abi::ARX_PATTERN_WHOLE,
    ) | (bits & abi::ARX_FLAG_HIGH) as usize
}

/// Runs an all-reduce of any length on the host device side by `algo`
/// (one-shot or two-shot, already chosen), as calls `first`, `first + 1`,
/// … (a two-shot chunk takes two), with one slot holding `whole`
/// elements. Returns the seq of the last call published (the last one, or
/// the one that failed) and the outcome; a failed chunk ends the call.
///
/// `input` None means in place (each chunk's partial is read from its part
/// of `output` before that part is written).
pub(crate) fn host<T: Element>(
    env: &Env<'_>,
    first: u64,
    whole: usize,
    input: Option<&[T]>,
    output: &mut [T],
    op: crate::Op,
    algo: crate::Algo,
) -> (u64, Result<()>) {
    let calls = if algo == crate::Algo::TwoShot { 2 } else { 1 };
    // One chunk: no list of chunks (no allocation on a small call's path).
    if fits_one_slot(output.len(), whole) {
        return if algo == crate::Algo::TwoShot {
            // A failure in either step leaves both seqs used (the second
            // may have been published).
            (
                first + 1,
                twoshot::host(env, first, input, output, false, op),
            )
        } else {
            (first, oneshot::host(env, first, input, output, false, op))
        };
    }
    let cs: Vec<Chunk> = call_chunks(output.len(), whole, calls).collect();
    let mut io = Io { input, output };
    if algo == crate::Algo::TwoShot {
        twoshot::pipelined(env, first, &cs, &mut io, op)
    } else {
        oneshot::pipelined(env, first, &cs, &mut io, op)
    }
}

/// The caller's buffers of a chunked call (`input` None: in place).
pub(crate) struct Io<'a, T> {
    pub input: Option<&'a [T]>,
    pub output: &'a mut [T],
}

impl<T: Element> Io<'_, T> {
    /// The partial of `range`: the input's, or (in place) the output's,
    /// which is read before the chunk's result is written.
    pub(crate) fn partial(&self, range: Range<usize>) -> &[u8] {
        match self.input {
            Some(i) => bytemuck::cast_slice(&i[range]),
            None => bytemuck::cast_slice(&self.output[range]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{call_chunks, chunks, count_field, fits_one_slot, Chunk};
    use crate::abi;

    fn all(count: usize, per: usize) -> Vec<(usize, usize, bool)> {
        chunks(count, per)
            .map(|Chunk { range, more, .. }| (range.start, range.end, more))
            .collect()
    }

    #[test]
    fn one_slot_means_one_chunk() {
        for whole in [0, 1, 2, 3, 8, 9] {
            for count in 0..=3 * whole + 5 {
                for calls in [1, 2] {
                    let n = call_chunks(count, whole, calls).count();
                    // A call that fits the slot (at least 2 elements: a
                    // chunk is split in two halves) is one chunk.
                    let fits = count <= whole.max(2);
                    assert_eq!(fits, n == 1, "{count} in {whole}: {n} chunks");
                    assert_eq!(fits_one_slot(count, whole), fits, "{count} in {whole}");
                }
            }
        }
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
    fn calls_over_a_slot_take_half_slots_in_four_places() {
        // Fits: one chunk at the start of its slots.
        for count in [0, 1, 999, 1000] {
            let c: Vec<_> = call_chunks(count, 1000, 1).collect();
            assert_eq!(c.len(), 1);
            assert_eq!(
                (c[0].range.clone(), c[0].more, c[0].high),
                (0..count, false, false)
            );
        }
        // Over a slot: chunks of half a slot, halves low, low, high, high, ...
        let c: Vec<_> = call_chunks(2501, 1000, 1).collect();
        let got: Vec<_> = c
            .iter()
            .map(|c| (c.range.clone(), c.more, c.high))
            .collect();
        assert_eq!(
            got,
            [
                (0..500, true, false),
                (500..1000, true, false),
                (1000..1500, true, true),
                (1500..2000, true, true),
                (2000..2500, true, false),
                (2500..2501, false, false),
            ]
        );
        // Four consecutive calls (their seqs alternate parities) have four
        // distinct (parity, half) places, whatever the first seq: one-shot
        // chunks, and two-shot chunks (each two calls in the same half).
        for calls in [1usize, 2] {
            for first in 0..4u64 {
                let places: Vec<_> = call_chunks(40_000, 1000, calls)
                    .enumerate()
                    .flat_map(|(k, c)| {
                        (0..calls).map(move |i| ((first + (k * calls + i) as u64) & 1, c.high))
                    })
                    .collect();
                assert_eq!(places.len(), 80 * calls);
                for w in places.windows(4) {
                    let mut w = w.to_vec();
                    w.sort();
                    w.dedup();
                    assert_eq!(w.len(), 4, "first seq {first}, {calls} calls per chunk");
                }
            }
        }
        let two: Vec<_> = call_chunks(2501, 1000, 2).map(|c| c.high).collect();
        assert_eq!(two, [false, true, false, true, false, true]);
        assert_eq!(c[2].bits(), abi::ARX_FLAG_MORE | abi::ARX_FLAG_HIGH);
        assert_eq!(c[5].bits(), 0);
    }

    #[test]
    fn the_more_bit_is_the_only_difference() {
        let n = abi::ARX_MAX_CHUNK as usize;
        assert_eq!(count_field(n, 0), n);
        assert_eq!(
            count_field(n, abi::ARX_FLAG_MORE),
            n | abi::ARX_FLAG_MORE as usize
        );
        assert_eq!(
            count_field(n, abi::ARX_FLAG_HIGH),
            n | abi::ARX_FLAG_HIGH as usize
        );
        assert_eq!(
            count_field(7, abi::ARX_FLAG_MORE) & abi::ARX_FLAG_COUNT_MASK as usize,
            7 | 1 << 27
        );
        // The chunk limit leaves the MORE bit free, fits the count field,
        // and keeps every chunk of every dtype on a 4 KiB boundary.
        assert_eq!(abi::ARX_MAX_CHUNK & abi::ARX_FLAG_MORE, 0);
        assert_eq!(abi::ARX_MAX_CHUNK & !abi::ARX_FLAG_ELEMS_MASK, 0);
        assert_eq!(abi::ARX_FLAG_HIGH & abi::ARX_FLAG_ELEMS_MASK, 0);
        assert_eq!(
            abi::ARX_FLAG_HIGH & (abi::ARX_FLAG_PATTERN_MASK << abi::ARX_FLAG_PATTERN_SHIFT),
            0
        );
        assert_eq!(
            (abi::ARX_MAX_CHUNK | abi::ARX_FLAG_MORE) & !abi::ARX_FLAG_COUNT_MASK,
            0
        );
        assert_eq!(abi::ARX_MAX_CHUNK % abi::ARX_SECTION_ALIGN, 0);
    }
}
