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

/// Element count of the "invalid" flag words a rank writes to its peers when
/// a call of its own timed out (see `proxy`), so that a peer still waiting
/// on it fails at once.
pub(crate) const FAILED_COUNT: usize = abi::ARX_FLAG_FAILED_COUNT as usize;

/// Element count of the "invalid" flag word a rank's proxy writes in place
/// of a peer's flag when that peer closed its instance before the call
/// (see `proxy`), so that the call fails at once naming it.
pub(crate) const DEPARTED_COUNT: usize = abi::ARX_FLAG_DEPARTED_COUNT as usize;

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
    /// Nothing: the rank had timed out in a call, so its instance is failed
    /// for good (poisoned flags).
    Failed,
    /// Nothing: the rank had closed its instance (dropped it; C:
    /// `arxCommDestroy`; Python: `close()`) after fewer calls than this
    /// rank made.
    Departed,
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
#[non_exhaustive]
pub enum Pattern {
    /// Every peer got the whole partial: a one-shot all-reduce.
    #[default]
    Whole,
    /// Each peer got its own shard: a `reduce_scatter`.
    Scatter,
    /// Every peer got the sender's shard: an `all_gather`.
    Gather,
    /// Each peer got its own shard: the first step of a two-shot
    /// all-reduce (`ARX_FLAG_ALLREDUCE`).
    TwoShotScatter,
    /// Every peer got the sender's reduced shard: the second step of a
    /// two-shot all-reduce (`ARX_FLAG_ALLREDUCE`).
    TwoShotGather,
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
    /// From a flag word's pattern code, op field (a broadcast's root bit)
    /// and `ARX_FLAG_ALLREDUCE` bit (`two`: a two-shot all-reduce's step).
    pub(crate) fn from_code(code: u32, op: u32, two: bool) -> Self {
        match code {
            abi::ARX_PATTERN_WHOLE => Pattern::Whole,
            abi::ARX_PATTERN_SCATTER if two => Pattern::TwoShotScatter,
            abi::ARX_PATTERN_GATHER if two => Pattern::TwoShotGather,
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
            None if code == abi::ARX_DTYPE_INVALID && field == FAILED_COUNT => CallKind::Failed,
            None if code == abi::ARX_DTYPE_INVALID && field == DEPARTED_COUNT => CallKind::Departed,
            None if code == abi::ARX_DTYPE_INVALID => CallKind::Refused,
            None => CallKind::Unknown(code),
        };
        let op = crate::protocol::flag_op(flag);
        let pattern = match kind {
            CallKind::Reduce(_) => Pattern::from_code(
                crate::protocol::flag_pattern(flag),
                op,
                flag & u64::from(abi::ARX_FLAG_ALLREDUCE) != 0,
            ),
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
                    Pattern::Scatter => write!(f, "a reduce_scatter ({op} of {n} x {d})")?,
                    Pattern::Gather => write!(f, "an all_gather ({n} x {d})")?,
                    Pattern::TwoShotScatter => write!(
                        f,
                        "the reduce-scatter step of a two-shot allreduce ({op} of {n} x {d})"
                    )?,
                    Pattern::TwoShotGather => {
                        write!(f, "the all-gather step of a two-shot allreduce ({n} x {d})")?
                    }
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
            CallKind::Failed => {
                return write!(
                    f,
                    "nothing: it had timed out in a call (see that rank's error)"
                )
            }
            CallKind::Departed => {
                return write!(
                    f,
                    "nothing: it had closed its instance after fewer calls (dropped or destroyed)"
                )
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
/// On x86-64 CPUs with AVX2 and F16C (detected at run time) each pass over
/// a block is explicit AVX2 code ([`avx2`]); elsewhere the same steps run
/// as slice loops the compiler vectorises for the CPU ([`Portable`]). Both
/// compute every element by the same rule (rank order, IEEE f32 adds, the
/// op's comparison rule, no fused multiply-add, conversions bit for bit),
/// so the bits are the same (the tests hold every path to an independent
/// reference).
pub(crate) fn reduce_in_rank_order<T: Element>(
    op: crate::Op,
    world: usize,
    part: impl Fn(usize, usize, &mut [u8]),
    out: &mut [T],
) {
    // The blocks come from this thread's scratch: zeroing 6 KiB of fresh
    // blocks per call cost ~80 ns, most of a one-line call's sum. Taken
    // already (a `part` that reduces, which arx's do not): fresh blocks.
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => reduce_with(op, world, part, out, &mut s),
        Err(_) => {
            let mut fresh = Scratch::ZERO;
            reduce_with(op, world, part, out, &mut fresh)
        }
    });
}

/// [`reduce_in_rank_order`] on the blocks of `scratch`.
#[inline(always)]
fn reduce_with<T: Element>(
    op: crate::Op,
    world: usize,
    part: impl Fn(usize, usize, &mut [u8]),
    out: &mut [T],
    scratch: &mut Scratch,
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(cpu) = avx2::Cpu::detect() {
        // SAFETY: the CPU has AVX2 and F16C (`cpu` exists), the only
        // features `reduce_avx2` is compiled for.
        unsafe { reduce_avx2(cpu, op, world, part, out, scratch) };
        return;
    }
    reduce_blocks(Portable, op, world, part, out, scratch);
}

thread_local! {
    /// [`reduce_in_rank_order`]'s blocks, zeroed once per thread.
    static SCRATCH: std::cell::RefCell<Scratch> = const { std::cell::RefCell::new(Scratch::ZERO) };
}

/// The accumulator and two partials' blocks of [`reduce_blocks`]. What
/// they hold on entry does not matter: every lane that reaches an output
/// was written by this call (the tests pass NaN-filled ones).
struct Scratch([Block; 3]);

impl Scratch {
    const ZERO: Scratch = Scratch([Block::ZERO; 3]);
}

/// [`reduce_blocks`] with the [`avx2`] passes, compiled for AVX2 and F16C
/// so that their intrinsics inline.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn reduce_avx2<T: Element>(
    cpu: avx2::Cpu,
    op: crate::Op,
    world: usize,
    part: impl Fn(usize, usize, &mut [u8]),
    out: &mut [T],
    scratch: &mut Scratch,
) {
    reduce_blocks(cpu, op, world, part, out, scratch);
}

/// Elements per block: every pass over a block stays in L1.
const BLOCK: usize = 512;
/// Elements per group: what the [`avx2`] passes take at a time (two AVX
/// registers of f32).
const GROUP: usize = 16;

/// A block of f32 (the accumulator), or of one rank's raw partial bytes
/// (any dtype: at most 4 bytes an element), in groups, aligned for the
/// vector loads. Bytes past a short last block's end hold stale values:
/// lanes computed from them are never written out.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Block([[f32; GROUP]; BLOCK / GROUP]);

impl Block {
    const ZERO: Block = Block([[0.0; GROUP]; BLOCK / GROUP]);

