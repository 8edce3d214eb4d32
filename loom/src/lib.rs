//! The loom model of arx's host-side synchronisation.
//!
//! `src/protocol.rs` — the protocol's ordering-bearing steps, which the
//! library's Host device side, proxy and Shm fabric call — is compiled here
//! by `#[path]` against this crate's `sync` (loom's atomics) and an
//! in-memory region ([`region::Rank`]), and driven by threads that play the
//! ranks' device sides and proxies (`tests.rs`). loom runs each model under
//! every interleaving (up to a preemption bound) and every outcome the
//! Rust/C++11 memory model allows: the reorderings that an aarch64 CPU
//! performs and an x86 one hides.
//!
//! A crate of its own, not `--cfg loom` on arx: building arx with another
//! `RUSTFLAGS` rebuilds every dependency of arx (cudarc, mpi, bindgen,
//! rdma-sys, hwloc) in a separate target directory, several minutes on
//! the 2-core CI machine, for a model that needs none of them. This crate
//! depends on loom alone and reads the ABI's constants from
//! `kernels/arx_abi.h` itself (build.rs).
//!
//! Run: `cargo test --release -p arx-loom` (`scripts/test-loom`).
//! `LOOM_MAX_PREEMPTIONS` overrides the preemption bound of each model.

// The model's pieces are used by the tests only.
#![cfg_attr(not(test), allow(dead_code))]

/// The ABI's constants (kernels/arx_abi.h, read by build.rs).
#[allow(dead_code)]
pub(crate) mod abi {
    include!(concat!(env!("OUT_DIR"), "/abi.rs"));
}

#[allow(dead_code)]
#[path = "../../src/protocol.rs"]
pub(crate) mod protocol;

mod region;
mod sync;

#[cfg(test)]
mod tests;
