/* Time inside and outside MPI per collective call, for benchmarks/call_gap.py: a PMPI
 * library that call_gap.py preloads (LD_PRELOAD) into its ranks.
 *
 * Between cg_start() and cg_stop() it counts the collectives that begin (a blocking call,
 * or the post of a nonblocking one; MPI_Barrier only with cg_start(1)) and sums two
 * times. Inside: from a collective's entry to the return of the blocking call, or of the
 * MPI_Wait, MPI_Test or MPI_Testall that completes it. Outside: from that return to the
 * next collective's entry. The outside time is what the caller runs between two calls
 * (its own code: mcrdl's, the Python loop's) with the misses it takes there after a large
 * call has evicted its lines; that is the part of a call mcrdl can change, measured on
 * the real run instead of estimated from a total that swings by more between runs.
 *
 * The loops measured keep one collective in flight at a time, and only one thread
 * calls MPI while one runs, so plain statics suffice; a collective that begins while
 * another is in flight is not counted, and any completing MPI_Wait or MPI_Test ends
 * the one in flight (an async op polled meanwhile would end it early).
 *
 * On a nonblocking variant "inside" runs from the post to the completing test: the
 * caller's polling between tests (mcrdl's backoff, MPI_Wait's in the C arms) counts as
 * inside MPI. */
#include <mpi.h>
#include <time.h>

static int on, count_barrier, inside;
static double last_exit, entered, sum_in, sum_out;
static long calls;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

void cg_start(int barrier) {
  count_barrier = barrier;
  inside = 0;
  last_exit = sum_in = sum_out = 0;
  calls = 0;
  on = 1;
}

void cg_stop(void) { on = 0; }

/* The collectives counted since cg_start; *in and *out: their seconds inside and
 * outside MPI (outside: between consecutive ones, so one gap fewer than calls). */
long cg_read(double* in, double* out) {
  *in = sum_in;
  *out = sum_out;
  return calls;
}

/* 1 if this call began a counted collective. */
static int enter(void) {
  if (!on || inside) return 0;
  double t = now();
  if (last_exit > 0) sum_out += t - last_exit;
  entered = t;
  inside = 1;
  ++calls;
  return 1;
}

/* A post that failed began nothing (its gap stays counted: an error ends the run). */
static void unenter(void) {
  inside = 0;
  --calls;
}

static void leave(void) {
  if (!on || !inside) return;
  double t = now();
  sum_in += t - entered;
  last_exit = t;
  inside = 0;
}

#define BLOCKING(call) \
  {                    \
    enter();           \
    int rc = call;     \
    leave();           \
    return rc;         \
  }
#define POST(call)                                \
  {                                               \
    int began = enter();                          \
    int rc = call;                                \
    if (rc != MPI_SUCCESS && began) unenter();    \
    return rc;                                    \
  }

/* The collectives of c_floor.c and of mcrdl's blocking and nonblocking paths for its
 * ops, in both the int and the large-count (_c, MPI 4) bindings. */
int MPI_Allreduce(const void* s, void* r, int n, MPI_Datatype t, MPI_Op o, MPI_Comm c)
    BLOCKING(PMPI_Allreduce(s, r, n, t, o, c))
#if MPI_VERSION >= 4
int MPI_Allreduce_c(const void* s, void* r, MPI_Count n, MPI_Datatype t, MPI_Op o, MPI_Comm c)
    BLOCKING(PMPI_Allreduce_c(s, r, n, t, o, c))
#endif
int MPI_Iallreduce(const void* s, void* r, int n, MPI_Datatype t, MPI_Op o, MPI_Comm c,
                   MPI_Request* q) POST(PMPI_Iallreduce(s, r, n, t, o, c, q))
#if MPI_VERSION >= 4
int MPI_Iallreduce_c(const void* s, void* r, MPI_Count n, MPI_Datatype t, MPI_Op o, MPI_Comm c,
                     MPI_Request* q) POST(PMPI_Iallreduce_c(s, r, n, t, o, c, q))
#endif
int MPI_Allgather(const void* s, int sn, MPI_Datatype st, void* r, int rn, MPI_Datatype rt,
                  MPI_Comm c) BLOCKING(PMPI_Allgather(s, sn, st, r, rn, rt, c))
