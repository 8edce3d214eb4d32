//! arx logs through the `log` crate (warnings such as a collective close
//! without every peer, the environment variables that took effect). A Rust
//! program installs a logger; a Python program has none, so the module
//! installs this one: lines on stderr, at the levels `RUST_LOG` gives, read
//! as `env_logger` reads it: comma-separated directives, each a level
//! (`error`, `warn`, `info`, `debug`, `trace`, `off`: the default for every
//! target), `TARGET=LEVEL`, or a bare `TARGET` (everything from it); a
//! record takes the directive of the longest target that is its own or a
//! module above it (`arx` covers `arx::proxy`), else the default, `warn`
//! when none is given. Unreadable directives are ignored. Read once, when
//! the first `Comm` is made. A logger installed before (by another
//! extension) is kept.

use std::sync::OnceLock;

use log::{LevelFilter, Log, Metadata, Record};

/// `RUST_LOG`'s directives: the default level and per-target levels.
struct Filter {
    default: LevelFilter,
    targets: Vec<(String, LevelFilter)>,
}

impl Filter {
    fn parse(v: &str) -> Filter {
        let mut f = Filter {
            default: LevelFilter::Warn,
            targets: Vec::new(),
        };
        for d in v.split(',').map(str::trim).filter(|d| !d.is_empty()) {
            let (target, level) = match d.split_once('=') {
                Some((t, l)) => match l.trim().parse::<LevelFilter>() {
                    Ok(l) => (t.trim(), l),
                    Err(_) => continue,
                },
                None => match d.parse::<LevelFilter>() {
                    Ok(l) => {
                        f.default = l;
                        continue;
                    }
                    Err(_) => (d, LevelFilter::Trace),
                },
            };
            if !target.is_empty() {
                f.targets.retain(|(t, _)| t != target);
                f.targets.push((target.to_string(), level));
            }
        }
        f
    }

    /// The level for records of `target`.
    fn level(&self, target: &str) -> LevelFilter {
        self.targets
            .iter()
            .filter(|(t, _)| {
                target == t
                    || (target.starts_with(t.as_str()) && target[t.len()..].starts_with("::"))
            })
            .max_by_key(|(t, _)| t.len())
            .map_or(self.default, |&(_, l)| l)
    }

    /// The most any record can pass at (for `log::set_max_level`).
    fn max(&self) -> LevelFilter {
        self.targets
            .iter()
            .map(|&(_, l)| l)
            .fold(self.default, std::cmp::max)
    }
}

struct Stderr;

static FILTER: OnceLock<Filter> = OnceLock::new();

impl Log for Stderr {
    fn enabled(&self, m: &Metadata<'_>) -> bool {
        FILTER
            .get()
            .is_some_and(|f| m.level() <= f.level(m.target()))
    }
    fn log(&self, r: &Record<'_>) {
        if self.enabled(r.metadata()) {
            eprintln!("[{} {}] {}", r.level(), r.target(), r.args());
        }
    }
    fn flush(&self) {}
}

static LOGGER: Stderr = Stderr;

/// The level a `RUST_LOG` value `v` gives records of `target` (the tests').
pub(crate) fn level_of(v: &str, target: &str) -> LevelFilter {
    Filter::parse(v).level(target)
}

/// Installs the logger once; later calls do nothing.
pub(crate) fn init() {
    let f = FILTER.get_or_init(|| Filter::parse(&std::env::var("RUST_LOG").unwrap_or_default()));
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(f.max());
    }
}
