// The engine's optimizers (worker/engine/optimizer.h) in-process: the 8-bit maps, SGD and
// AdamW against libtorch's own, the 8-bit state's layout and size. The Python reference
// holds every optimizer to its own implementation bit for bit (test_reference.py,
// OptimizerReplayTest), and resume_after_kill_test.py each one's checkpoints.
#include "worker/engine/optimizer.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/ops/nf4_linear.h"
#include "torch/optim/adamw.h"
#include "torch/optim/sgd.h"

namespace lathe {
namespace {

TEST(OptimizerTest, TheDynamicMapsHave256SortedValuesFromZeroToOne) {
  for (bool is_signed : {true, false}) {
    at::Tensor map = kernels::DynamicQuantizationMap(is_signed);
    ASSERT_EQ(map.numel(), 256);
    EXPECT_TRUE(at::all(map.narrow(0, 1, 255) > map.narrow(0, 0, 255)).item<bool>());
    EXPECT_EQ(map[255].item<float>(), 1.0f);
    EXPECT_EQ(at::sum(map == 0).item<int64_t>(), 1);
    if (is_signed) {
      EXPECT_GT(map[0].item<float>(), -1.0f);
      EXPECT_LT(map[0].item<float>(), -0.99f);
    } else {
      EXPECT_EQ(map[0].item<float>(), 0.0f);
    }
    // Seven decades down to 1e-6 x the block's largest magnitude.
    EXPECT_LT(at::abs(map).masked_select(map != 0).min().item<float>(), 1e-6f);
  }
}

// Three parameters, one below the 8-bit threshold, with gradients of several scales.
std::vector<NamedParameter> Params() {
  at::manual_seed(3);
  return {{"small", at::randn({3000}), false},
          {"square", at::randn({64, 96}), true},
          {"ragged", at::randn({50, 300}), true}};
}

std::vector<at::Tensor> Clones(const std::vector<NamedParameter>& params) {
  std::vector<at::Tensor> out;
  for (const NamedParameter& p : params) out.push_back(p.tensor.clone());
  return out;
}

void SetGrads(std::vector<NamedParameter>& params, std::vector<at::Tensor>& twins, int step) {
  at::manual_seed(100 + step);
  const double scales[] = {1e-3, 1.0, 10.0};
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor g = at::randn(params[i].tensor.sizes()) * scales[i];
    params[i].tensor.mutable_grad() = g;
    twins[i].mutable_grad() = g.clone();
  }
}

// SGD is libtorch's C++ SGD bit for bit. AdamW follows Python's torch.optim.AdamW, which users
// run and which takes the first moment by lerp; libtorch's C++ AdamW still multiplies and
// adds, so the two differ by the first moment's rounding alone (a few ulp after four steps).
// tests/reference's OptimizerReplayTest holds AdamW to torch.optim.AdamW itself, bit for bit.
TEST(OptimizerTest, SgdIsLibtorchsOwnBitForBitAndAdamWWithinRounding) {
  TrainSpec sgd;
  sgd.optimizer = OptimizerKind::kSgd;
  sgd.sgd_momentum = 0.9;
  sgd.sgd_nesterov = true;
  sgd.weight_decay = 0.01;
  TrainSpec adamw;
  adamw.weight_decay = 0.01;
  for (const TrainSpec& train : {sgd, adamw}) {
    std::vector<NamedParameter> params = Params();
    std::vector<at::Tensor> twins = Clones(params);
    std::unique_ptr<Optimizer> ours = MakeOptimizer(params, train);
    // libtorch's, with the no-decay parameter in its own group.
    std::vector<torch::optim::OptimizerParamGroup> groups;
    std::unique_ptr<torch::optim::Optimizer> theirs;
    if (train.optimizer == OptimizerKind::kSgd) {
      auto options = [&](double wd) {
        return std::make_unique<torch::optim::SGDOptions>(
            torch::optim::SGDOptions(1.0).momentum(0.9).nesterov(true).weight_decay(wd));
      };
      groups.emplace_back(std::vector<at::Tensor>{twins[0]}, options(0.0));
      groups.emplace_back(std::vector<at::Tensor>{twins[1], twins[2]}, options(0.01));
      theirs = std::make_unique<torch::optim::SGD>(groups, torch::optim::SGDOptions(1.0));
    } else {
      auto options = [&](double wd) {
        return std::make_unique<torch::optim::AdamWOptions>(
            torch::optim::AdamWOptions(1.0).weight_decay(wd));
      };
      groups.emplace_back(std::vector<at::Tensor>{twins[0]}, options(0.0));
      groups.emplace_back(std::vector<at::Tensor>{twins[1], twins[2]}, options(0.01));
      theirs = std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(1.0));
    }
    const double lrs[] = {1e-2, 3e-2, 5e-3, 2e-2};
    for (int step = 0; step < 4; ++step) {
      SetGrads(params, twins, step);
      for (auto& group : theirs->param_groups()) group.options().set_lr(lrs[step]);
      ours->Step(lrs[step]);
      theirs->step();
    }
    const bool exact = train.optimizer == OptimizerKind::kSgd;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(exact ? at::equal(params[i].tensor, twins[i])
                        : at::allclose(params[i].tensor, twins[i], /*rtol=*/1e-6, /*atol=*/1e-7))
          << OptimizerKindName(train.optimizer) << " " << params[i].name << ": "
          << (params[i].tensor - twins[i]).abs().max().item<float>();
    }
  }
}

