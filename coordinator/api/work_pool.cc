#include "coordinator/api/work_pool.h"

#include <utility>

namespace lathe {

WorkPool::WorkPool(int threads, size_t max_queued) : max_queued_(max_queued) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

WorkPool::~WorkPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
}

bool WorkPool::Schedule(std::function<void()> work) {
  absl::MutexLock lock(&mu_);
  if (queue_.size() >= max_queued_) return false;
  queue_.push_back(std::move(work));
  return true;
}

void WorkPool::Run() {
  for (;;) {
    std::function<void()> work;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](WorkPool* pool)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return pool->stopping_ || !pool->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping, and nothing left
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    work();
  }
}

}  // namespace lathe
