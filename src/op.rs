//! The reductions arx applies, element by element, over the ranks' partials
//! (in rank order, on values widened exactly to f32): the host device
//! side's twin of the helpers in `kernels/oneshot.cuh`, bit for bit.

use crate::abi;

/// The reduction of an all-reduce (the `_op` entry points; the others sum).
///
/// Every element of the result is computed from the ranks' values widened
/// exactly to f32, combined in rank order (`((v0 ∘ v1) ∘ v2) ∘ …`), and
/// rounded once to the element type, on the GPU and the host device side
/// alike, so every rank gets the same bits:
///
/// * [`Op::Sum`]: IEEE f32 addition; one rounding to the dtype (round to
///   nearest even).
/// * [`Op::Max`], [`Op::Min`]: IEEE 754-2019 `maximum` / `minimum`. Any NaN
///   input gives NaN, always the canonical quiet NaN of the dtype (bf16
///   `0x7fc0`, f16 `0x7e00`, f32 `0x7fc0_0000`); −0.0 < +0.0 (max(−0, +0) =
///   +0, min(−0, +0) = −0). The result is one of the inputs: exact.
/// * [`Op::Avg`]: the f32 sum exactly as [`Op::Sum`] computes it, then one
///   f32 division by the world size (correctly rounded), then one rounding
///   to the dtype (round to nearest even): two roundings after the sum,
///   which may differ from dividing in higher precision. A sum that
///   overflows f32 gives ±Inf; a NaN result is the canonical NaN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Op {
    /// Sum.
    #[default]
    Sum,
    /// Maximum (NaN propagates; −0 < +0).
    Max,
    /// Minimum (NaN propagates; −0 < +0).
    Min,
    /// Sum, then divided by the world size.
    Avg,
}

/// The canonical quiet NaN of f32 (narrowed: bf16 `0x7fc0`, f16 `0x7e00`).
pub(crate) const CANONICAL_NAN_BITS: u32 = 0x7fc0_0000;

impl Op {
    /// Every op, in code order.
    pub const ALL: [Op; 4] = [Op::Sum, Op::Max, Op::Min, Op::Avg];

    /// The `ARX_OP_*` code carried in flag words.
    pub fn code(self) -> u32 {
        match self {
            Op::Sum => abi::ARX_OP_SUM,
            Op::Max => abi::ARX_OP_MAX,
            Op::Min => abi::ARX_OP_MIN,
            Op::Avg => abi::ARX_OP_AVG,
        }
    }

    /// The op of an `ARX_OP_*` code.
    pub fn from_code(c: u32) -> Option<Self> {
        Op::ALL.into_iter().find(|o| o.code() == c)
    }

    /// Lower-case name (`sum`, `max`, `min`, `avg`), as nccl-tests' `-o`.
    pub fn name(self) -> &'static str {
        match self {
            Op::Sum => "sum",
            Op::Max => "max",
            Op::Min => "min",
            Op::Avg => "avg",
        }
    }

    /// The op named `s` (see [`Op::name`]; `prod` is not supported).
    pub fn from_name(s: &str) -> Option<Self> {
        Op::ALL.into_iter().find(|o| o.name() == s)
    }

    /// `a ∘ b` for max and min (see the type's docs); addition otherwise.
    ///
    /// Every outcome is computed and one selected, without a branch, so
    /// that the host side's loops over a block vectorise.
    #[inline(always)]
    pub(crate) fn combine(self, a: f32, b: f32) -> f32 {
        match self {
            Op::Sum | Op::Avg => a + b,
            Op::Max | Op::Min => {
                let max = self == Op::Max;
                let (x, y) = (a.to_bits(), b.to_bits());
                // Equal: the same bits, or ±0; AND keeps +0, OR −0.
                let tie = if max { x & y } else { x | y };
                let pick = if (a > b) == max { x } else { y };
                let r = if a == b { tie } else { pick };
                let nan = a.is_nan() | b.is_nan();
                f32::from_bits(if nan { CANONICAL_NAN_BITS } else { r })
            }
        }
    }

    /// The accumulator's last step before the one rounding to the dtype:
    /// avg's division by `world` (a NaN made canonical); nothing otherwise.
    #[inline(always)]
    pub(crate) fn finish(self, a: f32, world: usize) -> f32 {
        if self != Op::Avg {
            return a;
        }
        let q = a / world as f32;
        if q.is_nan() {
            f32::from_bits(CANONICAL_NAN_BITS)
        } else {
            q
        }
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_round_trip() {
        for o in Op::ALL {
            assert_eq!(Op::from_code(o.code()), Some(o));
            assert_eq!(Op::from_name(o.name()), Some(o));
            assert!(o.code() <= abi::ARX_FLAG_OP_MASK);
        }
        assert_eq!(Op::Sum.code(), 0, "sum's flag words are ABI 4's");
        assert_eq!(Op::from_name("prod"), None);
    }

    #[test]
    fn max_min_follow_ieee_maximum_minimum() {
        let (p0, n0) = (0.0f32, -0.0f32);
        let bits = |v: f32| v.to_bits();
        assert_eq!(bits(Op::Max.combine(n0, p0)), bits(p0));
        assert_eq!(bits(Op::Max.combine(p0, n0)), bits(p0));
        assert_eq!(bits(Op::Min.combine(n0, p0)), bits(n0));
        assert_eq!(bits(Op::Min.combine(p0, n0)), bits(n0));
        let nan = f32::from_bits(0xffc0_1234);
        for o in [Op::Max, Op::Min] {
            assert_eq!(bits(o.combine(nan, 1.0)), 0x7fc0_0000);
            assert_eq!(bits(o.combine(1.0, nan)), 0x7fc0_0000);
            assert_eq!(bits(o.combine(f32::INFINITY, nan)), 0x7fc0_0000);
        }
        assert_eq!(Op::Max.combine(f32::NEG_INFINITY, 3.0), 3.0);
        assert_eq!(Op::Min.combine(f32::INFINITY, -3.0), -3.0);
        assert_eq!(Op::Max.combine(-1.0, -2.0), -1.0);
        assert_eq!(Op::Min.combine(-1.0, -2.0), -2.0);
        let sub = f32::from_bits(1);
        assert_eq!(bits(Op::Max.combine(sub, p0)), 1);
        assert_eq!(bits(Op::Min.combine(-sub, n0)), bits(-sub));
    }

    #[test]
    fn avg_divides_once_and_canonicalises_nan() {
        assert_eq!(Op::Avg.finish(3.0, 2), 1.5);
        assert_eq!(Op::Avg.finish(f32::INFINITY, 3), f32::INFINITY);
        let nan = f32::from_bits(0xffc0_1234);
        assert_eq!(Op::Avg.finish(nan, 3).to_bits(), 0x7fc0_0000);
        assert_eq!(Op::Sum.finish(nan, 3).to_bits(), 0xffc0_1234);
        // One correctly rounded f32 division: 1/3 in f32.
        assert_eq!(Op::Avg.finish(1.0, 3), 1.0f32 / 3.0);
    }
}
