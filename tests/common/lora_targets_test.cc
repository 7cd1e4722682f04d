#include "common/lora_targets.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "common/model_config.h"
#include "common/peft.h"

namespace lathe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

const std::vector<std::string> kModules = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                           "gate_proj", "up_proj", "down_proj"};

// A target at the spec's default rank and alpha.
LoraTarget T(int64_t layer, std::string module) {
  const LoraSpec defaults;
  return {layer, std::move(module), defaults.rank, defaults.alpha};
}

LoraSpec ListOf(std::vector<std::string> targets) {
  LoraSpec lora;
  lora.targets = std::move(targets);
  return lora;
}

LoraSpec PatternOf(std::string pattern) {
  LoraSpec lora;
  lora.targets.clear();
  lora.targets_pattern = std::move(pattern);
  return lora;
}

std::vector<LoraTarget> MustMatch(const LoraSpec& lora, int64_t layers,
                                  const std::vector<std::string>& modules = kModules) {
  absl::StatusOr<std::vector<LoraTarget>> matched = MatchLoraTargets(lora, layers, modules);
  EXPECT_TRUE(matched.ok()) << matched.status();
  return matched.ok() ? *matched : std::vector<LoraTarget>{};
}

TEST(LoraTargetsTest, ListEntriesMatchANameOrASuffixOfTheFullName) {
  EXPECT_THAT(MustMatch(ListOf({"v_proj", "q_proj"}), 2),
              ElementsAre(T(0, "q_proj"), T(0, "v_proj"), T(1, "q_proj"), T(1, "v_proj")));
  EXPECT_THAT(MustMatch(ListOf({"mlp.up_proj", "model.layers.0.self_attn.o_proj"}), 2),
              ElementsAre(T(0, "o_proj"), T(0, "up_proj"), T(1, "up_proj")));
  // A suffix matches at a "." boundary only: layers.1 is not layers.11, p_proj not q_proj.
  EXPECT_THAT(MustMatch(ListOf({"layers.1.mlp.down_proj", "p_proj"}), 12),
              ElementsAre(T(1, "down_proj")));
}

TEST(LoraTargetsTest, AllLinearIsEveryProjection) {
  const std::vector<LoraTarget> matched = MustMatch(PatternOf("All-Linear"), 3);
  ASSERT_EQ(matched.size(), 21u);
  EXPECT_EQ(matched.front(), (T(0, "q_proj")));
  EXPECT_EQ(matched.back(), (T(2, "down_proj")));
  // Whatever the architecture's projections are.
  EXPECT_THAT(MustMatch(PatternOf("all-linear"), 1, {"qkv_proj", "o_proj"}),
              ElementsAre(T(0, "qkv_proj"), T(0, "o_proj")));
}

TEST(LoraTargetsTest, PatternMustMatchTheWholeName) {
  EXPECT_THAT(MustMatch(PatternOf(R"(.*\.layers\.(0|1)\.self_attn\.(q|v)_proj)"), 3),
              ElementsAre(T(0, "q_proj"), T(0, "v_proj"), T(1, "q_proj"), T(1, "v_proj")));
  // re.fullmatch: "q_proj" alone is not the full name of any module.
  absl::StatusOr<std::vector<LoraTarget>> none = MatchLoraTargets(PatternOf("q_proj"), 2, kModules);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.status().message(),
              HasSubstr("lora.targets: \"q_proj\" selects no module of the model (2 layers; full "
                        "names such as model.layers.0.self_attn.q_proj)"));
  EXPECT_THAT(MustMatch(PatternOf(".*mlp.*"), 1),
              ElementsAre(T(0, "gate_proj"), T(0, "up_proj"), T(0, "down_proj")));
}

TEST(LoraTargetsTest, RefusesWhatSelectsNothing) {
  absl::StatusOr<std::vector<LoraTarget>> none =
      MatchLoraTargets(ListOf({"layers.5.self_attn.q_proj"}), 2, kModules);
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.status().message(),
              HasSubstr("lora.targets: [layers.5.self_attn.q_proj] selects no module"));
  EXPECT_THAT(none.status().message(), Not(HasSubstr("\n")));
  absl::StatusOr<std::vector<LoraTarget>> bad = MatchLoraTargets(PatternOf("(q"), 2, kModules);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(),
              HasSubstr("lora.targets: \"(q\" is not a regular expression"));
}

