/*
 * arx kernels, compiled at run time by NVRTC (src/device/gpu.rs) with the
 * headers beside this file; no CUDA headers are needed.
 *
 *   arx_abi.h     the ABI shared with Rust (region layout, flag word, control
 *                 block, device state, kernel parameters)
 *   device.cuh    memory operations, conversions, accumulate/pack, failure
 *                 recording, block tickets
 *   oneshot.cuh   the one-shot all-reduce (and the wait and the rank-order
 *                 reduction every algorithm shares)
 *   twoshot.cuh   the two-shot all-reduce, reduce_scatter and all_gather
 *   bcast.cuh     broadcast
 *
 * This file holds only the entry points (one per algorithm and dtype) and
 * the conversion test hook.
 */
#include "twoshot.cuh"
#include "bcast.cuh"

extern "C" __global__ void __launch_bounds__(ARX_THREADS, 2) arx_allreduce_bf16(arx_params_t p) {
    oneshot_run<T_bf16>(p);
}
extern "C" __global__ void __launch_bounds__(ARX_THREADS, 2) arx_allreduce_f16(arx_params_t p) {
    oneshot_run<T_f16>(p);
}
extern "C" __global__ void __launch_bounds__(ARX_THREADS, 2) arx_allreduce_f32(arx_params_t p) {
    oneshot_run<T_f32>(p);
}

/* kind: ARX_COLL_* (twoshot.cuh); strides in elements. */
extern "C" __global__ void __launch_bounds__(ARX_THREADS, 2)
    arx_collective_bf16(arx_params_t p, u32 kind, u64 in_stride, u64 out_stride) {
    collective_run<T_bf16>(p, kind, in_stride, out_stride);
}
extern "C" __global__ void __launch_bounds__(ARX_THREADS, 2)
    arx_collective_f16(arx_params_t p, u32 kind, u64 in_stride, u64 out_stride) {
    collective_run<T_f16>(p, kind, in_stride, out_stride);
}
extern "C" __global__ void __launch_bounds__(ARX_THREADS, 2)
    arx_collective_f32(arx_params_t p, u32 kind, u64 in_stride, u64 out_stride) {
    collective_run<T_f32>(p, kind, in_stride, out_stride);
}

/* root: the broadcast's root rank. */
extern "C" __global__ void __launch_bounds__(ARX_THREADS, 2) arx_broadcast_bf16(arx_params_t p, u32 root) {
    bcast_run<T_bf16>(p, root);
}
extern "C" __global__ void __launch_bounds__(ARX_THREADS, 2) arx_broadcast_f16(arx_params_t p, u32 root) {
    bcast_run<T_f16>(p, root);
}
extern "C" __global__ void __launch_bounds__(ARX_THREADS, 2) arx_broadcast_f32(arx_params_t p, u32 root) {
    bcast_run<T_f32>(p, root);
}

/* Test hook: converts n f32 bit patterns to bf16 and f16 with the kernels'
 * own conversions, and back, so the tests can compare them with `half`. */
extern "C" __global__ void arx_convert_check(const u32 *in, u16 *bf, u16 *hf, u32 *bf_back,
                                             u32 *hf_back, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {
        float f = bits_f32(in[i]);
        /* Each pattern goes through one of the paths, by i % 4: the packed
         * conversion's low half (0) or high half (1), its partner being the
         * next or previous pattern; the written-out conversion (2, 3: what
         * a GPU before sm_80 runs). */
        float g = bits_f32(in[(i ^ 1) < n ? (i ^ 1) : i]);
        const u32 path = (u32)(i & 3);
        if (path == 0) {
            bf[i] = (u16)pack2_bf16(f, g);
            hf[i] = (u16)pack2_f16(f, g);
        } else if (path == 1) {
            bf[i] = (u16)(pack2_bf16(g, f) >> 16);
            hf[i] = (u16)(pack2_f16(g, f) >> 16);
        } else {
            bf[i] = f32_to_bf16_sw(f);
            hf[i] = f32_to_f16_sw(f);
        }
        bf_back[i] = f32_bits(bf16_to_f32((u16)in[i]));
        hf_back[i] = f32_bits(path < 2 ? f16_to_f32((u16)in[i]) : f16_to_f32_sw((u16)in[i]));
    }
}
