// The ranks' logs as their workers send them (WorkerService.AppendLogs), kept by the
// coordinator in files, one per attempt and rank: <dir>/<job>/attempt-<g>/rank-<r>.log. They
// outlive the coordinator's restarts like its database. Each log is capped (the first
// max_bytes are kept, then one line saying how much was left out); `lathe logs` reads them
// (JobService.GetLogs).
//
// Thread-safety: thread-safe.
#ifndef LATHE_COORDINATOR_LOGS_LOG_STORE_H_
#define LATHE_COORDINATOR_LOGS_LOG_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace lathe {

struct LogKey {
  std::string job_id;
  int64_t generation = 0;
  int64_t rank = 0;
  bool operator<(const LogKey& o) const {
    return std::tie(job_id, generation, rank) < std::tie(o.job_id, o.generation, o.rank);
  }
};

class LogStore {
 public:
  // Logs under `dir` (created when missing). INTERNAL naming it when it cannot be.
  static absl::StatusOr<std::unique_ptr<LogStore>> Open(const std::string& dir,
                                                        int64_t max_bytes = int64_t{64} << 20);

  // Appends `data`, which starts at `offset` of the worker's log: what the store already
  // has of it is skipped (a resend), and a gap of at most `lost` bytes (offset past the end:
  // bytes the worker dropped) is marked in the log. Returns the size afterwards, counted in
  // the worker's offsets. OUT_OF_RANGE for a larger gap: offsets are contiguous, so that no
  // sender can move a log's end past what its worker will write (issue #27).
  // REQUIRES: 0 <= lost <= offset < 2^62.
  absl::StatusOr<int64_t> Append(const LogKey& key, int64_t offset, absl::string_view data,
                                 int64_t lost = 0);

  // Up to `max_bytes` of the kept log from `offset` (bytes of the file, markers included),
  // and its size.
  struct Chunk {
    std::string data;
    int64_t size = 0;
  };
  absl::StatusOr<Chunk> Read(const LogKey& key, int64_t offset, int64_t max_bytes) const;

 private:
  LogStore(std::string dir, int64_t max_bytes) : dir_(std::move(dir)), max_bytes_(max_bytes) {}
  std::string PathOf(const LogKey& key) const;

  const std::string dir_;
  const int64_t max_bytes_;
  mutable absl::Mutex mu_;
  // Per log: the worker's offset it has reached (beyond the file's size once capped).
  std::map<LogKey, int64_t> reached_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_LOGS_LOG_STORE_H_
