#include "coordinator/logs/profile_store.h"

#include <filesystem>
#include <fstream>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"

namespace lathe {
namespace {

std::string MiB(int64_t bytes) { return absl::StrCat(bytes >> 20, " MiB"); }

}  // namespace

absl::StatusOr<std::unique_ptr<ProfileStore>> ProfileStore::Open(const std::string& dir,
                                                                 int64_t max_file_bytes,
                                                                 int64_t max_capture_bytes) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error || !std::filesystem::is_directory(dir)) {
    return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", error.message()));
  }
  return std::unique_ptr<ProfileStore>(new ProfileStore(dir, max_file_bytes, max_capture_bytes));
}

std::string ProfileStore::CaptureDir(const ProfileFileKey& key) const {
  return absl::StrCat(dir_, "/", key.job_id, "/attempt-", key.generation, "/profile/",
                      key.capture_id);
}

std::string ProfileStore::PathOf(const ProfileFileKey& key) const {
  return absl::StrCat(CaptureDir(key), "/rank-", key.rank, "/", key.name);
}

absl::StatusOr<int64_t> ProfileStore::Append(const ProfileFileKey& key, int64_t offset,
                                             absl::string_view data) {
  if (absl::Status bad = CheckCaptureId(key.capture_id); !bad.ok()) return bad;
  if (absl::Status bad = CheckProfileFileName(key.name); !bad.ok()) return bad;
  absl::MutexLock lock(&mu_);
  const std::string path = PathOf(key);
  std::error_code error;
  const uintmax_t on_disk = std::filesystem::file_size(path, error);
  const int64_t size = error ? 0 : static_cast<int64_t>(on_disk);
  if (offset < 0 || offset > size) {
    return absl::OutOfRangeError(
        absl::StrCat("offset: ", offset, " is not within ", key.name, "'s ", size, " bytes"));
  }
  const int64_t end = offset + static_cast<int64_t>(data.size());
  if (end <= size) return size;  // a resend of what is here
  data.remove_prefix(static_cast<size_t>(size - offset));
  const std::string file = absl::StrCat("rank ", key.rank, "'s ", key.name);
  if (end > max_file_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(file, ": ", end, " bytes pass the bound of ",
                                                     MiB(max_file_bytes_), " a file"));
  }
  int64_t capture = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(CaptureDir(key), error)) {
    std::error_code ignored;
    if (entry.is_regular_file(ignored)) {
      capture += static_cast<int64_t>(entry.file_size(ignored));
    }
  }
  const int64_t added = static_cast<int64_t>(data.size());
  if (capture + added > max_capture_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(file, ": the capture would hold ",
                                                     capture + added, " bytes, past the bound of ",
                                                     MiB(max_capture_bytes_), " a capture"));
  }
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), error);
  std::ofstream out(path, std::ios::app | std::ios::binary);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  out.flush();
  if (!out) return absl::InternalError(absl::StrCat("writing ", path));
  return end;
}

absl::StatusOr<int64_t> ProfileStore::Size(const ProfileFileKey& key) const {
  if (absl::Status bad = CheckCaptureId(key.capture_id); !bad.ok()) return bad;
  if (absl::Status bad = CheckProfileFileName(key.name); !bad.ok()) return bad;
  absl::MutexLock lock(&mu_);
  std::error_code error;
  const uintmax_t size = std::filesystem::file_size(PathOf(key), error);
  if (error) {
    return absl::NotFoundError(
        absl::StrCat("capture ", key.capture_id, " has no file ", key.name, " of rank ", key.rank));
  }
  return static_cast<int64_t>(size);
}

absl::StatusOr<ProfileStore::Chunk> ProfileStore::Read(const ProfileFileKey& key, int64_t offset,
                                                       int64_t max_bytes) const {
  absl::StatusOr<int64_t> size = Size(key);
  if (!size.ok()) return size.status();
  Chunk chunk;
  chunk.size = *size;
  if (offset >= *size || max_bytes <= 0) return chunk;
  std::ifstream in(PathOf(key), std::ios::binary);
  in.seekg(offset);
  chunk.data.resize(static_cast<size_t>(std::min(max_bytes, *size - offset)));
  in.read(chunk.data.data(), static_cast<std::streamsize>(chunk.data.size()));
  chunk.data.resize(static_cast<size_t>(in.gcount()));
  return chunk;
}

}  // namespace lathe
