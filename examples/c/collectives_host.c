/* arx's reduce-scatter, all-gather and broadcast through the C ABI on host
 * buffers,
 * checking itself: run it under mpirun with any number of ranks
 * (scripts/test-capi runs 2 and 3).
 *
 *   mpicc -O2 collectives_host.c $(pkg-config --cflags --libs arx) -lm -o collectives_host
 *   mpirun -n 2 ./collectives_host
 *
 * Reduce-scatter: every rank derives every rank's input of world x n
 * elements from a seed and computes the all-reduce of them itself
 * (reference.h: rank order, fp32 accumulator, one rounding, its own
 * fp16/bf16 conversions); rank r must get block r of it, bit for bit, for
 * sum, max, min and avg. All-gather: every rank's n elements are random
 * bytes (NaN payloads and signalling NaNs included: the call moves bits, it
 * converts nothing), and every rank must hold all of them in rank order.
 * Broadcast: from every root, random bytes again, the root's on every
 * rank (a non-root's sendbuff, its own bytes, NULL or a pointer into its
 * recvbuff, is never read nor checked).
 * Outputs are poisoned before each call; in place (NCCL's rule:
 * recvbuff == sendbuff + rank * recvcount for reduce-scatter, sendbuff ==
 * recvbuff + rank * sendcount for all-gather) and out of place; a 4 KiB
 * slot, so the longer calls run as several chunks. Then the failures:
 * arguments refused locally (the comm stays usable), a device call on a
 * host comm, a count that differs on the last rank (arxMismatch on every
 * rank at once), and recvbuff == sendbuff on every rank — in place on rank 0
 * only, refused on every other rank, which makes rank 0 fail at once too;
 * a broadcast root of -1 on rank 0 (arxInvalidArgument there, arxMismatch
 * on its peers at once) and a broadcast count that differs on the last
 * rank (arxMismatch on every rank at once, the root too).
 * Prints PASS or FAIL on rank 0 and exits non-zero on any failure. */
#include <arx.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference.h"

static int rank, world;
static long checks, failures;

#define CHECK(cond, ...)                                          \
    do {                                                          \
        checks++;                                                 \
        if (!(cond)) {                                            \
            if (++failures <= 20) { /* the first few say enough */ \
                fprintf(stderr, "rank %d: FAIL line %d: ", rank, __LINE__); \
                fprintf(stderr, __VA_ARGS__);                     \
                fputc('\n', stderr);                              \
            }                                                     \
        }                                                         \
    } while (0)

static void same_on_every_rank(const void *p, size_t bytes, const char *what) {
    uint64_t mine = ref_digest(p, bytes);
    uint64_t *all = malloc(sizeof(uint64_t) * (size_t)world);
    MPI_Allgather(&mine, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, MPI_COMM_WORLD);
    for (int r = 0; r < world; r++)
        CHECK(all[r] == all[0], "%s: rank %d's result differs from rank 0's", what, r);
    free(all);
}

/* One checked reduce-scatter of n elements per rank. In place, the other
 * ranks' blocks of sendbuff must be left as they were. */
static void checked_rs(arxComm_t comm, int t, int op, size_t n, int in_place, uint64_t call) {
    size_t sz = ref_size(t), total = n * (size_t)world, bytes = total * sz;
    unsigned char *send = malloc(bytes + 1), *recv = malloc(n * sz + 1);
    unsigned char *expect = malloc(bytes + 1), *keep = malloc(bytes + 1);
    ref_fill_op(t, op, call, rank, world, total, send, expect);
    memcpy(keep, send, bytes);
    memset(recv, REF_POISON, n * sz);
    unsigned char *got = in_place ? send + (size_t)rank * n * sz : recv;
    arxResult_t r = arxReduceScatterHost(send, got, n, (arxDataType_t)t, (arxRedOp_t)op, comm);
    char what[112];
    snprintf(what, sizeof what, "reduce-scatter op %d: %s x %zu %s (call %llu)", op, ref_type_name[t], n,
             in_place ? "in place" : "out of place", (unsigned long long)call);
    CHECK(r == arxSuccess, "%s: %s: %s", what, arxGetErrorString(r), arxGetLastError(comm));
    const unsigned char *want = expect + (size_t)rank * n * sz;
    size_t first, wrong = op == REF_SUM ? ref_wrong(t, got, want, n, &first)
                                        : ref_wrong_bits(t, got, want, n, &first);
    CHECK(wrong == 0, "%s: %zu wrong elements, first at %zu: got %a, expected %a", what, wrong, first,
          (double)ref_load(t, got, first), (double)ref_load(t, want, first));
    if (in_place) {
        size_t lo = (size_t)rank * n * sz, hi = lo + n * sz;
        CHECK(memcmp(send, keep, lo) == 0 && memcmp(send + hi, keep + hi, bytes - hi) == 0,
              "%s: another rank's block of sendbuff was changed", what);
    } else {
        CHECK(memcmp(send, keep, bytes) == 0, "%s: sendbuff was changed", what);
    }
    free(send); free(recv); free(expect); free(keep);
}

