// The checks of a model directory's weights that cost no tensor data: what admission runs
// at submit (coordinator/scheduler/job_manager.h) so that a directory without weights, a
// truncated or malformed safetensors file, or a missing tensor is refused before the job
// waits in the queue, not when its trainer loads the weights.
//
// Thread-safety: stateless; safe from any thread.
#ifndef LATHE_COMMON_WEIGHTS_CHECK_H_
#define LATHE_COMMON_WEIGHTS_CHECK_H_

#include <string>

#include "absl/status/status.h"
#include "common/job_spec.h"
#include "common/model_config.h"

namespace lathe {

// Opens the weights of `dir` as the engine does (SafetensorsDirectory::Open:
// model.safetensors, else every shard model.safetensors.index.json names) and checks every
// file's header against its size: the 8-byte length, the JSON, each tensor's dtype, shape
// and data_offsets, offsets inside the file, no overlap and no gap. The files are mapped,
// never read: only the header's pages are touched. Then checks that every tensor the
// engine loads for `config` (ExpectedWeights) is present with the shape config.json
// implies. Returns, with the message of SafetensorsDirectory::Open or one of:
//   NOT_FOUND "<dir>: neither model.safetensors nor model.safetensors.index.json exists";
//   INVALID_ARGUMENT "<dir>: tensor "<name>" is missing (config.json implies shape [..])";
//   INVALID_ARGUMENT "<file>: tensor "<name>": shape [..] in the file vs [..] from
//   config.json".
absl::Status CheckModelWeights(const std::string& dir, const ModelConfig& config);

// The checks CausalLm::LoadLora makes of `lora.init_from` (`dir`), but for the values:
// adapter_config.json parses and its r equals lora.rank; adapter_model.safetensors has a
// valid header and holds the A and B tensor of every targeted projection of every layer with
// the shape `config` and `lora` imply. INVALID_ARGUMENT (or the file's error) naming the file
// and the tensor, without the field's name.
absl::Status CheckLoraInitFrom(const std::string& dir, const ModelConfig& config,
                               const LoraSpec& lora);

}  // namespace lathe

#endif  // LATHE_COMMON_WEIGHTS_CHECK_H_
