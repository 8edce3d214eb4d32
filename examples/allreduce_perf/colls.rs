//! `-C reduce_scatter` and `-C all_gather`: arx's `reduce_scatter_host_op`
//! and `all_gather_host` (out of place) on a host instance (GPU instance:
//! module `gpu`), beside
//! `MPI_Reduce_scatter_block` and `MPI_Allgather` on the same ranks, timed
//! as the all-reduce host columns are (`-n` back-to-back calls after `-w`
//! warm-ups; `-a`, `-I`, `--median` as there).
//!
//! **Sizes** follow nccl-tests' reduce_scatter_perf and all_gather_perf:
//! a size is the whole buffer (reduce-scatter: the send buffer of N blocks;
//! all-gather: the receive buffer of N blocks); each rank's block is
//! `⌊size / (4·N·e)⌋·4` elements of e bytes (nccl-tests aligns blocks to 4
//! elements), the size shown is that block × N × e, and `count` is the
//! block's elements. A size too small for one aligned block is skipped.
//! algbw = size ÷ time, busbw = algbw × (N−1)/N (nccl-tests' factor for
//! both).
//!
//! **MPI columns**: the same bytes as floats (MPI has no bfloat16/half
//! sum): `MPI_Reduce_scatter_block` float sum, checked within the sum-order
//! tolerance of `check`; `MPI_Allgather`, checked bit for bit.
//!
//! **`--check`**: arx bit for bit against an independent reference built
//! on every rank from every rank's seeded inputs: reduce-scatter, block r
//! of `arx::verify::expected_op` (the rank-order all-reduce reference) of
//! the N-block inputs; all-gather, every rank's input concatenated in rank
//! order (and every rank's result must have rank 0's bits). The timed
//! calls' last result, then three fresh inputs into poisoned outputs.
//!
//! GPU instances: module `gpu` times `reduce_scatter_op` / `all_gather`
//! (and their in-place forms) on device buffers as it times the
//! all-reduce, with the sizes above and this module's MPI calls and checks
//! (`lens`, `mpi_call`, `mpi_check`) for its CUDA-staged MPI column.

use arx::{verify, Arx, Element};
use half::{bf16, f16};
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use super::report::{Check, Col, J};
use super::table::*;
use super::{back_to_back, check, common_header, host_devices, host_times, Run, MPI_SEED};

/// `-C`: which collective the sweep times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Coll {
    AllReduce,
    ReduceScatter,
    AllGather,
}

impl Coll {
    pub(super) fn from_arg(s: &str) -> Result<Self, String> {
        match s {
            "allreduce" | "all_reduce" => Ok(Coll::AllReduce),
            "reduce_scatter" | "reducescatter" => Ok(Coll::ReduceScatter),
            "all_gather" | "allgather" => Ok(Coll::AllGather),
            _ => Err(format!(
                "-C {s}: expected allreduce, reduce_scatter or all_gather"
            )),
        }
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "allreduce",
            Coll::ReduceScatter => "reduce_scatter",
            Coll::AllGather => "all_gather",
        }
    }

    /// nccl-tests' bus bandwidth factor.
    pub(super) fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::ReduceScatter | Coll::AllGather => (n - 1.0) / n,
        }
    }

    pub(super) fn mpi_name(self) -> &'static str {
        match self {
            Coll::AllReduce => "MPI_Allreduce",
            Coll::ReduceScatter => "MPI_Reduce_scatter_block",
            Coll::AllGather => "MPI_Allgather",
        }
    }
}

/// Elements per rank's block of a `size`-byte buffer over `n` ranks, as
/// nccl-tests: rounded down to a multiple of 4 elements.
pub(super) fn block_count(size: usize, esize: usize, n: usize) -> usize {
    size / esize / (4 * n) * 4
}

fn layout(args: &super::Args, coll: Coll) -> Layout {
    let mut l = vec![("arx".to_string(), fields(Kind::Host, args.per_iter))];
    if !args.no_mpi {
        l.push((coll.mpi_name().into(), fields(Kind::Host, args.per_iter)));
        l.push(("".into(), vec![("speedup", "(x)", 7)]));
    }
    l
}

