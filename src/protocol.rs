//! The protocol's ordering-bearing steps on the host (`kernels/arx_abi.h`
//! states the protocol; `kernels/oneshot.cuh` is the GPU's twin of the
//! device side):
//!
//! 1. the device side stages its partial in `send[p]` and publishes the call
//!    ([`stage_and_publish`], [`publish`]);
//! 2. the proxy sees it ([`published`], [`announced`]) and sends each lane's
//!    part, then that lane's flag, to every peer ([`post_shm`]; the Verbs
//!    fabric does the same with RDMA writes on one RC QP);
//! 3. the reader takes a peer's flag ([`look`]) and only then its partial
//!    ([`Memory::read_partial`]);
//! 4. the proxy tells the device side which calls' send slots it no longer
//!    reads ([`release_sent`], [`sent_through`]), which copy-engine staging
//!    waits for before overwriting both slots;
//! 5. failures: the abort word ([`raise_abort`], [`aborted`]), the recorded
//!    status ([`record`], [`recorded`]), and the refused or poisoned flag
//!    words (dtype `INVALID`, [`flag_word`]) that make peers fail at once.
//!
//! Each atomic access says why its ordering is needed, or why `Relaxed`
//! suffices.
//!
//! # Compiled twice
//!
//! This file is compiled into the library, over [`crate::layout::Region`]
//! (std's atomics, raw memory), and into the loom model in `loom/` (by
//! `#[path]`), over an in-memory region of loom's atomics and loom's
//! `UnsafeCell`s for the payload, where every interleaving and every
//! outcome of the Rust (C++11) memory model is explored — the outcomes that
//! an aarch64 CPU can produce and an x86 one hides. So it uses nothing of the
//! crate but `crate::sync::atomic` (std's here, loom's there) and the ABI
//! constants of `crate::abi`, and it touches memory only through the
//! [`Control`] and [`Memory`] traits.

use std::ops::Range;

use crate::abi;
use crate::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Lanes per peer (one flag each).
pub(crate) const LANES: usize = abi::ARX_LANES as usize;

/// A control-block word of 64 bits (`arx_ctrl_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Word {
    /// `seq`: the last call published.
    Seq,
    /// `meta[p]`: the flag word of the call of parity `p`.
    Meta(usize),
    /// `bytes[p]`: the byte count of the call of parity `p`.
    Bytes(usize),
    /// `sent`: the last call whose send slots the proxy no longer reads.
    Sent,
    /// `err_seq`: the call of the recorded failure.
    ErrSeq,
    /// `err_flag`: the flag word that failed it (or 0).
    ErrFlag,
}

/// A control-block word of 32 bits (`arx_ctrl_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Word32 {
    /// `abort`: nonzero stops the device side's waits.
    Abort,
    /// `status`: the first failure's `ARX_STATUS_*` (`u32::MAX` while being
    /// recorded).
    Status,
    /// `err_peer`: the peer of the recorded failure.
    ErrPeer,
    /// `err_lane`: its lane (`u32::MAX`: this rank's own sends).
    ErrLane,
}

/// A rank's control block.
pub(crate) trait Control {
    /// The 64-bit word `w`.
    fn word(&self, w: Word) -> &AtomicU64;
    /// The 32-bit word `w`.
    fn word32(&self, w: Word32) -> &AtomicU32;
}

/// A rank's region as the protocol touches it: the control block, the flags
/// peers write, and the data slots.
pub(crate) trait Memory: Control {
    /// `flags[parity][src][lane]`: the flag `src` writes here.
    fn flag(&self, parity: usize, src: usize, lane: usize) -> &AtomicU64;

    /// Copies `src` into this rank's `send[parity]`, from byte `at`.
    ///
    /// # Safety
    /// The slot is the caller's: nothing reads or writes it during the copy
    /// (for call `seq` of this parity: every peer has consumed call
    /// `seq - 2`, rule 5 of the protocol; with copy-engine staging also
    /// `sent_through() >= seq - 1`). `src` fits the slot from `at`.
    unsafe fn write_send(&self, parity: usize, at: usize, src: &[u8]);

