#include "coordinator/planner/model_states.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/flat_layout.h"

namespace lathe {

absl::StatusOr<ProjectionDims> ProjectionOf(const ModelShape& shape, absl::string_view name) {
  const int64_t h = shape.hidden_size, i = shape.intermediate_size;
  const int64_t q = shape.num_heads * shape.head_dim, kv = shape.num_kv_heads * shape.head_dim;
  if (name == "q_proj") return ProjectionDims{h, q};
  if (name == "k_proj" || name == "v_proj") return ProjectionDims{h, kv};
  if (name == "o_proj") return ProjectionDims{q, h};
  if (name == "gate_proj" || name == "up_proj") return ProjectionDims{h, i};
  if (name == "down_proj") return ProjectionDims{i, h};
  return absl::InvalidArgumentError(absl::StrCat("lora.targets: \"", name, "\" is not a ",
                                                 ModelFamilyName(shape.family), " projection"));
}

absl::StatusOr<int64_t> LoraParamsPerBlock(const ModelShape& shape, int64_t rank,
                                           const std::vector<std::string>& targets) {
  int64_t total = 0;
  for (const std::string& target : targets) {
    absl::StatusOr<ProjectionDims> p = ProjectionOf(shape, target);
    if (!p.ok()) return p.status();
    total += rank * (p->in + p->out);  // A [rank, in] and B [out, rank]
  }
  return total;
}

absl::StatusOr<std::vector<UnitElements>> UnitsOf(const ModelShape& shape, Method method,
                                                  int64_t lora_rank,
                                                  const std::vector<std::string>& targets) {
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
  std::vector<UnitElements> units = {unit(shape.embeddings, 0)};
  units.insert(units.end(), shape.num_layers, unit(shape.block.total(), adapters));
  units.push_back(unit(shape.final_norm + shape.lm_head, 0));
  return units;
}

ModelStateBytes ModelStates(const std::vector<UnitElements>& units, int64_t weight_bytes,
                            const ShardingChoice& c) {
  const int64_t n = c.ranks;
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
