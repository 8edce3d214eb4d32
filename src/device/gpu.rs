//! The GPU device side: `kernels/arx.cu`, compiled by NVRTC for the device's
//! own architecture, runs the protocol of `kernels/arx_abi.h` on device buffers.
//!
//! All CUDA calls of arx live here. cudarc loads libcuda and libnvrtc at run
//! time; both are checked before cudarc is touched (its context constructor
//! panics when libcuda is missing), so a machine without them gets
//! [`Error::Unavailable`].
//!
//! What the GPU needs to reach:
//! * the region (control block, flags, send and receive slots) in mapped
//!   pinned host memory: `cuMemHostAlloc(DEVICEMAP|PORTABLE)` for the Verbs
//!   fabric, or this rank's part of the node's shared segment registered
//!   with `cuMemHostRegister(DEVICEMAP|PORTABLE)` for the Shm fabric;
//! * `arx_gpu_state_t` in device memory: the call counter and the tickets of
//!   one launch, so a captured CUDA graph replays with no host work.
//!
//! Staging of the send slot:
//! * [`Staging::Sm`]: the kernel copies the input with SM stores, fences at
//!   system scope and publishes;
//! * [`Staging::CopyEngine`]: two `cuMemcpyDtoDAsync` on the caller's stream
//!   copy the input into *both* send slots before the kernel, which then only
//!   publishes. Both, because the call's parity lives in device memory (the
//!   host cannot know it under graph replay). That is safe because every
//!   copy-engine kernel ends only after the proxy has reported its sends
//!   complete (`ctrl.sent`), so when the next call's copies run, neither slot
//!   is still being read. The price is twice the staging bytes.

use std::ffi::{c_void, CString};
use std::mem::ManuallyDrop;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use crate::abi;
use crate::algo::{chunked, collective};
use crate::config::Staging;
use crate::device::nvrtc;
use crate::device::order::Order;
use crate::device::platform::{GpuPlatform, RegionAlloc};
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::layout::{Backing, Layout, Region};

/// Threads per block (must equal `ARX_THREADS` in kernels/device.cuh).
const THREADS: u32 = 256;
/// Upper bound on blocks of one launch.
const MAX_BLOCKS: u32 = 16;
/// Vectors per thread per work chunk.
const DEFAULT_UNROLL: u32 = 2;
/// One-shot calls up to this many bytes run as one block
/// (`oneshot_single` in kernels/oneshot.cuh: no tickets, no election, no
/// departure count). H200, 2026-12-02 (docs/GPU.md, "Where a small call's
/// time goes"): at 16 KB one block took 7.2 us against 10.9 for two blocks
/// (1 rank, `-G 10`) and 15.6 against 18.0 (2 ranks under MPS); at 32 KB
/// two ranks were faster with several blocks (21.9 against 23.3).
const ONE_BLOCK_BYTES: usize = 16 << 10;

fn cuda_err(call: &'static str) -> impl Fn(result::DriverError) -> Error {
    move |e| Error::Cuda {
        call,
        detail: e.to_string(),
    }
}

/// Checks that libcuda and libnvrtc can be loaded, without touching cudarc's
/// lazily loaded (and panicking) entry points.
pub(crate) fn probe_libraries() -> Result<()> {
    // SAFETY: only tries to dlopen the candidate library names.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::Unavailable {
            what: "the GPU device side",
            reason: "libcuda (the NVIDIA driver library) cannot be loaded".into(),
        });
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::Unavailable {
            what: "the GPU device side",
            reason: "libnvrtc (the CUDA runtime compiler) cannot be loaded; install the CUDA toolkit's nvrtc or put libnvrtc.so on LD_LIBRARY_PATH".into(),
        });
    }
    Ok(())
}

/// Number of CUDA devices, or why there are none.
pub(crate) fn device_count() -> Result<usize> {
    probe_libraries()?;
    // cuInit is idempotent; the count call needs it.
    result::init().map_err(cuda_err("cuInit"))?;
    let n = result::device::get_count().map_err(cuda_err("cuDeviceGetCount"))?;
    if n <= 0 {
        return Err(Error::Unavailable {
            what: "the GPU device side",
            reason: "no CUDA device is visible".into(),
        });
    }
    Ok(n as usize)
}

/// A loaded module and its kernels (one-shot bf16, f16, f32, conversion
/// check, collective bf16, f16, f32, broadcast bf16, f16, f32).
struct Module {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
    funcs: [sys::CUfunction; nvrtc::KERNELS.len()],
}

// SAFETY: module and function handles are plain driver handles, usable from
// any thread once the context is bound.
unsafe impl Send for Module {}
// SAFETY: as above; launches do not mutate the handles.
unsafe impl Sync for Module {}

impl Module {
    fn load(ctx: &Arc<CudaContext>, image: &[u8]) -> Result<Self> {
        ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        // SAFETY: `image` is a complete CUBIN produced by NVRTC for this
        // device's architecture; the driver copies it.
        let module = unsafe { result::module::load_data(image.as_ptr().cast()) }
            .map_err(cuda_err("cuModuleLoadData"))?;
        let mut funcs = [std::ptr::null_mut(); nvrtc::KERNELS.len()];
        for (f, name) in funcs.iter_mut().zip(nvrtc::KERNELS) {
            let c = CString::new(name).unwrap_or_default();
            // SAFETY: `module` was loaded above and stays loaded while
            // `Module` lives.
            match unsafe { result::module::get_function(module, c) } {
                Ok(h) => *f = h,
                Err(e) => {
                    // SAFETY: unloading the module we just loaded.
                    unsafe {
                        let _ = result::module::unload(module);
                    }
                    return Err(cuda_err("cuModuleGetFunction")(e));
                }
            }
        }
        Ok(Module {
            ctx: Arc::clone(ctx),
            module,
            funcs,
        })
    }

