// Moving tensors between safetensors files (common/safetensors.h) and libtorch.
//
// Thread-safety: free functions over immutable inputs.
#ifndef LATHE_WORKER_ENGINE_WEIGHTS_H_
#define LATHE_WORKER_ENGINE_WEIGHTS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/safetensors.h"
#include "kernels/ops/torch_compat.h"

namespace lathe {

// The tensor `entry` as a CPU tensor of `dtype` (at::ScalarType::Undefined: the file's own
// dtype, as the shard layer reads weights it slices). When the file already holds `dtype`, the
// data is suitably aligned and `writable` is false, the result views the read-only mapping
// (zero copy; it keeps the file mapped while alive); otherwise it is a fresh copy.
// INVALID_ARGUMENT naming the tensor and file for dtypes libtorch cannot convert.
absl::StatusOr<at::Tensor> TensorFromFile(const SafetensorsDirectory::Entry& entry,
                                          at::ScalarType dtype, bool writable);

// Tensors prepared for WriteSafetensors. Holds contiguous CPU copies alive until destroyed.
class TensorsToWrite {
 public:
  // Adds `tensor` (any device; F32, BF16, F16 or U8) under `name`.
  void Add(std::string name, const at::Tensor& tensor);
  const std::vector<TensorToWrite>& tensors() const { return tensors_; }

 private:
  std::vector<at::Tensor> keep_alive_;
  std::vector<TensorToWrite> tensors_;
};

}  // namespace lathe

#endif  // LATHE_WORKER_ENGINE_WEIGHTS_H_
