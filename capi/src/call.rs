//! The all-reduce, reduce-scatter, all-gather and broadcast calls: the
//! arguments C
//! can get wrong on their face are checked here, before anything
//! collective happens (the call is then not made: it does not count, the
//! comm stays usable, and no peer is told). The one exception is the
//! layout of a reduce-scatter's or all-gather's buffers ([`Blocks::layout`]),
//! which depends on the rank and is refused on every rank at once (see
//! `blocks_layout` in lib.rs). Any count is passed on: arx runs a count
//! beyond the slot as chunks, and ranks whose counts differ (also only in
//! the total of a chunked call) all fail at once with a mismatch.

use std::ffi::c_void;

use arx::{Arx, Dtype, Element, Op};
use half::{bf16, f16};

use crate::error::Failure;
use crate::types::{arxDataType_t, arxRedOp_t, cudaStream_t, RawDataType, RawRedOp};

/// The dtype of a C datatype value.
pub(crate) fn dtype(d: RawDataType) -> Result<Dtype, Failure> {
    match d {
        x if x == arxDataType_t::arxFloat32 as RawDataType => Ok(Dtype::F32),
        x if x == arxDataType_t::arxFloat16 as RawDataType => Ok(Dtype::F16),
        x if x == arxDataType_t::arxBfloat16 as RawDataType => Ok(Dtype::Bf16),
        x => Err(Failure::invalid(format!(
            "datatype {x} is not an arxDataType_t (arxFloat32, arxFloat16, arxBfloat16)"
        ))),
    }
}

/// The operation of a C op value.
pub(crate) fn op(o: RawRedOp) -> Result<Op, Failure> {
    match o {
        x if x == arxRedOp_t::arxSum as RawRedOp => Ok(Op::Sum),
        x if x == arxRedOp_t::arxMax as RawRedOp => Ok(Op::Max),
        x if x == arxRedOp_t::arxMin as RawRedOp => Ok(Op::Min),
        x if x == arxRedOp_t::arxAvg as RawRedOp => Ok(Op::Avg),
        x => Err(Failure::invalid(format!(
            "op {x} is not an arxRedOp_t (arxSum, arxMax, arxMin, arxAvg)"
        ))),
    }
}

/// The addresses of `sendbuff` and `recvbuff`: NULL is refused unless the
/// call is `empty` (count 0, as NCCL accepts), where a NULL buffer stands
/// for no memory and becomes the element size itself: a non-NULL address
/// aligned to the element, as a Rust slice of no elements needs (nothing is
/// ever read or written through it), and equal for two NULLs (in place).
fn addresses(
    send: *const c_void,
    recv: *mut c_void,
    empty: bool,
    dtype: Dtype,
) -> Result<(usize, usize), Failure> {
    let none = dtype.size();
    match (send.is_null(), recv.is_null()) {
        (false, false) => Ok((send as usize, recv as usize)),
        (sn, rn) if empty => Ok((
            if sn { none } else { send as usize },
            if rn { none } else { recv as usize },
        )),
        (sn, _) => Err(Failure::invalid(format!(
            "{} is NULL (NULL is accepted with count 0 only)",
            if sn { "sendbuff" } else { "recvbuff" }
        ))),
    }
}

/// The buffers of one call, checked: both non-NULL (or count 0), `count` elements in
/// bytes without overflow, and either the same address (in place) or
/// disjoint.
pub(crate) struct Buffers {
    pub op: Op,
    pub send: usize,
    pub recv: usize,
    pub count: usize,
    pub dtype: Dtype,
}

impl Buffers {
    pub(crate) fn check(
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: Dtype,
        op: Op,
    ) -> Result<Self, Failure> {
        let (s, r) = addresses(send, recv, count == 0, dtype)?;
        let bytes = count
            .checked_mul(dtype.size())
            .filter(|b| *b <= isize::MAX as usize)
            .filter(|b| s.checked_add(*b).is_some() && r.checked_add(*b).is_some())
            .ok_or_else(|| {
                Failure::invalid(format!(
                    "count {count} of {} overflows the address space",
                    dtype.name()
                ))
            })?;
        if s != r && s < r + bytes && r < s + bytes {
            return Err(Failure::invalid(format!(
                "sendbuff {send:p} and recvbuff {recv:p} overlap without being equal \
                 ({bytes} bytes each; equal pointers mean in place)"
            )));
        }
        Ok(Buffers {
            op,
            send: s,
            recv: r,
            count,
            dtype,
        })
    }

