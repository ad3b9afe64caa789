#include "gil.h"

#include <Python.h>

#include <algorithm>
#include <vector>

namespace mcrdl {

namespace {
std::atomic<int> g_mode{1};
std::atomic<int64_t> g_users{0};
std::vector<PyThreadState*> g_callback_states;  // read and written with the GIL held

// may_hold_gil's last walk of the thread list, and its answer (GIL held). The list only
// gains thread states at its head, each with a new id, so an unchanged head (pointer and
// id) means no thread state was added since: the answer stands, for the same caller,
// unless one was removed, which can only turn a "no" into a "yes" (a stale "no" releases
// the GIL, the safe side). Walking the list every call reached into four functions of
// libpython and a cache line per thread state.
struct Walk {
  PyThreadState* me = nullptr;
  PyThreadState* head = nullptr;
  uint64_t head_id = 0;
  size_t callbacks = 0;
  bool answer = false;
} g_walk;
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
  PyThreadState* head = PyInterpreterState_ThreadHead(me->interp);
  const auto& cb = g_callback_states;
  if (me == g_walk.me && head == g_walk.head && head->id == g_walk.head_id &&
      cb.size() == g_walk.callbacks)
    return g_walk.answer;
  bool answer = true;
  for (PyThreadState* ts = head; ts && answer; ts = PyThreadState_Next(ts))
    answer = ts == me || std::find(cb.begin(), cb.end(), ts) != cb.end();
  g_walk = {me, head, head->id, cb.size(), answer};
  return answer;
}

}  // namespace mcrdl