    fn kernel(&self, dtype: u32) -> sys::CUfunction {
        match dtype {
            abi::ARX_DTYPE_BF16 => self.funcs[0],
            abi::ARX_DTYPE_F16 => self.funcs[1],
            _ => self.funcs[2],
        }
    }

    /// The collective kernel (`kernels/twoshot.cuh`) of `dtype`.
    fn collective(&self, dtype: Dtype) -> sys::CUfunction {
        match dtype {
            Dtype::Bf16 => self.funcs[4],
            Dtype::F16 => self.funcs[5],
            Dtype::F32 => self.funcs[6],
        }
    }

    /// The broadcast kernel (`kernels/bcast.cuh`) of `dtype`.
    fn broadcast(&self, dtype: Dtype) -> sys::CUfunction {
        match dtype {
            Dtype::Bf16 => self.funcs[7],
            Dtype::F16 => self.funcs[8],
            Dtype::F32 => self.funcs[9],
        }
    }
}

/// A chunk's part in a pipelined all-reduce (`arx_params_t.prestaged`,
/// `next_*`; kernels/oneshot.cuh, kernels/twoshot.cuh), SM staging only.
#[derive(Debug, Clone, Copy, Default)]
struct Pipe {
    /// The previous launch staged and published this chunk (a two-shot
    /// chunk: its reduce-scatter call).
    prestaged: bool,
    /// The next chunk this launch stages and publishes early: its input
    /// address, element count and count-field bits.
    next: Option<(u64, usize, u32)>,
}

impl Pipe {
    /// Writes this part into a launch's parameters.
    fn apply(self, params: &mut abi::arx_params_t) {
        params.prestaged = u32::from(self.prestaged);
        if let Some((next_input, next_count, next_bits)) = self.next {
            params.next_input = next_input;
            params.next_count = next_count as u32;
            params.next_more = next_bits;
        }
    }
}

/// What a launch of the collective kernel runs (its `kind` argument,
/// `ARX_COLL_*` in kernels/twoshot.cuh).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Coll {
    /// The two-shot all-reduce: two calls per chunk.
    TwoShot,
    /// `reduce_scatter` (one call per chunk, pattern SCATTER).
    ReduceScatter,
    /// `all_gather` (one call per chunk, pattern GATHER).
    AllGather,
}

impl Coll {
    fn kind(self) -> u32 {
        match self {
            Coll::TwoShot => 1,
            Coll::ReduceScatter => 2,
            Coll::AllGather => 3,
        }
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: loaded in `load`, unloaded once here.
            unsafe {
                let _ = result::module::unload(self.module);
            }
        }
    }
}

/// A host range mapped into the GPU with `cuMemHostRegister`; unregistered
/// on drop, before the memory (kept alive by `_region`) goes.
struct Registration {
    ctx: Arc<CudaContext>,
    ptr: *mut c_void,
    _region: Arc<Region>,
}

// SAFETY: the pointer is only handed back to the driver in Drop.
unsafe impl Send for Registration {}
// SAFETY: as above.
unsafe impl Sync for Registration {}

