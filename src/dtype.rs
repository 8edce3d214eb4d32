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

/// Element count of the "invalid" flag words a rank writes to its peers when
/// its fabric failed (see `fabric::verbs`), so that they fail at once.
pub(crate) const POISON_COUNT: usize = abi::ARX_FLAG_POISON_COUNT as usize;

/// What a rank announced for a call in its flag word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CallKind {
    /// A call of this element type (which collective: [`CallDesc::pattern`]).
    Reduce(Dtype),
    /// A call the rank refused (bad arguments): see that rank's own error.
    Refused,
    /// Nothing: the rank's fabric failed (poisoned flags).
    FabricFailed,
    /// A dtype code this version does not know.
    Unknown(u32),
}

/// A call as a rank announced it: kind and element count.
///
/// A call longer than one slot is split into chunks of half a slot (see the
/// crate docs, Guarantees), each announced on its own: then `count` is the
/// chunk's, and `more` says whether more chunks of that call follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallDesc {
    /// What was called.
    pub kind: CallKind,
    /// Elements (as announced: of this chunk of a longer call; for a
    /// refused call, what was asked for, at most one slot's worth).
    pub count: usize,
    /// More chunks of the same call follow this one (the call is longer
    /// than one slot and this is not its last chunk).
    pub more: bool,
    /// The reduction (sum for a refused call or a fabric failure).
    pub op: crate::Op,
    /// Which bytes went to which peer: the step of which collective.
    pub pattern: Pattern,
}

/// The step a call was, as its flag word announces it (`ARX_PATTERN_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pattern {
    /// Every peer got the whole partial: a one-shot all-reduce.
    #[default]
    Whole,
    /// Each peer got its own shard: a reduce-scatter (alone, or the first
    /// step of a two-shot all-reduce).
    Scatter,
    /// Every peer got the sender's shard: an all-gather (alone, or the
    /// second step of a two-shot all-reduce).
    Gather,
    /// A broadcast: `root` when the sender announced itself as the root
    /// (every peer got its whole partial), else it sent no data.
    Broadcast {
        /// The sender is the broadcast's root.
        root: bool,
    },
    /// A pattern code this version does not know.
    Unknown(u32),
}

impl Pattern {
    /// From its `ARX_PATTERN_*` code.
    /// From a flag word's pattern code and op field (a broadcast's root
    /// bit).
    pub(crate) fn from_code(code: u32, op: u32) -> Self {
        match code {
            abi::ARX_PATTERN_WHOLE => Pattern::Whole,
            abi::ARX_PATTERN_SCATTER => Pattern::Scatter,
            abi::ARX_PATTERN_GATHER => Pattern::Gather,
            abi::ARX_PATTERN_BCAST => Pattern::Broadcast {
                root: op == abi::ARX_BCAST_ROOT,
            },
            c => Pattern::Unknown(c),
        }
    }
}

impl CallDesc {
    /// From a flag word (`protocol::flag_call` and `flag_more`).
    pub(crate) fn of_flag(flag: u64) -> Self {
        let (code, count) = crate::protocol::flag_call(flag);
        let field = flag as usize & abi::ARX_FLAG_COUNT_MASK as usize;
        let kind = match Dtype::from_code(code) {
            Some(d) => CallKind::Reduce(d),
            None if code == abi::ARX_DTYPE_INVALID && field == POISON_COUNT => {
                CallKind::FabricFailed
            }
            None if code == abi::ARX_DTYPE_INVALID => CallKind::Refused,
            None => CallKind::Unknown(code),
        };
        let op = crate::protocol::flag_op(flag);
        let pattern = match kind {
            CallKind::Reduce(_) => Pattern::from_code(crate::protocol::flag_pattern(flag), op),
            _ => Pattern::Whole,
        };
        CallDesc {
            kind,
            count,
            more: crate::protocol::flag_more(flag),
            // Two bits, four ops: every code is one. A broadcast's op field
            // is its root bit (in `pattern`): it reduces nothing.
            op: match pattern {
                Pattern::Broadcast { .. } => crate::Op::Sum,
                _ => crate::Op::from_code(op).unwrap_or_default(),
            },
            pattern,
        }
    }
}

impl std::fmt::Display for CallDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.count;
        match self.kind {
            CallKind::Reduce(d) => {
                let (op, d) = (self.op, d.name());
                match self.pattern {
                    Pattern::Whole => write!(f, "an allreduce ({op} of {n} x {d})")?,
                    Pattern::Scatter => write!(
                        f,
                        "a reduce-scatter step ({op} of {n} x {d}: a reduce_scatter or a two-shot allreduce)"
                    )?,
                    Pattern::Gather => write!(
                        f,
                        "an all-gather step ({n} x {d}: an all_gather or a two-shot allreduce)"
                    )?,
                    Pattern::Broadcast { root: true } => {
                        write!(f, "a broadcast ({n} x {d}) as its root")?
                    }
                    Pattern::Broadcast { root: false } => {
                        write!(f, "a broadcast ({n} x {d}) with another rank as root")?
                    }
                    Pattern::Unknown(c) => write!(f, "a call of {n} x {d} in unknown pattern {c}")?,
                }
            }
            CallKind::FabricFailed => {
                return write!(f, "nothing: its fabric failed (see that rank's error)")
            }
            CallKind::Refused => write!(
                f,
                "a call it refused ({n} elements: bad arguments; see that rank's error)"
            )?,
            CallKind::Unknown(c) => write!(f, "a call of {n} elements of unknown dtype {c}")?,
        }
        if self.more {
            write!(f, " then more (a chunk of a call longer than one slot)")?;
        }
        Ok(())
    }
}

