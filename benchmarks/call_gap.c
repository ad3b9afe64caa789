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
 * another is in flight is not counted. */
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

static void enter(void) {
  if (!on || inside) return;
  double t = now();
  if (last_exit > 0) sum_out += t - last_exit;
  entered = t;
  inside = 1;
  ++calls;
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
#define POST(call) \
  {                \
    enter();       \
    return call;   \
  }

/* The collectives of c_floor.c and of mcrdl's blocking and nonblocking paths for its
 * ops, in both the int and the large-count (_c) bindings. */
int MPI_Allreduce(const void* s, void* r, int n, MPI_Datatype t, MPI_Op o, MPI_Comm c)
    BLOCKING(PMPI_Allreduce(s, r, n, t, o, c))
int MPI_Allreduce_c(const void* s, void* r, MPI_Count n, MPI_Datatype t, MPI_Op o, MPI_Comm c)
    BLOCKING(PMPI_Allreduce_c(s, r, n, t, o, c))
int MPI_Iallreduce(const void* s, void* r, int n, MPI_Datatype t, MPI_Op o, MPI_Comm c,
                   MPI_Request* q) POST(PMPI_Iallreduce(s, r, n, t, o, c, q))
int MPI_Iallreduce_c(const void* s, void* r, MPI_Count n, MPI_Datatype t, MPI_Op o, MPI_Comm c,
                     MPI_Request* q) POST(PMPI_Iallreduce_c(s, r, n, t, o, c, q))
int MPI_Allgather(const void* s, int sn, MPI_Datatype st, void* r, int rn, MPI_Datatype rt,
                  MPI_Comm c) BLOCKING(PMPI_Allgather(s, sn, st, r, rn, rt, c))
int MPI_Allgather_c(const void* s, MPI_Count sn, MPI_Datatype st, void* r, MPI_Count rn,
                    MPI_Datatype rt, MPI_Comm c) BLOCKING(PMPI_Allgather_c(s, sn, st, r, rn, rt, c))
int MPI_Iallgather(const void* s, int sn, MPI_Datatype st, void* r, int rn, MPI_Datatype rt,
                   MPI_Comm c, MPI_Request* q) POST(PMPI_Iallgather(s, sn, st, r, rn, rt, c, q))
int MPI_Iallgather_c(const void* s, MPI_Count sn, MPI_Datatype st, void* r, MPI_Count rn,
                     MPI_Datatype rt, MPI_Comm c, MPI_Request* q)
    POST(PMPI_Iallgather_c(s, sn, st, r, rn, rt, c, q))
int MPI_Bcast(void* b, int n, MPI_Datatype t, int root, MPI_Comm c)
    BLOCKING(PMPI_Bcast(b, n, t, root, c))
int MPI_Bcast_c(void* b, MPI_Count n, MPI_Datatype t, int root, MPI_Comm c)
    BLOCKING(PMPI_Bcast_c(b, n, t, root, c))
int MPI_Ibcast(void* b, int n, MPI_Datatype t, int root, MPI_Comm c, MPI_Request* q)
    POST(PMPI_Ibcast(b, n, t, root, c, q))
int MPI_Ibcast_c(void* b, MPI_Count n, MPI_Datatype t, int root, MPI_Comm c, MPI_Request* q)
    POST(PMPI_Ibcast_c(b, n, t, root, c, q))
int MPI_Reduce_scatter_block(const void* s, void* r, int n, MPI_Datatype t, MPI_Op o, MPI_Comm c)
    BLOCKING(PMPI_Reduce_scatter_block(s, r, n, t, o, c))
int MPI_Reduce_scatter_block_c(const void* s, void* r, MPI_Count n, MPI_Datatype t, MPI_Op o,
                               MPI_Comm c) BLOCKING(PMPI_Reduce_scatter_block_c(s, r, n, t, o, c))
int MPI_Ireduce_scatter_block(const void* s, void* r, int n, MPI_Datatype t, MPI_Op o,
                              MPI_Comm c, MPI_Request* q)
    POST(PMPI_Ireduce_scatter_block(s, r, n, t, o, c, q))
int MPI_Ireduce_scatter_block_c(const void* s, void* r, MPI_Count n, MPI_Datatype t, MPI_Op o,
                                MPI_Comm c, MPI_Request* q)
    POST(PMPI_Ireduce_scatter_block_c(s, r, n, t, o, c, q))

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
  if (*flag) leave();
  return rc;
}
int MPI_Testall(int n, MPI_Request* q, int* flag, MPI_Status* st) {
  int rc = PMPI_Testall(n, q, flag, st);
  if (*flag) leave();
  return rc;
}