    /// Copies bytes `at..at + dst.len()` of rank `src`'s partial of
    /// `parity` out of the region: `send[parity]` when `src` is this rank,
    /// `recv[parity][src]` otherwise.
    ///
    /// # Safety
    /// Nothing writes those bytes during the copy: for a peer's partial, its
    /// flags for this call were seen by [`look`] (which acquired them) and
    /// the call has not returned.
    unsafe fn read_partial(&self, parity: usize, src: usize, at: usize, dst: &mut [u8]);

    /// Copies `range` of this rank's `send[parity]` into `peer`'s
    /// `recv[parity][from]` at the same offsets (`from` is this rank).
    ///
    /// # Safety
    /// The source was published (and is not written until the device side
    /// learns it was sent), and the destination is not read by the peer
    /// before the flag that follows it.
    unsafe fn copy_send(&self, parity: usize, range: Range<usize>, peer: &Self, from: usize);

    /// Bytes of one slot (a chunk with `ARX_FLAG_HIGH` sits at half of it,
    /// see [`data_base`]).
    fn slot_bytes(&self) -> usize;
}

impl<M: Control + ?Sized> Control for &M {
    fn word(&self, w: Word) -> &AtomicU64 {
        (**self).word(w)
    }
    fn word32(&self, w: Word32) -> &AtomicU32 {
        (**self).word32(w)
    }
}

impl<M: Memory + ?Sized> Memory for &M {
    fn flag(&self, parity: usize, src: usize, lane: usize) -> &AtomicU64 {
        (**self).flag(parity, src, lane)
    }
    unsafe fn write_send(&self, parity: usize, at: usize, src: &[u8]) {
        // SAFETY: the caller's contract, passed on.
        unsafe { (**self).write_send(parity, at, src) }
    }
    unsafe fn read_partial(&self, parity: usize, src: usize, at: usize, dst: &mut [u8]) {
        // SAFETY: the caller's contract, passed on.
        unsafe { (**self).read_partial(parity, src, at, dst) }
    }
    unsafe fn copy_send(&self, parity: usize, range: Range<usize>, peer: &Self, from: usize) {
        // SAFETY: the caller's contract, passed on.
        unsafe { (**self).copy_send(parity, range, *peer, from) }
    }
    fn slot_bytes(&self) -> usize {
        (**self).slot_bytes()
    }
}

/// The parity (slot set) of call `seq`.
pub(crate) fn parity(seq: u64) -> usize {
    (seq & 1) as usize
}

/// Packs the flag word for call `seq` of `count` elements of `dtype`, summed
/// (op 0: also the refusal and poison words).
pub fn flag_word(seq: u64, dtype: u32, count: usize) -> u64 {
    flag_word_op(seq, dtype, abi::ARX_OP_SUM, count)
}

/// [`flag_word`] with the reduction `op` (`ARX_OP_*`).
pub fn flag_word_op(seq: u64, dtype: u32, op: u32, count: usize) -> u64 {
    ((seq & 0xffff_ffff) << abi::ARX_FLAG_SEQ_SHIFT)
        | (u64::from(op & abi::ARX_FLAG_OP_MASK) << abi::ARX_FLAG_OP_SHIFT)
        | (u64::from(dtype & abi::ARX_FLAG_DTYPE_MASK) << abi::ARX_FLAG_DTYPE_SHIFT)
        | (count as u64 & u64::from(abi::ARX_FLAG_COUNT_MASK))
}

/// The seq bits of a flag word.
pub fn flag_seq(flag: u64) -> u32 {
    (flag >> abi::ARX_FLAG_SEQ_SHIFT) as u32
}

/// The dtype (without the op bits above it) and the element count of a
/// flag word (of a chunk, for a call longer than one slot: without
/// `ARX_FLAG_MORE`, see [`flag_more`], and without the pattern, see
/// [`flag_pattern`]).
pub fn flag_call(flag: u64) -> (u32, usize) {
    (
        ((flag >> abi::ARX_FLAG_DTYPE_SHIFT) as u32) & abi::ARX_FLAG_DTYPE_MASK,
        (flag & u64::from(abi::ARX_FLAG_ELEMS_MASK)) as usize,
    )
}

