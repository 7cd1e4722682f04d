// CheckModelWeights: what admission checks of a model's weights at submit (issue #32).
#include "common/weights_check.h"

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/model_config.h"
#include "common/peft.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/tiny_model.h"

namespace lathe {
namespace {

using testing::StatusIs;
using testing::TempDir;

// Zeros for every weight of `config` but `skip`, F32, in one file per entry of `files`
// (the weights dealt round-robin); more than one file gets an index.
void WriteWeights(const std::string& dir, const ModelConfig& config, int files = 1,
                  const std::string& skip = "") {
  std::filesystem::create_directories(dir);
  std::vector<std::vector<float>> data;
  std::vector<std::vector<TensorToWrite>> shards(files);
  nlohmann::json index = {{"metadata", nlohmann::json::object()},
                          {"weight_map", nlohmann::json::object()}};
  const std::vector<WeightSpec> weights = ExpectedWeights(config);
  data.reserve(weights.size());
  int i = 0;
  for (const WeightSpec& w : weights) {
    if (w.name == skip) continue;
    int64_t n = 1;
    for (int64_t d : w.shape) n *= d;
    data.emplace_back(static_cast<size_t>(n), 0.0f);
    const int shard = i++ % files;
    shards[shard].push_back(
        {w.name, DType::kF32, w.shape, data.back().data(), data.back().size() * sizeof(float)});
    index["weight_map"][w.name] = absl::StrCat("model-", shard, ".safetensors");
  }
  if (files == 1) {
    ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", shards[0]).ok());
    return;
  }
  for (int s = 0; s < files; ++s) {
    ASSERT_TRUE(WriteSafetensors(absl::StrCat(dir, "/model-", s, ".safetensors"), shards[s]).ok());
  }
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump();
}

// A safetensors file of raw bytes: the header `json` and `data_bytes` zero bytes after it.
void WriteRaw(const std::string& path, const std::string& json, size_t data_bytes) {
  std::string bytes(8, '\0');
  const uint64_t n = json.size();
  std::memcpy(bytes.data(), &n, 8);  // little-endian hosts only, as the format
  bytes += json;
  bytes.append(data_bytes, '\0');
  std::ofstream(path, std::ios::binary) << bytes;
}

class WeightsCheckTest : public ::testing::Test {
 protected:
  ModelConfig config_ = testing::TinyModelConfig();
  TempDir dir_;
};

TEST_F(WeightsCheckTest, CompleteWeightsPassInOneFileOrShards) {
  WriteWeights(dir_.Path("one"), config_);
  EXPECT_TRUE(CheckModelWeights(dir_.Path("one"), config_).ok());
  WriteWeights(dir_.Path("sharded"), config_, 3);
  EXPECT_TRUE(CheckModelWeights(dir_.Path("sharded"), config_).ok());
}

TEST_F(WeightsCheckTest, ADirectoryWithoutWeightsIsRefused) {
  std::filesystem::create_directories(dir_.Path("empty"));
  EXPECT_THAT(CheckModelWeights(dir_.Path("empty"), config_),
              StatusIs(absl::StatusCode::kNotFound,
                       std::string("neither model.safetensors nor model.safetensors.index.json")));
}

TEST_F(WeightsCheckTest, AMissingShardIsRefused) {
  WriteWeights(dir_.Path("m"), config_, 2);
  std::filesystem::remove(dir_.Path("m/model-1.safetensors"));
  EXPECT_THAT(CheckModelWeights(dir_.Path("m"), config_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       std::string("weight_map names shard \"model-1.safetensors\"")));
}

TEST_F(WeightsCheckTest, AMissingTensorIsRefusedWithTheShapeConfigImplies) {
  WriteWeights(dir_.Path("m"), config_, 1, "model.layers.1.mlp.up_proj.weight");
  EXPECT_THAT(CheckModelWeights(dir_.Path("m"), config_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       std::string(": tensor \"model.layers.1.mlp.up_proj.weight\" is missing "
                                   "(config.json implies shape [48, 32])")));
}

TEST_F(WeightsCheckTest, AShapeOtherThanConfigsIsRefused) {
  ModelConfig wider = config_;
  wider.intermediate_size = 64;
  WriteWeights(dir_.Path("m"), wider);
  EXPECT_THAT(CheckModelWeights(dir_.Path("m"), config_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       std::string("shape [64, 32] in the file vs [48, 32] from config.json")));
}

TEST_F(WeightsCheckTest, MalformedHeadersAreRefusedWithoutReadingTheData) {
  std::filesystem::create_directories(dir_.Path("m"));
  const std::string file = dir_.Path("m/model.safetensors");
  // Shorter than the 8-byte length.
  std::ofstream(file, std::ios::binary) << "abc";
  EXPECT_THAT(CheckModelWeights(dir_.Path("m"), config_),
              StatusIs(absl::StatusCode::kDataLoss, ""));
  // A header length past the end of the file.
  WriteRaw(file, "{}", 0);
  std::filesystem::resize_file(file, 9);
  EXPECT_THAT(CheckModelWeights(dir_.Path("m"), config_),
              StatusIs(absl::StatusCode::kDataLoss, ""));
  // Not JSON.
  WriteRaw(file, "{\"a\": ", 0);
  EXPECT_THAT(CheckModelWeights(dir_.Path("m"), config_),
              StatusIs(absl::StatusCode::kInvalidArgument, ""));
  // Offsets past the end of the file.
  WriteRaw(file, R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8);
  EXPECT_THAT(CheckModelWeights(dir_.Path("m"), config_),
              StatusIs(absl::StatusCode::kDataLoss, std::string("\"a\"")));
  // Overlapping ranges.
  WriteRaw(file,
           R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},)"
           R"( "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
           24);
  EXPECT_THAT(CheckModelWeights(dir_.Path("m"), config_),
              StatusIs(absl::StatusCode::kInvalidArgument, ""));
  // A byte count that does not match dtype x shape.
  WriteRaw(file, R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}})", 16);
  EXPECT_THAT(CheckModelWeights(dir_.Path("m"), config_),
              StatusIs(absl::StatusCode::kInvalidArgument, std::string("\"a\"")));
  // A valid file of other tensors: the model's are missing.
  WriteRaw(file, R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 16);
  EXPECT_THAT(CheckModelWeights(dir_.Path("m"), config_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       std::string("tensor \"model.embed_tokens.weight\" is missing")));
}