TEST(LoraTargetsTest, ModulesOfTargetsIsTheUnionOverLayers) {
  EXPECT_THAT(
      ModulesOfTargets(MustMatch(PatternOf(R"(.*\.layers\.(0\.mlp\.up|1\.self_attn\.q)_proj)"), 2),
                       kModules),
      ElementsAre("q_proj", "up_proj"));
  EXPECT_EQ(ModulesOfTargets(MustMatch(PatternOf("all-linear"), 2), kModules), kModules);
}

// rank_pattern / alpha_pattern as PEFT's get_pattern_key: (.*\.)?(<key>) matches the whole
// full name; the first matching key applies.
TEST(LoraTargetsTest, RankAndAlphaPatterns) {
  LoraSpec lora = ListOf({"q_proj", "v_proj", "down_proj"});
  lora.rank = 8;
  lora.alpha = 16;
  lora.rank_pattern = {{"q_proj", 4}, {R"(layers\.1\.mlp\.down_proj)", 2}};
  lora.alpha_pattern = {{R"(model\.layers\.0\..*)", 3.5}};
  EXPECT_THAT(MustMatch(lora, 2),
              ElementsAre(LoraTarget{0, "q_proj", 4, 3.5}, LoraTarget{0, "v_proj", 8, 3.5},
                          LoraTarget{0, "down_proj", 8, 3.5}, LoraTarget{1, "q_proj", 4, 16},
                          LoraTarget{1, "v_proj", 8, 16}, LoraTarget{1, "down_proj", 2, 16}));
  // A key matches at a "." boundary, through to the end: "proj" is no module's name.
  lora.rank_pattern = {{"proj", 4}};
  absl::StatusOr<std::vector<LoraTarget>> none = MatchLoraTargets(lora, 2, kModules);
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.status().message(),
              HasSubstr("lora.rank_pattern: key \"proj\" matches no module that lora.targets "
                        "selects"));
  // Keys that agree may overlap; keys that disagree may not (PEFT's saved config sorts them).
  lora.rank_pattern = {{"q_proj", 4}, {R"(.*\.q_proj)", 4}};
  EXPECT_TRUE(MatchLoraTargets(lora, 2, kModules).ok());
  lora.rank_pattern = {{"q_proj", 4}, {R"(.*\.q_proj)", 6}};
  none = MatchLoraTargets(lora, 2, kModules);
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.status().message(),
              HasSubstr("lora.rank_pattern: keys \"q_proj\" and \".*\\\\.q_proj\" both match "
                        "model.layers.0.self_attn.q_proj with different values"));
  lora.rank_pattern = {{"(q", 4}};
  EXPECT_THAT(CheckLoraPatternKeys(lora).message(),
              HasSubstr("lora.rank_pattern: key \"(q\" is not a regular expression"));
}

TEST(LoraTargetsTest, Scale) {
  EXPECT_DOUBLE_EQ((LoraTarget{0, "q_proj", 4, 6}.Scale(false)), 1.5);
  EXPECT_DOUBLE_EQ((LoraTarget{0, "q_proj", 4, 6}.Scale(true)), 3.0);
}

TEST(LoraTargetsTest, PatternCheck) {
  EXPECT_TRUE(CheckLoraTargetsPattern("all-linear").ok());
  EXPECT_TRUE(CheckLoraTargetsPattern(R"(.*\.(q|v)_proj)").ok());
  EXPECT_TRUE(CheckLoraTargetsPattern(R"(.*\.layers\.\d{1,2}\.mlp\..*)").ok());
  EXPECT_EQ(CheckLoraTargetsPattern("[q").code(), absl::StatusCode::kInvalidArgument);
  // The cost of a pattern is bounded: it runs in the coordinator.
  EXPECT_THAT(CheckLoraTargetsPattern(std::string(513, 'a')).message(),
              HasSubstr("a pattern of 513 bytes is longer than 512"));
  EXPECT_THAT(CheckLoraTargetsPattern("((a{100}){100}){2}").message(),
              HasSubstr("its counted repetitions ({n}) multiply to more than 10000"));
  EXPECT_TRUE(CheckLoraTargetsPattern(R"(\{a{100}\})").ok());  // escaped braces count not
  EXPECT_EQ(CheckLoraTargetsPattern(R"((q)\1)").code(), absl::StatusCode::kInvalidArgument);
  // A pattern that backtracks exponentially matches in polynomial time.
  LoraSpec slow = PatternOf("(.*)*(.*)*(.*)*(.*)*(.*)*z");
  EXPECT_FALSE(MatchLoraTargets(slow, 4, kModules).ok());
}