/// The pattern (`ARX_PATTERN_*`) of a flag word: which bytes of the
/// sender's partial each peer gets.
pub fn flag_pattern(flag: u64) -> u32 {
    (flag >> abi::ARX_FLAG_PATTERN_SHIFT) as u32 & abi::ARX_FLAG_PATTERN_MASK
}

/// The op field of a flag word (`ARX_OP_*`; of a broadcast,
/// `ARX_BCAST_ROOT` when the sender is the root).
pub fn flag_op(flag: u64) -> u32 {
    (flag >> abi::ARX_FLAG_OP_SHIFT) as u32 & abi::ARX_FLAG_OP_MASK
}

/// The flag word `src` announces for call `seq`, chunk of `count`
/// elements of `dtype`, of a broadcast from `root` (`more`: more chunks
/// follow): the count is every rank's, the root bit only the root's.
pub fn bcast_flag(seq: u64, dtype: u32, count: usize, more: bool, src: usize, root: usize) -> u64 {
    let role = if src == root { abi::ARX_BCAST_ROOT } else { 0 };
    flag_word_op(
        seq,
        dtype,
        role,
        count_field(count, more, abi::ARX_PATTERN_BCAST),
    )
}

/// The count field of a flag word: `count` elements (at most
/// `ARX_MAX_CHUNK`), `ARX_FLAG_MORE` if more chunks of the same call
/// follow, and the call's `pattern`.
pub fn count_field(count: usize, more: bool, pattern: u32) -> usize {
    debug_assert!(count <= abi::ARX_MAX_CHUNK as usize);
    let more = if more { abi::ARX_FLAG_MORE as usize } else { 0 };
    let pattern = ((pattern & abi::ARX_FLAG_PATTERN_MASK) << abi::ARX_FLAG_PATTERN_SHIFT) as usize;
    (count & abi::ARX_FLAG_ELEMS_MASK as usize) | more | pattern
}

/// Bytes per element of the dtype code (0 for `INVALID` and unknown codes:
/// such a call carries no data).
pub(crate) fn elem_size(dtype: u32) -> usize {
    match dtype {
        abi::ARX_DTYPE_BF16 | abi::ARX_DTYPE_F16 => 2,
        abi::ARX_DTYPE_F32 => 4,
        _ => 0,
    }
}

/// Shard `q` of a `count`-element call over `world` ranks, in elements
/// (`kernels/arx_abi.h`, "Shards"): exact blocks when `world` divides
/// `count` (reduce_scatter and all_gather), else blocks of
/// `ceil(count / world)` rounded up to 16 bytes, the last ones shorter or
/// empty.
pub(crate) fn shard(count: usize, world: usize, esize: usize, q: usize) -> Range<usize> {
    let world = world.max(1);
    // `count / world * world == count`, not `is_multiple_of`: the crate's
    // rust-version (1.80) predates it; the loom crate lints without one.
    let len = if count / world * world == count {
        count / world
    } else {
        let a = (abi::ARX_LANE_ALIGN as usize / esize.max(1)).max(1);
        count.div_ceil(world).div_ceil(a) * a
    };
    count.min(q * len)..count.min((q + 1) * len)
}

/// Whether a flag word's chunk sits in the second half of its slots
/// (`ARX_FLAG_HIGH`).
pub fn flag_high(flag: u64) -> bool {
    flag & u64::from(abi::ARX_FLAG_HIGH) != 0
}

/// Where the data of the call with flag word `flag` starts in its slots of
/// `slot` bytes: half a slot in for a chunk with `ARX_FLAG_HIGH`, else 0.
pub(crate) fn data_base(flag: u64, slot: usize) -> usize {
    if flag_high(flag) {
        slot / 2
    } else {
        0
    }
}

