#include "lane.h"

#include <cxxabi.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <sstream>
#include <thread>

namespace mcrdl {

using Clock = std::chrono::steady_clock;

// Polls before the first yield. Measured on 2 cores: with 2 ranks, 64 polls beat
// yielding at once (8 B all_reduce +0.25 us vs +0.66 us over raw MPI); with 4 ranks
// (oversubscribed) yielding at once wins (+6 us vs +19 us) and never yielding is
// catastrophic (6.5 ms). The MPI backend sets it from ranks per node vs cores.
std::atomic<uint64_t> g_poll_spins{64};
// Ranks outnumber cores: waiters and idle lanes sleep (set with the spins, from the same
// test; see Backoff).
std::atomic<bool> g_idle_sleep{false};

void set_poll_spins(uint64_t n) { g_poll_spins.store(n, std::memory_order_relaxed); }
void set_idle_sleep(bool on) { g_idle_sleep.store(on, std::memory_order_relaxed); }

namespace {

// Polling back-off: spin briefly (lowest latency), then yield; then, where noted, sleep.
//
// Ranks fit the cores: waiters never sleep. A sleep adds its length to the op's latency
// (sleeping after 0-16 yields cost 3-800x on small messages; waiters sleeping 1/8 of the
// time waited after 2000 polls cost 19-35% on 4 MiB MPI collectives, whose internal
// rounds advance only when polled), and a yielding waiter costs nothing when no other
// thread wants its core.
//
// Ranks outnumber cores (set_idle_sleep): a waiter yields for kWaitYield without
// progress, then sleeps kWaitSleep between polls, which the kernel rounds up to the
// thread's timer slack (50 us by default). Here the peer a waiter waits for often shares
// its core and is still computing, and a yielding waiter stays runnable, so it keeps
// taking a share of that core. 4 ranks on 2 cores, one TED MoE step
// (benchmarks/moe_step.py, (2,2,2)) on "mpi" took 1.10-4.3x as long as on "gloo" (whose
// waits block in the kernel) with yielding waiters, and 0.57-0.92x with sleeping ones.
// Sleeps growing to 1/8 of the time waited (up to 1 ms) suited the step as well (a yield
// budget of 20-100 us gave the same step times, 1 ms lost: 1.28x gloo) but made
// isolated 1-4 MiB MPI collectives 1.9-4.7x slower than raw MPI (their rounds advance
// only when polled, and a sleeping rank delays every round), against 1.03-1.13x with
// yielding and 0.89-1.3x (one 3.2x outlier) with the short sleeps. Ops that complete
// within the budget, small messages among them, keep the yielding latency; multi-step
// ops (Work::advanced) restart the budget at each step.
//
// Lane threads, which only provide background progress (a waiter polls its own op),
// sleep once nothing completed for 20000 polls: 50 us per poll, and when ranks outnumber
// cores 1/8 of the time without progress, 50 us to 1 ms.
// There 50 us sleeps (20000 wake-ups a second per lane) starved ranks that had work:
// 6 ranks on 2 cores, 3 of them running 640 checks in a sub-group while the other 3
// waited on async ops (the layout of tests/pccl/check_pccl.py) took 0.96-54.9 s (median
// 1.4 s; the outliers timed CI out), and 0.78-1.08 s with the growing sleeps (0.45 s with
// the 3 waiting ranks asleep in Python). A lane's sleep ends early when it gets a new op,
// and a multi-step op reports each step (Work::advanced), which restarts the count.
class Backoff {
 public:
  explicit Backoff(bool lane) : lane_(lane), since_(Clock::now()) {}
  // One pause between polls; `sleep(d)` sleeps up to d (returning early is fine).
  template <typename Sleep>
  void pause(Sleep&& sleep) {
    ++n_;
    if (n_ < g_poll_spins.load(std::memory_order_relaxed)) return;
    const bool oversubscribed = g_idle_sleep.load(std::memory_order_relaxed);
    if (!lane_) {
      if (!oversubscribed || idle_time() < kWaitYield) return (void)sched_yield();
      return sleep(kWaitSleep);
    }
    if (n_ < kLaneYields) return (void)sched_yield();
    if (!oversubscribed) return sleep(kMinSleep);
    sleep(std::clamp(idle_time() / 8, kMinSleep, kMaxSleep));
  }
  void reset() {
    n_ = 0;
    since_ = Clock::now();
  }

 private:
  std::chrono::microseconds idle_time() const {
    return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - since_);
  }
  static constexpr uint64_t kLaneYields = 20000;
  static constexpr std::chrono::microseconds kMinSleep{50}, kMaxSleep{1000};
  static constexpr std::chrono::microseconds kWaitYield{100}, kWaitSleep{1};
  bool lane_;
  uint64_t n_ = 0;
  Clock::time_point since_;  // when the polls without progress began
};

}  // namespace

