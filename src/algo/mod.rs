//! Algorithms, one file each, on the host device side; each has its GPU
//! twin in `kernels/` (`oneshot.rs` ↔ `kernels/oneshot.cuh`). Every
//! algorithm gives the same bits: each element is `((p0 + p1) + p2) + …` in
//! rank order with an fp32 accumulator, rounded once.
//!
//! `chunked.rs` runs a call longer than one slot as one-shot calls of at
//! most one slot each (on the GPU side: one launch per chunk).

pub(crate) mod chunked;
pub(crate) mod oneshot;