/// [`dest_range`] placed in the slots: within the first `cap` bytes of the
/// partial (what the sender published; the slot for a relay, which does not
/// know it), moved to where the call's data sits ([`data_base`]), and never
/// past the slot. What a fabric copies from the sender's `send[p]` into the
/// receiver's `recv[p][src]` (the same offsets in both).
pub(crate) fn placed_range(
    flag: u64,
    world: usize,
    src: usize,
    dst: usize,
    cap: usize,
    slot: usize,
) -> Range<usize> {
    let r = dest_range(flag, world, src, dst);
    let base = data_base(flag, slot);
    let end = |x: usize| (base + x.min(cap)).min(slot);
    end(r.start)..end(r.end)
}

/// The bytes of rank `src`'s partial that its call with flag word `flag`
/// gives rank `dst` (the call's pattern), at the same offsets in `dst`'s
/// `recv[p][src]`. Empty for a call that carries no data (refused,
/// poisoned).
pub(crate) fn dest_range(flag: u64, world: usize, src: usize, dst: usize) -> Range<usize> {
    let (dtype, count) = flag_call(flag);
    let esize = elem_size(dtype);
    if esize == 0 {
        return 0..0;
    }
    let elems = match flag_pattern(flag) {
        abi::ARX_PATTERN_WHOLE => 0..count,
        abi::ARX_PATTERN_SCATTER => shard(count, world, esize, dst),
        abi::ARX_PATTERN_GATHER => shard(count, world, esize, src),
        // Only the root's partial travels; every other rank announces the
        // count with no data.
        abi::ARX_PATTERN_BCAST if flag_op(flag) == abi::ARX_BCAST_ROOT => 0..count,
        _ => 0..0,
    };
    elems.start * esize..elems.end * esize
}

/// The part of `range` that travels on `lane` ([`lane_range`] of its
/// length, at its offset).
pub(crate) fn lane_part(range: &Range<usize>, lane: usize) -> Range<usize> {
    let r = lane_range(range.len(), lane);
    range.start + r.start..range.start + r.end
}

/// Whether a flag word announces a chunk after which more chunks of the
/// same call follow (`ARX_FLAG_MORE`).
pub fn flag_more(flag: u64) -> bool {
    flag & u64::from(abi::ARX_FLAG_MORE) != 0
}

/// The bytes of a `bytes`-long partial that travel on `lane`: the first half
/// (rounded up to `ARX_LANE_ALIGN`) on lane 0, the rest on lane 1. A lane
/// may carry nothing for tiny partials; its flag is sent all the same.
pub(crate) fn lane_range(bytes: usize, lane: usize) -> Range<usize> {
    let a = abi::ARX_LANE_ALIGN as usize;
    let half = bytes.div_ceil(2).div_ceil(a).saturating_mul(a).min(bytes);
    match lane {
        0 => 0..half,
        _ => half..bytes,
    }
}

/// Step 1 without data: announces call `seq` with its flag word and byte
/// count (a refused call: dtype `INVALID`, 0 bytes). The partial, if any, is
/// already in `send[seq & 1]`.
pub(crate) fn publish<C: Control + ?Sized>(c: &C, seq: u64, flag: u64, bytes: usize) {
    let p = parity(seq);
    // Relaxed: the proxy reads these two only after an Acquire load of `seq`
    // that saw this call (or a later one), which the Release store below
    // orders after them; they are not written again before call seq + 2 is
    // published, which needs this call posted (rule 5).
    c.word(Word::Meta(p)).store(flag, Ordering::Relaxed);
    c.word(Word::Bytes(p))
        .store(bytes as u64, Ordering::Relaxed);
    // Release: the proxy that acquires `seq` copies the partial staged in
    // send[p] and sends meta[p]; both were written before this store.
    c.word(Word::Seq).store(seq, Ordering::Release);
}

/// Step 1: copies this rank's partial of call `seq` into `send[seq & 1]`
/// (at [`data_base`]) and publishes the call.
///
/// # Safety
/// As [`Memory::write_send`]: the slot is the caller's.
pub(crate) unsafe fn stage_and_publish<M: Memory + ?Sized>(m: &M, seq: u64, flag: u64, src: &[u8]) {
    // SAFETY: the caller's contract (the chunk's place, `data_base`, is
    // part of the call's slot).
    unsafe { m.write_send(parity(seq), data_base(flag, m.slot_bytes()), src) };
    publish(m, seq, flag, src.len());
}

