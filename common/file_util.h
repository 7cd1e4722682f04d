// Small filesystem helpers shared by every module that writes files users rely on
// (checkpoints, adapters, exported models).
//
// Thread-safety: free functions; concurrent calls on different paths are safe. An
// AtomicFileWriter is not thread-safe; distinct writers may be used from different threads.
#ifndef LATHE_COMMON_FILE_UTIL_H_
#define LATHE_COMMON_FILE_UTIL_H_

#include <cstddef>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lathe {

// Reads the whole file. NOT_FOUND when it does not exist, INTERNAL (with errno text and
// the path) on other errors.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// Writes `contents` to `path` atomically: a uniquely named temp file in the same directory,
// write, fsync, rename over `path`, fsync of the directory. On failure the temp file is
// removed and `path` is untouched. INTERNAL (with errno text and the path) on I/O errors.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);

// Fsyncs the directory `dir` so that a rename inside it is durable. INTERNAL (with errno
// text and the path) on failure.
absl::Status SyncDirectory(const std::string& dir);

// INVALID_ARGUMENT "output: <dir> already holds a finished run (<file>); choose another
// directory" when `output` holds a trainer's finished adapter or model; the trainer and the
// coordinator's SubmitJob both refuse such a job with this message.
absl::Status CheckNoFinishedRun(const std::string& output);

// Copies the files of the Hugging Face model directory `from` that go with its weights and
// config (the tokenizer, its special tokens and chat template, the generation settings),
// those it has, into `to`, each atomically: an exported or merged model stays a usable model
// directory. INTERNAL (with errno text and the path) on I/O errors.
absl::Status CopyModelSideFiles(const std::string& from, const std::string& to);

// Writes one file atomically in pieces, for contents too large to hold in memory at once
// (WriteFileAtomically is built on it):
//
//   LATHE_ASSIGN_OR_RETURN(AtomicFileWriter writer, AtomicFileWriter::Open(path));
//   LATHE_RETURN_IF_ERROR(writer.Append(header));
//   LATHE_RETURN_IF_ERROR(writer.Append(body));
//   LATHE_RETURN_IF_ERROR(writer.Commit());
//
// The bytes go to `<path>.tmp.<pid>.<counter>` beside `path`; Commit fsyncs it, renames it
// over `path` and fsyncs the directory. Nothing appears at `path` before Commit. A failed
// Append or Commit, or destroying a writer that was not committed, removes the temp file;
// after a failure every further call returns FAILED_PRECONDITION.
//
// Movable, not copyable.
class AtomicFileWriter {
 public:
  // Creates the temp file. INTERNAL (with errno text and the path) when it cannot, e.g.
  // because the directory does not exist.
  static absl::StatusOr<AtomicFileWriter> Open(const std::string& path);

  AtomicFileWriter(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  // Removes the temp file unless Commit succeeded.
  ~AtomicFileWriter();

  // Appends `data` to the temp file. INTERNAL on I/O errors.
  absl::Status Append(absl::string_view data);
  absl::Status Append(const void* data, size_t size) {
    return Append(absl::string_view(static_cast<const char*>(data), size));
  }

  // Makes the file visible at `path`. INTERNAL on I/O errors; if the error comes from the
  // final directory fsync the file is already in place (but maybe not durable).
  absl::Status Commit();

  const std::string& path() const { return path_; }

 private:
  AtomicFileWriter(std::string path, std::string temp_path, int fd)
      : path_(std::move(path)), temp_path_(std::move(temp_path)), fd_(fd) {}

  // Closes and removes the temp file; idempotent.
  void Abandon();

  std::string path_;
  std::string temp_path_;
  int fd_ = -1;        // -1 once committed or abandoned.
  bool done_ = false;  // Committed or failed: no further calls allowed.
};

}  // namespace lathe

#endif  // LATHE_COMMON_FILE_UTIL_H_