mod sealed {
    /// Implemented for exactly the types arx reduces; private, so that no
    /// other crate can implement [`Element`](super::Element).
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
    impl Sealed for f32 {}
}

/// An element type arx can all-reduce: `bf16`, `f16` (the `half` crate) and
/// `f32`.
///
/// Sealed: arx reads `count × DTYPE.size()` bytes from a `[T]` of `count`
/// elements and hands the kernels `T`'s bits as `DTYPE`, so an impl with a
/// wrong `DTYPE` (say `u8` claiming `F32`) would read past the caller's
/// buffer. Only arx implements it:
///
/// ```compile_fail,E0277
/// #[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
/// #[repr(transparent)]
/// struct Byte(u8);
///
/// impl arx::Element for Byte {
///     const DTYPE: arx::Dtype = arx::Dtype::F32;
///     fn to_f32(self) -> f32 {
///         f32::from(self.0)
///     }
///     fn from_f32(v: f32) -> Self {
///         Byte(v as u8)
///     }
/// }
/// ```
pub trait Element: sealed::Sealed + bytemuck::Pod + Send + Sync + 'static {
    /// Its dtype.
    const DTYPE: Dtype;
    /// Widens to f32 exactly.
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type (round to nearest even).
    fn from_f32(v: f32) -> Self;
    /// Widens `src` (raw bytes of `dst.len()` elements) into `dst`.
    #[inline(always)]
    fn widen(src: &[u8], dst: &mut [f32]) {
        for (d, e) in dst
            .iter_mut()
            .zip(src.chunks_exact(std::mem::size_of::<Self>()))
        {
            *d = bytemuck::pod_read_unaligned::<Self>(e).to_f32();
        }
    }
    /// Rounds `src` into `dst`.
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = Self::from_f32(*s);
        }
    }
}

/// Slice conversions through `half`'s vectorised paths (F16C on x86-64,
/// NEON on aarch64), which run the same instruction, or the same fallback
/// code, as `half`'s one-element conversions: the same bits (checked over
/// every f16 pattern and the f32 patterns of the tests). The reduction's
/// blocks are f32-aligned, so the unaligned branch serves other callers.
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

/// bf16 → f32 is exact: the bits move up by 16; a signalling NaN is made
/// quiet (as `half` and the kernel's `bf16_to_f32` do). A select rather
/// than a branch, so that slice loops vectorise.
#[inline(always)]
fn bf16_bits_to_f32(b: u16) -> f32 {
    let quiet = if b & 0x7fff > 0x7f80 { 0x0040 } else { 0 };
    f32::from_bits(u32::from(b | quiet) << 16)
}

/// f32 → bf16, round to nearest even, overflow to ±Inf, a NaN made quiet
/// with its sign and top payload kept: the bits of `half::bf16::from_f32`
/// and of the kernel's `f32_to_bf16`. Adding 0x7fff plus the kept part's
/// lowest bit carries into bit 16 exactly when the dropped half is above
/// the halfway point, or at it with an odd kept part (ties to even); the
/// largest finite values carry into the exponent and give Inf. Both
/// results are computed and one selected, without a branch, so that slice
/// loops vectorise (`half`'s bf16 slice conversion is a scalar call per
/// element).
#[inline(always)]
fn f32_to_bf16_bits(v: f32) -> u16 {
    let x = v.to_bits();
    let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
    let nan = (x >> 16) | 0x0040;
    (if x & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    }) as u16
}

impl Element for bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    fn to_f32(self) -> f32 {
        bf16_bits_to_f32(self.to_bits())
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_bits(f32_to_bf16_bits(v))
    }
    // Inline, so that they vectorise with the reduction's features
    // (`reduce_avx2`), not the baseline's.
    #[inline(always)]
    fn widen(src: &[u8], dst: &mut [f32]) {
        match bytemuck::try_cast_slice::<u8, u16>(src) {
            Ok(h) => {
                for (d, &b) in dst.iter_mut().zip(h) {
                    *d = bf16_bits_to_f32(b);
                }
            }
            Err(_) => {
                for (d, e) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *d = bf16_bits_to_f32(u16::from_ne_bytes([e[0], e[1]]));
                }
            }
        }
    }
    #[inline(always)]
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
/// accumulator, rank order, one rounding): each element is
/// `((p0 + p1) + p2) + …` exactly, rank 0's value included as the first
/// operand. (An accumulator that started at +0.0 would turn an all −0.0
/// input into +0.0.)
///
/// `part(r, at, dst)` copies `dst.len()` bytes of rank r's partial, from its
/// byte `at`, into `dst`: partials live in memory that peers, a NIC or a GPU
/// write, which must not be seen through a `&[u8]` (see
/// `Region::read_into`). Works in blocks on the stack: no allocation on the
/// call path.
///
/// `op` other than sum combines by [`crate::Op`]'s rule instead of adding
/// (max, min), or divides the sum once at the end (avg).
///
/// On x86-64 CPUs with AVX2 and F16C (detected at run time) the same code
/// runs compiled for them ([`reduce_avx2`]). The operations and their
/// order are the same everywhere (IEEE adds and compares per lane, no fused
/// multiply-add, conversions bit for bit), so the bits are too.
pub(crate) fn reduce_in_rank_order<T: Element>(
    op: crate::Op,
    world: usize,
    part: impl Fn(usize, usize, &mut [u8]),
    out: &mut [T],
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(cpu) = f16c::Cpu::detect() {
        // SAFETY: the CPU has AVX2 and F16C (`cpu` exists), the only
        // features `reduce_avx2` is compiled for.
        unsafe { reduce_avx2(cpu, op, world, part, out) };
        return;
    }
    reduce_blocks(Portable, op, world, part, out);
}