impl Drop for Registration {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` was registered by us and the memory is still
            // mapped (`_region` drops after this).
            let r = unsafe { sys::cuMemHostUnregister(self.ptr) }.result();
            if let Err(e) = r {
                log::warn!("arx: cuMemHostUnregister failed: {e}");
            }
        }
    }
}

/// Creates the CUDA context (the device's primary one) for `ordinal`.
pub(crate) fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    let n = device_count()?;
    if ordinal >= n {
        return Err(Error::Unavailable {
            what: "the requested CUDA device",
            reason: format!("device {ordinal} asked for (ARX_CUDA_DEVICE), {n} visible"),
        });
    }
    CudaContext::new(ordinal).map_err(cuda_err("cuDevicePrimaryCtxRetain"))
}

/// Allocates the region for the Verbs fabric (the NIC and the GPU both
/// reach it) as `platform` chose: mapped pinned memory from
/// `cuMemHostAlloc`, or ordinary anonymous memory that [`GpuSide::new`]
/// registers (`RegionAlloc::MmapRegister`, coherent integrated GPUs).
pub(crate) fn alloc_region(
    ctx: &Arc<CudaContext>,
    platform: &GpuPlatform,
    len: usize,
) -> Result<Region> {
    if platform.region == RegionAlloc::MmapRegister {
        return Region::anonymous(len);
    }
    ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
    let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
    // SAFETY: a fresh allocation; freed exactly once by the backing closure.
    let p = unsafe { result::malloc_host(len, flags) }.map_err(|e| Error::Cuda {
        call: "cuMemHostAlloc",
        detail: format!("{len} bytes: {e}"),
    })?;
    // SAFETY: `p` is valid for `len` bytes; zero it before anyone reads it.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, len) };
    let addr = p as usize;
    let c = Arc::clone(ctx);
    let free: Box<dyn FnOnce() + Send + Sync> = Box::new(move || {
        let _ = c.bind_to_thread();
        // SAFETY: allocated by cuMemHostAlloc above; nobody uses it any more
        // (the region, its last owner, is being dropped).
        if let Err(e) = unsafe { result::free_host(addr as *mut c_void) } {
            log::warn!("arx: cuMemFreeHost failed: {e}");
        }
    });
    // SAFETY: `len` bytes (page-aligned in practice, checked next), freed
    // only by the backing closure when the region drops.
    let region = unsafe { Region::from_raw(p.cast(), len, Backing::Custom(Some(free))) }?;
    // The NIC registers it next (ibv_reg_mr): whole pages only.
    region.check_pages("cuMemHostAlloc")?;
    Ok(region)
}

/// Everything the GPU side of one instance holds.
pub(crate) struct GpuSide {
    ctx: Arc<CudaContext>,
    /// Device address of `arx_gpu_state_t`.
    state: sys::CUdeviceptr,
    /// Device address of the region.
    region_dev: u64,
    region: Arc<Region>,
    /// Dropped by hand in `Drop` (or kept for good, see there).
    registration: ManuallyDrop<Option<Registration>>,
    /// Dropped by hand in `Drop` (or kept for good, see there).
    module: ManuallyDrop<Module>,
    /// Orders this instance's launches across streams and graphs.
    order: Order,
    layout: Layout,
    staging: Staging,
    max_blocks: u32,
    unroll: Option<u32>,
    /// `Builder::test_sum_delay` in nanoseconds (0: none), for the
    /// one-shot and collective kernels (`arx_params_t.sum_delay_ns`).
    sum_delay_ns: u32,
    ordinal: usize,
    arch: String,
    /// What the device reported and what was chosen for it.
    platform: GpuPlatform,
}

// SAFETY: the raw handles and device addresses are only used through the
// driver with the context bound; the instance is used by one thread at a
// time (`&mut self` on every call).
unsafe impl Send for GpuSide {}

impl GpuSide {
    /// Sets up the GPU side over `region` (already allocated): maps it into
    /// the GPU if `register`, compiles and loads the kernels, allocates and
    /// initialises the device state. Runs before the proxy starts.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        ctx: Arc<CudaContext>,
        platform: GpuPlatform,
        region: Arc<Region>,
        register: bool,
        layout: Layout,
        cfg: &crate::Config,
        ranks_on_node: usize,
    ) -> Result<Self> {
        let staging = cfg.staging;
        // The one copy of the call timeout is the control block's (written
        // at start-up); the kernel keeps it in device state for speed.
        // Relaxed: written by this thread, before.
        let timeout_ns = region.ctrl().timeout_ns().load(Ordering::Relaxed);
        ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        // (`GpuPlatform::decide` refused a device that cannot map host
        // memory.)
        log::info!("arx: {platform}");
        let registration = if register {
            region.check_pages("cuMemHostRegister")?;
            let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
            // SAFETY: the region's memory is mapped, page-aligned and lives
            // as long as the registration (which holds an Arc to it).
            unsafe {
                sys::cuMemHostRegister_v2(region.as_ptr().cast(), region.len(), flags)
                    .result()
                    .map_err(|e| Error::Cuda {
                        call: "cuMemHostRegister",
                        detail: format!("{} bytes of the region: {e}", region.len()),
                    })?;
            }
            Some(Registration {
                ctx: Arc::clone(&ctx),
                ptr: region.as_ptr().cast(),
                _region: Arc::clone(&region),
            })
        } else {
            None
        };
        let mut region_dev: sys::CUdeviceptr = 0;
        // SAFETY: the region is mapped memory (cuMemHostAlloc DEVICEMAP or
        // registered DEVICEMAP just above).
        unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut region_dev, region.as_ptr().cast(), 0)
                .result()
                .map_err(cuda_err("cuMemHostGetDevicePointer"))?;
        }
        log::debug!(
            "arx: region at {:p} on the host, {region_dev:#x} on the GPU{}",
            region.as_ptr(),
            if region_dev == region.as_ptr() as u64 {
                " (the same address)"
            } else {
                ""
            }
        );
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda_err("cuDeviceGetAttribute"))?;
        let arch = format!("sm_{major}{minor}");
        let cache = cfg.kernel_cache.as_deref();
        match cache {
            Some(d) => log::debug!("arx: kernel cache {}", d.display()),
            None => log::info!(
                "arx: no kernel cache (ARX_KERNEL_CACHE off, or neither HOME nor XDG_CACHE_HOME is an absolute path): every process compiles"
            ),
        }
        let image = nvrtc::cubin(&arch, cache)?;
        let module = match Module::load(&ctx, &image.image) {
            Ok(m) => m,
            // A cached image the driver refuses (a driver older than the
            // NVRTC that made it, say) is compiled anew, never an error.
            Err(e) if image.from_disk => {
                log::warn!("arx: the cached kernels for {arch} did not load ({e}); compiling them");
                Module::load(&ctx, &nvrtc::recompile(&arch, cache)?.image)?
            }
            Err(e) => return Err(e),
        };
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda_err("cuDeviceGetAttribute"))? as u32;
        // Ranks sharing the GPU (MPS) share its SMs: keep every rank's grid
        // small enough that all of them fit at once. (Correctness does not
        // depend on it — the kernel's tickets never make a block wait for
        // another — but spinning blocks that cannot all be resident would
        // slow every rank.)
        let max_blocks = cfg
            .gpu_blocks
            .unwrap_or_else(|| (sms / (2 * ranks_on_node.max(1) as u32)).clamp(1, MAX_BLOCKS));
        // SAFETY: a fresh device allocation of one arx_gpu_state_t, freed in Drop.
        let state = unsafe { result::malloc_sync(std::mem::size_of::<abi::arx_gpu_state_t>()) }
            .map_err(cuda_err("cuMemAlloc"))?;
        let init = abi::arx_gpu_state_t {
            timeout_ns,
            ..Default::default()
        };
        // SAFETY: `state` holds exactly one arx_gpu_state_t.
        let r = unsafe { result::memcpy_htod_sync(state, std::slice::from_ref(&init)) };
        if let Err(e) = r {
            // SAFETY: freeing what we just allocated.
            unsafe {
                let _ = result::free_sync(state);
            }
            return Err(cuda_err("cuMemcpyHtoD")(e));
        }
        log::info!(
            "arx: GPU side on device {} ({arch}, {sms} SMs, up to {max_blocks} blocks of {THREADS}), staging {staging:?}",
            ctx.ordinal()
        );
        let order = match Order::new() {
            Ok(o) => o,
            Err(e) => {
                // SAFETY: freeing what we just allocated.
                unsafe {
                    let _ = result::free_sync(state);
                }
                return Err(e);
            }
        };
        Ok(GpuSide {
            ordinal: ctx.ordinal(),
            ctx,
            module: ManuallyDrop::new(module),
            order,
            state,
            region_dev,
            region,
            registration: ManuallyDrop::new(registration),
            layout,
            staging,
            max_blocks,
            unroll: cfg.gpu_unroll,
            sum_delay_ns: cfg
                .sum_delay
                .map_or(0, |d| u32::try_from(d.as_nanos()).unwrap_or(u32::MAX)),
            arch,
            platform,
        })
    }

    /// The context the instance runs in.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// One line for logs and headers.
    pub(crate) fn describe(&self) -> String {
        let kind = if self.platform.attrs.integrated {
            "integrated"
        } else {
            "discrete"
        };
        format!(
            "gpu {} ({}, {kind}), staging {:?}, up to {} blocks",
            self.ordinal, self.arch, self.staging, self.max_blocks
        )
    }

    /// What the device reported and what was chosen for it.
    #[allow(dead_code)] // read by tests and through `arx::gpu_platform`
    pub(crate) fn platform(&self) -> &GpuPlatform {
        &self.platform
    }

    /// Launch shape for `count` elements of `dtype`, `aligned` or not:
    /// (blocks, units per thread per chunk). One block for calls of up to
    /// `one_block` bytes.
    fn shape(&self, count: usize, dtype: Dtype, aligned: bool, one_block: usize) -> (u32, u32) {
        let per_unit = if aligned { 16 / dtype.size() } else { 1 };
        let units = count.div_ceil(per_unit);
        let unroll = self.unroll.unwrap_or(DEFAULT_UNROLL);
        let chunks = units.div_ceil((THREADS * unroll) as usize).max(1);
        if count * dtype.size() <= one_block {
            return (1, unroll);
        }
        ((chunks.min(self.max_blocks as usize)) as u32, unroll)
    }

    /// Enqueues one call on `stream`: for each chunk of at most `per`
    /// elements (`dtype` Some((dtype, per)); see `algo::chunked`), the
    /// copy-engine staging (if chosen) and one kernel launch on the chunk's
    /// part of `input` and `output`. Nothing else happens on the host, so
    /// this can be captured into a CUDA graph.
    ///
    /// The chunks of one call are ordered by the stream alone: the
    /// instance's order events ([`Order`]) are waited for once before the
    /// first chunk and recorded once after the last, so a call of any length
    /// costs one wait and one record (in a graph: a record node beside the
    /// last chunk's kernel, and a wait node before a capture's first
    /// call). Each
    /// chunk's kernel takes the next seq from device memory, so a graph
    /// replay of a chunked call advances it by the number of chunks.
    ///
    /// # Safety
    /// `input` and `output` must be device addresses valid for `count`
    /// elements of `dtype` in this instance's context until the call
    /// completes on the stream; `stream` must belong to that context.
    /// `dtype` None launches a refusal: the call is announced with the
    /// "invalid" dtype and `count` (at most `ARX_MAX_CHUNK`), and no memory
    /// is touched.
    pub(crate) unsafe fn launch(
        &mut self,
        input: u64,
        output: u64,
        count: usize,
        dtype: Option<(Dtype, usize, crate::Op)>,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        // After the previous launch of this instance, whatever its stream.
        let cap = self.order.before(stream)?;
        let r = match dtype {
            None => {
                let c = count.min(abi::ARX_MAX_CHUNK as usize);
                // SAFETY: a refusal touches no memory.
                unsafe { self.launch_one([0, 0], c, None, 0, Pipe::default(), stream) }
            }
            Some((d, per, op)) => {
                // Pipelined (SM staging only: copy-engine copies would
                // overwrite a slot in flight): launch k stages and publishes
                // chunk k + 1 unless that is the last chunk, which waits for
                // the sum of the one before (arx_abi.h, "A call longer than
                // one slot"); launch k + 1 then finds it published.
                let pipe = self.staging == Staging::Sm;
                let n = chunked::call_chunks(count, per, 1).count();
                let nexts = chunked::call_chunks(count, per, 1)
                    .skip(1)
                    .map(Some)
                    .chain(std::iter::once(None));
                chunked::call_chunks(count, per, 1)
                    .zip(nexts)
                    .enumerate()
                    .try_for_each(|(k, (c, next))| {
                        let at = |i: usize| input + (i * d.size()) as u64;
                        let pipe_in = Pipe {
                            prestaged: pipe && k >= 1 && k + 1 < n,
                            next: next
                                .filter(|_| pipe && k + 2 < n)
                                .map(|x| (at(x.range.start), x.range.len(), x.bits())),
                        };
                        // SAFETY: the chunk (and the next one, read by this
                        // launch when pipelined) lies within the caller's
                        // `count` elements (the caller's contract), and
                        // holds at most `per` elements, one slot's worth.
                        unsafe {
                            self.launch_one(
                                [
                                    at(c.range.start),
                                    output + (c.range.start * d.size()) as u64,
                                ],
                                c.range.len(),
                                Some((d, op)),
                                c.bits(),
                                pipe_in,
                                stream,
                            )
                        }
                    })
            }
        };
        // Recorded also after a failed enqueue: the instance is failed then,
        // and later launches must still wait for what was enqueued.
        let after = self.order.after(stream, cap);
        r.and(after)
    }

    /// Where a chunk with count-field `bits` sits in its slots
    /// (`protocol::data_base`).
    fn chunk_base(&self, bits: u32) -> usize {
        crate::protocol::data_base(u64::from(bits), self.layout.slot_bytes())
    }

    /// Enqueues one chunk: the copy-engine staging (if chosen) and the
    /// kernel. `dtype`: the element type and op (None: a refusal); `bits`:
    /// the chunk's count-field bits ([`chunked::Chunk::bits`]); `pipe`: its
    /// part in a pipelined call.
    ///
    /// # Safety
    /// As [`GpuSide::launch`], for `count` ≤ one slot's worth of elements
    /// (and the next chunk's, when `pipe` names one).
    unsafe fn launch_one(
        &mut self,
        [input, output]: [u64; 2],
        count: usize,
        dtype: Option<(Dtype, crate::Op)>,
        bits: u32,
        pipe: Pipe,
        stream: sys::CUstream,
    ) -> Result<()> {
        let d = dtype.map(|(d, _)| d);
        let base = self.chunk_base(bits);
        let op = dtype.map_or(crate::Op::Sum, |(_, o)| o);
        let code = d.map_or(abi::ARX_DTYPE_INVALID, Dtype::code);
        let bytes = d.map_or(0, |d| d.size() * count);
        if self.staging == Staging::CopyEngine && bytes > 0 {
            // Both slots for every chunk: the parity lives in device memory.
            // The previous chunk's kernel ended only once the proxy had sent
            // its slot (`ctrl.sent`), so these copies overwrite nothing in
            // flight (copy-engine chunks therefore are not pipelined).
            for parity in 0..2 {
                let dst = self.region_dev + (self.layout.send_offset(parity) + base) as u64;
                // SAFETY: `dst` is a send slot of the mapped region (the
                // chunking bounds `bytes` by the slot), `input` is valid for
                // `bytes` by the caller's contract, on the caller's stream.
                unsafe { result::memcpy_dtod_async(dst, input, bytes, stream) }
                    .map_err(cuda_err("cuMemcpyDtoDAsync"))?;
            }
        }
        let mut params = self.params([input, output], count, code, bits, op.code());
        params.sum_delay_ns = self.sum_delay_ns;
        pipe.apply(&mut params);
        // SAFETY: the one-shot kernels take exactly one `arx_params_t` by
        // value (kernels/arx.cu); the addresses in it are valid by the
        // caller's contract.
        unsafe {
            self.fire(
                self.module.kernel(code),
                d,
                params,
                &mut [],
                ONE_BLOCK_BYTES,
                stream,
            )
        }
    }

    /// The kernel parameters of one chunk of `count` elements (`code`: the
    /// dtype's ABI code; `bits`: its count-field bits), not pipelined.
    fn params(
        &self,
        [input, output]: [u64; 2],
        count: usize,
        code: u32,
        bits: u32,
        op: u32,
    ) -> abi::arx_params_t {
        abi::arx_params_t {
            region: self.region_dev,
            state: self.state,
            input,
            output,
            layout: self.layout.raw(),
            count: count as u32,
            dtype: code,
            sm_staging: u32::from(self.staging == Staging::Sm),
            unroll: 1,
            more: bits,
            op,
            ..Default::default()
        }
    }

    /// Launches kernel `f` on `stream` with `params` first and then the
    /// by-value arguments `extra` points to, in the launch shape of
    /// `params.count` elements of `dtype` (None, a refusal: one block; one
    /// block also up to `one_block` bytes).
    ///
    /// # Safety
    /// `f`'s parameters must be exactly an `arx_params_t` followed by what
    /// `extra` points to, in order and by type; every address in `params`
    /// must be valid for the call (the region and state live as long as
    /// this side).
    unsafe fn fire(
        &self,
        f: sys::CUfunction,
        dtype: Option<Dtype>,
        mut params: abi::arx_params_t,
        extra: &mut [*mut c_void],
        one_block: usize,
        stream: sys::CUstream,
    ) -> Result<()> {
        let aligned = (params.input | params.output) & 15 == 0;
        let (blocks, unroll) = dtype.map_or((1, 1), |d| {
            self.shape(params.count as usize, d, aligned, one_block)
        });
        params.unroll = unroll;
        let mut args = [std::ptr::null_mut::<c_void>(); 4];
        args[0] = (&mut params as *mut abi::arx_params_t).cast();
        let n = 1 + extra.len();
        args[1..n].copy_from_slice(extra);
        // SAFETY: by the caller's contract; `params` and what `extra`
        // points to outlive the call (the driver copies the arguments).
        unsafe {
            result::launch_kernel(
                f,
                (blocks, 1, 1),
                (THREADS, 1, 1),
                0,
                stream,
                &mut args[..n],
            )
        }
        .map_err(cuda_err("cuLaunchKernel"))
    }

    /// Enqueues a two-shot all-reduce, a reduce-scatter or an all-gather
    /// on `stream` (`kernels/twoshot.cuh`), chunked as the host side
    /// chunks it: a two-shot of `n` elements in chunks of at most `per`
    /// (each chunk two calls, `algo::chunked`); a reduce-scatter or
    /// all-gather of `n` elements per rank in chunks covering the same `c`
    /// elements of every rank's block (`algo::collective::block_chunks`,
    /// each chunk one call of `N·c` elements). One kernel launch per chunk,
    /// after the copy-engine staging if chosen; ordered with the
    /// instance's other launches as [`GpuSide::launch`] orders them.
    ///
    /// # Safety
    /// As [`GpuSide::launch`], for the buffers of the collective: a
    /// two-shot's `input` and `output` hold `n` elements (they may be the
    /// same); a reduce-scatter's `input` `N·n` and its `output` `n` (which
    /// may be this rank's block of the input); an all-gather's `input` `n`
    /// (which may be this rank's block of the output) and its `output`
    /// `N·n`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn launch_collective(
        &mut self,
        coll: Coll,
        input: u64,
        output: u64,
        n: usize,
        dtype: Dtype,
        per: usize,
        op: crate::Op,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        let cap = self.order.before(stream)?;
        let esize = dtype.size();
        let world = self.layout.world();
        let r = match coll {
            Coll::TwoShot => {
                // Pipelined (SM staging only: copy-engine copies write both
                // parities' slots at the chunk's half before the kernel, and
                // would overwrite a slot in flight): launch k stages and
                // publishes chunk k + 1's reduce-scatter call once its own
                // gather call's flags are in, before its copy out -- the
                // last chunk's too, as the host side's `twoshot::pipelined`
                // does (the call's last call, the last chunk's gather step,
                // still waits for every earlier chunk's copy out:
                // kernels/arx_abi.h); launch k + 1 then finds it published.
                let pipe = self.staging == Staging::Sm;
                let nexts = chunked::call_chunks(n, per, 2)
                    .skip(1)
                    .map(Some)
                    .chain(std::iter::once(None));
                chunked::call_chunks(n, per, 2)
                    .zip(nexts)
                    .enumerate()
                    .try_for_each(|(k, (c, next))| {
                        let at = |i: usize| (i * esize) as u64;
                        let pipe_in = Pipe {
                            prestaged: pipe && k >= 1,
                            next: next
                                .filter(|_| pipe)
                                .map(|x| (input + at(x.range.start), x.range.len(), x.bits())),
                        };
                        // SAFETY: the chunk (and the next one, read by this
                        // launch when pipelined) lies within the caller's
                        // `n` elements and holds at most one slot's worth.
                        unsafe {
                            self.launch_coll_one(
                                coll,
                                [input + at(c.range.start), output + at(c.range.start)],
                                c.range.len(),
                                [0, 0],
                                (dtype, op),
                                (c.bits(), pipe_in),
                                stream,
                            )
                        }
                    })
            }
            Coll::ReduceScatter | Coll::AllGather => {
                collective::block_chunks(n, world, per).try_for_each(|c| {
                    let at = (c.range.start * esize) as u64;
                    let strides = if coll == Coll::ReduceScatter {
                        [n as u64, 0]
                    } else {
                        [0, n as u64]
                    };
                    // SAFETY: the chunk's elements of every block lie
                    // within the caller's buffers; N of them fit one slot
                    // (`block_chunks`).
                    unsafe {
                        self.launch_coll_one(
                            coll,
                            [input + at, output + at],
                            world * c.range.len(),
                            strides,
                            (dtype, op),
                            (c.bits(), Pipe::default()),
                            stream,
                        )
                    }
                })
            }
        };
        // As in `launch`: recorded also after a failed enqueue.
        let after = self.order.after(stream, cap);
        r.and(after)
    }

    /// Enqueues one chunk of a collective: `count` elements in the call
    /// (`N·c` for a reduce-scatter or all-gather), block `q` of the
    /// caller's buffers at `io[0] + q·strides[0]` and `io[1] +
    /// q·strides[1]` elements (a two-shot's are contiguous); `bits`: the
    /// chunk's count-field bits, `pipe`: its part in a pipelined two-shot
    /// (default for the others).
    ///
    /// # Safety
    /// As [`GpuSide::launch_collective`], for one chunk (and the next one's
    /// input, when `pipe` names one).
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_coll_one(
        &mut self,
        coll: Coll,
        io: [u64; 2],
        count: usize,
        strides: [u64; 2],
        (dtype, op): (Dtype, crate::Op),
        (bits, pipe): (u32, Pipe),
        stream: sys::CUstream,
    ) -> Result<()> {
        let [input, output] = io;
        let base = self.chunk_base(bits) as u64;
        let esize = dtype.size();
        let world = self.layout.world();
        let ce = self.staging == Staging::CopyEngine;
        if ce && count > 0 {
            // Both slots (the parity lives in device memory), as in
            // `launch_one`; what the call's first step stages.
            for parity in 0..2 {
                let slot = self.region_dev + self.layout.send_offset(parity) as u64 + base;
                let r = match coll {
                    Coll::TwoShot => {
                        // SAFETY: the destination lies in a send slot of
                        // the mapped region (the chunking bounds the call
                        // by the slot), the source within the caller's
                        // buffer, on the caller's stream.
                        unsafe { result::memcpy_dtod_async(slot, input, count * esize, stream) }
                    }
                    Coll::AllGather => {
                        let c = count / world;
                        let at = (self.layout.rank() * c * esize) as u64;
                        // SAFETY: as above (this rank's block of the slot).
                        unsafe { result::memcpy_dtod_async(slot + at, input, c * esize, stream) }
                    }
                    Coll::ReduceScatter => {
                        // Block q of the input (pitch n) to shard q of the
                        // slot (pitch c): one 2-D copy.
                        let c = count / world;
                        let copy = sys::CUDA_MEMCPY2D {
                            srcXInBytes: 0,
                            srcY: 0,
                            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                            srcHost: std::ptr::null(),
                            srcDevice: input,
                            srcArray: std::ptr::null_mut(),
                            srcPitch: strides[0] as usize * esize,
                            dstXInBytes: 0,
                            dstY: 0,
                            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                            dstHost: std::ptr::null_mut(),
                            dstDevice: slot,
                            dstArray: std::ptr::null_mut(),
                            dstPitch: c * esize,
                            WidthInBytes: c * esize,
                            Height: world,
                        };
                        // SAFETY: as above: `world` rows of `c` elements,
                        // within the N·n input and within the slot.
                        unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream) }.result()
                    }
                };
                r.map_err(cuda_err("cuMemcpyDtoDAsync"))?;
            }
        }
        let mut params = self.params([input, output], count, dtype.code(), bits, op.code());
        params.sum_delay_ns = self.sum_delay_ns;
        pipe.apply(&mut params);
        let mut kind = coll.kind();
        let [mut in_stride, mut out_stride] = strides;
        let mut extra = [
            (&mut kind as *mut u32).cast::<c_void>(),
            (&mut in_stride as *mut u64).cast(),
            (&mut out_stride as *mut u64).cast(),
        ];
        // SAFETY: the kernel takes (arx_params_t, u32, u64, u64) by value
        // (kernels/arx.cu, arx_collective_*); addresses valid as in
        // `launch_one`.
        unsafe {
            self.fire(
                self.module.collective(dtype),
                Some(dtype),
                params,
                &mut extra,
                0,
                stream,
            )
        }
    }

    /// Enqueues a broadcast from `root` of `n` elements on `stream`
    /// (`kernels/bcast.cuh`): one kernel launch per chunk of at most `per`
    /// elements (`algo::chunked::chunks`, as the host side chunks it),
    /// after the root's copy-engine staging if chosen; ordered with the
    /// instance's other launches as [`GpuSide::launch`] orders them.
    ///
    /// # Safety
    /// As [`GpuSide::launch`]: `output` holds `n` elements, and on the root
    /// `input` too (it may equal `output`; it is read on the root only).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn launch_broadcast(
        &mut self,
        input: u64,
        output: u64,
        n: usize,
        dtype: Dtype,
        per: usize,
        root: usize,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        let cap = self.order.before(stream)?;
        let esize = dtype.size();
        let is_root = root == self.layout.rank();
        let ce = self.staging == Staging::CopyEngine;
        let r = chunked::chunks(n, per).try_for_each(|c| {
            let at = (c.range.start * esize) as u64;
            let count = c.range.len();
            let (input, output) = (input + at, output + at);
            if ce && is_root && count > 0 {
                // Both slots (the parity lives in device memory), as in
                // `launch_one`; only the root's partial travels.
                for parity in 0..2 {
                    let dst = self.region_dev + self.layout.send_offset(parity) as u64;
                    // SAFETY: `dst` is a send slot of the mapped region (the
                    // chunk holds at most one slot's worth), the source lies
                    // within the caller's input, on the caller's stream.
                    unsafe { result::memcpy_dtod_async(dst, input, count * esize, stream) }
                        .map_err(cuda_err("cuMemcpyDtoDAsync"))?;
                }
            }
            let more = if c.more { abi::ARX_FLAG_MORE } else { 0 };
            let params = self.params([input, output], count, dtype.code(), more, abi::ARX_OP_SUM);
            let mut root = root as u32;
            let mut extra = [(&mut root as *mut u32).cast::<c_void>()];
            // SAFETY: the kernel takes (arx_params_t, u32) by value
            // (kernels/arx.cu, arx_broadcast_*); the chunk lies within the
            // caller's buffers (the caller's contract) and holds at most one
            // slot's worth.
            unsafe {
                self.fire(
                    self.module.broadcast(dtype),
                    Some(dtype),
                    params,
                    &mut extra,
                    0,
                    stream,
                )
            }
        });
        // As in `launch`: recorded also after a failed enqueue.
        let after = self.order.after(stream, cap);
        r.and(after)
    }

    /// Waits for everything queued in the context (bounded: every arx
    /// kernel ends by its deadline).
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.ctx.synchronize().map_err(cuda_err("cuCtxSynchronize"))
    }

    /// The device's call counter (after [`GpuSide::synchronize`]).
    pub(crate) fn device_seq(&self) -> Result<u64> {
        let mut st = [abi::arx_gpu_state_t::default()];
        // SAFETY: `state` holds one arx_gpu_state_t.
        unsafe { result::memcpy_dtoh_sync(&mut st, self.state) }
            .map_err(cuda_err("cuMemcpyDtoH"))?;
        Ok(st[0].seq)
    }

    /// Sets the device's call counter (after a host-side call).
    pub(crate) fn set_device_seq(&self, seq: u64) -> Result<()> {
        // SAFETY: `seq` is the first field of arx_gpu_state_t.
        unsafe { result::memcpy_htod_sync(self.state, &[seq]) }.map_err(cuda_err("cuMemcpyHtoD"))
    }

    /// Runs the conversion check kernel on `bits` (test hook): returns
    /// (to bf16, to f16, bf16 bits back to f32, f16 bits back to f32).
    pub(crate) fn convert_check(&self, bits: &[u32]) -> Result<ConvertOut> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        let n = bits.len();
        let mut out = ConvertOut {
            bf16: vec![0; n],
            f16: vec![0; n],
            bf16_back: vec![0; n],
            f16_back: vec![0; n],
        };
        if n == 0 {
            return Ok(out);
        }
        // SAFETY: plain allocations and synchronous copies of exactly the
        // sizes allocated; freed on every path below.
        unsafe {
            let a = result::malloc_sync(n * 4).map_err(cuda_err("cuMemAlloc"))?;
            let b = result::malloc_sync(n * 2).map_err(cuda_err("cuMemAlloc"))?;
            let c = result::malloc_sync(n * 2).map_err(cuda_err("cuMemAlloc"))?;
            let d = result::malloc_sync(n * 4).map_err(cuda_err("cuMemAlloc"))?;
            let e = result::malloc_sync(n * 4).map_err(cuda_err("cuMemAlloc"))?;
            let r = (|| {
                result::memcpy_htod_sync(a, bits)?;
                let mut na = n as u64;
                let (mut pa, mut pb, mut pc, mut pd, mut pe) = (a, b, c, d, e);
                let mut args = [
                    (&mut pa as *mut u64).cast::<c_void>(),
                    (&mut pb as *mut u64).cast(),
                    (&mut pc as *mut u64).cast(),
                    (&mut pd as *mut u64).cast(),
                    (&mut pe as *mut u64).cast(),
                    (&mut na as *mut u64).cast(),
                ];
                result::launch_kernel(
                    self.module.funcs[3],
                    (1024, 1, 1),
                    (256, 1, 1),
                    0,
                    std::ptr::null_mut(),
                    &mut args,
                )?;
                result::memcpy_dtoh_sync(&mut out.bf16, b)?;
                result::memcpy_dtoh_sync(&mut out.f16, c)?;
                result::memcpy_dtoh_sync(&mut out.bf16_back, d)?;
                result::memcpy_dtoh_sync(&mut out.f16_back, e)
            })();
            for p in [a, b, c, d, e] {
                let _ = result::free_sync(p);
            }
            r.map_err(cuda_err("conversion check"))?;
        }
        Ok(out)
    }
}

