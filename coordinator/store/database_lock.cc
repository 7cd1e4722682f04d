#include "coordinator/store/database_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace lathe {
namespace {

// The pid that holds a flock on the file with inode `ino` on device `dev`, from /proc/locks
// ("1: FLOCK  ADVISORY  WRITE 1234 00:1f:5678 0 EOF"); 0 when none is listed.
int64_t FlockHolder(dev_t dev, ino_t ino) {
  std::ifstream locks("/proc/locks");
  std::string line;
  while (std::getline(locks, line)) {
    std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (fields.size() < 6 || fields[1] != "FLOCK") continue;
    std::vector<std::string> id = absl::StrSplit(fields[5], ':');
    uint64_t major = 0, minor = 0, inode = 0;
    int64_t pid = 0;
    if (id.size() != 3 || !absl::SimpleHexAtoi(id[0], &major) ||
        !absl::SimpleHexAtoi(id[1], &minor) || !absl::SimpleAtoi(id[2], &inode) ||
        !absl::SimpleAtoi(fields[4], &pid)) {
      continue;
    }
    if (inode == ino && major == ::major(dev) && minor == ::minor(dev)) return pid;
  }
  return 0;
}

}  // namespace

absl::StatusOr<DatabaseLock> DatabaseLock::Acquire(const std::string& path, bool* created_empty) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int error = errno;
    const std::string message =
        absl::StrCat(path, ": cannot open the database for writing (", std::strerror(error), ")");
    return error == EACCES || error == EROFS ? absl::PermissionDeniedError(message)
                                             : absl::InternalError(message);
  }
  DatabaseLock lock(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return absl::InternalError(absl::StrCat(path, ": ", std::strerror(errno)));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) {
      return absl::InternalError(absl::StrCat(path, ": cannot lock (", std::strerror(errno), ")"));
    }
    const int64_t holder = FlockHolder(st.st_dev, st.st_ino);
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is in use by another coordinator",
                     holder > 0 ? absl::StrCat(" (pid ", holder, ")") : std::string(),
                     ": one coordinator per database"));
  }
  // SQLite writes its write-ahead log and shared-memory index beside the file.
  const std::filesystem::path parent = std::filesystem::absolute(path).parent_path();
  if (::access(parent.c_str(), W_OK) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat(path, ": its directory ", parent.string(),
                     " is not writable (SQLite keeps its write-ahead log there)"));
  }
  if (created_empty != nullptr) *created_empty = st.st_size == 0;
  return lock;
}

DatabaseLock::DatabaseLock(DatabaseLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

DatabaseLock& DatabaseLock::operator=(DatabaseLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

DatabaseLock::~DatabaseLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

}  // namespace lathe
