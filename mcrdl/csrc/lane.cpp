#include "lane.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <sstream>

namespace mcrdl {

using Clock = std::chrono::steady_clock;

// Polls before the first yield. Measured on 2 cores: with 2 ranks, 64 polls beat
// yielding at once (8 B all_reduce +0.25 us vs +0.66 us over raw MPI); with 4 ranks
// (oversubscribed) yielding at once wins (+6 us vs +19 us) and never yielding is
// catastrophic (6.5 ms). The MPI backend sets it from ranks per node vs cores.
std::atomic<uint64_t> g_poll_spins{64};

void set_poll_spins(uint64_t n) { g_poll_spins.store(n, std::memory_order_relaxed); }

namespace {

// Polling back-off: spin briefly (lowest latency), then yield (oversubscribed ranks on
// few cores). Waiters never sleep (a sleep would add its length to the op's latency);
// lane threads, which only provide background progress, sleep in short slices once
// nothing has completed for a while.
class Backoff {
 public:
  // Polls before the first yield (measured: 64, 4096 and 10^6 give the same large-message
  // times at 2 ranks; yielding helps when ranks outnumber cores).
  static constexpr uint64_t kSpins = 0;
  explicit Backoff(bool may_sleep) : may_sleep_(may_sleep) {}
  void pause() {
    ++n_;
    if (n_ < g_poll_spins.load(std::memory_order_relaxed)) return;
    if (!may_sleep_ || n_ < 20000) {
      sched_yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  void reset() { n_ = 0; }

 private:
  bool may_sleep_;
  uint64_t n_ = 0;
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

void Work::wait(double timeout_s) {
  if (timeout_s < 0) timeout_s = timeout_s_;
  if (!progress()) {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(timeout_s));
    Backoff backoff(false);
    uint32_t iter = 0;
    while (!progress()) {
      if ((++iter & 63) == 0 && Clock::now() > deadline) {
        std::ostringstream s;
        s << op_ << " on backend '" << backend_ << "' (group " << group_ << ", sequence number "
          << seq_ << ") did not complete within " << timeout_s
          << " s; a rank of the group may never have called it, may be stuck, or may have died "
             "(set MCRDL_DEBUG=1 to check that all ranks issue the same calls)";
        if (timeout_s == timeout_s_)
          if (auto lane = lane_.lock()) lane->fail(s.str(), nullptr);
        throw Error(ErrorKind::Timeout, s.str());
      }
      backoff.pause();
    }
  }
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
    inflight_.push_back(std::move(w));
  }
  cv_.notify_one();
}

size_t Lane::in_flight() {
  std::lock_guard<std::mutex> g(mu_);
  return inflight_.size();
}

void Lane::synchronize(double timeout_s) {
  std::vector<std::shared_ptr<Work>> snapshot;
  {
    std::lock_guard<std::mutex> g(mu_);
    snapshot = inflight_;
  }
  for (auto& w : snapshot) w->wait(timeout_s);
}

void Lane::shutdown(const std::string& why, double drain_s) {
  std::vector<std::shared_ptr<Work>> left;
  {
    std::unique_lock<std::mutex> g(mu_);
    if (stop_ && !thread_.joinable()) return;
    // Let ops every rank posted finish (the lane thread keeps progressing them), unless
    // the backend failed: then they may never complete.
    if (healthy() && drain_s > 0)
      drained_.wait_for(g, std::chrono::duration<double>(drain_s),
                        [this] { return inflight_.empty(); });
    stop_ = true;
    left.swap(inflight_);
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (auto& w : left) w->abandon(ErrorKind::BackendUnavailable, w->op() + ": " + why);
}

void Lane::fail(const std::string& why, std::shared_ptr<Work> stuck) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!failed_.load()) {
      why_ = why;
      failed_.store(true, std::memory_order_release);
    }
    if (stuck && !stop_) inflight_.push_back(std::move(stuck));
  }
  cv_.notify_one();
}

void Lane::throw_unhealthy(const char* op) {
  std::lock_guard<std::mutex> g(mu_);
  throw Error(ErrorKind::BackendUnavailable,
              std::string(op) + ": backend '" + name_ +
                  "' is unusable since an earlier operation timed out (ranks no longer issue "
                  "matching operations); finalize and restart the job. Earlier: " + why_);
}

void Lane::loop() {
  Backoff backoff(true);
  std::vector<std::shared_ptr<Work>> snapshot;
  for (;;) {
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [this] { return stop_ || !inflight_.empty(); });
      if (stop_) return;
      snapshot = inflight_;
    }
    bool any_done = false;
    for (auto& w : snapshot) any_done |= w->progress();
    if (any_done) {
      std::lock_guard<std::mutex> g(mu_);
      auto& v = inflight_;
      v.erase(std::remove_if(v.begin(), v.end(),
                             [](const std::shared_ptr<Work>& w) { return w->finished(); }),
              v.end());
      if (v.empty()) drained_.notify_all();
      backoff.reset();
    } else {
      backoff.pause();
    }
  }
}

}  // namespace mcrdl
