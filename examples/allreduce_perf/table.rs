//! The tables' layout: column groups, their cells, header and rows
//! (rank 0 prints them).

use super::report::{bus_factor, Check, Col};

/// A column group's kind: which cells it shows.
#[derive(Clone, Copy)]
pub(super) enum Kind {
    /// lat [p99] time algbw busbw #wrong (GPU arx and NCCL).
    Gpu,
    /// lat [p99] algbw busbw #wrong (CUDA-staged MPI).
    Staged,
    /// time [med p99] algbw busbw #wrong (host arx and MPI).
    Host,
}

/// (name, unit, width) of each cell of a group.
pub(super) fn fields(k: Kind, per_iter: bool) -> Vec<(&'static str, &'static str, usize)> {
    let mut v = vec![];
    match k {
        Kind::Gpu => {
            v.push(("lat", "(us)", 8));
            if per_iter {
                v.push(("p99", "(us)", 8));
            }
            v.extend([
                ("time", "(us)", 8),
                ("algbw", "(GB/s)", 6),
                ("busbw", "(GB/s)", 6),
            ]);
            v.push(("#wrong", "", 6));
        }
        Kind::Staged => {
            v.push(("lat", "(us)", 9));
            if per_iter {
                v.push(("p99", "(us)", 9));
            }
            v.extend([
                ("algbw", "(GB/s)", 7),
                ("busbw", "(GB/s)", 7),
                ("#wrong", "", 6),
            ]);
        }
        Kind::Host => {
            v.push(("time", "(us)", 9));
            if per_iter {
                v.extend([("med", "(us)", 9), ("p99", "(us)", 9)]);
            }
            v.extend([
                ("algbw", "(GB/s)", 7),
                ("busbw", "(GB/s)", 7),
                ("#wrong", "", 7),
            ]);
        }
    }
    v
}

/// The cells of `c` in group kind `k`.
pub(super) fn cells(k: Kind, per_iter: bool, c: &Col, size: usize, n: usize) -> Vec<String> {
    let f = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |x| format!("{x:.2}"));
    let (t, _) = c.bw_time();
    let alg = t.map(|t| size as f64 / t / 1e3);
    let bus = alg.map(|a| a * bus_factor(n));
    let wrong = if c.check == Check::Off {
        "N/A".to_string()
    } else {
        c.wrong.to_string()
    };
    let mut v = vec![];
    match k {
        Kind::Gpu => {
            v.push(f(c.median_us));
            if per_iter {
                v.push(f(c.p99_us));
            }
            v.push(f(c.time_us));
        }
        Kind::Staged => {
            v.push(f(c.median_us));
            if per_iter {
                v.push(f(c.p99_us));
            }
        }
        Kind::Host => {
            v.push(f(c.time_us));
            if per_iter {
                v.push(f(c.median_us));
                v.push(f(c.p99_us));
            }
        }
    }
    v.extend([f(alg), f(bus), wrong]);
    v
}

/// A table's groups: (title, fields).
pub(super) type Layout = Vec<(String, Vec<(&'static str, &'static str, usize)>)>;

fn group_width(fs: &[(&str, &str, usize)]) -> usize {
    fs.iter().map(|f| f.2).sum::<usize>() + fs.len().saturating_sub(1)
}

pub(super) fn print_table_header(groups: &Layout) {
    let mut t = format!("# {:>10} {:>10} {:>9} {:>6}", "", "", "", "");
    let mut names = format!(
        "# {:>10} {:>10} {:>9} {:>6}",
        "size", "count", "type", "redop"
    );
    let mut units = format!("# {:>10} {:>10} {:>9} {:>6}", "(B)", "(elements)", "", "");
    for (title, fs) in groups {
        let w = group_width(fs);
        t.push_str(&format!(" | {title:^w$}"));
        let join = |pick: &dyn Fn(&(&str, &str, usize)) -> String| {
            fs.iter().map(pick).collect::<Vec<_>>().join(" ")
        };
        names.push_str(&format!(
            " | {}",
            join(&|f| format!("{:>w$}", f.0, w = f.2))
        ));
        units.push_str(&format!(
            " | {}",
            join(&|f| format!("{:>w$}", f.1, w = f.2))
        ));
    }
    println!("{}", t.trim_end());
    println!("{names}");
    println!("{units}");
}

pub(super) fn print_table_row(
    size: usize,
    count: usize,
    dtype: &str,
    op: arx::Op,
    groups: &[(Vec<usize>, Vec<String>)],
) {
    print_table_row_redop(size, count, dtype, op.name(), groups);
}

/// [`print_table_row`] with the redop cell spelled out ("none" for
/// all-gather, as nccl-tests prints).
pub(super) fn print_table_row_redop(
    size: usize,
    count: usize,
    dtype: &str,
    redop: &str,
    groups: &[(Vec<usize>, Vec<String>)],
) {
    let mut s = format!("  {size:>10} {count:>10} {dtype:>9} {redop:>6}");
    for (ws, cs) in groups {
        let cells: Vec<String> = ws.iter().zip(cs).map(|(w, c)| format!("{c:>w$}")).collect();
        s.push_str(&format!(" | {}", cells.join(" ")));
    }
    println!("{s}");
}

pub(super) fn widths(k: Kind, per_iter: bool) -> Vec<usize> {
    fields(k, per_iter).iter().map(|f| f.2).collect()
}