/// [`reduce_blocks`] compiled for AVX2 and F16C: 8 f32 lanes instead of
/// x86-64's baseline SSE2's 4, and f16 conversions by F16C instructions
/// inline ([`f16c::Cpu`]).
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn reduce_avx2<T: Element>(
    cpu: f16c::Cpu,
    op: crate::Op,
    world: usize,
    part: impl Fn(usize, usize, &mut [u8]),
    out: &mut [T],
) {
    reduce_blocks(cpu, op, world, part, out);
}

/// How a block's elements widen to f32 and narrow back.
trait Convert: Copy {
    fn widen<T: Element>(self, src: &[u8], dst: &mut [f32]);
    fn narrow<T: Element>(self, src: &[f32], dst: &mut [T]);
}

/// The element type's own slice conversions ([`Element::widen`],
/// [`Element::narrow`]), for any CPU.
#[derive(Clone, Copy)]
struct Portable;

impl Convert for Portable {
    #[inline(always)]
    fn widen<T: Element>(self, src: &[u8], dst: &mut [f32]) {
        T::widen(src, dst);
    }
    #[inline(always)]
    fn narrow<T: Element>(self, src: &[f32], dst: &mut [T]) {
        T::narrow(src, dst);
    }
}

/// The body of [`reduce_in_rank_order`]: each block of `out` is reduced
/// over every rank before the next, in loops without branches per element
/// (the op is chosen once per loop), which the compiler vectorises.
#[inline(always)]
fn reduce_blocks<T: Element>(
    conv: impl Convert,
    op: crate::Op,
    world: usize,
    part: impl Fn(usize, usize, &mut [u8]),
    out: &mut [T],
) {
    use crate::Op;
    const BLOCK: usize = 512;
    let size = std::mem::size_of::<T>();
    let mut acc = [0.0f32; BLOCK];
    let mut wide = [0.0f32; BLOCK];
    // One block of raw partial bytes, f32-aligned so that the slice
    // conversions see aligned 16-bit elements.
    let mut raw = [0.0f32; BLOCK];
    for (b, chunk) in out.chunks_mut(BLOCK).enumerate() {
        let at = b * BLOCK * size;
        let n = chunk.len();
        let len = std::mem::size_of_val(chunk);
        for r in 0..world {
            let dst = if r == 0 {
                &mut acc[..n]
            } else {
                &mut wide[..n]
            };
            if T::DTYPE == Dtype::F32 {
                // f32 widens to itself: copy straight into place (sealed:
                // only `f32` has this dtype).
                part(r, at, bytemuck::cast_slice_mut(dst));
            } else {
                let bytes = &mut bytemuck::cast_slice_mut::<f32, u8>(&mut raw)[..len];
                part(r, at, bytes);
                conv.widen::<T>(bytes, dst);
            }
            let (acc, wide) = (&mut acc[..n], &wide[..n]);
            match op {
                Op::Sum | Op::Avg if r > 0 => {
                    for (a, w) in acc.iter_mut().zip(wide) {
                        *a += *w;
                    }
                }
                Op::Max if r > 0 => {
                    for (a, w) in acc.iter_mut().zip(wide) {
                        *a = Op::Max.combine(*a, *w);
                    }
                }
                Op::Min if r > 0 => {
                    for (a, w) in acc.iter_mut().zip(wide) {
                        *a = Op::Min.combine(*a, *w);
                    }
                }
                Op::Sum | Op::Avg => {}
                Op::Max | Op::Min => {
                    // Rank 0's value as the first operand; a NaN made
                    // canonical (max/min's rule; as the kernel's start at
                    // ∓inf does).
                    for a in acc.iter_mut() {
                        *a = op.combine(*a, *a);
                    }
                }
            }
        }
        if op == Op::Avg {
            for a in &mut acc[..n] {
                *a = op.finish(*a, world);
            }
        }
        conv.narrow(&acc[..n], chunk);
    }
}

