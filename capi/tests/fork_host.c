/* A forked child's copies of comms, through the C ABI (run by
 * scripts/test-capi under mpirun -n 2 and 3; prints "fork_host: PASS").
 *
 * Rank 0 forks twice: once while its comm is idle, and once while another
 * of its threads is inside a call on it (waiting for rank 1, which joins
 * the call only after rank 0's forks). In each child: a call returns
 * arxSystemError naming the fork (not "another thread is inside a call",
 * which a child cannot cure: that thread is not in the child), and so do
 * arxCommGetAsyncError and an all-gather; arxCommDestroy succeeds (and,
 * for the held copy, which is not freed, a second destroy is refused as
 * destroyed). The child reports through its exit status; it makes no MPI
 * call. The parent's calls on the same comm, before and after, are
 * checked against reference.h's sum (independent of arx); in the parent,
 * a call, arxCommGetAsyncError and arxCommDestroy made while the thread is
 * inside its call are refused as arxInvalidUsage. */
#define _POSIX_C_SOURCE 200809L
#include <arx.h>
#include <mpi.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* This program uses part of the reference. */
#pragma GCC diagnostic ignored "-Wunused-function"
#include "../../examples/c/reference.h"

enum { N = 4099 };
static int rank, world;
static long fails;
static arxComm_t comm;
static float in[N], out[N], expect[N];
static arxResult_t thread_result;

#define CHECK(c, ...)                                                                   \
    do {                                                                                \
        if (!(c)) {                                                                     \
            fails++;                                                                    \
            fprintf(stderr, "fork_host: rank %d: line %d: ", rank, __LINE__);           \
            fprintf(stderr, __VA_ARGS__);                                               \
            fputc('\n', stderr);                                                        \
        }                                                                               \
    } while (0)

/* Fills the input of call `call` and the expected sum; poisons the output. */
static void prepare(uint64_t call) {
    ref_fill(REF_F32, call, rank, world, N, in, expect);
    memset(out, 0xa5, sizeof out);
}

static void check_sum(const char *what) {
    size_t first;
    size_t wrong = ref_wrong(REF_F32, out, expect, N, &first);
    CHECK(wrong == 0, "%s: %zu wrong elements, first %zu", what, wrong, first);
}

static void *call_in_thread(void *arg) {
    (void)arg;
    /* The main thread's arxGetLastError(comm) takes the comm for a moment
     * while it polls: a call that meets it is refused as overlapping (and
     * changes nothing), so it is made again. */
    do {
        thread_result = arxAllReduceHost(in, out, N, arxFloat32, arxSum, comm);
    } while (thread_result == arxInvalidUsage && strstr(arxGetLastError(NULL), "another thread"));
    return NULL;
}

/* In the child: every use of the copy. Bit k of the exit status is check
 * k failed. `held`: a parent thread was inside a call at the fork. */
static int child_checks(int held) {
    int bits = 0;
    float a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[16]; /* b: an all-gather of 2 from up to 8 ranks */
    arxResult_t r = arxAllReduceHost(a, b, 8, arxFloat32, arxSum, comm);
    const char *msg = arxGetLastError(comm);
    if (r != arxSystemError || !strstr(msg, "fork")) {
        fprintf(stderr, "fork_host: child (held %d): call -> %d: %s\n", held, (int)r, msg);
        bits |= 1;
    }
    if (!strstr(arxGetLastError(NULL), "fork")) {
        fprintf(stderr, "fork_host: child: thread's error: %s\n", arxGetLastError(NULL));
        bits |= 2;
    }
    arxResult_t async = arxSuccess;
    r = arxCommGetAsyncError(comm, &async);
    if (r != arxSuccess || async != arxSystemError) {
        fprintf(stderr, "fork_host: child (held %d): async error -> %d, %d\n", held, (int)r,
                (int)async);
        bits |= 4;
    }
    r = arxAllGatherHost(a, b, 2, arxFloat32, comm);
    if (r != arxSystemError) {
        fprintf(stderr, "fork_host: child (held %d): all-gather -> %d\n", held, (int)r);
        bits |= 8;
    }
    r = arxCommDestroy(comm);
    if (r != arxSuccess) {
        fprintf(stderr, "fork_host: child (held %d): destroy -> %d: %s\n", held, (int)r,
                arxGetLastError(NULL));
        bits |= 16;
    }
    /* A held copy is marked destroyed, not freed: a second destroy is
     * refused. (An idle copy is freed: using it again is C's undefined
     * behaviour, not tried.) */
    r = held ? arxCommDestroy(comm) : arxInvalidUsage;
    if (r != arxInvalidUsage || (held && !strstr(arxGetLastError(NULL), "destroyed"))) {
        fprintf(stderr, "fork_host: child (held %d): second destroy -> %d: %s\n", held, (int)r,
                arxGetLastError(NULL));
        bits |= 32;
    }
    return bits;
}

