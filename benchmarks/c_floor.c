/* The C floor of mcrdl's mpi backend (benchmarks/c_floor.py builds and runs it): per op
 * and size, the time of the blocking MPI collective and of the nonblocking one plus
 * MPI_Wait, as the median over trials of the per-trial maximum over ranks.
 * Usage: c_floor TRIALS SIZE... ; prints "op bytes blocking_s nonblocking_s" lines.
 * C_FLOOR_THREAD_MULTIPLE=1 initializes MPI with MPI_THREAD_MULTIPLE, as mcrdl must
 * (its lane threads call MPI): MPICH's small collectives are much slower then.
 *
 * Built with -shared -DC_FLOOR_LIB (and Python's include directory) it is the CPython
 * extension module `c_floor` instead: c_floor.py's mcrdl ranks call its time() (the
 * in-process reference) on the same buffers as mcrdl's calls, interleaved with them
 * trial by trial, and its call() once per iteration of a Python loop (the Python
 * caller's floor).
 *
 * Fairness rules, for both: buffers are allocated once, 64-byte aligned and written
 * before any timing (as torch.zeros does for mcrdl's); the calls per trial are
 * calibrated by time, not by size (a batch of at least 20 ms on the slowest rank and of
 * at least 8 calls, the calibration batches doubling as warm-up): a count from the size
 * alone assumed about 1 us per small call, while with more ranks than cores a call takes
 * milliseconds; and the variants alternate trial by trial, so a change of the machine's
 * load meets both. */
#ifdef C_FLOOR_LIB
#define PY_SSIZE_T_CLEAN
#include <Python.h>  /* first, as Python requires */
#endif
#include <mpi.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { ALL_REDUCE, ALL_GATHER, BCAST, REDUCE_SCATTER, BARRIER, NOPS };

/* all_gather / reduce_scatter as the blocking MPI_Allreduce of the whole buffer, of which
 * each rank keeps its part (mcrdl's "allreduce" variant, written as a C user would: the
 * gathered buffer zeroed but for this rank's part and OR-reduced in 64-bit words; the
 * input reduced into a scratch buffer, this rank's block copied out). */
static void via_allreduce(int op, float* a, float* b, long count, long per, int n) {
  static float* scratch;
  static long scratch_n;
  int me;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  if (op == ALL_GATHER) {
    memset(b, 0, count * 4);
    memcpy(b + me * per, a, per * 4);
    if (count % 2 == 0)
      MPI_Allreduce(MPI_IN_PLACE, b, (int)(count / 2), MPI_UINT64_T, MPI_BOR, MPI_COMM_WORLD);
    else
      MPI_Allreduce(MPI_IN_PLACE, b, (int)count, MPI_UINT32_T, MPI_BOR, MPI_COMM_WORLD);
  } else {
    if (scratch_n < count) {
      free(scratch);
      scratch = aligned_alloc(64, (count * 4 + 63) / 64 * 64);
      scratch_n = count;
    }
    MPI_Allreduce(a, scratch, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    memcpy(b, scratch + me * per, per * 4);
  }
}

/* One call of `op` on `bytes` (the tuning table's size: all_gather's output,
 * reduce_scatter's input) of float32, blocking (1) or nonblocking + wait (0); 2:
 * all_gather / reduce_scatter via_allreduce (the library's callers only). */
static void call(int op, int blocking, float* a, float* b, long bytes, int n) {
  long count = bytes / 4, per = count / n;
  MPI_Request r;
  if (blocking == 2 && (op == ALL_GATHER || op == REDUCE_SCATTER)) {
    via_allreduce(op, a, b, count, per, n);
    return;
  }
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

/* Seconds per call of `it` calls on this rank, after a barrier. */
static double batch(int op, int blocking, float* a, float* b, long bytes, int n, long it) {
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = MPI_Wtime();
  for (long k = 0; k < it; ++k) call(op, blocking, a, b, bytes, n);
  return (MPI_Wtime() - t0) / it;
}

#ifdef C_FLOOR_LIB
/* The module c_floor, which c_floor.py's rank part imports. */

/* The `want` integer arguments of `sig` into `v`; 0 with a Python error set if they are
 * not that. */
static int int_args(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t want, const char* sig,
                    long long* v) {
  if (nargs != want) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", sig, want, nargs);
    return 0;
  }
  for (Py_ssize_t i = 0; i < want; ++i) v[i] = PyLong_AsLongLong(args[i]);
  return !PyErr_Occurred();
}

/* c_floor.time(op, blocking, a, b, bytes, it): the in-process reference, seconds per call
 * of `it` calls of `op` (0 all_reduce, 1 all_gather, 2 bcast, 3 reduce_scatter, 4
 * barrier) on MPI_COMM_WORLD, on this rank. */
static PyObject* py_time(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  long long v[6];
  int n;
  (void)self;
  if (!int_args(args, nargs, 6, "time(op, blocking, a, b, bytes, it)", v)) return NULL;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return PyFloat_FromDouble(batch((int)v[0], (int)v[1], (float*)(intptr_t)v[2],
                                  (float*)(intptr_t)v[3], (long)v[4], n, (long)v[5]));
}

/* c_floor.call(op, blocking, a, b, bytes): one call, made once per iteration of a Python
 * loop as mcrdl's calls are (the reference for what a Python caller of C pays per call).
 * A METH_FASTCALL function that converts five ints and nothing more: the smallest entry
 * from Python into C. ctypes and pybind11 entries are not a floor: their calls run
 * 3-15% slower at 256 KiB-4 MiB (docs/performance.md). */
static PyObject* py_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  long long v[5];
  int n;
  (void)self;
  if (!int_args(args, nargs, 5, "call(op, blocking, a, b, bytes)", v)) return NULL;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  call((int)v[0], (int)v[1], (float*)(intptr_t)v[2], (float*)(intptr_t)v[3], (long)v[4], n);
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"time", (PyCFunction)(void (*)(void))py_time, METH_FASTCALL, "seconds per call"},
    {"call", (PyCFunction)(void (*)(void))py_call, METH_FASTCALL, "one call of an op"},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "c_floor", NULL, -1, methods};
