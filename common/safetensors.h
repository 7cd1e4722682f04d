// Reading and writing the safetensors format (https://huggingface.co/docs/safetensors):
// an 8-byte little-endian header length N, N bytes of JSON describing each tensor
// ({"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__":
// {str: str}}), then the raw little-endian tensor bytes. Offsets are relative to the start
// of the byte buffer after the header.
//
// Files are memory-mapped read-only, never read whole. No libtorch here: the engine wraps
// the mapped bytes in tensors itself.
//
// Thread-safety: SafetensorsFile and SafetensorsDirectory are immutable after Open and may
// be read from any number of threads. The mapping stays valid while any shared_ptr to the
// file is alive.
#ifndef LATHE_COMMON_SAFETENSORS_H_
#define LATHE_COMMON_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace lathe {

enum class DType { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

// "F32" -> kF32 etc. INVALID_ARGUMENT naming the string for an unknown dtype.
absl::StatusOr<DType> ParseDType(absl::string_view name);
// kF32 -> "F32".
absl::string_view DTypeName(DType dtype);
// Bytes per element.
size_t DTypeSize(DType dtype);

// One tensor inside a mapped file. `data` points into the mapping (not necessarily aligned
// to the element size); it stays valid while the owning SafetensorsFile lives.
struct TensorView {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const;
};

// What the header of a safetensors file says, checked against the bytes after it.
struct SafetensorsHeader {
  // In the order of their data offsets (ties, i.e. empty tensors, by name). Each `data`
  // points into the bytes that were parsed.
  std::vector<TensorView> tensors;
  std::map<std::string, std::string> metadata;
};

// Parses and validates `file_bytes`, the whole contents of a safetensors file (untrusted:
// never throws, takes memory in proportion to its size). `source` names the file in
// messages. On failure returns, naming `source` and, where there is one, the tensor, the
// DATA_LOSS and INVALID_ARGUMENT errors that SafetensorsFile::Open describes.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view file_bytes,
                                                         absl::string_view source);

// One memory-mapped .safetensors file.
class SafetensorsFile {
 public:
  // Maps and validates `path`. A file with no tensors is valid. On failure returns (the
  // message names the file and, where there is one, the tensor):
  //   NOT_FOUND: the file does not exist;
  //   DATA_LOSS (truncation): the file is shorter than 8 bytes, the header length runs
  //   past the end of the file, or a tensor's data_offsets run past the end of the data;
  //   INVALID_ARGUMENT (malformed content): not a regular file, the header is not JSON or
  //   not a JSON object, __metadata__ is not an object of strings, a tensor entry has an
  //   unknown dtype, a shape that is not a list of non-negative integers or whose byte
  //   count overflows (its non-zero dimensions must multiply to an int64 even when a zero
  //   makes it empty), data_offsets that are not [begin, end] with begin <= end, a byte
  //   count end - begin that does not match dtype x shape, or tensors that do not cover
  //   the data end to end (an overlap, a gap, bytes after the last tensor);
  //   INTERNAL: other I/O errors (open, fstat, mmap), with errno text.
  // The bytes are checked by ParseSafetensorsHeader.
  static absl::StatusOr<std::shared_ptr<const SafetensorsFile>> Open(const std::string& path);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Tensors in file order of their data offsets.
  const std::vector<TensorView>& tensors() const { return tensors_; }
  // nullptr when absent.
  const TensorView* Find(absl::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;

  std::string path_;
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
  std::vector<TensorView> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

// The weights of a Hugging Face model directory: either `model.safetensors`, or the shards
// listed by `model.safetensors.index.json` ({"weight_map": {tensor: file}}).
class SafetensorsDirectory {
 public:
  // Opens every file of the directory: model.safetensors when it exists (the index is
  // then ignored), else each distinct shard of the index once. Tensors a shard holds but
  // the weight map does not list are reachable too. Errors name the directory or the file:
  // NOT_FOUND when neither model.safetensors nor the index exists; INVALID_ARGUMENT for a
  // malformed index (including a shard name that is absolute or contains ".."), an index
  // naming a file that is missing or a tensor that its file lacks; any error of
  // SafetensorsFile::Open.
  static absl::StatusOr<SafetensorsDirectory> Open(const std::string& dir);

  // The tensor and the file that holds it; nullptr when no file has it.
  struct Entry {
    const TensorView* tensor = nullptr;
    std::shared_ptr<const SafetensorsFile> file;
  };
  Entry Find(absl::string_view name) const;
  // All tensor names, sorted.
  std::vector<std::string> Names() const;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::vector<std::shared_ptr<const SafetensorsFile>> files_;
  std::map<std::string, Entry, std::less<>> entries_;
};

// A tensor to write. `data` holds numel(shape) * DTypeSize(dtype) bytes, little-endian.
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t nbytes = 0;
};

// Writes `tensors` (in the given order) with `metadata` to `path` atomically: a temp file
// beside it, fsync, rename, fsync of the directory. The header is padded with spaces to a
// multiple of 8 bytes so that data offsets are 8-byte aligned. On failure no file is left
// at `path` or beside it. INVALID_ARGUMENT for duplicate names or a byte count that does
// not match dtype x shape; INTERNAL (with errno text) for I/O failures.
absl::Status WriteSafetensors(const std::string& path, absl::Span<const TensorToWrite> tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace lathe

#endif  // LATHE_COMMON_SAFETENSORS_H_
