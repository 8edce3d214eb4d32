//! `reduce_scatter`, `all_gather` and `broadcast` on host memory (NCCL's
//! definitions, see `algo::collective` and `algo::broadcast`).

use crate::algo::collective::Bufs;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::{Arx, Op};

impl Arx {
    /// Elements per rank of an in-place `what` (reduce_scatter or
    /// all_gather) on a buffer of `len` elements (host or GPU), or the
    /// error to refuse the call with.
    pub(crate) fn in_place_blocks(&self, what: &str, len: usize) -> Result<usize> {
        let world = self.world();
        if len % world != 0 {
            return Err(Error::InvalidArgument(format!(
                "{what} in place: the buffer's {len} elements are not a multiple of {world} ranks"
            )));
        }
        Ok(len / world)
    }

    /// The error refusing a broadcast from `root`, if `root` is no rank.
    pub(crate) fn bad_root(&self, root: usize) -> Option<Error> {
        let world = self.world();
        (root >= world).then(|| {
            Error::InvalidArgument(format!(
                "broadcast: root {root} is not a rank of this {world}-rank instance"
            ))
        })
    }

    /// Reduce-scatter: `input` holds `N·n` elements (N ranks); the sum of
    /// every rank's `input` is computed and block `r` of it (elements
    /// `r·n..(r+1)·n`) lands in rank `r`'s `output` of `n` elements. Bit for
    /// bit block `r` of [`Arx::allreduce_host`] of the same inputs.
    pub fn reduce_scatter_host<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        self.reduce_scatter_host_op(input, output, Op::Sum)
    }

    /// [`Arx::reduce_scatter_host`] with the reduction `op` (see
    /// [`Arx::allreduce_op`]).
    pub fn reduce_scatter_host_op<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: Op,
    ) -> Result<()> {
        let (world, n) = (self.world(), output.len());
        if input.len() != world.saturating_mul(n) {
            let e = Error::InvalidArgument(format!(
                "reduce_scatter: input has {} elements, expected {world} ranks x {n} (the output's length)",
                input.len()
            ));
            return Err(self.refuse_call(n, e));
        }
        self.device
            .host_collective(false, n, Bufs::Separate(input, output), op)
    }

    /// In-place [`Arx::reduce_scatter_host`]: `buf` holds `N·n` elements;
    /// this rank's block (`rank·n..(rank+1)·n`) receives the result, the
    /// other blocks are left as they were.
    pub fn reduce_scatter_host_in_place<T: Element>(&mut self, buf: &mut [T]) -> Result<()> {
        self.reduce_scatter_host_in_place_op(buf, Op::Sum)
    }

    /// [`Arx::reduce_scatter_host_in_place`] with the reduction `op`.
    pub fn reduce_scatter_host_in_place_op<T: Element>(
        &mut self,
        buf: &mut [T],
        op: Op,
    ) -> Result<()> {
        let n = match self.in_place_blocks("reduce_scatter", buf.len()) {
            Ok(n) => n,
            Err(e) => return Err(self.refuse_call(buf.len() / self.world(), e)),
        };
        self.device
            .host_collective(false, n, Bufs::InPlace(buf), op)
    }

    /// All-gather: every rank's `input` of `n` elements, concatenated in
    /// rank order, lands in every rank's `output` of `N·n` elements.
    pub fn all_gather_host<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        let (world, n) = (self.world(), input.len());
        if output.len() != world.saturating_mul(n) {
            let e = Error::InvalidArgument(format!(
                "all_gather: output has {} elements, expected {world} ranks x {n} (the input's length)",
                output.len()
            ));
            return Err(self.refuse_call(n, e));
        }
        self.device
            .host_collective(true, n, Bufs::Separate(input, output), Op::Sum)
    }

    /// In-place [`Arx::all_gather_host`]: `buf` holds `N·n` elements, this
    /// rank's block (`rank·n..(rank+1)·n`) is its input; every block is
    /// filled.
    pub fn all_gather_host_in_place<T: Element>(&mut self, buf: &mut [T]) -> Result<()> {
        let n = match self.in_place_blocks("all_gather", buf.len()) {
            Ok(n) => n,
            Err(e) => return Err(self.refuse_call(buf.len() / self.world(), e)),
        };
        self.device
            .host_collective(true, n, Bufs::InPlace(buf), Op::Sum)
    }

    /// Broadcast: the root's `input` lands in every rank's `output`, bit
    /// for bit (NCCL's `ncclBroadcast`). Every rank passes the same `root`
    /// and lengths; `input` is read on the root only, yet its length must
    /// equal `output`'s on every rank. A `root` that is no rank is refused
    /// with [`Error::InvalidArgument`] (its peers fail at once naming this
    /// rank), as are ranks that disagree on the root or the length: they
    /// fail with [`Error::CallMismatch`] instead of waiting (one case of
    /// root disagreement lets some ranks pass, see the README).
    pub fn broadcast_host<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        let n = output.len();
        if let Some(e) = self.bad_root(root) {
            return Err(self.refuse_call(n, e));
        }
        if input.len() != n {
            let e = Error::InvalidArgument(format!(
                "broadcast: input has {} elements, output {n}",
                input.len()
            ));
            return Err(self.refuse_call(n, e));
        }
        self.device
            .host_broadcast(root, Bufs::Separate(input, output))
    }

    /// In-place [`Arx::broadcast_host`]: `buf` is the root's input and
    /// every rank's output.
    pub fn broadcast_host_in_place<T: Element>(
        &mut self,
        buf: &mut [T],
        root: usize,
    ) -> Result<()> {
        if let Some(e) = self.bad_root(root) {
            return Err(self.refuse_call(buf.len(), e));
        }
        self.device.host_broadcast(root, Bufs::InPlace(buf))
    }
}
