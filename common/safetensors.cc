#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/file_util.h"
#include "common/json_fields.h"
#include "common/status_macros.h"

namespace lathe {
namespace {

using Json = nlohmann::json;

constexpr absl::string_view kMetadataKey = "__metadata__";
constexpr size_t kHeaderLengthBytes = 8;

struct DTypeInfo {
  DType dtype;
  absl::string_view name;
  size_t size;
};

constexpr std::array<DTypeInfo, 10> kDTypes = {{
    {DType::kF64, "F64", 8},
    {DType::kF32, "F32", 4},
    {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},
    {DType::kI64, "I64", 8},
    {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},
    {DType::kI8, "I8", 1},
    {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1},
}};

const DTypeInfo& Info(DType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  return kDTypes[0];  // Unreachable for valid enum values.
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// numel(shape) * element_size, or nullopt on a negative dimension or overflow. A zero
// dimension makes the count zero, but the other dimensions must still multiply to an int64:
// numel() and whoever builds a tensor of the shape multiply them all.
std::optional<uint64_t> ByteCount(const std::vector<int64_t>& shape, size_t element_size) {
  uint64_t numel = 1;
  bool empty = false;
  for (int64_t dim : shape) {
    if (dim < 0) return std::nullopt;
    if (dim == 0) {
      empty = true;
      continue;
    }
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel)) return std::nullopt;
  }
  if (numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
  if (empty) return 0;
  uint64_t bytes;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(element_size), &bytes)) {
    return std::nullopt;
  }
  if (bytes > std::numeric_limits<size_t>::max()) return std::nullopt;
  return bytes;
}

// A JSON number that is a non-negative integer, or nullopt.
std::optional<uint64_t> NonNegativeInteger(const Json& value) {
  if (!value.is_number_unsigned()) return std::nullopt;  // Negative integers parse as signed.
  return value.get<uint64_t>();
}

// Parses one tensor entry of the header; `data_size` is the number of bytes after it.
absl::StatusOr<TensorView> ParseTensorEntry(const std::string& name, const Json& entry,
                                            const std::byte* data, uint64_t data_size) {
  auto invalid = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\": ", what));
  };
  if (!entry.is_object()) return invalid("entry is not a JSON object");

  auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end() || !dtype_it->is_string()) {
    return invalid("\"dtype\" is missing or not a string");
  }
  absl::StatusOr<DType> dtype = ParseDType(dtype_it->get_ref<const std::string&>());
  if (!dtype.ok()) return Annotate(dtype.status(), absl::StrCat("tensor \"", name, "\""));

  auto shape_it = entry.find("shape");
  if (shape_it == entry.end() || !shape_it->is_array()) {
    return invalid("\"shape\" is missing or not an array");
  }
  std::vector<int64_t> shape;
  shape.reserve(shape_it->size());
  for (const Json& dim : *shape_it) {
    std::optional<uint64_t> value = NonNegativeInteger(dim);
    if (!value.has_value() || *value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return invalid(absl::StrCat("shape ", DescribeJson(*shape_it, 60), " has an entry (",
                                  DescribeJson(dim, 60), ") that is not a non-negative integer"));
    }
    shape.push_back(static_cast<int64_t>(*value));
  }

  auto offsets_it = entry.find("data_offsets");
  if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
    return invalid("\"data_offsets\" is missing or not an array of two integers");
  }
  std::optional<uint64_t> begin = NonNegativeInteger((*offsets_it)[0]);
  std::optional<uint64_t> end = NonNegativeInteger((*offsets_it)[1]);
  if (!begin.has_value() || !end.has_value()) {
    return invalid(absl::StrCat("data_offsets ", DescribeJson(*offsets_it, 60),
                                " are not two non-negative integers"));
  }
  if (*begin > *end) {
    return invalid(absl::StrCat("data_offsets [", *begin, ", ", *end, "] have begin > end"));
  }
  if (*end > data_size) {
    return absl::DataLossError(absl::StrCat("tensor \"", name, "\": data_offsets [", *begin, ", ",
                                            *end, "] run past the end of the data (", data_size,
                                            " bytes)"));
  }

  std::optional<uint64_t> expected = ByteCount(shape, DTypeSize(*dtype));
  if (!expected.has_value()) {
    return invalid(absl::StrCat("shape ", ShapeString(shape), " of ", DTypeName(*dtype),
                                " overflows the byte count"));
  }
  if (*end - *begin != *expected) {
    return invalid(absl::StrCat("data_offsets [", *begin, ", ", *end, "] hold ", *end - *begin,
                                " bytes but ", DTypeName(*dtype), " ", ShapeString(shape),
                                " needs ", *expected));
  }

  TensorView view;
  view.name = name;
  view.dtype = *dtype;
  view.shape = std::move(shape);
  view.data = data + *begin;
  view.nbytes = static_cast<size_t>(*expected);
  return view;
}

