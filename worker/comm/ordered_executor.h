// Runs a backend's collectives one at a time on a thread of its own, in the order they were
// submitted. A backend that routes every call through one (synchronous calls submit and
// wait) gets asynchronous Start* calls that keep the cross-rank order of communicator.h.
//
// Thread-safety: thread-safe.
#ifndef LATHE_WORKER_COMM_ORDERED_EXECUTOR_H_
#define LATHE_WORKER_COMM_ORDERED_EXECUTOR_H_

#include <deque>
#include <functional>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "worker/comm/communicator.h"

namespace lathe {

class OrderedExecutor {
 public:
  OrderedExecutor();
  // Runs what is still queued, then stops the thread. Declare the executor as the owner's
  // last member, so that it stops before anything its collectives use is destroyed.
  ~OrderedExecutor();

  OrderedExecutor(const OrderedExecutor&) = delete;
  OrderedExecutor& operator=(const OrderedExecutor&) = delete;

  // Queues `collective`; its handle's Wait returns what it returned.
  std::unique_ptr<CommWork> Submit(std::function<absl::Status()> collective);

  struct Task;  // one submitted collective and its outcome (ordered_executor.cc)

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<std::shared_ptr<Task>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace lathe

#endif  // LATHE_WORKER_COMM_ORDERED_EXECUTOR_H_
