//! Seeded inputs and an independent reference, for programs that check
//! their own results (tests, `allreduce_perf --check`, `doctor`).
//!
//! Every rank can compute every rank's input from `(seed, call, rank)`, so
//! every rank computes the expected sum on its own, with no communication.
//!
//! The reference shares no code with the library: it decodes and rounds
//! bf16/f16/f32 bit patterns with its own IEEE arithmetic (in f64, where
//! every step here is exact) rather than the library's conversions or the
//! `half` crate, and sums in plain scalar f32 adds starting from rank 0's
//! value: `((p0 + p1) + p2) + …`, rounded once to the element type. A bug in
//! the library's conversions or summation therefore shows up as a mismatch
//! instead of being repeated by the reference.
//!
//! NaN: any NaN matches any NaN ([`count_wrong`]); the payload and sign of
//! a NaN result are not specified (a GPU returns its canonical NaN).

use rand::{Rng, SeedableRng};

use crate::dtype::{Dtype, Element};

/// Bit layout of an IEEE binary format: exponent and mantissa widths.
#[derive(Clone, Copy)]
struct Format {
    exp: u32,
    man: u32,
}

fn format(d: Dtype) -> Format {
    match d {
        Dtype::Bf16 => Format { exp: 8, man: 7 },
        Dtype::F16 => Format { exp: 5, man: 10 },
        Dtype::F32 => Format { exp: 8, man: 23 },
    }
}

impl Format {
    fn bias(self) -> i32 {
        (1 << (self.exp - 1)) - 1
    }
    fn max_exp_field(self) -> u32 {
        (1 << self.exp) - 1
    }
    fn is_nan(self, bits: u32) -> bool {
        (bits >> self.man) & self.max_exp_field() == self.max_exp_field()
            && bits & ((1 << self.man) - 1) != 0
    }
    /// The value of `bits` (exact: every value of these formats is an f64).
    fn decode(self, bits: u32) -> f64 {
        let sign = if (bits >> (self.exp + self.man)) & 1 == 1 {
            -1.0
        } else {
            1.0
        };
        let e = (bits >> self.man) & self.max_exp_field();
        let m = f64::from(bits & ((1 << self.man) - 1));
        let man = self.man as i32;
        if e == self.max_exp_field() {
            return if m == 0.0 {
                sign * f64::INFINITY
            } else {
                f64::NAN
            };
        }
        if e == 0 {
            return sign * m * 2f64.powi(1 - self.bias() - man);
        }
        sign * (2f64.powi(man) + m) * 2f64.powi(e as i32 - self.bias() - man)
    }
    /// `x` rounded to nearest, ties to even (overflow to infinity).
    fn encode(self, x: f64) -> u32 {
        let sign = if x.is_sign_negative() {
            1u32 << (self.exp + self.man)
        } else {
            0
        };
        if x.is_nan() {
            return (self.max_exp_field() << self.man) | (1 << (self.man - 1));
        }
        let inf = sign | (self.max_exp_field() << self.man);
        let a = x.abs();
        if a.is_infinite() {
            return inf;
        }
        if a == 0.0 {
            return sign;
        }
        let man = self.man as i32;
        let emin = 1 - self.bias();
        let one = 1u64 << self.man;
        if a < 2f64.powi(emin) {
            // Subnormal (or rounds up to the smallest normal, whose bits
            // are then exactly `q`).
            let q = (a / 2f64.powi(emin - man)).round_ties_even() as u32;
            return sign | q;
        }
        let mut e = ((a.to_bits() >> 52) & 0x7ff) as i32 - 1023;
        let mut q = (a / 2f64.powi(e - man)).round_ties_even() as u64;
        if q == 2 * one {
            e += 1;
            q = one;
        }
        if e > self.bias() {
            return inf;
        }
        sign | (((e + self.bias()) as u32) << self.man) | (q - one) as u32
    }
}

