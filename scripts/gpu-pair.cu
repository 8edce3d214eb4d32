// arx's own one-shot kernel (kernels/arx.cu, compiled here by nvcc instead
// of NVRTC) driven by a minimal C++ proxy, in one process: how long a small
// call takes with nothing of the library's host side around it. Held
// against allreduce_perf's numbers, it says whether the per-call time sits
// in the kernel and the handoff (here too) or in the library's host side
// (proxy, capture shape; not here).
//
//   nvcc -O3 -std=c++17 -arch=native -o /tmp/gpu-pair scripts/gpu-pair.cu && /tmp/gpu-pair
//
// Rows: 1 rank (no peer: the kernel alone), 2 ranks on two streams of the
// one GPU, each with its own proxy thread doing what the Shm fabric's proxy
// does (kernels/arx_abi.h, step 2: for each published seq, each lane's half
// of send[p] into the peer's recv[p][me], then the flag word; then
// ctrl.sent). Each rank replays a CUDA graph of 10 calls back to back; the
// time is per call, median of 5 runs. bf16, SM staging, one block (what
// arx launches up to 16 KB). The sums are checked against the host.

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
#define GPU_BENCH_CHECK_ONLY
#include "gpu-bench.cuh"

// arx_abi.h's NVRTC branch (its own fixed-width typedefs, which differ
// from <stdint.h>'s), inside a namespace so that they do not clash.
#define __CUDACC_RTC__
namespace arxk {
#include "../kernels/arx.cu"
}
#undef __CUDACC_RTC__
using arxk::u16;
using arxk::u32;
using arxk::u64;
using arxk::arx_params_t;
using arxk::arx_ctrl_t;
using arxk::arx_gpu_state_t;

static const size_t SLOT = 64 << 10;
static const u64 FLAGS_OFF = 4096, SEND_OFF = 8192, RECV_OFF = SEND_OFF + 2 * SLOT;

struct Rank {
    unsigned char *reg_h = nullptr, *reg_d = nullptr;
    arx_gpu_state_t *st = nullptr;
    u16 *in = nullptr, *out = nullptr;
    cudaStream_t s;
    cudaGraphExec_t ge;
    std::thread proxy;
};

static bool g_failed = false;

static float bf(u16 v) {
    u32 b = (u32)v << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}
