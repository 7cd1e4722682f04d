#include "worker/comm/file_kv_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lathe {
namespace {

namespace fs = std::filesystem;

constexpr absl::Duration kPoll = absl::Milliseconds(5);

absl::Status WriteWhole(const std::string& path, absl::string_view value) {
  static std::atomic<uint64_t> counter{0};
  const std::string temp = absl::StrCat(path, ".tmp-", getpid(), "-", counter++);
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    out.write(value.data(), static_cast<std::streamsize>(value.size()));
    if (!out) return absl::InternalError(absl::StrCat("key-value store: writing ", temp));
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("key-value store: renaming ", temp, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

std::optional<std::string> ReadWhole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

}  // namespace

absl::StatusOr<std::unique_ptr<FileKvStore>> FileKvStore::Open(const std::string& dir) {
  std::error_code error;
  fs::create_directories(dir, error);
  if (error || access(dir.c_str(), W_OK) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous directory ", dir, ": ", error ? error.message() : "not writable"));
  }
  return std::unique_ptr<FileKvStore>(new FileKvStore(dir));
}

std::string FileKvStore::PathOf(absl::string_view key) const {
  return absl::StrCat(dir_, "/k-", absl::BytesToHexString(key));
}

absl::Status FileKvStore::Set(absl::string_view key, absl::string_view value) {
  return WriteWhole(PathOf(key), value);
}

absl::StatusOr<std::string> FileKvStore::Get(absl::string_view key, absl::Duration timeout) {
  const std::string keys[] = {std::string(key)};
  if (absl::Status s = Wait(keys, timeout); !s.ok()) return s;
  std::optional<std::string> value = ReadWhole(PathOf(key));
  if (!value) return absl::InternalError(absl::StrCat("key-value store: reading ", PathOf(key)));
  return *value;
}

absl::Status FileKvStore::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    std::vector<absl::string_view> missing;
    for (const std::string& key : keys) {
      if (!fs::exists(PathOf(key))) missing.push_back(key);
    }
    if (missing.empty()) return absl::OkStatus();
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("key-value store: timed out after ", absl::FormatDuration(timeout),
                       " waiting for ", absl::StrJoin(missing, ", ")));
    }
    std::this_thread::sleep_for(absl::ToChronoMilliseconds(kPoll));
  }
}

absl::StatusOr<int64_t> FileKvStore::Add(absl::string_view key, int64_t delta) {
  const std::string lock_path = dir_ + "/lock";
  const int fd = open(lock_path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
  if (fd < 0 || flock(fd, LOCK_EX) != 0) {
    if (fd >= 0) close(fd);
    return absl::InternalError(
        absl::StrCat("key-value store: locking ", lock_path, ": ", std::strerror(errno)));
  }
  absl::StatusOr<int64_t> result = [&]() -> absl::StatusOr<int64_t> {
    int64_t current = 0;
    std::optional<std::string> text = ReadWhole(PathOf(key));
    if (text && !absl::SimpleAtoi(*text, &current)) {
      return absl::InvalidArgumentError(
          absl::StrCat("key-value store: key \"", key, "\" does not hold an integer"));
    }
    current += delta;
    if (absl::Status s = WriteWhole(PathOf(key), absl::StrCat(current)); !s.ok()) return s;
    return current;
  }();
  flock(fd, LOCK_UN);
  close(fd);
  return result;
}

}  // namespace lathe
