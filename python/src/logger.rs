//! arx logs through the `log` crate (warnings such as a collective close
//! without every peer, the environment variables that took effect). A Rust
//! program installs a logger; a Python program has none, so the module
//! installs this one: lines on stderr, at the level `RUST_LOG` names
//! (`error`, `warn`, `info`, `debug`, `trace`, `off`; default `warn`),
//! either plain (`info`) or, as a Rust program's `env_logger` takes it, for
//! arx (`arx=info`, also among others: `warn,arx=debug`; a directive for
//! arx wins over a plain level, one for another crate is ignored). A logger
//! installed before (by another extension) is kept.

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

/// The level `RUST_LOG`'s value `v` gives arx's records (module doc).
pub(crate) fn level_of(v: &str) -> LevelFilter {
    let (mut plain, mut ours) = (None, None);
    for d in v.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        match d.split_once('=') {
            None => plain = d.parse::<LevelFilter>().ok().or(plain),
            Some((target, l)) => {
                let target = target.trim();
                if target == "arx" || target.starts_with("arx::") {
                    ours = l.trim().parse::<LevelFilter>().ok().or(ours);
                }
            }
        }
    }
    ours.or(plain).unwrap_or(LevelFilter::Warn)
}

fn level() -> LevelFilter {
    level_of(&std::env::var("RUST_LOG").unwrap_or_default())
}

/// Installs the logger once; later calls do nothing.
pub(crate) fn init() {
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(level());
    }
}
