/* The C floor of mcrdl's mpi backend (benchmarks/c_floor.py builds and runs it): per op
 * and size, the time of the blocking MPI collective and of the nonblocking one plus
 * MPI_Wait, as the median over trials of the per-trial maximum over ranks.
 * Usage: c_floor TRIALS SIZE... ; prints "op bytes blocking_s nonblocking_s" lines.
 * C_FLOOR_THREAD_MULTIPLE=1 initializes MPI with MPI_THREAD_MULTIPLE, as mcrdl must
 * (its lane threads call MPI): MPICH's small collectives are much slower then. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { ALL_REDUCE, ALL_GATHER, BCAST, REDUCE_SCATTER, BARRIER, NOPS };
static const char* NAMES[NOPS] = {"all_reduce", "all_gather", "bcast", "reduce_scatter",
                                  "barrier"};

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

/* One call of `op` on `bytes` (the tuning table's size: all_gather's output,
 * reduce_scatter's input) of float32, blocking or nonblocking + wait. */
static void call(int op, int blocking, float* a, float* b, long bytes, int n) {
  long count = bytes / 4, per = count / n;
  MPI_Request r;
  switch (op) {
    case ALL_REDUCE:
      if (blocking) MPI_Allreduce(MPI_IN_PLACE, a, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      else {
        MPI_Iallreduce(MPI_IN_PLACE, a, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      }
      break;
    case ALL_GATHER:
      if (blocking) MPI_Allgather(a, (int)per, MPI_FLOAT, b, (int)per, MPI_FLOAT, MPI_COMM_WORLD);
      else {
        MPI_Iallgather(a, (int)per, MPI_FLOAT, b, (int)per, MPI_FLOAT, MPI_COMM_WORLD, &r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      }
      break;
    case BCAST:
      if (blocking) MPI_Bcast(a, (int)count, MPI_FLOAT, 0, MPI_COMM_WORLD);
      else {
        MPI_Ibcast(a, (int)count, MPI_FLOAT, 0, MPI_COMM_WORLD, &r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      }
      break;
    case REDUCE_SCATTER:
      if (blocking)
        MPI_Reduce_scatter_block(a, b, (int)per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      else {
        MPI_Ireduce_scatter_block(a, b, (int)per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      }
      break;
    default:
      if (blocking) MPI_Barrier(MPI_COMM_WORLD);
      else {
        MPI_Ibarrier(MPI_COMM_WORLD, &r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      }
  }
}

/* Calls per trial: about 20 ms of work, at least 3. */
static long iters_for(long bytes) {
  long it = 20000000L / (bytes + 2000);
  return it < 3 ? 3 : it > 4000 ? 4000 : it;
}

int main(int argc, char** argv) {
  const char* mt = getenv("C_FLOOR_THREAD_MULTIPLE");
  if (mt && strcmp(mt, "1") == 0) {
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  } else {
    MPI_Init(&argc, &argv);
  }
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  int trials = atoi(argv[1]);
  long maxb = 8;
  for (int i = 2; i < argc; ++i) if (atol(argv[i]) > maxb) maxb = atol(argv[i]);
  float* a = calloc(maxb / 4 + n, 4);
  float* b = calloc(maxb / 4 + n, 4);
  double* t = malloc(sizeof(double) * trials);
  for (int op = 0; op < NOPS; ++op) {
    for (int i = 2; i < argc; ++i) {
      long bytes = atol(argv[i]);
      if (op == BARRIER && i > 2) break;
      if (op == BARRIER) bytes = 0;
      if ((op == ALL_GATHER || op == REDUCE_SCATTER) && bytes < 4L * n) continue;
      double med[2];
      for (int blocking = 1; blocking >= 0; --blocking) {
        long it = iters_for(bytes);
        for (long k = 0; k < it / 10 + 1; ++k) call(op, blocking, a, b, bytes, n); /* warm-up */
        for (int tr = 0; tr < trials; ++tr) {
          MPI_Barrier(MPI_COMM_WORLD);
          double t0 = MPI_Wtime();
          for (long k = 0; k < it; ++k) call(op, blocking, a, b, bytes, n);
          double mine = (MPI_Wtime() - t0) / it;
          MPI_Allreduce(&mine, &t[tr], 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        }
        qsort(t, trials, sizeof(double), cmp);
        med[1 - blocking] = t[trials / 2];
      }
      if (rank == 0) printf("%s %ld %.9g %.9g\n", NAMES[op], bytes, med[0], med[1]);
      fflush(stdout);
    }
  }
  free(a); free(b); free(t);
  MPI_Finalize();
  return 0;
}
