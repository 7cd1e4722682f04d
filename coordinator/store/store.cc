#include "coordinator/store/store.h"

#include <string>

namespace lathe {

absl::Status Store::UpdateJob(const v1::JobStatus& job) {
  StoreBatch batch;
  batch.jobs.push_back(job);
  return Write(batch);
}

absl::Status Store::PutWorker(const v1::WorkerStatus& worker) {
  StoreBatch batch;
  batch.workers.push_back(worker);
  return Write(batch);
}

absl::Status Store::DeleteWorker(absl::string_view worker_id) {
  StoreBatch batch;
  batch.deleted_workers.emplace_back(worker_id);
  return Write(batch);
}

}  // namespace lathe
