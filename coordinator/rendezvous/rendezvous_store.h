// The key-value store through which the ranks of one attempt find each other (gloo's
// store, NCCL's unique id). Keys live in the scope of a job and generation; calls for a
// generation that is not the job's active attempt are refused (fencing), and the values
// of ended attempts are dropped (DropEnded, which the server calls on every heartbeat
// check). A scope holds at most kMaxKeysPerScope keys and kMaxBytesPerScope bytes of keys
// and values (issue #27: forty 3 MiB values took the coordinator from 21 to 154 MiB, kept
// after the job ended). gloo's store and NCCL's unique id need a few keys per rank.
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
  static constexpr int64_t kMaxKeysPerScope = 65536;
  static constexpr int64_t kMaxBytesPerScope = int64_t{64} << 20;

  // `is_active(job_id, generation)` tells whether a scope may be used.
  explicit RendezvousStore(std::function<bool(absl::string_view, int64_t)> is_active);

  // FAILED_PRECONDITION for an inactive scope (all four calls). RESOURCE_EXHAUSTED naming
  // the job and the limit when a Set or Add would take the scope past its keys or bytes.
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

  // Drops every scope whose attempt is no longer active.
  void DropEnded();
  // Bytes of keys and values held, over every scope.
  int64_t BytesHeld();

 private:
  using Scope = std::pair<std::string, int64_t>;
  struct Values {
    std::map<std::string, std::string, std::less<>> values;
    int64_t bytes = 0;  // of its keys and values
  };
  absl::Status CheckActive(absl::string_view job_id, int64_t generation);
  void DropEndedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stores `value` at `key` in `scope` within its limits.
  absl::Status Put(const Scope& scope, absl::string_view key, std::string value)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::function<bool(absl::string_view, int64_t)> is_active_;
  absl::Mutex mu_;
  std::map<Scope, Values> scopes_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_RENDEZVOUS_RENDEZVOUS_STORE_H_
