// Fuzzes ParseSafetensorsHeader (common/safetensors.h) with whole files: any bytes must give
// DATA_LOSS or INVALID_ARGUMENT, or tensors that lie inside the data and cover it end to end.
#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/safetensors.h"
#include "fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<lathe::SafetensorsHeader> header =
      lathe::ParseSafetensorsHeader(bytes, "model.safetensors");
  if (!header.ok()) {
    if (!absl::IsDataLoss(header.status()) && !absl::IsInvalidArgument(header.status())) {
      lathe::FuzzFail("safetensors_fuzzer", "neither DATA_LOSS nor INVALID_ARGUMENT");
    }
    return 0;
  }
  uint64_t header_length = 0;
  for (int i = 0; i < 8; ++i) header_length |= static_cast<uint64_t>(data[i]) << (8 * i);
  const auto* end = reinterpret_cast<const std::byte*>(data + size);
  const std::byte* next = reinterpret_cast<const std::byte*>(data + 8 + header_length);
  for (const lathe::TensorView& tensor : header->tensors) {
    if (tensor.data > end || tensor.nbytes > static_cast<size_t>(end - tensor.data)) {
      lathe::FuzzFail("safetensors_fuzzer", "a tensor lies outside the file");
    }
    if (tensor.data != next)
      lathe::FuzzFail("safetensors_fuzzer", "the tensors do not cover the data end to end");
    next = tensor.data + tensor.nbytes;
    if (static_cast<uint64_t>(tensor.numel()) * lathe::DTypeSize(tensor.dtype) != tensor.nbytes) {
      lathe::FuzzFail("safetensors_fuzzer", "numel x dtype size is not nbytes");
    }
  }
  if (next != end)
    lathe::FuzzFail("safetensors_fuzzer", "the tensors do not reach the end of the file");
  return 0;
}
