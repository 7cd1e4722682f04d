#include "planner/model_states.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/flat_layout.h"
#include "common/model_config.h"

namespace lathe {

const std::vector<std::string>& ProjectionNamesOf(const ModelShape& shape) {
  return ProjectionModules(shape.config);
}

std::vector<std::string> LoraTargetsOn(const ModelShape& shape,
                                       const std::vector<std::string>& targets) {
  return targets.empty() ? ProjectionNamesOf(shape) : targets;
}

absl::StatusOr<ProjectionShape> ProjectionOf(const ModelShape& shape, absl::string_view name) {
  const std::vector<std::string>& names = ProjectionNamesOf(shape);
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    // The words of common/model_config.h's LoraTargetsOf, which the engine answers.
    return absl::InvalidArgumentError(absl::StrCat(
        "lora.targets: \"", name, "\" is not a projection of this ", shape.config.model_type,
        " model (its modules: ", absl::StrJoin(names, ", "), ")"));
  }
  return ProjectionShapeOf(shape.config, name);
}

absl::StatusOr<int64_t> LoraParamsPerBlock(const ModelShape& shape, int64_t rank,
                                           const std::vector<std::string>& targets) {
  int64_t total = 0;
  for (const std::string& target : LoraTargetsOn(shape, targets)) {
    absl::StatusOr<ProjectionShape> p = ProjectionOf(shape, target);
    if (!p.ok()) return p.status();
    total += rank * (p->in_features + p->out_features);  // A [rank, in] and B [out, rank]
  }
  return total;
}

absl::StatusOr<std::vector<UnitElements>> UnitsOf(const ModelShape& shape, Method method,
                                                  int64_t lora_rank,
                                                  const std::vector<std::string>& targets,
                                                  SavedModules saved) {
  const bool full = method == Method::kFull;
  auto unit = [full](int64_t base, int64_t adapters) {
    return full ? UnitElements{0, base} : UnitElements{base, adapters};
  };
  int64_t adapters = 0;
  if (!full) {
    absl::StatusOr<int64_t> lora = LoraParamsPerBlock(shape, lora_rank, targets);
    if (!lora.ok()) return lora.status();
    adapters = *lora;
  }
  // A saved module's copy is a float32 trainable tensor of its unit, beside the frozen base.
  const int64_t copy = shape.config.vocab_size * shape.config.hidden_size;
  std::vector<UnitElements> units = {unit(shape.embeddings, saved.embed_tokens ? copy : 0)};
  units.insert(units.end(), shape.config.num_hidden_layers, unit(shape.block.total(), adapters));
  units.push_back(unit(shape.final_norm + shape.lm_head, saved.lm_head ? copy : 0));
  return units;
}

absl::StatusOr<std::vector<TrainableShape>> TrainableShapes(const ModelShape& shape, Method method,
                                                            int64_t lora_rank,
                                                            const std::vector<std::string>& targets,
                                                            SavedModules saved) {
  std::vector<TrainableShape> shapes;
  if (method != Method::kFull) {
    for (const std::string& target : LoraTargetsOn(shape, targets)) {
      absl::StatusOr<ProjectionShape> p = ProjectionOf(shape, target);
      if (!p.ok()) return p.status();
      for (int64_t layer = 0; layer < shape.config.num_hidden_layers; ++layer) {
        shapes.push_back({{lora_rank, p->in_features}});
        shapes.push_back({{p->out_features, lora_rank}});
      }
    }
    const int64_t h = shape.config.hidden_size, v = shape.config.vocab_size;
    if (saved.embed_tokens) shapes.push_back({{v, h}, /*embeddings=*/true});
    if (saved.lm_head) shapes.push_back({{v, h}});
    return shapes;
  }
  const int64_t h = shape.config.hidden_size, v = shape.config.vocab_size;
  shapes.push_back({{v, h}, /*embeddings=*/true});
  if (shape.lm_head > 0) shapes.push_back({{v, h}});
  shapes.push_back({{h}});  // the final norm
  for (int64_t layer = 0; layer < shape.config.num_hidden_layers; ++layer) {
    // The engine's tensors: Phi-3's fused qkv_proj and gate_up_proj are one each.
    for (const std::string& name : ProjectionNamesOf(shape)) {
      const absl::StatusOr<ProjectionShape> p = ProjectionOf(shape, name);
      if (!p.ok()) return p.status();
      shapes.push_back({{p->out_features, p->in_features}});
    }
    for (int64_t n = 0; n < shape.block.hidden_norms(h, shape.config.head_dim); ++n) {
      shapes.push_back({{h}});
    }
    for (int64_t n = 0; n < shape.block.head_norms; ++n)
      shapes.push_back({{shape.config.head_dim}});
    // Biases: q, k, v (Qwen2) and any others, as vectors of their total size.
    if (shape.block.attention_bias > 0) shapes.push_back({{shape.block.attention_bias}});
    if (shape.block.mlp_bias > 0) shapes.push_back({{shape.block.mlp_bias}});
  }
  return shapes;
}

