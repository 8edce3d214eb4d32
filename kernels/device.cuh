/*
 * arx device helpers shared by every algorithm's kernel (compiled at run time
 * by NVRTC with the other files of kernels/, no CUDA headers):
 *   - memory operations with explicit scopes (PTX memory model),
 *   - bf16/f16 <-> f32 conversions bit for bit as the Rust `half` crate
 *     (the hardware's round-to-nearest-even plus the crate's NaNs on sm_80
 *     and later, written out before),
 *   - the element types' accumulate/pack helpers (fp32 accumulator),
 *   - failure recording (arx_fail) and the block-uniform ticket helpers.
 */
#ifndef ARX_DEVICE_CUH
#define ARX_DEVICE_CUH

#include "arx_abi.h"

#define ARX_THREADS 256

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

struct __align__(16) vec4 {
    u32 x, y, z, w;
};

/* ------------------------------------------------------------------ */
/* Memory operations with explicit scopes (PTX ISA memory model).       */

__device__ __forceinline__ u64 ld_acquire_sys_u64(const u64 *p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u32 ld_relaxed_sys_u32(const u32 *p) {
    u32 v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_relaxed_sys_u64(u64 *p, u64 v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys_u32(u32 *p, u32 v) {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys_u64(u64 *p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys_u32(u32 *p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_acquire_gpu_u32(const u32 *p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u32 ld_relaxed_gpu_u32(const u32 *p) {
    u32 v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_gpu_u32(u32 *p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 atom_add_acq_rel_gpu(u32 *p, u32 v) {
    u32 old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ u32 atom_cas_acq_rel_gpu(u32 *p, u32 cmp, u32 v) {
    u32 old;
    asm volatile("atom.acq_rel.gpu.global.cas.b32 %0, [%1], %2, %3;"
                 : "=r"(old)
                 : "l"(p), "r"(cmp), "r"(v)
                 : "memory");
    return old;
}
__device__ __forceinline__ u32 atom_exch_relaxed_gpu(u32 *p, u32 v) {
    u32 old;
    asm volatile("atom.relaxed.gpu.global.exch.b32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ u32 atom_or_acq_rel_gpu(u32 *p, u32 v) {
    u32 old;
    asm volatile("atom.acq_rel.gpu.global.or.b32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ void fence_sc_sys() { asm volatile("fence.sc.sys;" ::: "memory"); }
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ u64 globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
/* Peers' partials: written by the NIC or another process, so never trust a
 * cached line (cv: "consider cached system memory lines stale, fetch again"). */
__device__ __forceinline__ vec4 ld_cv_v4(const void *p) {
    vec4 v;
    asm volatile("ld.global.cv.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}
__device__ __forceinline__ u32 ld_cv_u32(const void *p) {
    u32 v;
    asm volatile("ld.global.cv.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u16 ld_cv_u16(const void *p) {
    u16 v;
    asm volatile("ld.global.cv.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return v;
}

/* ------------------------------------------------------------------ */
/* Conversions, bit for bit as the `half` crate (v2) does them.         */

__device__ __forceinline__ float bits_f32(u32 b) { return __int_as_float((int)b); }
__device__ __forceinline__ u32 f32_bits(float f) { return (u32)__float_as_int(f); }

__device__ __forceinline__ float bf16_to_f32(u16 i) {
    if ((i & 0x7FFFu) > 0x7F80u) return bits_f32(((u32)i | 0x0040u) << 16);
    return bits_f32((u32)i << 16);
}

/* The `half` crate's f32 -> bf16, written out (round to nearest even; a
 * NaN keeps its sign and top payload bits and gets the quiet bit). */
__device__ __forceinline__ u16 f32_to_bf16_sw(float v) {
    u32 x = f32_bits(v);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((x >> 16) | 0x0040u);
    const u32 round_bit = 0x00008000u;
    if ((x & round_bit) != 0 && (x & (3 * round_bit - 1)) != 0) return (u16)((x >> 16) + 1);
    return (u16)(x >> 16);
}

/* f16 -> f32 is exact, so the hardware's conversion (cvt.f32.f16: one
 * instruction, subnormals kept without .ftz) gives the crate's bits for
 * every non-NaN; a NaN is rebuilt the crate's way (sign, quiet bit,
 * payload shifted up). */
__device__ __forceinline__ float f16_to_f32(u16 i) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(i));
    if ((i & 0x7FFFu) > 0x7C00u)
        r = bits_f32(((u32)(i & 0x8000u) << 16) | 0x7FC00000u | ((u32)(i & 0x03FFu) << 13));
    return r;
}

/* The `half` crate's f16 -> f32, written out (the reference the tests hold
 * f16_to_f32 against, through arx_convert_check). */
__device__ __forceinline__ float f16_to_f32_sw(u16 i) {
    if ((i & 0x7FFFu) == 0) return bits_f32((u32)i << 16);
    u32 half_sign = (u32)(i & 0x8000u);
    u32 half_exp = (u32)(i & 0x7C00u);
    u32 half_man = (u32)(i & 0x03FFu);
    if (half_exp == 0x7C00u) {
        if (half_man == 0) return bits_f32((half_sign << 16) | 0x7F800000u);
        return bits_f32((half_sign << 16) | 0x7FC00000u | (half_man << 13));
    }
    u32 sign = half_sign << 16;
    int unbiased_exp = ((int)half_exp >> 10) - 15;
    if (half_exp == 0) {
        /* leading zeros of the 16-bit mantissa, minus the 6 non-mantissa bits */
        int e = (__clz((int)half_man) - 16) - 6;
        u32 exp = (u32)(127 - 15 - e) << 23;
        u32 man = (half_man << (14 + e)) & 0x7FFFFFu;
        return bits_f32(sign | exp | man);
    }
    u32 exp = (u32)(unbiased_exp + 127) << 23;
    u32 man = (half_man & 0x03FFu) << 13;
    return bits_f32(sign | exp | man);
}

/* The `half` crate's f32 -> f16, written out (round to nearest even,
 * subnormals and overflow to infinity included). */
__device__ __forceinline__ u16 f32_to_f16_sw(float v) {
    u32 x = f32_bits(v);
    u32 sign = x & 0x80000000u;
    u32 exp = x & 0x7F800000u;
    u32 man = x & 0x007FFFFFu;
    if (exp == 0x7F800000u) {
        u32 nan_bit = man == 0 ? 0u : 0x0200u;
        return (u16)((sign >> 16) | 0x7C00u | nan_bit | (man >> 13));
    }
    u32 half_sign = sign >> 16;
    int unbiased_exp = (int)(exp >> 23) - 127;
    int half_exp = unbiased_exp + 15;
    if (half_exp >= 0x1F) return (u16)(half_sign | 0x7C00u);
    if (half_exp <= 0) {
        if (14 - half_exp > 24) return (u16)half_sign;
        u32 m = man | 0x00800000u;
        u32 half_man = m >> (14 - half_exp);
        u32 round_bit = 1u << (13 - half_exp);
        if ((m & round_bit) != 0 && (m & (3 * round_bit - 1)) != 0) half_man += 1;
        return (u16)(half_sign | half_man);
    }
    u32 he = (u32)half_exp << 10;
    u32 half_man = man >> 13;
    const u32 round_bit = 0x00001000u;
    if ((man & round_bit) != 0 && (man & (3 * round_bit - 1)) != 0)
        return (u16)((half_sign | he | half_man) + 1);
    return (u16)(half_sign | he | half_man);
}

/* Two f32 -> two bf16 (f16), packed with `lo` in the low half, bit for bit
 * as the crate's conversions above: on sm_80 and later the hardware's
 * round-to-nearest-even conversion of both in one instruction
 * (cvt.rn.{bf16x2,f16x2}.f32; no .satfinite, so overflow gives infinity,
 * and no .ftz, so subnormals are kept, as the crate does), then any NaN
 * put back the crate's way (cvt gives the canonical NaN). The written-out
 * conversions take about ten instructions per value, and a one-block
 * call's sum is latency-bound on its few warps: at 8 KB the sum was 2 of
 * the kernel's 5 us on an H200 (scripts/gpu-pair-bisect, docs/GPU.md). */
__device__ __forceinline__ u32 nan_bf16(float v) { return (f32_bits(v) >> 16) | 0x0040u; }
__device__ __forceinline__ u32 nan_f16(float v) {
    u32 x = f32_bits(v);
    return ((x & 0x80000000u) >> 16) | 0x7C00u | 0x0200u | ((x & 0x007FFFFFu) >> 13);
}
__device__ __forceinline__ u32 pack2_bf16(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    if (lo != lo) r = (r & 0xFFFF0000u) | nan_bf16(lo);
    if (hi != hi) r = (r & 0x0000FFFFu) | (nan_bf16(hi) << 16);
    return r;
#else
    return (u32)f32_to_bf16_sw(lo) | ((u32)f32_to_bf16_sw(hi) << 16);
#endif
}
__device__ __forceinline__ u32 pack2_f16(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    if (lo != lo) r = (r & 0xFFFF0000u) | nan_f16(lo);
    if (hi != hi) r = (r & 0x0000FFFFu) | (nan_f16(hi) << 16);
    return r;
#else
    return (u32)f32_to_f16_sw(lo) | ((u32)f32_to_f16_sw(hi) << 16);
#endif
}
__device__ __forceinline__ u16 f32_to_bf16(float v) { return (u16)pack2_bf16(v, v); }
__device__ __forceinline__ u16 f32_to_f16(float v) { return (u16)pack2_f16(v, v); }

/* Element traits: storage type, lanes per 16-byte vector, NaN poison;
 * pack2: two results into one 32-bit word (16-bit types only). */
struct T_bf16 {
    typedef u16 S;
    static __device__ __forceinline__ float load(S s) { return bf16_to_f32(s); }
    static __device__ __forceinline__ S store(float f) { return f32_to_bf16(f); }
    static __device__ __forceinline__ u32 pack2(float lo, float hi) { return pack2_bf16(lo, hi); }
    static __device__ __forceinline__ S poison() { return (S)0x7FC0u; }
};
struct T_f16 {
    typedef u16 S;
    static __device__ __forceinline__ float load(S s) { return f16_to_f32(s); }
    static __device__ __forceinline__ S store(float f) { return f32_to_f16(f); }
    static __device__ __forceinline__ u32 pack2(float lo, float hi) { return pack2_f16(lo, hi); }
    static __device__ __forceinline__ S poison() { return (S)0x7E00u; }
};
struct T_f32 {
    typedef u32 S;
    static __device__ __forceinline__ float load(S s) { return bits_f32(s); }
    static __device__ __forceinline__ S store(float f) { return f32_bits(f); }
    static __device__ __forceinline__ u32 pack2(float lo, float hi) { return 0u; } /* unused */
    static __device__ __forceinline__ S poison() { return 0x7FC00000u; }
};

__device__ __forceinline__ u16 ld_cv_elem(const u16 *p) { return ld_cv_u16(p); }
__device__ __forceinline__ u32 ld_cv_elem(const u32 *p) { return ld_cv_u32(p); }

/* Unpacks a 16-byte vector into f32 lanes and adds it to acc (lane order). */
template <class T>
__device__ __forceinline__ void acc_add(float *acc, vec4 v) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    if (sizeof(typename T::S) == 2) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            acc[2 * k] += T::load((u16)(w[k] & 0xFFFFu));
            acc[2 * k + 1] += T::load((u16)(w[k] >> 16));
        }
    } else {
#pragma unroll
        for (int k = 0; k < 4; k++) acc[k] += T::load(w[k]);
    }
}

template <class T>
__device__ __forceinline__ vec4 acc_pack(const float *acc) {
    vec4 v;
    u32 w[4];
    if (sizeof(typename T::S) == 2) {
#pragma unroll
        for (int k = 0; k < 4; k++)
            w[k] = T::pack2(acc[2 * k], acc[2 * k + 1]);
    } else {
#pragma unroll
        for (int k = 0; k < 4; k++) w[k] = (u32)T::store(acc[k]);
    }
    v.x = w[0];
    v.y = w[1];
    v.z = w[2];
    v.w = w[3];
    return v;
}

/* ------------------------------------------------------------------ */

/* Records the first failure of this GPU side: device copy first (so the
 * other blocks stop at once), then the details and ctrl.status in mapped
 * memory for the host. */
__device__ void arx_fail(arx_ctrl_t *ctrl, arx_gpu_state_t *st, u32 code, u32 peer, u32 lane,
                         u64 seq, u64 flag) {
    if (atom_cas_acq_rel_gpu(&st->status, 0u, code) == 0u) {
        st_relaxed_sys_u32(&ctrl->err_peer, peer);
        st_relaxed_sys_u32(&ctrl->err_lane, lane);
        st_relaxed_sys_u64(&ctrl->err_seq, seq);
        st_relaxed_sys_u64(&ctrl->err_flag, flag);
        st_release_sys_u32(&ctrl->status, code);
    }
}

/* The grid's sticky status, read once for the whole block (uniform). */
__device__ __forceinline__ u32 block_status(arx_gpu_state_t *st, u32 *s_slot) {
    __syncthreads();
    if (threadIdx.x == 0) *s_slot = ld_relaxed_gpu_u32(&st->status);
    __syncthreads();
    return *s_slot;
}

/* Takes the next ticket of `counter` for the whole block. */
__device__ __forceinline__ u32 block_ticket(u32 *counter, u32 *s_slot) {
    __syncthreads();
    if (threadIdx.x == 0) *s_slot = atomicAdd(counter, 1u);
    __syncthreads();
    return *s_slot;
}

/* Length of every shard but the last ones of a `count`-element call over
 * `world` ranks (elements of `esize` bytes): kernels/arx_abi.h "Shards",
 * the rule of src/protocol.rs `shard`. Shard q is elements
 * [min(q*L, count), min((q+1)*L, count)). */
__device__ __forceinline__ u32 shard_len(u32 count, u32 world, u32 esize) {
    if (world == 0) world = 1;
    if (count % world == 0) return count / world;
    u32 a = ARX_LANE_ALIGN / esize;
    if (a == 0) a = 1;
    u32 per = count / world + 1; /* ceil: world does not divide count */
    return (per + a - 1) / a * a;
}

/* The flag word of call `seq` (kernels/arx_abi.h): `fields` are the count
 * field's bits above the element count (ARX_FLAG_MORE, the pattern). */
__device__ __forceinline__ u64 make_flag(u64 seq, u32 op, u32 dtype, u32 count, u32 fields) {
    return ((seq & 0xFFFFFFFFull) << ARX_FLAG_SEQ_SHIFT) |
           ((u64)(op & ARX_FLAG_OP_MASK) << ARX_FLAG_OP_SHIFT) |
           ((u64)(dtype & ARX_FLAG_DTYPE_MASK) << ARX_FLAG_DTYPE_SHIFT) |
           ((u64)(count | fields) & ARX_FLAG_COUNT_MASK);
}

/* Publishes call `seq` for the proxy: its flag word and byte count in the
 * control block's slots of its parity, then ctrl.seq (st.release.sys: the
 * caller has made the partial visible system-wide before). */
__device__ __forceinline__ void publish_call(arx_ctrl_t *ctrl, u64 seq, u64 flag, u64 bytes) {
    const u32 par = (u32)(seq & 1);
    st_relaxed_sys_u64(&ctrl->meta[par], flag);
    st_relaxed_sys_u64(&ctrl->bytes[par], bytes);
    st_release_sys_u64(&ctrl->seq, seq);
}

/* ---- leave: the epilogue every kernel shares ----
 *
 *   if (!depart_last(st, &s_ticket)) return;   every block; the last one on
 *   u32 status = await_sent(...);             copy-engine staging only
 *   if (status != 0) ...NaN over the output... (the kernel's own shape)
 *   close_launch(ctrl, st, last_seq, status);
 */

/* Every block departs; true (uniform) in the last block out only. */
__device__ __forceinline__ bool depart_last(arx_gpu_state_t *st, u32 *s_slot) {
    __syncthreads();
    if (threadIdx.x == 0) {
        /* acq_rel: this block's work before, the last block's after (no
         * separate fence). */
        *s_slot = atom_add_acq_rel_gpu(&st->depart, 1u);
    }
    __syncthreads();
    return *s_slot == gridDim.x - 1;
}

/* Copy-engine staging (`wait`: the launch published up to call `upto`): the
 * host copies the next call's partial into both send slots, so the launch
 * may end only once the proxy has finished reading what it published --
 * also when the call failed (a timeout, a mismatch, an abort): a peer may
 * still complete the call with the data in flight, and the next call's
 * copies, queued behind this kernel, would overwrite it. The proxy
 * advances ctrl.sent past every published seq once its sends completed
 * (or, after a fabric failure, once nothing it posted is outstanding).
 * Bounded like every wait. Returns the grid's status (uniform). */
__device__ u32 await_sent(arx_ctrl_t *ctrl, arx_gpu_state_t *st, bool wait, u64 upto, u32 me) {
    if (threadIdx.x == 0 && wait) {
        const u64 t0 = globaltimer();
        for (;;) {
            if (ld_acquire_sys_u64(&ctrl->sent) >= upto) break;
            if (globaltimer() - t0 > st->timeout_ns) {
                arx_fail(ctrl, st, ARX_STATUS_TIMEOUT, me, 0xFFFFFFFFu, upto, 0);
                break;
            }
        }
    }
    __syncthreads();
    return ld_relaxed_gpu_u32(&st->status);
}

/* The last block out closes the launch: resets every ticket, advances
 * state.seq to `last` (the launch's last call) and, if the launch
 * succeeded, stores ctrl.done. After the kernel's NaN poison. */
__device__ __forceinline__ void close_launch(arx_ctrl_t *ctrl, arx_gpu_state_t *st, u64 last,
                                             u32 status) {
    __syncthreads();
    if (threadIdx.x == 0) {
        st->stage_next = 0;
        st->staged = 0;
        st->sum_next = 0;
        st->reduced = 0;
        st->gather_next = 0;
        st->next_stage_next = 0;
        st->next_staged = 0;
        st->gate = 0;
        st->depart = 0;
        st->seq = last;
        /* No fence: the next launch reads these after this kernel ends
         * (stream order); ctrl.done is informational (watchdog, logs). */
        if (status == 0) st_relaxed_sys_u64(&ctrl->done, last);
    }
}

#endif /* ARX_DEVICE_CUH */
