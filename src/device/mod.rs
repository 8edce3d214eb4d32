//! Device sides: who writes this rank's partial, publishes the call and sums.
//!
//! [`Device`] is the one boundary between the public API and the protocol:
//! it owns the call counter of the host side, the chunk size (a call longer
//! than one slot runs as chunks of at most one slot, `algo::chunked`),
//! publishing a refused call, the sticky error and its translation
//! ([`status`]), and it dispatches each call to a side:
//! * `Host`: the calling thread runs the algorithm on host slices
//!   (`algo::chunked::host`, one `algo::oneshot::host` per chunk) — the
//!   embedded default, and how CI exercises the proxy and fabrics;
//! * `Gpu`: the arx CUDA kernels ([`gpu`], one launch per chunk;
//!   `kernels/oneshot.cuh`, `kernels/twoshot.cuh` for the two-shot
//!   all-reduce, reduce_scatter and all_gather, `kernels/bcast.cuh` for
//!   broadcast).
//!
//! The proxy is reached only through its [`Link`] (post inline, health).

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaStream};

use crate::abi;
use crate::algo::{broadcast, chunked, collective, oneshot};
use crate::config::Config;
use crate::dtype::{Dtype, Element};
use crate::error::{Error, Result};
use crate::layout::{flag_word, Layout, Region};
use crate::proxy::Link;

pub(crate) mod gpu;
mod nvrtc;
pub(crate) use nvrtc::default_cache_dir;
pub(crate) mod order;
pub(crate) mod platform;
pub(crate) mod status;

/// Which side runs the calls.
pub(crate) enum Side {
    Host,
    Gpu(Box<gpu::GpuSide>),
}

/// One instance's device side.
pub(crate) struct Device {
    side: Side,
    region: Arc<Region>,
    layout: Layout,
    cfg: Config,
    link: Link,
    /// Last call made on the host side (the GPU side keeps its counter in
    /// device memory, where graph replays advance it).
    seq: u64,
    /// The first error; every later call returns it (a failed collective
    /// leaves the ranks out of step).
    failed: Option<Error>,
    /// The process's fork count when the instance was made (src/fork.rs).
    born: crate::fork::ForkStamp,
}

impl Device {
    /// The device side over `region` (whose control block already holds
    /// the call timeout, see `establish`).
    pub(crate) fn new(
        side: Side,
        region: Arc<Region>,
        layout: Layout,
        cfg: Config,
        link: Link,
    ) -> Self {
        Device {
            side,
            region,
            layout,
            cfg,
            link,
            seq: 0,
            failed: None,
            born: crate::fork::ForkStamp(crate::fork::generation()),
        }
    }

    /// Whether this process is a fork of the one that made the instance.
    pub(crate) fn forked(&self) -> bool {
        self.born.forked()
    }

    /// The instance's fork stamp.
    pub(crate) fn fork_stamp(&self) -> crate::fork::ForkStamp {
        self.born
    }

    /// The error of every call in a forked child (src/fork.rs), before it
    /// touches MPI, CUDA, the region or a lock the parent's threads may
    /// have held at the fork.
    pub(crate) fn fork_guard(&self) -> Result<()> {
        self.born.check()
    }

    /// In a forked child: forgets the GPU side (its context is the
    /// parent's) instead of freeing it.
    pub(crate) fn abandon(&mut self) {
        std::mem::forget(std::mem::replace(&mut self.side, Side::Host));
    }

    /// "host", or the GPU side's description.
    pub(crate) fn describe(&self) -> String {
        match &self.side {
            Side::Host => "host".into(),
            Side::Gpu(g) => g.describe(),
        }
    }

