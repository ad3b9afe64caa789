// Work handles and host execution lanes (DESIGN.md "Deadlock-free mixing").
//
// A Work is one posted operation. Whoever needs it done (the caller of a blocking op,
// a thread in Work.wait, or the backend's lane thread) drives it with progress(); a
// try-lock makes exactly one thread test it at a time and run its finish step once.
// A Lane is a backend's dedicated progress thread: it drives every async op of that
// backend in the background, so waiting on one backend never stalls another.
#pragma once

#include "common.h"

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

namespace mcrdl {

// A wait of `s` seconds as the clocks can take it: at most a billion seconds (31 years,
// "forever"), as are inf and NaN; converted to the clock's int64 nanoseconds, 1e10 s
// overflowed into a deadline in the past, and the op timed out at once.
constexpr double kMaxWaitS = 1e9;
inline double bounded_wait(double s) { return s < kMaxWaitS ? s : kMaxWaitS; }

class Lane;

// How many times a waiter polls before it starts yielding the CPU between polls.
void set_poll_spins(uint64_t n);
// Ranks outnumber cores: waiters sleep after 100 us without progress and idle lane
// threads in slices growing to 1 ms: see Backoff in lane.cpp.
void set_idle_sleep(bool on);

// The text of the CommTimeoutError of an op that did not complete within timeout_s: what
// Work::wait raises and what the watchdog of blocking MPI calls prints (watchdog.h).
// own_timeout_s: the op's own timeout, when the wait had another one (the op is then
// still in flight, and the text says so); < 0: timeout_s is the op's own.
std::string timeout_message(const std::string& op, const std::string& backend,
                            const std::string& group, uint64_t seq, double timeout_s,
                            double own_timeout_s = -1.0);

// Poll `done(ctx)` as Work::wait polls a Work (the waiters' backoff) until it returns
// true (then true), or until timeout_s has passed (then false). For a blocking call that
// waits on its own thread without a Work; the caller keeps the GIL only where nothing
// else of the process can need it (may_hold_gil).
bool wait_polling(bool (*done)(void*), void* ctx, double timeout_s);

class Work {
 public:
  Work(const char* op, const std::string& backend, const std::string& group, uint64_t seq,
       double timeout_s, std::weak_ptr<Lane> lane = {})
      : op_(op), backend_(backend), group_(group), seq_(seq), timeout_s_(timeout_s),
        lane_(std::move(lane)) {}

  // Progress the op once: true when it is complete (successfully or not).
  std::function<bool()> test;
  // Runs once after completion (copy-back, cast-back, averaging); may throw Error.
  std::function<void()> finish;
  // The ops of one `gate_queue` (a communicator's collectives) are issued to MPI in the
  // order of their sequence numbers: the lane tests only each queue's oldest unfinished op
  // instead of every op in flight on every pass (see Lane::loop). An op that another
  // thread issues (a communicator's issue thread, issuer.h) has a `gate`: testing it is
  // pointless until `*gate` is set.
  std::shared_ptr<const std::atomic<bool>> gate;
  const void* gate_queue = nullptr;

  bool progress();
  bool is_completed() { return progress(); }
  // A multi-step op (pccl's schedules) reports each completed step: a lane that sees steps
  // complete keeps polling at full rate instead of backing off into sleeps.
  void advanced() { advances_.fetch_add(1, std::memory_order_relaxed); }
  uint64_t advances() const { return advances_.load(std::memory_order_relaxed); }
  // Blocks (the GIL must be released by the caller) until done; throws Error on
  // failure, CommTimeout-kind Error past the deadline. timeout < 0: the default.
  void wait(double timeout_s = -1.0);
  // Fail the op without completing it (lane shut down, backend failed).
  void abandon(ErrorKind kind, const std::string& why);
  // The op was waited on for `timeout_s` (< 0: its default timeout) by a caller that keeps
  // the time itself (a watchdog): unless it has completed since, throw the CommTimeout-kind
  // Error wait() throws at its deadline, and fail the lane as wait() does when that is the
  // op's default timeout. Never blocks.
  void time_out(double timeout_s);

  // What a completion callback is told: failed, then the error's kind and message.
  using Callback = std::function<void(bool failed, ErrorKind kind, const std::string& why)>;
  // Run `cb` once the op has completed or failed: at once on this thread when it already
  // has, else on the thread that completes it (a lane thread, a waiter, an is_completed
  // poll), after the op's own locks are released. Callbacks run in registration order,
  // one at a time; whatever one throws is dropped (a lane thread must survive it).
  void on_complete(Callback cb);

  const std::string& op() const { return op_; }
  const std::string& backend() const { return backend_; }
  const std::string& group() const { return group_; }
  uint64_t seq() const { return seq_; }
  bool failed() const { return state_.load(std::memory_order_acquire) == kFailed; }
  bool finished() const { return state_.load(std::memory_order_acquire) != kPending; }

 private:
  enum : int { kPending = 0, kDone = 1, kFailed = 2 };
  void complete(int state);
  // Run the callbacks registered so far, and those registered meanwhile (by the thread
  // that completed the op, once, with no lock of the op held).
  void run_callbacks();
  void call(Callback& cb);
  std::string timeout_message(double timeout_s) const;

  std::string op_, backend_, group_;
  uint64_t seq_;
  double timeout_s_;
  std::weak_ptr<Lane> lane_;  // told when the op times out under the default timeout
  std::atomic<int> state_{kPending};
  std::atomic<uint64_t> advances_{0};
  std::mutex claim_;
  std::mutex mu_;
  std::condition_variable cv_;
  ErrorKind err_kind_ = ErrorKind::Runtime;
  std::string err_;
  std::vector<Callback> callbacks_;  // under mu_
  bool callbacks_ran_ = false;       // under mu_: later callbacks run at once
};

class Lane {
 public:
  explicit Lane(std::string name);
  ~Lane();
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  // Hand an async op to the lane thread, which progresses it until completion.
  void track(std::shared_ptr<Work> w);
  // Wait for every op tracked so far (GIL released by the caller).
  void synchronize(double timeout_s);
  // Ops tracked and not finished.
  size_t in_flight();
  // Wait up to drain_s for the ops in flight to complete, then stop the thread; ops still
  // in flight are abandoned with `why` (their buffers are kept: MPI may still use them).
  void shutdown(const std::string& why, double drain_s);
  const std::string& name() const { return name_; }

  // After an op timed out the backend's ops no longer match across ranks: the lane
  // keeps the op (its buffers stay alive) and refuses new ops with the reason.
  void fail(const std::string& why, std::shared_ptr<Work> stuck);
  bool healthy() const { return !failed_.load(std::memory_order_acquire); }
  // Shut down (finalized): throw_unhealthy then says the backend is closed.
  bool closed() {
    std::lock_guard<std::mutex> g(mu_);
    return stop_;
  }
  [[noreturn]] void throw_unhealthy(const char* op);

 private:
  void loop();
  std::atomic<bool> failed_{false};
  std::string why_;

  std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable drained_;
  void add_locked(std::shared_ptr<Work> w);
  // Every op tracked, finished ones until the lane purges them (synchronize, shutdown).
  std::vector<std::shared_ptr<Work>> inflight_;
  std::vector<std::shared_ptr<Work>> fresh_;  // tracked since the lane thread last took them
  size_t purged_at_ = 0;  // inflight_'s size after the lane's last purge
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace mcrdl
