/* arx's C ABI on device buffers, checking itself: eager calls on a CUDA
 * stream (all-reduce, reduce-scatter, all-gather, broadcast), then CUDA
 * graphs that capture arxAllReduce, replayed many times.
 * scripts/gpu-c-example builds and runs it (several ranks on one GPU need
 * MPS):
 *
 *   cd examples/c       # reference.h is beside this file
 *   nvcc -O2 -std=c++17 $(pkg-config --cflags arx) \
 *        $(for d in $(mpicxx --showme:incdirs); do echo -I$d; done) \
 *        -c allreduce_cuda.cu -o allreduce_cuda.o
 *   mpicxx allreduce_cuda.o -o allreduce_cuda $(pkg-config --libs arx) \
 *        -Wl,-rpath,$HOME/arx/lib -L$CUDA/lib64 -lcudart -Wl,-rpath,$CUDA/lib64
 *   mpirun -n 2 ./allreduce_cuda
 *
 * (compiled by nvcc, linked by mpicxx: nvcc refuses some of MPI's host
 * flags; $HOME/arx is the scripts/install prefix, $CUDA the toolkit's
 * directory, e.g. /usr/local/cuda).
 *
 * Every rank derives every rank's input from a seed and computes the
 * expected sum on the host itself (reference.h: rank order, fp32
 * accumulator, its own fp16/bf16 conversions); outputs are poisoned before
 * each call (and inside each graph) and every rank's result bits are
 * compared. Each replay of a graph gets new inputs, so a replay that moved
 * no data would be seen. Then a call whose count differs on one rank: the
 * kernel records it, and arxCommGetAsyncError on every rank reports
 * arxMismatch, well before the call timeout. Prints PASS or FAIL on rank 0
 * and exits non-zero on any failure. */
/* MPI's C API only (Open MPI's and MPICH's deprecated C++ bindings draw
 * warnings from newer compilers). */
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <cuda_runtime.h>
#include <arx.h> /* after cuda_runtime.h: its cudaStream_t is the one used */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference.h"

static int rank, world;
static long checks, failures;

#define CHECK(cond, ...)                                                    \
    do {                                                                    \
        checks++;                                                           \
        if (!(cond)) {                                                      \
            if (++failures <= 20) { /* the first few say enough */        \
                fprintf(stderr, "rank %d: FAIL line %d: ", rank, __LINE__); \
                fprintf(stderr, __VA_ARGS__);                               \
                fputc('\n', stderr);                                        \
            }                                                               \
        }                                                                   \
    } while (0)

/* A CUDA runtime failure ends the run (on every rank: MPI_Abort). */
#define CUDA(call)                                                          \
    do {                                                                    \
        cudaError_t e_ = (call);                                            \
        if (e_ != cudaSuccess) {                                            \
            fprintf(stderr, "rank %d: FAIL line %d: %s: %s\n", rank, __LINE__, #call, \
                    cudaGetErrorString(e_));                                \
            MPI_Abort(MPI_COMM_WORLD, 1);                                   \
        }                                                                   \
    } while (0)

static void same_on_every_rank(const void *p, size_t bytes, const char *what) {
    uint64_t mine = ref_digest(p, bytes);
    uint64_t *all = (uint64_t *)malloc(sizeof(uint64_t) * (size_t)world);
    MPI_Allgather(&mine, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, MPI_COMM_WORLD);
    for (int r = 0; r < world; r++)
        CHECK(all[r] == all[0], "%s: rank %d's result differs from rank 0's", what, r);
    free(all);
}

static void check_result(int t, const void *got, const void *expect, size_t count, const char *what) {
    size_t first, wrong = ref_wrong(t, got, expect, count, &first);
    CHECK(wrong == 0, "%s: %zu wrong elements, first at %zu: got %a, expected %a", what, wrong,
          first, (double)ref_load(t, got, first), (double)ref_load(t, expect, first));
    same_on_every_rank(got, count * ref_size(t), what);
}

/* Device buffers of the largest call, host buffers (pinned: graphs copy
 * from and to them) and a stream. */
