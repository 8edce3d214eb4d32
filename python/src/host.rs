//! Host buffers (NumPy arrays, anything with the buffer protocol): the
//! checks arx cannot make itself (element type, layout, writability,
//! overlap), then `Arx::allreduce_host`, `Arx::reduce_scatter_host`,
//! `Arx::all_gather_host` or `Arx::broadcast_host`.

use arx::{Arx, Dtype, Error};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;

/// An exported buffer, checked: while it lives, the exporter keeps the
/// memory in place (NumPy refuses to resize an exported array).
pub(crate) struct HostBuf {
    /// Holds the export; released (with the GIL) when dropped.
    _buf: PyUntypedBuffer,
    pub dtype: Dtype,
    pub addr: usize,
    pub count: usize,
    pub readonly: bool,
}

impl HostBuf {
    pub(crate) fn bytes(&self) -> usize {
        self.count * self.dtype.size()
    }
}

/// What a buffer format names, for messages.
fn format_name(code: char) -> &'static str {
    match code {
        'd' => "float64",
        'f' => "float32",
        'e' => "float16",
        'g' => "long double",
        'b' | 'h' | 'i' | 'l' | 'q' | 'n' => "a signed integer",
        'B' | 'H' | 'I' | 'L' | 'Q' | 'N' => "an unsigned integer",
        '?' => "bool",
        'Z' => "complex",
        _ => "not a float32 or float16",
    }
}

/// The element count a buffer holds, if `obj` exports one (for the count
/// a refusal shows to the peers).
pub(crate) fn count_hint(obj: &Bound<'_, PyAny>) -> usize {
    PyUntypedBuffer::get(obj).map_or(0, |b| b.item_count())
}

/// Exports `obj` and checks it: a C-contiguous, aligned buffer of float32
/// or float16 (or, with `bf16_bits`, 16-bit integers holding bfloat16 bit
/// patterns), writable if `writable`. `what` names it in messages.
pub(crate) fn view(
    obj: &Bound<'_, PyAny>,
    what: &str,
    writable: bool,
    bf16_bits: bool,
) -> Result<HostBuf, Error> {
    let buf = PyUntypedBuffer::get(obj).map_err(|e| {
        Error::InvalidArgument(format!(
            "{what} ({}) is neither a CUDA tensor/array nor a host buffer arx can read \
             (a NumPy array, a CPU torch tensor): {e}",
            type_name(obj)
        ))
    })?;
    let fmt = buf.format().to_string_lossy().into_owned();
    // Byte order and size markers: native ('@', '=') or this machine's own
    // explicit order; a foreign byte order is refused.
    let native = if cfg!(target_endian = "little") {
        ['@', '=', '<']
    } else {
        ['@', '=', '>']
    };
    let code = fmt.trim_start_matches(native).to_string();
    let dtype = match (code.as_str(), bf16_bits) {
        ("f", false) => Some(Dtype::F32),
        ("e", false) => Some(Dtype::F16),
        ("H" | "h", true) => Some(Dtype::Bf16),
        _ => None,
    };
    let Some(dtype) = dtype else {
        let c = code.chars().next().unwrap_or('?');
        return Err(Error::InvalidArgument(if bf16_bits {
            format!(
                "{what}: dtype='bfloat16' reads bfloat16 bit patterns from a 16-bit integer \
                 buffer (uint16/int16), but {what} has format '{fmt}' ({})",
                format_name(c)
            )
        } else if code.len() != 1 || fmt.starts_with(['<', '>', '!']) {
            format!(
                "{what} has buffer format '{fmt}': arx reduces float32 and float16 host \
                 buffers in this machine's byte order (bfloat16 as uint16 with \
                 dtype='bfloat16')"
            )
        } else {
            format!(
                "{what} has format '{fmt}' ({}): arx reduces float32 and float16 host \
                 buffers (bfloat16 as uint16 with dtype='bfloat16')",
                format_name(c)
            )
        }));
    };
    if buf.item_size() != dtype.size() {
        return Err(Error::InvalidArgument(format!(
            "{what}: format '{fmt}' with items of {} bytes (expected {})",
            buf.item_size(),
            dtype.size()
        )));
    }
    if !buf.is_c_contiguous() {
        return Err(Error::InvalidArgument(format!(
            "{what} is not C-contiguous (shape {:?}, strides {:?}): pass a contiguous \
             array, e.g. numpy.ascontiguousarray(x), and copy the result back",
            buf.shape(),
            buf.strides()
        )));
    }
    if writable && buf.readonly() {
        return Err(Error::InvalidArgument(format!(
            "{what} is read-only: the result is written there"
        )));
    }
    let addr = buf.buf_ptr() as usize;
    let count = buf.item_count();
    let readonly = buf.readonly();
    if count > 0 && addr % dtype.size() != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what} is not aligned to its {}-byte elements (address {addr:#x})",
            dtype.size()
        )));
    }
    Ok(HostBuf {
        _buf: buf,
        dtype,
        addr,
        count,
        readonly,
    })
}

pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
}

/// Whether two byte ranges share a byte.
pub(crate) fn overlap(a: usize, a_len: usize, b: usize, b_len: usize) -> bool {
    a_len > 0 && b_len > 0 && a < b.saturating_add(b_len) && b < a.saturating_add(a_len)
}

/// The pair's call, checked: same element type, input and output either
/// the same memory (in place) or disjoint.
pub(crate) struct HostCall {
    pub dtype: Dtype,
    /// None: in place in `out`.
    pub input: Option<(usize, usize)>,
    pub out: (usize, usize),
}

pub(crate) fn pair(input: &HostBuf, out: Option<&HostBuf>) -> Result<HostCall, Error> {
    let Some(out) = out else {
        return Ok(HostCall {
            dtype: input.dtype,
            input: None,
            out: (input.addr, input.count),
        });
    };
    if out.dtype != input.dtype {
        return Err(Error::InvalidArgument(format!(
            "input is {} but out is {}: both must have the same dtype",
            crate::dtype_name(input.dtype),
            crate::dtype_name(out.dtype)
        )));
    }
    if input.addr == out.addr && input.count == out.count {
        return Ok(HostCall {
            dtype: input.dtype,
            input: None,
            out: (out.addr, out.count),
        });
    }
    if overlap(input.addr, input.bytes(), out.addr, out.bytes()) {
        return Err(Error::InvalidArgument(format!(
            "out partially overlaps the input ({} bytes at {:#x} and {} bytes at {:#x}): \
             pass the same array (in place) or disjoint ones",
            input.bytes(),
            input.addr,
            out.bytes(),
            out.addr
        )));
    }
    Ok(HostCall {
        dtype: input.dtype,
        input: Some((input.addr, input.count)),
        out: (out.addr, out.count),
    })
}

/// Runs the checked call.
///
/// # Safety
/// The addresses of `c` come from live buffer exports checked by [`view`]
/// and [`pair`] (C-contiguous, aligned, `count` elements of `c.dtype`, the
/// output writable, input and output identical or disjoint), held until
/// this returns, and nothing else accesses them meanwhile.
pub(crate) unsafe fn run(arx: &mut Arx, c: &HostCall, op: arx::Op) -> arx::Result<()> {
    // SAFETY: the caller's contract.
    unsafe {
        match c.dtype {
            Dtype::F32 => typed::<f32>(arx, c, op),
            Dtype::F16 => typed::<half::f16>(arx, c, op),
            Dtype::Bf16 => typed::<half::bf16>(arx, c, op),
        }
    }
}

