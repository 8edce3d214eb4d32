/* The C examples' reference, independent of the library: the element
 * formats (fp16 and bf16 conversions written here, round to nearest even),
 * every rank's input derived from a seed, and the expected sum computed the
 * way arx promises it (rank order, fp32 accumulator starting from rank 0's
 * value, rounded once to the element type). C and C++ (allreduce_cuda.cu). */
#ifndef ARX_EXAMPLES_REFERENCE_H
#define ARX_EXAMPLES_REFERENCE_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Element types as arxDataType_t numbers them. */
enum { REF_F32 = 0, REF_F16 = 1, REF_BF16 = 2, REF_TYPES = 3 };

static const char *const ref_type_name[] = {"float32", "float16", "bfloat16"};
static size_t ref_size(int t) { return t == REF_F32 ? 4 : 2; }

static uint32_t ref_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float ref_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static float bf16_to_f32(uint16_t h) { return ref_float((uint32_t)h << 16); }

/* Round to nearest, ties to even; NaN stays NaN (quiet). */
static uint16_t f32_to_bf16(float f) {
    uint32_t u = ref_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) { /* zero or subnormal: man * 2^-24, exact in fp32 */
        float v = (float)man * 0x1p-24f;
        return sign ? -v : v;
    }
    if (exp == 31) return ref_float(sign | 0x7f800000u | (man << 13));
    return ref_float(sign | ((exp + 112u) << 23) | (man << 13));
}

static uint16_t f32_to_f16(float f) {
    uint32_t u = ref_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u); /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520: Inf */
    if (a < 0x38800000u) {                                  /* below 2^-14 */
        /* v * 2^24 is exact; rintf rounds to nearest even. */
        return (uint16_t)(sign | (uint16_t)rintf(ref_float(a) * 0x1p24f));
    }
    uint32_t h = (((a >> 23) - 112u) << 10) | ((a & 0x7fffffu) >> 13);
    uint32_t rest = a & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++; /* a carry into the exponent is right */
    return (uint16_t)(sign | h);
}

