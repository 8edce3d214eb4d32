//! GPU calls on device addresses (torch tensors, CuPy arrays): the checks
//! arx cannot make on raw addresses (the instance's side, the memory's
//! device, the element type, overlap; the lengths of reduce-scatter and
//! all-gather, and broadcast's), then `Arx::allreduce_raw`,
//! `Arx::reduce_scatter_raw`, `Arx::all_gather_raw` or
//! `Arx::broadcast_raw`.

use arx::cudarc::driver::sys;
use arx::{Arx, Dtype, Error};

use crate::host::{overlap, Coll};

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

/// The instance's CUDA context, or why a CUDA array cannot be used.
fn context(arx: &Arx) -> Result<&std::sync::Arc<arx::cudarc::driver::CudaContext>, Error> {
    arx.cuda_context().ok_or_else(|| {
        Error::InvalidArgument(
            "a CUDA tensor was passed, but this arx.Comm runs the host device side \
             (device='host' or ARX_DEVICE=host, or not every rank has a usable GPU): \
             pass host arrays (NumPy, CPU tensors), or create the Comm with device='gpu' \
             to see why the GPU side cannot start"
                .into(),
        )
    })
}

/// Checks that each address is aligned to `d`'s elements and on the
/// instance's CUDA device (binding the context to this thread first).
fn on_my_device(
    ctx: &arx::cudarc::driver::CudaContext,
    d: Dtype,
    addrs: &[(u64, &str)],
) -> Result<(), Error> {
    ctx.bind_to_thread().map_err(|e| Error::Cuda {
        call: "cuCtxSetCurrent",
        detail: e.to_string(),
    })?;
    let mine = ctx.ordinal();
    for &(addr, what) in addrs {
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
    Ok(())
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
    let ctx = context(arx)?;
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
        on_my_device(ctx, d, &[(input, "the input"), (out, "out")])?;
    }
    Ok(DeviceCall {
        input,
        out,
        count,
        dtype: d,
    })
}

/// Checks a GPU broadcast as the host path checks one (`host::pair`,
/// then `Arx::broadcast_host`'s length rule): `broadcast_raw` takes `n` on
/// trust, so the lengths are checked here. `out` None, or the input's own
/// memory: in place. Each error names the call.
pub(crate) fn check_bcast(
    arx: &Arx,
    input: (u64, usize, &str),
    out: Option<(u64, usize, &str)>,
) -> Result<DeviceCall, Error> {
    let out = out.unwrap_or(input);
    let checked = context(arx).and_then(|_| {
        if input.1 != out.1 {
            return Err(Error::InvalidArgument(format!(
                "input has {} elements, output {}",
                input.1, out.1
            )));
        }
        check(arx, input.0, out.0, input.1, out.1, input.2, out.2)
    });
    checked.map_err(|e| match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(format!("broadcast: {m}")),
        e => e,
    })
}

/// Enqueues the checked broadcast from `root` on `stream` (a `root` that
/// is no rank is refused by arx, the peers failing at once).
///
/// # Safety
/// As [`run`], for the lengths [`check_bcast`] checked.
pub(crate) unsafe fn run_bcast(
    arx: &mut Arx,
    c: &DeviceCall,
    stream: u64,
    root: usize,
) -> arx::Result<()> {
    let stream = stream as usize as sys::CUstream;
    // SAFETY: the caller's contract, which is `broadcast_raw`'s; input and
    // output are one buffer or disjoint (checked).
    unsafe { arx.broadcast_raw(c.input, c.out, c.count, c.dtype, root, stream) }
}

/// A reduce-scatter or all-gather on device addresses, checked, in the
/// terms of `Arx::reduce_scatter_raw` / `Arx::all_gather_raw`: `n`
/// elements per rank, the in-place case already turned into this rank's
/// block of the large buffer.
pub(crate) struct BlocksCall {
    coll: Coll,
    input: u64,
    out: u64,
    n: usize,
    dtype: Dtype,
}