/// The sweep of `coll` (reduce-scatter or all-gather) on a host instance:
/// total wrong elements.
pub(super) fn run_host_coll(
    run: &mut Run,
    arx: &mut Arx,
    coll: Coll,
    dtypes: &[&'static str],
    sizes: &[usize],
) -> Result<u64, String> {
    let (args, world) = (run.args, run.world);
    if coll == Coll::AllGather && run.op != arx::Op::Sum {
        return Err(format!("-o {}: all_gather has no reduction", run.op));
    }
    let n = world.size() as usize;
    let d = arx.describe();
    let (hosts, devices) = host_devices(world);
    let redop = if coll == Coll::AllGather {
        "none"
    } else {
        run.op.name()
    };
    if world.rank() == 0 {
        common_header(run, &d, &hosts, &devices);
        let r = &mut run.report;
        r.set("collective", J::s(coll.name()));
        r.set(
            "size_rule",
            J::s("nccl-tests: size = the whole buffer (N blocks); count = elements per rank's block, rounded down to a multiple of 4"),
        );
        r.set("staging", J::Null);
        r.set(
            "nccl",
            J::obj(vec![
                ("status", J::s("not run (host instance)")),
                ("version", J::Null),
            ]),
        );
        let (call, buf) = match coll {
            Coll::ReduceScatter => ("reduce_scatter_host", "send buffer"),
            _ => ("all_gather_host", "receive buffer"),
        };
        println!(
            "# arx: {call}, out of place; time = {} per call of -n back-to-back calls",
            if args.median { "median" } else { "mean" }
        );
        println!(
            "# size = the whole {buf} of {n} blocks (nccl-tests' {}_perf convention); count = elements per rank's block (rounded down to a multiple of 4); busbw = algbw x (N-1)/N",
            coll.name()
        );
        if !args.no_mpi {
            println!(
                "# {}: the same bytes as floats, timed alike; {}; speedup = MPI time / arx time",
                coll.mpi_name(),
                if coll == Coll::ReduceScatter {
                    "float sum, checked within the sum-order tolerance"
                } else {
                    "checked bit for bit"
                }
            );
        }
        println!("#");
        print_table_header(&layout(args, coll));
    }
    let mut total_wrong = 0;
    for &dt in dtypes {
        let esize = if dt == "float" { 4 } else { 2 };
        for &size in sizes {
            let per = block_count(size, esize, n);
            if per == 0 {
                continue;
            }
            let a = match dt {
                "bfloat16" => arx_col::<bf16>(run, arx, coll, per)?,
                "half" => arx_col::<f16>(run, arx, coll, per)?,
                _ => arx_col::<f32>(run, arx, coll, per)?,
            };
            let m = if args.no_mpi {
                None
            } else {
                Some(mpi_col(run, coll, per * esize / 4)?)
            };
            total_wrong += a.wrong + m.as_ref().map_or(0, |m| m.wrong);
            if world.rank() == 0 {
                let shown = per * n * esize;
                let mut g = vec![(
                    widths(Kind::Host, args.per_iter),
                    cells(Kind::Host, args.per_iter, &a, shown, n),
                )];
                run.report.record(shown, per, dt, "host", n, &a);
                if let Some(m) = &m {
                    g.push((
                        widths(Kind::Host, args.per_iter),
                        cells(Kind::Host, args.per_iter, m, shown, n),
                    ));
                    let sp = match (m.time_us, a.time_us) {
                        (Some(x), Some(y)) => format!("{:.1}", x / y),
                        _ => "-".into(),
                    };
                    g.push((vec![7], vec![sp]));
                    run.report.record(shown, per, dt, "host", n, m);
                }
                print_table_row_redop(shown, per, dt, redop, &g);
            }
        }
    }
    Ok(total_wrong)
}

/// The reference of this rank's output for call `call`: built from every
/// rank's seeded inputs, not from any arx call.
fn want<T: Element>(
    coll: Coll,
    op: arx::Op,
    seed: u64,
    call: u64,
    n: usize,
    rank: usize,
    per: usize,
) -> Vec<T> {
    match coll {
        Coll::ReduceScatter => {
            let all = verify::expected_op::<T>(op, false, seed, call, n, n * per);
            all[rank * per..(rank + 1) * per].to_vec()
        }
        _ => (0..n)
            .flat_map(|r| verify::input::<T>(seed, call, r, per))
            .collect(),
    }
}

/// The arx column: blocks of `per` elements.
fn arx_col<T: Element>(
    run: &mut Run,
    arx: &mut Arx,
    coll: Coll,
    per: usize,
) -> Result<Col, String> {
    let (args, world, check, op) = (run.args, run.world, run.check, run.op);
    let rank = world.rank() as usize;
    let n = world.size() as usize;
    let (in_len, out_len) = lens(coll, n, per);
    let seed = 0x0c01_1ec7;
    let fail = |e: arx::Error| format!("{} of {per} x {:?} per rank: {e}", coll.name(), T::DTYPE);
    let call = |arx: &mut Arx, inp: &[T], out: &mut [T]| match coll {
        Coll::ReduceScatter => arx.reduce_scatter_host_op(inp, out, op),
        _ => arx.all_gather_host(inp, out),
    };
    run.call += 1;
    let timed_call = run.call;
    let input = verify::input::<T>(seed, timed_call, rank, in_len);
    let mut out = vec![T::from_f32(0.0); out_len];
    for _ in 0..args.warmup {
        call(arx, &input, &mut out).map_err(fail)?;
    }
    world.barrier();
    let (samples, mean) = back_to_back(args.iters.max(1), || {
        call(arx, &input, &mut out).map_err(fail)
    })?;
    let (median_us, p99_us, time) = host_times(run, &samples, mean);
    let mut col = Col {
        name: "arx",
        placement: "out-of-place",
        median_us,
        p99_us,
        time_us: Some(time),
        check: if check { Check::Exact } else { Check::Off },
        wrong: 0,
        inexact: 0,
    };
    if check {
        // Reduce-scatter blocks differ by rank (no digest comparison);
        // all-gather results must be the same everywhere.
        let tally = |got: &[T], want: &[T]| match coll {
            Coll::ReduceScatter => check::tally_own(world, got, want, None).0,
            _ => check::tally(world, got, want, None).0,
        };
        col.wrong += tally(&out, &want::<T>(coll, op, seed, timed_call, n, rank, per));
        for _ in 0..3 {
            run.call += 1;
            let inp = verify::input::<T>(seed, run.call, rank, in_len);
            verify::poison(&mut out);
            call(arx, &inp, &mut out).map_err(fail)?;
            col.wrong += tally(&out, &want::<T>(coll, op, seed, run.call, n, rank, per));
        }
    }
    Ok(col)
}

/// (input, output) elements of one call of `coll` with `per` elements per
/// rank's block over `n` ranks (all-reduce: `per` both).
pub(super) fn lens(coll: Coll, n: usize, per: usize) -> (usize, usize) {
    match coll {
        Coll::AllReduce => (per, per),
        Coll::ReduceScatter => (n * per, per),
        Coll::AllGather => (per, n * per),
    }
}

/// One MPI call of `coll` on floats (sum).
pub(super) fn mpi_call(world: &SimpleCommunicator, coll: Coll, send: &[f32], recv: &mut [f32]) {
    let sum = SystemOperation::sum();
    match coll {
        Coll::AllReduce => world.all_reduce_into(send, recv, sum),
        Coll::ReduceScatter => world.reduce_scatter_block_into(send, recv, sum),
        Coll::AllGather => world.all_gather_into(send, recv),
    }
}

/// Whether the MPI column of `coll` is checked within the sum-order
/// tolerance (a reduction), or bit for bit (all-gather).
pub(super) fn mpi_tolerant(coll: Coll) -> bool {
    coll != Coll::AllGather
}

/// (wrong, inexact) over all ranks of an MPI column's result `recv`, blocks
/// of `floats`, every rank's input seeded by `call_no`. Collective.
pub(super) fn mpi_check(
    world: &SimpleCommunicator,
    coll: Coll,
    call_no: u64,
    floats: usize,
    recv: &[f32],
) -> (u64, u64) {
    let rank = world.rank() as usize;
    let n = world.size() as usize;
    let in_len = lens(coll, n, floats).0;
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|r| verify::input::<f32>(MPI_SEED, call_no, r, in_len))
        .collect();
    match coll {
        Coll::AllReduce => {
            let (want, tol) = check::want(&inputs, true);
            check::tally(world, recv, &want, tol.as_deref())
        }
        Coll::ReduceScatter => {
            let (want, tol) = check::want(&inputs, true);
            let block = rank * floats..(rank + 1) * floats;
            let tol = tol.map(|t| t[block.clone()].to_vec());
            check::tally_own(world, recv, &want[block], tol.as_deref())
        }
        Coll::AllGather => (check::tally(world, recv, &inputs.concat(), None).0, 0),
    }
}

