//! `reduce_scatter`, `all_gather` and `broadcast` on GPU memory (NCCL's
//! definitions, see `algo::collective` and `algo::broadcast`; the kernels
//! are `kernels/twoshot.cuh` and `kernels/bcast.cuh`). Each rank's
//! calls are enqueued on its stream like [`Arx::allreduce`]'s: capturable
//! into a CUDA graph, ordered with the instance's other calls whatever
//! stream they use, errors returned by the next call or [`Arx::check`].
//! Bit for bit what the host versions ([`Arx::reduce_scatter_host`],
//! [`Arx::all_gather_host`], [`Arx::broadcast_host`]) give, and the same
//! calls of the protocol: a
//! rank may make a host call where another makes a GPU call.

use cudarc::driver::sys::CUstream;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};

use crate::device::Device;
use crate::dtype::{Dtype, Element};
use crate::error::{Error, Result};
use crate::{Arx, Op};

/// The buffers of a typed GPU call: an input and an output, or one buffer
/// that is both (in place).
enum Bufs<'a, T> {
    Separate(&'a CudaSlice<T>, &'a mut CudaSlice<T>),
    InPlace(&'a mut CudaSlice<T>),
}

impl Arx {
    /// What every typed entry point does around its launch. The stream's
    /// context is checked first (a stream of another device is refused on
    /// this rank only: nothing can be enqueued on it). Then an argument
    /// error `refused` is announced on the stream, showing the peers `count`
    /// elements, so that they fail at once (inside a graph too); else
    /// `launch` enqueues the call on the buffers' device addresses (input,
    /// output; in place the one buffer's twice). The buffers stay borrowed
    /// (cudarc orders their other uses around the call) until `launch`
    /// returns.
    fn typed_call<T>(
        &mut self,
        bufs: Bufs<'_, T>,
        count: usize,
        refused: Option<Error>,
        stream: &CudaStream,
        launch: impl FnOnce(&mut Device, u64, u64, CUstream) -> Result<()>,
    ) -> Result<()> {
        self.device.same_context(stream)?;
        let s = stream.cu_stream();
        if let Some(e) = refused {
            return self.device.refuse_gpu(count, e, s);
        }
        match bufs {
            Bufs::Separate(input, output) => {
                let (i, _ri) = input.device_ptr(stream);
                let (o, _ro) = output.device_ptr_mut(stream);
                launch(&mut self.device, i, o, s)
            }
            Bufs::InPlace(buf) => {
                let (p, _r) = buf.device_ptr_mut(stream);
                launch(&mut self.device, p, p, s)
            }
        }
    }

    /// Reduce-scatter on the GPU: `input` holds `N·n` elements (N ranks);
    /// the sum of every rank's `input` is computed and block `r` of it
    /// (elements `r·n..(r+1)·n`) lands in rank `r`'s `output` of `n`
    /// elements. Bit for bit block `r` of [`Arx::allreduce`] of the same
    /// inputs.
    pub fn reduce_scatter<T: Element + DeviceRepr>(
        &mut self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        self.reduce_scatter_op(input, output, Op::Sum, stream)
    }

    /// [`Arx::reduce_scatter`] with the reduction `op` (see
    /// [`Arx::allreduce_op`]).
    pub fn reduce_scatter_op<T: Element + DeviceRepr>(
        &mut self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        op: Op,
        stream: &CudaStream,
    ) -> Result<()> {
        let (world, n) = (self.world(), output.len());
        let refused = (input.len() != world.saturating_mul(n)).then(|| {
            Error::InvalidArgument(format!(
                "reduce_scatter: input has {} elements, expected {world} ranks x {n} (the output's length)",
                input.len()
            ))
        });
        let bufs = Bufs::Separate(input, output);
        self.typed_call(bufs, n, refused, stream, |d, i, o, s| {
            // SAFETY: live device allocations of N·n and n elements of T in
            // this context (checked), borrowed until the launches are
            // enqueued.
            unsafe { d.gpu_collective(false, i, o, n, T::DTYPE, op, s) }
        })
    }

    /// In-place [`Arx::reduce_scatter`]: `buf` holds `N·n` elements; this
    /// rank's block (`rank·n..(rank+1)·n`) receives the result, the other
    /// blocks are left as they were.
    pub fn reduce_scatter_in_place<T: Element + DeviceRepr>(
        &mut self,
        buf: &mut CudaSlice<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        self.reduce_scatter_in_place_op(buf, Op::Sum, stream)
    }

    /// [`Arx::reduce_scatter_in_place`] with the reduction `op`.
    pub fn reduce_scatter_in_place_op<T: Element + DeviceRepr>(
        &mut self,
        buf: &mut CudaSlice<T>,
        op: Op,
        stream: &CudaStream,
    ) -> Result<()> {
        let refused = self.in_place_blocks("reduce_scatter", buf.len()).err();
        let n = buf.len() / self.world();
        let own = (self.rank() * n * std::mem::size_of::<T>()) as u64;
        self.typed_call(Bufs::InPlace(buf), n, refused, stream, |d, p, _, s| {
            // SAFETY: as in `reduce_scatter_op`; the output is this rank's
            // block of the input (the kernel reduces it only once the whole
            // input is staged).
            unsafe { d.gpu_collective(false, p, p + own, n, T::DTYPE, op, s) }
        })
    }