/// Checks a GPU reduce-scatter or all-gather as the host path checks one
/// (`host::pair_blocks`) and as arx checks lengths (`Arx::reduce_scatter`):
/// the raw entry points take `n` on trust, so the lengths are checked
/// here. `out` None: in place in `input` (`world × n` elements, this rank's
/// block is the result, resp. the input). `out` being this rank's block of
/// the large buffer is in place too (NCCL's definition); any other overlap
/// is refused.
pub(crate) fn check_blocks(
    arx: &Arx,
    coll: Coll,
    input: (u64, usize, &str),
    out: Option<(u64, usize, &str)>,
) -> Result<BlocksCall, Error> {
    let ctx = context(arx)?;
    let (world, rank) = (arx.world(), arx.rank());
    let name = coll.name();
    let d = dtype(input.2, "the input")?;
    let Some(out) = out else {
        let (addr, len, _) = input;
        if len % world != 0 {
            return Err(Error::InvalidArgument(format!(
                "{name} in place: the buffer's {len} elements are not a multiple of {world} ranks"
            )));
        }
        let n = len / world;
        let own = addr + (rank * n * d.size()) as u64;
        if n > 0 {
            on_my_device(ctx, d, &[(addr, "the input")])?;
        }
        let (i, o) = match coll {
            Coll::ReduceScatter => (addr, own),
            Coll::AllGather => (own, addr),
        };
        return Ok(BlocksCall {
            coll,
            input: i,
            out: o,
            n,
            dtype: d,
        });
    };
    let od = dtype(out.2, "out")?;
    if d != od {
        return Err(Error::InvalidArgument(format!(
            "{name}: input is {} but out is {}: both must have the same dtype",
            input.2, out.2
        )));
    }
    // The large buffer (world × n) and the small one (n).
    let (big, small) = match coll {
        Coll::ReduceScatter => (input, out),
        Coll::AllGather => (out, input),
    };
    let n = small.1;
    if big.1 != world.saturating_mul(n) {
        let (big_name, small_name) = match coll {
            Coll::ReduceScatter => ("input", "output"),
            Coll::AllGather => ("output", "input"),
        };
        return Err(Error::InvalidArgument(format!(
            "{name}: {big_name} has {} elements, expected {world} ranks x {n} (the {small_name}'s length)",
            big.1
        )));
    }
    let bytes = |len: usize| len.saturating_mul(d.size());
    let mine = big.0.saturating_add(bytes(rank.saturating_mul(n)) as u64);
    let in_place = n > 0 && small.0 == mine;
    if !in_place
        && overlap(
            input.0 as usize,
            bytes(input.1),
            out.0 as usize,
            bytes(out.1),
        )
    {
        let rule = match coll {
            Coll::ReduceScatter => "out = input[rank*n:(rank+1)*n]",
            Coll::AllGather => "input = out[rank*n:(rank+1)*n]",
        };
        return Err(Error::InvalidArgument(format!(
            "{name}: out overlaps the input ({} bytes at {:#x} and {} bytes at {:#x}) without \
             being in place for rank {rank}: in place is out=None, or {rule} with \
             {world} ranks x n elements; otherwise pass disjoint tensors",
            bytes(input.1),
            input.0,
            bytes(out.1),
            out.0
        )));
    }
    if n > 0 {
        on_my_device(ctx, d, &[(input.0, "the input"), (out.0, "out")])?;
    }
    Ok(BlocksCall {
        coll,
        input: input.0,
        out: out.0,
        n,
        dtype: d,
    })
}

/// Enqueues the checked reduce-scatter or all-gather on `stream`.
///
/// # Safety
/// As [`run`], for the lengths [`check_blocks`] checked (`world × n` and
/// `n` elements).
pub(crate) unsafe fn run_blocks(
    arx: &mut Arx,
    c: &BlocksCall,
    stream: u64,
    op: arx::Op,
) -> arx::Result<()> {
    let stream = stream as usize as sys::CUstream;
    // SAFETY: the caller's contract, which is the raw entry points'; an
    // output overlapping the input is this rank's block (checked).
    unsafe {
        match c.coll {
            Coll::ReduceScatter => arx.reduce_scatter_raw(c.input, c.out, c.n, c.dtype, op, stream),
            Coll::AllGather => arx.all_gather_raw(c.input, c.out, c.n, c.dtype, stream),
        }
    }
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