OptimizerChoice OptimizerChoiceOf(const TrainSpec& train) {
  OptimizerChoice choice{train.optimizer, true};
  if (train.optimizer == OptimizerKind::kAdafactor) choice.first_moment = train.adafactor_beta1 > 0;
  if (train.optimizer == OptimizerKind::kSgd) choice.first_moment = train.sgd_momentum > 0;
  choice.weight_decay = train.weight_decay > 0;
  choice.nesterov = train.sgd_nesterov;
  return choice;
}

int64_t OptimizerStateBytes(const std::vector<TrainableShape>& shapes,
                            const OptimizerChoice& optimizer, int64_t ranks) {
  constexpr int64_t kMin8bit = 4096, kBlock = 2048;
  int64_t bytes = 0;
  for (const TrainableShape& shape : shapes) {
    const std::vector<int64_t>& s = shape.dims;
    int64_t whole = 1;
    for (int64_t d : s) whole *= d;
    const int64_t n = (whole + ranks - 1) / ranks;  // this rank's piece
    switch (optimizer.kind) {
      case OptimizerKind::kAdamW:
        bytes += 8 * n;
        break;
      case OptimizerKind::kAdamW8bit: {
        const int64_t blocks = (n + kBlock - 1) / kBlock;
        bytes += whole < kMin8bit || shape.embeddings ? 8 * n : 2 * blocks * kBlock + 8 * blocks;
        break;
      }
      case OptimizerKind::kAdafactor:  // the factored statistics whole on every rank
        bytes += s.size() >= 2 ? 4 * (whole / s.back() + whole / s[s.size() - 2]) : 4 * n;
        if (optimizer.first_moment) bytes += 4 * n;
        break;
      case OptimizerKind::kSgd:
        if (optimizer.first_moment) bytes += 4 * n;
        break;
    }
  }
  return bytes;
}

int64_t StepTemporaryBytesPerElement(const OptimizerChoice& optimizer) {
  switch (optimizer.kind) {
    case OptimizerKind::kAdamW:
      return 8;
    case OptimizerKind::kAdamW8bit:
      return 21;
    case OptimizerKind::kAdafactor:
      return 8;
    case OptimizerKind::kSgd:
      return 4 * ((optimizer.weight_decay ? 1 : 0) + (optimizer.nesterov ? 1 : 0));
  }
  return 8;
}

ModelStateBytes ModelStates(const std::vector<UnitElements>& units, int64_t weight_bytes,
                            int64_t ranks, const Strategy& c) {
  const int64_t n = ranks;
  ModelStateBytes b;
  for (const UnitElements& u : units) {
    const int64_t frozen_slice = ShardNumel(u.frozen, n);
    const int64_t trainable_slice = ShardNumel(u.trainable, n);
    switch (c.zero_stage) {
      case 0:
        b.weights += weight_bytes * u.frozen;
        b.trainable += 4 * u.trainable;
        b.gradients += 4 * u.trainable;
        b.optimizer += 8 * u.trainable;
        break;
      case 1:
      case 2:
        b.weights += weight_bytes * u.frozen;
        b.trainable += 4 * n * trainable_slice;  // whole, padded
        b.gradients += 4 * (c.zero_stage == 1 ? n * trainable_slice : trainable_slice);
        b.optimizer += 8 * trainable_slice;
        break;
      default:
        b.weights += weight_bytes * frozen_slice;
        b.trainable += 4 * trainable_slice;
        b.gradients += 4 * trainable_slice;
        b.optimizer += 8 * trainable_slice;
        b.gathered_unit =
            std::max(b.gathered_unit, n * (weight_bytes * frozen_slice + 4 * trainable_slice));
        break;
    }
    if (c.offload_optimizer) b.host += 12 * trainable_slice;  // master and both moments
  }
  if (c.offload_optimizer) b.optimizer = 0;
  if (c.offload_params && c.zero_stage == 3) {
    b.host += b.weights + b.trainable;
    b.weights = b.trainable = 0;
  }
  return b;
}

}  // namespace lathe
