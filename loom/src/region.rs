//! One rank's region in the model: the control words and flags as (loom)
//! atomics, the data slots as loom `UnsafeCell`s.
//!
//! Why cells for the payload: the library copies partials with plain
//! (non-atomic) memory copies, and what makes them safe is that every read
//! of a slot happens-after the write it reads, through the protocol's
//! release/acquire pairs. loom's `UnsafeCell` checks exactly that: each
//! access is stamped with the accessing thread's vector clock, and a read
//! not ordered after the last write (or a write not ordered after the last
//! read) panics with "Causality violation", in the first interleaving where
//! it happens, even when the bytes happen to be right. Modelling the
//! payload with relaxed atomics instead would only catch a stale value when
//! loom chose to return one, and would make every byte a scheduling point.
//! The readers also compare the bytes they read with the partial expected
//! for that rank and call.

use loom::cell::UnsafeCell;

use crate::protocol::{Control, Memory, Word, Word32};
use crate::sync::atomic::{AtomicU32, AtomicU64, Weak};

/// Bytes of one partial in the model: two 16-byte lane parts
/// (`ARX_LANE_ALIGN`), so each lane carries one.
pub(crate) const BYTES: usize = 32;
/// Granularity of the payload cells: half a lane's part (the copy
/// crew's model cuts each lane into two pieces).
const CHUNK: usize = 8;
const CHUNKS: usize = BYTES / CHUNK;

/// Which of a rank's orderings a model weakens (all strong by default).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Weaken {
    /// The flag stores (`post_shm`) become Relaxed.
    pub flag_store: bool,
    /// The flag loads (`look`) become Relaxed.
    pub flag_load: bool,
    /// The store of `ctrl.seq` (`publish`) becomes Relaxed.
    pub seq_store: bool,
    /// The store of `ctrl.sent` (`release_sent`) becomes Relaxed.
    pub sent_store: bool,
    /// The stores of `ctrl.status` (`record`) become Relaxed.
    pub status_store: bool,
}

type Chunk = UnsafeCell<[u8; CHUNK]>;

/// One rank's region.
pub(crate) struct Rank {
    rank: usize,
    world: usize,
    /// Seq, Meta(0..2), Bytes(0..2), Sent, ErrSeq, ErrFlag.
    words: Vec<AtomicU64>,
    /// Abort, Status, ErrPeer, ErrLane.
    words32: Vec<AtomicU32>,
    /// `[parity][src][lane]`.
    flags: Vec<AtomicU64>,
    /// `[parity][chunk]`.
    send: Vec<Chunk>,
    /// `[parity][src][chunk]`.
    recv: Vec<Chunk>,
}

// SAFETY: as the library's `Region`: the payload cells are shared between
// threads on purpose, and whether each access is ordered after the one
// before it is exactly what loom checks (it panics when not).
unsafe impl Sync for Rank {}

fn chunks(n: usize) -> Vec<Chunk> {
    (0..n).map(|_| UnsafeCell::new([0; CHUNK])).collect()
}

impl Rank {
    pub(crate) fn new(world: usize, rank: usize, w: Weaken) -> Self {
        let strong = Weak::default();
        let stores = |on: bool| Weak {
            loads: false,
            stores: on,
        };
        let words = (0..8)
            .map(|i| {
                AtomicU64::weakened(
                    0,
                    if i == 0 {
                        stores(w.seq_store)
                    } else if i == 5 {
                        stores(w.sent_store)
                    } else {
                        strong
                    },
                )
            })
            .collect();
        let words32 = (0..4)
            .map(|i| {
                AtomicU32::weakened(
                    0,
                    if i == 1 {
                        stores(w.status_store)
                    } else {
                        strong
                    },
                )
            })
            .collect();
        let flag_weak = Weak {
            loads: w.flag_load,
            stores: w.flag_store,
        };
        Rank {
            rank,
            world,
            words,
            words32,
            flags: (0..2 * world * 2)
                .map(|_| AtomicU64::weakened(0, flag_weak))
                .collect(),
            send: chunks(2 * CHUNKS),
            recv: chunks(2 * world * CHUNKS),
        }
    }

    fn send_cell(&self, parity: usize, chunk: usize) -> &Chunk {
        &self.send[parity * CHUNKS + chunk]
    }

    fn recv_cell(&self, parity: usize, src: usize, chunk: usize) -> &Chunk {
        &self.recv[(parity * self.world + src) * CHUNKS + chunk]
    }
}

/// The chunks a byte range covers, with the part of each: (chunk, range in
/// the chunk, offset in the range).
fn split(at: usize, len: usize) -> impl Iterator<Item = (usize, std::ops::Range<usize>, usize)> {
    assert!(at + len <= BYTES, "access {at}+{len} past the model's slot");
    let mut pos = at;
    let end = at + len;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let c = pos / CHUNK;
        let stop = end.min((c + 1) * CHUNK);
        let item = (c, pos - c * CHUNK..stop - c * CHUNK, pos - at);
        pos = stop;
        Some(item)
    })
}

impl Control for Rank {
    fn word(&self, w: Word) -> &AtomicU64 {
        &self.words[match w {
            Word::Seq => 0,
            Word::Meta(p) => 1 + p,
            Word::Bytes(p) => 3 + p,
            Word::Sent => 5,
            Word::ErrSeq => 6,
            Word::ErrFlag => 7,
        }]
    }
    fn word32(&self, w: Word32) -> &AtomicU32 {
        &self.words32[match w {
            Word32::Abort => 0,
            Word32::Status => 1,
            Word32::ErrPeer => 2,
            Word32::ErrLane => 3,
        }]
    }
}

impl Memory for Rank {
    fn flag(&self, parity: usize, src: usize, lane: usize) -> &AtomicU64 {
        &self.flags[(parity * self.world + src) * 2 + lane]
    }

    unsafe fn write_send(&self, parity: usize, at: usize, src: &[u8]) {
        for (c, r, o) in split(at, src.len()) {
            // SAFETY: the cell's pointer is valid; whether the access is
            // ordered is what loom checks.
            self.send_cell(parity, c).with_mut(|p| unsafe {
                (&mut *p)[r.clone()].copy_from_slice(&src[o..o + r.len()])
            });
        }
    }

    unsafe fn read_partial(&self, parity: usize, src: usize, at: usize, dst: &mut [u8]) {
        for (c, r, o) in split(at, dst.len()) {
            let cell = if src == self.rank {
                self.send_cell(parity, c)
            } else {
                self.recv_cell(parity, src, c)
            };
            // SAFETY: as in `write_send`.
            cell.with(|p| unsafe { dst[o..o + r.len()].copy_from_slice(&(&*p)[r.clone()]) });
        }
    }

    unsafe fn copy_send(
        &self,
        parity: usize,
        range: std::ops::Range<usize>,
        peer: &Self,
        from: usize,
    ) {
        for (c, r, _) in split(range.start, range.len()) {
            // SAFETY: as in `write_send`.
            self.send_cell(parity, c).with(|s| {
                peer.recv_cell(parity, from, c).with_mut(|d| unsafe {
                    (&mut *d)[r.clone()].copy_from_slice(&(&*s)[r.clone()])
                })
            });
        }
    }

    fn slot_bytes(&self) -> usize {
        BYTES
    }
}