    fn in_place(&self) -> bool {
        self.send == self.recv
    }
}

/// `arxAllReduceHost` on checked buffers.
///
/// # Safety
/// The buffers are host memory readable (send) and writable (recv) for
/// `count` elements, not accessed by anything else during the call.
pub(crate) unsafe fn host(arx: &mut Arx, b: &Buffers) -> Result<(), Failure> {
    // SAFETY: passed on.
    unsafe {
        match b.dtype {
            Dtype::F32 => host_typed::<f32>(arx, b),
            Dtype::F16 => host_typed::<f16>(arx, b),
            Dtype::Bf16 => host_typed::<bf16>(arx, b),
        }
    }
}

/// # Safety
/// As [`host`], with `T` the element type of `b.dtype`.
unsafe fn host_typed<T: Element>(arx: &mut Arx, b: &Buffers) -> Result<(), Failure> {
    let align = std::mem::align_of::<T>();
    if b.send % align != 0 || b.recv % align != 0 {
        return Err(Failure::invalid(format!(
            "sendbuff {:#x} or recvbuff {:#x} is not aligned to {align} bytes, the alignment of {}",
            b.send,
            b.recv,
            b.dtype.name()
        )));
    }
    // SAFETY: non-NULL, aligned, `count` elements (checked to fit in
    // isize), valid and unshared for the call (the caller's contract).
    let out = unsafe { std::slice::from_raw_parts_mut(b.recv as *mut T, b.count) };
    let r = if b.in_place() {
        arx.allreduce_host_in_place_op(out, b.op)
    } else {
        // SAFETY: as `out`; disjoint from it (checked).
        let input = unsafe { std::slice::from_raw_parts(b.send as *const T, b.count) };
        arx.allreduce_host_op(input, out, b.op)
    };
    r.map_err(Failure::from)
}

/// `arxAllReduce` on checked device buffers, enqueued on `stream`.
///
/// # Safety
/// The buffers are device memory of the comm's CUDA device valid for
/// `count` elements until the call completes on `stream`, a live stream of
/// that device (or a CUDA special stream handle).
pub(crate) unsafe fn device(
    arx: &mut Arx,
    b: &Buffers,
    stream: cudaStream_t,
) -> Result<(), Failure> {
    // SAFETY: the caller's contract is `allreduce_raw`'s; the runtime's
    // `cudaStream_t` and the driver's `CUstream` are the same handle.
    unsafe {
        arx.allreduce_raw_op(
            b.send as u64,
            b.recv as u64,
            b.count,
            b.dtype,
            b.op,
            stream.cast(),
        )
    }
    .map_err(Failure::from)
}

/// Enqueues a reduce-scatter or all-gather on device memory.
///
/// # Safety
/// As `Arx::reduce_scatter_raw` / `all_gather_raw`: the buffers are device
/// memory of the comm's context, sized as `b` says, and `stream` is live.
pub(crate) unsafe fn device_blocks(
    arx: &mut Arx,
    b: &Blocks,
    stream: cudaStream_t,
) -> Result<(), Failure> {
    // SAFETY: the caller's contract; the runtime's `cudaStream_t` and the
    // driver's `CUstream` are the same handle.
    unsafe {
        match b.coll {
            Coll::ReduceScatter => arx.reduce_scatter_raw(
                b.send as u64,
                b.recv as u64,
                b.n,
                b.dtype,
                b.op,
                stream.cast(),
            ),
            Coll::AllGather => {
                arx.all_gather_raw(b.send as u64, b.recv as u64, b.n, b.dtype, stream.cast())
            }
        }
    }
    .map_err(Failure::from)
}

/// Which of NCCL's block collectives a call is.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Coll {
    /// `recvbuff` (`n`) gets this rank's block of the reduction of every
    /// rank's `sendbuff` (`world × n`).
    ReduceScatter,
    /// `recvbuff` (`world × n`) gets every rank's `sendbuff` (`n`) in rank
    /// order.
    AllGather,
}

impl Coll {
    fn name(self) -> &'static str {
        match self {
            Coll::ReduceScatter => "reduce-scatter",
            Coll::AllGather => "all-gather",
        }
    }
}

