//! Element types arx reduces, and the one summation rule every device side
//! follows: an fp32 accumulator, partials added in rank order, one rounding
//! at the end. Same order and same rounding ⇒ the same bits on every rank.

use half::{bf16, f16};

use crate::abi;

/// The element type of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
    /// IEEE single precision.
    F32,
}

impl Dtype {
    /// The `ARX_DTYPE_*` code carried in flag words.
    pub fn code(self) -> u32 {
        match self {
            Dtype::Bf16 => abi::ARX_DTYPE_BF16,
            Dtype::F16 => abi::ARX_DTYPE_F16,
            Dtype::F32 => abi::ARX_DTYPE_F32,
        }
    }
    /// The dtype of an `ARX_DTYPE_*` code.
    pub fn from_code(c: u32) -> Option<Self> {
        [Dtype::Bf16, Dtype::F16, Dtype::F32]
            .into_iter()
            .find(|d| d.code() == c)
    }
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
        }
    }
    /// Lower-case name as nccl-tests prints it.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bfloat16",
            Dtype::F16 => "half",
            Dtype::F32 => "float",
        }
    }
}

/// Describes a call's (dtype code, count) pair for messages.
/// Element count of the "invalid" flag words a rank writes to its peers when
/// its fabric failed (see `fabric::verbs`), so that they fail at once.
pub(crate) const POISON_COUNT: usize = abi::ARX_FLAG_COUNT_MASK as usize;

pub(crate) fn describe_call(code: u32, count: usize) -> String {
    match Dtype::from_code(code) {
        Some(d) => format!("{count} x {}", d.name()),
        None if code == abi::ARX_DTYPE_INVALID && count == POISON_COUNT => {
            "nothing: its fabric failed (see that rank's error)".to_string()
        }
        None if code == abi::ARX_DTYPE_INVALID => {
            format!("a call it refused ({count} elements: too long or bad arguments; see that rank's error)")
        }
        None => format!("{count} elements of unknown dtype {code}"),
    }
}

/// An element type arx can all-reduce.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// Its dtype.
    const DTYPE: Dtype;
    /// Widens to f32 exactly.
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type (round to nearest even).
    fn from_f32(v: f32) -> Self;
    /// Widens `src` (raw bytes of `dst.len()` elements) into `dst`.
    fn widen(src: &[u8], dst: &mut [f32]) {
        for (d, e) in dst
            .iter_mut()
            .zip(src.chunks_exact(std::mem::size_of::<Self>()))
        {
            *d = bytemuck::pod_read_unaligned::<Self>(e).to_f32();
        }
    }
    /// Rounds `src` into `dst`.
    fn narrow(src: &[f32], dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = Self::from_f32(*s);
        }
    }
}

/// Slice conversions through `half`'s vectorised paths (F16C, NEON fp16)
/// when the bytes are aligned, which received slots always are.
macro_rules! half_slices {
    () => {
        fn widen(src: &[u8], dst: &mut [f32]) {
            use half::slice::HalfFloatSliceExt;
            match bytemuck::try_cast_slice::<u8, Self>(src) {
                Ok(h) => h.convert_to_f32_slice(dst),
                Err(_) => {
                    for (d, e) in dst.iter_mut().zip(src.chunks_exact(2)) {
                        *d = bytemuck::pod_read_unaligned::<Self>(e).to_f32();
                    }
                }
            }
        }
        fn narrow(src: &[f32], dst: &mut [Self]) {
            use half::slice::HalfFloatSliceExt;
            dst.convert_from_f32_slice(src);
        }
    };
}

/// bf16 → f32 is exact: the bits move up by 16 (a NaN is made quiet, as
/// `half` does).
#[inline(always)]
fn bf16_bits_to_f32(b: u16) -> f32 {
    let b = if b & 0x7fff > 0x7f80 { b | 0x0040 } else { b };
    f32::from_bits(u32::from(b) << 16)
}

/// f32 → bf16, round to nearest even, NaN kept quiet: the same bits as
/// `half::bf16::from_f32` (checked over many patterns in the tests), written
/// branch-light so the compiler vectorises the slice loops (`half`'s bf16
/// slice conversion is a scalar call per element).
#[inline(always)]
fn f32_to_bf16_bits(v: f32) -> u16 {
    let x = v.to_bits();
    if x & 0x7fff_ffff > 0x7f80_0000 {
        return ((x >> 16) | 0x0040) as u16;
    }
    let round = u32::from((x & 0x8000) != 0 && (x & 0x17fff) != 0);
    ((x >> 16) + round) as u16
}

