//! What one measurement produced (`Col`), the table's cells, and the JSON
//! file of `-J` (rank 0 writes it).
//!
//! JSON layout (`"format": "arx-allreduce-perf/1"`): a header object with
//! the machine, the instance and the settings, and `"results"`, one record
//! per size × dtype × column:
//!
//! ```text
//! { "size_bytes", "count", "dtype", "column" ("arx", "NCCL", "MPI_Allreduce",
//!   "CUDA-staged MPI_Allreduce"), "placement" ("out-of-place", "in-place"),
//!   "launch" ("host", "eager", "graph"), "median_us", "p99_us", "time_us",
//!   "algbw_GBps", "busbw_GBps", "bw_from" ("time_us" or "median_us"),
//!   "check" ("exact", "tolerance" or null), "wrong", "inexact",
//!   host all-reduce arx columns also: "algo" (the instance's `ARX_ALGO`:
//!   "auto", "oneshot", "twoshot"), "algo_run" (what that setting runs at
//!   this size and world, `Algo::choose`) }
//! ```
//!
//! `-A all` adds the columns "arx-1shot", "arx-2shot", "arx-auto" (header:
//! `"algos"`, each column's algorithm, and `"twoshot_from_bytes"`); `-C`
//! names the collective in the header (`"collective"`: "allreduce",
//! "reduce_scatter", "all_gather"; host instances) with the columns "arx",
//! "MPI_Reduce_scatter_block", "MPI_Allgather" and `"size_rule"`.
//!
//! Times are µs after the `-a` rule; a field that was not measured is null
//! (`p99_us` without `-I`, `time_us` of CUDA-staged MPI, `median_us` of a
//! host column without `-I`/`--median`); `wrong` is null without `--check`.

use std::fmt::Write as _;

use super::colls::Coll;

/// A JSON value, written by hand (no serde in the examples' dependencies).
pub(super) enum J {
    Null,
    Bool(bool),
    Num(f64),
    Int(i64),
    Str(String),
    Arr(Vec<J>),
    Obj(Vec<(String, J)>),
}

impl J {
    pub(super) fn s(v: impl Into<String>) -> J {
        J::Str(v.into())
    }
    pub(super) fn opt(v: Option<f64>) -> J {
        v.map_or(J::Null, J::Num)
    }
    pub(super) fn obj(kv: Vec<(&str, J)>) -> J {
        J::Obj(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
    }

    fn write(&self, out: &mut String, indent: usize) {
        match self {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            // Non-finite numbers have no JSON spelling.
            J::Num(x) if !x.is_finite() => out.push_str("null"),
            J::Num(x) => {
                let _ = write!(out, "{}", (x * 1e4).round() / 1e4);
            }
            J::Int(i) => {
                let _ = write!(out, "{i}");
            }
            J::Str(s) => escape(s, out),
            J::Arr(v) => {
                out.push('[');
                for (i, x) in v.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    // One record per line: readable and diff-able.
                    out.push('\n');
                    out.push_str(&" ".repeat(indent + 2));
                    x.write(out, indent + 2);
                }
                if !v.is_empty() {
                    out.push('\n');
                    out.push_str(&" ".repeat(indent));
                }
                out.push(']');
            }
            J::Obj(kv) => {
                out.push('{');
                let nested = kv.iter().any(|(_, v)| matches!(v, J::Arr(_) | J::Obj(_)));
                for (i, (k, v)) in kv.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    if nested {
                        out.push('\n');
                        out.push_str(&" ".repeat(indent + 2));
                    } else if i > 0 {
                        out.push(' ');
                    }
                    escape(k, out);
                    out.push_str(": ");
                    v.write(out, indent + 2);
                }
                if nested && !kv.is_empty() {
                    out.push('\n');
                    out.push_str(&" ".repeat(indent));
                }
                out.push('}');
            }
        }
    }
}