/// # Safety
/// As [`run`], with `T` the element type of `c.dtype`.
unsafe fn typed<T: arx::Element>(arx: &mut Arx, c: &HostCall, op: arx::Op) -> arx::Result<()> {
    let (out_addr, out_n) = c.out;
    let out: &mut [T] = if out_n == 0 {
        &mut []
    } else {
        // SAFETY: `run`'s contract: a writable, aligned, exported buffer of
        // `out_n` elements of T that nothing else accesses during the call.
        unsafe { std::slice::from_raw_parts_mut(out_addr as *mut T, out_n) }
    };
    match c.input {
        None => arx.allreduce_host_in_place_op(out, op),
        Some((in_addr, in_n)) => {
            let input: &[T] = if in_n == 0 {
                &[]
            } else {
                // SAFETY: `run`'s contract: an aligned, exported buffer of
                // `in_n` elements of T, disjoint from `out` (checked by `pair`).
                unsafe { std::slice::from_raw_parts(in_addr as *const T, in_n) }
            };
            arx.allreduce_host_op(input, out, op)
        }
    }
}

/// Runs the checked call ([`pair`]) as a broadcast from `root` (in place
/// when `c.input` is None).
///
/// # Safety
/// As [`run`].
pub(crate) unsafe fn run_bcast(arx: &mut Arx, c: &HostCall, root: usize) -> arx::Result<()> {
    // SAFETY: the caller's contract.
    unsafe {
        match c.dtype {
            Dtype::F32 => bcast_typed::<f32>(arx, c, root),
            Dtype::F16 => bcast_typed::<half::f16>(arx, c, root),
            Dtype::Bf16 => bcast_typed::<half::bf16>(arx, c, root),
        }
    }
}

/// # Safety
/// As [`run`], with `T` the element type of `c.dtype`.
unsafe fn bcast_typed<T: arx::Element>(
    arx: &mut Arx,
    c: &HostCall,
    root: usize,
) -> arx::Result<()> {
    let (out_addr, out_n) = c.out;
    let out: &mut [T] = if out_n == 0 {
        &mut []
    } else {
        // SAFETY: `run`'s contract: a writable, aligned, exported buffer of
        // `out_n` elements of T that nothing else accesses during the call.
        unsafe { std::slice::from_raw_parts_mut(out_addr as *mut T, out_n) }
    };
    match c.input {
        None => arx.broadcast_host_in_place(out, root),
        Some((in_addr, in_n)) => {
            let input: &[T] = if in_n == 0 {
                &[]
            } else {
                // SAFETY: `run`'s contract: an aligned, exported buffer of
                // `in_n` elements of T, disjoint from `out` (checked by `pair`).
                unsafe { std::slice::from_raw_parts(in_addr as *const T, in_n) }
            };
            arx.broadcast_host(input, out, root)
        }
    }
}

/// Which of NCCL's block collectives a host call is.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Coll {
    /// `out` (`n`) gets this rank's block of the reduction of every rank's
    /// `input` (`world × n`).
    ReduceScatter,
    /// `out` (`world × n`) gets every rank's `input` (`n`) in rank order.
    AllGather,
}

impl Coll {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Coll::ReduceScatter => "reduce_scatter",
            Coll::AllGather => "all_gather",
        }
    }
}

/// A reduce-scatter or all-gather, checked: in place in one buffer of
/// `world × n` elements, or input and output disjoint.
pub(crate) struct BlockCall {
    pub coll: Coll,
    pub dtype: Dtype,
    /// None: in place in `out` (`world × n` elements).
    pub input: Option<(usize, usize)>,
    pub out: (usize, usize),
}

