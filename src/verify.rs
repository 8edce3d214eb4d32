//! Seeded inputs and an independent reference, for programs that check
//! their own results (tests, `allreduce_perf --check`, `doctor`).
//!
//! Every rank can compute every rank's input from `(seed, call, rank)`, so
//! every rank computes the expected sum on its own, with no communication.
//! The reference is a plain scalar loop written separately from the
//! library's summation: fp32 accumulator, ranks in order, one rounding.

use rand::{Rng, SeedableRng};

use crate::dtype::Element;

/// Rank `rank`'s input for call `call` of a run seeded with `seed`:
/// `count` values uniform in [-8, 8), rounded to `T`.
pub fn input<T: Element>(seed: u64, call: u64, rank: usize, count: usize) -> Vec<T> {
    let mix = seed
        ^ call.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (rank as u64 + 1).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    let mut rng = rand::rngs::StdRng::seed_from_u64(mix);
    (0..count)
        .map(|_| T::from_f32(rng.gen_range(-8.0f32..8.0)))
        .collect()
}

/// The expected result of call `call` over `world` ranks.
pub fn expected<T: Element>(seed: u64, call: u64, world: usize, count: usize) -> Vec<T> {
    let inputs: Vec<Vec<T>> = (0..world).map(|r| input(seed, call, r, count)).collect();
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let mut acc = 0.0f32;
        for x in &inputs {
            acc += x[i].to_f32();
        }
        out.push(T::from_f32(acc));
    }
    out
}

/// Fills `buf` with all-ones bytes (a NaN in every supported type), so a
/// call that writes nothing cannot pass a check.
pub fn poison<T: Element>(buf: &mut [T]) {
    bytemuck::cast_slice_mut::<T, u8>(buf).fill(0xff);
}

/// Number of elements whose bits differ.
pub fn count_wrong<T: Element>(got: &[T], want: &[T]) -> usize {
    let g: &[u8] = bytemuck::cast_slice(got);
    let w: &[u8] = bytemuck::cast_slice(want);
    let s = std::mem::size_of::<T>();
    if g.len() != w.len() {
        return got.len().max(want.len());
    }
    g.chunks_exact(s)
        .zip(w.chunks_exact(s))
        .filter(|(a, b)| a != b)
        .count()
}

/// FNV-1a digest of a buffer's bits (to compare results across ranks).
pub fn digest<T: Element>(buf: &[T]) -> u64 {
    bytemuck::cast_slice::<T, u8>(buf)
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn inputs_differ_by_rank_and_call_and_repeat() {
        let a = input::<f32>(1, 1, 0, 64);
        assert_eq!(a, input::<f32>(1, 1, 0, 64));
        assert_ne!(a, input::<f32>(1, 1, 1, 64));
        assert_ne!(a, input::<f32>(1, 2, 0, 64));
        assert_ne!(a, input::<f32>(2, 1, 0, 64));
        assert!(a.iter().all(|v| (-8.0..8.0).contains(v)));
        assert!(a.iter().any(|&v| v != 0.0));
    }

    #[test]
    fn expected_is_close_to_the_exact_sum() {
        let e = expected::<bf16>(7, 3, 4, 256);
        for (i, v) in e.iter().enumerate() {
            let exact: f64 = (0..4)
                .map(|r| f64::from(input::<bf16>(7, 3, r, 256)[i].to_f32()))
                .sum();
            assert!(
                (f64::from(v.to_f32()) - exact).abs() <= exact.abs() / 128.0 + 1e-6,
                "{i}"
            );
        }
    }

    #[test]
    fn poison_and_wrong_count() {
        let mut b = vec![1.0f32; 8];
        poison(&mut b);
        assert!(b.iter().all(|v| v.is_nan()));
        assert_eq!(count_wrong(&b, &[1.0f32; 8]), 8);
        assert_eq!(count_wrong(&[1.0f32, 2.0], &[1.0, 2.0]), 0);
        assert_ne!(digest(&[1.0f32]), digest(&[2.0f32]));
    }
}