    fn f32s_mut(&mut self, n: usize) -> &mut [f32] {
        &mut bytemuck::cast_slice_mut(&mut self.0[..])[..n]
    }
    fn bytes(&self, len: usize) -> &[u8] {
        &bytemuck::cast_slice(&self.0[..])[..len]
    }
    fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.0[..])[..len]
    }
    /// The raw partial as `groups` groups of elements of `T`.
    #[cfg(target_arch = "x86_64")]
    fn groups<T: Element>(&self, groups: usize) -> &[[T; GROUP]] {
        &bytemuck::cast_slice(&self.0[..])[..groups]
    }
}

/// One pass of the reduction over a block of `n` elements. Its value per
/// element is `a ∘ widen(next)` (by the op's rule) where `a` is
/// `widen(first)`, or the accumulator's when `first` is `None`; without
/// `next`, `a` alone as the first operand (max, min: a NaN made
/// canonical). Then that value goes into `out` (the op's last step, then
/// one rounding to `T`) when given, else into the accumulator. (The
/// accumulator may be left changed either way.)
trait Kernel: Copy {
    #[allow(clippy::too_many_arguments)]
    fn pass<T: Element>(
        self,
        op: crate::Op,
        world: usize,
        n: usize,
        first: Option<&Block>,
        next: Option<&Block>,
        acc: &mut Block,
        out: Option<&mut [T]>,
    );

    /// Where element `i` of a block sits in the accumulator between
    /// passes (the kernel's own order; tests read and write it).
    #[cfg(test)]
    fn acc_index<T: Element>(self, i: usize) -> usize {
        i
    }
}

/// The body of [`reduce_in_rank_order`]: each block of `out` is reduced
/// over every rank before the next, ranks 0 and 1 in one pass, each later
/// rank in one more, the last one's pass writing `out`: one pass in all
/// for two ranks, none through memory of the accumulator.
#[inline(always)]
fn reduce_blocks<T: Element>(
    k: impl Kernel,
    op: crate::Op,
    world: usize,
    part: impl Fn(usize, usize, &mut [u8]),
    out: &mut [T],
    scratch: &mut Scratch,
) {
    if world == 0 {
        // No partials: nothing to read (callers pass their world size).
        return;
    }
    let size = std::mem::size_of::<T>();
    let [acc, a, b] = &mut scratch.0;
    for (i, chunk) in out.chunks_mut(BLOCK).enumerate() {
        let at = i * BLOCK * size;
        let (n, len) = (chunk.len(), std::mem::size_of_val(chunk));
        part(0, at, a.bytes_mut(len));
        if world == 1 {
            k.pass(op, world, n, Some(&*a), None, acc, Some(chunk));
            continue;
        }
        part(1, at, b.bytes_mut(len));
        if world == 2 {
            k.pass(op, world, n, Some(&*a), Some(&*b), acc, Some(chunk));
            continue;
        }
        k.pass::<T>(op, world, n, Some(&*a), Some(&*b), acc, None);
        for r in 2..world {
            part(r, at, a.bytes_mut(len));
            let out = (r + 1 == world).then_some(&mut *chunk);
            k.pass(op, world, n, None, Some(&*a), acc, out);
        }
    }
}

/// The element type's own slice conversions ([`Element::widen`],
/// [`Element::narrow`]) and loops of [`crate::Op`]'s per-element steps
/// without branches per element (the op is chosen once per loop), which
/// the compiler vectorises: for any CPU.
#[derive(Clone, Copy)]
struct Portable;

impl Portable {
    /// `dst[i] = dst[i] ∘ widen(src[i])`, in pieces through a small buffer
    /// (the widening is a slice conversion).
    #[inline(always)]
    fn combine<T: Element>(op: crate::Op, src: &[u8], dst: &mut [f32]) {
        use crate::Op;
        const PIECE: usize = 64;
        let size = std::mem::size_of::<T>();
        let mut wide = [0.0f32; PIECE];
        for (acc, raw) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE * size)) {
            let wide = &mut wide[..acc.len()];
            Portable::widen::<T>(raw, wide);
            match op {
                Op::Sum | Op::Avg => {
                    for (a, w) in acc.iter_mut().zip(&*wide) {
                        *a += *w;
                    }
                }
                Op::Max => {
                    for (a, w) in acc.iter_mut().zip(&*wide) {
                        *a = Op::Max.combine(*a, *w);
                    }
                }
                Op::Min => {
                    for (a, w) in acc.iter_mut().zip(&*wide) {
                        *a = Op::Min.combine(*a, *w);
                    }
                }
            }
        }
    }

    #[inline(always)]
    fn widen<T: Element>(src: &[u8], dst: &mut [f32]) {
        match bytemuck::try_cast_slice(src) {
            // f32 widens to itself (sealed: only `f32` has this dtype); a
            // block's bytes are f32-aligned.
            Ok(f) if T::DTYPE == Dtype::F32 => dst.copy_from_slice(f),
            _ => T::widen(src, dst),
        }
    }
}