PyMODINIT_FUNC PyInit_c_floor(void) { return PyModule_Create(&module); }
#else
static const char* NAMES[NOPS] = {"all_reduce", "all_gather", "bcast", "reduce_scatter",
                                  "barrier"};

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static double max_over_ranks(double mine) {
  double all;
  MPI_Allreduce(&mine, &all, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return all;
}

/* A trial's rules (c_floor.py reads these three lines): a batch of at least TRIAL_S
 * seconds on the slowest rank, of at least MIN_ITERS calls (a 16 MiB call takes 3-7 ms
 * here: 20 ms alone made a trial the mean of 4-6 of them) and at most MAX_ITERS. */
#define TRIAL_S 0.02
#define MIN_ITERS 8
#define MAX_ITERS 4000

/* Calls per trial: batches grow until one takes TRIAL_S; the same rule as c_floor.py's
 * calibrate(). */
static long calibrate(int op, int blocking, float* a, float* b, long bytes, int n) {
  long it = 1;
  for (;;) {
    double t = max_over_ranks(batch(op, blocking, a, b, bytes, n, it)) * it;
    if (t >= TRIAL_S || it >= MAX_ITERS) return it < MIN_ITERS ? MIN_ITERS : it;
    long next = t > 0 ? (long)(it * 1.25 * TRIAL_S / t) + 1 : it * 8;
    it = next < 2 * it ? 2 * it : next > MAX_ITERS ? MAX_ITERS : next;
  }
}

static float* buffer(long bytes) {
  void* p = NULL;
  if (posix_memalign(&p, 64, (size_t)bytes)) abort();
  memset(p, 0, (size_t)bytes);
  return p;
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
  float* a = buffer(maxb + 4L * n);
  float* b = buffer(maxb + 4L * n);
  double* t[2] = {malloc(sizeof(double) * trials), malloc(sizeof(double) * trials)};
  for (int op = 0; op < NOPS; ++op) {
    for (int i = 2; i < argc; ++i) {
      long bytes = atol(argv[i]);
      if (op == BARRIER && i > 2) break;
      if (op == BARRIER) bytes = 0;
      if ((op == ALL_GATHER || op == REDUCE_SCATTER) && bytes < 4L * n) continue;
      long it[2];  /* [0] nonblocking, [1] blocking */
      for (int blocking = 1; blocking >= 0; --blocking)
        it[blocking] = calibrate(op, blocking, a, b, bytes, n);
      for (int tr = 0; tr < trials; ++tr)
        for (int k = 0; k < 2; ++k) {
          int blocking = (tr + k) % 2;  /* each variant first in every other trial */
          t[blocking][tr] = max_over_ranks(batch(op, blocking, a, b, bytes, n, it[blocking]));
        }
      double med[2];
      for (int v = 0; v < 2; ++v) {
        qsort(t[v], trials, sizeof(double), cmp);
        med[v] = t[v][trials / 2];
      }
      if (rank == 0) printf("%s %ld %.9g %.9g\n", NAMES[op], bytes, med[1], med[0]);
      fflush(stdout);
    }
  }
  free(a); free(b); free(t[0]); free(t[1]);
  MPI_Finalize();
  return 0;
}
#endif
