#include "worker/engine/tokenizer.h"

#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/sha256.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/source_path.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "worker/engine/pre_tokenizer.h"
#include "worker/tools/synthetic.h"

namespace lathe {
namespace {

using ::testing::ElementsAre;
using ::testing::Optional;
using testing::SourcePath;
using testing::StatusIs;
using testing::TempDir;
using Json = nlohmann::json;

// The tokenizer.json of `lathe-synth tokenizer --flavor F`, parsed (made once per flavor).
const Json& SyntheticJson(TokenizerFlavor flavor) {
  static auto* const kMade = new std::map<TokenizerFlavor, Json>();
  auto it = kMade->find(flavor);
  if (it == kMade->end()) {
    absl::StatusOr<SyntheticTokenizer> made = MakeSyntheticTokenizer({flavor, 576});
    EXPECT_TRUE(made.ok()) << made.status();
    it = kMade->emplace(flavor, Json::parse(made->json)).first;
  }
  return it->second;
}

// Messages are one line: no newline, tab or other C0 control character.
void ExpectOnePrintableLine(absl::string_view message) {
  for (char c : message) {
    EXPECT_GE(static_cast<unsigned char>(c), 0x20) << "in " << message;
  }
}

Tokenizer MustParse(const Json& json) {
  absl::StatusOr<Tokenizer> tokenizer = Tokenizer::Parse(json.dump(), "/m/tokenizer.json");
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return *std::move(tokenizer);
}

std::vector<int64_t> MustEncode(const Tokenizer& tokenizer, const std::string& text,
                                bool add_special_tokens = false) {
  absl::StatusOr<std::vector<int64_t>> ids = tokenizer.Encode(text, add_special_tokens);
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? *ids : std::vector<int64_t>();
}

// `json` with an expected-ids entry's patch applied: "set" replaces top-level fields, "model"
// fields of the model, and "append_added_tokens" adds added tokens.
Json Patched(Json json, const Json& patch) {
  for (const char* key : {"set", "model"}) {
    if (!patch.contains(key)) continue;
    Json& target = std::string(key) == "set" ? json : json["model"];
    for (auto it = patch[key].begin(); it != patch[key].end(); ++it) {
      target[it.key()] = it.value();
    }
  }
  if (patch.contains("append_added_tokens")) {
    for (const Json& token : patch["append_added_tokens"]) json["added_tokens"].push_back(token);
  }
  return json;
}

// Every line of `corpus` encodes, without and with special tokens, to the entry's ids.
void ExpectCorpusIds(const Tokenizer& tokenizer, const Json& entry, const Json& corpus) {
  ASSERT_EQ(entry["ids"].size(), corpus.size());
  ASSERT_EQ(entry["ids_with_special_tokens"].size(), corpus.size());
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::string line = corpus[i];
    for (bool special : {false, true}) {
      const std::vector<int64_t> want =
          entry[special ? "ids_with_special_tokens" : "ids"][i].get<std::vector<int64_t>>();
      const std::vector<int64_t> got = MustEncode(tokenizer, line, special);
      EXPECT_EQ(got, want) << "line " << i << " " << Json(line).dump()
                           << (special ? " with" : " without")
                           << " special tokens\n  got:  " << absl::StrJoin(got, " ")
                           << "\n  want: " << absl::StrJoin(want, " ");
    }
  }
}

// Every synthetic tokenizer and variant of tokenizer_expected.json gives, for every line of
// its corpus, exactly the ids that Hugging Face's `tokenizers` gave (see the script beside
// it for how they were produced).
TEST(Tokenizer, MatchesHuggingFaceOnTheTestCorpus) {
  const std::string path = SourcePath("tests/engine/data/tokenizer_expected.json");
  absl::StatusOr<std::string> text = ReadFile(path);
  ASSERT_TRUE(text.ok()) << text.status();
  const Json expected = Json::parse(*text);
  const Json& corpus = expected["corpus"];
  ASSERT_GE(corpus.size(), 40u);
  ASSERT_EQ(expected["tokenizers"].size(), 6u);
  for (const Json& entry : expected["tokenizers"]) {
    const std::string name = entry["name"];
    SCOPED_TRACE(name);
    absl::StatusOr<TokenizerFlavor> flavor = ParseTokenizerFlavor(entry["flavor"]);
    ASSERT_TRUE(flavor.ok());
    absl::StatusOr<SyntheticTokenizer> made = MakeSyntheticTokenizer({*flavor, 576});
    ASSERT_TRUE(made.ok()) << made.status();
    ASSERT_EQ(Sha256Hex(made->json), entry["sha256"])
        << "lathe-synth tokenizer --flavor " << entry["flavor"]
        << " no longer writes the file the expected ids were made with; regenerate them with "
           "tests/engine/data/make_tokenizer_expected.py";

    Tokenizer tokenizer = MustParse(Patched(Json::parse(made->json), entry["patch"]));
    ExpectCorpusIds(tokenizer, entry, corpus);
    if (!entry.contains("pre_tokens")) continue;
    // The regex scanner alone, against the pre-tokenizer alone.
    const SplitRegex regex = *flavor == TokenizerFlavor::kGpt2     ? SplitRegex::kGpt2
                             : *flavor == TokenizerFlavor::kLlama3 ? SplitRegex::kLlama3
                                                                   : SplitRegex::kQwen2;
    ASSERT_EQ(entry["pre_tokens"].size(), corpus.size());
    for (size_t i = 0; i < corpus.size(); ++i) {
      const std::string line = corpus[i];
      std::vector<absl::string_view> pieces;
      SplitPreTokens(regex, line, &pieces);
      std::vector<std::string> got;
      for (absl::string_view piece : pieces) got.push_back(ByteLevelEncode(piece));
      EXPECT_EQ(got, entry["pre_tokens"][i].get<std::vector<std::string>>())
          << "line " << i << " " << Json(line).dump();
    }
  }
}

TEST(Tokenizer, DecodeGivesBackTheText) {
  const std::string text = "Grüße, 世界! 👩‍💻\r\n\t<|eot_id|> done";
  Tokenizer llama3 = MustParse(SyntheticJson(TokenizerFlavor::kLlama3));
  absl::StatusOr<std::string> decoded = llama3.Decode(MustEncode(llama3, text, true));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, "<|begin_of_text|>" + text);
  // Qwen2 normalises to NFC first.
  Tokenizer qwen2 = MustParse(SyntheticJson(TokenizerFlavor::kQwen2));
  decoded = qwen2.Decode(MustEncode(qwen2, "cafe\u0301"));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, "caf\u00e9");
  EXPECT_THAT(qwen2.Decode({100000}), StatusIs(absl::StatusCode::kInvalidArgument,
                                               "token id 100000 is not in the tokenizer"));
}