/* Rank p's all-gather input: random bytes, any bit pattern. */
static void ag_input(uint64_t call, int p, size_t bytes, unsigned char *out) {
    for (size_t j = 0; j < bytes; j++)
        out[j] = (unsigned char)(ref_mix(ref_mix(call) ^ ((uint64_t)p << 40) ^ j) >> 24);
}

/* One checked all-gather of n elements per rank. */
static void checked_ag(arxComm_t comm, int t, size_t n, int in_place, uint64_t call) {
    size_t sz = ref_size(t), blk = n * sz, bytes = blk * (size_t)world;
    unsigned char *send = malloc(blk + 1), *keep = malloc(blk + 1);
    unsigned char *recv = malloc(bytes + 1), *expect = malloc(bytes + 1);
    for (int p = 0; p < world; p++) ag_input(call, p, blk, expect + (size_t)p * blk);
    ag_input(call, rank, blk, send);
    memcpy(keep, send, blk);
    memset(recv, REF_POISON, bytes);
    arxResult_t r;
    if (in_place) {
        memcpy(recv + (size_t)rank * blk, send, blk);
        r = arxAllGatherHost(recv + (size_t)rank * blk, recv, n, (arxDataType_t)t, comm);
    } else {
        r = arxAllGatherHost(send, recv, n, (arxDataType_t)t, comm);
    }
    char what[112];
    snprintf(what, sizeof what, "all-gather: %s x %zu %s (call %llu)", ref_type_name[t], n,
             in_place ? "in place" : "out of place", (unsigned long long)call);
    CHECK(r == arxSuccess, "%s: %s: %s", what, arxGetErrorString(r), arxGetLastError(comm));
    size_t first, wrong = ref_wrong_bits(t, recv, expect, n * (size_t)world, &first);
    CHECK(wrong == 0, "%s: %zu wrong elements, first at %zu (block %zu)", what, wrong, first,
          n ? first / n : 0);
    CHECK(memcmp(send, keep, blk) == 0, "%s: sendbuff was changed", what);
    same_on_every_rank(recv, bytes, what);
    free(send); free(keep); free(recv); free(expect);
}

/* One checked broadcast of n elements from root. In place, a non-root's
 * buffer starts poisoned; out of place, a non-root passes its own bytes,
 * or on odd calls NULL, or on others recvbuff + 1 byte (overlapping and
 * misaligned: ignored off the root, so not refused) as sendbuff. */
static void checked_bc(arxComm_t comm, int t, size_t n, int root, int in_place, uint64_t call) {
    size_t bytes = n * ref_size(t);
    unsigned char *send = malloc(bytes + 1), *keep = malloc(bytes + 1);
    unsigned char *recv = malloc(bytes + 1), *expect = malloc(bytes + 1);
    ag_input(call, root, bytes, expect);
    ag_input(call, rank, bytes, send);
    memcpy(keep, send, bytes);
    memset(recv, REF_POISON, bytes);
    arxResult_t r;
    if (in_place) {
        if (rank == root) memcpy(recv, send, bytes);
        r = arxBroadcastHost(recv, recv, n, (arxDataType_t)t, root, comm);
    } else {
        const void *s = send;
        if (rank != root && (call & 1)) s = NULL;
        else if (rank != root && (call & 2)) s = recv + 1;
        r = arxBroadcastHost(s, recv, n, (arxDataType_t)t, root, comm);
    }
    char what[112];
    snprintf(what, sizeof what, "broadcast: %s x %zu from %d %s (call %llu)", ref_type_name[t], n, root,
             in_place ? "in place" : "out of place", (unsigned long long)call);
    CHECK(r == arxSuccess, "%s: %s: %s", what, arxGetErrorString(r), arxGetLastError(comm));
    size_t first, wrong = ref_wrong_bits(t, recv, expect, n, &first);
    CHECK(wrong == 0, "%s: %zu wrong elements, first at %zu", what, wrong, first);
    CHECK(memcmp(send, keep, bytes) == 0, "%s: sendbuff was changed", what);
    same_on_every_rank(recv, bytes, what);
    free(send); free(keep); free(recv); free(expect);
}

