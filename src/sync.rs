//! The atomics the protocol's steps ([`crate::protocol`]) are written
//! against: std's here. The loom model (`loom/`, which compiles
//! `src/protocol.rs` into its own crate by `#[path]`) has a `sync` module of
//! its own that puts loom's atomics under the same names, so the model
//! explores the very code the library runs.

pub(crate) mod atomic {
    pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
}
