/* arx's C ABI on host buffers, checking itself: run it under mpirun with
 * any number of ranks (scripts/test-capi runs 2 and 4).
 *
 *   mpicc -O2 allreduce_host.c $(pkg-config --cflags --libs arx) -o allreduce_host
 *   mpirun -n 2 ./allreduce_host
 *
 * Every rank derives every rank's input from a seed and computes the
 * expected sum itself (in rank order, fp32 accumulator, rounded once, with
 * its own fp16/bf16 conversions below, not the library's); outputs are
 * poisoned before each call and every rank's result bits are compared.
 * max, min and avg are checked the same way, bit for bit (their NaN is the
 * canonical one). Then the failures: arguments refused locally (the comm stays usable), a
 * device call on a host comm, a call whose count differs on one rank
 * (arxMismatch on every rank at once, and the comm stays failed), counts
 * beyond the slot (chunked: checked like the others; a total that differs
 * on one rank fails every rank at once), and arxCommInit with bad configs
 * (on every rank, on one rank, and disagreeing ranks). Prints PASS or FAIL on rank 0 and exits
 * non-zero on any failure. */
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

/* Every rank holds the same bits? */
static void same_on_every_rank(const void *p, size_t bytes, const char *what) {
    uint64_t mine = ref_digest(p, bytes);
    uint64_t *all = malloc(sizeof(uint64_t) * (size_t)world);
    MPI_Allgather(&mine, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, MPI_COMM_WORLD);
    for (int r = 0; r < world; r++)
        CHECK(all[r] == all[0], "%s: rank %d's result differs from rank 0's", what, r);
    free(all);
}

/* One checked call of operation `op`: out of place or in place. */
static void checked_op_call(arxComm_t comm, int t, int op, size_t count, int in_place, uint64_t call) {
    size_t bytes = count * ref_size(t);
    unsigned char *send = malloc(bytes + 1), *recv = malloc(bytes + 1);
    unsigned char *expect = malloc(bytes + 1), *keep = malloc(bytes + 1);
    ref_fill_op(t, op, call, rank, world, count, send, expect);
    memcpy(keep, send, bytes);
    if (in_place) memcpy(recv, send, bytes);
    else memset(recv, REF_POISON, bytes);
    arxRedOp_t o = (arxRedOp_t)op;
    arxResult_t r = in_place ? arxAllReduceHost(recv, recv, count, (arxDataType_t)t, o, comm)
                             : arxAllReduceHost(send, recv, count, (arxDataType_t)t, o, comm);
    char what[96];
    snprintf(what, sizeof what, "op %d: %s x %zu %s (call %llu)", op, ref_type_name[t], count,
             in_place ? "in place" : "out of place", (unsigned long long)call);
    CHECK(r == arxSuccess, "%s: %s: %s", what, arxGetErrorString(r), arxGetLastError(comm));
    size_t first, wrong = op == REF_SUM ? ref_wrong(t, recv, expect, count, &first)
                                        : ref_wrong_bits(t, recv, expect, count, &first);
    CHECK(wrong == 0, "%s: %zu wrong elements, first at %zu: got %a, expected %a", what, wrong,
          first, (double)ref_load(t, recv, first), (double)ref_load(t, expect, first));
    if (!in_place) CHECK(memcmp(send, keep, bytes) == 0, "%s: sendbuff was changed", what);
    same_on_every_rank(recv, bytes, what);
    free(send); free(recv); free(expect); free(keep);
}

static void checked_call(arxComm_t comm, int t, size_t count, int in_place, uint64_t call) {
    checked_op_call(comm, t, REF_SUM, count, in_place, call);
}

static double now(void) { return MPI_Wtime(); }

