//! Inputs and the reference of the "large" cases (issue 10: one answer up
//! to 64 MiB), for `tests/mpi` and `tests/gpu`. Written without the
//! library (nor `arx::verify`, nor the `half` crate), and fast enough for
//! 64 MiB per rank on every rank: inputs are built as bit patterns of the
//! element type from a seeded splitmix64 stream; the sum is the rule's
//! `((p0 + p1) + p2) + ...` in f32 over exactly widened values, rounded
//! once to the element type (round to nearest, ties to even) by integer
//! code below; max is IEEE 754-2019 `maximum` (−0 < +0; the inputs hold no
//! NaN), exact.

use arx::{Dtype, Element, Op};

/// splitmix64: the stream of (seed, call, rank).
struct Mix(u64);

impl Mix {
    fn new(seed: u64, call: u64, rank: usize) -> Self {
        let mut m = Mix(seed ^ call.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (rank as u64) << 48);
        m.next();
        m
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Rank `rank`'s input of call `call`: `count` finite values of T with a
/// random sign, mantissa and exponent up to 2³ (from 2⁻³⁰ for f32, 2⁻²⁴
/// bf16, 2⁻¹⁴ f16: sums round, tie, cancel and depend on the order of the
/// additions, and never overflow at any world up to a few hundred ranks);
/// every 4099th element is −0.0 on every rank (the sum must stay −0.0).
pub fn input<T: Element>(seed: u64, call: u64, rank: usize, count: usize) -> Vec<T> {
    let mut m = Mix::new(seed, call, rank);
    match T::DTYPE {
        Dtype::F32 => {
            let v: Vec<u32> = (0..count)
                .map(|i| {
                    if i % 4099 == 7 {
                        return 0x8000_0000;
                    }
                    let r = m.next();
                    let exp = 127 - 30 + (r >> 32) as u32 % 34;
                    ((r >> 63) as u32) << 31 | exp << 23 | (r as u32 & 0x7f_ffff)
                })
                .collect();
            bytemuck::cast_slice(&v).to_vec()
        }
        d => {
            // bf16: 8 exponent bits, 7 mantissa bits; f16: 5 and 10.
            // Exponents (low, how many): bf16 2^-24..2^3 (sums of a few
            // ranks span more than f32's 24 bits, so the order of the
            // additions shows), f16 2^-14..2^3 (its normal range).
            let (bias, man, low, span) = if d == Dtype::Bf16 {
                (127, 7, 24, 28)
            } else {
                (15, 10, 14, 18)
            };
            let v: Vec<u16> = (0..count)
                .map(|i| {
                    if i % 4099 == 7 {
                        return 0x8000;
                    }
                    let r = m.next();
                    let exp = bias - low + (r >> 32) as u16 % span;
                    ((r >> 63) as u16) << 15 | exp << man | (r as u16 & ((1 << man) - 1))
                })
                .collect();
            bytemuck::cast_slice(&v).to_vec()
        }
    }
}

/// The f32 value of an element (exact).
fn widen<T: Element>(x: &T) -> f32 {
    match T::DTYPE {
        Dtype::F32 => f32::from_bits(bytemuck::cast::<T, u32>(*x)),
        Dtype::Bf16 => f32::from_bits(u32::from(bytemuck::cast::<T, u16>(*x)) << 16),
        Dtype::F16 => {
            let h = bytemuck::cast::<T, u16>(*x);
            let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
            let (e, m) = (i32::from((h >> 10) & 0x1f), f32::from(h & 0x3ff));
            match e {
                0 => sign * m * 2f32.powi(-24),
                31 if m == 0.0 => sign * f32::INFINITY,
                31 => f32::NAN,
                _ => sign * (1024.0 + m) * 2f32.powi(e - 25),
            }
        }
    }
}

/// `v` rounded to T once (nearest, ties to even).
fn narrow<T: Element>(v: f32) -> T {
    let b = v.to_bits();
    match T::DTYPE {
        Dtype::F32 => bytemuck::cast(b),
        Dtype::Bf16 => {
            let h = if v.is_nan() {
                0x7fc0
            } else {
                // Adding just under half an ulp, plus the kept lsb, then
                // truncating rounds to nearest even; a carry into the
                // exponent (and to infinity) is the right result.
                ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
            };
            bytemuck::cast(h)
        }
        Dtype::F16 => {
            let sign = ((b >> 16) & 0x8000) as u16;
            let a = f64::from(v.abs());
            let h = if v.is_nan() {
                0x7e00
            } else if a >= 65520.0 {
                sign | 0x7c00 // past the midpoint of 65504 and 2^16
            } else if a < 2f64.powi(-14) {
                // Subnormal steps of 2^-24 (1024 steps is the smallest
                // normal, whose encoding follows on).
                sign | (a * 2f64.powi(24)).round_ties_even() as u16
            } else {
                let e = ((b >> 23) & 0xff) as i32 - 127;
                let q = (a * 2f64.powi(10 - e)).round_ties_even() as u32;
                let (e, q) = if q == 2048 { (e + 1, 1024) } else { (e, q) };
                sign | ((e + 15) as u16) << 10 | (q - 1024) as u16
            };
            bytemuck::cast(h)
        }
    }
}

/// The reference of `op` (sum or max) over every rank's input, in rank
/// order.
pub fn reference<T: Element>(op: Op, inputs: &[Vec<T>]) -> Vec<T> {
    let count = inputs[0].len();
    let mut acc: Vec<f32> = inputs[0].iter().map(widen).collect();
    for x in &inputs[1..] {
        for (a, v) in acc.iter_mut().zip(x) {
            let b = widen(v);
            *a = match op {
                Op::Max => {
                    // b wins when larger, or equal with a being −0 (−0
                    // below +0; equal nonzero values have one sign).
                    if b > *a || (b == *a && a.is_sign_negative()) {
                        b
                    } else {
                        *a
                    }
                }
                _ => *a + b,
            };
        }
    }
    debug_assert_eq!(acc.len(), count);
    acc.into_iter().map(narrow::<T>).collect()
}

/// Every rank's input of call `call`.
pub fn inputs<T: Element>(seed: u64, call: u64, world: usize, count: usize) -> Vec<Vec<T>> {
    (0..world).map(|r| input(seed, call, r, count)).collect()
}

/// The first index where `got` and `want` differ in bits.
pub fn first_diff<T: Element>(got: &[T], want: &[T]) -> Option<usize> {
    let (g, w): (&[u8], &[u8]) = (bytemuck::cast_slice(got), bytemuck::cast_slice(want));
    if g.len() != w.len() {
        return Some(0);
    }
    let s = std::mem::size_of::<T>();
    g.chunks(s).zip(w.chunks(s)).position(|(a, b)| a != b)
}

/// Checks the module's rounding against exhaustive and known cases (run
/// once per case, before the large calls; cheap). Returns what is wrong.
pub fn self_check() -> Result<(), String> {
    use half::{bf16, f16};
    // Every f16 and bf16 value widens and narrows back to itself.
    for h in 0..=u16::MAX {
        let x: f16 = bytemuck::cast(h);
        let w = widen(&x);
        if !w.is_nan() && bytemuck::cast::<f16, u16>(narrow::<f16>(w)) != h {
            return Err(format!("f16 {h:#06x} does not round-trip"));
        }
        let y: bf16 = bytemuck::cast(h);
        let w = widen(&y);
        if !w.is_nan() && bytemuck::cast::<bf16, u16>(narrow::<bf16>(w)) != h {
            return Err(format!("bf16 {h:#06x} does not round-trip"));
        }
    }
    // Ties to even, and the known edges.
    let cases: [(f32, u16, u16); 6] = [
        (1.0 + 2f32.powi(-11), 0x3c00, 0x3f80), // f16 tie -> even (1.0); bf16 rounds down
        (1.0 + 3.0 * 2f32.powi(-11), 0x3c02, 0x3f80), // f16 tie -> even (up)
        (65519.0, 0x7bff, 0x4780),              // f16 just below the midpoint: max
        (65520.0, 0x7c00, 0x4780),              // f16 the midpoint: infinity
        (2f32.powi(-25), 0x0000, 0x3300),       // f16 tie at half the smallest subnormal -> 0
        (1.0 + 2f32.powi(-8), 0x3c04, 0x3f80),  // bf16 tie -> even (1.0)
    ];
    for (v, hf, hb) in cases {
        let (gf, gb) = (
            bytemuck::cast::<f16, u16>(narrow::<f16>(v)),
            bytemuck::cast::<bf16, u16>(narrow::<bf16>(v)),
        );
        if gf != hf || gb != hb {
            return Err(format!(
                "narrow({v:e}): f16 {gf:#06x} (want {hf:#06x}), bf16 {gb:#06x} (want {hb:#06x})"
            ));
        }
    }
    Ok(())
}
