#include "worker/tools/synthetic.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/float16.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/engine/pre_tokenizer.h"

namespace lathe {
namespace {

// Float values converted to the bytes of `dtype` (F32, BF16 or F16).
std::vector<std::byte> Encode(const std::vector<float>& values, DType dtype) {
  std::vector<std::byte> bytes(values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &values[i], 4);
    } else {
      uint16_t half = dtype == DType::kBF16 ? FloatToBFloat16(values[i]) : FloatToHalf(values[i]);
      std::memcpy(bytes.data() + 2 * i, &half, 2);
    }
  }
  return bytes;
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

absl::Status WriteSyntheticModel(const ModelConfig& config, DType dtype, int64_t shards,
                                 uint64_t seed, const std::string& dir) {
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    return absl::InvalidArgumentError("dtype: expected F32, BF16 or F16");
  }
  std::string config_json = ModelConfigToJson(config);
  LATHE_RETURN_IF_ERROR(ParseModelConfig(config_json, "generated config.json").status());
  std::vector<WeightSpec> weights = ExpectedWeights(config);
  if (shards < 1 || shards > static_cast<int64_t>(weights.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("shards: expected 1..", weights.size(), ", got ", shards));
  }
  std::mt19937_64 rng(seed);
  std::vector<std::vector<std::byte>> buffers;
  std::vector<TensorToWrite> tensors;
  buffers.reserve(weights.size());
  for (const WeightSpec& w : weights) {
    std::vector<float> values(static_cast<size_t>(Numel(w.shape)));
    // Matrices scaled by 1/sqrt(fan_in) keep activations and logits of order one, so even a
    // tiny model has something to learn; norms start near one (Gemma's store weight - 1, so
    // near zero), biases near zero.
    bool is_norm = absl::EndsWith(w.name, "norm.weight");
    float scale = w.shape.size() == 2 ? 1.0f / std::sqrt(static_cast<float>(w.shape[1])) : 0.02f;
    float norm_mean = IsGemma(config) ? 0.0f : 1.0f;
    std::normal_distribution<float> normal(is_norm ? norm_mean : 0.0f, is_norm ? 0.1f : scale);
    for (float& v : values) v = normal(rng);
    buffers.push_back(Encode(values, dtype));
    tensors.push_back({w.name, dtype, w.shape, buffers.back().data(), buffers.back().size()});
  }

  std::filesystem::create_directories(dir);
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  if (shards == 1) {
    LATHE_RETURN_IF_ERROR(WriteSafetensors(dir + "/model.safetensors", tensors, metadata));
  } else {
    std::string weight_map;
    size_t per_shard = (tensors.size() + shards - 1) / shards;
    for (int64_t s = 0; s < shards; ++s) {
      std::string file = absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, shards);
      size_t begin = s * per_shard;
      size_t end = std::min(tensors.size(), begin + per_shard);
      if (begin >= end) continue;
      absl::Span<const TensorToWrite> part(tensors.data() + begin, end - begin);
      LATHE_RETURN_IF_ERROR(WriteSafetensors(dir + "/" + file, part, metadata));
      for (const TensorToWrite& t : part) {
        absl::StrAppend(&weight_map, weight_map.empty() ? "" : ",\n    ", "\"", t.name, "\": \"",
                        file, "\"");
      }
    }
    LATHE_RETURN_IF_ERROR(
        WriteFileAtomically(dir + "/model.safetensors.index.json",
                            absl::StrCat("{\n  \"metadata\": {},\n  \"weight_map\": {\n    ",
                                         weight_map, "\n  }\n}\n")));
  }
  LATHE_RETURN_IF_ERROR(WriteFileAtomically(dir + "/config.json", config_json));
  return absl::OkStatus();
}

std::string SyntheticDataJsonl(const SyntheticDataOptions& options) {
  std::mt19937_64 rng(options.seed);
  std::vector<std::array<int64_t, 4>> successors(options.vocab);
  std::uniform_int_distribution<int64_t> token(0, options.vocab - 1);
  for (auto& s : successors) {
    for (int64_t& t : s) t = token(rng);
  }
  std::uniform_int_distribution<int64_t> length(options.min_len, options.max_len);
  std::uniform_int_distribution<int> pick(0, 9);
  std::string text;
  for (int64_t r = 0; r < options.records; ++r) {
    int64_t len = length(rng);
    std::vector<int64_t> ids(len);
    ids[0] = token(rng);
    for (int64_t i = 1; i < len; ++i) {
      int p = pick(rng);
      ids[i] = p < 8 ? successors[ids[i - 1]][p % 4] : token(rng);
    }
    absl::StrAppend(&text, "{\"input_ids\": [", absl::StrJoin(ids, ", "), "]");
    if (options.prompt_labels) {
      int64_t prompt = len / 3;
      std::vector<int64_t> labels(ids);
      for (int64_t i = 0; i < prompt; ++i) labels[i] = -100;
      absl::StrAppend(&text, ", \"labels\": [", absl::StrJoin(labels, ", "), "]");
    }
    absl::StrAppend(&text, "}\n");
  }
  return text;
}