TEST(Tokenizer, TokenIdsSizeAndTemplate) {
  Tokenizer llama3 = MustParse(SyntheticJson(TokenizerFlavor::kLlama3));
  EXPECT_EQ(llama3.size(), 576);
  EXPECT_THAT(llama3.TokenId("<|begin_of_text|>"), Optional(571));
  EXPECT_THAT(llama3.TokenId("<|eot_id|>"), Optional(575));
  EXPECT_THAT(llama3.TokenId("Ġt"), Optional(256));  // the first merge
  EXPECT_EQ(llama3.TokenId("<|im_end|>"), std::nullopt);
  EXPECT_THAT(llama3.template_prefix(), ElementsAre(571));
  EXPECT_TRUE(llama3.template_suffix().empty());
  EXPECT_THAT(MustEncode(llama3, "", true), ElementsAre(571));
  EXPECT_TRUE(MustEncode(llama3, "", false).empty());
}

// A tokenizer over the 256 byte tokens, with `extra` vocabulary entries from id 256 on and
// the given merges.
Json SmallTokenizer(const std::vector<std::string>& extra, const Json& merges) {
  Json vocab = Json::object();
  const auto& alphabet = ByteLevelAlphabet();
  for (int b = 0; b < 256; ++b) vocab[alphabet[b]] = b;
  for (size_t i = 0; i < extra.size(); ++i) vocab[extra[i]] = 256 + i;
  return {
      {"version", "1.0"},
      {"added_tokens", Json::array()},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
}

// ignore_merges (Llama 3's files set it; the synthetic files of the corpus test do not): a
// whole pre-token found in the vocabulary is one id even when the merges would not build it.
TEST(Tokenizer, IgnoreMergesTakesWholeWordsFromTheVocabulary) {
  Json json = SmallTokenizer({"ab", "abc", "Ġabc"}, {"a b"});
  EXPECT_THAT(MustEncode(MustParse(json), "abc abc"), ElementsAre(256, 'c', ' ', 256, 'c'));
  json["model"]["ignore_merges"] = true;
  EXPECT_THAT(MustEncode(MustParse(json), "abc abc abd"), ElementsAre(257, 258, 32, 256, 'd'));
}

TEST(Tokenizer, MergesAsPairsEqualMergesAsStrings) {
  Tokenizer strings = MustParse(SyntheticJson(TokenizerFlavor::kQwen2));
  Json json = SyntheticJson(TokenizerFlavor::kQwen2);
  for (Json& merge : json["model"]["merges"]) {
    const std::string text = merge;
    merge = Json::array({text.substr(0, text.find(' ')), text.substr(text.find(' ') + 1)});
  }
  Tokenizer pairs = MustParse(json);
  for (const std::string text : {"The lathe turns the wood.", "Мы учимся каждый день.",
                                 "机器学习正在改变世界。 1234 don't"}) {
    EXPECT_EQ(MustEncode(pairs, text), MustEncode(strings, text)) << text;
  }
}

TEST(Tokenizer, PostProcessorSequenceNestsTemplates) {
  Json json = SmallTokenizer({}, Json::array());
  json["added_tokens"] = {
      {{"id", 256}, {"content", "<s>"}, {"special", true}, {"normalized", false}},
      {{"id", 257}, {"content", "</s>"}, {"special", true}, {"normalized", false}}};
  auto special = [](const std::string& name) {
    return Json{{"SpecialToken", {{"id", name}, {"type_id", 0}}}};
  };
  const Json sequence = {{"Sequence", {{"id", "A"}, {"type_id", 0}}}};
  const Json ids = {{"<s>", {{"id", "<s>"}, {"ids", {256}}, {"tokens", {"<s>"}}}},
                    {"</s>", {{"id", "</s>"}, {"ids", {257}}, {"tokens", {"</s>"}}}}};
  json["post_processor"] = {{"type", "Sequence"},
                            {"processors",
                             {{{"type", "ByteLevel"}},
                              {{"type", "TemplateProcessing"},
                               {"single", {special("<s>"), sequence}},
                               {"special_tokens", ids}},
                              {{"type", "TemplateProcessing"},
                               {"single", {special("</s>"), sequence, special("</s>")}},
                               {"special_tokens", ids}}}}};
  Tokenizer tokenizer = MustParse(json);
  EXPECT_THAT(MustEncode(tokenizer, "a", true), ElementsAre(257, 256, 'a', 257));
  EXPECT_THAT(MustEncode(tokenizer, "a", false), ElementsAre('a'));
}

TEST(Tokenizer, RefusesInvalidUtf8) {
  Tokenizer tokenizer = MustParse(SyntheticJson(TokenizerFlavor::kGpt2));
  EXPECT_THAT(tokenizer.Encode("ok \xC3\x28", false),
              StatusIs(absl::StatusCode::kInvalidArgument, "invalid UTF-8 at byte 3"));
  EXPECT_THAT(tokenizer.Encode("\xED\xA0\x80", false),  // a surrogate
              StatusIs(absl::StatusCode::kInvalidArgument, "invalid UTF-8 at byte 0"));
}

TEST(Tokenizer, LoadReportsAMissingFile) {
  EXPECT_THAT(Tokenizer::Load("/nonexistent/tokenizer.json"),
              StatusIs(absl::StatusCode::kNotFound, "/nonexistent/tokenizer.json: no such file"));
  TempDir dir;
  absl::StatusOr<SyntheticTokenizer> made = MakeSyntheticTokenizer({TokenizerFlavor::kGpt2, 300});
  ASSERT_TRUE(made.ok());
  absl::StatusOr<Tokenizer> loaded = Tokenizer::Load(dir.Write("tokenizer.json", made->json));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->size(), 300);
}

