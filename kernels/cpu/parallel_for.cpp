#include "kernels/cpu/parallel_for.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace loom::cpu {
namespace {

class Pool {
 public:
  explicit Pool(int n) {
    for (int i = 0; i < n; ++i) workers_.emplace_back([this] { work(); });
  }
  ~Pool() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return int(workers_.size()) + 1; }

  void run(int64_t chunks, const std::function<void(int64_t)>& task) {
    std::unique_lock lock(mu_);
    // A nested call (a kernel calling another from inside a worker) runs inline.
    if (busy_) {
      lock.unlock();
      for (int64_t c = 0; c < chunks; ++c) task(c);
      return;
    }
    busy_ = true;
    task_ = &task;
    next_ = 0;
    total_ = chunks;
    done_ = 0;
    error_ = nullptr;
    ++generation_;
    cv_.notify_all();
    lock.unlock();
    drain();
    lock.lock();
    done_cv_.wait(lock, [this] { return done_ == total_; });
    busy_ = false;
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void drain() {
    for (;;) {
      int64_t c;
      const std::function<void(int64_t)>* task;
      {
        std::lock_guard lock(mu_);
        if (!task_ || next_ >= total_) return;
        c = next_++;
        task = task_;
      }
      std::exception_ptr err;
      try {
        (*task)(c);
      } catch (...) {
        err = std::current_exception();
      }
      std::lock_guard lock(mu_);
      if (err && !error_) error_ = err;
      if (++done_ == total_) done_cv_.notify_all();
    }
  }
  void work() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || (generation_ != seen && task_); });
        if (stop_) return;
        seen = generation_;
      }
      drain();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t)>* task_ = nullptr;
  int64_t next_ = 0, total_ = 0, done_ = 0;
  uint64_t generation_ = 0;
  bool busy_ = false, stop_ = false;
  std::exception_ptr error_;
};

}  // namespace

std::vector<int> affinity_cpus() {
  std::vector<int> ids;
  for (int size = CPU_SETSIZE; size <= (1 << 20); size *= 2) {
    cpu_set_t* set = CPU_ALLOC(size);
    if (!set) break;
    const size_t bytes = CPU_ALLOC_SIZE(size);
    CPU_ZERO_S(bytes, set);
    const int got = ::sched_getaffinity(0, bytes, set);
    const int error = errno;
    if (got == 0)
      for (int c = 0; c < size; ++c)
        if (CPU_ISSET_S(c, bytes, set)) ids.push_back(c);
    CPU_FREE(set);
    if (got == 0 || error != EINVAL) break;
  }
  return ids;
}

namespace {

// LOOM_NUM_THREADS, else the CPUs this process may run on (its affinity mask, which
// taskset, cgroups' cpusets and loomrun --cpu-bind narrow), else every CPU of the machine.
int configured_threads() {
  if (const char* env = std::getenv("LOOM_NUM_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  if (const size_t allowed = affinity_cpus().size()) return int(allowed);
  return std::max(1u, std::thread::hardware_concurrency());
}

// The pool is made on first use and never destroyed (its workers end with the process).
// fork() copies the pool into the child without its worker threads, and possibly with its
// mutex held by a worker caught mid-step, so a child that used it could hang: the child
// drops the inherited pool, unused, and makes its own on first use. This is what lets a
// program run tensor ops and then fork ranks, as the multi-process tests do.
std::atomic<Pool*> current_pool{nullptr};

void forget_pool_in_child() { current_pool.store(nullptr, std::memory_order_relaxed); }

Pool& pool() {
  Pool* p = current_pool.load(std::memory_order_acquire);
  if (p) return *p;
  static const int registered = ::pthread_atfork(nullptr, nullptr, forget_pool_in_child);
  (void)registered;
  auto* fresh = new Pool(configured_threads() - 1);
  if (current_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return *fresh;
  delete fresh;  // another thread made one first
  return *p;
}

}  // namespace

int num_threads() { return pool().size(); }

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  int64_t chunks = std::min<int64_t>((n + grain - 1) / grain, int64_t(num_threads()) * 4);
  if (chunks <= 1) {
    body(0, n);
    return;
  }
  int64_t per = (n + chunks - 1) / chunks;
  pool().run(chunks, [&](int64_t c) {
    int64_t b = c * per, e = std::min(n, b + per);
    if (b < e) body(b, e);
  });
}

}  // namespace loom::cpu
