#include "worker/engine/weights.h"

#include <cstdint>

#include "absl/strings/str_cat.h"

namespace lathe {
namespace {

absl::StatusOr<at::ScalarType> ScalarTypeOf(DType dtype) {
  switch (dtype) {
    case DType::kF64:
      return at::kDouble;
    case DType::kF32:
      return at::kFloat;
    case DType::kF16:
      return at::kHalf;
    case DType::kBF16:
      return at::kBFloat16;
    case DType::kI64:
      return at::kLong;
    case DType::kI32:
      return at::kInt;
    case DType::kI16:
      return at::kShort;
    case DType::kI8:
      return at::kChar;
    case DType::kU8:
      return at::kByte;
    case DType::kBool:
      return at::kBool;
  }
  return absl::InvalidArgumentError("unknown dtype");
}

absl::StatusOr<DType> DTypeOf(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return DType::kF32;
    case at::kHalf:
      return DType::kF16;
    case at::kBFloat16:
      return DType::kBF16;
    case at::kByte:
      return DType::kU8;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("cannot write tensors of type ", c10::toString(type)));
  }
}

}  // namespace

absl::StatusOr<at::Tensor> TensorFromFile(const SafetensorsDirectory::Entry& entry,
                                          at::ScalarType dtype, bool writable) {
  const TensorView& view = *entry.tensor;
  absl::StatusOr<at::ScalarType> stored = ScalarTypeOf(view.dtype);
  if (!stored.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(entry.file->path(), ": tensor \"", view.name,
                                                   "\": ", stored.status().message()));
  }
  auto* data = const_cast<std::byte*>(view.data);  // never written through: see below
  bool aligned = reinterpret_cast<uintptr_t>(data) % DTypeSize(view.dtype) == 0;
  std::shared_ptr<const SafetensorsFile> file = entry.file;
  at::Tensor mapped;
  if (aligned) {
    mapped = at::from_blob(
        data, view.shape, [file](void*) {}, at::TensorOptions(*stored));
  } else {
    // Misaligned data: copy the bytes first.
    mapped = at::empty(view.shape, at::TensorOptions(*stored));
    std::memcpy(mapped.data_ptr(), data, view.nbytes);
  }
  if (dtype == at::ScalarType::Undefined) dtype = *stored;
  if (*stored == dtype && !writable && aligned) return mapped;  // read-only view of the file
  if (*stored == dtype) return aligned ? mapped.clone() : mapped;
  return mapped.to(dtype);
}

void TensorsToWrite::Add(std::string name, const at::Tensor& tensor) {
  at::Tensor cpu = tensor.detach().to(at::kCPU).contiguous();
  keep_alive_.push_back(cpu);
  absl::StatusOr<DType> dtype = DTypeOf(cpu.scalar_type());
  // Callers add float tensors of the three model dtypes and 8-bit optimizer codes.
  TORCH_CHECK(dtype.ok(), std::string(dtype.status().message()));
  std::vector<int64_t> shape(cpu.sizes().begin(), cpu.sizes().end());
  tensors_.push_back({std::move(name), *dtype, std::move(shape), cpu.data_ptr(),
                      static_cast<size_t>(cpu.numel()) * cpu.element_size()});
}

}  // namespace lathe
