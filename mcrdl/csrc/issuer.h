// A communicator's issue thread (Issuer) and the result of an op it issued (Issued):
// shared by the "mpi" backend (csrc/mpi_comm.cpp) and pccl's MPI-library steps
// (csrc/pccl.cpp).
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "mpi_util.h"

namespace mcrdl {

// Tasks running on issue threads now, over the process: a blocking MPI collective that a
// rank never joins keeps its thread inside MPI for good (its Work's wait raised
// CommTimeoutError), and MPI may not be finalized under it (MPICH then crashes in its
// progress engine). The Python side reads it at exit (mcrdl.bootstrap) and ends the job
// with MPI_Abort instead.
inline std::atomic<int>& issuer_tasks_running() {
  static std::atomic<int> n{0};
  return n;
}

// A communicator's post lock: held only to post an op or to start a blocking call (never
// while waiting for other ranks), so it is almost never contended. An atomic flag, taken
// and released inline: a std::mutex costs calls into libc's pthread_mutex_trylock and
// unlock on every call (their code is cache lines that a large call's data evicted since
// the last call). A waiter yields its core until the flag is free.
class PostLock {
 public:
  bool try_lock() {
    return !held_.load(std::memory_order_relaxed) &&
           !held_.exchange(true, std::memory_order_acquire);
  }
  void lock() {
    while (!try_lock()) std::this_thread::yield();
  }
  void unlock() { held_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> held_{false};
};

// A communicator's issue thread: runs, in order, the ops that must not be issued from
// the caller's thread: async calls of the blocking variant (a blocking MPI call must not
// block an async caller) and every op of the communicator issued while such calls are
// queued or running (MPI matches collectives in issue order, and a blocking collective
// never matches a nonblocking one, so every rank must issue the same variant, async or
// not, in the same order). Its thread starts on first use and holds the Issuer, so a call
// stuck in MPI never touches a freed object.
class Issuer : public std::enable_shared_from_this<Issuer> {
 public:
  // Called with the communicator's post lock held: no task queued or running, and no
  // blocking call running on a caller's thread.
  bool idle() const { return pending_.load(std::memory_order_acquire) == 0; }

  // A blocking collective runs on a caller's thread (begun with the post lock held, when
  // idle): ops issued meanwhile queue here and run after it. The post lock itself is not
  // held during the call: a thread posting an async op must never wait for other ranks
  // (the peer it waits for may need that very op, or a later one of this thread).
  // Lock-free on the hot path (two mutex pairs were ~10% of a small blocking call): the
  // thread reads direct_ under mu_ only while it has tasks to wait for, and tasks pushed
  // during the call raise pending_ above 1, so end_direct wakes it only then, after a
  // lock/unlock of mu_ that orders direct_ = false before the thread's next look.
  void begin_direct() {
    pending_.fetch_add(1, std::memory_order_acq_rel);
    direct_.store(true, std::memory_order_release);
  }
  void end_direct() {
    direct_.store(false, std::memory_order_release);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) > 1) {  // tasks queued meanwhile
      { std::lock_guard<std::mutex> g(mu_); }
      cv_.notify_one();
    }
  }

  // Called with the post lock held (tasks run in the order they were pushed).
  void push(std::function<void()> task) {
    pending_.fetch_add(1, std::memory_order_acq_rel);
    {
      std::lock_guard<std::mutex> g(mu_);
      q_.push_back(std::move(task));
      if (!started_) {
        started_ = true;
        std::thread([self = shared_from_this()] { self->loop(); }).detach();
      }
    }
    cv_.notify_one();
  }

  // Let the thread end once its queue is empty.
  void stop() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [this] {
          return !direct_.load(std::memory_order_acquire) && (stop_ || !q_.empty());
        });
        if (q_.empty()) return;
        task = std::move(q_.front());
        q_.pop_front();
      }
      issuer_tasks_running().fetch_add(1, std::memory_order_relaxed);
      task();  // never throws: a task keeps its MPI error code for its Work
      issuer_tasks_running().fetch_sub(1, std::memory_order_release);
      task = nullptr;
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::atomic<int64_t> pending_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  bool started_ = false, stop_ = false;
  std::atomic<bool> direct_{false};
};

// An op issued by the Issuer: its MPI error code once issued.
struct Issued {
  virtual ~Issued() = default;
  std::atomic<bool> done{false};
  int rc = MPI_SUCCESS;
  // On the issue thread, once the MPI call returned `code`.
  void set(int code) {
    rc = code;
    done.store(true, std::memory_order_release);
  }
  // Whether the op was issued yet; throws its MPI error when issuing failed.
  bool issued(const char* mpi_name) const {
    if (!done.load(std::memory_order_acquire)) return false;
    check_mpi(rc, mpi_name);
    return true;
  }
};

// An op queued on the Issuer that owns what it runs (the MPI call, its buffers): the Work
// that tracks it holds it in its test, and the task only points at it. The task's thread
// must not release the buffers: dropping a tensor's last reference but one from C++ takes
// the GIL to decref its Python object (torch), so an issue thread that did so after each
// call stalled behind a caller holding the GIL (posting a burst of async ops), and issued
// nothing meanwhile. The Work releases them when it completes (Work::complete, on the
// thread that completes it, holding no lane lock), or keeps them for good when abandoned
// (MPI may still use them).
struct Queued : Issued {
  explicit Queued(std::function<int()> call) : call(std::move(call)) {}
  std::function<int()> call;
  // Set when the call has returned, before `done`: the Work's gate (Work::gate). An object
  // of its own, which the Work keeps to its end: the Work is destroyed wherever its last
  // reference goes, under the lane's lock too, where it must not release tensors (the GIL
  // they may take is held by a thread waiting for that lock).
  std::shared_ptr<std::atomic<bool>> returned = std::make_shared<std::atomic<bool>>(false);
  // The task to push: runs the call and publishes its code. The Work must hold this
  // object until done is set (its test does); after set() the task touches only `returned`.
  std::function<void()> task() {
    return [self = this, returned = returned] {
      const int rc = self->call();
      returned->store(true, std::memory_order_release);
      self->set(rc);
    };
  }
};

}  // namespace mcrdl
