// The files of profile captures (`lathe profile`) as the workers upload them
// (WorkerService.UploadProfile), kept by the coordinator beside the ranks' logs:
// <dir>/<job>/attempt-<g>/profile/<capture>/rank-<r>/<name>. Only plain base names are
// accepted, and what a capture may hold is bounded (per file and per capture, over all its
// ranks): a worker cannot fill the coordinator's disk. `lathe profile --fetch` reads them
// (JobService.GetProfileFile).
//
// Thread-safety: thread-safe.
#ifndef LATHE_COORDINATOR_LOGS_PROFILE_STORE_H_
#define LATHE_COORDINATOR_LOGS_PROFILE_STORE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/profile_limits.h"

namespace lathe {

struct ProfileFileKey {
  std::string job_id;
  int64_t generation = 0;
  std::string capture_id;
  int64_t rank = 0;
  std::string name;  // a base name (CheckProfileFileName)
};

class ProfileStore {
 public:
  // Files under `dir` (created when missing). INTERNAL naming it when it cannot be.
  static absl::StatusOr<std::unique_ptr<ProfileStore>> Open(
      const std::string& dir, int64_t max_file_bytes = kMaxProfileFileBytes,
      int64_t max_capture_bytes = kMaxProfileCaptureBytes);

  // Appends `data`, which starts at `offset` of the file: bytes the store already has are
  // skipped (a resend); a gap is OUT_OF_RANGE. Returns the file's size afterwards.
  // RESOURCE_EXHAUSTED, naming the file and the bound, when the file or its capture would
  // grow past its bound (nothing is written then); INVALID_ARGUMENT for a bad name or
  // capture id.
  absl::StatusOr<int64_t> Append(const ProfileFileKey& key, int64_t offset, absl::string_view data);

  // The file's size; NOT_FOUND when the store has none of it.
  absl::StatusOr<int64_t> Size(const ProfileFileKey& key) const;

  // Up to `max_bytes` of the file from `offset`, and its size. NOT_FOUND for a missing file.
  struct Chunk {
    std::string data;
    int64_t size = 0;
  };
  absl::StatusOr<Chunk> Read(const ProfileFileKey& key, int64_t offset, int64_t max_bytes) const;

  int64_t max_file_bytes() const { return max_file_bytes_; }
  int64_t max_capture_bytes() const { return max_capture_bytes_; }

 private:
  ProfileStore(std::string dir, int64_t max_file, int64_t max_capture)
      : dir_(std::move(dir)), max_file_bytes_(max_file), max_capture_bytes_(max_capture) {}
  std::string CaptureDir(const ProfileFileKey& key) const;
  std::string PathOf(const ProfileFileKey& key) const;

  const std::string dir_;
  const int64_t max_file_bytes_;
  const int64_t max_capture_bytes_;
  mutable absl::Mutex mu_;  // one append at a time: the capture's total is read, then grown
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_LOGS_PROFILE_STORE_H_
