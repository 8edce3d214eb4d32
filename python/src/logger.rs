//! arx logs through the `log` crate (warnings such as a collective close
//! without every peer, the environment variables that took effect). A Rust
//! program installs a logger; a Python program has none, so the module
//! installs this one: lines on stderr, at the level `RUST_LOG` names as a
//! plain level (`error`, `warn`, `info`, `debug`, `trace`, `off`; default
//! `warn`). A logger installed before (by another extension) is kept.

use log::{LevelFilter, Log, Metadata, Record};

struct Stderr;

impl Log for Stderr {
    fn enabled(&self, m: &Metadata<'_>) -> bool {
        m.level() <= log::max_level()
    }
    fn log(&self, r: &Record<'_>) {
        if self.enabled(r.metadata()) {
            eprintln!("[{} {}] {}", r.level(), r.target(), r.args());
        }
    }
    fn flush(&self) {}
}

static LOGGER: Stderr = Stderr;

fn level() -> LevelFilter {
    std::env::var("RUST_LOG")
        .ok()
        .and_then(|v| v.trim().parse::<LevelFilter>().ok())
        .unwrap_or(LevelFilter::Warn)
}

/// Installs the logger once; later calls do nothing.
pub(crate) fn init() {
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(level());
    }
}
