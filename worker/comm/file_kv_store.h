// A KvStore in a directory that every rank can reach (one machine, or a shared filesystem):
// the rendezvous of trainers started without a coordinator (`lathe-worker train --spec ...
// --rank R --world-size N --rendezvous-dir DIR`), as c10d's FileStore is for torchrun.
//
// Each key is one file, named by the key's hex encoding, written to a temporary name and
// renamed into place, so a reader sees a whole value or none. Add holds an flock on the
// directory's lock file. Get and Wait poll every few milliseconds (a rendezvous happens once
// per attempt, so the cost does not matter).
//
// Thread-safety: thread-safe, also across processes.
#ifndef LATHE_WORKER_COMM_FILE_KV_STORE_H_
#define LATHE_WORKER_COMM_FILE_KV_STORE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/comm/kv_store.h"

namespace lathe {

class FileKvStore final : public KvStore {
 public:
  // Creates `dir` when missing. INVALID_ARGUMENT naming the directory when it cannot be
  // created or written.
  static absl::StatusOr<std::unique_ptr<FileKvStore>> Open(const std::string& dir);

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;

 private:
  explicit FileKvStore(std::string dir) : dir_(std::move(dir)) {}
  std::string PathOf(absl::string_view key) const;

  const std::string dir_;
};

}  // namespace lathe

#endif  // LATHE_WORKER_COMM_FILE_KV_STORE_H_