bool Work::progress() {
  if (state_.load(std::memory_order_acquire) != kPending) return true;
  std::unique_lock<std::mutex> claim(claim_, std::try_to_lock);
  if (!claim.owns_lock()) return false;
  if (state_.load(std::memory_order_acquire) != kPending) return true;
  try {
    if (!test()) return false;
    if (finish) finish();
    complete(kDone);
  } catch (const Error& e) {
    err_kind_ = e.kind();
    err_ = e.what();
    complete(kFailed);
  } catch (const std::exception& e) {
    err_kind_ = ErrorKind::Runtime;
    err_ = std::string(op_) + " on backend '" + backend_ + "' failed: " + e.what();
    complete(kFailed);
  }
  claim.unlock();
  run_callbacks();
  return true;
}

void Work::complete(int state) {
  test = nullptr;  // release captured buffers early
  finish = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    state_.store(state, std::memory_order_release);
  }
  cv_.notify_all();
}

void Work::abandon(ErrorKind kind, const std::string& why) {
  {
    std::lock_guard<std::mutex> claim(claim_);
    if (state_.load() != kPending) return;
    err_kind_ = kind;
    err_ = why;
    // MPI may still write into the op's buffers (a collective cannot be cancelled): keep
    // them alive for the rest of the process instead of freeing them.
    static auto* graveyard = new std::vector<std::function<bool()>>();
    static std::mutex graveyard_mu;
    {
      std::lock_guard<std::mutex> g(graveyard_mu);
      graveyard->push_back(std::move(test));
    }
    complete(kFailed);
  }
  run_callbacks();
}

void Work::on_complete(Callback cb) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!callbacks_ran_) {  // pending, or its completer has not finished the callbacks
      callbacks_.push_back(std::move(cb));
      return;
    }
  }
  call(cb);
}

void Work::run_callbacks() {
  for (;;) {
    std::vector<Callback> batch;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (callbacks_.empty()) {
        callbacks_ran_ = true;
        return;
      }
      batch.swap(callbacks_);
    }
    for (auto& cb : batch) call(cb);
  }
}

void Work::call(Callback& cb) {
  const bool failed = state_.load(std::memory_order_acquire) == kFailed;
  try {
    cb(failed, err_kind_, err_);
  } catch (const abi::__forced_unwind&) {
    throw;  // thread cancellation must unwind
  } catch (...) {
  }
  cb = nullptr;  // release what it captured here, not when the Work goes
}

std::string timeout_message(const std::string& op, const std::string& backend,
                            const std::string& group, uint64_t seq, double timeout_s,
                            double own_timeout_s) {
  std::ostringstream s;
  s << op << " on backend '" << backend << "' (group " << group << ", sequence number " << seq
    << ") did not complete within " << timeout_s << " s";
  if (own_timeout_s >= 0 && own_timeout_s != timeout_s)
    s << " (the wait's timeout; the op's own is " << own_timeout_s
      << " s): it is still in flight, and a later wait may complete it";
  else
    s << "; a rank of the group may never have called it, may be stuck, or may have died "
         "(set MCRDL_DEBUG=1 to check that all ranks issue the same calls)";
  return s.str();
}

std::string Work::timeout_message(double timeout_s) const {
  return mcrdl::timeout_message(op_, backend_, group_, seq_, timeout_s, timeout_s_);
}

void Work::time_out(double timeout_s) {
  if (timeout_s < 0) timeout_s = timeout_s_;
  if (progress()) return;
  const std::string why = timeout_message(timeout_s);
  if (timeout_s == timeout_s_)
    if (auto lane = lane_.lock()) lane->fail(why, nullptr);
  throw Error(ErrorKind::Timeout, why);
}

namespace {

// A waiter's loop: poll `done()` with the waiters' backoff until it returns true (then
// true), or until `timeout_s` has passed (then false). `steps()` counts the steps of a
// multi-step op: when it moves, polling goes back to full rate.
template <typename Done, typename Steps>
bool poll_until(Done&& done, Steps&& steps, double timeout_s) {
  if (done()) return true;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(bounded_wait(timeout_s)));
  Backoff backoff(false);
  uint32_t iter = 0;
  uint64_t seen = steps();
  while (!done()) {
    if (steps() != seen) {
      seen = steps();
      backoff.reset();
    }
    if ((++iter & 63) == 0 && Clock::now() > deadline) return false;
    backoff.pause([](std::chrono::microseconds d) { std::this_thread::sleep_for(d); });
  }
  return true;
}

}  // namespace

