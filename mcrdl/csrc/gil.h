// Whether a blocking MPI call may keep the GIL. Releasing and re-taking it costs a few
// mutex and condition-variable operations (~0.08 us a call at 2 ranks here, a quarter of
// a small blocking call's time in mcrdl); keeping it is safe when no other thread of
// this process can need it while the call waits for its peers: a thread that does could
// be what a peer is waiting for (a deadlock that only the watchdog ends).
//
// "auto" (the default): keep it when the interpreter has no Python thread but the
// caller's (and mcrdl's callback threads, below) and none of mcrdl's C++ threads may take
// it (a fusion timer is running, or a Work has a Python completion callback pending:
// GilUser counts them). A C++ thread of another library that takes the GIL for work the
// peers wait on is invisible here: MCRDL_HOLD_GIL=never (docs/api.md) always releases it,
// and the watchdog's message says so.
#pragma once

#include <Python.h>

#include <atomic>

namespace mcrdl {

// 0 never, 1 auto.
void set_hold_gil(int mode);
int hold_gil_mode();

// Whether the calling thread, which holds the GIL, may keep it through a blocking call.
bool may_hold_gil();

// A thread state that an mcrdl thread keeps between the Python callbacks it runs (a lane
// thread, module.cpp keep_thread_state): not a Python thread for may_hold_gil, as such a
// thread takes the GIL only for callbacks, which GilUser counts while pending. Called with
// the GIL held.
void register_callback_thread_state(PyThreadState* ts);

// Counts, while alive, a C++ thread or callback of mcrdl that may take the GIL.
class GilUser {
 public:
  GilUser();
  ~GilUser();
  GilUser(const GilUser&) = delete;
  GilUser& operator=(const GilUser&) = delete;
};

}  // namespace mcrdl