impl Kernel for Portable {
    #[inline(always)]
    fn pass<T: Element>(
        self,
        op: crate::Op,
        world: usize,
        n: usize,
        first: Option<&Block>,
        next: Option<&Block>,
        acc: &mut Block,
        out: Option<&mut [T]>,
    ) {
        use crate::Op;
        let len = n * std::mem::size_of::<T>();
        let acc = acc.f32s_mut(n);
        if let Some(a) = first {
            Portable::widen::<T>(a.bytes(len), acc);
        }
        match next {
            Some(b) => Portable::combine::<T>(op, b.bytes(len), acc),
            None if matches!(op, Op::Max | Op::Min) => {
                for a in acc.iter_mut() {
                    *a = op.combine(*a, *a);
                }
            }
            None => {}
        }
        if let Some(out) = out {
            if op == Op::Avg {
                for a in acc.iter_mut() {
                    *a = op.finish(*a, world);
                }
            }
            T::narrow(acc, out);
        }
    }
}

/// The passes as explicit AVX2 code, inline in [`reduce_avx2`], 16
/// elements (two registers of 8 f32) at a time: per group one load and
/// widening per rank, the op, its last step and the rounding fused into
/// the pass, so that no block is written and read back between them.
/// (The compiler does not fuse slice loops across these steps, and
/// `half`'s conversions are a call per element (bf16) or per 8 (f16).)
///
/// bf16 is widened without a shuffle: of 16 elements loaded as 8 32-bit
/// lanes, each lane's upper element is an f32 once its low half is
/// cleared, its lower one once shifted up by 16; so the group's first
/// register holds the even-numbered elements and the second the odd ones,
/// and the rounding puts each back in its half of the lane. The order of
/// elements inside a group does not matter between the two: every step
/// works per lane.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::{
        __m128i, __m256, __m256i, _mm256_add_epi32, _mm256_add_ps, _mm256_and_ps, _mm256_and_si256,
        _mm256_blend_epi16, _mm256_blendv_epi8, _mm256_blendv_ps, _mm256_castps_si256,
        _mm256_castsi256_ps, _mm256_cmp_ps, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_div_ps,
        _mm256_load_ps, _mm256_loadu_ps, _mm256_loadu_si256, _mm256_max_ps, _mm256_min_ps,
        _mm256_movemask_ps, _mm256_or_ps, _mm256_or_si256, _mm256_set1_epi32, _mm256_set1_ps,
        _mm256_slli_epi32, _mm256_srli_epi32, _mm256_store_ps, _mm256_storeu_ps,
        _mm256_storeu_si256, _mm_loadu_si128, _mm_storeu_si128, _CMP_UNORD_Q,
        _MM_FROUND_TO_NEAREST_INT,
    };

    use std::marker::PhantomData;

    use super::{Block, Dtype, Element, Kernel, GROUP};
    use crate::abi::{ARX_OP_AVG, ARX_OP_MAX, ARX_OP_MIN, ARX_OP_SUM};
    use crate::op::CANONICAL_NAN_BITS;

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

    /// A group's 16 values as f32, in two registers (bf16: even-numbered
    /// elements, then odd-numbered; other dtypes: in order).
    #[derive(Clone, Copy)]
    struct X16(__m256, __m256);

    /// 8 lanes of `bits`.
    #[inline(always)]
    fn splat(_: Cpu, bits: u32) -> __m256i {
        // SAFETY: the CPU has AVX (a `Cpu` exists); no memory access.
        unsafe { _mm256_set1_epi32(bits as i32) }
    }

    /// 8 lanes of the canonical NaN.
    #[inline(always)]
    fn canonical(cpu: Cpu) -> __m256 {
        // SAFETY: the CPU has AVX (a `Cpu` exists); no memory access.
        unsafe { _mm256_castsi256_ps(splat(cpu, CANONICAL_NAN_BITS)) }
    }

    /// A group widened exactly to f32: f32 loaded; f16 by F16C (the
    /// instruction `half` runs: the same bits, a signalling NaN made
    /// quiet); bf16 moved into the upper half of an f32 (the order: see
    /// the module docs), but a signalling NaN left signalling: every pass
    /// combines the value (an IEEE add makes it quiet; max and min give
    /// the canonical NaN) or makes it the first operand ([`first`]: quiet
    /// as well) before anything else reads it, so the quieting of
    /// [`super::bf16_bits_to_f32`] would be a step for nothing.
    #[inline(always)]
    fn widen<T: Element>(cpu: Cpu, e: &[T; GROUP]) -> X16 {
        let p = e.as_ptr();
        match T::DTYPE {
            // SAFETY: the CPU has AVX (a `Cpu` exists); the unaligned loads
            // read `e`'s 64 bytes.
            Dtype::F32 => unsafe {
                let p = p.cast::<f32>();
                X16(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
            },
            // SAFETY: the CPU has F16C (a `Cpu` exists); the unaligned loads
            // read `e`'s 32 bytes.
            Dtype::F16 => unsafe {
                let p = p.cast::<__m128i>();
                X16(
                    _mm256_cvtph_ps(_mm_loadu_si128(p)),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(1))),
                )
            },
            // SAFETY: the CPU has AVX2 (a `Cpu` exists); the unaligned load
            // reads `e`'s 32 bytes.
            Dtype::Bf16 => unsafe {
                let x = _mm256_loadu_si256(p.cast::<__m256i>());
                X16(
                    _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)),
                    _mm256_castsi256_ps(_mm256_and_si256(x, splat(cpu, 0xffff_0000))),
                )
            },
        }
    }

    /// f32 lanes rounded to bf16 in their upper half by
    /// [`super::f32_to_bf16_bits`]'s rule: add 0x7fff plus the kept part's
    /// lowest bit (ties to even; the largest finite values carry into
    /// Inf). A NaN lane is wrong here: see [`narrow`].
    #[inline(always)]
    fn round_bf16(cpu: Cpu, x: __m256i) -> __m256i {
        // SAFETY: the CPU has AVX2 (a `Cpu` exists); no memory access.
        unsafe {
            let odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), splat(cpu, 1));
            _mm256_add_epi32(x, _mm256_add_epi32(odd, splat(cpu, 0x7fff)))
        }
    }

    /// A group rounded to `T` into `d`, to nearest even: f32 stored; f16
    /// by F16C with the immediate's rounding (not MXCSR's), as `half`;
    /// bf16 by [`round_bf16`], a NaN as its upper half with the quiet bit
    /// set (sign and top payload kept) when `EXACT`. Without `EXACT` a bf16
    /// NaN's bits may be wrong: returned, a lane set where either register
    /// had a NaN, for [`into_out`] to redo the pass.
    #[inline(always)]
    fn narrow<T: Element, const EXACT: bool>(cpu: Cpu, v: X16, d: &mut [T; GROUP]) -> __m256 {
        // SAFETY: the CPU has AVX (a `Cpu` exists); no memory access.
        let mut nan = unsafe { _mm256_set1_ps(0.0) };
        let p = d.as_mut_ptr();
        match T::DTYPE {
            // SAFETY: the CPU has AVX (a `Cpu` exists); the unaligned stores
            // write `d`'s 64 bytes.
            Dtype::F32 => unsafe {
                let p = p.cast::<f32>();
                _mm256_storeu_ps(p, v.0);
                _mm256_storeu_ps(p.add(8), v.1);
            },
            // SAFETY: the CPU has F16C (a `Cpu` exists); the unaligned stores
            // write `d`'s 32 bytes.
            Dtype::F16 => unsafe {
                let p = p.cast::<__m128i>();
                _mm_storeu_si128(p, _mm256_cvtps_ph(v.0, _MM_FROUND_TO_NEAREST_INT));
                _mm_storeu_si128(p.add(1), _mm256_cvtps_ph(v.1, _MM_FROUND_TO_NEAREST_INT));
            },
            Dtype::Bf16 => {
                // SAFETY: the CPU has AVX2 (a `Cpu` exists); no memory
                // access.
                let (even, odd) = unsafe { (_mm256_castps_si256(v.0), _mm256_castps_si256(v.1)) };
                let (mut e, mut o) = (round_bf16(cpu, even), round_bf16(cpu, odd));
                // SAFETY: as above.
                unsafe {
                    if EXACT {
                        let quiet = splat(cpu, 0x0040_0000);
                        let is = _mm256_castps_si256(_mm256_cmp_ps(v.0, v.0, _CMP_UNORD_Q));
                        e = _mm256_blendv_epi8(e, _mm256_or_si256(even, quiet), is);
                        let is = _mm256_castps_si256(_mm256_cmp_ps(v.1, v.1, _CMP_UNORD_Q));
                        o = _mm256_blendv_epi8(o, _mm256_or_si256(odd, quiet), is);
                    } else {
                        nan = _mm256_cmp_ps(v.0, v.1, _CMP_UNORD_Q);
                    }
                }
                // SAFETY: as above; the unaligned store writes `d`'s 32
                // bytes.
                unsafe {
                    // Even elements' upper halves down into the lower ones,
                    // odd elements' upper halves in place.
                    let h = _mm256_blend_epi16(_mm256_srli_epi32(e, 16), o, 0xaa);
                    _mm256_storeu_si256(p.cast::<__m256i>(), h);
                }
            }
        }
        nan
    }

    /// `a ∘ b` by [`crate::Op::combine`]'s rule. Max: `vmaxps` gives the
    /// larger of unequal numbers both ways round; of equal ones (±0) its
    /// second operand, so ANDing both orders keeps +0 as the rule's AND of
    /// the bits does (min: OR keeps −0); any NaN gives the canonical one.
    #[inline(always)]
    fn combine<const OP: u32>(cpu: Cpu, a: X16, b: X16) -> X16 {
        X16(combine8::<OP>(cpu, a.0, b.0), combine8::<OP>(cpu, a.1, b.1))
    }

    /// [`combine`] of one register.
    #[inline(always)]
    fn combine8<const OP: u32>(cpu: Cpu, a: __m256, b: __m256) -> __m256 {
        // SAFETY: the CPU has AVX (a `Cpu` exists); no memory access.
        unsafe {
            let r = match OP {
                ARX_OP_MAX => _mm256_and_ps(_mm256_max_ps(a, b), _mm256_max_ps(b, a)),
                ARX_OP_MIN => _mm256_or_ps(_mm256_min_ps(a, b), _mm256_min_ps(b, a)),
                _ => return _mm256_add_ps(a, b),
            };
            _mm256_blendv_ps(r, canonical(cpu), _mm256_cmp_ps(a, b, _CMP_UNORD_Q))
        }
    }

    /// `a` as the first operand: `a ∘ a` for max and min (a NaN made
    /// canonical); for sum and avg `a` itself, a bf16 NaN made quiet (bit
    /// 22 set), so that the value is the portable widening's (see
    /// [`widen`]). (Not by `−0.0 + a`, the sum's identity: the compiler
    /// may fold that to `a`.)
    #[inline(always)]
    fn first<T: Element, const OP: u32>(cpu: Cpu, a: X16) -> X16 {
        match OP {
            ARX_OP_MAX | ARX_OP_MIN => combine::<OP>(cpu, a, a),
            _ if T::DTYPE == Dtype::Bf16 => X16(quiet8(cpu, a.0), quiet8(cpu, a.1)),
            _ => a,
        }
    }

    /// A NaN lane made quiet (bit 22 set), the others as they are.
    #[inline(always)]
    fn quiet8(cpu: Cpu, a: __m256) -> __m256 {
        // SAFETY: the CPU has AVX (a `Cpu` exists); no memory access.
        unsafe {
            let bit = _mm256_castsi256_ps(splat(cpu, 0x0040_0000));
            _mm256_or_ps(a, _mm256_and_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), bit))
        }
    }

    /// [`crate::Op::finish`]: avg's one division by `world` (a NaN made
    /// canonical); nothing for the others.
    #[inline(always)]
    fn finish<const OP: u32>(cpu: Cpu, a: X16, world: usize) -> X16 {
        if OP != ARX_OP_AVG {
            return a;
        }
        X16(avg8(cpu, a.0, world), avg8(cpu, a.1, world))
    }

    /// [`finish`] of one register, for avg.
    #[inline(always)]
    fn avg8(cpu: Cpu, a: __m256, world: usize) -> __m256 {
        // SAFETY: the CPU has AVX (a `Cpu` exists); no memory access.
        unsafe {
            let q = _mm256_div_ps(a, _mm256_set1_ps(world as f32));
            _mm256_blendv_ps(q, canonical(cpu), _mm256_cmp_ps(q, q, _CMP_UNORD_Q))
        }
    }

    /// A pass's value per group, built from the types below (plain types
    /// with inline methods rather than closures: a closure is a function
    /// of its own, compiled without AVX, into which the intrinsics would
    /// not inline).
    trait Lanes: Copy {
        /// The value of group `g`; `old`: the accumulator's group `g` when
        /// the pass writes the accumulator in place.
        fn get(self, cpu: Cpu, g: usize, old: X16) -> X16;
    }

    /// A raw partial's groups, widened.
    #[derive(Clone, Copy)]
    struct Wide<'a, T>(&'a [[T; GROUP]]);
    /// The accumulator's groups, read (a pass into `out`).
    #[derive(Clone, Copy)]
    struct Acc<'a>(&'a [[f32; GROUP]]);
    /// The accumulator's group in place (a pass into the accumulator).
    #[derive(Clone, Copy)]
    struct Old;
    /// `A ∘ B` by the op.
    #[derive(Clone, Copy)]
    struct Combine<A, B, const OP: u32>(A, B);
    /// `A` as the first operand, of dtype `T`.
    #[derive(Clone, Copy)]
    struct First<A, T, const OP: u32>(A, PhantomData<T>);

    impl<T: Element> Lanes for Wide<'_, T> {
        #[inline(always)]
        fn get(self, cpu: Cpu, g: usize, _: X16) -> X16 {
            widen(cpu, &self.0[g])
        }
    }
    impl Lanes for Acc<'_> {
        #[inline(always)]
        fn get(self, cpu: Cpu, g: usize, _: X16) -> X16 {
            load(cpu, &self.0[g])
        }
    }
    impl Lanes for Old {
        #[inline(always)]
        fn get(self, _: Cpu, _: usize, old: X16) -> X16 {
            old
        }
    }
    impl<A: Lanes, B: Lanes, const OP: u32> Lanes for Combine<A, B, OP> {
        #[inline(always)]
        fn get(self, cpu: Cpu, g: usize, old: X16) -> X16 {
            combine::<OP>(cpu, self.0.get(cpu, g, old), self.1.get(cpu, g, old))
        }
    }
    impl<A: Lanes, T: Element, const OP: u32> Lanes for First<A, T, OP> {
        #[inline(always)]
        fn get(self, cpu: Cpu, g: usize, old: X16) -> X16 {
            first::<T, OP>(cpu, self.0.get(cpu, g, old))
        }
    }

    /// A group of the accumulator.
    #[inline(always)]
    fn load(_: Cpu, a: &[f32; GROUP]) -> X16 {
        // SAFETY: the CPU has AVX (a `Cpu` exists); `a` is 64 bytes,
        // 32-aligned (`Block`'s alignment, groups of 64 bytes).
        unsafe {
            X16(
                _mm256_load_ps(a.as_ptr()),
                _mm256_load_ps(a.as_ptr().add(8)),
            )
        }
    }

    /// Every group of `acc` ← `v`'s.
    #[inline(always)]
    fn into_acc(cpu: Cpu, acc: &mut [[f32; GROUP]], v: impl Lanes) {
        for (g, a) in acc.iter_mut().enumerate() {
            let x = v.get(cpu, g, load(cpu, a));
            // SAFETY: the CPU has AVX (a `Cpu` exists); `a` is 64 bytes,
            // 32-aligned (see `load`).
            unsafe {
                _mm256_store_ps(a.as_mut_ptr(), x.0);
                _mm256_store_ps(a.as_mut_ptr().add(8), x.1);
            }
        }
    }

    /// `out` ← `v`'s groups finished and narrowed. First without a bf16
    /// NaN's exact bits (the select per group costs a tenth of the pass);
    /// if some value was a NaN, again with them: the pass only reads its
    /// inputs, so it can be redone.
    #[inline(always)]
    fn into_out<T: Element, const OP: u32>(cpu: Cpu, world: usize, out: &mut [T], v: impl Lanes) {
        if !into_out_as::<T, OP, false>(cpu, world, out, v) {
            into_out_as::<T, OP, true>(cpu, world, out, v);
        }
    }

    /// [`into_out`] with [`narrow`]'s `EXACT`: false if that was not
    /// exact (a NaN lane without it). A last group shorter than [`GROUP`]
    /// (`out`'s length is any) goes through a padded copy.
    #[inline(always)]
    fn into_out_as<T: Element, const OP: u32, const EXACT: bool>(
        cpu: Cpu,
        world: usize,
        out: &mut [T],
        v: impl Lanes,
    ) -> bool {
        let whole = out.len() / GROUP;
        // SAFETY: the CPU has AVX (a `Cpu` exists); no memory access.
        let zero = unsafe { _mm256_set1_ps(0.0) };
        // Never read: only `Old` reads it, which no pass into `out` has.
        let none = X16(zero, zero);
        let mut nan = zero;
        let mut groups = out.chunks_exact_mut(GROUP);
        for (g, d) in (&mut groups).enumerate() {
            if let Ok(d) = d.try_into() {
                let x = finish::<OP>(cpu, v.get(cpu, g, none), world);
                // SAFETY: as above.
                nan = unsafe { _mm256_or_ps(nan, narrow::<T, EXACT>(cpu, x, d)) };
            }
        }
        let tail = groups.into_remainder();
        if !tail.is_empty() {
            let mut pad = [<T as bytemuck::Zeroable>::zeroed(); GROUP];
            let x = finish::<OP>(cpu, v.get(cpu, whole, none), world);
            // SAFETY: as above.
            nan = unsafe { _mm256_or_ps(nan, narrow::<T, EXACT>(cpu, x, &mut pad)) };
            tail.copy_from_slice(&pad[..tail.len()]);
        }
        // SAFETY: as above.
        EXACT || unsafe { _mm256_movemask_ps(nan) } == 0
    }

    /// The accumulator's first `out.len()` values narrowed into `out`, as
    /// a pass's last step but alone (no first operand's rule): the tests'
    /// view of [`narrow`] on values no pass would hand it (signalling
    /// NaNs).
    #[cfg(test)]
    pub(super) fn narrow_only<T: Element>(cpu: Cpu, acc: &Block, out: &mut [T]) {
        into_out::<T, ARX_OP_SUM>(cpu, 1, out, Acc(&acc.0));
    }

    /// [`Kernel::pass`] for one op (a constant: no choice per element).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn pass_op<T: Element, const OP: u32>(
        cpu: Cpu,
        world: usize,
        n: usize,
        first: Option<&Block>,
        next: Option<&Block>,
        acc: &mut Block,
        out: Option<&mut [T]>,
    ) {
        let groups = n.div_ceil(GROUP);
        let acc = &mut acc.0[..groups];
        let a = first.map(|a| Wide(a.groups::<T>(groups)));
        let b = next.map(|b| Wide(b.groups::<T>(groups)));
        let w = world;
        match (a, b, out) {
            (Some(a), Some(b), Some(o)) => into_out::<T, OP>(cpu, w, o, Combine::<_, _, OP>(a, b)),
            (None, Some(b), Some(o)) => {
                into_out::<T, OP>(cpu, w, o, Combine::<_, _, OP>(Acc(acc), b))
            }
            (Some(a), None, Some(o)) => {
                into_out::<T, OP>(cpu, w, o, First::<_, T, OP>(a, PhantomData))
            }
            (None, None, Some(o)) => {
                into_out::<T, OP>(cpu, w, o, First::<_, T, OP>(Acc(acc), PhantomData))
            }
            (Some(a), Some(b), None) => into_acc(cpu, acc, Combine::<_, _, OP>(a, b)),
            (None, Some(b), None) => into_acc(cpu, acc, Combine::<_, _, OP>(Old, b)),
            (Some(a), None, None) => into_acc(cpu, acc, First::<_, T, OP>(a, PhantomData)),
            (None, None, None) => into_acc(cpu, acc, First::<_, T, OP>(Old, PhantomData)),
        }
    }

    impl Kernel for Cpu {
        #[inline(always)]
        fn pass<T: Element>(
            self,
            op: crate::Op,
            world: usize,
            n: usize,
            first: Option<&Block>,
            next: Option<&Block>,
            acc: &mut Block,
            out: Option<&mut [T]>,
        ) {
            use crate::Op;
            let c = self;
            match op {
                Op::Sum => pass_op::<T, ARX_OP_SUM>(c, world, n, first, next, acc, out),
                Op::Max => pass_op::<T, ARX_OP_MAX>(c, world, n, first, next, acc, out),
                Op::Min => pass_op::<T, ARX_OP_MIN>(c, world, n, first, next, acc, out),
                Op::Avg => pass_op::<T, ARX_OP_AVG>(c, world, n, first, next, acc, out),
            }
        }

        #[cfg(test)]
        fn acc_index<T: Element>(self, i: usize) -> usize {
            let (g, j) = (i / GROUP, i % GROUP);
            match T::DTYPE {
                // Even-numbered elements in the first register.
                Dtype::Bf16 => g * GROUP + (j % 2) * 8 + j / 2,
                _ => i,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Scratch {
        /// Blocks full of NaN bits (every dtype's 0xff bytes): a lane of
        /// them reaching an output shows.
        fn dirty() -> Scratch {
            let mut s = Scratch::ZERO;
            for b in &mut s.0 {
                b.bytes_mut(BLOCK * 4).fill(0xff);
            }
            s
        }
    }

    /// The thread's scratch holds whatever the last call left (here: NaN
    /// bits everywhere); a short call after it must not see any of it.
    #[test]
    fn stale_scratch_never_reaches_an_output() {
        fn check<T: Element>() {
            for world in 1..=4 {
                for n in [1, 2, 15, 16, 17, BLOCK - 1, BLOCK + 3] {
                    SCRATCH.with(|s| *s.borrow_mut() = Scratch::dirty());
                    let inputs: Vec<Vec<T>> = (0..world)
                        .map(|r| crate::verify::input::<T>(0x5c7a, 1, r, n))
                        .collect();
                    let bytes: Vec<&[u8]> =
                        inputs.iter().map(|v| bytemuck::cast_slice(v)).collect();
                    for op in crate::Op::ALL {
                        let want = crate::verify::reference_op(op, &inputs);
                        let mut out = vec![T::from_f32(0.0); n];
                        crate::verify::poison(&mut out);
                        reduce_in_rank_order(op, world, from_slices(&bytes), &mut out);
                        let wrong = crate::verify::count_wrong_op(op, &out, &want);
                        assert_eq!(wrong, 0, "{:?} {op:?} world {world} n {n}", T::DTYPE);
                    }
                }
            }
        }
        check::<f32>();
        check::<bf16>();
        check::<f16>();
    }

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

    /// `src` widened by `k`'s passes: a pass with nothing to combine (sum:
    /// the value alone) into the accumulator, a block at a time.
    fn widen_by<T: Element>(k: impl Kernel, src: &[u8], dst: &mut [f32]) {
        let size = std::mem::size_of::<T>();
        let (mut raw, mut acc) = (Block::ZERO, Block::ZERO);
        for (s, d) in src.chunks(BLOCK * size).zip(dst.chunks_mut(BLOCK)) {
            raw.bytes_mut(s.len()).copy_from_slice(s);
            let op = crate::Op::Sum;
            k.pass::<T>(op, 1, d.len(), Some(&raw), None, &mut acc, None);
            let acc = acc.f32s_mut(BLOCK);
            for (i, d) in d.iter_mut().enumerate() {
                *d = acc[k.acc_index::<T>(i)];
            }
        }
    }

    /// `src` narrowed a block at a time by `f(acc, out)`, the block's
    /// values placed in the accumulator in `k`'s order.
    fn narrow_by<T: Element>(
        k: impl Kernel,
        f: impl Fn(&mut Block, &mut [T]),
        src: &[f32],
        dst: &mut [T],
    ) {
        let mut acc = Block::ZERO;
        for (s, d) in src.chunks(BLOCK).zip(dst.chunks_mut(BLOCK)) {
            let a = acc.f32s_mut(BLOCK);
            for (i, s) in s.iter().enumerate() {
                a[k.acc_index::<T>(i)] = *s;
            }
            f(&mut acc, d);
        }
    }

    /// By `k`'s pass from the accumulator with nothing to combine (sum).
    fn narrow_pass<T: Element>(k: impl Kernel, src: &[f32], dst: &mut [T]) {
        let pass = |acc: &mut Block, d: &mut [T]| {
            k.pass(crate::Op::Sum, 1, d.len(), None, None, acc, Some(d));
        };
        narrow_by(k, pass, src, dst);
    }

    /// The conversions under test, by name: `half`'s one-element ones as
    /// arx uses them, the slice conversion on unaligned bytes, and the
    /// passes of every kernel the CPU runs (portable, and AVX2+F16C where
    /// the CPU has it).
    fn widen_paths<T: Element>(src: &[u16]) -> Vec<(&'static str, Vec<f32>)> {
        let bytes: &[u8] = bytemuck::cast_slice(src);
        let run = |f: &dyn Fn(&[u8], &mut [f32])| {
            let mut d = vec![f32::from_bits(0x7fbf_ffff); src.len()];
            f(bytes, &mut d);
            d
        };
        let mut odd = vec![0u8; bytes.len() + 1];
        odd[1..].copy_from_slice(bytes);
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut paths = vec![
            (
                "to_f32",
                run(&|b, d| {
                    for (d, e) in d.iter_mut().zip(b.chunks_exact(2)) {
                        *d = bytemuck::pod_read_unaligned::<T>(e).to_f32();
                    }
                }),
            ),
            ("portable", run(&|b, d| widen_by::<T>(Portable, b, d))),
            ("portable unaligned", run(&|_, d| T::widen(&odd[1..], d))),
        ];
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = avx2::Cpu::detect() {
            paths.push(("avx2+f16c", run(&|b, d| widen_by::<T>(cpu, b, d))));
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
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut paths = vec![
            (
                "from_f32",
                run(&|s, d| {
                    for (d, s) in d.iter_mut().zip(s) {
                        *d = T::from_f32(*s);
                    }
                }),
            ),
            ("portable", run(&|s, d| narrow_pass(Portable, s, d))),
        ];
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = avx2::Cpu::detect() {
            paths.push(("avx2+f16c", run(&|s, d| narrow_pass(cpu, s, d))));
            let alone = |acc: &mut Block, d: &mut [T]| avx2::narrow_only(cpu, acc, d);
            paths.push(("avx2+f16c alone", run(&|s, d| narrow_by(cpu, alone, s, d))));
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
                    reduce_blocks(
                        Portable,
                        op,
                        world,
                        from_slices(&bytes),
                        &mut out,
                        &mut Scratch::dirty(),
                    );
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

    /// Rank `r`'s partial of `n` elements for [`every_path_on_every_length`]:
    /// `verify::input_edges` (NaN on ranks 0 and 1, ±Inf, ±0, subnormals,
    /// sums that overflow or cancel), and at every 7th element a NaN of a
    /// random payload, signalling or quiet, on one rank in turn (the
    /// others keep numbers there).
    fn nan_payload_inputs<T: Element>(world: usize, r: usize, n: usize, seed: u64) -> Vec<T> {
        let mut v = crate::verify::input_edges::<T>(seed, world as u64, r, n);
        let mut x = seed ^ 0x9e37_79b9_7f4a_7c15 ^ n as u64;
        for (i, e) in v.iter_mut().enumerate() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if i % 7 != 3 {
                continue;
            }
            let mine = (i / 7) % world == r;
            let nan = match T::DTYPE {
                Dtype::Bf16 => u32::from(0x7f81 | (x as u16 & 0x807f)),
                Dtype::F16 => u32::from(0x7c01 | (x as u16 & 0x83ff)),
                Dtype::F32 => 0x7f80_0001 | (x as u32 & 0x807f_ffff),
            };
            *e = match (mine, T::DTYPE) {
                (false, _) => crate::verify::round_to(((i % 13) as f32 - 6.0) * 0.75),
                (true, Dtype::F32) => bytemuck::pod_read_unaligned(&nan.to_ne_bytes()),
                (true, _) => bytemuck::pod_read_unaligned(&(nan as u16).to_ne_bytes()),
            };
        }
        v
    }

    /// The element's bits as a u32.
    fn bits32<T: Element>(v: &T) -> u32 {
        let b = bytemuck::bytes_of(v);
        match b.len() {
            2 => u32::from(u16::from_ne_bytes([b[0], b[1]])),
            _ => u32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
        }
    }

    /// Every path (portable; AVX2+F16C where the CPU has it) on every dtype
    /// and op, 1 to 16 ranks, lengths of every tail modulo a group and
    /// across blocks (up to 4 ranks; two lengths beyond), the output slice one element into its buffer (not
    /// aligned as a vector) between two poisoned guards: equals
    /// `verify::reference_op` (sum's NaN: a NaN), the guards stay
    /// untouched, and a sum with one NaN input among numbers is exactly
    /// that NaN made quiet, its payload kept (the widening and rounding
    /// keep it; an add makes it quiet; f32 from one rank is not touched).
    #[test]
    fn every_path_on_every_length() {
        fn check<T: Element>(lengths: &[usize]) {
            let quiet = match T::DTYPE {
                Dtype::Bf16 => 0x0040,
                Dtype::F16 => 0x0200,
                Dtype::F32 => 0x0040_0000,
            };
            type Reduce<T> = Box<dyn Fn(crate::Op, usize, &[&[u8]], &mut [T])>;
            #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
            let mut paths: Vec<(&str, Reduce<T>)> = vec![(
                "portable",
                Box::new(|op, world, b: &[&[u8]], out: &mut [T]| {
                    reduce_blocks(
                        Portable,
                        op,
                        world,
                        from_slices(b),
                        out,
                        &mut Scratch::dirty(),
                    )
                }),
            )];
            #[cfg(target_arch = "x86_64")]
            if let Some(cpu) = avx2::Cpu::detect() {
                paths.push((
                    "avx2+f16c",
                    Box::new(move |op, world, b: &[&[u8]], out: &mut [T]| {
                        // SAFETY: the CPU has AVX2 and F16C (`cpu` exists).
                        unsafe {
                            reduce_avx2(cpu, op, world, from_slices(b), out, &mut Scratch::dirty())
                        }
                    }),
                ));
            }
            for world in 1..=16 {
                // One rank, two, and three or more pass through different
                // steps (see `reduce_blocks`); more ranks only add passes.
                let lengths = if world <= 4 { lengths } else { &[17, 513] };
                for (k, &n) in lengths.iter().enumerate() {
                    let seed = (world * 1000 + k) as u64;
                    let inputs: Vec<Vec<T>> = (0..world)
                        .map(|r| nan_payload_inputs::<T>(world, r, n, seed))
                        .collect();
                    let bytes: Vec<&[u8]> =
                        inputs.iter().map(|v| bytemuck::cast_slice(v)).collect();
                    for op in crate::Op::ALL {
                        let want = crate::verify::reference_op(op, &inputs);
                        for (name, reduce) in &paths {
                            let mut buf = vec![T::from_f32(0.0); n + 2];
                            crate::verify::poison(&mut buf);
                            reduce(op, world, &bytes, &mut buf[1..=n]);
                            let what =
                                format!("{:?} {op} {name}, {world} ranks, {n} elements", T::DTYPE);
                            let guard = bits32(&buf[0]);
                            assert_eq!(guard, bits32(&buf[n + 1]), "{what}: a guard written");
                            assert!(
                                guard == 0xffff || guard == u32::MAX,
                                "{what}: a guard written"
                            );
                            let got = &buf[1..=n];
                            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                                assert_eq!(
                                    crate::verify::count_wrong_op(op, &[*g], &[*w]),
                                    0,
                                    "{what}: element {i}: got {:#x}, want {:#x}",
                                    bits32(g),
                                    bits32(w)
                                );
                            }
                            if op != crate::Op::Sum {
                                continue;
                            }
                            for i in (3..n).step_by(7) {
                                let r = (i / 7) % world;
                                let nan = bits32(&inputs[r][i]);
                                let others_numbers = inputs.iter().enumerate().all(|(q, v)| {
                                    q == r || crate::verify::value_of(&v[i]).is_finite()
                                });
                                // f32 from one rank: no add, no widening.
                                let want = match (world, T::DTYPE) {
                                    (1, Dtype::F32) => nan,
                                    _ => nan | quiet,
                                };
                                if others_numbers {
                                    assert_eq!(
                                        bits32(&got[i]),
                                        want,
                                        "{what}: element {i}, rank {r}'s NaN {nan:#x}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
        let lengths: Vec<usize> = (1..=33).chain([63, 64, 65, 511, 512, 513, 1040]).collect();
        check::<bf16>(&lengths);
        check::<f16>(&lengths);
        check::<f32>(&lengths);
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