/// The bits of `v` as a u32 (elements are 2 or 4 bytes).
fn bits_of<T: Element>(v: &T) -> u32 {
    let b = bytemuck::bytes_of(v);
    match b.len() {
        2 => u32::from(u16::from_le_bytes([b[0], b[1]])),
        _ => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}

/// The element whose bits are `bits`.
fn from_bits<T: Element>(bits: u32) -> T {
    let b = bits.to_le_bytes();
    bytemuck::pod_read_unaligned(&b[..std::mem::size_of::<T>()])
}

/// `x` rounded to `T` by the reference's own rounding.
pub fn round_to<T: Element>(x: f32) -> T {
    from_bits(format(T::DTYPE).encode(f64::from(x)))
}

/// The exact value of `v`, decoded by the reference's own code.
pub fn value_of<T: Element>(v: &T) -> f32 {
    format(T::DTYPE).decode(bits_of(v)) as f32
}

fn rng_for(seed: u64, call: u64, rank: usize) -> rand::rngs::StdRng {
    let mix = seed
        ^ call.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (rank as u64)
            .wrapping_add(1)
            .wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    rand::rngs::StdRng::seed_from_u64(mix)
}

/// Rank `rank`'s input for call `call` of a run seeded with `seed`:
/// `count` values uniform in [-8, 8), rounded to `T`.
pub fn input<T: Element>(seed: u64, call: u64, rank: usize, count: usize) -> Vec<T> {
    let mut rng = rng_for(seed, call, rank);
    (0..count)
        .map(|_| round_to(rng.gen_range(-8.0f32..8.0)))
        .collect()
}

/// Like [`input`], with the values that break assumptions at seeded
/// positions (the same positions on every rank): −0.0 on every rank, ±0.0
/// mixed, NaN on rank 0 (and elsewhere on rank 1 only), +Inf on one rank
/// and −Inf on another, +Inf on every rank, subnormals of `T`, values whose
/// sum overflows `T`, and values whose sum cancels exactly.
pub fn input_edges<T: Element>(seed: u64, call: u64, rank: usize, count: usize) -> Vec<T> {
    let mut v = input::<T>(seed, call, rank, count);
    let f = format(T::DTYPE);
    let tiny = f.decode(1) as f32; // the smallest subnormal
    let big = f.decode(((f.max_exp_field() - 1) << f.man) | ((1 << f.man) - 1)) as f32;
    // Which edge each position gets depends on (seed, call) only.
    let mut pick = rng_for(seed, call, usize::MAX);
    for x in v.iter_mut() {
        let k = pick.gen_range(0..16u32);
        let r = rank as u32;
        let e: Option<f32> = match k {
            0 => Some(-0.0),
            1 => Some(if r % 2 == 0 { -0.0 } else { 0.0 }),
            2 if r == 0 => Some(f32::NAN),
            3 => Some(match r {
                0 => f32::INFINITY,
                1 => f32::NEG_INFINITY,
                _ => 1.0,
            }),
            4 => Some(f32::INFINITY),
            5 => Some(tiny * (1 + r % 3) as f32 * if r % 2 == 0 { 1.0 } else { -1.0 }),
            6 => Some(big),
            7 => Some(if r % 2 == 0 { 3.0 } else { -3.0 }),
            // NaN on one rank that is not the first (max/min must keep it
            // although earlier ranks' values are numbers).
            8 if r == 1 => Some(f32::NAN),
            _ => None,
        };
        if let Some(e) = e {
            *x = round_to(e);
        }
    }
    v
}

/// The arx rule computed independently: rank-order f32 sum starting from
/// rank 0's value, one rounding to `T`.
/// Long calls (64 MiB and more in `allreduce_perf --check`) are computed
/// on the machine's cores, in slices of elements, each element exactly as
/// alone.
pub fn reference<T: Element>(inputs: &[Vec<T>]) -> Vec<T> {
    let count = inputs.first().map_or(0, |v| v.len());
    let f = format(T::DTYPE);
    let one = |i: usize| -> T {
        let mut acc = f.decode(bits_of(&inputs[0][i])) as f32;
        for x in &inputs[1..] {
            acc += f.decode(bits_of(&x[i])) as f32;
        }
        from_bits(f.encode(f64::from(acc)))
    };
    let threads = if count < PARALLEL_FROM {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    };
    in_slices(count, threads, &one)
}

/// Elements from which [`reference`] uses every core.
const PARALLEL_FROM: usize = 1 << 20;

/// `(0..count).map(one).collect()`, in `threads` slices computed on threads
/// of their own (a slice whose thread cannot start, or fails, is computed
/// on this one).
fn in_slices<T: Send, F: Fn(usize) -> T + Sync>(count: usize, threads: usize, one: &F) -> Vec<T> {
    let threads = threads.clamp(1, 64);
    if threads == 1 {
        return (0..count).map(one).collect();
    }
    let per = count.div_ceil(threads).max(1);
    let slices: Vec<std::ops::Range<usize>> = (0..count)
        .step_by(per)
        .map(|a| a..count.min(a + per))
        .collect();
    std::thread::scope(|s| {
        let running: Vec<_> = slices
            .iter()
            .map(|r| {
                let r2 = r.clone();
                let h = std::thread::Builder::new()
                    .spawn_scoped(s, move || r2.map(one).collect::<Vec<T>>())
                    .ok();
                (r.clone(), h)
            })
            .collect();
        let mut out = Vec::with_capacity(count);
        for (r, h) in running {
            match h.map(|h| h.join()) {
                Some(Ok(v)) => out.extend(v),
                _ => out.extend(r.map(one)),
            }
        }
        out
    })
}

/// The reduction `op` computed independently of the library (see the
/// module docs): sum as [`reference()`]; max/min by f64 comparison with
/// −0 < +0 and any NaN giving NaN; avg as the f32 sum divided once in f32 by
/// the number of ranks. One rounding to `T` (a NaN to `T`'s canonical NaN).
pub fn reference_op<T: Element>(op: crate::Op, inputs: &[Vec<T>]) -> Vec<T> {
    use crate::Op;
    if op == Op::Sum {
        return reference(inputs);
    }
    let count = inputs.first().map_or(0, |v| v.len());
    let f = format(T::DTYPE);
    // Order key: the value, then the sign of a zero (−0 below +0).
    let key = |x: f64| {
        (
            x,
            if x == 0.0 && x.is_sign_negative() {
                0
            } else {
                1
            },
        )
    };
    (0..count)
        .map(|i| {
            let vals: Vec<f64> = inputs.iter().map(|x| f.decode(bits_of(&x[i]))).collect();
            let r: f64 = match op {
                _ if op != Op::Avg && vals.iter().any(|v| v.is_nan()) => f64::NAN,
                Op::Max => vals[1..]
                    .iter()
                    .fold(vals[0], |m, &v| if key(v) > key(m) { v } else { m }),
                Op::Min => vals[1..]
                    .iter()
                    .fold(vals[0], |m, &v| if key(v) < key(m) { v } else { m }),
                _ => {
                    let mut acc = vals[0] as f32;
                    for v in &vals[1..] {
                        acc += *v as f32;
                    }
                    f64::from(acc / inputs.len() as f32)
                }
            };
            from_bits(f.encode(r))
        })
        .collect()
}

/// The expected result of `op` on call `call` over `world` ranks
/// ([`input_edges`] if `edges`, else [`input`]).
pub fn expected_op<T: Element>(
    op: crate::Op,
    edges: bool,
    seed: u64,
    call: u64,
    world: usize,
    count: usize,
) -> Vec<T> {
    let inputs = all_inputs(world, count, |r| {
        if edges {
            input_edges(seed, call, r, count)
        } else {
            input(seed, call, r, count)
        }
    });
    reference_op(op, &inputs)
}

/// Number of elements whose bits differ from `want`'s for `op`: exactly,
/// NaN included, for max, min and avg (their NaN is canonical); as
/// [`count_wrong`] for sum.
pub fn count_wrong_op<T: Element>(op: crate::Op, got: &[T], want: &[T]) -> usize {
    if op == crate::Op::Sum || got.len() != want.len() {
        return count_wrong(got, want);
    }
    got.iter()
        .zip(want)
        .filter(|(g, w)| bits_of(*g) != bits_of(*w))
        .count()
}

/// The expected result of call `call` over `world` ranks ([`input`]).
pub fn expected<T: Element>(seed: u64, call: u64, world: usize, count: usize) -> Vec<T> {
    let inputs = all_inputs(world, count, |r| input(seed, call, r, count));
    reference(&inputs)
}

/// Every rank's input (`make(rank)`), one rank per thread for long calls
/// (each rank's stream is its own, so the inputs are those made one by one).
fn all_inputs<T: Element, F: Fn(usize) -> Vec<T> + Sync>(
    world: usize,
    count: usize,
    make: F,
) -> Vec<Vec<T>> {
    let threads = if count < PARALLEL_FROM { 1 } else { world };
    in_slices(world, threads, &make)
}

/// The expected result of call `call` over `world` ranks ([`input_edges`]).
pub fn expected_edges<T: Element>(seed: u64, call: u64, world: usize, count: usize) -> Vec<T> {
    let inputs = all_inputs(world, count, |r| input_edges(seed, call, r, count));
    reference(&inputs)
}

/// Fills `buf` with all-ones bytes (a NaN in every supported type), so a
/// call that writes nothing cannot pass a check.
pub fn poison<T: Element>(buf: &mut [T]) {
    bytemuck::cast_slice_mut::<T, u8>(buf).fill(0xff);
}

/// True when `got` is what `want` asks for: the same bits, or both NaN.
pub fn same<T: Element>(got: &T, want: &T) -> bool {
    let f = format(T::DTYPE);
    let (g, w) = (bits_of(got), bits_of(want));
    g == w || (f.is_nan(g) && f.is_nan(w))
}

/// Number of elements that differ ([`same`] is false); a length mismatch
/// counts every element.
pub fn count_wrong<T: Element>(got: &[T], want: &[T]) -> usize {
    if got.len() != want.len() {
        return got.len().max(want.len());
    }
    got.iter().zip(want).filter(|(g, w)| !same(*g, *w)).count()
}

/// Index of the first element that differs, if any.
pub fn first_wrong<T: Element>(got: &[T], want: &[T]) -> Option<usize> {
    got.iter().zip(want).position(|(g, w)| !same(g, w))
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
    fn slices_give_every_element_once_in_order() {
        for count in [0usize, 1, 2, 7, 64, 1000, 1001] {
            let want: Vec<usize> = (0..count).map(|i| i * 3 + 1).collect();
            for threads in [1usize, 2, 3, 8, 64, 100] {
                let got = in_slices(count, threads, &|i| i * 3 + 1);
                assert_eq!(got, want, "count {count}, {threads} threads");
            }
        }
        // Past the threshold the reference runs in slices; its bits equal
        // the element-by-element rule.
        let n = PARALLEL_FROM + 12_345;
        let inputs: Vec<Vec<bf16>> = (0..3).map(|r| input(7, 9, r, n)).collect();
        let got = reference(&inputs);
        let f = format(Dtype::Bf16);
        assert_eq!(got.len(), n);
        for i in (0..n).step_by(997).chain([n - 1]) {
            let v = |r: usize| f.decode(bits_of(&inputs[r][i])) as f32;
            let acc = (v(0) + v(1)) + v(2);
            assert_eq!(bits_of(&got[i]), f.encode(f64::from(acc)), "element {i}");
        }
    }

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

    /// The reference's own rounding agrees with `half` on many patterns:
    /// two independent implementations of the same IEEE rule.
    #[test]
    fn own_rounding_agrees_with_half() {
        use half::f16;
        let mut x = 0x1234_5678u32;
        let mut pats: Vec<u32> = (0..=255u32)
            .flat_map(|e| {
                [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xfff, 0x1000, 0x7f_ffff]
                    .map(move |m| (e << 23) | m)
            })
            .flat_map(|v| [v, v | 0x8000_0000])
            .collect();
        for _ in 0..300_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            pats.push(x);
        }
        for p in pats {
            let v = f32::from_bits(p);
            let b: bf16 = round_to(v);
            let h: f16 = round_to(v);
            if v.is_nan() {
                assert!(b.is_nan() && h.is_nan(), "{p:#x}");
                continue;
            }
            assert_eq!(b.to_bits(), bf16::from_f32(v).to_bits(), "bf16 {p:#x}");
            assert_eq!(h.to_bits(), f16::from_f32(v).to_bits(), "f16 {p:#x}");
        }
        for b in 0..=u16::MAX {
            let (x, y) = (bf16::from_bits(b), f16::from_bits(b));
            if !x.is_nan() {
                assert_eq!(value_of(&x).to_bits(), x.to_f32().to_bits(), "bf16 {b:#x}");
            }
            if !y.is_nan() {
                assert_eq!(value_of(&y).to_bits(), y.to_f32().to_bits(), "f16 {b:#x}");
            }
        }
    }

    #[test]
    fn reference_keeps_the_sign_of_zero_and_the_rank_order() {
        let z = vec![vec![-0.0f32; 4]; 3];
        assert!(reference(&z)
            .iter()
            .all(|v| v.to_bits() == (-0.0f32).to_bits()));
        let m = vec![vec![-0.0f32], vec![0.0f32]];
        assert_eq!(reference(&m)[0].to_bits(), 0.0f32.to_bits());
        // (1e8 + 1) - 1e8 = 0 in f32; (1e8 - 1e8) + 1 = 1.
        assert_eq!(reference(&[vec![1e8f32], vec![1.0], vec![-1e8]])[0], 0.0);
        assert_eq!(reference(&[vec![1e8f32], vec![-1e8], vec![1.0]])[0], 1.0);
        let inf = reference(&[vec![f32::INFINITY], vec![f32::NEG_INFINITY]]);
        assert!(inf[0].is_nan());
    }

    #[test]
    fn edge_inputs_hold_every_edge() {
        let n = 4096;
        let a = input_edges::<bf16>(3, 1, 0, n);
        assert_eq!(digest(&a), digest(&input_edges::<bf16>(3, 1, 0, n)));
        assert!(a.iter().any(|v| v.is_nan()));
        assert!(a.iter().any(|v| v.to_bits() == 0x8000));
        assert!(a.iter().any(|v| v.is_infinite()));
        let e = expected_edges::<bf16>(3, 1, 3, n);
        assert!(e.iter().any(|v| v.to_bits() == 0x8000), "-0.0 survives");
        assert!(e.iter().any(|v| v.is_nan()));
        assert!(e.iter().any(|v| v.is_infinite()), "overflow to inf");
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