bool wait_polling(bool (*done)(void*), void* ctx, double timeout_s) {
  return poll_until([&] { return done(ctx); }, [] { return uint64_t{0}; }, timeout_s);
}

void Work::wait(double timeout_s) {
  if (timeout_s < 0) timeout_s = timeout_s_;
  if (!poll_until([this] { return progress(); }, [this] { return advances(); }, timeout_s))
    time_out(timeout_s);  // raises, unless the op completed meanwhile
  if (state_.load(std::memory_order_acquire) == kFailed) throw Error(err_kind_, err_);
}

Lane::Lane(std::string name) : name_(std::move(name)) { thread_ = std::thread([this] { loop(); }); }

Lane::~Lane() { shutdown("the lane was destroyed", 0.0); }

void Lane::track(std::shared_ptr<Work> w) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stop_) {
      w->abandon(ErrorKind::BackendUnavailable,
                 w->op() + ": backend '" + w->backend() + "' was finalized");
      return;
    }
    add_locked(std::move(w));
  }
  cv_.notify_one();
}

void Lane::add_locked(std::shared_ptr<Work> w) {
  inflight_.push_back(w);
  fresh_.push_back(std::move(w));
}

size_t Lane::in_flight() {
  std::lock_guard<std::mutex> g(mu_);
  return std::count_if(inflight_.begin(), inflight_.end(),
                       [](const std::shared_ptr<Work>& w) { return !w->finished(); });
}

void Lane::synchronize(double timeout_s) {
  std::vector<std::shared_ptr<Work>> snapshot;
  {
    std::lock_guard<std::mutex> g(mu_);
    snapshot = inflight_;
  }
  for (auto& w : snapshot) w->wait(timeout_s);
}

namespace {

// A drain still waiting this long names its ops on stderr: one that waits for a peer
// which never posts its side (a recv nothing sends) would otherwise be a silent wait of
// the whole timeout.
constexpr double kDrainQuietS = 1.0;

// "recv (group world, sequence number 1), ..." for the ops not finished yet; their count.
std::pair<std::string, size_t> unfinished(const std::vector<std::shared_ptr<Work>>& ws) {
  std::ostringstream s;
  size_t n = 0;
  for (auto& w : ws) {
    if (w->finished()) continue;
    if (n < 4)
      s << (n ? ", " : "") << w->op() << " (group " << w->group() << ", sequence number "
        << w->seq() << ")";
    ++n;
  }
  if (n > 4) s << " and " << n - 4 << " more";
  return {s.str(), n};
}

}  // namespace

void Lane::shutdown(const std::string& why, double drain_s) {
  std::vector<std::shared_ptr<Work>> left;
  bool drained = true;
  {
    std::unique_lock<std::mutex> g(mu_);
    if (stop_ && !thread_.joinable()) return;
    // Let ops every rank posted finish (the lane thread keeps progressing them), unless
    // the backend failed: then they may never complete.
    if (healthy() && drain_s > 0) {
      auto empty = [this] { return inflight_.empty(); };
      const double quiet = std::min(drain_s, kDrainQuietS);
      drained = drained_.wait_for(g, std::chrono::duration<double>(bounded_wait(quiet)), empty);
      if (!drained && drain_s > quiet) {
        auto [ops, n] = unfinished(inflight_);
        std::fprintf(stderr,
                     "mcrdl: %s: waiting up to %.3g s more for %zu op%s still in flight on "
                     "lane '%s': %s (a rank may never post its side)\n",
                     why.c_str(), drain_s - quiet, n, n == 1 ? "" : "s", name_.c_str(),
                     ops.c_str());
        std::fflush(stderr);
        drained = drained_.wait_for(g, std::chrono::duration<double>(bounded_wait(drain_s - quiet)), empty);
      }
    }
    stop_ = true;
    left.swap(inflight_);
    // Calls made after this (through a backend method kept past finalize) are refused
    // by the one check every post makes (healthy()), with why_ as the reason.
    if (!failed_.load()) {
      why_ = why;
      failed_.store(true, std::memory_order_release);
    }
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (!drained) {
    auto [ops, n] = unfinished(left);
    if (n) {
      std::fprintf(stderr, "mcrdl: %s: abandoned %zu op%s that did not complete: %s\n",
                   why.c_str(), n, n == 1 ? "" : "s", ops.c_str());
      std::fflush(stderr);
    }
  }
  for (auto& w : left) w->abandon(ErrorKind::BackendUnavailable, w->op() + ": " + why);
}

void Lane::fail(const std::string& why, std::shared_ptr<Work> stuck) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!failed_.load()) {
      why_ = why;
      failed_.store(true, std::memory_order_release);
    }
    if (stuck && !stop_) add_locked(std::move(stuck));
  }
  cv_.notify_one();
}

