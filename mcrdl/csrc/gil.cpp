#include "gil.h"

#include <Python.h>

namespace mcrdl {

namespace {
std::atomic<int> g_mode{1};
std::atomic<int64_t> g_users{0};
}  // namespace

void set_hold_gil(int mode) { g_mode.store(mode, std::memory_order_relaxed); }
int hold_gil_mode() { return g_mode.load(std::memory_order_relaxed); }

GilUser::GilUser() { g_users.fetch_add(1, std::memory_order_acq_rel); }
GilUser::~GilUser() { g_users.fetch_sub(1, std::memory_order_acq_rel); }

bool may_hold_gil() {
  if (g_mode.load(std::memory_order_relaxed) == 0) return false;
  if (g_users.load(std::memory_order_acquire) != 0) return false;
  // The only thread state of the interpreter is ours. New ones are linked under the
  // runtime's head lock, not the GIL: one being made right now is a thread that will then
  // wait for the GIL, which is the case above (invisible) anyway.
  PyThreadState* me = PyThreadState_Get();
  PyThreadState* head = PyInterpreterState_ThreadHead(PyThreadState_GetInterpreter(me));
  return head == me && PyThreadState_Next(me) == nullptr;
}

}  // namespace mcrdl
