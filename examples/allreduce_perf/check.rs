//! `--check`: every column against the independent reference of
//! `arx::verify` (rank-order f32 sum, one rounding).
//!
//! arx follows that rule, so its columns must match bit for bit. NCCL and
//! `MPI_Allreduce` add in another order (a ring, a tree, recursive
//! doubling) and NCCL rounds bf16/f16 partial sums to the element type at
//! every step, so their results may differ from the reference in the last
//! bits; they are checked against a bound on that difference instead:
//!
//! |got − want| ≤ n · (u_T + 2⁻²⁴) · Σ_r |x_r| + n · s_T
//!
//! per element, n ranks, x_r rank r's input, u_T the unit roundoff of the
//! element type (bf16 2⁻⁸, f16 2⁻¹¹, f32 2⁻²⁴), s_T its smallest subnormal.
//! Any order of n − 1 additions each rounded to T (or to f32) is within
//! (n − 1)(u_T + 2⁻²⁴)Σ|x| of the exact sum, and the reference within
//! u_T·Σ|x| + (n − 1)·2⁻²⁴·Σ|x|. An in-place graph of k calls sums n copies
//! of the previous result k − 1 more times; the bound is carried through
//! each (`chain`). A NaN where the reference has none, or an infinity
//! where the reference is finite and not within the bound of overflowing
//! (or the reverse), is wrong. With 1 or 2 ranks every order gives the
//! reference's bits. `inexact` counts the elements within the bound but not
//! bit-equal.
//!
//! Every column's result must also have the same bits on every rank: a
//! rank whose digest differs from rank 0's counts its whole buffer wrong.

use arx::{verify, Dtype, Element};
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

/// Unit roundoff of `d` plus f32's (the accumulator's) one.
fn unit(d: Dtype) -> f64 {
    let u = match d {
        Dtype::Bf16 => 2f64.powi(-8),
        Dtype::F16 => 2f64.powi(-11),
        Dtype::F32 => 2f64.powi(-24),
    };
    u + 2f64.powi(-24)
}

fn smallest_subnormal(d: Dtype) -> f64 {
    match d {
        Dtype::Bf16 => 2f64.powi(-133),
        Dtype::F16 => 2f64.powi(-24),
        Dtype::F32 => 2f64.powi(-149),
    }
}

fn max_finite(d: Dtype) -> f64 {
    match d {
        Dtype::Bf16 => (2.0 - 2f64.powi(-7)) * 2f64.powi(127),
        Dtype::F16 => 65504.0,
        Dtype::F32 => f64::from(f32::MAX),
    }
}

/// The reference for `inputs` (one per rank) and, for a tolerance check,
/// the per-element bound of one call.
pub(super) fn want<T: Element>(inputs: &[Vec<T>], tolerant: bool) -> (Vec<T>, Option<Vec<f64>>) {
    let want = verify::reference(inputs);
    if !tolerant {
        return (want, None);
    }
    let n = inputs.len() as f64;
    let (u, s) = (unit(T::DTYPE), smallest_subnormal(T::DTYPE));
    let tol = (0..want.len())
        .map(|i| {
            let sum: f64 = inputs
                .iter()
                .map(|x| f64::from(verify::value_of(&x[i])).abs())
                .sum();
            n * u * sum + n * s
        })
        .collect();
    (want, Some(tol))
}

/// One more in-place call on every rank holding `want` (within `tol`):
/// the next reference and bound.
pub(super) fn chain<T: Element>(
    want: &[T],
    tol: Option<&[f64]>,
    n: usize,
) -> (Vec<T>, Option<Vec<f64>>) {
    let next = verify::reference(&vec![want.to_vec(); n]);
    let tol = tol.map(|tol| {
        let nf = n as f64;
        let (u, s) = (unit(T::DTYPE), smallest_subnormal(T::DTYPE));
        want.iter()
            .zip(tol)
            .map(|(w, t)| {
                let a = f64::from(verify::value_of(w)).abs() + t;
                nf * t + nf * u * nf * a + nf * s
            })
            .collect()
    });
    (next, tol)
}

/// As [`want`] for `op`: other ops than sum are arx's only (the MPI and
/// NCCL columns are not run for them), checked exactly against
/// `verify::reference_op`.
pub(super) fn want_op<T: Element>(
    op: arx::Op,
    inputs: &[Vec<T>],
    tolerant: bool,
) -> (Vec<T>, Option<Vec<f64>>) {
    if op == arx::Op::Sum {
        want(inputs, tolerant)
    } else {
        (verify::reference_op(op, inputs), None)
    }
}

/// (wrong, inexact) of this rank's `got`.
fn judge<T: Element>(got: &[T], want: &[T], tol: Option<&[f64]>) -> (u64, u64) {
    let Some(tol) = tol else {
        return (verify::count_wrong(got, want) as u64, 0);
    };
    if got.len() != want.len() {
        return (got.len().max(want.len()) as u64, 0);
    }
    let max = max_finite(T::DTYPE);
    let (mut wrong, mut inexact) = (0, 0);
    for ((g, w), &t) in got.iter().zip(want).zip(tol) {
        if verify::same(g, w) {
            continue;
        }
        let (gv, wv) = (
            f64::from(verify::value_of(g)),
            f64::from(verify::value_of(w)),
        );
        let ok = if gv.is_nan() || wv.is_nan() {
            false
        } else if gv.is_infinite() != wv.is_infinite() {
            // One side overflowed: fine only if the other is within the
            // bound of overflowing, with the same sign.
            let (inf, fin) = if gv.is_infinite() { (gv, wv) } else { (wv, gv) };
            fin.signum() == inf.signum() && fin.abs() + t >= max
        } else if gv.is_infinite() {
            false // opposite infinities
        } else {
            (gv - wv).abs() <= t
        };
        if ok {
            inexact += 1;
        } else {
            wrong += 1;
        }
    }
    (wrong, inexact)
}