// f32 -> bf16 -> f32, round to nearest even (finite inputs only).
static float round_bf(float x) {
    u32 b;
    memcpy(&b, &x, 4);
    b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static double run(int world, u32 count, int reps, bool check) {
    std::vector<Rank> R(world);
    const u64 region = RECV_OFF + 2 * (u64)world * SLOT;
    for (int r = 0; r < world; r++) {
        CK(cudaHostAlloc((void **)&R[r].reg_h, region, cudaHostAllocMapped | cudaHostAllocPortable));
        memset(R[r].reg_h, 0, region);
        CK(cudaHostGetDevicePointer((void **)&R[r].reg_d, R[r].reg_h, 0));
        CK(cudaMalloc(&R[r].st, 256));
        CK(cudaMemset(R[r].st, 0, 256));
        u64 tmo = 2000000000ull;
        CK(cudaMemcpy(&R[r].st->timeout_ns, &tmo, 8, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&R[r].in, count * 2));
        CK(cudaMalloc(&R[r].out, count * 2));
        std::vector<u16> h(count);
        for (u32 i = 0; i < count; i++) h[i] = (u16)(0x3f80 + ((i * 7 + r * 13) & 0x3f)); // 1..2
        CK(cudaMemcpy(R[r].in, h.data(), count * 2, cudaMemcpyHostToDevice));
        CK(cudaStreamCreateWithFlags(&R[r].s, cudaStreamNonBlocking));
        arx_params_t p;
        memset(&p, 0, sizeof p);
        p.region = (u64)R[r].reg_d;
        p.state = (u64)R[r].st;
        p.input = (u64)R[r].in;
        p.output = (u64)R[r].out;
        p.layout.ctrl_off = 0;
        p.layout.flags_off = FLAGS_OFF;
        p.layout.send_off = SEND_OFF;
        p.layout.recv_off = RECV_OFF;
        p.layout.slot_bytes = SLOT;
        p.layout.region_bytes = region;
        p.layout.world = world;
        p.layout.rank = r;
        p.count = count;
        p.dtype = ARX_DTYPE_BF16;
        p.sm_staging = 1;
        p.unroll = 2;
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(R[r].s, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < 10; i++) arxk::arx_allreduce_bf16<<<1, ARX_THREADS, 0, R[r].s>>>(p);
        CK(cudaStreamEndCapture(R[r].s, &g));
        CK(cudaGraphInstantiate(&R[r].ge, g, 0));
    }
    std::atomic<bool> stop{false};
    for (int r = 0; r < world; r++) {
        R[r].proxy = std::thread([&, r] {
            arx_ctrl_t *c = (arx_ctrl_t *)R[r].reg_h;
            u64 done = 0;
            while (!stop.load(std::memory_order_relaxed)) {
                u64 s = __atomic_load_n(&c->seq, __ATOMIC_ACQUIRE);
                while (done < s) {
                    done++;
                    u32 par = done & 1;
                    u64 flag = __atomic_load_n(&c->meta[par], __ATOMIC_RELAXED);
                    u64 bytes = __atomic_load_n(&c->bytes[par], __ATOMIC_RELAXED);
                    u64 half = ((bytes + 1) / 2 + 15) / 16 * 16;
                    if (half > bytes) half = bytes;
                    for (int k = 1; k < world; k++) {
                        int q = (r + k) % world;
                        for (int lane = 0; lane < 2; lane++) {
                            u64 a = lane ? half : 0, b = lane ? bytes : half;
                            memcpy(R[q].reg_h + RECV_OFF + ((u64)par * world + r) * SLOT + a,
                                   R[r].reg_h + SEND_OFF + par * SLOT + a, b - a);
                            u64 *fw = (u64 *)(R[q].reg_h + FLAGS_OFF) +
                                      (((u64)par * world + r) * 2 + lane);
                            __atomic_store_n(fw, flag, __ATOMIC_RELEASE);
                        }
                    }
                    __atomic_store_n(&c->sent, done, __ATOMIC_RELEASE);
                }
            }
        });
    }
    std::vector<double> runs;
    for (int k = 0; k < 6; k++) {
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < (k == 0 ? 50 : reps); i++)
            for (int r = 0; r < world; r++) CK(cudaGraphLaunch(R[r].ge, R[r].s));
        CK(cudaDeviceSynchronize());
        auto t1 = std::chrono::steady_clock::now();
        if (k > 0) runs.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / (reps * 10.0));
    }
    stop = true;
    int bad = 0;
    for (int r = 0; r < world; r++) {
        R[r].proxy.join();
        arx_ctrl_t *c = (arx_ctrl_t *)R[r].reg_h;
        if (c->status != 0) {
            printf("rank %d: status %u peer %u\n", r, c->status, c->err_peer);
            bad++;
        }
    }
    if (check) {
        std::vector<std::vector<u16>> in(world, std::vector<u16>(count)), out(world, std::vector<u16>(count));
        for (int r = 0; r < world; r++) {
            CK(cudaMemcpy(in[r].data(), R[r].in, count * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(out[r].data(), R[r].out, count * 2, cudaMemcpyDeviceToHost));
        }
        for (int r = 0; r < world; r++)
            for (u32 i = 0; i < count; i++) {
                float s = 0;
                for (int q = 0; q < world; q++) s += bf(in[q][i]);
                if (bf(out[r][i]) != round_bf(s) && bad < 5) {
                    printf("rank %d elem %u: %g, expected %g\n", r, i, bf(out[r][i]), s);
                    bad++;
                }
            }
    }
    for (int r = 0; r < world; r++) {
        CK(cudaGraphExecDestroy(R[r].ge));
        CK(cudaFreeHost(R[r].reg_h));
        CK(cudaFree(R[r].st));
        CK(cudaFree(R[r].in));
        CK(cudaFree(R[r].out));
        CK(cudaStreamDestroy(R[r].s));
    }
    std::sort(runs.begin(), runs.end());
    if (bad) {
        printf("WRONG or FAILED (%d)\n", bad);
        g_failed = true;
    }
    return runs[runs.size() / 2];
}

// argv: [largest world (default 2)] [check: 1 (default) or 0]
int main(int argc, char **argv) {
    const int maxw = argc > 1 ? atoi(argv[1]) : 2;
    const bool check = argc > 2 ? atoi(argv[2]) != 0 : true;
    CK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("# gpu-pair: %s; arx's one-shot kernel, bf16, one block, graph of 10 calls per "
           "replay, back to back; us per call, median of 5 runs\n",
           prop.name);
    const u32 counts[] = {4096, 8192}; // 8 KB, 16 KB
    for (u32 n : counts)
        for (int world = 1; world <= maxw; world++)
            printf("%2u KB  %d rank%s  %6.2f us\n", n * 2 / 1024, world, world > 1 ? "s" : " ",
                   run(world, n, 2000, check));
    return g_failed ? 1 : 0;
}