void Lane::throw_unhealthy(const char* op) {
  std::lock_guard<std::mutex> g(mu_);
  if (stop_)
    throw Error(ErrorKind::BackendUnavailable,
                std::string(op) + ": backend '" + name_ + "' is closed (" + why_ +
                    "); mcrdl.init() starts a new session");
  throw Error(ErrorKind::BackendUnavailable,
              std::string(op) + ": backend '" + name_ +
                  "' is unusable since an earlier operation timed out (ranks no longer issue "
                  "matching operations); finalize and restart the job. Earlier: " + why_);
}

// The lane's own lists: `polled`, the ops it tests on every pass, and per order queue
// (Work::gate_queue: a communicator's collectives) its ops in sequence order, of which it
// tests only the oldest unfinished one, once its gate (if any) is open. Testing every op
// in flight on every pass cost O(ops in flight) per pass, and more inside MPI: each test
// of a nonblocking op runs MPICH's progress engine, which visits every nonblocking
// collective in flight, so a pass over N ops cost O(N^2). And a pass ran per turn of the
// threads sharing a core (the issue thread's MPI call yields in its progress loop, waiters
// yield): with N small async ops queued on an issue thread each one's issue waited for
// O(N) work of the lane, so N ops took O(N^2) (512 all_reduces of 1 KiB at 2 ranks, MPI
// initialized by mpi4py: 230 us an op against 40 us at 64). Testing the oldest op drives
// MPI's progress for all of them; a later op that completes first is seen when it heads
// the queue, or at once by a thread waiting on it (a waiter tests its own op).
// inflight_ (for synchronize and shutdown) is purged of finished ops when the lane has
// nothing left, or once they are half of it (amortized O(1) an op).
void Lane::loop() {
  Backoff backoff(true);
  std::vector<std::shared_ptr<Work>> polled, fresh;
  std::vector<std::pair<const void*, std::deque<std::shared_ptr<Work>>>> ordered;
  size_t n_ordered = 0;
  auto sleep = [this](std::chrono::microseconds d) {
    std::unique_lock<std::mutex> g(mu_);
    cv_.wait_for(g, d, [this] { return stop_ || !fresh_.empty(); });
  };
  for (;;) {
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [&] { return stop_ || !fresh_.empty() || !polled.empty() || n_ordered; });
      if (stop_) return;
      if (!fresh_.empty()) {
        backoff.reset();  // a new op: poll it at full rate
        fresh.swap(fresh_);
      }
    }
    for (auto& w : fresh) {
      if (!w->gate_queue) {
        polled.push_back(std::move(w));
        continue;
      }
      auto q = std::find_if(ordered.begin(), ordered.end(),
                            [&](const auto& e) { return e.first == w->gate_queue; });
      if (q == ordered.end())
        q = ordered.emplace(ordered.end(), w->gate_queue, std::deque<std::shared_ptr<Work>>{});
      // in issue order: threads posting on one communicator may track in another order
      // than they posted, but its sequence numbers follow the posts (both under its lock)
      auto at = q->second.end();
      while (at != q->second.begin() && (*(at - 1))->seq() > w->seq()) --at;
      q->second.insert(at, std::move(w));
      ++n_ordered;
    }
    fresh.clear();
    bool any_done = false, moved = false;
    for (auto& [key, q] : ordered) {
      while (!q.empty()) {
        Work& w = *q.front();
        if (!w.finished()) {
          if (w.gate && !w.gate->load(std::memory_order_acquire)) break;
          const uint64_t steps = w.advances();
          const bool done = w.progress();
          moved |= w.advances() != steps;
          if (!done) break;
        }
        q.pop_front();
        --n_ordered;
        any_done = true;
      }
    }
    for (auto& w : polled) {
      const uint64_t steps = w->advances();
      any_done |= w->progress();
      moved |= w->advances() != steps;
    }
    if (any_done) {
      polled.erase(std::remove_if(polled.begin(), polled.end(),
                                  [](const std::shared_ptr<Work>& w) { return w->finished(); }),
                   polled.end());
      std::lock_guard<std::mutex> g(mu_);
      auto& v = inflight_;
      if (polled.empty() && !n_ordered && fresh_.empty()) {
        v.clear();  // every op tracked has finished
        purged_at_ = 0;
      } else if (v.size() >= 2 * purged_at_ + 64) {
        v.erase(std::remove_if(v.begin(), v.end(),
                               [](const std::shared_ptr<Work>& w) { return w->finished(); }),
                v.end());
        purged_at_ = v.size();
      }
      if (v.empty()) drained_.notify_all();
    }
    if (any_done || moved)
      backoff.reset();
    else
      backoff.pause(sleep);
  }
}

}  // namespace mcrdl