// An adapter of rank `rank` for `targets` on every layer of `config`, zeros; `skip` left out.
void WriteAdapter(const std::string& dir, const ModelConfig& config, int64_t rank,
                  const std::vector<std::string>& targets, const std::string& skip = "") {
  std::vector<std::vector<float>> data;
  data.reserve(static_cast<size_t>(config.num_hidden_layers) * targets.size() * 2);
  std::vector<TensorToWrite> tensors;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    for (const std::string& module : targets) {
      const ProjectionShape shape = ProjectionShapeOf(config, module);
      for (const auto& [which, dims] :
           {std::pair{"A", std::vector<int64_t>{rank, shape.in_features}},
            std::pair{"B", std::vector<int64_t>{shape.out_features, rank}}}) {
        const std::string name = PeftLoraTensorName(l, module, which);
        if (name == skip) continue;
        data.emplace_back(static_cast<size_t>(dims[0] * dims[1]), 0.0f);
        tensors.push_back(
            {name, DType::kF32, dims, data.back().data(), data.back().size() * sizeof(float)});
      }
    }
  }
  PeftAdapterConfig adapter;
  adapter.r = rank;
  adapter.lora_alpha = 2.0 * static_cast<double>(rank);
  adapter.target_modules = targets;
  ASSERT_TRUE(WritePeftAdapter(dir, adapter, tensors).ok());
}