TEST(Tokenizer, RefusesWhatItDoesNotImplementNamingTheField) {
  struct Case {
    std::string description;
    std::function<void(Json&)> mutate;
    std::string message;
  };
  const std::string llama3_regex(SplitRegexPattern(SplitRegex::kLlama3));
  const std::vector<Case> cases = {
      {"unigram", [](Json& j) { j["model"]["type"] = "Unigram"; },
       "/m/tokenizer.json: model.type: \"Unigram\" is not supported (BPE only)"},
      {"no model type", [](Json& j) { j["model"].erase("type"); },
       "/m/tokenizer.json: model.type: required field is missing"},
      {"dropout", [](Json& j) { j["model"]["dropout"] = 0.1; },
       "/m/tokenizer.json: model.dropout: 0.1 is not supported (must be null)"},
      {"byte fallback", [](Json& j) { j["model"]["byte_fallback"] = true; },
       "/m/tokenizer.json: model.byte_fallback: true is not supported (byte-level BPE needs "
       "none)"},
      {"subword prefix", [](Json& j) { j["model"]["continuing_subword_prefix"] = "##"; },
       "/m/tokenizer.json: model.continuing_subword_prefix: \"##\" is not supported (must be "
       "null or empty)"},
      {"merge without a space", [](Json& j) { j["model"]["merges"][3] = "ab"; },
       "/m/tokenizer.json: model.merges[3]: expected \"left right\", got \"ab\""},
      {"merge with two spaces", [](Json& j) { j["model"]["merges"][0] = "a b c"; },
       "/m/tokenizer.json: model.merges[0]: expected \"left right\", got \"a b c\""},
      {"merge of unknown tokens", [](Json& j) { j["model"]["merges"][1] = "zq xw"; },
       "/m/tokenizer.json: model.merges[1]: \"zq\" is not in model.vocab"},
      {"merge whose result is unknown", [](Json& j) { j["model"]["merges"][1] = "x q"; },
       "/m/tokenizer.json: model.merges[1]: \"xq\" is not in model.vocab"},
      {"merge as a number", [](Json& j) { j["model"]["merges"][2] = 7; },
       "/m/tokenizer.json: model.merges[2]: expected \"left right\" or [\"left\", \"right\"], "
       "got 7"},
      {"missing byte", [](Json& j) { j["model"]["vocab"].erase("Ā"); },
       "/m/tokenizer.json: model.vocab: byte-level BPE needs all 256 byte characters; \"Ā\" "
       "(byte 0) is missing"},
      {"shared id", [](Json& j) { j["model"]["vocab"]["zzz"] = 38; },
       "/m/tokenizer.json: model.vocab: \"&\" and \"zzz\" share id 38"},
      {"unknown pattern",
       [](Json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\s+"; },
       "/m/tokenizer.json: pre_tokenizer.pretokenizers[0].pattern.Regex: \"\\\\s+\" is not "
       "supported (the GPT-2, Llama 3 and Qwen2 patterns only)"},
      {"string pattern",
       [](Json& j) {
         j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"String", " "}};
       },
       "/m/tokenizer.json: pre_tokenizer.pretokenizers[0].pattern: {\"String\":\" \"} is not "
       "supported (a {\"Regex\": ...} only)"},
      {"split behavior",
       [](Json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; },
       "/m/tokenizer.json: pre_tokenizer.pretokenizers[0].behavior: \"Removed\" is not "
       "supported (Isolated only)"},
      {"metaspace beside byte level",
       [](Json& j) {
         j["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Metaspace"}, {"replacement", "_"}};
       },
       "/m/tokenizer.json: pre_tokenizer.pretokenizers[0].type: \"Metaspace\" is not supported "
       "(ByteLevel, Split or a Sequence of them only; Metaspace only alone)"},
      {"no byte level", [](Json& j) { j["pre_tokenizer"]["pretokenizers"].erase(1); },
       "/m/tokenizer.json: pre_tokenizer: byte-level BPE needs exactly one ByteLevel "
       "pre-tokenizer, as the last one"},
      {"nfkc",
       [](Json& j) {
         j["normalizer"] = {{"type", "NFKC"}};
       },
       "/m/tokenizer.json: normalizer.type: \"NFKC\" is not supported (null, NFC, Prepend, "
       "Replace or a Sequence of them only)"},
      {"nfkc in a sequence",
       [](Json& j) {
         j["normalizer"] = {{"type", "Sequence"},
                            {"normalizers", {{{"type", "NFC"}}, {{"type", "Lowercase"}}}}};
       },
       "/m/tokenizer.json: normalizer.normalizers[1].type: \"Lowercase\" is not supported"},
      {"truncation",
       [](Json& j) {
         j["truncation"] = {{"max_length", 512}};
       },
       "/m/tokenizer.json: truncation: {\"max_length\":512} is not supported (Lathe cuts "
       "sequences to data.seq_len itself); it must be null"},
      {"roberta",
       [](Json& j) {
         j["post_processor"] = {{"type", "RobertaProcessing"}};
       },
       "/m/tokenizer.json: post_processor.type: \"RobertaProcessing\" is not supported"},
      {"pair template only",
       [](Json& j) { j["post_processor"]["processors"][1]["single"][1]["Sequence"]["id"] = "B"; },
       "/m/tokenizer.json: post_processor.processors[1].single[1].Sequence.id: \"B\" is not "
       "supported (one sequence \"A\" only)"},
      {"template token without ids",
       [](Json& j) { j["post_processor"]["processors"][1]["special_tokens"] = Json::object(); },
       "/m/tokenizer.json: post_processor.processors[1].special_tokens: no ids for "
       "\"<|begin_of_text|>\""},
      {"added token on a vocabulary id", [](Json& j) { j["added_tokens"][0]["id"] = 38; },
       "/m/tokenizer.json: added_tokens[0]: id 38 is \"&\" in model.vocab"},
      {"added token twice", [](Json& j) { j["added_tokens"][1]["content"] = "<|begin_of_text|>"; },
       "/m/tokenizer.json: added_tokens[1]: \"<|begin_of_text|>\" is added twice"},
      {"empty added token", [](Json& j) { j["added_tokens"][0]["content"] = ""; },
       "/m/tokenizer.json: added_tokens[0].content: expected a non-empty string, got \"\""},
      {"not an object", [](Json& j) { j = Json::array(); },
       "/m/tokenizer.json: expected a JSON object at the top level"},
      // Found by fuzz/tokenizer_fuzzer: an id below size() that no token has was taken, and
      // Encode then gave an id that Decode refused.
      {"template id of no token",
       [](Json& j) {
         j["added_tokens"][4]["id"] = 600;  // frees 575
         j["post_processor"]["processors"][1]["special_tokens"]["<|begin_of_text|>"]["ids"] = {575};
       },
       "/m/tokenizer.json: post_processor.processors[1].special_tokens[\"<|begin_of_text|>\"]"
       ".ids: 575 is not a token id of this tokenizer"},
      // Strings from the file went into messages unescaped (a newline broke the line).
      {"shared id, key with a newline", [](Json& j) { j["model"]["vocab"]["z\nz"] = 38; },
       "/m/tokenizer.json: model.vocab: \"&\" and \"z\\nz\" share id 38"},
      {"added twice, content with a newline",
       [](Json& j) {
         j["added_tokens"][0]["content"] = "a\nb";
         j["added_tokens"][1]["content"] = "a\nb";
       },
       "/m/tokenizer.json: added_tokens[1]: \"a\\nb\" is added twice"},
      {"nested sequences",
       [](Json& j) {
         Json normalizer = {{"type", "NFC"}};
         for (int i = 0; i < 9; ++i) {
           normalizer = {{"type", "Sequence"}, {"normalizers", {normalizer}}};
         }
         j["normalizer"] = normalizer;
       },
       "/m/tokenizer.json: normalizer.normalizers[0].normalizers[0].normalizers[0].normalizers[0]"
       ".normalizers[0].normalizers[0].normalizers[0].normalizers[0]: a Sequence nested more "
       "than 8 deep is not supported"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.description);
    Json json = SyntheticJson(TokenizerFlavor::kLlama3);
    c.mutate(json);
    absl::StatusOr<Tokenizer> tokenizer = Tokenizer::Parse(json.dump(), "/m/tokenizer.json");
    ASSERT_FALSE(tokenizer.ok());
    EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(std::string(tokenizer.status().message()).substr(0, c.message.size()), c.message);
    ExpectOnePrintableLine(tokenizer.status().message());
  }
  EXPECT_THAT(Tokenizer::Parse("{\"model\": ", "/m/tokenizer.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, "/m/tokenizer.json: malformed JSON"));
}

// Hostile files give one-line errors, not a crash (the nested ones are longer than
// fuzz/tokenizer_fuzzer's inputs can be).
TEST(Tokenizer, RefusesHostileFilesWithOneLineErrors) {
  const struct {
    std::string description;
    std::string json;
    std::string message;
  } cases[] = {
      // An uncaught out_of_range ended the process.
      {"number overflow", "{\"model\": 1e999}",
       "/m/tokenizer.json: malformed JSON: [json.exception.out_of_range.406] number overflow"},
      // nlohmann's message quotes the bytes last read (found by fuzz/tokenizer_fuzzer).
      {"control byte", "{\"model\": \x7f}", "last read: '\"model\": \\x7f'"},
      {"invalid UTF-8", "{\"model\": \"\xff\"}", "last read: '\"\\xff'"},
      // dump() for the message recursed once per level and overflowed the stack.
      {"deeply nested value",
       "{\"normalizer\": {\"type\": " + std::string(200000, '[') + std::string(200000, ']') + "}}",
       "/m/tokenizer.json: normalizer.type: expected a string, got [[[[[[[["},
      // One stack frame and one ever longer path per level.
      {"deeply nested sequences",
       "{\"normalizer\": " +
           [] {
             constexpr int kLevels = 50000;
             std::string levels;
             for (int i = 0; i < kLevels; ++i) levels += R"({"type": "Sequence", "normalizers": [)";
             levels += R"({"type": "NFC"})";
             for (int i = 0; i < kLevels; ++i) levels += "]}";
             return levels;
           }() +
           "}",
       "a Sequence nested more than 8 deep is not supported"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.description);
    absl::StatusOr<Tokenizer> tokenizer = Tokenizer::Parse(c.json, "/m/tokenizer.json");
    EXPECT_THAT(tokenizer, StatusIs(absl::StatusCode::kInvalidArgument, c.message));
    ExpectOnePrintableLine(tokenizer.status().message());
    EXPECT_LT(tokenizer.status().message().size(), 300u);
  }
}

// model.vocab was a table indexed by id, so one id near 2^31 in a small file asked for
// 64 GiB, and 2^31 - 1 overflowed an int32 (fuzz/corpus/tokenizer/crash_giant_vocab_id.json).
TEST(Tokenizer, LargeIdsCostNoMemory) {
  Json json = SmallTokenizer({"ab"}, {"a b"});
  json["model"]["vocab"]["zz"] = 2147483647;
  Tokenizer tokenizer = MustParse(json);
  EXPECT_EQ(tokenizer.size(), 2147483648);
  EXPECT_THAT(tokenizer.TokenId("zz"), Optional(2147483647));
  absl::StatusOr<std::string> decoded = tokenizer.Decode({2147483647, 256});
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, "zzab");
  EXPECT_THAT(tokenizer.Decode({2147483646}),
              StatusIs(absl::StatusCode::kInvalidArgument, "token id 2147483646 is not in"));
}