/* Element i of a buffer of type t, as fp32 (exact). */
static float ref_load(int t, const void *p, size_t i) {
    if (t == REF_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return t == REF_F16 ? f16_to_f32(h) : bf16_to_f32(h);
}
/* Stores v rounded to type t. */
static void ref_store(int t, void *p, size_t i, float v) {
    if (t == REF_F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = t == REF_F16 ? f32_to_f16(v) : f32_to_bf16(v);
}

static uint64_t ref_mix(uint64_t x) { /* splitmix64 */
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Element i of rank r's input (of `world` ranks) for call `call`: mostly
 * uniform in (-8, 8) with a full mantissa, and at positions chosen by
 * (call, i) alone, the same on every rank, the values that break
 * assumptions: -0.0 on every rank, subnormals of the type, sums that
 * overflow the type, sums that cancel exactly, NaN on rank 0, NaN on the
 * last rank only, -0.0 and +0.0 mixed. */
static float ref_input(int t, uint64_t call, int r, int world, size_t i) {
    uint64_t pick = ref_mix(call * 0x100000001b3ull ^ i) % 32;
    float tiny = t == REF_F32 ? 0x1p-149f : t == REF_F16 ? 0x1p-24f : 0x1p-133f;
    float v;
    switch (pick) {
    case 0: v = -0.0f; break;
    case 1: v = (r % 2 ? -1.0f : 1.0f) * tiny * (float)(1 + r % 3); break;
    case 2: v = t == REF_F16 ? 60000.0f : 3.0e38f; break;
    case 3: v = (world % 2 == 0 || r != world - 1) ? (r % 2 ? -3.0f : 3.0f) : 0.0f; break;
    case 4: v = r == 0 ? NAN : 1.0f; break;
    case 5: v = r % 2 ? 0.0f : -0.0f; break; /* +-0 ties (max +0, min -0) */
    case 6: v = r == world - 1 ? NAN : 2.0f; break; /* NaN after numbers */
    default: {
        uint64_t x = ref_mix(ref_mix(call) ^ ref_mix((uint64_t)r + 0x51ed) ^ i);
        v = ((float)(x >> 40) / (float)(1u << 24) * 2.0f - 1.0f) * 8.0f;
    }
    }
    /* As the type holds it. */
    return t == REF_F32 ? v : t == REF_F16 ? f16_to_f32(f32_to_f16(v)) : bf16_to_f32(f32_to_bf16(v));
}

/* Fills `input` with rank r's input and `expect` with the sum every rank
 * must get, for `count` elements of type t. */
static void ref_fill(int t, uint64_t call, int r, int world, size_t count, void *input, void *expect) {
    for (size_t i = 0; i < count; i++) {
        ref_store(t, input, i, ref_input(t, call, r, world, i));
        float acc = ref_input(t, call, 0, world, i);
        for (int p = 1; p < world; p++) acc += ref_input(t, call, p, world, i);
        ref_store(t, expect, i, acc);
    }
}

/* Elements of `got` that differ from `expect` (bit for bit; where a NaN is
 * expected, any NaN: its payload is not specified); the first in *first. */
static size_t ref_wrong(int t, const void *got, const void *expect, size_t count, size_t *first) {
    size_t sz = ref_size(t), wrong = 0;
    *first = 0;
    for (size_t i = 0; i < count; i++) {
        int ok = isnan(ref_load(t, expect, i))
                     ? isnan(ref_load(t, got, i))
                     : memcmp((const char *)got + i * sz, (const char *)expect + i * sz, sz) == 0;
        if (!ok && wrong++ == 0) *first = i;
    }
    return wrong;
}

/* Operations as arxRedOp_t numbers them. */
enum { REF_SUM = 0, REF_MAX = 2, REF_MIN = 3, REF_AVG = 4 };

/* arx's max/min, written here: IEEE 754-2019 maximum/minimum (any NaN gives
 * the canonical quiet NaN, -0 < +0). */
static float ref_maxmin(int is_max, float a, float b) {
    if (isnan(a) || isnan(b)) return ref_float(0x7fc00000u);
    if (a == b) { /* equal: only the sign of a zero can differ */
        int an = signbit(a) != 0, bn = signbit(b) != 0;
        if (is_max) return (an && bn) ? a : fabsf(a);
        return (an || bn) ? -fabsf(a) : a;
    }
    return (is_max ? a > b : a < b) ? a : b;
}

/* As ref_fill for operation `op`: max/min folded in rank order; avg the
 * fp32 sum divided once in fp32 by the number of ranks (a NaN canonical). */
static void ref_fill_op(int t, int op, uint64_t call, int r, int world, size_t count, void *input,
                        void *expect) {
    if (op == REF_SUM) {
        ref_fill(t, call, r, world, count, input, expect);
        return;
    }
    for (size_t i = 0; i < count; i++) {
        ref_store(t, input, i, ref_input(t, call, r, world, i));
        float acc = ref_input(t, call, 0, world, i);
        if (op != REF_AVG && isnan(acc)) acc = ref_float(0x7fc00000u);
        for (int p = 1; p < world; p++) {
            float v = ref_input(t, call, p, world, i);
            acc = op == REF_AVG ? acc + v : ref_maxmin(op == REF_MAX, acc, v);
        }
        if (op == REF_AVG) {
            acc = acc / (float)world;
            if (isnan(acc)) acc = ref_float(0x7fc00000u);
        }
        ref_store(t, expect, i, acc);
    }
}

/* Elements of `got` whose bits differ from `expect`'s, NaN included (max,
 * min and avg give the canonical NaN); the first in *first. */
static size_t ref_wrong_bits(int t, const void *got, const void *expect, size_t count, size_t *first) {
    size_t sz = ref_size(t), wrong = 0;
    *first = 0;
    for (size_t i = 0; i < count; i++)
        if (memcmp((const char *)got + i * sz, (const char *)expect + i * sz, sz) != 0 && wrong++ == 0)
            *first = i;
    return wrong;
}

static uint64_t ref_digest(const void *p, size_t bytes) { /* FNV-1a */
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < bytes; i++) h = (h ^ ((const uint8_t *)p)[i]) * 0x100000001b3ull;
    return h;
}

/* Poison for outputs before a call: finite in every format, so that a
 * position where NaN is expected is checked too. */
#define REF_POISON 0x7b

#endif