/// (wrong, inexact) summed over ranks, plus the whole buffer for every rank
/// whose digest differs from rank 0's. Collective.
pub(super) fn tally<T: Element>(
    world: &SimpleCommunicator,
    got: &[T],
    want: &[T],
    tol: Option<&[f64]>,
) -> (u64, u64) {
    let n = world.size() as usize;
    let (mut wrong, inexact) = judge(got, want, tol);
    let d = verify::digest(got);
    let mut all = vec![0u64; n];
    world.all_gather_into(&d, &mut all[..]);
    if d != all[0] {
        wrong += got.len() as u64; // this rank disagrees with rank 0
    }
    let local = [wrong, inexact];
    let mut sum = [0u64; 2];
    world.all_reduce_into(&local[..], &mut sum[..], SystemOperation::sum());
    (sum[0], sum[1])
}

/// (wrong, inexact) summed over ranks, for results that differ by rank
/// (a reduce-scatter's blocks): no digest comparison. Collective.
pub(super) fn tally_own<T: Element>(
    world: &SimpleCommunicator,
    got: &[T],
    want: &[T],
    tol: Option<&[f64]>,
) -> (u64, u64) {
    let local = {
        let (w, i) = judge(got, want, tol);
        [w, i]
    };
    let mut sum = [0u64; 2];
    world.all_reduce_into(&local[..], &mut sum[..], SystemOperation::sum());
    (sum[0], sum[1])
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// A sum in another order, rounded to T at every step (NCCL's ring for
    /// bf16/f16): starting at rank `start`, each next rank adds its input.
    fn ring_sum<T: Element>(inputs: &[Vec<T>], start: usize) -> Vec<T> {
        let n = inputs.len();
        (0..inputs[0].len())
            .map(|i| {
                let mut acc = inputs[start % n][i];
                for k in 1..n {
                    let x = inputs[(start + k) % n][i];
                    acc = verify::round_to::<T>(verify::value_of(&acc) + verify::value_of(&x));
                }
                acc
            })
            .collect()
    }

    fn inputs<T: Element>(n: usize, count: usize) -> Vec<Vec<T>> {
        (0..n).map(|r| verify::input(7, 1, r, count)).collect()
    }

    fn reordered_passes<T: Element>() {
        let inp = inputs::<T>(8, 4096);
        let got = ring_sum(&inp, 3);
        let (want, tol) = want(&inp, true);
        // Bit for bit, the other order differs...
        assert!(
            judge(&got, &want, None).0 > 0,
            "{:?}: orders agree",
            T::DTYPE
        );
        // ...and is within the bound.
        let (wrong, inexact) = judge(&got, &want, tol.as_deref());
        assert_eq!(wrong, 0, "{:?}", T::DTYPE);
        assert!(inexact > 0, "{:?}", T::DTYPE);
    }

    #[test]
    fn another_sum_order_is_inexact_not_wrong() {
        reordered_passes::<bf16>();
        reordered_passes::<f16>();
        reordered_passes::<f32>();
    }

    #[test]
    fn two_ranks_are_bit_exact_in_any_order() {
        let inp = inputs::<bf16>(2, 4096);
        let (want, _) = want(&inp, false);
        assert_eq!(judge(&ring_sum(&inp, 1), &want, None), (0, 0));
    }

    #[test]
    fn gross_errors_are_wrong() {
        let inp = inputs::<bf16>(8, 64);
        let (want, tol) = want(&inp, true);
        let tol = tol.as_deref();
        let mut got = ring_sum(&inp, 0);
        // The bound is at most 8 ranks x 2^-8 x 64 = 2 here.
        got[0] = verify::round_to(verify::value_of(&want[0]) + 4.0);
        got[1] = verify::round_to(f32::NAN);
        got[2] = verify::round_to(f32::INFINITY);
        got[3] = verify::round_to(verify::value_of(&want[3]) - 4.0);
        assert_eq!(judge(&got, &want, tol).0, 4);
        let mut poisoned = want.clone();
        verify::poison(&mut poisoned);
        assert_eq!(judge(&poisoned, &want, tol).0, 64);
    }

    #[test]
    fn in_place_graph_chain_is_within_bound() {
        // A graph of in-place calls: the inputs, then n copies of the
        // previous result each time, each call in another order; f16
        // overflows on the way for some elements and not for others.
        for (n, calls) in [(4, 7), (8, 5)] {
            let inp = inputs::<f16>(n, 2048);
            let mut got = ring_sum(&inp, 1);
            let (mut want, mut tol) = want(&inp, true);
            for k in 1..calls {
                got = ring_sum(&vec![got; n], k + 1);
                (want, tol) = chain(&want, tol.as_deref(), n);
            }
            let (wrong, _) = judge(&got, &want, tol.as_deref());
            assert_eq!(wrong, 0, "{n} ranks");
            let inf = want.iter().filter(|w| verify::value_of(*w).is_infinite());
            assert!((1..want.len()).contains(&inf.count()), "{n} ranks");
        }
    }
}