/// Checks the buffers of a block collective: the same dtype; `out` None
/// (in place in `input`), or the `n`-element buffer being this rank's
/// block of the other (in place, as NCCL defines it), or disjoint. The
/// lengths are arx's to check (it refuses them on every rank).
pub(crate) fn pair_blocks(
    coll: Coll,
    world: usize,
    rank: usize,
    input: &HostBuf,
    out: Option<&HostBuf>,
) -> Result<BlockCall, Error> {
    let Some(out) = out else {
        return Ok(BlockCall {
            coll,
            dtype: input.dtype,
            input: None,
            out: (input.addr, input.count),
        });
    };
    if out.dtype != input.dtype {
        return Err(Error::InvalidArgument(format!(
            "{}: input is {} but out is {}: both must have the same dtype",
            coll.name(),
            crate::dtype_name(input.dtype),
            crate::dtype_name(out.dtype)
        )));
    }
    let (big, small, big_name) = match coll {
        Coll::ReduceScatter => (input, out, "input"),
        Coll::AllGather => (out, input, "out"),
    };
    let n = small.count;
    let mine = big.addr.saturating_add(rank.saturating_mul(small.bytes()));
    if n > 0 && small.addr == mine && big.count == world.saturating_mul(n) {
        if big.readonly {
            return Err(Error::InvalidArgument(format!(
                "{}: {big_name} is read-only, and in place the result is written there",
                coll.name()
            )));
        }
        return Ok(BlockCall {
            coll,
            dtype: input.dtype,
            input: None,
            out: (big.addr, big.count),
        });
    }
    if overlap(input.addr, input.bytes(), out.addr, out.bytes()) {
        let rule = match coll {
            Coll::ReduceScatter => "out = input[rank*n:(rank+1)*n]",
            Coll::AllGather => "input = out[rank*n:(rank+1)*n]",
        };
        return Err(Error::InvalidArgument(format!(
            "{}: out overlaps the input ({} bytes at {:#x} and {} bytes at {:#x}) without \
             being in place for rank {rank}: in place is out=None, or {rule} with \
             {} ranks x n elements; otherwise pass disjoint arrays",
            coll.name(),
            input.bytes(),
            input.addr,
            out.bytes(),
            out.addr,
            world
        )));
    }
    Ok(BlockCall {
        coll,
        dtype: input.dtype,
        input: Some((input.addr, input.count)),
        out: (out.addr, out.count),
    })
}

/// Runs the checked block call.
///
/// # Safety
/// As [`run`], for the buffers of `c` checked by [`view`] and
/// [`pair_blocks`].
pub(crate) unsafe fn run_blocks(arx: &mut Arx, c: &BlockCall, op: arx::Op) -> arx::Result<()> {
    // SAFETY: the caller's contract.
    unsafe {
        match c.dtype {
            Dtype::F32 => blocks_typed::<f32>(arx, c, op),
            Dtype::F16 => blocks_typed::<half::f16>(arx, c, op),
            Dtype::Bf16 => blocks_typed::<half::bf16>(arx, c, op),
        }
    }
}

/// # Safety
/// As [`run_blocks`], with `T` the element type of `c.dtype`.
unsafe fn blocks_typed<T: arx::Element>(
    arx: &mut Arx,
    c: &BlockCall,
    op: arx::Op,
) -> arx::Result<()> {
    let (out_addr, out_n) = c.out;
    let out: &mut [T] = if out_n == 0 {
        &mut []
    } else {
        // SAFETY: `run_blocks`'s contract: a writable, aligned, exported
        // buffer of `out_n` elements of T that nothing else accesses during
        // the call.
        unsafe { std::slice::from_raw_parts_mut(out_addr as *mut T, out_n) }
    };
    let Some((in_addr, in_n)) = c.input else {
        return match c.coll {
            Coll::ReduceScatter => arx.reduce_scatter_host_in_place_op(out, op),
            Coll::AllGather => arx.all_gather_host_in_place(out),
        };
    };
    let input: &[T] = if in_n == 0 {
        &[]
    } else {
        // SAFETY: `run_blocks`'s contract: an aligned, exported buffer of
        // `in_n` elements of T, disjoint from `out` (checked by
        // `pair_blocks`).
        unsafe { std::slice::from_raw_parts(in_addr as *const T, in_n) }
    };
    match c.coll {
        Coll::ReduceScatter => arx.reduce_scatter_host_op(input, out, op),
        Coll::AllGather => arx.all_gather_host(input, out),
    }
}
