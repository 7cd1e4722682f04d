#include "coordinator/logs/log_store.h"

#include <filesystem>
#include <fstream>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"

namespace lathe {
namespace {

int64_t FileSize(const std::string& path) {
  std::error_code error;
  const uintmax_t size = std::filesystem::file_size(path, error);
  return error ? 0 : static_cast<int64_t>(size);
}

}  // namespace

absl::StatusOr<std::unique_ptr<LogStore>> LogStore::Open(const std::string& dir,
                                                         int64_t max_bytes) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error || !std::filesystem::is_directory(dir)) {
    return absl::InternalError(
        absl::StrCat("--log-dir: cannot create ", dir, ": ", error.message()));
  }
  return std::unique_ptr<LogStore>(new LogStore(dir, max_bytes));
}

std::string LogStore::PathOf(const LogKey& key) const {
  return absl::StrCat(dir_, "/", key.job_id, "/attempt-", key.generation, "/rank-", key.rank,
                      ".log");
}

absl::StatusOr<int64_t> LogStore::Append(const LogKey& key, int64_t offset, absl::string_view data,
                                         int64_t lost) {
  absl::MutexLock lock(&mu_);
  const std::string path = PathOf(key);
  auto known = reached_.find(key);
  // After a restart the file's size stands for what was received.
  const int64_t reached = known != reached_.end() ? known->second : FileSize(path);
  if (offset - reached > lost) {
    return absl::OutOfRangeError(absl::StrCat("offset: ", offset, " is past the log's end, ",
                                              reached, ", by more than the ", lost,
                                              " bytes declared lost"));
  }
  const int64_t end = offset + static_cast<int64_t>(data.size());
  if (end <= reached) return reached;  // a resend of what is here
  if (offset < reached) {
    data.remove_prefix(static_cast<size_t>(reached - offset));
    offset = reached;
  }
  std::string out;
  if (offset > reached) {
    absl::StrAppend(&out, "[... ", offset - reached, " bytes of this log were lost ...]\n");
  }
  absl::StrAppend(&out, data);
  const int64_t size = FileSize(path);
  if (size < max_bytes_) {
    if (size + static_cast<int64_t>(out.size()) > max_bytes_) {
      out.resize(static_cast<size_t>(max_bytes_ - size));
      absl::StrAppend(&out, "\n[... this log reached its cap of ", max_bytes_,
                      " bytes: the rest is left out ...]\n");
    }
    std::error_code error;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path(), error);
    std::ofstream file(path, std::ios::app | std::ios::binary);
    file.write(out.data(), static_cast<std::streamsize>(out.size()));
    file.flush();
    if (!file) return absl::InternalError(absl::StrCat("writing ", path));
  }
  reached_[key] = end;
  return end;
}

absl::StatusOr<LogStore::Chunk> LogStore::Read(const LogKey& key, int64_t offset,
                                               int64_t max_bytes) const {
  absl::MutexLock lock(&mu_);
  const std::string path = PathOf(key);
  Chunk chunk;
  chunk.size = FileSize(path);
  if (offset >= chunk.size) return chunk;
  std::ifstream file(path, std::ios::binary);
  file.seekg(offset);
  chunk.data.resize(static_cast<size_t>(std::min(max_bytes, chunk.size - offset)));
  file.read(chunk.data.data(), static_cast<std::streamsize>(chunk.data.size()));
  chunk.data.resize(static_cast<size_t>(file.gcount()));
  return chunk;
}

}  // namespace lathe
