//! Device sides: who writes this rank's partial, publishes the call and sums.
//!
//! `Host` runs the protocol on host slices with the calling thread (the
//! embedded default, and how CI exercises the proxy and fabrics); `Gpu` runs
//! it inside the arx CUDA kernel.

pub(crate) mod gpu;
pub(crate) mod host;
pub(crate) mod order;
