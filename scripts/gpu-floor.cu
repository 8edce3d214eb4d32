// The cost of each primitive the arx kernel uses, on the GPU it runs on
// (issue 9 item 3: "measure where the time goes first"). Built and run by
// scripts/gpu-floor with nvcc on the GPU machine; needs no arx code.
//
// Every variant is a one-block, 256-thread kernel (what an 8 KB arx call
// launches) touching `host`, mapped pinned host memory (where arx's region
// lives on a discrete GPU), and/or `dev`, device memory. Each is timed as a
// CUDA graph of NODES kernel nodes in a chain, replayed REPS times; the
// printed time is per node (so graph launch is amortised, as in
// allreduce_perf -G 10). Subtract the "empty" row to get a primitive's own
// cost. The graph-node rows add event record / wait nodes the way
// src/device/order.rs captures them.
//
// The ping-pong rows time a flag round trip GPU -> CPU -> GPU inside one
// kernel (a CPU thread answers), the handoff an arx call pays twice.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
#include "gpu-bench.cuh"

// What each variant does, selected by `mode` (one kernel, so every variant
// has the same launch cost and register footprint).
enum {
    EMPTY,          // nothing
    DEV_WRITE,      // 8 KB SM stores to device memory
    HOST_WRITE,     // 8 KB SM stores to host memory, no fence
    HOST_FENCE_ALL, // + fence.sc.sys in every thread (arx today)
    HOST_FENCE_ONE, // + bar.sync, fence.sc.sys in thread 0 only
    HOST_REL_ONE,   // + bar.sync, st.release.sys of a flag by thread 0 (no fence)
    HOST_PUBLISH,   // HOST_FENCE_ALL + arx's publish (2 relaxed + 1 release, sys)
    HOST_PUB_ONE,   // HOST_FENCE_ONE + arx's publish
    HOST_PUB_LEAN,  // bar.sync + thread 0: one st.release.sys (data + flag in one fence)
    FENCE_ONLY,     // fence.sc.sys in thread 0 with nothing written
    ACQ_READ,       // thread 0: one ld.acquire.sys of a host word
    VOL_READ,       // thread 0: one ld.volatile of a host word
    ACQ_READ4,      // thread 0: four dependent ld.acquire.sys (chain)
    HOST_READ8K,    // 8 KB ld.global.cv from host memory (the sum's peer read)
    HOST_READ64K,   // 64 KB ld.global.cv from host memory, one block
    DEV_ATOM,       // thread 0: 6 acq_rel atomics at gpu scope (tickets, depart)
    DEV_FENCE,      // thread 0: __threadfence (gpu scope)
    NMODES
};
static const char *NAMES[NMODES] = {
    "empty", "dev write 8K", "host write 8K", "host write 8K + fence.sc.sys all",
    "host write 8K + fence.sc.sys one", "host write 8K + st.release.sys one",
    "host write 8K + fence all + publish", "host write 8K + fence one + publish",
    "host write 8K + one st.release.sys", "fence.sc.sys, nothing written",
    "1 ld.acquire.sys (host)", "1 ld.volatile (host)", "4 chained ld.acquire.sys (host)",
    "read 8K host ld.cv", "read 64K host ld.cv (1 block)", "6 gpu atomics (thread 0)",
    "__threadfence"};