// What adapter_config.json's target_modules holds, as PEFT saves it.
TEST(LoraTargetsTest, PeftTargetModules) {
  PeftAdapterConfig config;
  const LoraSpec list = ListOf({"q_proj", "v_proj"});
  SetPeftTargetModules(list, MustMatch(list, 2), &config);
  EXPECT_THAT(config.target_modules, ElementsAre("q_proj", "v_proj"));
  EXPECT_EQ(config.target_modules_pattern, "");

  const LoraSpec regex = PatternOf(R"(.*\.layers\.1\.mlp\.up_proj)");
  SetPeftTargetModules(regex, MustMatch(regex, 2), &config);
  EXPECT_TRUE(config.target_modules.empty());
  EXPECT_EQ(config.target_modules_pattern, regex.targets_pattern);

  // PEFT replaces "all-linear" by the full names it selected.
  const LoraSpec all = PatternOf("all-linear");
  SetPeftTargetModules(all, MustMatch(all, 1, {"q_proj", "down_proj"}), &config);
  EXPECT_THAT(config.target_modules,
              ElementsAre("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"));
  EXPECT_EQ(config.target_modules_pattern, "");

  LoraSpec back;
  SetSpecTargets(config, &back);
  EXPECT_THAT(MustMatch(back, 2), ElementsAre(T(0, "q_proj"), T(0, "down_proj")));
}

// Against a model's own projections (ProjectionModules): Phi-3's fused ones take every target
// form and pattern, no targets at all (the spec's default) is every projection of the model,
// and a projection of another architecture is refused by name.
TEST(LoraTargetsTest, MatchesTheModelsOwnProjections) {
  ModelConfig phi3;
  phi3.model_type = "phi3";
  phi3.num_hidden_layers = 2;
  const LoraSpec defaults;
  ASSERT_TRUE(defaults.targets.empty() && defaults.targets_pattern.empty());
  absl::StatusOr<std::vector<LoraTarget>> every = MatchLoraTargets(defaults, phi3);
  ASSERT_TRUE(every.ok()) << every.status();
  EXPECT_THAT(*every, ElementsAre(T(0, "qkv_proj"), T(0, "o_proj"), T(0, "gate_up_proj"),
                                  T(0, "down_proj"), T(1, "qkv_proj"), T(1, "o_proj"),
                                  T(1, "gate_up_proj"), T(1, "down_proj")));
  PeftAdapterConfig config;
  SetPeftTargetModules(defaults, *every, &config);
  EXPECT_THAT(config.target_modules,
              ElementsAre("qkv_proj", "o_proj", "gate_up_proj", "down_proj"));

  LoraSpec regex = PatternOf(R"(.*\.layers\.1\.(self_attn\.qkv|mlp\.gate_up)_proj)");
  regex.rank_pattern = {{"qkv_proj", 4}};
  absl::StatusOr<std::vector<LoraTarget>> matched = MatchLoraTargets(regex, phi3);
  ASSERT_TRUE(matched.ok()) << matched.status();
  EXPECT_THAT(*matched,
              ElementsAre(LoraTarget{1, "qkv_proj", 4, defaults.alpha}, T(1, "gate_up_proj")));
  absl::StatusOr<std::vector<LoraTarget>> all = MatchLoraTargets(PatternOf("all-linear"), phi3);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(*all, *every);

  EXPECT_EQ(MatchLoraTargets(ListOf({"qkv_proj", "self_attn.q_proj"}), phi3).status().message(),
            "lora.targets: \"q_proj\" is not a projection of this phi3 model (its modules: "
            "qkv_proj, o_proj, gate_up_proj, down_proj)");
  ModelConfig llama = phi3;
  llama.model_type = "llama";
  EXPECT_THAT(MatchLoraTargets(ListOf({"gate_up_proj"}), llama).status().message(),
              HasSubstr("\"gate_up_proj\" is not a projection of this llama model"));
  EXPECT_EQ(MatchLoraTargets(defaults, llama)->size(), 14u);
}

}  // namespace
}  // namespace lathe
