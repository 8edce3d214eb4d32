// Flag-then-data against data-and-flag lines (NCCL's LL), on the GPU arx
// runs on: one rank's critical path of a small one-shot call, looped back
// through a CPU "proxy" thread (issue 9 item 3: measure before building).
// Needs no arx code; built with nvcc on the GPU machine:
//
//   nvcc -O3 -std=c++17 -arch=native -o /tmp/gpu-lines scripts/gpu-lines.cu && /tmp/gpu-lines
//
// One block of 256 threads loops ITERS calls inside one kernel. Per call:
// it stages a B-byte partial into `send` (mapped pinned host memory, as
// arx's region on a discrete GPU), publishes seq with one st.release.sys;
// the CPU thread sees it, copies `send` into `recv` and stores the flag
// (release); the block waits, reads `recv`, adds its own partial and
// writes the sum to device memory.
//
//   flags:  the partial as is; thread 0 polls the flag (ld.acquire.sys),
//           barrier, then every thread reads its part of `recv` (ld.cv):
//           what arx's one-block path does (two PCIe round trips after
//           the flag lands: the flag's, then the data's).
//   lines:  every 8-byte word is 4 bytes of data and the 4-byte seq (so
//           2B bytes travel); every thread polls its own lines with
//           ld.volatile.v4 until each word carries seq, thread 0 also the
//           flag word in the same loop (arx would keep it, to detect a peer
//           that called with another count); the CPU copies with aligned
//           8-byte stores (a word is never seen half-written).
//   lines-noflag: lines without the flag poll (what the flag costs).
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
#include "gpu-bench.cuh"

__device__ __forceinline__ float f(u32 b) { return __int_as_float((int)b); }
__device__ __forceinline__ u32 b(float x) { return (u32)__float_as_int(x); }

enum { FLAGS, LINES, LINES_NOFLAG, LINES_MEMCPY, LINES_AFTERFLAG, LINES_BACKOFF, NMODES };
static const char *MODE[NMODES] = {"flags", "lines", "lines-noflag", "lines-memcpy",
                                   "lines-afterflag", "lines-backoff"};

// NV: 16-byte payload vectors per thread (B = NV * 256 * 16).
template <int NV>
__global__ void xchg(int mode, int iters, const v4 *in, v4 *send, const v4 *recv, u64 *seqw,
                     const u64 *flag, v4 *out, u64 *ns, u32 *bad) {
    const u32 t = threadIdx.x;
    u64 t0, t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    u32 wrong = 0;
    for (int i = 1; i <= iters; i++) {
        const u32 tag = (u32)i;
        v4 x[NV];
#pragma unroll
        for (int k = 0; k < NV; k++) {
            x[k] = in[k * 256 + t];
            x[k].x += (u32)i; // a different partial per call
        }
        v4 y[NV];
        if (mode == FLAGS) {
#pragma unroll
            for (int k = 0; k < NV; k++) send[k * 256 + t] = x[k];
            __syncthreads();
            if (t == 0) {
                st_release_sys(seqw, (u64)i);
                while (ld_acquire_sys(flag) != (u64)i) {
                }
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < NV; k++) y[k] = ld_cv(recv + k * 256 + t);
        } else {
#pragma unroll
            for (int k = 0; k < NV; k++) {
                // A warp's store covers 512 contiguous bytes (whole lines
                // of host memory: partial-line PCIe writes are slow).
                send[k * 512 + t] = v4{x[k].x, tag, x[k].y, tag};
                send[k * 512 + 256 + t] = v4{x[k].z, tag, x[k].w, tag};
            }
            __syncthreads();
            if (t == 0) st_release_sys(seqw, (u64)i);
            if (mode == LINES_AFTERFLAG) {
                if (t == 0)
                    while (ld_acquire_sys(flag) != (u64)i) {
                    }
                __syncthreads();
            }
            u32 done = 0; // bit k: line pair k valid
            bool fl = mode != LINES && mode != LINES_MEMCPY && mode != LINES_BACKOFF ? true : t != 0;
            for (;;) {
                v4 a[NV], c[NV];
#pragma unroll
                for (int k = 0; k < NV; k++) {
                    if (!((done >> k) & 1)) {
                        a[k] = ld_vol(recv + k * 512 + t);
                        c[k] = ld_vol(recv + k * 512 + 256 + t);
                    }
                }
                u64 fw = fl ? 0 : ld_acquire_sys(flag);
#pragma unroll
                for (int k = 0; k < NV; k++) {
                    if (!((done >> k) & 1) && a[k].y == tag && a[k].w == tag && c[k].y == tag &&
                        c[k].w == tag) {
                        y[k] = v4{a[k].x, a[k].z, c[k].x, c[k].z};
                        done |= 1u << k;
                    }
                }
                if (!fl && fw == (u64)i) fl = true;
                if (fl && done == (1u << NV) - 1) break;
                if (mode == LINES_BACKOFF) __nanosleep(500);
            }
            __syncthreads();
        }
#pragma unroll
        for (int k = 0; k < NV; k++) {
            if (y[k].x != x[k].x || y[k].w != x[k].w) wrong++;
            out[k * 256 + t] = v4{b(f(x[k].x) + f(y[k].x)), b(f(x[k].y) + f(y[k].y)),
                                  b(f(x[k].z) + f(y[k].z)), b(f(x[k].w) + f(y[k].w))};
        }
        __syncthreads(); // the next call's staging overwrites send
    }
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    if (t == 0) *ns = t1 - t0;
    if (wrong) atomicAdd(bad, wrong);
}