TEST_F(WeightsCheckTest, AnInitAdapterNeedsTheRankAndEveryTensor) {
  LoraSpec lora;
  lora.rank = 4;
  lora.targets = {"q_proj", "v_proj"};
  WriteAdapter(dir_.Path("a"), config_, 4, lora.targets);
  EXPECT_TRUE(CheckLoraInitFrom(dir_.Path("a"), config_, lora).ok());
  lora.rank = 8;
  EXPECT_THAT(CheckLoraInitFrom(dir_.Path("a"), config_, lora),
              StatusIs(absl::StatusCode::kInvalidArgument, "r is 4 but lora.rank is 8"));
  lora.rank = 4;
  const std::string missing = PeftLoraTensorName(1, "v_proj", "B");
  WriteAdapter(dir_.Path("b"), config_, 4, lora.targets, missing);
  EXPECT_THAT(CheckLoraInitFrom(dir_.Path("b"), config_, lora),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       absl::StrCat("tensor \"", missing, "\" is missing")));
  EXPECT_THAT(CheckLoraInitFrom(dir_.Path("none"), config_, lora),
              StatusIs(absl::StatusCode::kNotFound, ""));
}

// The targets' own form, a rank_pattern's shapes, and PEFT options Lathe lacks.
TEST_F(WeightsCheckTest, AnInitAdapterWithPatternsOrUnsupportedOptions) {
  LoraSpec lora;
  lora.rank = 4;
  lora.targets = {"q_proj", "v_proj"};
  WriteAdapter(dir_.Path("a"), config_, 4, lora.targets);
  // A regular expression selecting the same modules.
  lora.targets.clear();
  lora.targets_pattern = R"(.*\.(q|v)_proj)";
  EXPECT_TRUE(CheckLoraInitFrom(dir_.Path("a"), config_, lora).ok());
  // A rank_pattern makes v_proj's tensors rank 2: the adapter's are 4.
  lora.rank_pattern = {{"v_proj", 2}};
  EXPECT_THAT(
      CheckLoraInitFrom(dir_.Path("a"), config_, lora),
      StatusIs(absl::StatusCode::kInvalidArgument,
               absl::StrCat("tensor \"", PeftLoraTensorName(0, "v_proj", "A"), "\": shape [4, ")));
  lora.rank_pattern.clear();
  lora.targets_pattern = "nothing";
  EXPECT_THAT(CheckLoraInitFrom(dir_.Path("a"), config_, lora),
              StatusIs(absl::StatusCode::kInvalidArgument, "lora.targets: \"nothing\" selects"));
  // An adapter that uses DoRA, saves a module Lathe cannot, or saves other modules than the
  // spec's lora.modules_to_save is refused naming the file and the key.
  lora.targets_pattern.clear();
  lora.targets = {"q_proj", "v_proj"};
  const std::string config_path = dir_.Path("a") + "/adapter_config.json";
  absl::StatusOr<std::string> text = ReadFile(config_path);
  ASSERT_TRUE(text.ok());
  for (const auto& [key, value, message] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"\"use_dora\": false", "\"use_dora\": true", ": use_dora is true: not supported"},
           {"\"modules_to_save\": null", "\"modules_to_save\": [\"lm_head\"]",
            ": modules_to_save is [lm_head] but lora.modules_to_save is []"},
           {"\"modules_to_save\": null", "\"modules_to_save\": [\"score\"]",
            ": modules_to_save: \"score\" is not a module Lathe trains whole"}}) {
    std::string edited = *text;
    ASSERT_NE(edited.find(key), std::string::npos) << key;
    edited.replace(edited.find(key), key.size(), value);
    ASSERT_TRUE(WriteFileAtomically(config_path, edited).ok());
    EXPECT_THAT(CheckLoraInitFrom(dir_.Path("a"), config_, lora),
                StatusIs(absl::StatusCode::kInvalidArgument, config_path + message));
  }
  // Both name lm_head, but the adapter's file lacks the copy's tensor.
  std::string edited = *text;
  const std::string key = "\"modules_to_save\": null";
  edited.replace(edited.find(key), key.size(), "\"modules_to_save\": [\"lm_head\"]");
  ASSERT_TRUE(WriteFileAtomically(config_path, edited).ok());
  lora.modules_to_save = {"lm_head"};
  EXPECT_THAT(CheckLoraInitFrom(dir_.Path("a"), config_, lora),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "adapter_model.safetensors: tensor \"base_model.model.lm_head.weight\" is "
                       "missing"));
}

}  // namespace
}  // namespace lathe
