/* Calls under a sampling profiler's signals, through the C ABI (run by
 * scripts/test-capi under mpirun -n 2 and 3; prints "signals_host: PASS").
 *
 * Profilers (perf's and gperftools' SIGPROF, Score-P, py-spy's timers) and
 * timeouts (SIGALRM) interrupt a process thousands of times a second, in
 * any of its threads, the proxy thread included. The handlers here are
 * installed without SA_RESTART, so every blocking system call they land in
 * returns EINTR: arx must carry on. Every call of several sizes, types and
 * placements is checked against reference.h (independent of arx), and the
 * test fails if the signals did not arrive. */
#define _POSIX_C_SOURCE 200809L
#include <arx.h>
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

/* This program uses part of the reference. */
#pragma GCC diagnostic ignored "-Wunused-function"
#include "../../examples/c/reference.h"

static volatile sig_atomic_t hits;
static void on_signal(int s) {
    (void)s;
    hits++;
}

int main(int argc, char **argv) {
    int rank, world;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal; /* no SA_RESTART: interrupted calls fail with EINTR */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGPROF, &sa, NULL);
    sigaction(SIGALRM, &sa, NULL);
    /* Start-up under a dense timer (its shared segment is reserved page
     * by page, and the reservation gives up when a signal is pending),
     * the calls under a profiler's usual rate. */
    struct itimerval prof = {{0, 200}, {0, 200}}, real = {{0, 300}, {0, 300}};
    struct itimerval dense = {{0, 20}, {0, 20}};
    setitimer(ITIMER_PROF, &prof, NULL);
    setitimer(ITIMER_REAL, &dense, NULL);

    arxComm_t comm;
    arxConfig_t cfg = ARX_CONFIG_INITIALIZER;
    cfg.timeoutMs = 30000;
    arxResult_t r = arxCommInit(&comm, MPI_COMM_WORLD, &cfg);
    if (r != arxSuccess) {
        fprintf(stderr, "signals_host: rank %d: arxCommInit: %s\n", rank, arxGetLastError(NULL));
        MPI_Abort(MPI_COMM_WORLD, 1);
    }

    setitimer(ITIMER_REAL, &real, NULL);

    /* Up to ~2 MiB of float32: calls over one slot (chunked) too. */
    static const size_t sizes[] = {1, 7, 1000, 4099, 65536, 300001, 600000};
    enum { MAX = 600000, CALLS = 63 };
    char *in = malloc(MAX * 4), *out = malloc(MAX * 4), *expect = malloc(MAX * 4);
    long fails = 0;
    for (int call = 0; call < CALLS && in && out && expect; call++) {
        size_t n = sizes[call % 7];
        int t = (call / 7) % REF_TYPES, in_place = (call / 21) % 2;
        ref_fill(t, 7000 + (uint64_t)call, rank, world, n, in, expect);
        void *dst = in_place ? (void *)in : (void *)out;
        if (!in_place) memset(out, 0xa5, n * ref_size(t));
        r = arxAllReduceHost(in, dst, n, (arxDataType_t)t, arxSum, comm);
        size_t first = 0, wrong = r == arxSuccess ? ref_wrong(t, dst, expect, n, &first) : 0;
        if (r != arxSuccess || wrong) {
            fails++;
            fprintf(stderr, "signals_host: rank %d: call %d (%zu x %s, %s): %s, %zu wrong (first %zu)\n",
                    rank, call, n, ref_type_name[t], in_place ? "in place" : "out of place",
                    r == arxSuccess ? "ok" : arxGetLastError(comm), wrong, first);
            if (r != arxSuccess) break;
        }
    }
    r = arxCommDestroy(comm);
    if (r != arxSuccess) {
        fails++;
        fprintf(stderr, "signals_host: rank %d: destroy: %s\n", rank, arxGetLastError(NULL));
    }
    struct itimerval off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_PROF, &off, NULL);
    setitimer(ITIMER_REAL, &off, NULL);
    if (hits < 100) {
        fails++;
        fprintf(stderr, "signals_host: rank %d: only %d signals arrived\n", rank, (int)hits);
    }
    long total = 0, all_hits = 0, mine = hits;
    MPI_Allreduce(&fails, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&mine, &all_hits, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
        printf("signals_host: %s (%d calls per rank under %ld signals)\n", total ? "FAIL" : "PASS",
               CALLS, all_hits);
    free(in);
    free(out);
    free(expect);
    MPI_Finalize();
    return total ? 1 : 0;
}
