//! The all-reduce calls: the arguments C can get wrong on their face are
//! checked here, before anything collective happens (the call is then not
//! made: it does not count, the comm stays usable, and no peer is told).
//! Any count is passed on: arx runs a count beyond the slot as chunks of
//! one slot, and ranks whose counts differ (also only in the total of a
//! chunked call) all fail at once with a mismatch.

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

/// The buffers of one call, checked: both non-NULL, `count` elements in
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
        if send.is_null() || recv.is_null() {
            return Err(Failure::invalid(format!(
                "{} is NULL",
                if send.is_null() {
                    "sendbuff"
                } else {
                    "recvbuff"
                }
            )));
        }
        let (s, r) = (send as usize, recv as usize);
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
