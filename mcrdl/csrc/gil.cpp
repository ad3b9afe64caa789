#include "gil.h"

#include <Python.h>

#include <algorithm>
#include <vector>

namespace mcrdl {

namespace {
std::atomic<int> g_mode{1};
std::atomic<int64_t> g_users{0};
std::vector<PyThreadState*> g_callback_states;  // read and written with the GIL held
}  // namespace

void register_callback_thread_state(PyThreadState* ts) { g_callback_states.push_back(ts); }

void set_hold_gil(int mode) { g_mode.store(mode, std::memory_order_relaxed); }
int hold_gil_mode() { return g_mode.load(std::memory_order_relaxed); }

GilUser::GilUser() { g_users.fetch_add(1, std::memory_order_acq_rel); }
GilUser::~GilUser() { g_users.fetch_sub(1, std::memory_order_acq_rel); }

bool may_hold_gil() {
  if (g_mode.load(std::memory_order_relaxed) == 0) return false;
  if (g_users.load(std::memory_order_acquire) != 0) return false;
  // No thread state but ours and the callback threads'. New ones are linked under the
  // runtime's head lock, not the GIL: one being made right now is a thread that will then
  // wait for the GIL, which is the invisible case of gil.h anyway.
  PyThreadState* me = PyThreadState_Get();
  for (PyThreadState* ts = PyInterpreterState_ThreadHead(PyThreadState_GetInterpreter(me)); ts;
       ts = PyThreadState_Next(ts)) {
    if (ts == me) continue;
    const auto& cb = g_callback_states;
    if (std::find(cb.begin(), cb.end(), ts) == cb.end()) return false;
  }
  return true;
}

}  // namespace mcrdl