/// Step 2 (the proxy): the last call published.
pub(crate) fn published<C: Control + ?Sized>(c: &C) -> u64 {
    // Acquire: pairs with publish's Release store; every call up to the one
    // seen here has its partial, flag word and byte count visible to this
    // thread, which copies and sends them next.
    c.word(Word::Seq).load(Ordering::Acquire)
}

/// Step 2 (the proxy): the flag word and byte count call `seq` announced,
/// for a `seq` that [`published`] has returned (or passed).
pub(crate) fn announced<C: Control + ?Sized>(c: &C, seq: u64) -> (u64, u64) {
    let p = parity(seq);
    // Relaxed: ordered after this thread's Acquire load of `seq` in
    // `published` (see `publish`).
    (
        c.word(Word::Meta(p)).load(Ordering::Relaxed),
        c.word(Word::Bytes(p)).load(Ordering::Relaxed),
    )
}

/// Step 2 on shared memory (the Shm fabric): sends call `seq` — the bytes
/// of this rank's `send[seq & 1]` that the flag word's pattern gives each
/// peer ([`dest_range`], within the call's `bytes`) and the flag word
/// `flag` — to every `(rank, memory)` in `peers` of a `world`-rank
/// communicator, in the order given (`r+1, r+2, …`), lane by lane: the
/// lane's part into the peer's `recv[p][me]` at the same offsets, then the
/// lane's flag.
///
/// # Safety
/// Call `seq` was published and is the next call in order (every earlier
/// call was posted): the sender's slot holds it, and each peer reads its
/// `recv[p][me]` only after the flag (see [`Memory::copy_send`]).
pub(crate) unsafe fn post_shm<M: Memory>(
    mine: &M,
    me: usize,
    world: usize,
    peers: impl IntoIterator<Item = (usize, M)>,
    seq: u64,
    bytes: usize,
    flag: u64,
) {
    let p = parity(seq);
    let slot = mine.slot_bytes();
    for (q, peer) in peers {
        let range = placed_range(flag, world, me, q, bytes, slot);
        for lane in 0..LANES {
            let r = lane_part(&range, lane);
            // SAFETY: the caller's contract.
            unsafe { mine.copy_send(p, r, &peer, me) };
            // Release: the peer acquires this flag and then reads the bytes
            // copied just above; without it the flag could become visible
            // before the data, and the peer would sum call seq - 2's bytes.
            peer.flag(p, me, lane).store(flag, Ordering::Release);
        }
    }
}

/// One piece of a post split among several copying threads (the Shm
/// fabric's copy crew, `fabric::shm`): `range` of this rank's
/// `send[p]` into peer `peer`'s `recv[p][me]`, part of lane `lane`'s
/// bytes; `unit` numbers the (peer, lane) pair whose flag follows the
/// last of its pieces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Piece {
    /// The peer's rank.
    pub peer: usize,
    /// The lane whose flag follows.
    pub lane: usize,
    /// `peer_index * LANES + lane`, in the order of `peers`.
    pub unit: usize,
    /// Bytes of the slot (the same offsets on both sides).
    pub range: Range<usize>,
}

/// [`post_shm`]'s work cut into pieces of at most `piece` bytes (at least
/// one), unit by unit in [`post_shm`]'s order (peers as given, then lanes),
/// with the number of pieces of every unit. A unit with no bytes (a lane of
/// an empty or short partial) is one empty piece: its flag still goes.
pub(crate) fn split_post(
    me: usize,
    world: usize,
    peers: &[usize],
    bytes: usize,
    flag: u64,
    slot: usize,
    piece: usize,
) -> (Vec<Piece>, Vec<u32>) {
    let piece = piece.max(1);
    let mut pieces = Vec::new();
    let mut per_unit = Vec::with_capacity(peers.len() * LANES);
    for (i, &q) in peers.iter().enumerate() {
        let range = placed_range(flag, world, me, q, bytes, slot);
        for lane in 0..LANES {
            let r = lane_part(&range, lane);
            let unit = i * LANES + lane;
            let n = r.len().div_ceil(piece).max(1);
            for k in 0..n {
                let start = (r.start + k * piece).min(r.end);
                let end = (start + piece).min(r.end);
                pieces.push(Piece {
                    peer: q,
                    lane,
                    unit,
                    range: start..end,
                });
            }
            per_unit.push(n as u32);
        }
    }
    (pieces, per_unit)
}