/// f16 conversions by F16C instructions, 8 elements each, inline in
/// [`reduce_avx2`]. `half`'s slice conversions run the same instructions
/// (so give the same bits) but through a call per 8 elements, which cannot
/// be inlined into code not compiled for F16C, as arx's baseline is not.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::{
        __m128i, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps,
        _mm_loadu_si128, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
    };

    use super::{Convert, Dtype, Element};

    /// Proof that the CPU has AVX2 and F16C: only [`Cpu::detect`] makes one.
    #[derive(Clone, Copy)]
    pub(super) struct Cpu(());

    impl Cpu {
        pub(super) fn detect() -> Option<Cpu> {
            let yes = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("f16c");
            yes.then_some(Cpu(()))
        }
    }

    /// 8 f16 (16 bytes, any alignment) widened into `d`.
    #[inline(always)]
    fn widen8(_: Cpu, h: &[u8; 16], d: &mut [f32; 8]) {
        // SAFETY: the CPU has F16C and AVX (a `Cpu` exists); the unaligned
        // load reads `h`'s 16 bytes, the store writes `d`'s 32.
        unsafe {
            let v = _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast::<__m128i>()));
            _mm256_storeu_ps(d.as_mut_ptr(), v);
        }
    }

    /// 8 f32 rounded to f16 into `d`, to nearest even (the immediate's
    /// rounding, not MXCSR's).
    #[inline(always)]
    fn narrow8(_: Cpu, f: &[f32; 8], d: &mut [u16; 8]) {
        // SAFETY: the CPU has F16C and AVX (a `Cpu` exists); the unaligned
        // load reads `f`'s 32 bytes, the store writes `d`'s 16.
        unsafe {
            let v = _mm256_cvtps_ph(_mm256_loadu_ps(f.as_ptr()), _MM_FROUND_TO_NEAREST_INT);
            _mm_storeu_si128(d.as_mut_ptr().cast::<__m128i>(), v);
        }
    }

    impl Convert for Cpu {
        #[inline(always)]
        fn widen<T: Element>(self, src: &[u8], dst: &mut [f32]) {
            if T::DTYPE != Dtype::F16 {
                return T::widen(src, dst);
            }
            let mut s = src.chunks_exact(16);
            let mut d = dst.chunks_exact_mut(8);
            for (s, d) in (&mut s).zip(&mut d) {
                if let (Ok(s), Ok(d)) = (s.try_into(), d.try_into()) {
                    widen8(self, s, d);
                }
            }
            let (s, d) = (s.remainder(), d.into_remainder());
            if !d.is_empty() {
                let (mut h, mut f) = ([0u8; 16], [0.0f32; 8]);
                h[..s.len()].copy_from_slice(s);
                widen8(self, &h, &mut f);
                d.copy_from_slice(&f[..d.len()]);
            }
        }

        #[inline(always)]
        fn narrow<T: Element>(self, src: &[f32], dst: &mut [T]) {
            if T::DTYPE != Dtype::F16 {
                return T::narrow(src, dst);
            }
            // Sealed: only `half::f16` has this dtype, 2 bytes.
            let dst: &mut [u16] = bytemuck::cast_slice_mut(dst);
            let mut s = src.chunks_exact(8);
            let mut d = dst.chunks_exact_mut(8);
            for (s, d) in (&mut s).zip(&mut d) {
                if let (Ok(s), Ok(d)) = (s.try_into(), d.try_into()) {
                    narrow8(self, s, d);
                }
            }
            let (s, d) = (s.remainder(), d.into_remainder());
            if !d.is_empty() {
                let (mut f, mut h) = ([0.0f32; 8], [0u16; 8]);
                f[..s.len()].copy_from_slice(s);
                narrow8(self, &f, &mut h);
                d.copy_from_slice(&h[..d.len()]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_desc_reads_the_more_bit() {
        use crate::protocol::flag_word;
        let more = abi::ARX_FLAG_MORE as usize;
        let d = CallDesc::of_flag(flag_word(9, abi::ARX_DTYPE_F32, 1024 | more));
        assert_eq!(
            (d.kind, d.count, d.more),
            (CallKind::Reduce(Dtype::F32), 1024, true)
        );
        assert_eq!(
            d.to_string(),
            "an allreduce (sum of 1024 x float) then more (a chunk of a call longer than one slot)"
        );
        let d = CallDesc::of_flag(flag_word(9, abi::ARX_DTYPE_BF16, 1024));
        assert_eq!((d.count, d.more), (1024, false));
        assert_eq!(d.to_string(), "an allreduce (sum of 1024 x bfloat16)");
        let f = crate::protocol::flag_word_op(9, abi::ARX_DTYPE_BF16, crate::Op::Min.code(), 7);
        let d = CallDesc::of_flag(f);
        assert_eq!(
            (d.kind, d.op),
            (CallKind::Reduce(Dtype::Bf16), crate::Op::Min)
        );
        assert_eq!(d.to_string(), "an allreduce (min of 7 x bfloat16)");
        let n = abi::ARX_MAX_CHUNK as usize;
        let d = CallDesc::of_flag(flag_word(9, abi::ARX_DTYPE_F16, n | more));
        assert_eq!((d.count, d.more), (n, true));
        // The poison is no chunk and no refusal: "its fabric failed".
        let p = CallDesc::of_flag(flag_word(9, abi::ARX_DTYPE_INVALID, POISON_COUNT));
        assert_eq!((p.kind, p.more), (CallKind::FabricFailed, false));
        assert!(POISON_COUNT > n && POISON_COUNT & more == 0);
        let r = CallDesc::of_flag(flag_word(9, abi::ARX_DTYPE_INVALID, 5));
        assert_eq!((r.kind, r.count, r.more), (CallKind::Refused, 5, false));
        let r = CallDesc::of_flag(flag_word(9, abi::ARX_DTYPE_INVALID, n));
        assert_eq!(r.kind, CallKind::Refused);
    }

    /// The library's reduction of every op equals the independent
    /// reference of `verify` bit for bit (NaN included: canonical) on
    /// edge-value inputs, for every dtype and 1 to 5 ranks.
    #[test]
    fn every_op_matches_the_independent_reference() {
        fn check<T: Element>() {
            for world in 1..=5 {
                for op in crate::Op::ALL {
                    let n = 3000;
                    let inputs: Vec<Vec<T>> = (0..world)
                        .map(|r| crate::verify::input_edges::<T>(77, op.code().into(), r, n))
                        .collect();
                    let bytes: Vec<&[u8]> =
                        inputs.iter().map(|v| bytemuck::cast_slice(v)).collect();
                    let mut out = vec![T::from_f32(0.0); n];
                    crate::verify::poison(&mut out);
                    reduce_in_rank_order(op, world, from_slices(&bytes), &mut out);
                    let want = crate::verify::reference_op(op, &inputs);
                    assert_eq!(
                        crate::verify::count_wrong_op(op, &out, &want),
                        0,
                        "{op} {:?} over {world} ranks",
                        T::DTYPE
                    );
                }
            }
        }
        check::<f32>();
        check::<f16>();
        check::<bf16>();
    }

    /// `part` over byte slices, one per rank.
    fn from_slices<P: AsRef<[u8]>>(parts: &[P]) -> impl Fn(usize, usize, &mut [u8]) + '_ {
        |r, at, dst| dst.copy_from_slice(&parts[r].as_ref()[at..at + dst.len()])
    }

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
        reduce_in_rank_order::<f32>(crate::Op::Sum, 3, from_slices(&p), &mut out);
        assert_eq!(out[0], 1.0);
        let mut out2 = [0f32; 1];
        let p2 = [&b[..], &a[..], &c[..]];
        reduce_in_rank_order::<f32>(crate::Op::Sum, 3, from_slices(&p2), &mut out2);
        assert_eq!(out2[0], 0.0);
        assert_ne!(out[0], out2[0]);
    }

    /// Sums one element per rank, `vals[r]` on rank r, through
    /// `reduce_in_rank_order`, the inputs converted by the `half` crate.
    fn one_sum<T: Element>(vals: &[f32], conv: fn(f32) -> T) -> T {
        let parts: Vec<Vec<u8>> = vals
            .iter()
            .map(|v| bytemuck::bytes_of(&conv(*v)).to_vec())
            .collect();
        let mut out = [conv(7.0); 1];
        reduce_in_rank_order(crate::Op::Sum, vals.len(), from_slices(&parts), &mut out);
        out[0]
    }

    /// The documented sum `((p0 + p1) + p2) + …` for signed zeros, infinities
    /// and NaN, on every dtype. The expectations are written out by hand
    /// (IEEE 754: x + y is -0 only when both are -0), not computed by the
    /// code under test.
    #[test]
    fn signed_zeros_inf_and_nan_follow_the_rank_order_sum() {
        let (pz, nz, inf) = (0.0f32, -0.0f32, f32::INFINITY);
        // (inputs, expected f32 sum written out by hand)
        let cases: &[(&[f32], f32)] = &[
            (&[nz], nz),
            (&[nz, nz], nz),
            (&[nz, nz, nz], nz),
            (&[nz, nz, nz, nz, nz, nz, nz, nz], nz),
            (&[nz, pz], pz),
            (&[pz, nz], pz),
            (&[nz, nz, pz], pz),
            (&[pz, nz, nz], pz),
            (&[nz, 1.5], 1.5),
            (&[1.5, -1.5], pz), // x - x is +0 in round-to-nearest
            (&[1.5, -1.5, nz], pz),
            (&[inf, 1.0], inf),
            (&[-inf, nz, -inf], -inf),
            (&[2.0, inf, -2.0], inf),
        ];
        for &(vals, want) in cases {
            let f = one_sum::<f32>(vals, |v| v);
            assert_eq!(f.to_bits(), want.to_bits(), "f32 {vals:?}: got {f:?}");
            let b = one_sum::<bf16>(vals, bf16::from_f32);
            assert_eq!(
                b.to_bits(),
                bf16::from_f32(want).to_bits(),
                "bf16 {vals:?}: got {b:?}"
            );
            let h = one_sum::<f16>(vals, f16::from_f32);
            assert_eq!(
                h.to_bits(),
                f16::from_f32(want).to_bits(),
                "f16 {vals:?}: got {h:?}"
            );
        }
        let nan_cases: &[&[f32]] = &[
            &[f32::NAN],
            &[1.0, f32::NAN, 2.0],
            &[nz, f32::NAN],
            &[inf, -inf],
            &[inf, nz, -inf, 1.0],
        ];
        for &vals in nan_cases {
            assert!(one_sum::<f32>(vals, |v| v).is_nan(), "f32 {vals:?}");
            assert!(
                one_sum::<bf16>(vals, bf16::from_f32).is_nan(),
                "bf16 {vals:?}"
            );
            assert!(one_sum::<f16>(vals, f16::from_f32).is_nan(), "f16 {vals:?}");
        }
        // Overflow of the narrow types happens at the one rounding: bf16 and
        // f16 maxima summed in f32 exceed them (and f32's own maximum).
        assert_eq!(
            one_sum::<f16>(&[65504.0, 65504.0], f16::from_f32),
            f16::INFINITY
        );
        assert_eq!(one_sum::<f32>(&[f32::MAX, f32::MAX], |v| v), inf);
        let bmax = bf16::MAX.to_f32();
        assert_eq!(
            one_sum::<bf16>(&[bmax, bmax], bf16::from_f32),
            bf16::INFINITY
        );
        // In f16, 65504 + 8 rounds back to 65504 but 65504 + 8 + 8 = 65520
        // rounds (to even) to infinity: the sum is rounded once, at the end.
        assert_eq!(
            one_sum::<f16>(&[65504.0, 8.0, 8.0], f16::from_f32),
            f16::INFINITY
        );
        assert_eq!(f16::from_f32(65504.0 + 8.0), f16::MAX);
    }

    /// Many blocks, an odd tail, and every rank's bytes at the right offset:
    /// each element against `(p0 + p1) + p2` written out per element.
    #[test]
    fn every_element_of_every_block_is_summed() {
        let n = 512 * 3 + 77;
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1000.0
        };
        let p: Vec<Vec<f32>> = (0..3).map(|_| (0..n).map(|_| next()).collect()).collect();
        let want = |i: usize| (p[0][i] + p[1][i]) + p[2][i];
        let bytes: Vec<Vec<u8>> = p.iter().map(|v| bytemuck::cast_slice(v).to_vec()).collect();
        let mut out = vec![f32::NAN; n];
        reduce_in_rank_order(crate::Op::Sum, 3, from_slices(&bytes), &mut out);
        for (i, o) in out.iter().enumerate() {
            assert_eq!(o.to_bits(), want(i).to_bits(), "f32 element {i}");
        }
        let hb: Vec<Vec<bf16>> = p
            .iter()
            .map(|v| v.iter().map(|&f| bf16::from_f32(f)).collect())
            .collect();
        let bytes: Vec<Vec<u8>> = hb
            .iter()
            .map(|v| bytemuck::cast_slice(v).to_vec())
            .collect();
        let mut out = vec![bf16::NAN; n];
        reduce_in_rank_order(crate::Op::Sum, 3, from_slices(&bytes), &mut out);
        for (i, o) in out.iter().enumerate() {
            let e = (hb[0][i].to_f32() + hb[1][i].to_f32()) + hb[2][i].to_f32();
            assert_eq!(o.to_bits(), bf16::from_f32(e).to_bits(), "bf16 element {i}");
        }
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

    /// The conversions under test, by name: `half`'s one-element ones as
    /// arx uses them, and the slice paths the reduction runs (portable,
    /// unaligned, and F16C where the CPU has it).
    fn widen_paths<T: Element>(src: &[u16]) -> Vec<(&'static str, Vec<f32>)> {
        let bytes: &[u8] = bytemuck::cast_slice(src);
        let run = |f: &dyn Fn(&[u8], &mut [f32])| {
            let mut d = vec![f32::from_bits(0x7fbf_ffff); src.len()];
            f(bytes, &mut d);
            d
        };
        let mut odd = vec![0u8; bytes.len() + 1];
        odd[1..].copy_from_slice(bytes);
        let mut paths = vec![
            (
                "to_f32",
                run(&|b, d| {
                    for (d, e) in d.iter_mut().zip(b.chunks_exact(2)) {
                        *d = bytemuck::pod_read_unaligned::<T>(e).to_f32();
                    }
                }),
            ),
            ("portable", run(&|b, d| Portable.widen::<T>(b, d))),
            ("portable unaligned", run(&|_, d| T::widen(&odd[1..], d))),
        ];
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = f16c::Cpu::detect() {
            paths.push(("avx2+f16c", run(&|b, d| cpu.widen::<T>(b, d))));
        }
        paths
    }

    fn narrow_paths<T: Element>(src: &[f32]) -> Vec<(&'static str, Vec<u16>)> {
        let run = |f: &dyn Fn(&[f32], &mut [T])| {
            let mut d = vec![T::from_f32(0.0); src.len()];
            crate::verify::poison(&mut d);
            f(src, &mut d);
            bytemuck::cast_slice::<T, u16>(&d).to_vec()
        };
        let mut paths = vec![
            (
                "from_f32",
                run(&|s, d| {
                    for (d, s) in d.iter_mut().zip(s) {
                        *d = T::from_f32(*s);
                    }
                }),
            ),
            ("portable", run(&|s, d| Portable.narrow(s, d))),
        ];
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = f16c::Cpu::detect() {
            paths.push(("avx2+f16c", run(&|s, d| cpu.narrow(s, d))));
        }
        paths
    }

    /// Independent per-element widening: a value by `verify`'s own
    /// decoding; a NaN by the rule written out (quiet bit set, sign and
    /// payload kept).
    fn ref_widen<T: Element>(h: u16) -> u32 {
        let nan = match T::DTYPE {
            Dtype::Bf16 => (h & 0x7fff > 0x7f80).then(|| u32::from(h | 0x0040) << 16),
            _ => (h & 0x7fff > 0x7c00).then(|| {
                (u32::from(h & 0x8000) << 16) | 0x7fc0_0000 | (u32::from(h & 0x03ff) << 13)
            }),
        };
        let v: T = bytemuck::pod_read_unaligned(&h.to_ne_bytes());
        nan.unwrap_or_else(|| crate::verify::value_of(&v).to_bits())
    }

    /// Independent per-element rounding: a value by `verify`'s own
    /// rounding (in f64: to nearest, ties to even, overflow to Inf); a NaN
    /// made quiet with its sign and top payload bits kept.
    fn ref_narrow<T: Element>(x: u32) -> u16 {
        let v = f32::from_bits(x);
        if !v.is_nan() {
            let r: T = crate::verify::round_to(v);
            return bytemuck::cast_slice::<T, u16>(std::slice::from_ref(&r))[0];
        }
        let top = (x >> 16) as u16;
        match T::DTYPE {
            Dtype::Bf16 => top | 0x0040,
            _ => (top & 0x8000) | 0x7e00 | ((x >> 13) & 0x03ff) as u16,
        }
    }

    /// f32 patterns whose rounding to bf16 or f16 is hard: every sign,
    /// exponent and top mantissa bits (the high half), each with low
    /// halves that put a rounding boundary (exactly half an ulp, just
    /// above, just below, odd and even kept parts) at every bit position
    /// of the low half that f16's normals (bit 12) and subnormals (13 to
    /// 15; higher ones lie in the high half) and bf16 (15) round at; then
    /// random patterns.
    fn hard_f32_patterns() -> Vec<u32> {
        let mut lows: Vec<u32> = (11..16)
            .flat_map(|k| {
                let b = 1u32 << k;
                [b, b - 1, b + 1, 3 * b, 3 * b + 1]
            })
            .chain([0, 1, 0xffff])
            .map(|l| l & 0xffff)
            .collect();
        lows.sort_unstable();
        lows.dedup();
        let mut p: Vec<u32> = (0..=0xffffu32)
            .flat_map(|hi| lows.iter().map(move |lo| (hi << 16) | lo))
            .collect();
        let mut x = 0x2545_f491u32;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            p.push(x);
        }
        p
    }

    /// Every bf16 and f16 pattern widens, and the hard f32 patterns
    /// narrow, to the independent reference's bits on every path (NaN
    /// payloads included), in slices of every length modulo 8 (the
    /// vector paths' tails).
    #[test]
    fn conversions_match_the_reference_bit_for_bit() {
        fn check<T: Element>(wide: &[u32]) {
            let all: Vec<u16> = (0..=u16::MAX).collect();
            let want: Vec<u32> = all.iter().map(|&h| ref_widen::<T>(h)).collect();
            // Lengths 1..=19 in turn, so that every tail length is met.
            let mut at = 0;
            for len in (1..=19).cycle() {
                if at >= all.len() {
                    break;
                }
                let r = at..(at + len).min(all.len());
                for (name, got) in widen_paths::<T>(&all[r.clone()]) {
                    for (i, g) in r.clone().zip(got) {
                        assert_eq!(
                            g.to_bits(),
                            want[i],
                            "{:?} {name}: widen {:#06x}",
                            T::DTYPE,
                            all[i]
                        );
                    }
                }
                at = r.end;
            }
            let src: Vec<f32> = wide.iter().map(|&x| f32::from_bits(x)).collect();
            let want: Vec<u16> = wide.iter().map(|&x| ref_narrow::<T>(x)).collect();
            let mut at = 0;
            for len in [1usize, 2, 7, 8, 9, 15, 16, 17, 4096, 12345]
                .into_iter()
                .cycle()
            {
                if at >= src.len() {
                    break;
                }
                let r = at..(at + len).min(src.len());
                for (name, got) in narrow_paths::<T>(&src[r.clone()]) {
                    for (i, g) in r.clone().zip(got) {
                        assert_eq!(
                            g,
                            want[i],
                            "{:?} {name}: narrow {:#010x}",
                            T::DTYPE,
                            wide[i]
                        );
                    }
                }
                at = r.end;
            }
        }
        let wide = hard_f32_patterns();
        check::<bf16>(&wide);
        check::<f16>(&wide);
    }

    /// Inputs on which the reduction's rounding is hard, rank `r`'s of
    /// `world`: every 16-bit pattern on every rank (paired differently on
    /// each rank: NaN payloads, ±Inf, −0.0, subnormals, sums that
    /// overflow), then sums that are exact ties of the dtype (every normal
    /// value plus half its ulp, the largest finite value's tie included:
    /// to Inf), with −0.0 on the ranks past the second.
    fn hard_inputs<T: Element>(r: usize) -> Vec<T> {
        const MUL: [u32; 4] = [1, 40503, 26693, 1021];
        let mut bits: Vec<u16> = (0..=0xffffu32)
            .map(|i| (i.wrapping_mul(MUL[r % 4]).wrapping_add(r as u32 * 7919) & 0xffff) as u16)
            .collect();
        let (man, top_exp) = match T::DTYPE {
            Dtype::Bf16 => (7u32, 254u32),
            _ => (10, 30),
        };
        for e in (man + 2)..=top_exp {
            for m in [0u32, 1, 2, 3, (1 << man) - 1] {
                for sign in [0u32, 1] {
                    let a = (sign << 15) | (e << man) | m;
                    // Half an ulp of `a`: exponent e - man - 1, as a
                    // normal of the same dtype (e > man + 1).
                    let h = (sign << 15) | ((e - man - 1) << man);
                    bits.push(match r {
                        0 => a as u16,
                        1 => h as u16,
                        _ => 0x8000,
                    });
                }
            }
        }
        bits.iter()
            .map(|b| bytemuck::pod_read_unaligned(&b.to_ne_bytes()))
            .collect()
    }

    /// The reduction, on every conversion path, equals the independent
    /// reference (`verify::reference_op`: its own decoding, rank-order
    /// f32 arithmetic and rounding) bit for bit on [`hard_inputs`], for
    /// every op and 1 to 3 ranks; a NaN result is a NaN (sum: payload
    /// unspecified; max, min, avg: canonical). One rank's sum is the
    /// conversion there and back: its NaN keeps its payload, made quiet.
    #[test]
    fn reduce_matches_the_reference_on_every_pattern() {
        fn check<T: Element>() {
            for world in 1..=3 {
                let inputs: Vec<Vec<T>> = (0..world).map(hard_inputs::<T>).collect();
                let bytes: Vec<&[u8]> = inputs.iter().map(|v| bytemuck::cast_slice(v)).collect();
                let n = inputs[0].len();
                for op in crate::Op::ALL {
                    let want = crate::verify::reference_op(op, &inputs);
                    let mut paths: Vec<(&str, Vec<T>)> = Vec::new();
                    let mut out = vec![T::from_f32(0.0); n];
                    crate::verify::poison(&mut out);
                    reduce_blocks(Portable, op, world, from_slices(&bytes), &mut out);
                    paths.push(("portable", out.clone()));
                    crate::verify::poison(&mut out);
                    reduce_in_rank_order(op, world, from_slices(&bytes), &mut out);
                    paths.push(("dispatched", out.clone()));
                    for (name, got) in paths {
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            let ins: Vec<u16> = inputs
                                .iter()
                                .map(|v| bytemuck::cast_slice::<T, u16>(v)[i])
                                .collect();
                            assert_eq!(
                                crate::verify::count_wrong_op(op, &[*g], &[*w]),
                                0,
                                "{:?} {op} {name} over {world} ranks, element {i} of inputs {ins:04x?}: got {:#06x}, want {:#06x}",
                                T::DTYPE,
                                bytemuck::cast_slice::<T, u16>(std::slice::from_ref(g))[0],
                                bytemuck::cast_slice::<T, u16>(std::slice::from_ref(w))[0],
                            );
                            if world == 1 && op == crate::Op::Sum {
                                let one = ref_narrow::<T>(ref_widen::<T>(ins[0]));
                                let g = bytemuck::cast_slice::<T, u16>(std::slice::from_ref(g))[0];
                                assert_eq!(
                                    g,
                                    one,
                                    "{:?} {name}: one rank's {:#06x}",
                                    T::DTYPE,
                                    ins[0]
                                );
                            }
                        }
                    }
                }
            }
        }
        check::<bf16>();
        check::<f16>();
    }

    /// The host-side reduction's speed, ns per output element (`cargo
    /// test --release --lib reduce_speed -- --ignored --nocapture`): the
    /// CPU cost of the sum that bf16/f16 calls pay over f32 ones. Prints
    /// only; speed is not asserted (the machine is shared).
    #[test]
    #[ignore]
    fn reduce_speed() {
        fn run<T: Element>(world: usize, op: crate::Op, n: usize) {
            let inputs: Vec<Vec<T>> = (0..world)
                .map(|r| crate::verify::input::<T>(5, 0, r, n))
                .collect();
            let bytes: Vec<&[u8]> = inputs.iter().map(|v| bytemuck::cast_slice(v)).collect();
            let mut out = vec![T::from_f32(0.0); n];
            let part = from_slices(&bytes);
            for _ in 0..3 {
                reduce_in_rank_order(op, world, &part, &mut out);
            }
            let mut best = f64::INFINITY;
            for _ in 0..5 {
                let reps = 20;
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    reduce_in_rank_order(op, world, &part, std::hint::black_box(&mut out));
                }
                best = best.min(t.elapsed().as_secs_f64() / (reps * n) as f64);
            }
            println!(
                "reduce_speed {:>8} {op:>3} world {world} n {n:>7}: {:6.3} ns/element",
                T::DTYPE.name(),
                best * 1e9
            );
        }
        for n in [4096, 65536, 262144] {
            for world in [2, 4] {
                for op in [crate::Op::Sum, crate::Op::Max] {
                    run::<f32>(world, op, n);
                    run::<bf16>(world, op, n);
                    run::<f16>(world, op, n);
                }
            }
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
        let mut out = [bf16::ZERO; 1];
        reduce_in_rank_order(crate::Op::Sum, 3, from_slices(&parts), &mut out);
        assert_eq!(out[0], bf16::from_f32(1.0 + 0.00390625 + 0.00390625));
        // Rounding after every step would have lost both small terms.
        let stepwise = bf16::from_f32(bf16::from_f32(1.0 + 0.00390625).to_f32() + 0.00390625);
        assert_ne!(out[0], stepwise);
    }
}