__global__ void prim(int mode, unsigned char *host, unsigned char *dev, u64 *hflag, u64 *dflag,
                     u64 seq) {
    const u32 t = threadIdx.x;
    const int W = 8192 / 256 / 16; // 16-byte vectors per thread for 8 KB
    v4 val = {t, (u32)seq, 1u, 2u};
    switch (mode) {
    case EMPTY:
        break;
    case DEV_WRITE:
        for (int k = 0; k < W; k++) ((v4 *)dev)[k * 256 + t] = val;
        break;
    case HOST_WRITE:
    case HOST_FENCE_ALL:
    case HOST_FENCE_ONE:
    case HOST_REL_ONE:
    case HOST_PUBLISH:
    case HOST_PUB_ONE:
    case HOST_PUB_LEAN:
        for (int k = 0; k < W; k++) ((v4 *)host)[k * 256 + t] = val;
        if (mode == HOST_FENCE_ALL || mode == HOST_PUBLISH) fence_sc_sys();
        __syncthreads();
        if (t == 0) {
            if (mode == HOST_FENCE_ONE || mode == HOST_PUB_ONE) fence_sc_sys();
            if (mode == HOST_REL_ONE || mode == HOST_PUB_LEAN) st_release_sys(hflag, seq);
            if (mode == HOST_PUBLISH || mode == HOST_PUB_ONE) {
                st_relaxed_sys(hflag + 1, seq);
                st_relaxed_sys(hflag + 2, seq);
                st_release_sys(hflag, seq);
            }
        }
        break;
    case FENCE_ONLY:
        if (t == 0) fence_sc_sys();
        break;
    case ACQ_READ:
        if (t == 0) dflag[0] = ld_acquire_sys(hflag + 8);
        break;
    case VOL_READ:
        if (t == 0) dflag[0] = ld_volatile(hflag + 8);
        break;
    case ACQ_READ4:
        if (t == 0) {
            u64 a = ld_acquire_sys(hflag + 8);
            a = ld_acquire_sys(hflag + 8 + (a & 1));
            a = ld_acquire_sys(hflag + 8 + (a & 1));
            a = ld_acquire_sys(hflag + 8 + (a & 1));
            dflag[0] = a;
        }
        break;
    case HOST_READ8K: {
        v4 acc = {0, 0, 0, 0};
        for (int k = 0; k < W; k++) {
            v4 v = ld_cv(host + 16 * (k * 256 + t));
            acc.x += v.x;
            acc.y ^= v.y;
        }
        ((v4 *)dev)[t] = acc;
        break;
    }
    case HOST_READ64K: {
        v4 acc = {0, 0, 0, 0};
        for (int k = 0; k < 8 * W; k++) {
            v4 v = ld_cv(host + 16 * (k * 256 + t));
            acc.x += v.x;
            acc.y ^= v.y;
        }
        ((v4 *)dev)[t] = acc;
        break;
    }
    case DEV_ATOM:
        if (t == 0) {
            u32 *c = (u32 *)(dflag + 4);
            for (int k = 0; k < 6; k++) {
                [[maybe_unused]] u32 old;
                asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
                             : "=r"(old)
                             : "l"(c + k), "r"(1u)
                             : "memory");
            }
        }
        break;
    case DEV_FENCE:
        if (t == 0) __threadfence();
        break;
    }
}

// Ping-pong: the GPU stores seq into ping (host), the CPU sees it and
// stores seq into pong (host), the GPU polls pong. `vol`: poll with
// ld.volatile (+ fence after) instead of ld.acquire.sys.
__global__ void pingpong(u64 *ping, u64 *pong, int iters, int vol, u64 *out_ns) {
    u64 t0, t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (int i = 1; i <= iters; i++) {
        st_release_sys(ping, (u64)i);
        if (vol) {
            while (ld_volatile(pong) != (u64)i) {
            }
            fence_acqrel_sys();
        } else {
            while (ld_acquire_sys(pong) != (u64)i) {
            }
        }
    }
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    *out_ns = t1 - t0;
}

// Timer reads kept in place around the loads they bracket ("memory").
__device__ __forceinline__ u64 globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}
__device__ __forceinline__ u64 clocks() {
    u64 t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
    return t;
}

