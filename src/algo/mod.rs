//! Algorithms, one file each, on the host device side; each has its GPU
//! twin in `kernels/` (`oneshot.rs` ↔ `kernels/oneshot.cuh`). Every
//! algorithm gives the same bits: each element is `((p0 + p1) + p2) + …` in
//! rank order with an fp32 accumulator, rounded once.
//!
//! `chunked.rs` runs a call longer than one slot as one-shot or two-shot
//! calls of at most one slot each (on the GPU side: one launch per chunk);
//! `twoshot.rs` is the two-shot all-reduce (a reduce-scatter step, then an
//! all-gather step); `collective.rs` has `reduce_scatter` and
//! `all_gather`, those two steps on their own; `broadcast.rs` has
//! `broadcast` (the root's partial to every rank, nothing reduced).

pub(crate) mod broadcast;
pub(crate) mod chunked;
pub(crate) mod collective;
pub(crate) mod oneshot;
pub(crate) mod twoshot;