namespace {

// The text the synthetic tokenizers learn their merges from: several scripts, digits,
// code, emoji and whitespace runs, so that merged tokens appear in every test language.
constexpr char kTokenizerCorpus[] =
    "The lathe turns the wood slowly, and the turner shapes it with a steady hand.\n"
    "A good turner knows that the tool must be sharp, the rest must be close, and the speed must "
    "suit the piece.\n"
    "We're learning to train language models on our own data. It's not hard, but it isn't trivial "
    "either.\n"
    "They'll say the model can't learn that, yet we've seen it learn harder things; I'd try it "
    "anyway.\n"
    "I'm sure you're right: the loss fell from 4.25 to 1.75 in 1000 steps, and then to 0.98 after "
    "2500 more.\n"
    "The quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly.\n"
    "In 2024 the cluster had 512 GPUs; by 2025 it had 2048, and the queue was still long.\n"
    "Call train(model, data, steps=100) and then evaluate(model, eval_data) to see the result.\n"
    "for (int i = 0; i < n; ++i) { total += weights[i] * inputs[i]; }\n"
    "if (status.ok()) { return value; } else { return status; }\n"
    "{\"text\": \"hello world\", \"labels\": [1, 2, 3], \"id\": 42}\n"
    "Visit https://example.com/docs/training for the guide, or write to team@example.org.\n"
    "Le tour à bois tourne lentement, et l'artisan façonne une pièce élégante.\n"
    "Où est la bibliothèque ? À côté du café, près de l'église, derrière le théâtre.\n"
    "C'est très intéressant : nous apprenons à entraîner des modèles de langue.\n"
    "Die Drehbank läuft ruhig, und größere Werkstücke brauchen mehr Geduld und Übung.\n"
    "Über die Straße gehen die Mädchen zur Schule; die Bäume blühen schön im Frühling.\n"
    "El niño comió una manzana pequeña. ¿Dónde está la estación? ¡Qué día tan bonito!\n"
    "La educación es la base del desarrollo; aprender cada día es una alegría.\n"
    "A ação do coração não é só emoção; é também razão e atenção.\n"
    "Zażółć gęślą jaźń. Pchnąć w tę łódź jeża lub ośm skrzyń fig.\n"
    "Příliš žluťoučký kůň úpěl ďábelské ódy.\n"
    "Η γλώσσα είναι ζωντανή και αλλάζει κάθε μέρα. Καλημέρα σε όλους τους φίλους μας.\n"
    "Το μηχάνημα γυρίζει αργά και ο τεχνίτης δουλεύει με προσοχή.\n"
    "Токарный станок медленно вращает заготовку, а мастер работает спокойно.\n"
    "Мы учимся каждый день, и это прекрасно. Модель обучается на наших данных.\n"
    "Добрий вечір, друзі! Ми вчимося разом і це чудово.\n"
    "机器学习正在改变世界。我们每天都在学习新的知识。\n"
    "今天天气很好，我们去公园散步吧。模型在数据上训练，损失逐渐下降。\n"
    "旋盤は金属や木を削る機械です。ひらがなとカタカナを毎日勉強しています。\n"
    "東京は大きな都市です。私は日本語を少し話します。\n"
    "안녕하세요. 오늘은 날씨가 좋습니다. 우리는 매일 새로운 것을 배웁니다.\n"
    "مرحبا بالعالم. اللغة العربية جميلة جدا، ونحن نتعلمها كل يوم.\n"
    "שלום עולם. אנחנו לומדים משהו חדש בכל יום.\n"
    "नमस्ते दुनिया। हम हर दिन कुछ नया सीखते हैं।\n"
    "สวัสดีครับ วันนี้อากาศดีมาก\n"
    "I love it 😀👍 and so does she 😂🎉; the team 👩‍💻👨‍🔬 ships on Friday "
    "🚀.\n"
    "Math: ∑ x² ≤ ∞, α + β = γ, and π ≈ 3.14159; ½ + ¼ = ¾.\n"
    "Prices: $19.99, €25.00, £7.50, ¥1200 — all before tax (≈ 20%).\n"
    "\tIndented with a tab, then    four spaces, then a line with trailing spaces   \n"
    "Line one\n"
    "Line two\n"
    "\n"
    "Line four after a blank line.\n"
    "The end of the corpus repeats the most common words: the the the, and and, of of, to to, in "
    "in.\n";

struct FlavorSpec {
  SplitRegex regex;
  bool nfc;
  std::vector<std::string> special_tokens;
};

FlavorSpec SpecOf(TokenizerFlavor flavor) {
  switch (flavor) {
    case TokenizerFlavor::kGpt2:
      return {SplitRegex::kGpt2, false, {"<|endoftext|>"}};
    case TokenizerFlavor::kLlama3:
      return {SplitRegex::kLlama3,
              false,
              {"<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
               "<|eot_id|>"}};
    case TokenizerFlavor::kQwen2:
      return {SplitRegex::kQwen2, true, {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}};
  }
  return {};
}

nlohmann::ordered_json ByteLevelJson(bool add_prefix_space, bool trim_offsets, bool use_regex) {
  nlohmann::ordered_json json;
  json["type"] = "ByteLevel";
  json["add_prefix_space"] = add_prefix_space;
  json["trim_offsets"] = trim_offsets;
  json["use_regex"] = use_regex;
  return json;
}

nlohmann::ordered_json SplitJson(SplitRegex regex) {
  nlohmann::ordered_json json;
  json["type"] = "Split";
  json["pattern"] = {{"Regex", std::string(SplitRegexPattern(regex))}};
  json["behavior"] = "Isolated";
  json["invert"] = false;
  return json;
}

// BPE merges learned from kTokenizerCorpus until `new_tokens` tokens beyond the 256 bytes
// exist. Tokens are strings of bytes; `tokens` starts with the bytes and receives the new
// ones; the merges are pairs of indices into it.
std::vector<std::pair<int32_t, int32_t>> LearnMerges(SplitRegex regex, int64_t new_tokens,
                                                     std::vector<std::string>* tokens) {
  std::map<std::string, int64_t> word_counts;
  std::vector<absl::string_view> pieces;
  SplitPreTokens(regex, kTokenizerCorpus, &pieces);
  for (absl::string_view piece : pieces) ++word_counts[std::string(piece)];

  std::vector<std::vector<int32_t>> words;
  std::vector<int64_t> counts;
  for (const auto& [word, count] : word_counts) {
    std::vector<int32_t> symbols;
    for (char b : word) symbols.push_back(static_cast<unsigned char>(b));
    words.push_back(std::move(symbols));
    counts.push_back(count);
  }
  std::map<std::string, int32_t> token_ids;
  for (int32_t i = 0; i < static_cast<int32_t>(tokens->size()); ++i) token_ids[(*tokens)[i]] = i;

  std::vector<std::pair<int32_t, int32_t>> merges;
  const size_t target = tokens->size() + static_cast<size_t>(new_tokens);
  while (tokens->size() < target) {
    std::map<std::pair<int32_t, int32_t>, int64_t> pair_counts;
    for (size_t w = 0; w < words.size(); ++w) {
      for (size_t i = 0; i + 1 < words[w].size(); ++i) {
        pair_counts[{words[w][i], words[w][i + 1]}] += counts[w];
      }
    }
    if (pair_counts.empty()) break;  // every word is one token
    const std::pair<int32_t, int32_t>* best = nullptr;
    int64_t best_count = 0;
    for (const auto& [pair, count] : pair_counts) {
      if (best != nullptr) {
        if (count < best_count) continue;
        if (count == best_count) {
          const std::string& a = (*tokens)[pair.first];
          const std::string& b = (*tokens)[best->first];
          if (a > b || (a == b && (*tokens)[pair.second] >= (*tokens)[best->second])) continue;
        }
      }
      best = &pair;
      best_count = count;
    }
    const std::pair<int32_t, int32_t> merge = *best;
    const std::string merged = (*tokens)[merge.first] + (*tokens)[merge.second];
    auto [it, inserted] = token_ids.emplace(merged, static_cast<int32_t>(tokens->size()));
    if (inserted) tokens->push_back(merged);
    merges.push_back(merge);
    for (std::vector<int32_t>& word : words) {
      std::vector<int32_t> out;
      out.reserve(word.size());
      for (size_t i = 0; i < word.size(); ++i) {
        if (i + 1 < word.size() && word[i] == merge.first && word[i + 1] == merge.second) {
          out.push_back(it->second);
          ++i;
        } else {
          out.push_back(word[i]);
        }
      }
      word.swap(out);
    }
  }
  return merges;
}

}  // namespace