// Ping-pong with the poll spread over k poller warps (issue 9 item 3:
// does the flag's detection, on average about one PCIe read round trip
// after the flag lands, shrink when k reads are in flight at once, issued
// rtt/k apart?). Warp 0's lane 0 stores ping and waits in shared memory;
// lane 0 of warps 1..k, from the store's time + (w-1) * stagger SM clocks
// (clock64: one block, one SM, one clock; %globaltimer may tick coarsely), polls
// pong with ld.acquire.sys until it reads the round's value or another
// poller has posted it (fence.acq_rel.cta, then an atomic max in shared
// memory: the handoff arx's block would need). k = 1 is the same poll from
// a warp of its own (the cost of the shared-memory hop). pause_ns: a
// __nanosleep after each read that missed (does a poll's traffic slow the
// CPU's answer?).
__global__ void pingpong_k(u64 *ping, const u64 *pong, int iters, u64 stagger, u32 pause_ns,
                           u64 *out_ns) {
    __shared__ unsigned long long s_seen, s_t;
    __shared__ int s_iter;
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        s_seen = 0;
        s_t = 0;
        s_iter = 0;
    }
    __syncthreads();
    if (lane != 0) return;
    volatile int *iter = &s_iter;
    volatile unsigned long long *seen = &s_seen, *t_store = &s_t;
    if (warp == 0) {
        const u64 t0 = globaltimer();
        for (int i = 1; i <= iters; i++) {
            *t_store = clocks();
            __threadfence_block();
            *iter = i;
            st_release_sys(ping, (u64)i);
            while (*seen < (u64)i) {
            }
            asm volatile("fence.acq_rel.cta;" ::: "memory");
        }
        *out_ns = globaltimer() - t0;
        *iter = iters + 1; // the pollers' stop
        return;
    }
    for (int i = 1; i <= iters; i++) {
        while (*iter < i) {
        }
        if (*iter > iters) return;
        const u64 start = *t_store + (u64)(warp - 1) * stagger;
        while (clocks() < start && *seen < (u64)i) {
        }
        while (*seen < (u64)i) {
            u64 v = ld_acquire_sys(pong);
            if (v >= (u64)i) {
                asm volatile("fence.acq_rel.cta;" ::: "memory");
                atomicMax((unsigned long long *)&s_seen, (unsigned long long)v);
                break;
            }
            if (pause_ns) __nanosleep(pause_ns);
        }
    }
}

// One thread: `n` dependent ld.acquire.sys of a host word (its round
// trip): out[0] in ns, out[1] in SM clocks.
__global__ void read_rtt(const u64 *p, int n, u64 *out) {
    u64 x = 0;
    const u64 t0 = globaltimer();
    const u64 c0 = clocks();
    // (Each address depends on the last value read: the loads are serial.)
    for (int i = 0; i < n; i++) x += ld_acquire_sys(p + (x & 1));
    out[1] = (clocks() - c0) / n;
    out[0] = (globaltimer() - t0) / n;
}

static double time_graph(cudaGraphExec_t ge, cudaStream_t s, int reps) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 5; i++) CK(cudaGraphLaunch(ge, s));
    CK(cudaStreamSynchronize(s));
    std::vector<float> ms;
    for (int r = 0; r < 5; r++) {
        CK(cudaEventRecord(a, s));
        for (int i = 0; i < reps; i++) CK(cudaGraphLaunch(ge, s));
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float m;
        CK(cudaEventElapsedTime(&m, a, b));
        ms.push_back(m);
    }
    std::sort(ms.begin(), ms.end());
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return ms[ms.size() / 2] * 1000.0 / reps; // µs per graph launch, median of 5
}

