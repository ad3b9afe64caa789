/* What a caller's own time between two small blocking collectives costs per call.
 *
 * A C loop calls MPI_Allreduce (or MPI_Bcast) on 8 bytes back to back; a Python loop,
 * with or without mcrdl, spends some time between the calls. This program adds a busy
 * wait of D ns after every call on rank 0 only, on rank 1 only, or on every rank, and
 * prints the time per call (median of 21 trials of the per-trial maximum over ranks),
 * with mcrdl's MPI setup (MPI_THREAD_MULTIPLE; give it mcrdl's MPICH selection file as
 * below). The rise over D = 0, against D, says how much of a caller's time lands on
 * the call's critical path: the floor under any Python caller's "mcrdl - C" at 8 B
 * (docs/performance.md, "The C floor").
 *
 *   MPICC=$(dirname $(python -c 'import sys; print(sys.executable)'))/mpicc
 *   $MPICC -O2 -o /tmp/caller_delay benchmarks/caller_delay.c
 *   MPIR_CVAR_CH4_POSIX_COLL_SELECTION_TUNING_JSON_FILE=$PWD/mcrdl/tuning/mpich_posix_coll.json \
 *     mpiexec -n 2 /tmp/caller_delay allreduce 0 50 100 200 400
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <x86intrin.h>

#define TRIALS 21
#define CALLS 20000

/* Busy-waits `ns` nanoseconds on the time-stamp counter (`ghz` ticks per ns). */
static void spin(double ns, double ghz) {
  if (ns <= 0) return;
  const unsigned long long t0 = __rdtsc(), n = (unsigned long long)(ns * ghz);
  while (__rdtsc() - t0 < n) _mm_pause();
}

static int cmp(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char** argv) {
  int provided, rank;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (argc < 3 || (strcmp(argv[1], "allreduce") && strcmp(argv[1], "bcast"))) {
    if (rank == 0) fprintf(stderr, "usage: caller_delay allreduce|bcast NS [NS ...]\n");
    MPI_Finalize();
    return 2;
  }
  const int bcast = strcmp(argv[1], "bcast") == 0;
  /* the counter's rate, over 0.2 s of wall time */
  const double w0 = MPI_Wtime();
  const unsigned long long c0 = __rdtsc();
  while (MPI_Wtime() - w0 < 0.2) {
  }
  const double ghz = (double)(__rdtsc() - c0) / ((MPI_Wtime() - w0) * 1e9);
  float a[2] = {1, 2};
  static const char* who[] = {"none", "rank 0", "rank 1", "every rank"};
  double base = 0;
  for (int i = 2; i < argc; ++i) {
    const double d = atof(argv[i]);
    for (int w = 0; w < 4; ++w) {
      if ((d == 0) != (w == 0)) continue;
      const double mine = (w == 3 || (w == 1 && rank == 0) || (w == 2 && rank == 1)) ? d : 0;
      double t[TRIALS];
      for (int tr = 0; tr < TRIALS; ++tr) {
        MPI_Barrier(MPI_COMM_WORLD);
        const double s = MPI_Wtime();
        for (int k = 0; k < CALLS; ++k) {
          if (bcast) MPI_Bcast(a, 2, MPI_FLOAT, 0, MPI_COMM_WORLD);
          else MPI_Allreduce(MPI_IN_PLACE, a, 2, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
          spin(mine, ghz);
        }
        const double e = (MPI_Wtime() - s) / CALLS;
        MPI_Allreduce(&e, &t[tr], 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      }
      qsort(t, TRIALS, sizeof(double), cmp);
      const double us = t[TRIALS / 2] * 1e6;
      if (w == 0) base = us;
      if (rank == 0)
        printf("%s 8 B, %4.0f ns after each call on %-10s: %.3f us per call (%+.3f)\n",
               argv[1], d, who[w], us, d == 0 ? 0.0 : us - base);
    }
  }
  fflush(stdout);
  MPI_Finalize();
  return 0;
}