absl::StatusOr<std::map<std::string, std::string>> ParseMetadata(const Json& value) {
  std::map<std::string, std::string> metadata;
  if (value.is_null()) return metadata;
  if (!value.is_object()) {
    return absl::InvalidArgumentError("\"__metadata__\" is not a JSON object");
  }
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat("\"__metadata__\" entry \"", key, "\" is not a string"));
    }
    metadata.emplace(key, item.get<std::string>());
  }
  return metadata;
}

absl::Status ShortFileError(uint64_t file_size) {
  return absl::DataLossError(
      absl::StrCat("file is ", file_size, " bytes, shorter than the 8-byte header length"));
}

// Rejects shard names that would escape the model directory.
bool IsPlainRelativePath(const std::string& name) {
  if (name.empty()) return false;
  std::filesystem::path path(name);
  if (path.is_absolute()) return false;
  for (const auto& part : path) {
    if (part == "..") return false;
  }
  return true;
}

bool FileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype \"", name, "\""));
}

absl::string_view DTypeName(DType dtype) { return Info(dtype).name; }

size_t DTypeSize(DType dtype) { return Info(dtype).size; }

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t dim : shape) n *= dim;
  return n;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view file_bytes,
                                                         absl::string_view source) {
  auto error = [&](const absl::Status& status) { return Annotate(status, source); };
  const uint64_t file_size = file_bytes.size();
  if (file_size < kHeaderLengthBytes) return error(ShortFileError(file_size));
  const auto* bytes = reinterpret_cast<const std::byte*>(file_bytes.data());

  uint64_t header_length = 0;
  for (size_t i = 0; i < kHeaderLengthBytes; ++i) {
    header_length |= static_cast<uint64_t>(bytes[i]) << (8 * i);
  }
  if (header_length > file_size - kHeaderLengthBytes) {
    return error(absl::DataLossError(absl::StrCat("header length ", header_length,
                                                  " runs past the end of the file (", file_size,
                                                  " bytes)")));
  }
  const char* header_begin = file_bytes.data() + kHeaderLengthBytes;
  Json header;
  try {
    header = Json::parse(header_begin, header_begin + header_length);
  } catch (const Json::exception& e) {
    return error(
        absl::InvalidArgumentError(absl::StrCat("header is not JSON: ", PrintableAscii(e.what()))));
  }
  if (!header.is_object()) {
    return error(absl::InvalidArgumentError(
        absl::StrCat("header is not a JSON object but ", header.type_name())));
  }

  SafetensorsHeader result;
  const std::byte* data = bytes + kHeaderLengthBytes + header_length;
  const uint64_t data_size = file_size - kHeaderLengthBytes - header_length;
  std::vector<std::pair<uint64_t, TensorView>> tensors;
  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      absl::StatusOr<std::map<std::string, std::string>> metadata = ParseMetadata(entry);
      if (!metadata.ok()) return error(metadata.status());
      result.metadata = *std::move(metadata);
      continue;
    }
    absl::StatusOr<TensorView> view = ParseTensorEntry(name, entry, data, data_size);
    if (!view.ok()) return error(view.status());
    uint64_t begin = static_cast<uint64_t>(view->data - data);
    tensors.emplace_back(begin, *std::move(view));
  }
  // Items come sorted by name, so ties (empty tensors) stay in name order.
  std::stable_sort(tensors.begin(), tensors.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  // The data is indexed end to end (the format's rule): overlapping tensors would alias one
  // another's bytes, and a gap or a tail is bytes nothing names.
  uint64_t next = 0;
  const TensorView* previous = nullptr;
  for (const auto& [begin, view] : tensors) {
    if (begin != next) {
      return error(absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", view.name, "\": data_offsets begin at ", begin,
          begin < next ? " inside " : " after a gap following ",
          previous ? absl::StrCat("tensor \"", previous->name, "\", which ends at ", next)
                   : absl::StrCat("the start of the data (", next, ")"),
          " (tensors must cover the data end to end)")));
    }
    next = begin + view.nbytes;
    previous = &view;
  }
  if (next != data_size) {
    return error(absl::InvalidArgumentError(
        absl::StrCat("the tensors cover ", next, " of the ", data_size,
                     " data bytes (tensors must cover the data end to end)")));
  }
  result.tensors.reserve(tensors.size());
  for (auto& [begin, view] : tensors) result.tensors.push_back(std::move(view));
  return result;
}