int main(int argc, char **argv) {
    const int NODES = 10, REPS = 200;
    CK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("# gpu-floor: %s, %d SMs; one block of 256 threads per kernel node; graph of %d "
           "nodes x %d replays, median of 5; us per node\n",
           prop.name, prop.multiProcessorCount, NODES, REPS);
    unsigned char *host, *hdev;
    CK(cudaHostAlloc((void **)&host, 1 << 20, cudaHostAllocMapped | cudaHostAllocPortable));
    memset(host, 1, 1 << 20);
    CK(cudaHostGetDevicePointer((void **)&hdev, host, 0));
    u64 *hflag_h;
    u64 *hflag;
    CK(cudaHostAlloc((void **)&hflag_h, 4096, cudaHostAllocMapped | cudaHostAllocPortable));
    memset(hflag_h, 0, 4096);
    CK(cudaHostGetDevicePointer((void **)&hflag, hflag_h, 0));
    unsigned char *dev;
    CK(cudaMalloc(&dev, 1 << 20));
    u64 *dflag;
    CK(cudaMalloc(&dflag, 4096));
    CK(cudaMemset(dflag, 0, 4096));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

    // Kernel-only variants.
    double empty = 0;
    for (int m = 0; m < NMODES; m++) {
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < NODES; i++) prim<<<1, 256, 0, s>>>(m, hdev, dev, hflag, dflag, i + 1);
        CK(cudaStreamEndCapture(s, &g));
        cudaGraphExec_t ge;
        CK(cudaGraphInstantiate(&ge, g, 0));
        double us = time_graph(ge, s, REPS) / NODES;
        if (m == EMPTY) empty = us;
        printf("kernel  %-40s %7.2f us/node   (+%.2f over empty)\n", NAMES[m], us, us - empty);
        CK(cudaGraphExecDestroy(ge));
        CK(cudaGraphDestroy(g));
    }

    // Graph nodes as src/device/order.rs adds them around each captured call.
    cudaEvent_t last;
    CK(cudaEventCreateWithFlags(&last, cudaEventDisableTiming));
    CK(cudaEventRecord(last, s));
    CK(cudaStreamSynchronize(s));
    for (int variant = 0; variant < 4; variant++) {
        static const char *VN[4] = {"empty kernel", "empty kernel + external record",
                                    "external wait + empty kernel + external record",
                                    "empty kernel, 1 external record at the end"};
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < NODES; i++) {
            if (variant == 2) CK(cudaStreamWaitEvent(s, last, cudaEventWaitExternal));
            prim<<<1, 256, 0, s>>>(EMPTY, hdev, dev, hflag, dflag, i + 1);
            if (variant == 1 || variant == 2 || (variant == 3 && i == NODES - 1))
                CK(cudaEventRecordWithFlags(last, s, cudaEventRecordExternal));
        }
        CK(cudaStreamEndCapture(s, &g));
        cudaGraphExec_t ge;
        CK(cudaGraphInstantiate(&ge, g, 0));
        double us = time_graph(ge, s, REPS) / NODES;
        printf("graph   %-48s %7.2f us/call\n", VN[variant], us);
        CK(cudaGraphExecDestroy(ge));
        CK(cudaGraphDestroy(g));
    }

    // Eager launches: plain, and with a record + wait per call (order.rs).
    for (int variant = 0; variant < 2; variant++) {
        cudaEvent_t a, b;
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
        std::vector<float> res;
        for (int r = 0; r < 5; r++) {
            CK(cudaEventRecord(a, s));
            for (int i = 0; i < 1000; i++) {
                if (variant) CK(cudaStreamWaitEvent(s, last, 0));
                prim<<<1, 256, 0, s>>>(EMPTY, hdev, dev, hflag, dflag, i + 1);
                if (variant) CK(cudaEventRecord(last, s));
            }
            CK(cudaEventRecord(b, s));
            CK(cudaEventSynchronize(b));
            float m;
            CK(cudaEventElapsedTime(&m, a, b));
            res.push_back(m);
        }
        std::sort(res.begin(), res.end());
        printf("eager   %-48s %7.2f us/call (back to back)\n",
               variant ? "empty kernel + wait + record" : "empty kernel", res[2]);
    }

    // Ping-pong with a CPU thread.
    for (int vol = 0; vol < 2; vol++) {
        volatile u64 *ping = hflag_h + 64, *pong = hflag_h + 128;
        *ping = 0;
        *pong = 0;
        const int iters = 20000;
        std::atomic<bool> stop{false};
        std::thread cpu([&] {
            u64 seen = 0;
            while (!stop.load(std::memory_order_relaxed)) {
                u64 v = __atomic_load_n(ping, __ATOMIC_ACQUIRE);
                if (v != seen) {
                    seen = v;
                    __atomic_store_n(pong, v, __ATOMIC_RELEASE);
                    if (v == (u64)iters) break;
                }
            }
        });
        u64 *ns;
        CK(cudaMalloc(&ns, 8));
        pingpong<<<1, 1, 0, s>>>(hflag + 64, hflag + 128, iters, vol, ns);
        CK(cudaStreamSynchronize(s));
        stop = true;
        cpu.join();
        u64 h;
        CK(cudaMemcpy(&h, ns, 8, cudaMemcpyDeviceToHost));
        printf("pingpong GPU->CPU->GPU, poll %-12s %7.2f us/round trip\n",
               vol ? "ld.volatile" : "ld.acquire", h / 1000.0 / iters);
        CK(cudaFree(ns));
    }

    // Ping-pong with k staggered pollers (pingpong_k), rtt/k apart, where
    // rtt is one ld.acquire.sys of host memory measured first.
    {
        u64 *ns;
        CK(cudaMalloc(&ns, 16));
        read_rtt<<<1, 1, 0, s>>>(hflag + 256, 1000, ns);
        CK(cudaStreamSynchronize(s)); // (s does not sync with cudaMemcpy's stream)
        u64 rtt[2];
        CK(cudaMemcpy(rtt, ns, 16, cudaMemcpyDeviceToHost));
        printf("pingpong one ld.acquire.sys of host memory: %.2f us, %llu SM clocks\n",
               rtt[0] / 1000.0, (unsigned long long)rtt[1]);
        // (k, spread, pause): k pollers, all at once (spread 0) or rtt/k
        // apart (1), pausing `pause` ns after a missed read.
        const int cases[][3] = {{1, 0, 0},   {1, 0, 100}, {1, 0, 200}, {1, 0, 400}, {1, 0, 800},
                                {2, 0, 0},   {2, 1, 0},   {3, 0, 0},   {3, 1, 0},   {4, 0, 0},
                                {4, 1, 0},   {8, 0, 0},   {8, 1, 0},   {2, 1, 400}, {4, 1, 800}};
        for (int round = 0; round < 3; round++) {
            for (const auto &c : cases) {
                const int k = c[0], spread = c[1];
                const u32 pause = (u32)c[2];
                volatile u64 *ping = hflag_h + 64, *pong = hflag_h + 128;
                *ping = 0;
                *pong = 0;
                const int iters = 20000;
                std::thread cpu([&] {
                    u64 seen = 0;
                    while (seen != (u64)iters) {
                        u64 v = __atomic_load_n(ping, __ATOMIC_ACQUIRE);
                        if (v != seen) {
                            seen = v;
                            __atomic_store_n(pong, v, __ATOMIC_RELEASE);
                        }
                    }
                });
                // spread 1: rtt/k apart; spread 0: all at once
                const u64 stagger = spread ? rtt[1] / k : 0;
                pingpong_k<<<1, 32 * (k + 1), 0, s>>>(hflag + 64, hflag + 128, iters, stagger,
                                                      pause, ns);
                CK(cudaStreamSynchronize(s));
                cpu.join();
                u64 h;
                CK(cudaMemcpy(&h, ns, 8, cudaMemcpyDeviceToHost));
                printf("pingpong GPU->CPU->GPU, %d poller warp(s), %5llu clocks apart, pause "
                       "%3u ns (round %d) %7.2f us/round trip\n",
                       k, (unsigned long long)stagger, pause, round + 1, h / 1000.0 / iters);
            }
        }
        CK(cudaFree(ns));
    }
    return 0;
}