struct Bufs {
    void *dsend, *drecv;
    unsigned char *hsend, *hrecv, *expect;
    size_t cap;
    cudaStream_t s;
};

/* One eager call on the stream, out of place or in place. */
static void eager(arxComm_t comm, Bufs *b, int t, size_t count, int in_place, uint64_t call) {
    size_t bytes = count * ref_size(t);
    ref_fill(t, call, rank, world, count, b->hsend, b->expect);
    void *out = in_place ? b->dsend : b->drecv;
    CUDA(cudaMemcpyAsync(b->dsend, b->hsend, bytes, cudaMemcpyHostToDevice, b->s));
    if (!in_place) CUDA(cudaMemsetAsync(b->drecv, REF_POISON, bytes, b->s));
    arxResult_t r = arxAllReduce(b->dsend, out, count, (arxDataType_t)t, arxSum, comm, b->s);
    char what[96];
    snprintf(what, sizeof what, "eager %s x %zu %s (call %llu)", ref_type_name[t], count,
             in_place ? "in place" : "out of place", (unsigned long long)call);
    CHECK(r == arxSuccess, "%s: %s: %s", what, arxGetErrorString(r), arxGetLastError(comm));
    memset(b->hrecv, REF_POISON, bytes);
    CUDA(cudaMemcpyAsync(b->hrecv, out, bytes, cudaMemcpyDeviceToHost, b->s));
    CUDA(cudaStreamSynchronize(b->s));
    check_result(t, b->hrecv, b->expect, count, what);
    if (!in_place) {
        /* sendbuff unchanged */
        CUDA(cudaMemcpy(b->hrecv, b->dsend, bytes, cudaMemcpyDeviceToHost));
        CHECK(memcmp(b->hrecv, b->hsend, bytes) == 0, "%s: sendbuff was changed", what);
    }
}

/* A graph of: input H2D, poison the output, arxAllReduce, output D2H,
 * captured in `mode`; replayed `replays` times with new inputs each time,
 * every result checked. */