static void fork_and_check(int held) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        CHECK(0, "fork failed");
        return;
    }
    if (pid == 0) {
        alarm(60); /* a child that hangs dies rather than the test */
        _exit(child_checks(held));
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid, "waitpid");
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "child (held %d): %s %d (exit bits: see its messages)", held,
          WIFEXITED(status) ? "exit status" : "signal",
          WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
}

int main(int argc, char **argv) {
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    arxConfig_t cfg = ARX_CONFIG_INITIALIZER;
    cfg.device = arxDeviceHost;
    cfg.timeoutMs = 30000;
    arxResult_t r = arxCommInit(&comm, MPI_COMM_WORLD, &cfg);
    if (r != arxSuccess) {
        fprintf(stderr, "fork_host: rank %d: arxCommInit: %s\n", rank, arxGetLastError(NULL));
        MPI_Abort(MPI_COMM_WORLD, 1);
    }

    prepare(1);
    r = arxAllReduceHost(in, out, N, arxFloat32, arxSum, comm);
    CHECK(r == arxSuccess, "call 1: %s", arxGetLastError(comm));
    check_sum("call 1 (before the forks)");

    /* Call 2: rank 0 makes it on a thread and forks meanwhile; the others
     * join once rank 0 says its forks are done. */
    prepare(2);
    if (rank == 0) {
        fork_and_check(0);
        pthread_t t;
        CHECK(pthread_create(&t, NULL, call_in_thread, NULL) == 0, "pthread_create");
        /* Until the thread is inside its call: arxGetLastError(comm) says
         * so. */
        struct timespec nap = {0, 1000000};
        int inside = 0;
        for (int i = 0; i < 10000 && !inside; i++) {
            inside = strstr(arxGetLastError(comm), "another thread") != NULL;
            if (!inside) nanosleep(&nap, NULL);
        }
        CHECK(inside, "the thread never entered its call");
        if (inside) {
            /* In this process the hold is another thread's: refused, and
             * nothing changes (the thread's call still ends right). */
            float a[8] = {0}, b[8];
            arxResult_t async = arxSuccess;
            r = arxAllReduceHost(a, b, 8, arxFloat32, arxSum, comm);
            CHECK(r == arxInvalidUsage && strstr(arxGetLastError(NULL), "another thread"),
                  "an overlapping call: %d: %s", (int)r, arxGetLastError(NULL));
            r = arxCommGetAsyncError(comm, &async);
            CHECK(r == arxInvalidUsage, "async error during another thread's call: %d", (int)r);
            r = arxCommDestroy(comm);
            CHECK(r == arxInvalidUsage && strstr(arxGetLastError(NULL), "cannot be destroyed"),
                  "destroy during another thread's call: %d: %s", (int)r, arxGetLastError(NULL));
            fork_and_check(1);
        }
        int go = 1;
        for (int p = 1; p < world; p++) MPI_Send(&go, 1, MPI_INT, p, 7, MPI_COMM_WORLD);
        pthread_join(t, NULL);
        CHECK(thread_result == arxSuccess, "call 2 (on a thread): %s", arxGetLastError(comm));
    } else {
        int go;
        MPI_Recv(&go, 1, MPI_INT, 0, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        r = arxAllReduceHost(in, out, N, arxFloat32, arxSum, comm);
        CHECK(r == arxSuccess, "call 2: %s", arxGetLastError(comm));
    }
    check_sum("call 2 (during the fork)");

    for (uint64_t call = 3; call < 8; call++) {
        prepare(call);
        r = arxAllReduceHost(in, out, N, arxFloat32, arxSum, comm);
        CHECK(r == arxSuccess, "call %d: %s", (int)call, arxGetLastError(comm));
        check_sum("a call after the forks");
    }
    r = arxCommDestroy(comm);
    CHECK(r == arxSuccess, "destroy: %s", arxGetLastError(NULL));

    long total = 0;
    MPI_Allreduce(&fails, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) printf("fork_host: %s\n", total ? "FAIL" : "PASS");
    MPI_Finalize();
    return total ? 1 : 0;
}
