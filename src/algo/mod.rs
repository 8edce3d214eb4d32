//! Algorithms, one file each, on the host device side; each has its GPU
//! twin in `kernels/` (`oneshot.rs` ↔ `kernels/oneshot.cuh`). Every
//! algorithm gives the same bits: each element is `((p0 + p1) + p2) + …` in
//! rank order with an fp32 accumulator, rounded once.

pub(crate) mod oneshot;
