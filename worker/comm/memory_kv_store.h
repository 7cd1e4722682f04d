// A KvStore held in this process's memory: the store for tests and for groups whose ranks
// are threads of one process.
//
// Thread-safety: thread-safe; waiters block on a condition, not by polling.
#ifndef LATHE_WORKER_COMM_MEMORY_KV_STORE_H_
#define LATHE_WORKER_COMM_MEMORY_KV_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "worker/comm/kv_store.h"

namespace lathe {

class MemoryKvStore final : public KvStore {
 public:
  MemoryKvStore() = default;
  MemoryKvStore(const MemoryKvStore&) = delete;
  MemoryKvStore& operator=(const MemoryKvStore&) = delete;

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string, std::less<>> values_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lathe

#endif  // LATHE_WORKER_COMM_MEMORY_KV_STORE_H_