TEST(OptimizerTest, EightBitStateIsCodesAndBlockMaximaAndTracksAdamW) {
  TrainSpec train;
  train.optimizer = OptimizerKind::kAdamW8bit;
  std::vector<NamedParameter> params = Params();
  std::vector<at::Tensor> twins = Clones(params);
  std::unique_ptr<Optimizer> eight = MakeOptimizer(params, train);
  std::vector<NamedParameter> twin_params = {
      {"small", twins[0], false}, {"square", twins[1], true}, {"ragged", twins[2], true}};
  train.optimizer = OptimizerKind::kAdamW;
  std::unique_ptr<Optimizer> full = MakeOptimizer(twin_params, train);
  // 3000 elements: float32 moments; 6144: 3 blocks; 15000: 8 blocks (the last one partial).
  EXPECT_EQ(eight->StateBytes(), 8 * 3000 + 2 * (3 * 2048 + 4 * 3) + 2 * (8 * 2048 + 4 * 8));
  for (int step = 0; step < 5; ++step) {
    SetGrads(params, twins, step);
    eight->Step(1e-3);
    full->Step(1e-3);
  }
  // The small tensor takes AdamW's own path; the others stay within a few percent of the
  // distance AdamW moved them.
  EXPECT_TRUE(at::equal(params[0].tensor, twins[0]));
  at::manual_seed(3);
  std::vector<NamedParameter> start = Params();
  for (size_t i = 1; i < params.size(); ++i) {
    const double moved = (twins[i] - start[i].tensor).abs().mean().item<double>();
    const double apart = (params[i].tensor - twins[i]).abs().mean().item<double>();
    EXPECT_LT(apart, 0.05 * moved) << params[i].name;
  }
  TensorsToWrite state;
  eight->AddStateTo(&state);
  std::vector<std::string> names;
  for (const TensorToWrite& t : state.tensors()) names.push_back(t.name);
  EXPECT_THAT(names, ::testing::Contains("exp_avg.square.codes"));
  EXPECT_THAT(names, ::testing::Contains("exp_avg_sq.ragged.absmax"));
  EXPECT_THAT(names, ::testing::Contains("exp_avg.small"));
}

// Paged from host memory (here the CPU's: the same copies, within host memory), every
// optimizer computes exactly what it computes with its state in place.
TEST(OptimizerTest, PagedStateUpdatesBitForBitAsResidentState) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdamW8bit,
                             OptimizerKind::kAdafactor, OptimizerKind::kSgd}) {
    SCOPED_TRACE(std::string(OptimizerKindName(kind)));
    TrainSpec train;
    train.optimizer = kind;
    train.sgd_momentum = 0.9;
    train.adafactor_beta1 = 0.9;
    train.weight_decay = 0.01;
    std::vector<NamedParameter> params = Params();
    std::vector<at::Tensor> twins = Clones(params);
    std::vector<NamedParameter> twin_params = params;
    for (size_t i = 0; i < params.size(); ++i) twin_params[i].tensor = twins[i];
    std::unique_ptr<Optimizer> resident = MakeOptimizer(params, train);
    train.paged_optimizer = true;
    std::unique_ptr<Optimizer> paged = MakeOptimizer(twin_params, train);
    EXPECT_TRUE(paged->paged());
    EXPECT_EQ(paged->StateBytes(), resident->StateBytes());
    for (int step = 0; step < 3; ++step) {
      SetGrads(params, twins, step);
      resident->Step(1e-2);
      paged->Step(1e-2);
    }
    const bool exact = train.optimizer == OptimizerKind::kSgd;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(exact ? at::equal(params[i].tensor, twins[i])
                        : at::allclose(params[i].tensor, twins[i], /*rtol=*/1e-6, /*atol=*/1e-7))
          << params[i].name;
    }
  }
}

}  // namespace
}  // namespace lathe
