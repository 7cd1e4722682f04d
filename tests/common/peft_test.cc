#include "common/peft.h"

#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace lathe {
namespace {

using ::testing::ElementsAre;
using ::testing::UnorderedElementsAre;

using testing::StatusIs;

PeftAdapterConfig SampleConfig() {
  PeftAdapterConfig config;
  config.base_model_name_or_path = "meta-llama/Llama-3.2-1B";
  config.r = 16;
  config.lora_alpha = 32;
  config.lora_dropout = 0.05;
  config.use_rslora = true;
  config.target_modules = {"q_proj", "v_proj", "down_proj"};
  return config;
}

void ExpectSameConfig(const PeftAdapterConfig& actual, const PeftAdapterConfig& expected) {
  EXPECT_EQ(actual.base_model_name_or_path, expected.base_model_name_or_path);
  EXPECT_EQ(actual.r, expected.r);
  EXPECT_DOUBLE_EQ(actual.lora_alpha, expected.lora_alpha);
  EXPECT_DOUBLE_EQ(actual.lora_dropout, expected.lora_dropout);
  EXPECT_EQ(actual.use_rslora, expected.use_rslora);
  EXPECT_EQ(actual.target_modules, expected.target_modules);
}

TEST(PeftTest, TensorNames) {
  EXPECT_EQ(PeftLoraTensorName(3, "q_proj", "A"),
            "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(PeftLoraTensorName(0, "o_proj", "B"),
            "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight");
  EXPECT_EQ(PeftLoraTensorName(15, "k_proj", "A"),
            "base_model.model.model.layers.15.self_attn.k_proj.lora_A.weight");
  EXPECT_EQ(PeftLoraTensorName(1, "v_proj", "B"),
            "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight");
  EXPECT_EQ(PeftLoraTensorName(27, "gate_proj", "A"),
            "base_model.model.model.layers.27.mlp.gate_proj.lora_A.weight");
  EXPECT_EQ(PeftLoraTensorName(2, "up_proj", "B"),
            "base_model.model.model.layers.2.mlp.up_proj.lora_B.weight");
  EXPECT_EQ(PeftLoraTensorName(2, "down_proj", "A"),
            "base_model.model.model.layers.2.mlp.down_proj.lora_A.weight");
}

TEST(PeftTest, ConfigJsonHasPeftFields) {
  nlohmann::json json = nlohmann::json::parse(PeftAdapterConfigJson(SampleConfig()));
  EXPECT_EQ(json["peft_type"], "LORA");
  EXPECT_EQ(json["task_type"], "CAUSAL_LM");
  EXPECT_EQ(json["r"], 16);
  EXPECT_TRUE(json["r"].is_number_integer());
  EXPECT_EQ(json["lora_alpha"], 32);
  EXPECT_TRUE(json["lora_alpha"].is_number_integer());
  EXPECT_DOUBLE_EQ(json["lora_dropout"].get<double>(), 0.05);
  EXPECT_EQ(json["target_modules"], nlohmann::json({"q_proj", "v_proj", "down_proj"}));
  EXPECT_EQ(json["use_rslora"], true);
  EXPECT_EQ(json["bias"], "none");
  EXPECT_EQ(json["fan_in_fan_out"], false);
  EXPECT_EQ(json["inference_mode"], true);
  EXPECT_EQ(json["base_model_name_or_path"], "meta-llama/Llama-3.2-1B");
  EXPECT_TRUE(json["modules_to_save"].is_null());
  EXPECT_EQ(json["init_lora_weights"], true);
  EXPECT_TRUE(json["layers_to_transform"].is_null());
  EXPECT_TRUE(json["layers_pattern"].is_null());
  EXPECT_EQ(json["rank_pattern"], nlohmann::json::object());
  EXPECT_EQ(json["alpha_pattern"], nlohmann::json::object());
  EXPECT_TRUE(json["revision"].is_null());
  EXPECT_EQ(json["use_dora"], false);
  EXPECT_EQ(json.size(), 19u);
}

TEST(PeftTest, FractionalAlphaStaysFractional) {
  PeftAdapterConfig config = SampleConfig();
  config.lora_alpha = 12.5;
  nlohmann::json json = nlohmann::json::parse(PeftAdapterConfigJson(config));
  EXPECT_DOUBLE_EQ(json["lora_alpha"].get<double>(), 12.5);
}

TEST(PeftTest, PatternTargetModulesAreAString) {
  PeftAdapterConfig config = SampleConfig();
  config.target_modules.clear();
  config.target_modules_pattern = R"(.*\.layers\.(0|1)\.self_attn\.(q|v)_proj)";
  const std::string text = PeftAdapterConfigJson(config);
  EXPECT_EQ(nlohmann::json::parse(text)["target_modules"], config.target_modules_pattern);
  absl::StatusOr<PeftAdapterConfig> parsed = ParsePeftAdapterConfig(text, "adapter_config.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->target_modules_pattern, config.target_modules_pattern);
  EXPECT_TRUE(parsed->target_modules.empty());
}

// rank_pattern, alpha_pattern and modules_to_save as PEFT writes them.
TEST(PeftTest, PatternsAndModulesToSave) {
  PeftAdapterConfig config = SampleConfig();
  config.rank_pattern = {{"q_proj", 4}, {R"(layers\.1\..*)", 2}};
  config.alpha_pattern = {{"down_proj", 3.5}, {"v_proj", 8}};
  config.modules_to_save = {"lm_head"};
  const std::string text = PeftAdapterConfigJson(config);
  const nlohmann::json json = nlohmann::json::parse(text);
  EXPECT_EQ(json["rank_pattern"], nlohmann::json({{"q_proj", 4}, {R"(layers\.1\..*)", 2}}));
  EXPECT_EQ(json["alpha_pattern"], nlohmann::json({{"down_proj", 3.5}, {"v_proj", 8}}));
  EXPECT_TRUE(json["alpha_pattern"]["v_proj"].is_number_integer());
  EXPECT_EQ(json["modules_to_save"], nlohmann::json({"lm_head"}));
  absl::StatusOr<PeftAdapterConfig> parsed = ParsePeftAdapterConfig(text, "adapter_config.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  // Back in the file's (sorted) order.
  using Rank = std::pair<std::string, int64_t>;
  EXPECT_THAT(parsed->rank_pattern, ElementsAre(Rank{R"(layers\.1\..*)", 2}, Rank{"q_proj", 4}));
  EXPECT_EQ(parsed->alpha_pattern.size(), 2u);
  EXPECT_THAT(parsed->modules_to_save, ElementsAre("lm_head"));
  EXPECT_THAT(
      ParsePeftAdapterConfig(
          R"({"peft_type": "LORA", "target_modules": ["q_proj"], "rank_pattern": {"q": 0}})",
          "x.json"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               "x.json: rank_pattern \"q\" is 0, not a positive integer"));
}

TEST(PeftTest, ConfigRoundTrips) {
  PeftAdapterConfig config = SampleConfig();
  absl::StatusOr<PeftAdapterConfig> parsed =
      ParsePeftAdapterConfig(PeftAdapterConfigJson(config), "adapter_config.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ExpectSameConfig(*parsed, config);
}

TEST(PeftTest, ParsesConfigWrittenByPeft) {
  // As PEFT 0.13 writes it, with keys Lathe does not know.
  constexpr const char* kText = R"({
    "alpha_pattern": {}, "auto_mapping": null, "base_model_name_or_path": null,
    "bias": "none", "fan_in_fan_out": false, "inference_mode": true,
    "init_lora_weights": true, "layer_replication": null, "layers_pattern": null,
    "layers_to_transform": null, "loftq_config": {}, "lora_alpha": 16, "lora_dropout": 0.1,
    "megatron_config": null, "megatron_core": "megatron.core", "modules_to_save": null,
    "peft_type": "LORA", "r": 8, "rank_pattern": {}, "revision": null,
    "target_modules": ["v_proj", "q_proj"], "task_type": "CAUSAL_LM", "use_dora": false,
    "use_rslora": false})";
  absl::StatusOr<PeftAdapterConfig> parsed = ParsePeftAdapterConfig(kText, "peft.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->base_model_name_or_path, "");
  EXPECT_EQ(parsed->r, 8);
  EXPECT_DOUBLE_EQ(parsed->lora_alpha, 16);
  EXPECT_DOUBLE_EQ(parsed->lora_dropout, 0.1);
  EXPECT_FALSE(parsed->use_rslora);
  EXPECT_THAT(parsed->target_modules, ElementsAre("v_proj", "q_proj"));
}

// PEFT's str target_modules is a regular expression over full module names: kept as such.
TEST(PeftTest, ParseAcceptsStringTargetModulesAndDefaults) {
  absl::StatusOr<PeftAdapterConfig> parsed =
      ParsePeftAdapterConfig(R"({"peft_type": "LORA", "target_modules": ".*\\.(q|v)_proj"})", "x");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->target_modules.empty());
  EXPECT_EQ(parsed->target_modules_pattern, R"(.*\.(q|v)_proj)");
  EXPECT_EQ(parsed->r, 8);
  EXPECT_DOUBLE_EQ(parsed->lora_alpha, 8);
  EXPECT_DOUBLE_EQ(parsed->lora_dropout, 0);
  EXPECT_FALSE(parsed->use_rslora);
}

TEST(PeftTest, ParseErrorsNameSourceAndField) {
  struct Case {
    std::string text;
    std::string fragment;
  };
  const std::string modules = R"("target_modules": ["q_proj"])";
  std::vector<Case> cases = {
      {"{", "not JSON"},
      {"[]", "not a JSON object"},
      {R"({"r": 8, )" + modules + "}", "peft_type is missing, expected \"LORA\""},
      {R"({"peft_type": "PREFIX_TUNING", "r": 8, )" + modules + "}",
       "peft_type is \"PREFIX_TUNING\", expected \"LORA\""},
      {R"({"peft_type": "LORA", "r": 0, )" + modules + "}", "r is 0, must be positive"},
      {R"({"peft_type": "LORA", "r": -4, )" + modules + "}", "r is -4, must be positive"},
      {R"({"peft_type": "LORA", "r": "8", )" + modules + "}", "r is \"8\", not an integer"},
      {R"({"peft_type": "LORA", "r": 8.5, )" + modules + "}", "r is 8.5, not an integer"},
      {R"({"peft_type": "LORA", "lora_alpha": "16", )" + modules + "}", "lora_alpha"},
      {R"({"peft_type": "LORA", "lora_dropout": 1.5, )" + modules + "}",
       "lora_dropout is 1.5, must be in [0, 1)"},
      {R"({"peft_type": "LORA", "use_rslora": 1, )" + modules + "}", "use_rslora"},
      {R"({"peft_type": "LORA", "base_model_name_or_path": 3, )" + modules + "}",
       "base_model_name_or_path"},
      {R"({"peft_type": "LORA", "r": 8})", "target_modules is missing"},
      {R"({"peft_type": "LORA", "target_modules": null})", "target_modules is missing"},
      {R"({"peft_type": "LORA", "target_modules": []})", "target_modules is empty"},
      {R"({"peft_type": "LORA", "target_modules": ""})", "target_modules is empty"},
      {R"({"peft_type": "LORA", "target_modules": ["q_proj", 3]})",
       "target_modules entry 3 is not a non-empty string"},
      {R"({"peft_type": "LORA", "target_modules": {"q": 1}})",
       "target_modules is neither a list nor a string"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    absl::StatusOr<PeftAdapterConfig> parsed = ParsePeftAdapterConfig(c.text, "dir/cfg.json");
    EXPECT_THAT(parsed, StatusIs(absl::StatusCode::kInvalidArgument, "dir/cfg.json: "));
    EXPECT_THAT(parsed, StatusIs(absl::StatusCode::kInvalidArgument, c.fragment));
  }
}

// PEFT 0.21's adapter_config.json, every option at its default: nothing to refuse.
TEST(PeftTest, AcceptsEveryUnsupportedOptionLeftOff) {
  constexpr char kText[] = R"({"alora_invocation_tokens": null, "alpha_pattern": {},
    "arrow_config": null, "bias": "none", "corda_config": null, "ensure_weight_tying": false,
    "eva_config": null, "exclude_modules": null, "fan_in_fan_out": false,
    "inference_mode": true, "init_lora_weights": true, "kasa_config": null,
    "layer_replication": null, "layers_pattern": null, "layers_to_transform": null,
    "loftq_config": {}, "lora_alpha": 4, "lora_bias": false, "lora_dropout": 0.0,
    "lora_ga_config": null, "megatron_config": null, "megatron_core": "megatron.core",
    "modules_to_save": null, "monteclora_config": null, "peft_type": "LORA",
    "peft_version": "0.21.2", "qalora_group_size": 16, "r": 2, "rank_pattern": {},
    "target_modules": ["model.layers.0.mlp.down_proj"], "target_parameters": null,
    "task_type": "CAUSAL_LM", "trainable_token_indices": null, "use_bdlora": null,
    "use_dora": false, "use_qalora": false, "use_rslora": false, "velora_config": null})";
  absl::StatusOr<PeftAdapterConfig> parsed = ParsePeftAdapterConfig(kText, "peft.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_THAT(parsed->target_modules, ElementsAre("model.layers.0.mlp.down_proj"));
  // How A and B started does not matter in a saved adapter, unless the base was changed too.
  for (const char* init : {"false", "\"gaussian\""}) {
    std::string text = kText;
    text.replace(text.find("\"init_lora_weights\": true"), 25,
                 absl::StrCat("\"init_lora_weights\": ", init));
    EXPECT_TRUE(ParsePeftAdapterConfig(text, "peft.json").ok()) << init;
  }
}

// An adapter that uses an option Lathe lacks is refused, naming the file and the key.
TEST(PeftTest, RefusesUnsupportedOptions) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"("use_dora": true)", "use_dora is true: not supported by Lathe"},
      {R"("fan_in_fan_out": true)", "fan_in_fan_out is true: not supported"},
      {R"("init_lora_weights": "pissa")", "init_lora_weights is \"pissa\": not supported"},
      {R"("bias": "all")", "bias is \"all\": not supported"},
      {R"("layers_to_transform": [0, 1])", "layers_to_transform is [0,1]: not supported"},
      {R"("layers_pattern": "layers")", "layers_pattern is \"layers\": not supported"},
      {R"("lora_bias": true)", "lora_bias is true: not supported"},
      {R"("megatron_config": {"a": 1})", "megatron_config is {\"a\":1}: not supported"},
      {R"("loftq_config": {"loftq_bits": 4})", "loftq_config is "},
      {R"("layer_replication": [[0, 2]])", "layer_replication is [[0,2]]: not supported"},
  };
  for (const auto& [field, fragment] : cases) {
    const std::string text =
        absl::StrCat(R"({"peft_type": "LORA", "target_modules": ["q_proj"], )", field, "}");
    SCOPED_TRACE(text);
    EXPECT_THAT(ParsePeftAdapterConfig(text, "a/adapter_config.json"),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         absl::StrCat("a/adapter_config.json: ", fragment)));
  }
}

class PeftAdapterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "lathe_peft_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  std::string root_;
};

TEST_F(PeftAdapterTest, WritesLoadableAdapter) {
  const std::string dir = root_ + "/run/adapter";  // Created, parents included.
  PeftAdapterConfig config = SampleConfig();
  std::vector<uint16_t> a(16 * 8, 1), b(4 * 16, 2);
  std::vector<TensorToWrite> tensors = {
      {PeftLoraTensorName(0, "q_proj", "A"), DType::kBF16, {16, 8}, a.data(), a.size() * 2},
      {PeftLoraTensorName(0, "q_proj", "B"), DType::kBF16, {4, 16}, b.data(), b.size() * 2},
  };
  ASSERT_TRUE(WritePeftAdapter(dir, config, tensors).ok());

  auto file = SafetensorsFile::Open(dir + "/adapter_model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  const TensorView* lora_b = (*file)->Find(PeftLoraTensorName(0, "q_proj", "B"));
  ASSERT_NE(lora_b, nullptr);
  EXPECT_THAT(lora_b->shape, ElementsAre(4, 16));
  EXPECT_EQ(std::memcmp(lora_b->data, b.data(), lora_b->nbytes), 0);

  absl::StatusOr<std::string> text = ReadFile(dir + "/adapter_config.json");
  ASSERT_TRUE(text.ok()) << text.status();
  absl::StatusOr<PeftAdapterConfig> parsed = ParsePeftAdapterConfig(*text, "adapter_config.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ExpectSameConfig(*parsed, config);

  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  EXPECT_THAT(names, UnorderedElementsAre("adapter_model.safetensors", "adapter_config.json"));

  // Overwriting an existing adapter works too.
  ASSERT_TRUE(WritePeftAdapter(dir, config, {}).ok());
  file = SafetensorsFile::Open(dir + "/adapter_model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE((*file)->tensors().empty());
}

TEST_F(PeftAdapterTest, BadTensorsWriteNoConfig) {
  const std::string dir = root_ + "/adapter";
  uint16_t value = 0;
  TensorToWrite tensor{PeftLoraTensorName(0, "q_proj", "A"), DType::kBF16, {2}, &value, 2};
  EXPECT_THAT(WritePeftAdapter(dir, SampleConfig(), {&tensor, 1}),
              StatusIs(absl::StatusCode::kInvalidArgument, "2 bytes given but BF16 [2] needs 4"));
  EXPECT_TRUE(std::filesystem::is_empty(dir));
}

TEST_F(PeftAdapterTest, InvalidConfigWritesNothing) {
  const std::string dir = root_ + "/adapter";
  PeftAdapterConfig config = SampleConfig();
  config.r = 0;
  EXPECT_THAT(WritePeftAdapter(dir, config, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, "r is 0, must be positive"));
  config = SampleConfig();
  config.target_modules.clear();
  EXPECT_THAT(WritePeftAdapter(dir, config, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, "no target_modules"));
  EXPECT_FALSE(std::filesystem::exists(dir));
}

TEST_F(PeftAdapterTest, DirectoryThatIsAFileIsInternal) {
  const std::string dir = root_ + "/file";
  ASSERT_TRUE(WriteFileAtomically(dir, "x").ok());
  EXPECT_THAT(WritePeftAdapter(dir + "/adapter", SampleConfig(), {}),
              StatusIs(absl::StatusCode::kInternal, dir + "/adapter: create directory"));
}

}  // namespace
}  // namespace lathe