/// The buffers of a reduce-scatter or all-gather, checked on their face
/// (non-NULL, `world × n` elements in bytes without overflow) by
/// [`Blocks::check`]; their layout (in place or disjoint) by
/// [`Blocks::layout`].
pub(crate) struct Blocks {
    pub coll: Coll,
    pub op: Op,
    pub send: usize,
    pub recv: usize,
    /// Elements per rank: `recvcount` of a reduce-scatter, `sendcount` of
    /// an all-gather.
    pub n: usize,
    pub dtype: Dtype,
    world: usize,
    rank: usize,
    /// Bytes of one block, and of `world` blocks.
    block: usize,
    whole: usize,
    in_place: bool,
}

impl Blocks {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check(
        coll: Coll,
        send: *const c_void,
        recv: *mut c_void,
        n: usize,
        dtype: Dtype,
        op: Op,
        world: usize,
        rank: usize,
    ) -> Result<Self, Failure> {
        let (s, r) = addresses(send, recv, n == 0, dtype)?;
        // The world-sized buffer: sendbuff of a reduce-scatter, recvbuff of
        // an all-gather.
        let big = if coll == Coll::ReduceScatter { s } else { r };
        let sizes = n.checked_mul(dtype.size()).and_then(|block| {
            let whole = block.checked_mul(world)?;
            let small = if big == s { r } else { s };
            (whole <= isize::MAX as usize
                && big.checked_add(whole).is_some()
                && small.checked_add(block).is_some())
            .then_some((block, whole))
        });
        let (block, whole) = sizes.ok_or_else(|| {
            Failure::invalid(format!(
                "count {n} of {} x {world} ranks overflows the address space",
                dtype.name()
            ))
        })?;
        Ok(Blocks {
            coll,
            op,
            send: s,
            recv: r,
            n,
            dtype,
            world,
            rank,
            block,
            whole,
            in_place: false,
        })
    }

    /// Whether the buffers are in place as NCCL defines it (the
    /// `n`-element buffer is this rank's block of the other), disjoint
    /// (`Ok`), or overlap otherwise (`Err`, the message). The answer
    /// depends on the rank: `recvbuff == sendbuff` is in place on rank 0
    /// only.
    pub(crate) fn layout(&mut self) -> Result<(), String> {
        let (big, small) = match self.coll {
            Coll::ReduceScatter => (self.send, self.recv),
            Coll::AllGather => (self.recv, self.send),
        };
        let mine = big + self.rank * self.block;
        if small == mine {
            self.in_place = true;
            return Ok(());
        }
        let overlap = self.block > 0 && small < big + self.whole && big < small + self.block;
        if !overlap {
            return Ok(());
        }
        let rule = match self.coll {
            Coll::ReduceScatter => "recvbuff == sendbuff + rank * recvcount",
            Coll::AllGather => "sendbuff == recvbuff + rank * sendcount",
        };
        Err(format!(
            "{}: sendbuff {:#x} and recvbuff {:#x} overlap, but not in place for rank {} \
             ({rule} is in place, here {mine:#x}; {} elements of {} per rank, {} ranks)",
            self.coll.name(),
            self.send,
            self.recv,
            self.rank,
            self.n,
            self.dtype.name(),
            self.world
        ))
    }

    /// Host buffers must be aligned to their element (a Rust slice over
    /// them must be).
    pub(crate) fn aligned(&self) -> Result<(), Failure> {
        let align = self.dtype.size();
        if self.send % align != 0 || self.recv % align != 0 {
            return Err(Failure::invalid(format!(
                "sendbuff {:#x} or recvbuff {:#x} is not aligned to {align} bytes, the alignment of {}",
                self.send,
                self.recv,
                self.dtype.name()
            )));
        }
        Ok(())
    }

    /// Whether [`Blocks::layout`] found the buffers in place.
    #[cfg(test)]
    pub(crate) fn in_place(&self) -> bool {
        self.in_place
    }
}

/// `arxReduceScatterHost` / `arxAllGatherHost` on buffers checked by
/// [`Blocks::check`], [`Blocks::aligned`] and [`Blocks::layout`].
///
/// # Safety
/// The buffers are host memory, the one of `world × n` elements readable
/// (and writable in place) and the other readable (send) or writable
/// (recv), not accessed by anything else during the call.
pub(crate) unsafe fn host_blocks(arx: &mut Arx, b: &Blocks) -> Result<(), Failure> {
    // SAFETY: passed on.
    unsafe {
        match b.dtype {
            Dtype::F32 => blocks_typed::<f32>(arx, b),
            Dtype::F16 => blocks_typed::<f16>(arx, b),
            Dtype::Bf16 => blocks_typed::<bf16>(arx, b),
        }
    }
}