#if MPI_VERSION >= 4
int MPI_Allgather_c(const void* s, MPI_Count sn, MPI_Datatype st, void* r, MPI_Count rn,
                    MPI_Datatype rt, MPI_Comm c) BLOCKING(PMPI_Allgather_c(s, sn, st, r, rn, rt, c))
#endif
int MPI_Iallgather(const void* s, int sn, MPI_Datatype st, void* r, int rn, MPI_Datatype rt,
                   MPI_Comm c, MPI_Request* q) POST(PMPI_Iallgather(s, sn, st, r, rn, rt, c, q))
#if MPI_VERSION >= 4
int MPI_Iallgather_c(const void* s, MPI_Count sn, MPI_Datatype st, void* r, MPI_Count rn,
                     MPI_Datatype rt, MPI_Comm c, MPI_Request* q)
    POST(PMPI_Iallgather_c(s, sn, st, r, rn, rt, c, q))
#endif
int MPI_Bcast(void* b, int n, MPI_Datatype t, int root, MPI_Comm c)
    BLOCKING(PMPI_Bcast(b, n, t, root, c))
#if MPI_VERSION >= 4
int MPI_Bcast_c(void* b, MPI_Count n, MPI_Datatype t, int root, MPI_Comm c)
    BLOCKING(PMPI_Bcast_c(b, n, t, root, c))
#endif
int MPI_Ibcast(void* b, int n, MPI_Datatype t, int root, MPI_Comm c, MPI_Request* q)
    POST(PMPI_Ibcast(b, n, t, root, c, q))
#if MPI_VERSION >= 4
int MPI_Ibcast_c(void* b, MPI_Count n, MPI_Datatype t, int root, MPI_Comm c, MPI_Request* q)
    POST(PMPI_Ibcast_c(b, n, t, root, c, q))
#endif
int MPI_Reduce_scatter_block(const void* s, void* r, int n, MPI_Datatype t, MPI_Op o, MPI_Comm c)
    BLOCKING(PMPI_Reduce_scatter_block(s, r, n, t, o, c))
#if MPI_VERSION >= 4
int MPI_Reduce_scatter_block_c(const void* s, void* r, MPI_Count n, MPI_Datatype t, MPI_Op o,
                               MPI_Comm c) BLOCKING(PMPI_Reduce_scatter_block_c(s, r, n, t, o, c))
#endif
int MPI_Ireduce_scatter_block(const void* s, void* r, int n, MPI_Datatype t, MPI_Op o,
                              MPI_Comm c, MPI_Request* q)
    POST(PMPI_Ireduce_scatter_block(s, r, n, t, o, c, q))
#if MPI_VERSION >= 4
int MPI_Ireduce_scatter_block_c(const void* s, void* r, MPI_Count n, MPI_Datatype t, MPI_Op o,
                                MPI_Comm c, MPI_Request* q)
    POST(PMPI_Ireduce_scatter_block_c(s, r, n, t, o, c, q))
#endif

int MPI_Barrier(MPI_Comm c) {
  if (!count_barrier) return PMPI_Barrier(c);
  BLOCKING(PMPI_Barrier(c))
}
int MPI_Ibarrier(MPI_Comm c, MPI_Request* q) {
  if (!count_barrier) return PMPI_Ibarrier(c, q);
  POST(PMPI_Ibarrier(c, q))
}

/* Completions: the collective in flight ends when its request does. */
int MPI_Wait(MPI_Request* q, MPI_Status* st) {
  int rc = PMPI_Wait(q, st);
  leave();
  return rc;
}
int MPI_Test(MPI_Request* q, int* flag, MPI_Status* st) {
  int rc = PMPI_Test(q, flag, st);
  if (rc == MPI_SUCCESS && *flag) leave();
  return rc;
}
int MPI_Testall(int n, MPI_Request* q, int* flag, MPI_Status* st) {
  int rc = PMPI_Testall(n, q, flag, st);
  if (rc == MPI_SUCCESS && *flag) leave();
  return rc;
}
