// The key-value store through which the ranks of one attempt find each other (gloo's
// store, NCCL's unique id). Keys live in the scope of a job and generation; calls for a
// generation that is not the job's active attempt are refused (fencing), and the values
// of ended attempts are dropped.
//
// Thread-safety: thread-safe.
#ifndef LATHE_COORDINATOR_RENDEZVOUS_RENDEZVOUS_STORE_H_
#define LATHE_COORDINATOR_RENDEZVOUS_RENDEZVOUS_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace lathe {

class RendezvousStore {
 public:
  // `is_active(job_id, generation)` tells whether a scope may be used.
  explicit RendezvousStore(std::function<bool(absl::string_view, int64_t)> is_active);

  // FAILED_PRECONDITION for an inactive scope (all four calls).
  absl::Status Set(absl::string_view job_id, int64_t generation, absl::string_view key,
                   std::string value);
  // NOT_FOUND when the key is absent.
  absl::StatusOr<std::string> Get(absl::string_view job_id, int64_t generation,
                                  absl::string_view key);
  // Returns when every key exists; DEADLINE_EXCEEDED naming the missing keys at `deadline`.
  absl::Status Wait(absl::string_view job_id, int64_t generation,
                    const std::vector<std::string>& keys, absl::Time deadline);
  // Adds `delta` to the integer at `key` (0 when absent) and returns the sum.
  // INVALID_ARGUMENT when the key holds a value that is not an integer.
  absl::StatusOr<int64_t> Add(absl::string_view job_id, int64_t generation, absl::string_view key,
                              int64_t delta);

 private:
  using Scope = std::pair<std::string, int64_t>;
  absl::Status CheckActive(absl::string_view job_id, int64_t generation);

  const std::function<bool(absl::string_view, int64_t)> is_active_;
  absl::Mutex mu_;
  std::map<Scope, std::map<std::string, std::string, std::less<>>> values_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_RENDEZVOUS_RENDEZVOUS_STORE_H_