static void graph(arxComm_t comm, Bufs *b, int t, size_t count, int in_place, int replays,
                  cudaStreamCaptureMode mode, uint64_t *call) {
    size_t bytes = count * ref_size(t);
    void *out = in_place ? b->dsend : b->drecv;
    cudaGraph_t g;
    cudaGraphExec_t exec;
    CUDA(cudaStreamBeginCapture(b->s, mode));
    CUDA(cudaMemcpyAsync(b->dsend, b->hsend, bytes, cudaMemcpyHostToDevice, b->s));
    if (!in_place) CUDA(cudaMemsetAsync(b->drecv, REF_POISON, bytes, b->s));
    arxResult_t r = arxAllReduce(b->dsend, out, count, (arxDataType_t)t, arxSum, comm, b->s);
    CUDA(cudaMemcpyAsync(b->hrecv, out, bytes, cudaMemcpyDeviceToHost, b->s));
    CUDA(cudaStreamEndCapture(b->s, &g));
    CHECK(r == arxSuccess, "capturing arxAllReduce: %s: %s", arxGetErrorString(r), arxGetLastError(comm));
    CUDA(cudaGraphInstantiate(&exec, g, 0));
    char what[128];
    for (int k = 0; k < replays; k++) {
        uint64_t c = (*call)++;
        ref_fill(t, c, rank, world, count, b->hsend, b->expect);
        memset(b->hrecv, REF_POISON, bytes);
        CUDA(cudaGraphLaunch(exec, b->s));
        CUDA(cudaStreamSynchronize(b->s));
        snprintf(what, sizeof what, "graph %s x %zu %s, replay %d of %d (call %llu)", ref_type_name[t],
                 count, in_place ? "in place" : "out of place", k + 1, replays, (unsigned long long)c);
        /* Every rank replays as often: check_result is collective. */
        check_result(t, b->hrecv, b->expect, count, what);
    }
    arxResult_t async = arxInternalError;
    r = arxCommGetAsyncError(comm, &async);
    CHECK(r == arxSuccess && async == arxSuccess, "after the replays: %d, %d: %s", r, async, arxGetLastError(comm));
    CUDA(cudaGraphExecDestroy(exec));
    CUDA(cudaGraphDestroy(g));
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    const int last = world - 1;

    /* The node-local rank picks the GPU; arx is told the same one. */
    MPI_Comm node;
    int local = 0, devices = 0;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local);
    MPI_Comm_free(&node);
    CUDA(cudaGetDeviceCount(&devices));
    int dev = local % devices;
    CUDA(cudaSetDevice(dev));
    CUDA(cudaFree(0)); /* the primary context, which arx shares */

    arxConfig_t config = ARX_CONFIG_INITIALIZER;
    config.device = arxDeviceGpu;
    config.cudaDevice = dev;
    config.timeoutMs = 20000;
    arxComm_t comm = NULL;
    arxResult_t r = arxCommInit(&comm, MPI_COMM_WORLD, &config);
    if (r != arxSuccess) {
        fprintf(stderr, "rank %d: FAIL: arxCommInit: %s: %s\n", rank, arxGetErrorString(r), arxGetLastError(NULL));
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (rank == 0) printf("allreduce_cuda: %d ranks, rank 0 on CUDA device %d of %d\n", world, dev, devices);

    Bufs b;
    b.cap = 1u << 20; /* the default slot */
    CUDA(cudaMalloc(&b.dsend, b.cap));
    CUDA(cudaMalloc(&b.drecv, b.cap));
    CUDA(cudaMallocHost((void **)&b.hsend, b.cap));
    CUDA(cudaMallocHost((void **)&b.hrecv, b.cap));
    b.expect = (unsigned char *)malloc(b.cap);
    CUDA(cudaStreamCreateWithFlags(&b.s, cudaStreamNonBlocking));

    /* Eager calls: every type, sizes up to the whole slot, out of place
     * and in place. */
    const size_t counts[] = {1, 3, 1000, 4099, 65536, 0 /* the whole slot */};
    uint64_t call = 1;
    for (int t = REF_F32; t < REF_TYPES; t++)
        for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
            size_t count = counts[k] ? counts[k] : b.cap / ref_size(t);
            eager(comm, &b, t, count, 0, call++);
            eager(comm, &b, t, count, 1, call++);
        }
    /* A host call on a GPU comm works too (it synchronizes the GPU first). */
    {
        size_t count = 777;
        ref_fill(REF_BF16, call++, rank, world, count, b.hsend, b.expect);
        memset(b.hrecv, REF_POISON, count * 2);
        r = arxAllReduceHost(b.hsend, b.hrecv, count, arxBfloat16, arxSum, comm);
        CHECK(r == arxSuccess, "host call on a GPU comm: %s", arxGetLastError(comm));
        check_result(REF_BF16, b.hrecv, b.expect, count, "host call on a GPU comm");
    }

    /* Reduce-scatter and all-gather on device memory, every type, out of
     * place and in place (NCCL's placement), chunked at the largest n. */
    for (int t = REF_F32; t < REF_TYPES; t++) {
        const size_t ns[] = {1, 1000, b.cap / ref_size(t) / (size_t)world};
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            size_t n = ns[k], es = ref_size(t), all = n * (size_t)world;
            unsigned char *tmp = (unsigned char *)malloc(all * es);
            for (int in_place = 0; in_place < 2; in_place++) {
                char what[96];
                snprintf(what, sizeof what, "reduce_scatter %s x %zu per rank %s", ref_type_name[t], n,
                         in_place ? "in place" : "out of place");
                ref_fill(t, call++, rank, world, all, b.hsend, b.expect);
                CUDA(cudaMemcpyAsync(b.dsend, b.hsend, all * es, cudaMemcpyHostToDevice, b.s));
                void *out = in_place ? (void *)((char *)b.dsend + (size_t)rank * n * es) : b.drecv;
                if (!in_place) CUDA(cudaMemsetAsync(b.drecv, REF_POISON, n * es, b.s));
                r = arxReduceScatter(b.dsend, out, n, (arxDataType_t)t, arxSum, comm, b.s);
                CHECK(r == arxSuccess, "%s: %s", what, arxGetLastError(comm));
                memset(b.hrecv, REF_POISON, n * es);
                CUDA(cudaMemcpyAsync(b.hrecv, out, n * es, cudaMemcpyDeviceToHost, b.s));
                CUDA(cudaStreamSynchronize(b.s));
                size_t first, wrong = ref_wrong(t, b.hrecv, b.expect + (size_t)rank * n * es, n, &first);
                CHECK(wrong == 0, "%s: %zu wrong, first at %zu", what, wrong, first);

                snprintf(what, sizeof what, "all_gather %s x %zu per rank %s", ref_type_name[t], n,
                         in_place ? "in place" : "out of place");
                uint64_t c = call++;
                for (int q = 0; q < world; q++)
                    ref_fill(t, c, q, world, n, tmp + (size_t)q * n * es, b.expect);
                unsigned char *mine = tmp + (size_t)rank * n * es;
                CUDA(cudaMemsetAsync(b.drecv, REF_POISON, all * es, b.s));
                void *in = b.dsend;
                if (in_place) in = (char *)b.drecv + (size_t)rank * n * es;
                CUDA(cudaMemcpyAsync(in, mine, n * es, cudaMemcpyHostToDevice, b.s));
                r = arxAllGather(in, b.drecv, n, (arxDataType_t)t, comm, b.s);
                CHECK(r == arxSuccess, "%s: %s", what, arxGetLastError(comm));
                memset(b.hrecv, REF_POISON, all * es);
                CUDA(cudaMemcpyAsync(b.hrecv, b.drecv, all * es, cudaMemcpyDeviceToHost, b.s));
                CUDA(cudaStreamSynchronize(b.s));
                CHECK(memcmp(b.hrecv, tmp, all * es) == 0, "%s: not every rank's bits", what);
            }
            free(tmp);
        }
    }

    /* Broadcast on device memory from every root, every type, out of place
     * and in place, up to the whole slot: the root's bits everywhere (a
     * non-root's own input, sent too, must be ignored). */
    for (int t = REF_F32; t < REF_TYPES; t++) {
        const size_t ns[] = {1, 1000, b.cap / ref_size(t)};
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            size_t n = ns[k], es = ref_size(t);
            unsigned char *want = (unsigned char *)malloc(n * es);
            for (int root = 0; root < world; root++)
                for (int in_place = 0; in_place < 2; in_place++) {
                    char what[96];
                    snprintf(what, sizeof what, "broadcast %s x %zu from %d %s", ref_type_name[t], n, root,
                             in_place ? "in place" : "out of place");
                    uint64_t c = call++;
                    ref_fill(t, c, root, world, n, want, b.expect);
                    ref_fill(t, c, rank, world, n, b.hsend, b.expect);
                    CUDA(cudaMemsetAsync(b.drecv, REF_POISON, n * es, b.s));
                    void *in = in_place ? b.drecv : b.dsend;
                    if (!in_place || rank == root)
                        CUDA(cudaMemcpyAsync(in, b.hsend, n * es, cudaMemcpyHostToDevice, b.s));
                    r = arxBroadcast(in, b.drecv, n, (arxDataType_t)t, root, comm, b.s);
                    CHECK(r == arxSuccess, "%s: %s", what, arxGetLastError(comm));
                    memset(b.hrecv, REF_POISON, n * es);
                    CUDA(cudaMemcpyAsync(b.hrecv, b.drecv, n * es, cudaMemcpyDeviceToHost, b.s));
                    CUDA(cudaStreamSynchronize(b.s));
                    CHECK(memcmp(b.hrecv, want, n * es) == 0, "%s: not the root's bits", what);
                }
            free(want);
        }
    }

    /* Empty calls with NULL buffers (NCCL accepts them): a call like any
     * other on every rank; the next call is still right. */
    r = arxAllReduce(NULL, NULL, 0, arxFloat32, arxSum, comm, b.s);
    CHECK(r == arxSuccess, "empty all-reduce, NULL buffers: %s", arxGetLastError(comm));
    r = arxReduceScatter(NULL, NULL, 0, arxBfloat16, arxSum, comm, b.s);
    CHECK(r == arxSuccess, "empty reduce-scatter, NULL buffers: %s", arxGetLastError(comm));
    r = arxAllGather(NULL, NULL, 0, arxFloat16, comm, b.s);
    CHECK(r == arxSuccess, "empty all-gather, NULL buffers: %s", arxGetLastError(comm));
    r = arxBroadcast(NULL, NULL, 0, arxFloat32, 0, comm, b.s);
    CHECK(r == arxSuccess, "empty broadcast, NULL buffers: %s", arxGetLastError(comm));
    eager(comm, &b, REF_F32, 777, 0, call++);

    /* Graphs, replayed many times with new inputs. */
    graph(comm, &b, REF_BF16, 4096, 0, 500, cudaStreamCaptureModeGlobal, &call);
    graph(comm, &b, REF_F16, 1000, 1, 300, cudaStreamCaptureModeThreadLocal, &call);
    graph(comm, &b, REF_F32, 65536, 0, 100, cudaStreamCaptureModeRelaxed, &call);

    /* Refused before anything is enqueued. */
    r = arxAllReduce(b.dsend, b.drecv, 16, (arxDataType_t)9, arxSum, comm, b.s);
    CHECK(r == arxInvalidArgument, "bad datatype: got %d", r);
    r = arxAllReduce(b.dsend, (char *)b.dsend + 4, 16, arxFloat32, arxSum, comm, b.s);
    CHECK(r == arxInvalidArgument, "overlapping buffers: got %d", r);
    r = arxBroadcast(b.dsend, NULL, 16, arxFloat32, 0, comm, b.s);
    CHECK(r == arxInvalidArgument, "broadcast NULL recvbuff: got %d", r);

    /* A count that differs on the last rank: enqueued fine, the kernel
     * records the mismatch on every rank, and the output is NaN. */
    size_t count = rank == last ? 101 : 100;
    double t0 = MPI_Wtime();
    CUDA(cudaMemsetAsync(b.drecv, REF_POISON, 404, b.s));
    r = arxAllReduce(b.dsend, b.drecv, count, arxFloat32, arxSum, comm, b.s);
    CHECK(r == arxSuccess, "enqueueing the mismatched call: %d: %s", r, arxGetLastError(comm));
    CUDA(cudaStreamSynchronize(b.s));
    double took = MPI_Wtime() - t0;
    arxResult_t async = arxSuccess;
    r = arxCommGetAsyncError(comm, &async);
    CHECK(r == arxSuccess && async == arxMismatch, "mismatched count: async error %d (%s): %s", async,
          arxGetErrorString(async), arxGetLastError(comm));
    CHECK(took < 10.0, "mismatched count: the kernel took %.1f s to fail", took);
    float out[101];
    CUDA(cudaMemcpy(out, b.drecv, count * 4, cudaMemcpyDeviceToHost));
    size_t nan = 0;
    for (size_t i = 0; i < count; i++) nan += isnan(out[i]) != 0;
    CHECK(nan == count, "mismatched count: %zu of %zu outputs are NaN", nan, count);
    if (rank == 0) printf("mismatched call: rank 0 after %.3f s: %s\n", took, arxGetLastError(comm));
    r = arxAllReduce(b.dsend, b.drecv, 100, arxFloat32, arxSum, comm, b.s);
    CHECK(r == arxMismatch, "a call after the failure: got %d", r);

    CHECK(arxCommDestroy(comm) == arxSuccess, "arxCommDestroy: %s", arxGetLastError(NULL));
    CUDA(cudaStreamDestroy(b.s));
    CUDA(cudaFree(b.dsend));
    CUDA(cudaFree(b.drecv));
    CUDA(cudaFreeHost(b.hsend));
    CUDA(cudaFreeHost(b.hrecv));
    free(b.expect);

    long total_failures = 0, total_checks = 0;
    MPI_Allreduce(&failures, &total_failures, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&checks, &total_checks, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
        printf("allreduce_cuda: %s: %ld checks on %d ranks, %ld failed\n",
               total_failures ? "FAIL" : "PASS", total_checks, world, total_failures);
    MPI_Finalize();
    return total_failures ? 1 : 0;
}
