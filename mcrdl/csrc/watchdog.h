// The watchdog of blocking MPI calls. A blocking MPI collective cannot be interrupted, so
// the timeout contract (API.md "Timeouts") is kept from outside the call: the calling
// thread arms its slot before entering MPI and disarms it after; a watchdog thread that
// finds one call armed past its timeout prints, on that rank, the CommTimeoutError text
// the nonblocking path raises and ends the job with MPI_Abort (as NCCL's watchdog does
// under torch). Arming costs a few plain stores: no lock, no clock read.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "lane.h"  // timeout_message

namespace mcrdl {

// One thread's blocking call, seqlock-style: `gen` is odd while a call is armed; the
// fields are written only while it is even, and the watchdog reads them only when `gen`
// is odd and unchanged around the read.
struct WatchSlot {
  std::atomic<uint64_t> gen{0};
  std::atomic<const char*> op{nullptr};
  std::atomic<const std::string*> backend{nullptr}, group{nullptr};
  std::atomic<uint64_t> seq{0};
  std::atomic<double> timeout_s{0.0};
  std::atomic<bool> held_gil{false};  // the call kept the GIL (gil.h)
  std::atomic<double> spent_s{0.0};    // the op's time before this call: it may take the rest
};

// The calling thread's slot (registered, and the watchdog thread started, on first use).
WatchSlot& watch_slot();

// watch_slot() of the first thread that asks (a communicator's usual caller) without the
// thread_local lookup, which in a shared library is a call to __tls_get_addr: two more
// cache lines of code and data on every blocking call. Other threads get their own slot.
// A thread that reuses a dead owner's id reuses its slot too, which no one else uses.
class SlotCache {
 public:
  WatchSlot& get() {
    WatchSlot* s = slot_.load(std::memory_order_acquire);
    const pthread_t me = pthread_self();
    if (s && pthread_equal(owner_, me)) return *s;
    WatchSlot& mine = watch_slot();
    if (!s && !claimed_.exchange(true, std::memory_order_acq_rel)) {
      owner_ = me;  // read only after the acquire load of slot_ above
      slot_.store(&mine, std::memory_order_release);
    }
    return mine;
  }

 private:
  std::atomic<WatchSlot*> slot_{nullptr};
  std::atomic<bool> claimed_{false};
  pthread_t owner_{};
};

// Arms the calling thread's slot for the lifetime of the guard. The strings must outlive it.
class WatchGuard {
 public:
  // spent_s: how long the op ran before this call (a step of a multi-step op): the call
  // may take the rest of the op's timeout. Only this form writes it (the slot of the
  // "mpi" backend's single-call ops keeps 0 without a store).
  WatchGuard(const char* op, const std::string* backend, const std::string* group, uint64_t seq,
             double timeout_s, double spent_s)
      : s_(watch_slot()), spent_(spent_s > 0) {
    if (spent_) s_.spent_s.store(spent_s, std::memory_order_relaxed);
    arm(op, backend, group, seq, timeout_s, false);
  }
  WatchGuard(WatchSlot& slot, const char* op, const std::string* backend,
             const std::string* group, uint64_t seq, double timeout_s, bool held_gil)
      : s_(slot) {
    arm(op, backend, group, seq, timeout_s, held_gil);
  }
  ~WatchGuard() {
    s_.gen.store(s_.gen.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    if (spent_) {  // disarmed: gen is even
      std::atomic_thread_fence(std::memory_order_release);
      s_.spent_s.store(0.0, std::memory_order_relaxed);
    }
  }
  WatchGuard(const WatchGuard&) = delete;
  WatchGuard& operator=(const WatchGuard&) = delete;

 private:
  void arm(const char* op, const std::string* backend, const std::string* group, uint64_t seq,
           double timeout_s, bool held_gil) {
    // The fields of this call after the even gen of the last (seqlock writer): on x86 a
    // compiler barrier only.
    std::atomic_thread_fence(std::memory_order_release);
    s_.held_gil.store(held_gil, std::memory_order_relaxed);
    s_.op.store(op, std::memory_order_relaxed);
    s_.backend.store(backend, std::memory_order_relaxed);
    s_.group.store(group, std::memory_order_relaxed);
    s_.seq.store(seq, std::memory_order_relaxed);
    s_.timeout_s.store(timeout_s, std::memory_order_relaxed);
    s_.gen.store(s_.gen.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  }

  WatchSlot& s_;
  bool spent_ = false;
};

}  // namespace mcrdl
