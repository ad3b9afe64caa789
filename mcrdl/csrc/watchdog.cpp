#include "watchdog.h"

#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

namespace mcrdl {

namespace {

using Clock = std::chrono::steady_clock;

// How often the watchdog looks at the slots: a stuck call ends the job between its
// timeout and its timeout plus this period.
constexpr auto kPeriod = std::chrono::milliseconds(200);

struct Registry {
  std::mutex mu;
  std::vector<WatchSlot*> slots;  // never freed: a thread's slot outlives the thread
};

// Never destroyed: the detached watchdog thread may still read it during process exit.
Registry& registry() {
  static auto* r = new Registry();
  return *r;
}

[[noreturn]] void fire(const char* op, const std::string& backend,
                       const std::string& group, uint64_t seq, double timeout_s, bool held_gil) {
  std::string msg = timeout_message(op, backend, group, seq, timeout_s);
  const char* gil =
      held_gil ? "mcrdl: the call kept the GIL (this rank had no other Python thread); if a "
                 "thread that takes the GIL from C or C++ must run for the other ranks to reach "
                 "this call, set MCRDL_HOLD_GIL=never\n"
               : "";
  std::fprintf(stderr,
               "mcrdl: CommTimeoutError: %s\nmcrdl: a blocking MPI call cannot be interrupted; "
               "ending the job with MPI_Abort\n%s",
               msg.c_str(), gil);
  std::fflush(stderr);
  // The launcher relays this rank's stderr through a pipe that MPI_Abort's teardown may
  // close before it is read: give it a moment, so the job's output says why it ended.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();  // MPI_Abort does not return
}

void watch() {
  struct Seen {
    uint64_t gen = 0;
    Clock::time_point since;
  };
  std::vector<Seen> seen;
  std::vector<WatchSlot*> slots;
  for (;;) {
    std::this_thread::sleep_for(kPeriod);
    {
      std::lock_guard<std::mutex> g(registry().mu);
      slots = registry().slots;
    }
    seen.resize(slots.size());
    const auto now = Clock::now();
    for (size_t i = 0; i < slots.size(); ++i) {
      WatchSlot& s = *slots[i];
      const uint64_t g1 = s.gen.load(std::memory_order_acquire);
      if (!(g1 & 1)) continue;
      if (seen[i].gen != g1) {  // a call armed since the last look: its clock starts now
        seen[i] = {g1, now};
        continue;
      }
      const char* op = s.op.load(std::memory_order_relaxed);
      const std::string* backend = s.backend.load(std::memory_order_relaxed);
      const std::string* group = s.group.load(std::memory_order_relaxed);
      const uint64_t seq = s.seq.load(std::memory_order_relaxed);
      const double timeout_s = s.timeout_s.load(std::memory_order_relaxed);
      const bool held_gil = s.held_gil.load(std::memory_order_relaxed);
      const double spent_s = s.spent_s.load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (s.gen.load(std::memory_order_relaxed) != g1) continue;  // it completed meanwhile
      if (now - seen[i].since < std::chrono::duration<double>(timeout_s - spent_s)) continue;
      fire(op, *backend, *group, seq, timeout_s, held_gil);
    }
  }
}

}  // namespace

WatchSlot& watch_slot() {
  thread_local WatchSlot* slot = [] {
    auto* s = new WatchSlot();
    static std::once_flag started;
    std::call_once(started, [] { std::thread(watch).detach(); });
    std::lock_guard<std::mutex> g(registry().mu);
    registry().slots.push_back(s);
    return s;
  }();
  return *slot;
}

}  // namespace mcrdl