/// The MPI column: blocks of `floats` floats (the arx block's bytes).
fn mpi_col(run: &mut Run, coll: Coll, floats: usize) -> Result<Col, String> {
    let (args, world, check) = (run.args, run.world, run.check);
    let rank = world.rank() as usize;
    let n = world.size() as usize;
    let (in_len, out_len) = lens(coll, n, floats);
    // The call number is the block's size, as the all-reduce MPI column's
    // is its size.
    let call_no = (floats * n) as u64;
    let send = verify::input::<f32>(MPI_SEED, call_no, rank, in_len);
    let mut recv = vec![0f32; out_len];
    for _ in 0..args.warmup {
        mpi_call(world, coll, &send, &mut recv);
    }
    world.barrier();
    verify::poison(&mut recv);
    let (samples, mean) = back_to_back(args.iters.max(1), || {
        mpi_call(world, coll, &send, &mut recv);
        Ok(())
    })?;
    let (median_us, p99_us, time) = host_times(run, &samples, mean);
    let mut m = Col {
        name: coll.mpi_name(),
        placement: "out-of-place",
        median_us,
        p99_us,
        time_us: Some(time),
        check: match (check, mpi_tolerant(coll)) {
            (false, _) => Check::Off,
            (true, true) => Check::Tolerance,
            (true, false) => Check::Exact,
        },
        wrong: 0,
        inexact: 0,
    };
    if check {
        (m.wrong, m.inexact) = mpi_check(world, coll, call_no, floats, &recv);
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_follow_nccl_tests() {
        // nccl-tests: base = count / (4 N) * 4 elements per rank.
        assert_eq!(block_count(1 << 20, 4, 8), 32768);
        assert_eq!(block_count(1 << 20, 2, 3), 174760);
        assert_eq!(block_count(48, 4, 3), 4);
        assert_eq!(block_count(47, 4, 3), 0);
        assert_eq!(block_count(8, 2, 2), 0);
        assert_eq!(Coll::AllGather.bus_factor(4), 0.75);
        assert_eq!(Coll::AllReduce.bus_factor(4), 1.5);
    }
}