    /// "host" or "gpu".
    pub(crate) fn kind(&self) -> &'static str {
        match self.side {
            Side::Host => "host",
            Side::Gpu(_) => "gpu",
        }
    }

    /// The GPU side, if this instance runs one.
    pub(crate) fn gpu(&self) -> Option<&gpu::GpuSide> {
        match &self.side {
            Side::Gpu(g) => Some(g),
            Side::Host => None,
        }
    }

    /// The settings the instance runs with.
    pub(crate) fn config(&self) -> &Config {
        &self.cfg
    }

    /// Elements of `dtype` in one chunk: what one slot holds (a longer call
    /// is split into chunks of this many elements, the last one shorter).
    /// The one place a call's size is judged.
    pub(crate) fn max_count(&self, dtype: Dtype) -> usize {
        (self.layout.slot_bytes() / dtype.size()).min(abi::ARX_MAX_CHUNK as usize)
    }

    fn fail(&mut self, e: Error) -> Error {
        self.failed.get_or_insert(e.clone());
        e
    }

    /// The sticky error, or what either side recorded, or the proxy's.
    pub(crate) fn ready(&mut self) -> Result<()> {
        self.fork_guard()?;
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if let Some(e) = status::error(&self.region, &self.layout, &self.link) {
            return Err(self.fail(e));
        }
        self.link.health().map_err(|e| self.fail(e))
    }

    /// Waits for everything enqueued on the GPU (if any).
    pub(crate) fn synchronize(&self) -> Result<()> {
        match &self.side {
            Side::Gpu(g) => g.synchronize(),
            Side::Host => Ok(()),
        }
    }

    /// Synchronizes, then [`Device::ready`].
    pub(crate) fn check(&mut self) -> Result<()> {
        self.fork_guard()?;
        if let Err(e) = self.synchronize() {
            return Err(self.fail(e));
        }
        self.ready()
    }

    /// The call number the next host call uses. On the GPU side the
    /// counter lives in device memory (graph replays advance it without
    /// the host): the GPU is synchronized and the counter read.
    fn next_host_seq(&mut self) -> Result<u64> {
        match &self.side {
            Side::Host => Ok(self.seq + 1),
            Side::Gpu(g) => {
                g.synchronize()?;
                if let Some(e) = status::error(&self.region, &self.layout, &self.link) {
                    return Err(e);
                }
                Ok(g.device_seq()? + 1)
            }
        }
    }

    /// After host call `seq`: the GPU's counter follows it.
    fn host_seq_done(&mut self, seq: u64) -> Result<()> {
        self.seq = seq;
        match &self.side {
            Side::Gpu(g) => g.set_device_seq(seq),
            Side::Host => Ok(()),
        }
    }

    /// One host call (`input` None: in place in `output`).
    pub(crate) fn host_call<T: Element>(
        &mut self,
        input: Option<&[T]>,
        output: &mut [T],
        op: crate::Op,
    ) -> Result<()> {
        self.ready()?;
        if let Some(i) = input {
            if i.len() != output.len() {
                let e = Error::InvalidArgument(format!(
                    "input has {} elements, output {}",
                    i.len(),
                    output.len()
                ));
                return self.refuse_host(output.len(), e);
            }
        }
        let first = self.next_host_seq().map_err(|e| self.fail(e))?;
        let per = self.max_count(T::DTYPE);
        let algo = self.algo(std::mem::size_of_val(output));
        let env = oneshot::Env {
            region: &self.region,
            layout: &self.layout,
            cfg: &self.cfg,
            link: &self.link,
        };
        let (seq, r) = chunked::host(&env, first, per, input, output, op, algo);
        self.host_done(seq, r)
    }

    /// The all-reduce algorithm of a call of `bytes` bytes (`ARX_ALGO`,
    /// [`crate::Algo::choose`]); the first automatic choice of each kind
    /// is logged.
    pub(crate) fn algo(&self, bytes: usize) -> crate::Algo {
        let gpu = matches!(self.side, Side::Gpu(_));
        let a = self
            .cfg
            .algo
            .choose(self.layout.world(), bytes, gpu, self.cfg.fabric);
        if self.cfg.algo == crate::Algo::Auto {
            static LOGGED: [std::sync::Once; 2] = [std::sync::Once::new(), std::sync::Once::new()];
            LOGGED[usize::from(a == crate::Algo::TwoShot)].call_once(|| {
                log::info!(
                    "arx: all-reduce algorithm (ARX_ALGO=auto, {} ranks, {} side): {} for a call of {bytes} bytes{}",
                    self.layout.world(),
                    if gpu { "GPU" } else { "host" },
                    a.name(),
                    match crate::Algo::twoshot_from_bytes(self.layout.world(), gpu, self.cfg.fabric) {
                        Some(from) => format!(" (two-shot from {from} bytes at this world size)"),
                        None => " (always one-shot at this world size)".to_string(),
                    }
                )
            });
        }
        a
    }

    /// After host calls up to `seq` ended with `r`: the counters follow,
    /// a failure sticks.
    fn host_done(&mut self, seq: u64, r: Result<()>) -> Result<()> {
        let r = r.and_then(|()| self.host_seq_done(seq));
        if r.is_err() {
            self.seq = seq;
        }
        r.map_err(|e| self.fail(e))
    }

    /// A host reduce-scatter (`gather` false) or all-gather (`gather`
    /// true) of `n` elements per rank (see `algo::collective`).
    pub(crate) fn host_collective<T: Element>(
        &mut self,
        gather: bool,
        n: usize,
        bufs: collective::Bufs<'_, T>,
        op: crate::Op,
    ) -> Result<()> {
        self.ready()?;
        let first = self.next_host_seq().map_err(|e| self.fail(e))?;
        let per = self.max_count(T::DTYPE);
        let env = oneshot::Env {
            region: &self.region,
            layout: &self.layout,
            cfg: &self.cfg,
            link: &self.link,
        };
        let (seq, r) = if gather {
            collective::all_gather(&env, first, per, n, bufs)
        } else {
            collective::reduce_scatter(&env, first, per, n, bufs, op)
        };
        self.host_done(seq, r)
    }

    /// A host broadcast from `root` of the buffers' elements (see
    /// `algo::broadcast`).
    pub(crate) fn host_broadcast<T: Element>(
        &mut self,
        root: usize,
        bufs: collective::Bufs<'_, T>,
    ) -> Result<()> {
        self.ready()?;
        let first = self.next_host_seq().map_err(|e| self.fail(e))?;
        let per = self.max_count(T::DTYPE);
        let env = oneshot::Env {
            region: &self.region,
            layout: &self.layout,
            cfg: &self.cfg,
            link: &self.link,
        };
        let (seq, r) = broadcast::broadcast(&env, first, per, root, bufs);
        self.host_done(seq, r)
    }

    /// Refuses a host call without leaving the peers to time out: it
    /// publishes the call with the "invalid" dtype and no data, so every
    /// peer fails at once with [`Error::CallMismatch`] naming this rank, and
    /// this rank returns `err`. The instance is failed afterwards.
    pub(crate) fn refuse_host(&mut self, count: usize, err: Error) -> Result<()> {
        match self.next_host_seq() {
            Ok(seq) => {
                let c = count.min(abi::ARX_MAX_CHUNK as usize);
                let word = flag_word(seq, abi::ARX_DTYPE_INVALID, c);
                crate::protocol::publish(&*self.region, seq, word, 0);
                let _ = self.host_seq_done(seq);
            }
            Err(e) => log::warn!("arx: could not announce the refused call to peers: {e}"),
        }
        Err(self.fail(err))
    }

    /// Checks that `stream` belongs to this instance's GPU.
    pub(crate) fn same_context(&self, stream: &CudaStream) -> Result<()> {
        // First of every safe GPU call: before cudarc's driver calls on
        // the caller's buffers in a forked child.
        self.fork_guard()?;
        match &self.side {
            Side::Gpu(g) if g.context().cu_ctx() == stream.context().cu_ctx() => Ok(()),
            Side::Gpu(g) => Err(Error::InvalidArgument(format!(
                "the stream belongs to CUDA device {}, this instance to device {}",
                stream.context().ordinal(),
                g.context().ordinal()
            ))),
            Side::Host => Err(Error::InvalidArgument(
                "this instance runs the host device side (no usable GPU, or ARX_DEVICE=host): use allreduce_host".into(),
            )),
        }
    }

    /// The CUDA context of the GPU side.
    pub(crate) fn cuda_context(&self) -> Option<&Arc<CudaContext>> {
        self.gpu().map(|g| g.context())
    }

    /// One GPU call, enqueued on `stream` (one launch per chunk).
    ///
    /// # Safety
    /// As [`crate::Arx::allreduce_raw`].
    pub(crate) unsafe fn gpu_call(
        &mut self,
        input: u64,
        output: u64,
        count: usize,
        dtype: Dtype,
        op: crate::Op,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.ready()?;
        let per = self.max_count(dtype);
        // The algorithm the host side chooses for the same call, so that
        // ranks mixing GPU and host calls agree.
        let algo = self.algo(count.saturating_mul(dtype.size()));
        let Side::Gpu(g) = &mut self.side else {
            return Err(Error::InvalidArgument(
                "this instance runs the host device side: use allreduce_host".into(),
            ));
        };
        let r = if algo == crate::Algo::TwoShot {
            // SAFETY: the caller's contract (addresses, stream) is passed on.
            unsafe {
                g.launch_collective(
                    gpu::Coll::TwoShot,
                    input,
                    output,
                    count,
                    dtype,
                    per,
                    op,
                    stream,
                )
            }
        } else {
            // SAFETY: as above.
            unsafe { g.launch(input, output, count, Some((dtype, per, op)), stream) }
        };
        r.map_err(|e| self.fail(e))
    }

    /// One GPU reduce-scatter (`gather` false) or all-gather (`gather`
    /// true) of `n` elements per rank, enqueued on `stream` (one launch per
    /// chunk, see [`gpu::GpuSide::launch_collective`]).
    ///
    /// # Safety
    /// As [`crate::Arx::reduce_scatter_raw`] / [`crate::Arx::all_gather_raw`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn gpu_collective(
        &mut self,
        gather: bool,
        input: u64,
        output: u64,
        n: usize,
        dtype: Dtype,
        op: crate::Op,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.ready()?;
        let per = self.max_count(dtype);
        let Side::Gpu(g) = &mut self.side else {
            return Err(Error::InvalidArgument(
                "this instance runs the host device side: use reduce_scatter_host / all_gather_host".into(),
            ));
        };
        let (coll, op) = if gather {
            // The op travels as sum: an all-gather reduces nothing.
            (gpu::Coll::AllGather, crate::Op::Sum)
        } else {
            (gpu::Coll::ReduceScatter, op)
        };
        // SAFETY: the caller's contract (addresses, stream) is passed on.
        let r = unsafe { g.launch_collective(coll, input, output, n, dtype, per, op, stream) };
        r.map_err(|e| self.fail(e))
    }

    /// One GPU broadcast from `root` of `n` elements, enqueued on `stream`
    /// (one launch per chunk, see [`gpu::GpuSide::launch_broadcast`]).
    ///
    /// # Safety
    /// As [`crate::Arx::broadcast_raw`], with `root` a rank.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn gpu_broadcast(
        &mut self,
        input: u64,
        output: u64,
        n: usize,
        dtype: Dtype,
        root: usize,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.ready()?;
        let per = self.max_count(dtype);
        let Side::Gpu(g) = &mut self.side else {
            return Err(Error::InvalidArgument(
                "this instance runs the host device side: use broadcast_host".into(),
            ));
        };
        // SAFETY: the caller's contract (addresses, stream) is passed on.
        let r = unsafe { g.launch_broadcast(input, output, n, dtype, per, root, stream) };
        r.map_err(|e| self.fail(e))
    }

    /// Refuses a GPU call: the kernel publishes it with the "invalid" dtype
    /// and no data (so peers fail at once, also inside a graph), and this
    /// rank returns `err`; the instance is failed afterwards.
    pub(crate) fn refuse_gpu(
        &mut self,
        count: usize,
        err: Error,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.ready()?;
        if let Side::Gpu(g) = &mut self.side {
            let c = count.min(abi::ARX_MAX_CHUNK as usize);
            // SAFETY: an INVALID call touches no input or output memory.
            if let Err(e) = unsafe { g.launch(0, 0, c, None, stream) } {
                log::warn!("arx: could not announce the refused call to peers: {e}");
            }
        }
        Err(self.fail(err))
    }

    /// Test hook: the kernels' conversions (see [`gpu::GpuSide::convert_check`]).
    pub(crate) fn convert_check(&self, bits: &[u32]) -> Result<gpu::ConvertOut> {
        match &self.side {
            Side::Gpu(g) => g.convert_check(bits),
            Side::Host => Err(Error::InvalidArgument("no GPU side".into())),
        }
    }
}