absl::StatusOr<std::shared_ptr<const SafetensorsFile>> SafetensorsFile::Open(
    const std::string& path) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;

  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int errno_value = errno;
    if (errno_value == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::InternalError(absl::StrCat(
        path, ": open: ", std::error_code(errno_value, std::generic_category()).message()));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int errno_value = errno;
    ::close(fd);
    return absl::InternalError(absl::StrCat(
        path, ": fstat: ", std::error_code(errno_value, std::generic_category()).message()));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < kHeaderLengthBytes) {  // mmap refuses an empty file
    ::close(fd);
    return Annotate(ShortFileError(file_size), path);
  }
  void* mapping = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  int mmap_errno = errno;
  ::close(fd);
  if (mapping == MAP_FAILED) {
    return absl::InternalError(absl::StrCat(
        path, ": mmap: ", std::error_code(mmap_errno, std::generic_category()).message()));
  }
  file->mapping_ = mapping;
  file->mapping_size_ = file_size;

  LATHE_ASSIGN_OR_RETURN(
      SafetensorsHeader header,
      ParseSafetensorsHeader(absl::string_view(static_cast<const char*>(mapping), file_size),
                             path));
  file->metadata_ = std::move(header.metadata);
  file->tensors_ = std::move(header.tensors);
  for (size_t i = 0; i < file->tensors_.size(); ++i)
    file->index_.emplace(file->tensors_[i].name, i);
  return std::shared_ptr<const SafetensorsFile>(std::move(file));
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_size_);
}

const TensorView* SafetensorsFile::Find(absl::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<SafetensorsDirectory> SafetensorsDirectory::Open(const std::string& dir) {
  SafetensorsDirectory result;
  result.dir_ = dir;
  const std::string single_path = (std::filesystem::path(dir) / "model.safetensors").string();
  const std::string index_path =
      (std::filesystem::path(dir) / "model.safetensors.index.json").string();

  if (FileExists(single_path)) {
    LATHE_ASSIGN_OR_RETURN(std::shared_ptr<const SafetensorsFile> file,
                           SafetensorsFile::Open(single_path));
    for (const TensorView& tensor : file->tensors()) {
      result.entries_.emplace(tensor.name, Entry{&tensor, file});
    }
    result.files_.push_back(std::move(file));
    return result;
  }

  absl::StatusOr<std::string> index_text = ReadFile(index_path);
  if (absl::IsNotFound(index_text.status())) {
    return absl::NotFoundError(
        absl::StrCat(dir, ": neither model.safetensors nor model.safetensors.index.json exists"));
  }
  if (!index_text.ok()) return index_text.status();

  auto invalid = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": ", what));
  };
  Json index;
  try {
    index = Json::parse(*index_text);
  } catch (const Json::exception& e) {
    return invalid(absl::StrCat("not JSON: ", PrintableAscii(e.what())));
  }
  if (!index.is_object()) return invalid("not a JSON object");
  auto weight_map_it = index.find("weight_map");
  if (weight_map_it == index.end() || !weight_map_it->is_object()) {
    return invalid("\"weight_map\" is missing or not a JSON object");
  }

  // Shard file name -> tensors the index puts there.
  std::map<std::string, std::vector<std::string>> shards;
  for (const auto& [name, shard] : weight_map_it->items()) {
    if (!shard.is_string() || !IsPlainRelativePath(shard.get<std::string>())) {
      return invalid(absl::StrCat("weight_map entry for tensor \"", name, "\" (",
                                  DescribeJson(shard, 60),
                                  ") is not a file name inside the directory"));
    }
    shards[shard.get<std::string>()].push_back(name);
  }

  for (const auto& [shard, names] : shards) {
    const std::string shard_path = (std::filesystem::path(dir) / shard).string();
    absl::StatusOr<std::shared_ptr<const SafetensorsFile>> file = SafetensorsFile::Open(shard_path);
    if (absl::IsNotFound(file.status())) {
      return invalid(absl::StrCat("weight_map names shard \"", shard, "\" (for tensor \"",
                                  names.front(), "\"), which does not exist"));
    }
    if (!file.ok()) return file.status();
    for (const std::string& name : names) {
      const TensorView* tensor = (*file)->Find(name);
      if (tensor == nullptr) {
        return invalid(absl::StrCat("weight_map puts tensor \"", name, "\" in \"", shard,
                                    "\", which does not contain it"));
      }
      result.entries_.emplace(name, Entry{tensor, *file});
    }
    result.files_.push_back(*std::move(file));
  }
  // Tensors a shard holds beyond the weight map stay reachable; the map wins on conflicts.
  for (const std::shared_ptr<const SafetensorsFile>& file : result.files_) {
    for (const TensorView& tensor : file->tensors()) {
      result.entries_.emplace(tensor.name, Entry{&tensor, file});
    }
  }
  return result;
}

