// A fixed set of threads that run the coordinator's unary RPC handlers. gRPC's callback
// threads then never block on the scheduler's lock or the store (a blocked one would delay
// every heartbeat stream it serves), and the server's threads do not grow with its callers.
//
// Thread-safety: thread-safe.
#ifndef LATHE_COORDINATOR_API_WORK_POOL_H_
#define LATHE_COORDINATOR_API_WORK_POOL_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace lathe {

class WorkPool {
 public:
  // REQUIRES: threads >= 1, max_queued >= 1.
  WorkPool(int threads, size_t max_queued);
  // Runs what is queued, then joins the threads.
  ~WorkPool();
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  // Queues `work`; false (nothing queued) when max_queued already wait: the caller answers
  // UNAVAILABLE, which clients retry with backoff.
  bool Schedule(std::function<void()> work);

 private:
  void Run();

  const size_t max_queued_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_API_WORK_POOL_H_
