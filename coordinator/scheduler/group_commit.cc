#include "coordinator/scheduler/group_commit.h"

#include <map>
#include <string>

#include "absl/strings/str_cat.h"

namespace lathe {
namespace {

// The staged batches as one: the newest record of each job and worker.
StoreBatch Merge(const std::deque<std::pair<uint64_t, StoreBatch>>& batches) {
  std::map<std::string, const v1::JobStatus*> jobs;
  std::map<std::string, const v1::WorkerStatus*> workers;  // null: deleted
  for (const auto& [sequence, batch] : batches) {
    for (const v1::JobStatus& job : batch.jobs) jobs[job.job_id()] = &job;
    for (const v1::WorkerStatus& worker : batch.workers) workers[worker.worker_id()] = &worker;
    for (const std::string& id : batch.deleted_workers) workers[id] = nullptr;
  }
  StoreBatch merged;
  for (const auto& [id, job] : jobs) merged.jobs.push_back(*job);
  for (const auto& [id, worker] : workers) {
    if (worker != nullptr) {
      merged.workers.push_back(*worker);
    } else {
      merged.deleted_workers.push_back(id);
    }
  }
  return merged;
}

}  // namespace

uint64_t GroupCommit::Stage(StoreBatch batch) {
  absl::MutexLock lock(&mu_);
  if (batch.empty()) return staged_sequence_;
  staged_.emplace_back(++staged_sequence_, std::move(batch));
  return staged_sequence_;
}

uint64_t GroupCommit::NextSequence() const {
  absl::MutexLock lock(&mu_);
  return staged_sequence_ + 1;
}

absl::Status GroupCommit::WaitDurable(uint64_t sequence) {
  absl::MutexLock lock(&mu_);
  while (durable_.load() < sequence) {
    if (writing_) {
      // Another caller is writing: its batch may hold ours; else ours is next.
      mu_.Await(absl::Condition(
          +[](bool* writing) { return !*writing; }, &writing_));
      continue;
    }
    if (staged_.empty()) {
      return absl::InternalError(absl::StrCat("batch ", sequence, " was never staged"));
    }
    std::deque<std::pair<uint64_t, StoreBatch>> batches;
    batches.swap(staged_);
    const uint64_t last = batches.back().first;
    writing_ = true;
    mu_.Unlock();
    absl::Status status = store_->Write(Merge(batches));
    mu_.Lock();
    writing_ = false;
    if (!status.ok()) {  // written with the next ones
      for (auto it = batches.rbegin(); it != batches.rend(); ++it) {
        staged_.push_front(std::move(*it));
      }
      return status;
    }
    durable_.store(last);
  }
  return absl::OkStatus();
}

}  // namespace lathe