fn escape(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ` (no date crate needed).
pub(super) fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Days since 1970-01-01 to a civil date (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// How a column's results were checked.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Check {
    /// Not checked (no `--check`).
    Off,
    /// Bit for bit against `arx::verify`'s reference (arx).
    Exact,
    /// Within the sum-order tolerance of `check::tolerance` (NCCL, MPI).
    Tolerance,
}

/// One column's measurement at one size and dtype.
pub(super) struct Col {
    /// "arx", "NCCL", "MPI_Allreduce", "CUDA-staged MPI_Allreduce".
    pub name: &'static str,
    /// "out-of-place" or "in-place".
    pub placement: &'static str,
    /// Median of per-iteration samples (the GPU table's `lat`).
    pub median_us: Option<f64>,
    /// 99th percentile of the same samples (`-I`).
    pub p99_us: Option<f64>,
    /// Back-to-back time per call.
    pub time_us: Option<f64>,
    pub check: Check,
    /// Wrong elements over every checked call and rank.
    pub wrong: u64,
    /// Elements not bit-equal to the reference but within tolerance.
    pub inexact: u64,
}

impl Col {
    /// The time bandwidths come from: back-to-back if measured, else the
    /// median.
    pub(super) fn bw_time(&self) -> (Option<f64>, &'static str) {
        match self.time_us {
            Some(t) => (Some(t), "time_us"),
            None => (self.median_us, "median_us"),
        }
    }
}

/// The collective this run times (`-C`), set once before any bandwidth is
/// computed.
static COLLECTIVE: std::sync::OnceLock<Coll> = std::sync::OnceLock::new();

pub(super) fn set_collective(c: Coll) {
    let _ = COLLECTIVE.set(c);
}

/// nccl-tests' bus bandwidth factor of the collective this run times:
/// all-reduce 2(n−1)/n, reduce-scatter and all-gather (n−1)/n.
pub(super) fn bus_factor(n: usize) -> f64 {
    COLLECTIVE
        .get()
        .copied()
        .unwrap_or(Coll::AllReduce)
        .bus_factor(n)
}

/// Everything `-J` writes; filled on rank 0 only.
#[derive(Default)]
pub(super) struct Report {
    header: Vec<(String, J)>,
    results: Vec<J>,
}

impl Report {
    pub(super) fn set(&mut self, k: &str, v: J) {
        self.header.push((k.to_string(), v));
    }

    pub(super) fn record(
        &mut self,
        size: usize,
        count: usize,
        dtype: &str,
        launch: &str,
        n: usize,
        c: &Col,
    ) {
        self.record_with(size, count, dtype, launch, n, c, vec![]);
    }

    /// [`Report::record`] with more fields at the end (e.g. `algo`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn record_with(
        &mut self,
        size: usize,
        count: usize,
        dtype: &str,
        launch: &str,
        n: usize,
        c: &Col,
        extra: Vec<(&str, J)>,
    ) {
        let (t, from) = c.bw_time();
        let alg = t.map(|t| size as f64 / t / 1e3);
        let checked = c.check != Check::Off;
        let mut fields = vec![
            ("size_bytes", J::Int(size as i64)),
            ("count", J::Int(count as i64)),
            ("dtype", J::s(dtype)),
            ("column", J::s(c.name)),
            ("placement", J::s(c.placement)),
            ("launch", J::s(launch)),
            ("median_us", J::opt(c.median_us)),
            ("p99_us", J::opt(c.p99_us)),
            ("time_us", J::opt(c.time_us)),
            ("algbw_GBps", J::opt(alg)),
            ("busbw_GBps", J::opt(alg.map(|a| a * bus_factor(n)))),
            ("bw_from", J::s(from)),
            (
                "check",
                match c.check {
                    Check::Off => J::Null,
                    Check::Exact => J::s("exact"),
                    Check::Tolerance => J::s("tolerance"),
                },
            ),
            (
                "wrong",
                if checked {
                    J::Int(c.wrong as i64)
                } else {
                    J::Null
                },
            ),
            (
                "inexact",
                if c.check == Check::Tolerance {
                    J::Int(c.inexact as i64)
                } else {
                    J::Null
                },
            ),
        ];
        fields.extend(extra);
        self.results.push(J::obj(fields));
    }

    pub(super) fn write(self, path: &str) -> Result<(), String> {
        let mut kv = vec![("format".to_string(), J::s("arx-allreduce-perf/1"))];
        kv.extend(self.header);
        kv.push(("results".to_string(), J::Arr(self.results)));
        let mut out = String::new();
        J::Obj(kv).write(&mut out, 0);
        out.push('\n');
        std::fs::write(path, out).map_err(|e| format!("-J {path}: {e}"))
    }
}
