// A Store that passes every call to another one: tests derive from it and override the call
// they watch or slow down (counting writes, failing them, holding them at a gate).
#ifndef LATHE_TESTS_TESTING_FORWARDING_STORE_H_
#define LATHE_TESTS_TESTING_FORWARDING_STORE_H_

#include <optional>
#include <vector>

#include "coordinator/store/store.h"

namespace lathe::testing {

class ForwardingStore : public Store {
 public:
  // REQUIRES: `inner` outlives this store.
  explicit ForwardingStore(Store* inner) : inner_(inner) {}

  absl::Status CreateJob(const v1::JobStatus& job, absl::string_view request_id) override {
    return inner_->CreateJob(job, request_id);
  }
  absl::Status Write(const StoreBatch& batch) override { return inner_->Write(batch); }
  absl::StatusOr<std::optional<v1::JobStatus>> FindJobByRequestId(
      absl::string_view request_id) override {
    return inner_->FindJobByRequestId(request_id);
  }
  absl::StatusOr<std::vector<v1::JobStatus>> LoadJobs() override { return inner_->LoadJobs(); }
  absl::StatusOr<std::vector<v1::WorkerStatus>> LoadWorkers() override {
    return inner_->LoadWorkers();
  }

 private:
  Store* const inner_;
};

}  // namespace lathe::testing

#endif  // LATHE_TESTS_TESTING_FORWARDING_STORE_H_