    /// All-gather on the GPU: every rank's `input` of `n` elements,
    /// concatenated in rank order, lands in every rank's `output` of `N·n`
    /// elements.
    pub fn all_gather<T: Element + DeviceRepr>(
        &mut self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        let (world, n) = (self.world(), input.len());
        let refused = (output.len() != world.saturating_mul(n)).then(|| {
            Error::InvalidArgument(format!(
                "all_gather: output has {} elements, expected {world} ranks x {n} (the input's length)",
                output.len()
            ))
        });
        let bufs = Bufs::Separate(input, output);
        self.typed_call(bufs, n, refused, stream, |d, i, o, s| {
            // SAFETY: live device allocations of n and N·n elements of T in
            // this context (checked), borrowed until the launches are
            // enqueued.
            unsafe { d.gpu_collective(true, i, o, n, T::DTYPE, Op::Sum, s) }
        })
    }

    /// In-place [`Arx::all_gather`]: `buf` holds `N·n` elements, this
    /// rank's block (`rank·n..(rank+1)·n`) is its input; every block is
    /// filled.
    pub fn all_gather_in_place<T: Element + DeviceRepr>(
        &mut self,
        buf: &mut CudaSlice<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        let refused = self.in_place_blocks("all_gather", buf.len()).err();
        let n = buf.len() / self.world();
        let own = (self.rank() * n * std::mem::size_of::<T>()) as u64;
        self.typed_call(Bufs::InPlace(buf), n, refused, stream, |d, p, _, s| {
            // SAFETY: as in `all_gather`; the input is this rank's block of
            // the output (the kernel does not copy a block onto itself).
            unsafe { d.gpu_collective(true, p + own, p, n, T::DTYPE, Op::Sum, s) }
        })
    }

    /// [`Arx::reduce_scatter_op`] on raw device addresses: `input` holds
    /// `N·n` elements of `dtype`, `output` `n`. In place as NCCL defines
    /// it: `output` may be `input + rank·n` elements (this rank's block).
    ///
    /// # Safety
    /// As [`Arx::allreduce_raw`], for those lengths; `output` must not
    /// overlap `input` other than as this rank's block.
    pub unsafe fn reduce_scatter_raw(
        &mut self,
        input: u64,
        output: u64,
        n: usize,
        dtype: Dtype,
        op: Op,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's contract is the same as `gpu_collective`'s.
        unsafe {
            self.device
                .gpu_collective(false, input, output, n, dtype, op, stream)
        }
    }

    /// [`Arx::all_gather`] on raw device addresses: `input` holds `n`
    /// elements of `dtype`, `output` `N·n`. In place as NCCL defines it:
    /// `input` may be `output + rank·n` elements (this rank's block).
    ///
    /// # Safety
    /// As [`Arx::allreduce_raw`], for those lengths; `input` must not
    /// overlap `output` other than as this rank's block.
    pub unsafe fn all_gather_raw(
        &mut self,
        input: u64,
        output: u64,
        n: usize,
        dtype: Dtype,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's contract is the same as `gpu_collective`'s.
        unsafe {
            self.device
                .gpu_collective(true, input, output, n, dtype, Op::Sum, stream)
        }
    }

    /// Broadcast on the GPU: the root's `input` lands in every rank's
    /// `output`, bit for bit (NCCL's `ncclBroadcast`; the rules of
    /// [`Arx::broadcast_host`]: `input` is read on the root only, its
    /// length must equal `output`'s on every rank, a `root` that is no rank
    /// is refused).
    pub fn broadcast<T: Element + DeviceRepr>(
        &mut self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let n = output.len();
        let refused = self.bad_root(root).or_else(|| {
            (input.len() != n).then(|| {
                Error::InvalidArgument(format!(
                    "broadcast: input has {} elements, output {n}",
                    input.len()
                ))
            })
        });
        let bufs = Bufs::Separate(input, output);
        self.typed_call(bufs, n, refused, stream, |d, i, o, s| {
            // SAFETY: live device allocations of n elements of T in this
            // context (checked), borrowed until the launches are enqueued;
            // the root is a rank (checked).
            unsafe { d.gpu_broadcast(i, o, n, T::DTYPE, root, s) }
        })
    }

    /// In-place [`Arx::broadcast`]: `buf` is the root's input and every
    /// rank's output.
    pub fn broadcast_in_place<T: Element + DeviceRepr>(
        &mut self,
        buf: &mut CudaSlice<T>,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let n = buf.len();
        let refused = self.bad_root(root);
        self.typed_call(Bufs::InPlace(buf), n, refused, stream, |d, p, _, s| {
            // SAFETY: as in `broadcast`; the kernel copies nothing on the
            // root when input and output are one buffer.
            unsafe { d.gpu_broadcast(p, p, n, T::DTYPE, root, s) }
        })
    }

    /// [`Arx::broadcast`] on raw device addresses: `output` holds `n`
    /// elements of `dtype`, and on the root `input` too (read there only;
    /// in place when `input == output`). A `root` that is no rank is
    /// refused with [`Error::InvalidArgument`] (its peers fail at once).
    ///
    /// # Safety
    /// As [`Arx::allreduce_raw`], for those lengths; on the root `input`
    /// must not overlap `output` other than being equal to it.
    pub unsafe fn broadcast_raw(
        &mut self,
        input: u64,
        output: u64,
        n: usize,
        dtype: Dtype,
        root: usize,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        if let Some(e) = self.bad_root(root) {
            return self.device.refuse_gpu(n, e, stream);
        }
        // SAFETY: the caller's contract is the same as `gpu_broadcast`'s,
        // and the root is a rank (checked).
        unsafe {
            self.device
                .gpu_broadcast(input, output, n, dtype, root, stream)
        }
    }
}