impl Element for bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    fn to_f32(self) -> f32 {
        bf16_bits_to_f32(self.to_bits())
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_bits(f32_to_bf16_bits(v))
    }
    fn widen(src: &[u8], dst: &mut [f32]) {
        for (d, e) in dst.iter_mut().zip(src.chunks_exact(2)) {
            *d = bf16_bits_to_f32(u16::from_le_bytes([e[0], e[1]]));
        }
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = bf16::from_bits(f32_to_bf16_bits(*s));
        }
    }
}

impl Element for f16 {
    const DTYPE: Dtype = Dtype::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    half_slices!();
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

/// Sums `world` partials element-wise into `out` by the arx rule (fp32
/// accumulator, rank order, one rounding). `part(r)` is rank r's partial as
/// raw bytes of at least `out.len()` elements. Works in blocks with the
/// accumulator on the stack: no allocation on the call path, and each
/// element still sees exactly `((p0 + p1) + p2) + …`.
pub(crate) fn sum_in_rank_order<'a, T: Element>(
    world: usize,
    part: impl Fn(usize) -> &'a [u8],
    out: &mut [T],
) {
    const BLOCK: usize = 512;
    let size = std::mem::size_of::<T>();
    let mut acc = [0.0f32; BLOCK];
    let mut wide = [0.0f32; BLOCK];
    for (b, chunk) in out.chunks_mut(BLOCK).enumerate() {
        let base = b * BLOCK * size;
        let n = chunk.len();
        let acc = &mut acc[..n];
        let wide = &mut wide[..n];
        acc.fill(0.0);
        for r in 0..world {
            T::widen(&part(r)[base..base + std::mem::size_of_val(chunk)], wide);
            for (a, w) in acc.iter_mut().zip(wide.iter()) {
                *a += *w;
            }
        }
        T::narrow(acc, chunk);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for d in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
            assert_eq!(Dtype::from_code(d.code()), Some(d));
        }
        assert_eq!(Dtype::from_code(0), None);
    }

    #[test]
    fn rank_order_is_the_order() {
        // In f32, (1e8 - 1e8) + 1 = 1 but (1 + 1e8) - 1e8 = 0: the order matters
        // and must be the rank order.
        let a = 1e8f32.to_le_bytes();
        let b = 1f32.to_le_bytes();
        let c = (-1e8f32).to_le_bytes();
        let mut out = [0f32; 1];
        let p = [&a[..], &c[..], &b[..]];
        sum_in_rank_order::<f32>(3, |r| p[r], &mut out);
        assert_eq!(out[0], 1.0);
        let mut out2 = [0f32; 1];
        let p2 = [&b[..], &a[..], &c[..]];
        sum_in_rank_order::<f32>(3, |r| p2[r], &mut out2);
        assert_eq!(out2[0], 0.0);
        assert_ne!(out[0], out2[0]);
    }

    #[test]
    fn bf16_conversions_match_half() {
        for b in 0..=u16::MAX {
            let h = bf16::from_bits(b);
            assert_eq!(
                bf16_bits_to_f32(b).to_bits(),
                h.to_f32().to_bits(),
                "{b:#x}"
            );
        }
        let mut x = 0x9e37_79b9u32;
        let mut patterns: Vec<u32> = (0..=255u32)
            .flat_map(|e| {
                [0u32, 1, 0x7fff, 0x8000, 0x8001, 0x17fff, 0x18000, 0x7f_ffff]
                    .map(move |m| (e << 23) | m)
            })
            .flat_map(|v| [v, v | 0x8000_0000])
            .collect();
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            patterns.push(x);
        }
        for p in patterns {
            let v = f32::from_bits(p);
            assert_eq!(f32_to_bf16_bits(v), bf16::from_f32(v).to_bits(), "{p:#x}");
        }
    }

    #[test]
    fn bf16_rounds_once() {
        // Three bf16 values whose exact sum needs rounding once at the end.
        let x = [
            bf16::from_f32(1.0),
            bf16::from_f32(0.00390625),
            bf16::from_f32(0.00390625),
        ];
        let parts: Vec<Vec<u8>> = x.iter().map(|v| bytemuck::bytes_of(v).to_vec()).collect();
        let refs: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
        let mut out = [bf16::ZERO; 1];
        sum_in_rank_order(3, |r| refs[r], &mut out);
        assert_eq!(out[0], bf16::from_f32(1.0 + 0.00390625 + 0.00390625));
        // Rounding after every step would have lost both small terms.
        let stepwise = bf16::from_f32(bf16::from_f32(1.0 + 0.00390625).to_f32() + 0.00390625);
        assert_ne!(out[0], stepwise);
    }
}