// The SentencePiece-style tokenizers that `tokenizers` trained (Llama 2's and Gemma's layout)
// and their variants in byte_fallback_expected.json give, for every line of its corpus,
// exactly the ids `tokenizers` gave, and decode the ids with special tokens to its text (see
// make_byte_fallback_tokenizers.py beside it).
TEST(Tokenizer, ByteFallbackMatchesHuggingFaceOnTheTestCorpus) {
  absl::StatusOr<std::string> text =
      ReadFile(SourcePath("tests/engine/data/byte_fallback_expected.json"));
  ASSERT_TRUE(text.ok()) << text.status();
  const Json expected = Json::parse(*text);
  const Json& corpus = expected["corpus"];
  ASSERT_GE(corpus.size(), 80u);
  ASSERT_EQ(expected["tokenizers"].size(), 9u);
  for (const Json& entry : expected["tokenizers"]) {
    const std::string name = entry["name"];
    SCOPED_TRACE(name);
    const std::string file = entry["file"];
    absl::StatusOr<std::string> file_text = ReadFile(SourcePath("tests/engine/data/" + file));
    ASSERT_TRUE(file_text.ok()) << file_text.status();
    ASSERT_EQ(Sha256Hex(*file_text), expected["sha256"][file])
        << file << " is not the file the expected ids were made with; regenerate them with "
        << "tests/engine/data/make_byte_fallback_tokenizers.py";
    Tokenizer tokenizer = MustParse(Patched(Json::parse(*file_text), entry["patch"]));
    ExpectCorpusIds(tokenizer, entry, corpus);
    ASSERT_EQ(entry["decoded"].size(), corpus.size());
    for (size_t i = 0; i < corpus.size(); ++i) {
      const std::string line = corpus[i];
      absl::StatusOr<std::string> decoded =
          tokenizer.Decode(entry["ids_with_special_tokens"][i].get<std::vector<int64_t>>());
      ASSERT_TRUE(decoded.ok()) << decoded.status();
      EXPECT_EQ(*decoded, entry["decoded"][i].get<std::string>())
          << "line " << i << " " << Json(line).dump();
    }
  }
}