template <int NV>
static double run(int mode, int iters, unsigned char *send_h, unsigned char *recv_h, v4 *send_d,
                  v4 *recv_d, u64 *ctl_h, u64 *ctl_d, const v4 *in, v4 *out, u64 *ns, u32 *bad,
                  cudaStream_t s, u32 *wrong_out) {
    const size_t B = (size_t)NV * 256 * 16;
    const size_t moved = mode == FLAGS ? B : 2 * B;
    memset(recv_h, 0, 2 * B);
    u64 *seqw_h = ctl_h, *flag_h = ctl_h + 16;
    __atomic_store_n(seqw_h, 0, __ATOMIC_RELAXED);
    __atomic_store_n(flag_h, 0, __ATOMIC_RELAXED);
    CK(cudaMemset(bad, 0, 4));
    std::thread cpu([&] {
        u64 seen = 0;
        while (seen < (u64)iters) {
            u64 v = __atomic_load_n(seqw_h, __ATOMIC_ACQUIRE);
            if (v == seen) continue;
            seen = v;
            if (mode == FLAGS || mode == LINES_MEMCPY) {
                memcpy(recv_h, send_h, moved);
            } else {
                const u64 *src = (const u64 *)send_h;
                u64 *dst = (u64 *)recv_h;
                for (size_t w = 0; w < moved / 8; w++)
                    __atomic_store_n(dst + w, src[w], __ATOMIC_RELAXED);
            }
            __atomic_store_n(flag_h, v, __ATOMIC_RELEASE);
        }
    });
    xchg<NV><<<1, 256, 0, s>>>(mode, iters, in, send_d, recv_d, ctl_d, ctl_d + 16, out, ns, bad);
    CK(cudaStreamSynchronize(s));
    cpu.join();
    u64 h;
    CK(cudaMemcpy(&h, ns, 8, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(wrong_out, bad, 4, cudaMemcpyDeviceToHost));
    return h / 1000.0 / iters;
}

int main() {
    const int ITERS = 20000, ROUNDS = 5;
    CK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("# gpu-lines: %s; one block of 256 threads, %d calls per kernel, %d alternated "
           "rounds; us per call: median [min-max]\n",
           prop.name, ITERS, ROUNDS);
    const size_t CAP = 64 << 10;
    unsigned char *send_h, *recv_h;
    u64 *ctl_h;
    CK(cudaHostAlloc((void **)&send_h, CAP, cudaHostAllocMapped | cudaHostAllocPortable));
    CK(cudaHostAlloc((void **)&recv_h, CAP, cudaHostAllocMapped | cudaHostAllocPortable));
    CK(cudaHostAlloc((void **)&ctl_h, 4096, cudaHostAllocMapped | cudaHostAllocPortable));
    memset(ctl_h, 0, 4096);
    v4 *send_d, *recv_d;
    u64 *ctl_d;
    CK(cudaHostGetDevicePointer((void **)&send_d, send_h, 0));
    CK(cudaHostGetDevicePointer((void **)&recv_d, recv_h, 0));
    CK(cudaHostGetDevicePointer((void **)&ctl_d, ctl_h, 0));
    v4 *in, *out;
    CK(cudaMalloc(&in, CAP));
    CK(cudaMalloc(&out, CAP));
    std::vector<u32> seed(CAP / 4);
    for (size_t k = 0; k < seed.size(); k++) seed[k] = (u32)(k * 2654435761u) & 0x3f7fffffu;
    CK(cudaMemcpy(in, seed.data(), CAP, cudaMemcpyHostToDevice));
    u64 *ns;
    u32 *bad;
    CK(cudaMalloc(&ns, 8));
    CK(cudaMalloc(&bad, 4));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const int SIZES[] = {1, 2, 4}; // NV: 4, 8, 16 KB
    int rc = 0;
    for (int nv : SIZES) {
        std::vector<double> t[NMODES];
        for (int r = 0; r < ROUNDS; r++) {
            for (int m = 0; m < NMODES; m++) {
                u32 w = 0;
                double us = 0;
                if (nv == 1)
                    us = run<1>(m, ITERS, send_h, recv_h, send_d, recv_d, ctl_h, ctl_d, in, out,
                                ns, bad, s, &w);
                else if (nv == 2)
                    us = run<2>(m, ITERS, send_h, recv_h, send_d, recv_d, ctl_h, ctl_d, in, out,
                                ns, bad, s, &w);
                else
                    us = run<4>(m, ITERS, send_h, recv_h, send_d, recv_d, ctl_h, ctl_d, in, out,
                                ns, bad, s, &w);
                if (w) {
                    printf("WRONG: %s %d KB round %d: %u vectors\n", MODE[m], nv * 4, r, w);
                    rc = 1;
                }
                t[m].push_back(us);
            }
        }
        for (int m = 0; m < NMODES; m++) {
            std::vector<double> v = t[m];
            std::sort(v.begin(), v.end());
            printf("%2d KB  %-13s %6.2f [%.2f-%.2f]\n", nv * 4, MODE[m], v[v.size() / 2], v[0],
                   v.back());
        }
    }
    return rc;
}