/// Step 2 by several threads: copies one [`Piece`] of the call whose flag
/// word is `flag` into `peer`, then, if it was the last piece of its unit to finish (`left`,
/// the unit's count of unfinished pieces, set to its piece count before any
/// piece was handed out, reaches 0) and the post was not given up
/// (`abandoned` still 0), stores the unit's flag. Returns whether it did.
///
/// # Safety
/// [`post_shm`]'s contract, and each piece is copied once. Where the poster
/// gives up waiting for a piece (and lets the device side reuse the send
/// slot), it sets `abandoned` first: a copy that may have read the reused
/// slot then never gets its flag.
pub(crate) unsafe fn post_piece<M: Memory>(
    mine: &M,
    me: usize,
    peer: &M,
    piece: &Piece,
    flag: u64,
    left: &AtomicU32,
    abandoned: &AtomicU32,
) -> bool {
    // The call's parity, from the seq bits of its flag word.
    let p = parity(u64::from(flag_seq(flag)));
    // SAFETY: the caller's contract.
    unsafe { mine.copy_send(p, piece.range.clone(), peer, me) };
    // AcqRel: Release hands this thread's copy to whichever thread ends the
    // unit (the decrements form one release sequence); Acquire, when this
    // is the unit's last piece, takes every other piece's copy, so that the
    // Release flag store below covers them all. With Relaxed a peer that
    // acquired the flag could read a piece another thread had not finished.
    // SeqCst on `abandoned` (both sides): either this load comes first in
    // the total order and every copy of the unit was done before the poster
    // gave up, or it sees the abandonment.
    if left.fetch_sub(1, Ordering::AcqRel) == 1 && abandoned.load(Ordering::SeqCst) == 0 {
        // Release: as in `post_shm`.
        peer.flag(p, me, piece.lane).store(flag, Ordering::Release);
        return true;
    }
    false
}

/// What a reader found in one flag (see [`look`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Look {
    /// The peer's flag for this call is not there yet (its word now).
    Missing(u64),
    /// It is there and agrees: the lane's data may be read.
    Arrived,
    /// A word for this call that is not this rank's flag word: another
    /// count or dtype, a refused call (dtype `INVALID`), or a poisoned flag
    /// (the peer's fabric failed) — also one for call `seq + 2`, which only
    /// a poisoned flag can be. The call must fail naming the peer.
    Mismatch(u64),
}

/// Step 3: the flag rank `src` wrote for `lane` of call `seq`, judged
/// against this rank's own flag word `flag` for the call.
pub(crate) fn look<M: Memory + ?Sized>(
    m: &M,
    seq: u64,
    flag: u64,
    src: usize,
    lane: usize,
) -> Look {
    // Acquire: pairs with the sender's Release store of the flag (post_shm;
    // over RDMA the NIC writes the flag after the data on one RC QP, and this
    // load keeps the reads of the slot after it): the lane's data, read next,
    // is this call's.
    let f = m.flag(parity(seq), src, lane).load(Ordering::Acquire);
    judge(f, seq, flag)
}

/// [`look`]'s verdict on the word `f` read from a flag.
pub(crate) fn judge(f: u64, seq: u64, flag: u64) -> Look {
    let s = flag_seq(f);
    if s == seq as u32 {
        if f == flag {
            Look::Arrived
        } else {
            Look::Mismatch(f)
        }
    } else if s == (seq as u32).wrapping_add(2) {
        // Two calls ahead, on this call's parity: no healthy peer gets there
        // (it would need this rank's flag of call seq + 1, sent after this
        // call ends), but a peer whose fabric failed in call seq + 1 poisons
        // seq + 1 and seq + 2, and the poison for seq + 2 overwrites its flag
        // of this call if this rank had not read it yet. Waiting for the
        // flag of this call would then last until the timeout.
        Look::Mismatch(f)
    } else {
        Look::Missing(f)
    }
}

