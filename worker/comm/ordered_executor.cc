#include "worker/comm/ordered_executor.h"

#include <utility>

namespace lathe {

struct OrderedExecutor::Task {
  std::function<absl::Status()> collective;
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
};

namespace {

class QueuedWork final : public CommWork {
 public:
  explicit QueuedWork(std::shared_ptr<OrderedExecutor::Task> task) : task_(std::move(task)) {}
  ~QueuedWork() override {
    if (!waited_) Wait().IgnoreError();
  }

  absl::Status Wait() override {
    waited_ = true;
    absl::MutexLock lock(&task_->mu);
    task_->mu.Await(absl::Condition(&task_->done));
    return task_->status;
  }

 private:
  const std::shared_ptr<OrderedExecutor::Task> task_;
  bool waited_ = false;
};

}  // namespace

OrderedExecutor::OrderedExecutor() : thread_([this] { Loop(); }) {}

OrderedExecutor::~OrderedExecutor() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

std::unique_ptr<CommWork> OrderedExecutor::Submit(std::function<absl::Status()> collective) {
  auto task = std::make_shared<Task>();
  task->collective = std::move(collective);
  {
    absl::MutexLock lock(&mu_);
    queue_.push_back(task);
  }
  return std::make_unique<QueuedWork>(std::move(task));
}

void OrderedExecutor::Loop() {
  while (true) {
    std::shared_ptr<Task> task;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    absl::Status status = task->collective();
    absl::MutexLock lock(&task->mu);
    task->status = std::move(status);
    task->done = true;
  }
}

}  // namespace lathe