/// # Safety
/// As [`host_blocks`], with `T` the element type of `b.dtype`.
unsafe fn blocks_typed<T: Element>(arx: &mut Arx, b: &Blocks) -> Result<(), Failure> {
    let (n, all) = (b.n, b.n * b.world);
    let r = match (b.coll, b.in_place) {
        (Coll::ReduceScatter, true) => {
            // SAFETY: `all` elements from sendbuff (checked to fit), aligned,
            // which the caller lets this call write in place (recvbuff is
            // its block), unshared for the call.
            let buf = unsafe { std::slice::from_raw_parts_mut(b.send as *mut T, all) };
            arx.reduce_scatter_host_in_place_op(buf, b.op)
        }
        (Coll::ReduceScatter, false) => {
            // SAFETY: aligned, sized as checked, disjoint (checked by
            // `layout`), valid and unshared for the call.
            let (input, out) = unsafe {
                (
                    std::slice::from_raw_parts(b.send as *const T, all),
                    std::slice::from_raw_parts_mut(b.recv as *mut T, n),
                )
            };
            arx.reduce_scatter_host_op(input, out, b.op)
        }
        (Coll::AllGather, true) => {
            // SAFETY: `all` writable elements at recvbuff (sendbuff is its
            // block), aligned, unshared for the call.
            let buf = unsafe { std::slice::from_raw_parts_mut(b.recv as *mut T, all) };
            arx.all_gather_host_in_place(buf)
        }
        (Coll::AllGather, false) => {
            // SAFETY: as the reduce-scatter's, sizes swapped.
            let (input, out) = unsafe {
                (
                    std::slice::from_raw_parts(b.send as *const T, n),
                    std::slice::from_raw_parts_mut(b.recv as *mut T, all),
                )
            };
            arx.all_gather_host(input, out)
        }
    };
    r.map_err(Failure::from)
}

/// `arxBroadcast` on checked device buffers from `root` (a rank: checked by
/// `broadcast_raw`, which refuses it on every rank otherwise), enqueued on
/// `stream`.
///
/// # Safety
/// As [`device`]; `sendbuff` is read on the root only.
pub(crate) unsafe fn device_bcast(
    arx: &mut Arx,
    b: &Buffers,
    root: usize,
    stream: cudaStream_t,
) -> Result<(), Failure> {
    // SAFETY: the caller's contract is `broadcast_raw`'s; the runtime's
    // `cudaStream_t` and the driver's `CUstream` are the same handle.
    unsafe {
        arx.broadcast_raw(
            b.send as u64,
            b.recv as u64,
            b.count,
            b.dtype,
            root,
            stream.cast(),
        )
    }
    .map_err(Failure::from)
}

/// `arxBroadcastHost` on checked buffers from `root` (refused on every
/// rank by `broadcast_host` if it is no rank).
///
/// # Safety
/// As [`host`]; `sendbuff` is read on the root only.
pub(crate) unsafe fn host_bcast(arx: &mut Arx, b: &Buffers, root: usize) -> Result<(), Failure> {
    // SAFETY: passed on.
    unsafe {
        match b.dtype {
            Dtype::F32 => bcast_typed::<f32>(arx, b, root),
            Dtype::F16 => bcast_typed::<f16>(arx, b, root),
            Dtype::Bf16 => bcast_typed::<bf16>(arx, b, root),
        }
    }
}

/// # Safety
/// As [`host_bcast`], with `T` the element type of `b.dtype`.
unsafe fn bcast_typed<T: Element>(arx: &mut Arx, b: &Buffers, root: usize) -> Result<(), Failure> {
    let align = std::mem::align_of::<T>();
    if b.send % align != 0 || b.recv % align != 0 {
        return Err(Failure::invalid(format!(
            "sendbuff {:#x} or recvbuff {:#x} is not aligned to {align} bytes, the alignment of {}",
            b.send,
            b.recv,
            b.dtype.name()
        )));
    }
    // SAFETY: non-NULL, aligned, `count` elements (checked to fit in
    // isize), valid and unshared for the call (the caller's contract).
    let out = unsafe { std::slice::from_raw_parts_mut(b.recv as *mut T, b.count) };
    let r = if b.in_place() {
        arx.broadcast_host_in_place(out, root)
    } else {
        // SAFETY: as `out`; disjoint from it (checked).
        let input = unsafe { std::slice::from_raw_parts(b.send as *const T, b.count) };
        arx.broadcast_host(input, out, root)
    };
    r.map_err(Failure::from)
}