/// Step 4 (the proxy): every call up to `sent` no longer needs its send
/// slot (its writes completed locally, or the proxy failed and will read
/// nothing more).
pub(crate) fn release_sent<C: Control + ?Sized>(c: &C, sent: u64) {
    // Release: the device side that acquires `sent` overwrites the send
    // slots of these calls next (copy-engine staging writes both); the
    // proxy's reads of them (the Shm copies; for Verbs, the reaping of the
    // completions that say the NIC's reads are done) come before this store
    // and must stay before it.
    c.word(Word::Sent).store(sent, Ordering::Release);
}

/// Step 4 (the device side): the last call whose send slots the proxy no
/// longer reads.
pub(crate) fn sent_through<C: Control + ?Sized>(c: &C) -> u64 {
    // Acquire: pairs with release_sent's Release store; the caller
    // overwrites the send slots once this says so.
    c.word(Word::Sent).load(Ordering::Acquire)
}

/// Raises the abort word: the device side stops waiting and fails the call.
pub(crate) fn raise_abort<C: Control + ?Sized>(c: &C) {
    // Release: whoever sees the word then asks for the error that explains
    // it (the proxy's record, written before this store); without it the
    // device side could see the abort and not yet the error.
    c.word32(Word32::Abort).store(1, Ordering::Release);
}

/// True once the abort word is raised.
pub(crate) fn aborted<C: Control + ?Sized>(c: &C) -> bool {
    // Acquire: pairs with raise_abort (see there).
    c.word32(Word32::Abort).load(Ordering::Acquire) != 0
}

/// A failure as recorded in the control block (see [`record`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Recorded {
    /// `ARX_STATUS_*`.
    pub code: u32,
    /// The peer whose flag was missing or wrong (this rank: its own sends).
    pub peer: u32,
    /// Its lane (`u32::MAX`: no lane).
    pub lane: u32,
    /// The call.
    pub seq: u64,
    /// The flag word seen (or 0).
    pub flag: u64,
}

/// Records a failure unless one was recorded before (the first one stays),
/// the way the kernel's `arx_fail` does.
pub(crate) fn record<C: Control + ?Sized>(
    c: &C,
    code: u32,
    peer: u32,
    lane: u32,
    seq: u64,
    flag: u64,
) {
    // Relaxed: the compare-exchange is atomic whatever its ordering, so one
    // recorder alone wins the claim and writes the details; nothing is read
    // after it. The details are published by the Release store of the code.
    if c.word32(Word32::Status)
        .compare_exchange(0, u32::MAX, Ordering::Relaxed, Ordering::Relaxed)
        .is_err()
    {
        return;
    }
    // Relaxed: published by the Release store below.
    c.word32(Word32::ErrPeer).store(peer, Ordering::Relaxed);
    c.word32(Word32::ErrLane).store(lane, Ordering::Relaxed);
    c.word(Word::ErrSeq).store(seq, Ordering::Relaxed);
    c.word(Word::ErrFlag).store(flag, Ordering::Relaxed);
    // Release: a reader that sees the code sees the details above.
    c.word32(Word32::Status).store(code, Ordering::Release);
}

/// The failure recorded in the control block, if one is complete.
pub(crate) fn recorded<C: Control + ?Sized>(c: &C) -> Option<Recorded> {
    // Acquire: pairs with record's Release store of the code, so the
    // details read below are that failure's.
    let code = c.word32(Word32::Status).load(Ordering::Acquire);
    if code == abi::ARX_STATUS_OK || code == u32::MAX {
        // u32::MAX: being recorded; the code follows.
        return None;
    }
    // Relaxed: ordered after the Acquire load above.
    Some(Recorded {
        code,
        peer: c.word32(Word32::ErrPeer).load(Ordering::Relaxed),
        lane: c.word32(Word32::ErrLane).load(Ordering::Relaxed),
        seq: c.word(Word::ErrSeq).load(Ordering::Relaxed),
        flag: c.word(Word::ErrFlag).load(Ordering::Relaxed),
    })
}