// A Llama 2 style tokenizer: <unk> <s> </s>, the byte tokens <0x00>..<0xFF> (ids 3..258),
// then "▁" 259, "a" 260, "b" 261, "▁a" 262, "▁ab" 263, "ab" 264. (The ids below are those
// `tokenizers` 0.23.3 gives for the same file.)
Json SmallSentencePiece() {
  Json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) vocab[absl::StrFormat("<0x%02X>", b)] = 3 + b;
  const char* extra[] = {"\u2581", "a", "b", "\u2581a", "\u2581ab", "ab"};
  for (int i = 0; i < 6; ++i) vocab[extra[i]] = 259 + i;
  Json added = Json::array();
  for (int id = 0; id < 3; ++id) {
    added.push_back({{"id", id},
                     {"content", id == 0   ? "<unk>"
                                 : id == 1 ? "<s>"
                                           : "</s>"},
                     {"special", true},
                     {"normalized", false}});
  }
  return {{"version", "1.0"},
          {"added_tokens", added},
          {"normalizer",
           {{"type", "Sequence"},
            {"normalizers",
             {{{"type", "Prepend"}, {"prepend", "\u2581"}},
              {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}}}}},
          {"pre_tokenizer", nullptr},
          {"post_processor", nullptr},
          {"decoder",
           {{"type", "Sequence"},
            {"decoders",
             {{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
              {{"type", "ByteFallback"}},
              {{"type", "Fuse"}},
              {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
          {"model",
           {{"type", "BPE"},
            {"unk_token", "<unk>"},
            {"fuse_unk", true},
            {"byte_fallback", true},
            {"vocab", vocab},
            {"merges", Json::array({Json::array({"\u2581", "a"}), Json::array({"\u2581a", "b"}),
                                    Json::array({"a", "b"})})}}}};
}

Json MetaspacePreTokenizer(const std::string& scheme, bool split) {
  return {{"type", "Metaspace"},
          {"replacement", "\u2581"},
          {"prepend_scheme", scheme},
          {"split", split}};
}

TEST(Tokenizer, ByteFallbackGivesTheBytesOfUnknownCharacters) {
  Tokenizer tokenizer = MustParse(SmallSentencePiece());
  // é is C3 A9, € E2 82 AC; neither is in the vocabulary.
  EXPECT_THAT(MustEncode(tokenizer, "a\u00e9"), ElementsAre(262, 3 + 0xC3, 3 + 0xA9));
  EXPECT_THAT(MustEncode(tokenizer, "\u20acb"),
              ElementsAre(259, 3 + 0xE2, 3 + 0x82, 3 + 0xAC, 261));
  absl::StatusOr<std::string> decoded = tokenizer.Decode({1, 262, 3 + 0xC3, 3 + 0xA9, 263});
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, "<s> a\u00e9 ab");
  // Half a character stays its byte (`tokenizers` would show U+FFFD).
  decoded = tokenizer.Decode({262, 3 + 0xC3});
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, "a\xC3");
  // A character whose bytes are not all there is unk.
  Json json = SmallSentencePiece();
  json["model"]["vocab"].erase("<0xA9>");
  EXPECT_THAT(MustEncode(MustParse(json), "a\u00e9b\u20ac"),
              ElementsAre(262, 0, 261, 3 + 0xE2, 3 + 0x82, 3 + 0xAC));
}

TEST(Tokenizer, UnknownCharactersWithoutByteFallback) {
  Json json = SmallSentencePiece();
  json["model"]["byte_fallback"] = false;
  EXPECT_THAT(MustEncode(MustParse(json), "a\u00e9\u00e9b\u20ac"), ElementsAre(262, 0, 261, 0));
  json["model"]["fuse_unk"] = false;
  EXPECT_THAT(MustEncode(MustParse(json), "a\u00e9\u00e9b\u20ac"), ElementsAre(262, 0, 0, 261, 0));
  // With no unk_token they vanish, and what is left merges across them.
  json["model"]["unk_token"] = nullptr;
  EXPECT_THAT(MustEncode(MustParse(json), "a\u00e9\u00e9b"), ElementsAre(263));
}

TEST(Tokenizer, NormalizerPrependsToEveryPieceBetweenAddedTokens) {
  Tokenizer tokenizer = MustParse(SmallSentencePiece());
  EXPECT_THAT(MustEncode(tokenizer, " a<s>ab "), ElementsAre(259, 262, 1, 263, 259));
  EXPECT_TRUE(MustEncode(tokenizer, "").empty());
}

TEST(Tokenizer, MetaspacePrependSchemes) {
  const struct {
    std::string scheme;
    std::vector<int64_t> ids;  // of "a<s>a"
  } cases[] = {{"first", {262, 1, 260}}, {"always", {262, 1, 262}}, {"never", {260, 1, 260}}};
  for (const auto& c : cases) {
    for (bool split : {false, true}) {
      SCOPED_TRACE(absl::StrCat(c.scheme, split ? " split" : ""));
      Json json = SmallSentencePiece();
      json["normalizer"] = nullptr;
      json["pre_tokenizer"] = MetaspacePreTokenizer(c.scheme, split);
      Tokenizer tokenizer = MustParse(json);
      EXPECT_EQ(MustEncode(tokenizer, "a<s>a"), c.ids);
      // Leading and trailing spaces; a leading one is the replacement already.
      EXPECT_THAT(MustEncode(tokenizer, " ab  b "), ElementsAre(263, 259, 259, 261, 259));
    }
  }
  // The Metaspace decoder drops the first token's replacements and spaces the others'.
  Json json = SmallSentencePiece();
  json["normalizer"] = nullptr;
  json["pre_tokenizer"] = MetaspacePreTokenizer("first", false);
  json["decoder"] = MetaspacePreTokenizer("first", false);
  absl::StatusOr<std::string> decoded = MustParse(json).Decode({262, 259, 263});
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, "a  ab");
  // No decoder: the tokens joined by spaces, as `tokenizers` does.
  json["decoder"] = nullptr;
  decoded = MustParse(json).Decode({262, 1, 260});
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, "\u2581a <s> a");
}

// Replace steps that double the text again and again would exhaust memory.
TEST(Tokenizer, RefusesANormalizerThatGrowsTheTextWithoutBound) {
  Json json = SmallSentencePiece();
  Json steps = Json::array();
  for (int i = 0; i < 40; ++i) {
    steps.push_back({{"type", "Replace"}, {"pattern", {{"String", "a"}}}, {"content", "aa"}});
  }
  json["normalizer"] = {{"type", "Sequence"}, {"normalizers", steps}};
  Tokenizer tokenizer = MustParse(json);
  EXPECT_THAT(tokenizer.Encode("a", false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "the tokenizer's normalizer makes the text more than 16 times longer"));
  EXPECT_THAT(MustEncode(tokenizer, "<s>b"), ElementsAre(1, 261));
  json["added_tokens"].push_back(
      {{"id", 300}, {"content", "aaa"}, {"special", false}, {"normalized", true}});
  EXPECT_THAT(Tokenizer::Parse(json.dump(), "/m/tokenizer.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "/m/tokenizer.json: normalizer: makes \"aaa\" more than 16 times longer"));
}

TEST(Tokenizer, RefusesUnsupportedSentencePiecePartsNamingTheField) {
  const struct {
    std::string description;
    std::function<void(Json&)> mutate;
    std::string message;
  } cases[] = {
      {"nfkc",
       [](Json& j) {
         j["normalizer"]["normalizers"][1] = {{"type", "NFKC"}};
       },
       "/m/tokenizer.json: normalizer.normalizers[1].type: \"NFKC\" is not supported (null, NFC, "
       "Prepend, Replace or a Sequence of them only)"},
      {"regex replace",
       [](Json& j) {
         j["normalizer"]["normalizers"][1]["pattern"] = {{"Regex", " +"}};
       },
       "/m/tokenizer.json: normalizer.normalizers[1].pattern: {\"Regex\":\" +\"} is not "
       "supported (a non-empty {\"String\": ...} only)"},
      {"prepend scheme",
       [](Json& j) { j["pre_tokenizer"] = MetaspacePreTokenizer("sometimes", true); },
       "/m/tokenizer.json: pre_tokenizer.prepend_scheme: \"sometimes\" is not supported "
       "(\"always\", \"first\" or \"never\" only)"},
      {"long replacement",
       [](Json& j) {
         j["pre_tokenizer"] = MetaspacePreTokenizer("first", true);
         j["pre_tokenizer"]["replacement"] = "__";
       },
       "/m/tokenizer.json: pre_tokenizer.replacement: expected one character, got \"__\""},
      {"byte level decoder",
       [](Json& j) {
         j["decoder"] = {{"type", "ByteLevel"}};
       },
       "/m/tokenizer.json: decoder.type: \"ByteLevel\" is not supported (null, Replace, "
       "ByteFallback, Fuse, Strip, Metaspace or a Sequence of them only)"},
      {"ctc decoder in a sequence",
       [](Json& j) {
         j["decoder"]["decoders"][2] = {{"type", "CTC"}};
       },
       "/m/tokenizer.json: decoder.decoders[2].type: \"CTC\" is not supported"},
      {"unk not in the vocabulary", [](Json& j) { j["model"]["unk_token"] = "<?>"; },
       "/m/tokenizer.json: model.unk_token: \"<?>\" is not in model.vocab"},
      {"unigram", [](Json& j) { j["model"]["type"] = "Unigram"; },
       "/m/tokenizer.json: model.type: \"Unigram\" is not supported (BPE only)"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.description);
    Json json = SmallSentencePiece();
    c.mutate(json);
    absl::StatusOr<Tokenizer> tokenizer = Tokenizer::Parse(json.dump(), "/m/tokenizer.json");
    ASSERT_FALSE(tokenizer.ok());
    EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(std::string(tokenizer.status().message()).substr(0, c.message.size()), c.message);
    ExpectOnePrintableLine(tokenizer.status().message());
  }
}

TEST(PreTokenizer, RecognisesExactlyTheThreePatterns) {
  for (SplitRegex regex : {SplitRegex::kGpt2, SplitRegex::kLlama3, SplitRegex::kQwen2}) {
    EXPECT_EQ(RecognizeSplitRegex(SplitRegexPattern(regex)), regex) << SplitRegexName(regex);
  }
  EXPECT_EQ(RecognizeSplitRegex(absl::StrCat(SplitRegexPattern(SplitRegex::kGpt2), "|x")),
            std::nullopt);
}

std::vector<std::string> Split(SplitRegex regex, absl::string_view text) {
  std::vector<absl::string_view> pieces;
  SplitPreTokens(regex, text, &pieces);
  return std::vector<std::string>(pieces.begin(), pieces.end());
}

// The regexes' corner cases, spelled out (the corpus test checks them against Hugging Face).
TEST(PreTokenizer, SplitsAsTheRegexesDo) {
  EXPECT_THAT(
      Split(SplitRegex::kGpt2, "I'm  here!!\n\nDON'T 2024x"),
      ElementsAre("I", "'m", " ", " here", "!!", "\n", "\n", "DON", "'", "T", " 2024", "x"));
  EXPECT_THAT(Split(SplitRegex::kLlama3, "I'm  here!!\n\nDON'T 2024x"),
              ElementsAre("I", "'m", " ", " here", "!!\n\n", "DON", "'T", " ", "202", "4", "x"));
  EXPECT_THAT(Split(SplitRegex::kQwen2, "x 2024  \n\n  y"),
              ElementsAre("x", " ", "2", "0", "2", "4", "  \n\n", " ", " y"));
}

TEST(PreTokenizer, FindsInvalidUtf8) {
  EXPECT_EQ(FindInvalidUtf8("plain ascii, Grüße, 世界, 😀"), std::nullopt);
  EXPECT_EQ(FindInvalidUtf8("ab\x80"), 2u);             // a lone continuation byte
  EXPECT_EQ(FindInvalidUtf8("\xC0\xAF"), 0u);           // overlong
  EXPECT_EQ(FindInvalidUtf8("x\xF4\x90\x80\x80"), 1u);  // past U+10FFFF
  EXPECT_EQ(FindInvalidUtf8("\xE4\xB8"), 0u);           // truncated
}

}  // namespace
}  // namespace lathe