/// Output of [`GpuSide::convert_check`].
#[derive(Debug, Clone)]
pub struct ConvertOut {
    /// f32 → bf16 bits.
    pub bf16: Vec<u16>,
    /// f32 → f16 bits.
    pub f16: Vec<u16>,
    /// Low 16 bits as bf16 → f32 bits.
    pub bf16_back: Vec<u32>,
    /// Low 16 bits as f16 → f32 bits.
    pub f16_back: Vec<u32>,
}

impl Drop for GpuSide {
    fn drop(&mut self) {
        // A kernel may still be running (the caller need not synchronize):
        // it ends by its deadline, so this wait is bounded.
        if let Err(e) = self.synchronize() {
            log::warn!("arx: synchronize before teardown failed: {e}");
        }
        if self.order.captured() {
            // A CUDA graph holding this instance's launches may be replayed
            // after the instance is gone (cudarc's graph launch is safe
            // code). Keep everything such a replay touches -- the region,
            // the device state, the module, the events -- and mark the state
            // failed: a replay then stages nothing, publishes nothing and
            // writes NaN to its output, instead of touching freed memory.
            let status = std::mem::offset_of!(abi::arx_gpu_state_t, status) as u64;
            // SAFETY: `state` holds an arx_gpu_state_t; no kernel runs now.
            let marked = unsafe {
                result::memcpy_htod_sync(self.state + status, &[abi::ARX_STATUS_ABORTED])
            };
            if let Err(e) = marked {
                log::warn!("arx: could not mark the GPU state closed: {e}");
            }
            crate::protocol::raise_abort(&*self.region);
            self.order.leak();
            std::mem::forget(Arc::clone(&self.region));
            log::info!(
                "arx: rank {}: launches of this instance were captured into CUDA graphs; keeping its {} bytes of mapped memory, device state and kernels so that a replay after drop fails cleanly (NaN output)",
                self.layout.rank(),
                self.region.len()
            );
            return;
        }
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated in `new`, freed once; no kernel uses it now.
            unsafe {
                let _ = result::free_sync(self.state);
            }
        }
        // SAFETY: dropped exactly once, here; nothing refers to them now
        // (no launch was captured, and the context is synchronized).
        unsafe {
            ManuallyDrop::drop(&mut self.module);
            ManuallyDrop::drop(&mut self.registration);
        }
    }
}
