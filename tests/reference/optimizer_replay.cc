// lathe-optimizer-replay --in IN.safetensors --out OUT.safetensors
//
// Replays a fixed sequence of gradients through one of the engine's optimizers
// (worker/engine/optimizer.h), single-threaded, so that test_reference.py can hold it to the
// reference's own implementation bit for bit. IN holds float32 "param.<name>" (initial
// values) and "grad.<k>.<name>" (k = 1..steps), with metadata "steps", "lrs" (a JSON list),
// "train" (a JSON object of train.* fields: optimizer and its hyperparameters) and
// "no_decay" (a JSON list of parameter names without weight decay). OUT gets the final
// "param.<name>" and the optimizer's state under its checkpoint names.
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/command_line.h"
#include "common/job_spec.h"
#include "common/safetensors.h"
#include "nlohmann/json.hpp"
#include "worker/engine/optimizer.h"
#include "worker/engine/weights.h"

namespace lathe {
namespace {

absl::StatusOr<TrainSpec> TrainFrom(const nlohmann::json& train) {
  TrainSpec t;
  const std::map<std::string, OptimizerKind> kinds = {{"adamw", OptimizerKind::kAdamW},
                                                      {"adamw8bit", OptimizerKind::kAdamW8bit},
                                                      {"adafactor", OptimizerKind::kAdafactor},
                                                      {"sgd", OptimizerKind::kSgd}};
  auto kind = kinds.find(train.value("optimizer", "adamw"));
  if (kind == kinds.end()) return absl::InvalidArgumentError("train.optimizer: unknown");
  t.optimizer = kind->second;
  t.adam_beta1 = train.value("adam_beta1", t.adam_beta1);
  t.adam_beta2 = train.value("adam_beta2", t.adam_beta2);
  t.adam_eps = train.value("adam_eps", t.adam_eps);
  t.weight_decay = train.value("weight_decay", t.weight_decay);
  t.sgd_momentum = train.value("sgd_momentum", t.sgd_momentum);
  t.sgd_nesterov = train.value("sgd_nesterov", t.sgd_nesterov);
  t.adafactor_beta1 = train.value("adafactor_beta1", t.adafactor_beta1);
  t.adafactor_decay_rate = train.value("adafactor_decay_rate", t.adafactor_decay_rate);
  t.adafactor_clip_threshold = train.value("adafactor_clip_threshold", t.adafactor_clip_threshold);
  t.adafactor_relative_step = train.value("adafactor_relative_step", t.adafactor_relative_step);
  return t;
}

absl::Status Replay(const std::string& in, const std::string& out) {
  at::set_num_threads(1);
  absl::StatusOr<std::shared_ptr<const SafetensorsFile>> file = SafetensorsFile::Open(in);
  if (!file.ok()) return file.status();
  const std::map<std::string, std::string>& meta = (*file)->metadata();
  int64_t steps = 0;
  if (!meta.count("steps") || !absl::SimpleAtoi(meta.at("steps"), &steps) || !meta.count("lrs") ||
      !meta.count("train")) {
    return absl::InvalidArgumentError(in + ": metadata needs steps, lrs and train");
  }
  const nlohmann::json lrs = nlohmann::json::parse(meta.at("lrs"));
  const nlohmann::json no_decay =
      meta.count("no_decay") ? nlohmann::json::parse(meta.at("no_decay")) : nlohmann::json::array();
  absl::StatusOr<TrainSpec> train = TrainFrom(nlohmann::json::parse(meta.at("train")));
  if (!train.ok()) return train.status();

  std::vector<NamedParameter> params;
  for (const TensorView& view : (*file)->tensors()) {  // sorted by name
    if (view.name.rfind("param.", 0) != 0) continue;
    absl::StatusOr<at::Tensor> tensor = TensorFromFile({&view, *file}, at::kFloat, true);
    if (!tensor.ok()) return tensor.status();
    const std::string name = view.name.substr(6);
    bool decays = true;
    for (const auto& n : no_decay) decays = decays && n.get<std::string>() != name;
    params.push_back({name, *tensor, decays});
  }
  std::unique_ptr<Optimizer> optimizer = MakeOptimizer(params, *train);
  for (int64_t k = 1; k <= steps; ++k) {
    for (NamedParameter& p : params) {
      const std::string name = absl::StrCat("grad.", k, ".", p.name);
      const TensorView* view = (*file)->Find(name);
      if (view == nullptr) return absl::InvalidArgumentError(in + ": no tensor " + name);
      absl::StatusOr<at::Tensor> grad = TensorFromFile({view, *file}, at::kFloat, true);
      if (!grad.ok()) return grad.status();
      p.tensor.mutable_grad() = *grad;
    }
    optimizer->Step(lrs.at(k - 1).get<double>());
  }
  TensorsToWrite tensors;
  for (const NamedParameter& p : params) tensors.Add("param." + p.name, p.tensor);
  optimizer->AddStateTo(&tensors);
  return WriteSafetensors(out, tensors.tensors(), {{"steps", absl::StrCat(steps)}});
}

}  // namespace
}  // namespace lathe

int main(int argc, char** argv) {
  const std::vector<lathe::FlagSpec> specs = {
      {"in", true, "the parameters and gradients (safetensors)"},
      {"out", true, "where to write the final parameters and the optimizer state"}};
  absl::StatusOr<lathe::ParsedFlags> flags = lathe::ParseFlags({argv + 1, argv + argc}, specs);
  if (!flags.ok() || !flags->Has("in") || !flags->Has("out")) {
    std::cerr << "usage: lathe-optimizer-replay --in IN.safetensors --out OUT.safetensors\n";
    return 2;
  }
  absl::Status status = lathe::Replay(flags->Get("in"), flags->Get("out"));
  if (!status.ok()) {
    std::cerr << "lathe-optimizer-replay: " << status.message() << "\n";
    return 1;
  }
  return 0;
}
