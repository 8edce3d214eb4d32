//! How each rank's times become the one number a table cell shows (`-a`),
//! and the per-iteration statistics (`-I`).
//!
//! A *sample* is one rank's time of one iteration. Iterations are aligned
//! across ranks: on a GPU instance every latency sample starts after an MPI
//! barrier; on a host instance sample i is each rank's i-th of a run of
//! back-to-back calls, which is the same collective call on every rank.

use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

/// `-a`: how the ranks' times are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Across {
    /// 0 (default): per iteration, the slowest rank's time (the largest any
    /// rank measured for that iteration); statistics are taken over those
    /// per-iteration maxima. A single number per rank (a back-to-back
    /// time): the largest.
    Slowest,
    /// 1: each rank's statistic, averaged over the ranks (nccl-tests' 1).
    Avg,
    /// 2: each rank's statistic, the smallest over the ranks (nccl-tests' 2).
    Min,
    /// 3: each rank's statistic, the largest over the ranks (nccl-tests' 3).
    Max,
}

impl Across {
    pub(super) fn from_arg(a: u8) -> Result<Self, String> {
        match a {
            0 => Ok(Across::Slowest),
            1 => Ok(Across::Avg),
            2 => Ok(Across::Min),
            3 => Ok(Across::Max),
            _ => Err(format!(
                "-a {a}: expected 0 (slowest rank per iteration), 1 (average), 2 (min) or 3 (max) across ranks"
            )),
        }
    }

    pub(super) fn code(self) -> u8 {
        match self {
            Across::Slowest => 0,
            Across::Avg => 1,
            Across::Min => 2,
            Across::Max => 3,
        }
    }

    pub(super) fn describe(self) -> &'static str {
        match self {
            Across::Slowest => "slowest rank per iteration (-a 0): statistics of the per-iteration maximum over ranks; back-to-back times: the largest rank's",
            Across::Avg => "average over ranks of each rank's own statistic (-a 1)",
            Across::Min => "smallest over ranks of each rank's own statistic (-a 2)",
            Across::Max => "largest over ranks of each rank's own statistic (-a 3)",
        }
    }
}

/// The median of sorted `v`: its ⌊n/2⌋+1-th smallest (the upper median).
pub(super) fn median_sorted(v: &[f64]) -> f64 {
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The nearest-rank 99th percentile of sorted `v`: its ⌈0.99·n⌉-th
/// smallest (for fewer than 100 samples, the largest).
pub(super) fn p99_sorted(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let k = (v.len() * 99).div_ceil(100).max(1);
    v[k - 1]
}

fn sorted(v: &[f64]) -> Vec<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s
}

/// This rank's samples (µs, the same count on every rank) → (median, p99)
/// combined across ranks by `a`. Collective.
pub(super) fn samples(world: &SimpleCommunicator, a: Across, v: &[f64]) -> (f64, f64) {
    if a == Across::Slowest {
        let mut worst = vec![0.0f64; v.len()];
        world.all_reduce_into(v, &mut worst[..], SystemOperation::max());
        let s = sorted(&worst);
        return (median_sorted(&s), p99_sorted(&s));
    }
    let s = sorted(v);
    (
        scalar(world, a, median_sorted(&s)),
        scalar(world, a, p99_sorted(&s)),
    )
}

/// One number per rank → one across ranks by `a`. Collective.
pub(super) fn scalar(world: &SimpleCommunicator, a: Across, v: f64) -> f64 {
    let mut r = 0.0f64;
    match a {
        Across::Slowest | Across::Max => {
            world.all_reduce_into(&v, &mut r, SystemOperation::max());
        }
        Across::Min => world.all_reduce_into(&v, &mut r, SystemOperation::min()),
        Across::Avg => {
            world.all_reduce_into(&v, &mut r, SystemOperation::sum());
            r /= f64::from(world.size());
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_p99_by_rank() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!((median_sorted(&v), p99_sorted(&v)), (6.0, 10.0));
        let v: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!((median_sorted(&v), p99_sorted(&v)), (101.0, 198.0));
        assert_eq!(p99_sorted(&[3.0]), 3.0);
        assert!(p99_sorted(&[]).is_nan());
    }
}
