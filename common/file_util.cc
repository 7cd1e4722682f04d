#include "common/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace lathe {
namespace {

// std::strerror is not guaranteed thread-safe; the generic category's message is.
std::string ErrnoText(int error) {
  return std::error_code(error, std::generic_category()).message();
}

absl::Status ErrnoError(int error, absl::string_view path, absl::string_view action) {
  return absl::InternalError(absl::StrCat(path, ": ", action, ": ", ErrnoText(error)));
}

std::string ParentDirectory(const std::string& path) {
  std::string parent = std::filesystem::path(path).parent_path().string();
  return parent.empty() ? "." : parent;
}

std::string TempPathFor(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return absl::StrCat(path, ".tmp.", ::getpid(), ".", counter.fetch_add(1));
}

}  // namespace

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int error = errno;
    if (error == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return ErrnoError(error, path, "open");
  }
  std::string contents;
  struct stat st;
  if (::fstat(fd, &st) == 0 && st.st_size > 0) contents.reserve(static_cast<size_t>(st.st_size));
  char buffer[1 << 16];
  while (true) {
    ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      int error = errno;
      ::close(fd);
      return ErrnoError(error, path, "read");
    }
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return contents;
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  LATHE_ASSIGN_OR_RETURN(AtomicFileWriter writer, AtomicFileWriter::Open(path));
  LATHE_RETURN_IF_ERROR(writer.Append(contents));
  return writer.Commit();
}

absl::Status SyncDirectory(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, dir, "open directory");
  if (::fsync(fd) != 0) {
    int error = errno;
    ::close(fd);
    return ErrnoError(error, dir, "fsync directory");
  }
  ::close(fd);
  return absl::OkStatus();
}

absl::StatusOr<AtomicFileWriter> AtomicFileWriter::Open(const std::string& path) {
  std::string temp_path = TempPathFor(path);
  int fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) return ErrnoError(errno, temp_path, "create temp file");
  return AtomicFileWriter(path, std::move(temp_path), fd);
}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& other) noexcept
    : path_(std::move(other.path_)),
      temp_path_(std::move(other.temp_path_)),
      fd_(std::exchange(other.fd_, -1)),
      done_(std::exchange(other.done_, true)) {}

AtomicFileWriter& AtomicFileWriter::operator=(AtomicFileWriter&& other) noexcept {
  if (this != &other) {
    Abandon();
    path_ = std::move(other.path_);
    temp_path_ = std::move(other.temp_path_);
    fd_ = std::exchange(other.fd_, -1);
    done_ = std::exchange(other.done_, true);
  }
  return *this;
}

AtomicFileWriter::~AtomicFileWriter() { Abandon(); }

void AtomicFileWriter::Abandon() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(temp_path_.c_str());
    fd_ = -1;
  }
  done_ = true;
}

absl::Status AtomicFileWriter::Append(absl::string_view data) {
  if (done_) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": append to a writer that was committed or failed"));
  }
  while (!data.empty()) {
    ssize_t n = ::write(fd_, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status status = ErrnoError(errno, temp_path_, "write");
      Abandon();
      return status;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Commit() {
  if (done_) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": commit of a writer that was committed or failed"));
  }
  if (::fsync(fd_) != 0) {
    absl::Status status = ErrnoError(errno, temp_path_, "fsync");
    Abandon();
    return status;
  }
  int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) {
    absl::Status status = ErrnoError(errno, temp_path_, "close");
    ::unlink(temp_path_.c_str());
    done_ = true;
    return status;
  }
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    absl::Status status = ErrnoError(errno, path_, absl::StrCat("rename from ", temp_path_));
    ::unlink(temp_path_.c_str());
    done_ = true;
    return status;
  }
  done_ = true;
  return SyncDirectory(ParentDirectory(path_));
}

absl::Status CopyModelSideFiles(const std::string& from, const std::string& to) {
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                           "tokenizer.model", "added_tokens.json", "vocab.json", "merges.txt",
                           "chat_template.jinja", "generation_config.json"}) {
    const std::string source = from + "/" + name;
    std::error_code error;
    if (!std::filesystem::exists(source, error)) continue;
    absl::StatusOr<std::string> bytes = ReadFile(source);
    if (!bytes.ok()) return bytes.status();
    if (absl::Status written = WriteFileAtomically(to + "/" + name, *bytes); !written.ok()) {
      return written;
    }
  }
  return absl::OkStatus();
}

absl::Status CheckNoFinishedRun(const std::string& output) {
  for (const char* finished : {"adapter/adapter_config.json", "model/config.json"}) {
    std::error_code error;
    if (std::filesystem::exists(std::filesystem::path(output) / finished, error)) {
      return absl::InvalidArgumentError(absl::StrCat("output: ", output,
                                                     " already holds a finished run (", finished,
                                                     "); choose another directory"));
    }
  }
  return absl::OkStatus();
}

}  // namespace lathe