static arxComm_t make_comm(arxConfig_t *config) {
    arxComm_t comm = NULL;
    arxResult_t r = arxCommInit(&comm, MPI_COMM_WORLD, config);
    CHECK(r == arxSuccess && comm != NULL, "arxCommInit: %s: %s", arxGetErrorString(r), arxGetLastError(NULL));
    if (r != arxSuccess) {
        fprintf(stderr, "rank %d: FAIL: cannot go on without a comm\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    return comm;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    const int last = world - 1;

    /* Host side, a 4 KiB slot (a chunk holds 4096 / element size / world
     * elements of each block), call timeout 20 s: a failure that should be
     * seen at once must come back well before it. */
    arxConfig_t config = ARX_CONFIG_INITIALIZER;
    config.device = arxDeviceHost;
    config.timeoutMs = 20000;
    config.slotBytes = 4096;
    arxComm_t comm = make_comm(&config);

    const size_t counts[] = {0, 1, 3, 1000, 4099};
    uint64_t call = 1;
    for (int t = arxFloat32; t <= arxBfloat16; t++)
        for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++)
            for (int in_place = 0; in_place < 2; in_place++) {
                checked_rs(comm, t, REF_SUM, counts[k], in_place, call++);
                checked_ag(comm, t, counts[k], in_place, call++);
                for (int root = 0; root < world; root++)
                    checked_bc(comm, t, counts[k], root, in_place, call++);
            }
    const int ops[] = {arxMax, arxMin, arxAvg};
    for (int o = 0; o < 3; o++)
        for (int t = arxFloat32; t <= arxBfloat16; t++) {
            checked_rs(comm, t, ops[o], 1001, 0, call++);
            checked_rs(comm, t, ops[o], 1001, 1, call++);
        }

    /* Arguments wrong on their face: refused on this rank before anything
     * is sent; the comm stays usable. Every rank makes the same calls. */
    float *a = calloc(64 * (size_t)world, sizeof(float)), *b = calloc(64 * (size_t)world, sizeof(float));
    arxResult_t r;
    r = arxReduceScatterHost(a, b, 64, (arxDataType_t)7, arxSum, comm);
    CHECK(r == arxInvalidArgument, "reduce-scatter datatype 7: got %d", r);
    CHECK(strstr(arxGetLastError(comm), "arxReduceScatterHost") && strstr(arxGetLastError(comm), "datatype"),
          "last error: %s", arxGetLastError(comm));
    r = arxReduceScatterHost(a, b, 64, arxFloat32, (arxRedOp_t)1, comm);
    CHECK(r == arxInvalidArgument, "reduce-scatter op 1: got %d", r);
    r = arxReduceScatterHost(NULL, b, 64, arxFloat32, arxSum, comm);
    CHECK(r == arxInvalidArgument, "reduce-scatter NULL sendbuff: got %d", r);
    r = arxReduceScatterHost(a, b, 64, arxFloat32, arxSum, NULL);
    CHECK(r == arxInvalidArgument, "reduce-scatter NULL comm: got %d", r);
    r = arxReduceScatterHost(a, b, SIZE_MAX / 4, arxFloat32, arxSum, comm);
    CHECK(r == arxInvalidArgument, "reduce-scatter count overflow: got %d", r);
    CHECK(strstr(arxGetLastError(comm), "address space") != NULL, "last error: %s", arxGetLastError(comm));
    r = arxReduceScatterHost((char *)a + 2, b, 8, arxFloat32, arxSum, comm);
    CHECK(r == arxInvalidArgument, "reduce-scatter misaligned sendbuff: got %d", r);
    r = arxAllGatherHost(a, NULL, 64, arxFloat16, comm);
    CHECK(r == arxInvalidArgument, "all-gather NULL recvbuff: got %d", r);
    r = arxAllGatherHost(a, b, 64, (arxDataType_t)-1, comm);
    CHECK(r == arxInvalidArgument, "all-gather datatype -1: got %d", r);
    r = arxAllGatherHost(a, b, SIZE_MAX / 4, arxFloat16, comm);
    CHECK(r == arxInvalidArgument, "all-gather count overflow: got %d", r);
    r = arxAllGatherHost(a, (char *)b + 1, 8, arxFloat16, comm);
    CHECK(r == arxInvalidArgument, "all-gather misaligned recvbuff: got %d", r);
    r = arxReduceScatter(a, b, 64, arxFloat32, arxSum, comm, NULL);
    CHECK(r == arxInvalidUsage, "device reduce-scatter on a host comm: got %d", r);
    CHECK(strstr(arxGetLastError(comm), "arxReduceScatterHost") != NULL, "last error: %s", arxGetLastError(comm));
    r = arxAllGather(a, b, 64, arxFloat32, comm, NULL);
    CHECK(r == arxInvalidUsage, "device all-gather on a host comm: got %d", r);
    r = arxBroadcast(a, b, 64, arxFloat32, 0, comm, NULL);
    CHECK(r == arxInvalidUsage, "device broadcast on a host comm: got %d", r);
    CHECK(strstr(arxGetLastError(comm), "arxBroadcastHost") != NULL, "last error: %s", arxGetLastError(comm));
    r = arxBroadcastHost(a, b, 64, (arxDataType_t)7, 0, comm);
    CHECK(r == arxInvalidArgument, "broadcast datatype 7: got %d", r);
    r = arxBroadcastHost(a, NULL, 64, arxFloat32, 0, comm);
    CHECK(r == arxInvalidArgument, "broadcast NULL recvbuff: got %d", r);
    r = arxBroadcastHost(NULL, b, 64, arxFloat32, rank, comm);
    CHECK(r == arxInvalidArgument, "broadcast NULL sendbuff on the root: got %d", r);
    r = arxBroadcastHost(a, (char *)a + 4, 64, arxFloat32, rank, comm);
    CHECK(r == arxInvalidArgument, "broadcast overlapping buffers on the root: got %d", r);
    arxResult_t async = arxInternalError;
    r = arxCommGetAsyncError(comm, &async);
    CHECK(r == arxSuccess && async == arxSuccess, "async error after refused calls: %d, %d", r, async);
    checked_rs(comm, arxFloat32, REF_SUM, 100, 0, call++); /* still usable */
    checked_ag(comm, arxBfloat16, 100, 1, call++);
    checked_bc(comm, arxFloat16, 100, last, 0, call++);

    /* A reduce-scatter whose recvcount differs on the last rank: every
     * rank fails at once (not by the 20 s timeout), and the comm stays
     * failed. */
    float *x = calloc(101 * (size_t)world, sizeof(float)), *y = calloc(101 * (size_t)world, sizeof(float));
    double t0 = MPI_Wtime();
    r = arxReduceScatterHost(x, y, rank == last ? 101 : 100, arxFloat32, arxSum, comm);
    double took = MPI_Wtime() - t0;
    CHECK(r == arxMismatch, "mismatched recvcount: got %s (%d): %s", arxGetErrorString(r), r, arxGetLastError(comm));
    CHECK(took < 10.0, "mismatched recvcount: the error took %.1f s", took);
    if (rank == 0) printf("reduce-scatter count on the last rank differs: every rank fails; rank 0 after %.3f s: %s\n", took, arxGetLastError(comm));
    r = arxAllGatherHost(x, y, 100, arxFloat32, comm);
    CHECK(r == arxMismatch, "a call after the failure: got %d", r);
    /* The async error is that failure; the last error keeps its call's name. */
    r = arxCommGetAsyncError(comm, &async);
    CHECK(r == arxSuccess && async == arxMismatch, "async error after the failure: %d, %d", r, async);
    CHECK(strncmp(arxGetLastError(comm), "arxAllGatherHost: ", 18) == 0, "last error after arxCommGetAsyncError: %s",
          arxGetLastError(comm));
    CHECK(arxCommDestroy(comm) == arxSuccess, "arxCommDestroy: %s", arxGetLastError(NULL));

    /* recvbuff == sendbuff on every rank (an all-reduce habit): in place on
     * rank 0, whose block starts there; on every other rank the buffers
     * overlap elsewhere than its block, which is refused and told to the
     * peers, so rank 0 fails at once too. Both calls, each on a new comm. */
    for (int which = 0; which < 2; which++) {
        comm = make_comm(&config);
        t0 = MPI_Wtime();
        r = which == 0 ? arxReduceScatterHost(a, a, 64, arxFloat32, arxSum, comm)
                       : arxAllGatherHost(a, a, 64, arxFloat32, comm);
        took = MPI_Wtime() - t0;
        const char *name = which == 0 ? "reduce-scatter" : "all-gather";
        CHECK(r == (rank == 0 ? arxMismatch : arxInvalidArgument), "%s with recvbuff == sendbuff: got %d: %s",
              name, r, arxGetLastError(comm));
        CHECK(took < 10.0, "%s with recvbuff == sendbuff: the error took %.1f s", name, took);
        CHECK(rank == 0 || strstr(arxGetLastError(comm), "in place") != NULL, "%s: message %s", name,
              arxGetLastError(comm));
        if (rank == 0) printf("%s with recvbuff == sendbuff on every rank: rank 0 fails after %.3f s: %s\n", name, took, arxGetLastError(comm));
        CHECK(arxCommDestroy(comm) == arxSuccess, "arxCommDestroy: %s", arxGetLastError(NULL));
    }

    /* Broadcast: a root of -1 on rank 0 only (refused there and told to
     * the peers), then a count one larger on the last rank (the root sees
     * it too): every rank fails at once. Each on a new comm. */
    for (int which = 0; which < 2; which++) {
        comm = make_comm(&config);
        t0 = MPI_Wtime();
        int root = which == 0 && rank == 0 ? -1 : 0;
        size_t n = which == 1 && rank == last ? 101 : 100;
        r = arxBroadcastHost(x, y, n, arxFloat32, root, comm);
        took = MPI_Wtime() - t0;
        const char *name = which == 0 ? "broadcast root -1 on rank 0" : "broadcast count on the last rank";
        arxResult_t want = which == 0 && rank == 0 ? arxInvalidArgument : arxMismatch;
        CHECK(r == want, "%s: got %s (%d): %s", name, arxGetErrorString(r), r, arxGetLastError(comm));
        CHECK(took < 10.0, "%s: the error took %.1f s", name, took);
        CHECK(which == 1 || rank != 0 || strstr(arxGetLastError(comm), "root -1") != NULL, "%s: message %s",
              name, arxGetLastError(comm));
        if (rank == 0) printf("%s: every rank fails; rank 0 after %.3f s: %s\n", name, took, arxGetLastError(comm));
        CHECK(arxCommDestroy(comm) == arxSuccess, "arxCommDestroy: %s", arxGetLastError(NULL));
    }

    /* The default slot (1 MiB), from the environment and defaults. */
    comm = make_comm(NULL);
    checked_rs(comm, arxFloat32, REF_SUM, 70001, 0, call++);
    checked_rs(comm, arxBfloat16, REF_AVG, 70001, 1, call++);
    checked_ag(comm, arxFloat16, 70001, 0, call++);
    checked_ag(comm, arxFloat32, 70001, 1, call++);
    checked_bc(comm, arxBfloat16, 700001, last, 0, call++);
    checked_bc(comm, arxFloat32, 700001, 0, 1, call++);
    CHECK(arxCommDestroy(comm) == arxSuccess, "arxCommDestroy: %s", arxGetLastError(NULL));
    free(a); free(b); free(x); free(y);

    long total_failures = 0, total_checks = 0;
    MPI_Allreduce(&failures, &total_failures, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&checks, &total_checks, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
        printf("collectives_host: %s: %ld checks on %d ranks, %ld failed\n",
               total_failures ? "FAIL" : "PASS", total_checks, world, total_failures);
    MPI_Finalize();
    return total_failures ? 1 : 0;
}
