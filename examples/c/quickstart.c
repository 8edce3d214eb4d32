/* The smallest arx program in C (the README's C quick start). */
#include <arx.h>
#include <mpi.h>
#include <stdio.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    arxComm_t comm;
    if (arxCommInit(&comm, MPI_COMM_WORLD, NULL) != arxSuccess) {
        fprintf(stderr, "arxCommInit: %s\n", arxGetLastError(NULL));
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    int rank, ranks;
    arxCommUserRank(comm, &rank);
    arxCommCount(comm, &ranks);
    float x[4] = {1.0f, 2.0f, 3.0f, (float)rank};
    arxResult_t r = arxAllReduceHost(x, x, 4, arxFloat32, arxSum, comm); /* in place */
    if (r != arxSuccess) {
        fprintf(stderr, "arxAllReduceHost: %s\n", arxGetLastError(comm));
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    /* Every rank: ranks, 2 ranks, 3 ranks, 0 + 1 + ... + (ranks - 1). */
    int ok = x[0] == ranks && x[1] == 2 * ranks && x[2] == 3 * ranks &&
             x[3] == ranks * (ranks - 1) / 2;
    printf("rank %d of %d: %g %g %g %g %s\n", rank, ranks, x[0], x[1], x[2], x[3],
           ok ? "ok" : "WRONG");
    arxCommDestroy(comm);
    MPI_Finalize();
    return ok ? 0 : 1;
}