/* ---- the program ---------------------------------------------------------- */

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    const int last = world - 1;

    int version = 0;
    CHECK(arxGetVersion(&version) == arxSuccess && version == ARX_VERSION_CODE,
          "arxGetVersion gave %d, header says %d", version, ARX_VERSION_CODE);
    CHECK(ARX_VERSION_CODE == ARX_VERSION(ARX_MAJOR, ARX_MINOR, ARX_PATCH), "version macros disagree");
    CHECK(arxGetVersion(NULL) == arxInvalidArgument, "arxGetVersion(NULL) accepted");
    for (int c = arxSuccess; c <= arxNumResults; c++)
        CHECK(arxGetErrorString((arxResult_t)c)[0] != '\0', "no string for code %d", c);

    /* Host side, call timeout 20 s: a failure that should be seen at once
     * must come back well before it. */
    arxConfig_t config = ARX_CONFIG_INITIALIZER;
    config.device = arxDeviceHost;
    config.timeoutMs = 20000;
    arxComm_t comm = NULL;
    arxResult_t r = arxCommInit(&comm, MPI_COMM_WORLD, &config);
    CHECK(r == arxSuccess && comm != NULL, "arxCommInit: %s: %s", arxGetErrorString(r), arxGetLastError(NULL));
    if (r != arxSuccess) {
        fprintf(stderr, "rank %d: FAIL: cannot go on without a comm\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    int n = -1, me = -1;
    CHECK(arxCommCount(comm, &n) == arxSuccess && n == world, "arxCommCount gave %d", n);
    CHECK(arxCommUserRank(comm, &me) == arxSuccess && me == rank, "arxCommUserRank gave %d", me);

    /* Correct results: every type, several sizes up to the default slot
     * (1 MiB), out of place and in place. */
    const size_t counts[] = {0, 1, 3, 64, 1000, 4099, 65536, 262144};
    uint64_t call = 1;
    for (int t = arxFloat32; t <= arxBfloat16; t++)
        for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
            /* The last: the whole slot of this type. */
            size_t count = counts[k] == 262144 ? (1u << 20) / ref_size(t) : counts[k];
            checked_call(comm, t, count, 0, call++);
            checked_call(comm, t, count, 1, call++);
        }
    /* max, min, avg: every type, bit for bit (NaN by its canonical bits). */
    const int ops[] = {arxMax, arxMin, arxAvg};
    for (int o = 0; o < 3; o++)
        for (int t = arxFloat32; t <= arxBfloat16; t++) {
            checked_op_call(comm, t, ops[o], 1, 0, call++);
            checked_op_call(comm, t, ops[o], 1001, 0, call++);
            checked_op_call(comm, t, ops[o], 1001, 1, call++);
        }
    float a0[4] = {1, 2, 3, 4};
    r = arxAllReduceHost(a0, a0, 4, arxFloat32, (arxRedOp_t)1, comm);
    CHECK(r == arxInvalidArgument, "op 1 (NCCL's product): got %d", r);

    /* Arguments wrong on their face: refused on this rank before anything
     * is sent; the comm stays usable. Every rank makes the same calls. */
    float a[64], b[64];
    for (int i = 0; i < 64; i++) a[i] = (float)i;
    const arxDataType_t bad_types[] = {(arxDataType_t)-1, arxNumTypes, (arxDataType_t)99};
    for (int i = 0; i < 3; i++) {
        r = arxAllReduceHost(a, b, 64, bad_types[i], arxSum, comm);
        CHECK(r == arxInvalidArgument, "datatype %d: got %d", (int)bad_types[i], r);
    }
    CHECK(strstr(arxGetLastError(comm), "datatype") != NULL, "last error: %s", arxGetLastError(comm));
    CHECK(strstr(arxGetLastError(NULL), "datatype") != NULL, "thread's last error: %s", arxGetLastError(NULL));
    r = arxAllReduceHost(a, b, 64, arxFloat32, arxNumOps, comm);
    CHECK(r == arxInvalidArgument, "op arxNumOps: got %d", r);
    r = arxAllReduceHost(a, b, 64, arxFloat32, (arxRedOp_t)-3, comm);
    CHECK(r == arxInvalidArgument, "op -3: got %d", r);
    r = arxAllReduceHost(NULL, b, 64, arxFloat32, arxSum, comm);
    CHECK(r == arxInvalidArgument, "NULL sendbuff: got %d", r);
    r = arxAllReduceHost(a, NULL, 64, arxFloat32, arxSum, comm);
    CHECK(r == arxInvalidArgument, "NULL recvbuff: got %d", r);
    r = arxAllReduceHost(a, b, 64, arxFloat32, arxSum, NULL);
    CHECK(r == arxInvalidArgument, "NULL comm: got %d", r);
    r = arxAllReduceHost(a, a + 1, 32, arxFloat32, arxSum, comm);
    CHECK(r == arxInvalidArgument, "overlapping buffers: got %d", r);
    r = arxAllReduceHost(a, b, SIZE_MAX / 2, arxFloat32, arxSum, comm);
    CHECK(r == arxInvalidArgument, "count overflow: got %d", r);
    r = arxAllReduceHost((char *)a + 1, b, 8, arxFloat32, arxSum, comm);
    CHECK(r == arxInvalidArgument, "misaligned sendbuff: got %d", r);
    r = arxAllReduce(a, b, 64, arxFloat32, arxSum, comm, NULL);
    CHECK(r == arxInvalidUsage, "device call on a host comm: got %d", r);
    r = arxCommCount(NULL, &n);
    CHECK(r == arxInvalidArgument, "arxCommCount(NULL): got %d", r);
    r = arxCommUserRank(comm, NULL);
    CHECK(r == arxInvalidArgument, "arxCommUserRank(comm, NULL): got %d", r);
    arxResult_t async = arxInternalError;
    r = arxCommGetAsyncError(comm, &async);
    CHECK(r == arxSuccess && async == arxSuccess, "async error after refused calls: %d, %d", r, async);
    checked_call(comm, arxFloat32, 100, 0, call++); /* still usable */

    /* Empty calls with NULL buffers (NCCL accepts them): each is a call
     * like any other on every rank, and the next call is still right. */
    r = arxAllReduceHost(NULL, NULL, 0, arxFloat32, arxSum, comm);
    CHECK(r == arxSuccess, "empty all-reduce, NULL buffers: %d: %s", r, arxGetLastError(comm));
    r = arxAllReduceHost(a, NULL, 0, arxBfloat16, arxMax, comm);
    CHECK(r == arxSuccess, "empty all-reduce, NULL recvbuff: %d: %s", r, arxGetLastError(comm));
    r = arxReduceScatterHost(NULL, NULL, 0, arxFloat16, arxSum, comm);
    CHECK(r == arxSuccess, "empty reduce-scatter, NULL buffers: %d: %s", r, arxGetLastError(comm));
    r = arxAllGatherHost(NULL, b, 0, arxFloat32, comm);
    CHECK(r == arxSuccess, "empty all-gather, NULL sendbuff: %d: %s", r, arxGetLastError(comm));
    r = arxBroadcastHost(NULL, NULL, 0, arxFloat32, 0, comm);
    CHECK(r == arxSuccess, "empty broadcast, NULL buffers: %d: %s", r, arxGetLastError(comm));
    checked_call(comm, arxBfloat16, 333, 1, call++);

    /* A call whose count differs on the last rank: an error on every rank
     * at once (not by the 20 s timeout), and the comm stays failed. */
    size_t count = rank == last ? 101 : 100;
    float *x = calloc(101, sizeof(float)), *y = calloc(101, sizeof(float));
    double t0 = now();
    r = arxAllReduceHost(x, y, count, arxFloat32, arxSum, comm);
    double took = now() - t0;
    CHECK(r == arxMismatch, "mismatched count: got %s (%d): %s", arxGetErrorString(r), r, arxGetLastError(comm));
    CHECK(took < 10.0, "mismatched count: the error took %.1f s", took);
    CHECK(strstr(arxGetLastError(comm), "101") != NULL, "message does not name the counts: %s", arxGetLastError(comm));
    if (rank == 0) printf("mismatched call: every rank fails; rank 0 after %.3f s: %s\n", took, arxGetLastError(comm));
    r = arxCommGetAsyncError(comm, &async);
    CHECK(r == arxSuccess && async == arxMismatch, "async error after the mismatch: %d, %d", r, async);
    r = arxAllReduceHost(x, y, 100, arxFloat32, arxSum, comm);
    CHECK(r == arxMismatch, "a call after the failure: got %d", r);
    /* Local checks still come first on a failed comm. */
    r = arxAllReduceHost(x, y, 100, arxNumTypes, arxSum, comm);
    CHECK(r == arxInvalidArgument, "bad datatype on a failed comm: got %d", r);
    CHECK(arxCommDestroy(comm) == arxSuccess, "arxCommDestroy: %s", arxGetLastError(NULL));
    CHECK(arxCommDestroy(NULL) == arxInvalidArgument, "arxCommDestroy(NULL) accepted");

    /* Counts beyond the slot (4 KiB): run as chunks of one slot, checked
     * like any call, every type, out of place and in place. Then the last
     * rank's total is one chunk longer (1024 floats each): every rank fails
     * at once with arxMismatch, not by the timeout. */
    config.slotBytes = 4096;
    r = arxCommInit(&comm, MPI_COMM_WORLD, &config);
    CHECK(r == arxSuccess, "arxCommInit (slot 4096): %s", arxGetLastError(NULL));
    if (r == arxSuccess) {
        for (int t = arxFloat32; t <= arxBfloat16; t++) {
            size_t m = 4096 / ref_size(t); /* elements per chunk */
            const size_t beyond[] = {m + 1, 2 * m + 3, 3 * m + m / 2 + 1};
            for (size_t k = 0; k < 3; k++) {
                checked_call(comm, t, beyond[k], 0, call++);
                checked_call(comm, t, beyond[k], 1, call++);
            }
            checked_op_call(comm, t, arxMax, 2 * m + 3, 0, call++);
            checked_op_call(comm, t, arxAvg, 2 * m + 3, 1, call++);
        }
        float *big = malloc(3072 * sizeof(float));
        for (int i = 0; i < 3072; i++) big[i] = (float)(i % 7 + 1);
        t0 = now();
        r = arxAllReduceHost(big, big, rank == last ? 3072 : 2048, arxFloat32, arxSum, comm);
        took = now() - t0;
        CHECK(r == arxMismatch, "a total one chunk longer on the last rank: got %d: %s", r, arxGetLastError(comm));
        CHECK(took < 10.0, "a total one chunk longer on the last rank: the error took %.1f s", took);
        if (rank == 0) printf("chunked call one chunk longer on the last rank: every rank fails; rank 0 after %.3f s: %s\n", took, arxGetLastError(comm));
        CHECK(arxCommDestroy(comm) == arxSuccess, "arxCommDestroy: %s", arxGetLastError(NULL));
        free(big);
    }
    config.slotBytes = ARX_CONFIG_UNDEF_INT;

    /* Bad configs. On every rank: a wrong magic. */
    arxConfig_t bad = config;
    bad.magic = 0;
    comm = (arxComm_t)&bad; /* must be reset to NULL */
    r = arxCommInit(&comm, MPI_COMM_WORLD, &bad);
    CHECK(r == arxInvalidArgument && comm == NULL, "bad magic: got %d", r);
    CHECK(strstr(arxGetLastError(NULL), "magic") != NULL, "bad magic: message %s", arxGetLastError(NULL));
    bad = config;
    bad.size = sizeof(arxConfig_t) - 8;
    r = arxCommInit(&comm, MPI_COMM_WORLD, &bad);
    CHECK(r == arxInvalidArgument, "bad size: got %d", r);
    bad = config;
    bad.version = ARX_VERSION_CODE + 1;
    r = arxCommInit(&comm, MPI_COMM_WORLD, &bad);
    CHECK(r == arxInvalidArgument, "newer version: got %d", r);
    bad = config;
    bad.device = 7;
    r = arxCommInit(&comm, MPI_COMM_WORLD, &bad);
    CHECK(r == arxInvalidArgument, "device 7: got %d", r);
    r = arxCommInit(NULL, MPI_COMM_WORLD, &config);
    CHECK(r == arxInvalidArgument, "arxCommInit(NULL, ...): got %d", r);
    /* On the last rank only (a negative timeout): it refuses, and the others
     * fail at once naming it, not after the start-up timeout. */
    bad = config;
    bad.initTimeoutMs = 30000;
    if (rank == last) bad.timeoutMs = -5;
    t0 = now();
    r = arxCommInit(&comm, MPI_COMM_WORLD, &bad);
    took = now() - t0;
    CHECK(r == (rank == last ? arxInvalidArgument : arxPeerFailed), "negative timeout on the last rank: got %d: %s", r, arxGetLastError(NULL));
    CHECK(took < 15.0, "negative timeout on the last rank: the error took %.1f s", took);
    CHECK(rank == last ? strstr(arxGetLastError(NULL), "timeoutMs") != NULL : 1, "message: %s", arxGetLastError(NULL));
    /* Ranks that disagree on a setting that must be shared. */
    bad = config;
    if (rank == 0) bad.slotBytes = 65536;
    r = arxCommInit(&comm, MPI_COMM_WORLD, &bad);
    CHECK(r == arxMismatch, "slot size on rank 0 only: got %d: %s", r, arxGetLastError(NULL));
    /* An out-of-range value, refused by arx's own range check. */
    bad = config;
    bad.timeoutMs = 100000000; /* over 24 h */
    r = arxCommInit(&comm, MPI_COMM_WORLD, &bad);
    CHECK(r == arxInvalidArgument, "timeout over 24 h: got %d", r);
    CHECK(strstr(arxGetLastError(NULL), "arxConfig_t.timeoutMs") != NULL, "timeout over 24 h: the message does not name the field: %s", arxGetLastError(NULL));

    /* After all that, a comm works again (NULL config: environment and defaults). */
    r = arxCommInit(&comm, MPI_COMM_WORLD, NULL);
    CHECK(r == arxSuccess, "arxCommInit(NULL config) after failures: %s", arxGetLastError(NULL));
    if (r == arxSuccess) {
        checked_call(comm, arxBfloat16, 777, 0, call++);
        checked_call(comm, arxFloat16, 777, 1, call++);
        CHECK(arxCommDestroy(comm) == arxSuccess, "arxCommDestroy: %s", arxGetLastError(NULL));
    }
    free(x); free(y);

    long total_failures = 0, total_checks = 0;
    MPI_Allreduce(&failures, &total_failures, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&checks, &total_checks, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
        printf("allreduce_host: %s: %ld checks on %d ranks, %ld failed\n",
               total_failures ? "FAIL" : "PASS", total_checks, world, total_failures);
    MPI_Finalize();
    return total_failures ? 1 : 0;
}