SafetensorsDirectory::Entry SafetensorsDirectory::Find(absl::string_view name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? Entry{} : it->second;
}

std::vector<std::string> SafetensorsDirectory::Names() const {
  std::vector<std::string> names;
  names.reserve(entries_.size());
  for (const auto& [name, entry] : entries_) names.push_back(name);
  return names;
}

absl::Status WriteSafetensors(const std::string& path, absl::Span<const TensorToWrite> tensors,
                              const std::map<std::string, std::string>& metadata) {
  auto invalid = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
  };
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json entries = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) entries[key] = value;
    header[std::string(kMetadataKey)] = std::move(entries);
  }
  std::set<absl::string_view> names;
  uint64_t offset = 0;
  for (const TensorToWrite& tensor : tensors) {
    const std::string quoted = absl::StrCat("tensor \"", tensor.name, "\"");
    if (tensor.name.empty() || tensor.name == kMetadataKey) {
      return invalid(absl::StrCat(quoted, ": name is empty or reserved"));
    }
    if (!names.insert(tensor.name).second) {
      return invalid(absl::StrCat(quoted, ": duplicate tensor name"));
    }
    std::optional<uint64_t> expected = ByteCount(tensor.shape, DTypeSize(tensor.dtype));
    if (!expected.has_value()) {
      return invalid(absl::StrCat(quoted, ": shape ", ShapeString(tensor.shape),
                                  " has a negative dimension or overflows the byte count"));
    }
    if (tensor.nbytes != *expected) {
      return invalid(absl::StrCat(quoted, ": ", tensor.nbytes, " bytes given but ",
                                  DTypeName(tensor.dtype), " ", ShapeString(tensor.shape),
                                  " needs ", *expected));
    }
    if (tensor.nbytes > 0 && tensor.data == nullptr) {
      return invalid(absl::StrCat(quoted, ": data is null"));
    }
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = std::string(DTypeName(tensor.dtype));
    entry["shape"] = tensor.shape;
    entry["data_offsets"] = {offset, offset + tensor.nbytes};
    header[tensor.name] = std::move(entry);
    offset += tensor.nbytes;
  }

  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const nlohmann::ordered_json::exception& e) {
    // Names or metadata that are not valid UTF-8.
    return invalid(absl::StrCat("cannot encode the header: ", e.what()));
  }
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  char length[kHeaderLengthBytes];
  for (size_t i = 0; i < kHeaderLengthBytes; ++i) {
    length[i] = static_cast<char>((static_cast<uint64_t>(header_text.size()) >> (8 * i)) & 0xff);
  }

  LATHE_ASSIGN_OR_RETURN(AtomicFileWriter writer, AtomicFileWriter::Open(path));
  LATHE_RETURN_IF_ERROR(writer.Append(length, sizeof(length)));
  LATHE_RETURN_IF_ERROR(writer.Append(header_text));
  for (const TensorToWrite& tensor : tensors) {
    if (tensor.nbytes > 0) LATHE_RETURN_IF_ERROR(writer.Append(tensor.data, tensor.nbytes));
  }
  return writer.Commit();
}

}  // namespace lathe
