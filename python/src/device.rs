//! GPU calls on device addresses (torch tensors, CuPy arrays): the checks
//! arx cannot make on raw addresses (the instance's side, the memory's
//! device, the element type, overlap), then `Arx::allreduce_raw`.

use arx::cudarc::driver::sys;
use arx::{Arx, Dtype, Error};

use crate::host::overlap;

pub(crate) struct DeviceCall {
    input: u64,
    out: u64,
    count: usize,
    dtype: Dtype,
}

fn dtype(name: &str, what: &str) -> Result<Dtype, Error> {
    match name {
        "float32" => Ok(Dtype::F32),
        "float16" => Ok(Dtype::F16),
        "bfloat16" => Ok(Dtype::Bf16),
        other => Err(Error::InvalidArgument(format!(
            "{what} has dtype {other}: arx reduces float32, float16 and bfloat16"
        ))),
    }
}

/// The CUDA device `addr` belongs to, as the driver sees it.
fn device_of(addr: u64, what: &str) -> Result<usize, Error> {
    let mut ordinal: std::os::raw::c_int = -1;
    // SAFETY: `ordinal` is a valid out-pointer for this attribute (an int);
    // the driver only looks the address up, it does not dereference it.
    let rc = unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut std::os::raw::c_int).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            addr,
        )
    };
    if rc != sys::CUresult::CUDA_SUCCESS || ordinal < 0 {
        return Err(Error::InvalidArgument(format!(
            "{what} (address {addr:#x}) is not CUDA memory the driver knows ({rc:?})"
        )));
    }
    Ok(ordinal as usize)
}

/// Checks a GPU call before it is handed to arx.
pub(crate) fn check(
    arx: &Arx,
    input: u64,
    out: u64,
    count: usize,
    out_count: usize,
    in_dtype: &str,
    out_dtype: &str,
) -> Result<DeviceCall, Error> {
    let Some(ctx) = arx.cuda_context() else {
        return Err(Error::InvalidArgument(
            "a CUDA tensor was passed, but this arx.Comm runs the host device side \
             (device='host' or ARX_DEVICE=host, or not every rank has a usable GPU): \
             pass host arrays (NumPy, CPU tensors), or create the Comm with device='gpu' \
             to see why the GPU side cannot start"
                .into(),
        ));
    };
    let d = dtype(in_dtype, "the input")?;
    let od = dtype(out_dtype, "out")?;
    if d != od {
        return Err(Error::InvalidArgument(format!(
            "input is {in_dtype} but out is {out_dtype}: both must have the same dtype"
        )));
    }
    if count != out_count {
        return Err(Error::InvalidArgument(format!(
            "input has {count} elements, out {out_count}"
        )));
    }
    let bytes = count.saturating_mul(d.size());
    if input != out && overlap(input as usize, bytes, out as usize, bytes) {
        return Err(Error::InvalidArgument(format!(
            "out partially overlaps the input ({bytes} bytes at {input:#x} and {out:#x}): \
             pass the same tensor (in place) or disjoint ones"
        )));
    }
    if count > 0 {
        ctx.bind_to_thread().map_err(|e| Error::Cuda {
            call: "cuCtxSetCurrent",
            detail: e.to_string(),
        })?;
        let mine = ctx.ordinal();
        for (addr, what) in [(input, "the input"), (out, "out")] {
            if addr % d.size() as u64 != 0 {
                return Err(Error::InvalidArgument(format!(
                    "{what} (address {addr:#x}) is not aligned to its {}-byte elements",
                    d.size()
                )));
            }
            let theirs = device_of(addr, what)?;
            if theirs != mine {
                return Err(Error::InvalidArgument(format!(
                    "{what} is on CUDA device {theirs}, but this arx.Comm runs on CUDA device \
                     {mine} (its cuda_device): move the tensor there, or create the Comm with \
                     cuda_device={theirs}"
                )));
            }
        }
    }
    Ok(DeviceCall {
        input,
        out,
        count,
        dtype: d,
    })
}

/// Enqueues the checked call on `stream`.
///
/// # Safety
/// The addresses are those of live device buffers of `count` elements
/// (checked by [`check`] for device and overlap), valid until the work
/// completes on `stream`, a live stream (or a special handle: 0, 1 legacy,
/// 2 per-thread) of the instance's context.
pub(crate) unsafe fn run(
    arx: &mut Arx,
    c: &DeviceCall,
    stream: u64,
    op: arx::Op,
) -> arx::Result<()> {
    let stream = stream as usize as sys::CUstream;
    // SAFETY: the caller's contract, which is `allreduce_raw`'s.
    unsafe { arx.allreduce_raw_op(c.input, c.out, c.count, c.dtype, op, stream) }
}
