// lathe-nf4-quantize --in IN.safetensors --out OUT.safetensors
//
// Quantizes every 2-D float tensor of IN to NF4 (kernels/ops/nf4_linear.h) and writes, per
// tensor <t>: <t>.codes (U8, packed levels: ceil(n / 2) bytes), <t>.absmax_codes (U8),
// <t>.absmax2 (F32), <t>.offset (F32 [1]) and <t>.dequantized (F32, the input's shape), so
// that test_reference.py holds it to the reference's own implementation bit for bit.
#include <iostream>
#include <string>
#include <vector>

#include "common/command_line.h"
#include "common/safetensors.h"
#include "kernels/ops/nf4_linear.h"
#include "worker/engine/weights.h"

namespace lathe {
namespace {

absl::Status Quantize(const std::string& in, const std::string& out) {
  absl::StatusOr<std::shared_ptr<const SafetensorsFile>> file = SafetensorsFile::Open(in);
  if (!file.ok()) return file.status();
  TensorsToWrite tensors;
  for (const TensorView& view : (*file)->tensors()) {
    absl::StatusOr<at::Tensor> weight = TensorFromFile({&view, *file}, at::kFloat, false);
    if (!weight.ok()) return weight.status();
    if (weight->dim() != 2)
      return absl::InvalidArgumentError(in + ": " + view.name + " is not 2-D");
    const kernels::Nf4Weight q = kernels::QuantizeNf4(*weight, at::kCPU);
    tensors.Add(view.name + ".codes", q.codes.narrow(0, 0, (weight->numel() + 1) / 2));
    tensors.Add(view.name + ".absmax_codes", q.absmax_codes);
    tensors.Add(view.name + ".absmax2", q.absmax2);
    tensors.Add(view.name + ".offset", at::full({1}, q.offset, at::kFloat));
    tensors.Add(view.name + ".dequantized",
                kernels::DequantizeNf4(q, 0, weight->numel()).view(weight->sizes()));
  }
  return WriteSafetensors(out, tensors.tensors());
}

}  // namespace
}  // namespace lathe

int main(int argc, char** argv) {
  const std::vector<lathe::FlagSpec> specs = {{"in", true, "2-D float tensors (safetensors)"},
                                              {"out", true, "where to write their NF4 form"}};
  absl::StatusOr<lathe::ParsedFlags> flags = lathe::ParseFlags({argv + 1, argv + argc}, specs);
  if (!flags.ok() || !flags->Has("in") || !flags->Has("out")) {
    std::cerr << "usage: lathe-nf4-quantize --in IN.safetensors --out OUT.safetensors\n";
    return 2;
  }
  absl::Status status = lathe::Quantize(flags->Get("in"), flags->Get("out"));
  if (!status.ok()) {
    std::cerr << "lathe-nf4-quantize: " << status.message() << "\n";
    return 1;
  }
  return 0;
}