absl::StatusOr<TokenizerFlavor> ParseTokenizerFlavor(absl::string_view name) {
  if (name == "gpt2") return TokenizerFlavor::kGpt2;
  if (name == "llama3") return TokenizerFlavor::kLlama3;
  if (name == "qwen2") return TokenizerFlavor::kQwen2;
  return absl::InvalidArgumentError(
      absl::StrCat("expected gpt2, llama3 or qwen2, got \"", name, "\""));
}

absl::StatusOr<SyntheticTokenizer> MakeSyntheticTokenizer(
    const SyntheticTokenizerOptions& options) {
  const FlavorSpec spec = SpecOf(options.flavor);
  const int64_t minimum = 256 + static_cast<int64_t>(spec.special_tokens.size());
  if (options.vocab_size < minimum) {
    return absl::InvalidArgumentError(absl::StrCat("vocab_size: at least ", minimum,
                                                   " (256 bytes and the special tokens), got ",
                                                   options.vocab_size));
  }
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(std::string(1, static_cast<char>(b)));
  std::vector<std::pair<int32_t, int32_t>> merges =
      LearnMerges(spec.regex, options.vocab_size - minimum, &tokens);

  using OrderedJson = nlohmann::ordered_json;
  OrderedJson vocab = OrderedJson::object();
  for (size_t id = 0; id < tokens.size(); ++id) {
    vocab[ByteLevelEncode(tokens[id])] = static_cast<int64_t>(id);
  }
  OrderedJson merge_list = OrderedJson::array();
  for (const auto& [left, right] : merges) {
    merge_list.push_back(
        absl::StrCat(ByteLevelEncode(tokens[left]), " ", ByteLevelEncode(tokens[right])));
  }
  SyntheticTokenizer result;
  std::map<std::string, int64_t> special_ids;
  OrderedJson added = OrderedJson::array();
  for (const std::string& content : spec.special_tokens) {
    const int64_t id = static_cast<int64_t>(tokens.size() + special_ids.size());
    special_ids[content] = id;
    OrderedJson token;
    token["id"] = id;
    token["content"] = content;
    token["single_word"] = false;
    token["lstrip"] = false;
    token["rstrip"] = false;
    // GPT-2's file marks its one special token normalized; Llama 3 and Qwen2 do not.
    token["normalized"] = options.flavor == TokenizerFlavor::kGpt2;
    token["special"] = true;
    added.push_back(token);
  }
  result.size = static_cast<int64_t>(tokens.size() + special_ids.size());

  OrderedJson json;
  json["version"] = "1.0";
  json["truncation"] = nullptr;
  json["padding"] = nullptr;
  json["added_tokens"] = added;
  json["normalizer"] = spec.nfc ? OrderedJson{{"type", "NFC"}} : OrderedJson();
  switch (options.flavor) {
    case TokenizerFlavor::kGpt2:
      json["pre_tokenizer"] = ByteLevelJson(false, true, true);
      json["post_processor"] = ByteLevelJson(true, false, true);
      result.bos_token_id = special_ids["<|endoftext|>"];
      result.eos_token_ids = {special_ids["<|endoftext|>"]};
      break;
    case TokenizerFlavor::kLlama3: {
      json["pre_tokenizer"] = {
          {"type", "Sequence"},
          {"pretokenizers", {SplitJson(SplitRegex::kLlama3), ByteLevelJson(false, true, false)}}};
      const int64_t bos = special_ids["<|begin_of_text|>"];
      OrderedJson bos_piece = {{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}};
      OrderedJson template_processing;
      template_processing["type"] = "TemplateProcessing";
      template_processing["single"] = {bos_piece, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}};
      template_processing["pair"] = {
          bos_piece,
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
          {{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 1}}}},
          {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}};
      template_processing["special_tokens"] = {
          {"<|begin_of_text|>",
           {{"id", "<|begin_of_text|>"}, {"ids", {bos}}, {"tokens", {"<|begin_of_text|>"}}}}};
      json["post_processor"] = {
          {"type", "Sequence"},
          {"processors", {ByteLevelJson(true, false, true), template_processing}}};
      result.bos_token_id = bos;
      result.eos_token_ids = {special_ids["<|end_of_text|>"]};
      break;
    }
    case TokenizerFlavor::kQwen2:
      json["pre_tokenizer"] = {
          {"type", "Sequence"},
          {"pretokenizers", {SplitJson(SplitRegex::kQwen2), ByteLevelJson(false, false, false)}}};
      json["post_processor"] = ByteLevelJson(false, false, false);
      result.bos_token_id = special_ids["<|endoftext|>"];
      result.eos_token_ids = {special_ids["<|endoftext|>"]};
      break;
  }
  json["decoder"] = ByteLevelJson(true, true, true);
  OrderedJson model;
  model["type"] = "BPE";
  model["dropout"] = nullptr;
  model["unk_token"] = nullptr;
  model["continuing_subword_prefix"] = "";
  model["end_of_word_suffix"] = "";
  model["fuse_unk"] = false;
  model["byte_fallback"] = false;
  model["vocab"] = std::move(vocab);
  model["merges"] = std::move(merge_list);
  json["model"] = std::move(model);
  result.json = json.dump(2) + "\n";
  return result;
}

}  // namespace lathe
