#include "worker/engine/token_dataset.h"

#include <algorithm>
#include <filesystem>
#include <numeric>
#include <optional>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "worker/engine/text_record_encoder.h"
#include "worker/engine/tokenizer.h"
#include "worker/tools/synthetic.h"

namespace lathe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::StatusIs;
using testing::TempDir;

absl::Status LoadStatus(const std::string& text, int64_t vocab = 100) {
  TempDir dir;
  return TokenDataset::Load(dir.Write("d.jsonl", text), "data.train", vocab).status();
}

TEST(TokenDataset, LoadsIdsAndLabelsAndSkipsBlankLines) {
  TempDir dir;
  std::string path = dir.Write(
      "d.jsonl",
      "{\"input_ids\": [1, 2, 3]}\n\n  \n{\"input_ids\": [4, 5], \"labels\": [-100, 5]}\n");
  absl::StatusOr<TokenDataset> data = TokenDataset::Load(path, "data.train", 10);
  ASSERT_TRUE(data.ok()) << data.status();
  ASSERT_EQ(data->documents().size(), 2u);
  EXPECT_THAT(data->documents()[0].labels, ElementsAre(1, 2, 3));
  EXPECT_THAT(data->documents()[1].labels, ElementsAre(-100, 5));
  EXPECT_EQ(data->total_tokens(), 5);
}

TEST(TokenDataset, RejectsBadRecordsNamingFieldFileAndLine) {
  struct Case {
    std::string text;
    std::string fragment;
  } cases[] = {
      {"{\"input_ids\": [1]}\nnot json\n", "line 2: not valid JSON"},
      {"[1, 2]\n", "line 1: not a JSON object"},
      {"{\"ids\": [1]}\n", "line 1: no \"input_ids\""},
      {"{\"text\": \"hello\"}\n", "line 1: text records need a tokenizer"},
      {"{\"input_ids\": []}\n", "line 1: input_ids is empty"},
      {"{\"input_ids\": [1, \"a\"]}\n", "input_ids[1] is not an integer"},
      {"{\"input_ids\": [1, 100]}\n",
       "line 1: input_ids[1]: token id 100 is outside the vocabulary (vocab_size 100)"},
      {"{\"input_ids\": [-1]}\n", "token id -1 is outside the vocabulary"},
      {"{\"input_ids\": [1, 2], \"labels\": [1]}\n", "labels has 1 entries but input_ids has 2"},
      {"{\"input_ids\": [1, 2], \"labels\": [1, -5]}\n", "labels[1]: -5 is neither -100"},
  };
  for (const Case& c : cases) {
    absl::Status status = LoadStatus(c.text);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(status.message(), HasSubstr("data.train: ")) << c.text;
    EXPECT_THAT(status.message(), HasSubstr(c.fragment)) << status.message();
  }
}

TEST(TokenDataset, RejectsEmptyAndMissingFiles) {
  absl::Status empty = LoadStatus("\n\n");
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.message(), HasSubstr("the data set is empty"));
  absl::Status missing = TokenDataset::Load("/nonexistent/x.jsonl", "data.eval", 10).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("data.eval: /nonexistent/x.jsonl"));
}

TEST(EpochPermutation, IsADeterministicPermutationThatChangesPerEpoch) {
  std::vector<int64_t> p0 = EpochPermutation(50, 7, 0);
  std::vector<int64_t> sorted = p0;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> identity(50);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_EQ(sorted, identity);
  EXPECT_EQ(p0, EpochPermutation(50, 7, 0));
  EXPECT_NE(p0, EpochPermutation(50, 7, 1));
  EXPECT_NE(p0, EpochPermutation(50, 8, 0));
}

TEST(EpochPermutation, MatchesTheDocumentedSplitMix64Shuffle) {
  // Computed by hand from docs/training.md for seed 0, epoch 0, n = 5:
  // state = 0x9E3779B97F4A7C15; the first next() returns SplitMix64(2 * golden ratio) etc.
  uint64_t state = 0x9E3779B97F4A7C15ULL;
  auto next = [&state] {
    state += 0x9E3779B97F4A7C15ULL;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  };
  std::vector<int64_t> expected = {0, 1, 2, 3, 4};
  for (int64_t i = 4; i >= 1; --i) std::swap(expected[i], expected[next() % (i + 1)]);
  EXPECT_EQ(EpochPermutation(5, 0, 0), expected);
}

TokenDataset Dataset(const std::string& text) {
  TempDir dir;
  return *TokenDataset::Load(dir.Write("d.jsonl", text), "data.train", 100);
}

TEST(SequenceSampler, PacksDocumentsAndMasksEachDocumentsFirstToken) {
  TokenDataset data = Dataset("{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4, 5, 6, 7]}\n");
  SequenceSampler sampler(&data, 4, /*pack=*/true, /*seed=*/0);
  std::vector<int64_t> order = EpochPermutation(2, 0, 0);
  const auto& docs = data.documents();
  std::vector<int64_t> ids, labels;
  for (int64_t d : order) {
    for (size_t i = 0; i < docs[d].input_ids.size(); ++i) {
      ids.push_back(docs[d].input_ids[i]);
      labels.push_back(i == 0 ? -100 : docs[d].labels[i]);
    }
  }
  Sequence first = sampler.Next();
  ASSERT_EQ(first.input_ids.size(), 4u);
  EXPECT_EQ(first.input_ids, std::vector<int64_t>(ids.begin(), ids.begin() + 4));
  EXPECT_EQ(first.labels, std::vector<int64_t>(labels.begin(), labels.begin() + 4));
  Sequence second = sampler.Next();  // the last 3 tokens of epoch 0, then epoch 1 begins
  EXPECT_EQ(std::vector<int64_t>(second.input_ids.begin(), second.input_ids.begin() + 3),
            std::vector<int64_t>(ids.begin() + 4, ids.end()));
  int64_t epoch1_first = EpochPermutation(2, 0, 1)[0];
  EXPECT_EQ(second.input_ids[3], docs[epoch1_first].input_ids[0]);
  EXPECT_EQ(second.labels[3], -100);
  EXPECT_EQ(sampler.SequencesPerEpoch(), 1);
}

TEST(SequenceSampler, UnpackedTruncatesEachDocument) {
  TokenDataset data = Dataset("{\"input_ids\": [1, 2, 3, 4, 5]}\n{\"input_ids\": [6, 7]}\n");
  SequenceSampler sampler(&data, 3, /*pack=*/false, /*seed=*/3);
  std::vector<int64_t> order = EpochPermutation(2, 3, 0);
  for (int64_t d : order) {
    Sequence s = sampler.Next();
    const std::vector<int64_t>& doc = data.documents()[d].input_ids;
    EXPECT_EQ(s.input_ids,
              std::vector<int64_t>(doc.begin(), doc.begin() + std::min<size_t>(3, doc.size())));
    EXPECT_EQ(s.labels, s.input_ids);
  }
  EXPECT_EQ(sampler.SequencesPerEpoch(), 2);
}

// Text, chat and instruction records, tokenised with the synthetic tokenizers.

struct TextSetup {
  TempDir dir;
  ModelConfig config;
  std::optional<Tokenizer> tokenizer;

  explicit TextSetup(TokenizerFlavor flavor) {
    absl::StatusOr<SyntheticTokenizer> made = MakeSyntheticTokenizer({flavor, 576});
    EXPECT_TRUE(made.ok()) << made.status();
    dir.Write("tokenizer.json", made->json);
    config.vocab_size = 576;
    config.eos_token_ids = made->eos_token_ids;
    absl::StatusOr<Tokenizer> loaded = Tokenizer::Parse(made->json, "tokenizer.json");
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    tokenizer = *std::move(loaded);
  }
  int64_t Id(absl::string_view token) const { return *tokenizer->TokenId(token); }
  std::vector<int64_t> Encode(absl::string_view text, bool special = false) const {
    return *tokenizer->Encode(text, special);
  }
  absl::StatusOr<TokenDataset> Load(const std::string& jsonl) {
    TextRecordEncoder encoder(dir.path(), config);
    return TokenDataset::Load(dir.Write("d.jsonl", jsonl), "data.train", config.vocab_size,
                              &encoder);
  }
  Document LoadOne(const std::string& record) {
    absl::StatusOr<TokenDataset> data = Load(record + "\n");
    EXPECT_TRUE(data.ok()) << data.status();
    return data.ok() ? data->documents().at(0) : Document();
  }
};

// Concatenates pieces of ids, marking each as target or not.
struct Expected {
  std::vector<int64_t> ids;
  std::vector<int64_t> labels;
  Expected& Add(const std::vector<int64_t>& piece, bool target) {
    for (int64_t id : piece) {
      ids.push_back(id);
      labels.push_back(target ? id : kIgnoreLabel);
    }
    return *this;
  }
};

TEST(TextRecords, TextIsTheEncodingThenEos) {
  TextSetup llama3(TokenizerFlavor::kLlama3);
  const int64_t bos = llama3.Id("<|begin_of_text|>");
  const int64_t eos = llama3.Id("<|end_of_text|>");
  ASSERT_THAT(llama3.config.eos_token_ids, ElementsAre(eos));
  Document doc = llama3.LoadOne(R"({"text": "The lathe turns. Grüße!"})");
  std::vector<int64_t> want = {bos};
  for (int64_t id : llama3.Encode("The lathe turns. Grüße!")) want.push_back(id);
  want.push_back(eos);
  EXPECT_EQ(doc.input_ids, want);
  EXPECT_EQ(doc.labels, want);  // every position is a target
  // No second eos when the text already ends with it; none at all when config.json names none.
  doc = llama3.LoadOne(R"({"text": "done<|end_of_text|>"})");
  EXPECT_EQ(doc.input_ids.back(), eos);
  EXPECT_NE(doc.input_ids[doc.input_ids.size() - 2], eos);
  llama3.config.eos_token_ids.clear();
  doc = llama3.LoadOne(R"({"text": "done"})");
  EXPECT_EQ(doc.input_ids, llama3.Encode("done", true));

  TextSetup qwen2(TokenizerFlavor::kQwen2);  // no BOS; eos <|endoftext|>
  doc = qwen2.LoadOne(R"({"text": "hi"})");
  std::vector<int64_t> qwen_want = qwen2.Encode("hi");
  qwen_want.push_back(qwen2.Id("<|endoftext|>"));
  EXPECT_EQ(doc.input_ids, qwen_want);
}

TEST(TextRecords, ChatMlTrainsOnlyAssistantContentAndItsEnd) {
  TextSetup qwen2(TokenizerFlavor::kQwen2);
  const std::vector<int64_t> start = {qwen2.Id("<|im_start|>")};
  const std::vector<int64_t> end = {qwen2.Id("<|im_end|>")};
  const std::vector<int64_t> newline = qwen2.Encode("\n");
  Document doc = qwen2.LoadOne(
      R"({"messages": [{"role": "system", "content": "Be brief."},)"
      R"( {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},)"
      R"( {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "Sure."}]})");
  Expected want;
  want.Add(start, false).Add(qwen2.Encode("system\nBe brief."), false).Add(end, false);
  want.Add(newline, false);
  want.Add(start, false).Add(qwen2.Encode("user\nHi"), false).Add(end, false);
  want.Add(newline, false);
  want.Add(start, false).Add(qwen2.Encode("assistant\n"), false);
  want.Add(qwen2.Encode("Hello!"), true).Add(end, true).Add(newline, false);
  want.Add(start, false).Add(qwen2.Encode("user\nAgain?"), false).Add(end, false);
  want.Add(newline, false);
  want.Add(start, false).Add(qwen2.Encode("assistant\n"), false);
  want.Add(qwen2.Encode("Sure."), true).Add(end, true).Add(newline, false);
  EXPECT_EQ(doc.input_ids, want.ids);
  EXPECT_EQ(doc.labels, want.labels);
  // The ids are those of the rendered template, tokenised whole.
  EXPECT_EQ(doc.input_ids,
            qwen2.Encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                         "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nAgain?"
                         "<|im_end|>\n<|im_start|>assistant\nSure.<|im_end|>\n"));
}

TEST(TextRecords, Llama3TrainsOnlyAssistantContentAndEotAndTrimsContent) {
  TextSetup llama3(TokenizerFlavor::kLlama3);
  const std::vector<int64_t> bos = {llama3.Id("<|begin_of_text|>")};
  const std::vector<int64_t> header_start = {llama3.Id("<|start_header_id|>")};
  const std::vector<int64_t> header_end = {llama3.Id("<|end_header_id|>")};
  const std::vector<int64_t> eot = {llama3.Id("<|eot_id|>")};
  Document doc = llama3.LoadOne(R"({"messages": [{"role": "user", "content": "  Hi there \n"},)"
                                R"( {"role": "assistant", "content": "Hello!\n"}]})");
  Expected want;
  want.Add(bos, false);
  want.Add(header_start, false).Add(llama3.Encode("user"), false).Add(header_end, false);
  want.Add(llama3.Encode("\n\nHi there"), false).Add(eot, false);
  want.Add(header_start, false).Add(llama3.Encode("assistant"), false).Add(header_end, false);
  want.Add(llama3.Encode("\n\n"), false).Add(llama3.Encode("Hello!"), true).Add(eot, true);
  EXPECT_EQ(doc.input_ids, want.ids);
  EXPECT_EQ(doc.labels, want.labels);
  EXPECT_EQ(doc.input_ids,
            llama3.Encode("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there"
                          "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!"
                          "<|eot_id|>"));
}

TEST(TextRecords, InstructionsAreAUserAndAnAssistantTurn) {
  TextSetup qwen2(TokenizerFlavor::kQwen2);
  Document chat =
      qwen2.LoadOne(R"({"messages": [{"role": "user", "content": "Translate.\n\nGuten Tag"},)"
                    R"( {"role": "assistant", "content": "Good day"}]})");
  Document instruction =
      qwen2.LoadOne(R"({"instruction": "Translate.", "input": "Guten Tag", "output": "Good day"})");
  EXPECT_EQ(instruction.input_ids, chat.input_ids);
  EXPECT_EQ(instruction.labels, chat.labels);
  Document no_input = qwen2.LoadOne(R"({"instruction": "Say hi.", "input": "", "output": "Hi"})");
  Document null_input =
      qwen2.LoadOne(R"({"instruction": "Say hi.", "input": null, "output": "Hi"})");
  Document same_chat = qwen2.LoadOne(R"({"messages": [{"role": "user", "content": "Say hi."},)"
                                     R"( {"role": "assistant", "content": "Hi"}]})");
  EXPECT_EQ(no_input.input_ids, same_chat.input_ids);
  EXPECT_EQ(null_input.input_ids, same_chat.input_ids);
}

TEST(TextRecords, InstructionsWithoutAChatFormatUseTheAlpacaPrompt) {
  TextSetup gpt2(TokenizerFlavor::kGpt2);
  const int64_t eos = gpt2.Id("<|endoftext|>");
  Document doc = gpt2.LoadOne(R"({"instruction": "Add 2 and 3.", "output": "5"})");
  Expected want;
  want.Add(gpt2.Encode("Below is an instruction that describes a task. Write a response that "
                       "appropriately completes the request.\n\n### Instruction:\nAdd 2 and 3."
                       "\n\n### Response:\n"),
           false);
  want.Add(gpt2.Encode("5"), true).Add({eos}, true);
  EXPECT_EQ(doc.input_ids, want.ids);
  EXPECT_EQ(doc.labels, want.labels);

  doc = gpt2.LoadOne(R"({"instruction": "Sum.", "input": "2 3", "output": "5"})");
  want = Expected();
  want.Add(gpt2.Encode("Below is an instruction that describes a task, paired with an input that "
                       "provides further context. Write a response that appropriately completes "
                       "the request.\n\n### Instruction:\nSum.\n\n### Input:\n2 3\n\n"
                       "### Response:\n"),
           false);
  want.Add(gpt2.Encode("5"), true).Add({eos}, true);
  EXPECT_EQ(doc.input_ids, want.ids);
  EXPECT_EQ(doc.labels, want.labels);

  gpt2.config.eos_token_ids.clear();
  EXPECT_THAT(gpt2.Load(R"({"instruction": "Sum.", "output": "5"})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "line 1: instruction records need an eos_token_id in config.json"));
}

TEST(TextRecords, KindsMixInOneFile) {
  TextSetup qwen2(TokenizerFlavor::kQwen2);
  absl::StatusOr<TokenDataset> data = qwen2.Load(
      "{\"input_ids\": [1, 2, 3], \"labels\": [-100, 2, 3]}\n"
      "{\"text\": \"plain text\", \"source\": \"ignored\"}\n\n"
      "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, "
      "{\"role\": \"assistant\", \"content\": \"Hello\"}]}\n"
      "{\"instruction\": \"Say hi.\", \"output\": \"Hi\"}\n");
  ASSERT_TRUE(data.ok()) << data.status();
  ASSERT_EQ(data->documents().size(), 4u);
  EXPECT_THAT(data->documents()[0].labels, ElementsAre(-100, 2, 3));
  EXPECT_EQ(data->documents()[1].labels, data->documents()[1].input_ids);
  int64_t total = 0;
  for (const Document& doc : data->documents()) total += doc.input_ids.size();
  EXPECT_EQ(data->total_tokens(), total);
}

TEST(TextRecords, RejectsBadRecordsNamingFileAndLine) {
  TextSetup qwen2(TokenizerFlavor::kQwen2);
  const std::string path = qwen2.dir.Path("d.jsonl");
  struct Case {
    std::string record;
    std::string message;  // after "data.train: <path>: line 2: "
  } cases[] = {
      {R"({"text": 5})", "text is not a string"},
      {R"({"text": ""})", "text is empty"},
      {R"({"text": "a", "labels": [1]})", R"("labels" go with "input_ids" only, not with "text")"},
      {R"({"text": "a", "input_ids": [1]})",
       R"(has both "input_ids" and "text"; give one per record)"},
      {R"({"messages": []})", "messages is empty"},
      {R"({"messages": "hi"})", "messages is not a list"},
      {R"({"messages": ["hi"]})", "messages[0] is not an object"},
      {R"({"messages": [{"role": "user"}]})", R"(messages[0] has no "content")"},
      {R"({"messages": [{"content": "x"}]})", R"(messages[0] has no "role")"},
      {R"({"messages": [{"role": "user", "content": 3}]})", "messages[0].content is not a string"},
      {R"({"messages": [{"role": "tool", "content": "x"}]})",
       R"(messages[0].role: "tool" is not one of system, user, assistant)"},
      {R"({"messages": [{"role": "user", "content": "x", "name": "bob"}]})",
       R"(messages[0]: unknown field "name" (only role and content))"},
      {R"({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]})",
       "messages has no assistant turn, so nothing to train on"},
      {R"({"instruction": 1, "output": "x"})", "instruction is not a string"},
      {R"({"instruction": "x"})", R"(no "output")"},
      {R"({"instruction": "x", "input": 2, "output": "y"})", "input is not a string"},
      {R"({"labels": [1]})", R"(no "input_ids", "text", "messages" or "instruction")"},
      {"{\"text\": \"bad \xC3\x28\"}", "invalid UTF-8 at byte 14"},
  };
  for (const Case& c : cases) {
    absl::Status status = qwen2.Load("{\"input_ids\": [1]}\n" + c.record + "\n").status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.record;
    EXPECT_EQ(status.message(), absl::StrCat("data.train: ", path, ": line 2: ", c.message));
  }
}

TEST(TextRecords, NeedTheModelsTokenizer) {
  TextSetup gpt2(TokenizerFlavor::kGpt2);
  const std::string path = gpt2.dir.Path("d.jsonl");
  // A chat format is needed for chat records.
  EXPECT_THAT(gpt2.Load(R"({"messages": [{"role": "assistant", "content": "x"}]})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       absl::StrCat("data.train: ", path,
                                    ": line 1: chat records need a chat "
                                    "format, but ",
                                    gpt2.dir.Path("tokenizer.json"),
                                    " has the special tokens of neither ChatML")));
  // The model's vocabulary must hold every id of the tokenizer.
  gpt2.config.vocab_size = 300;
  EXPECT_THAT(gpt2.Load(R"({"text": "x"})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       absl::StrCat("line 1: ", gpt2.dir.Path("tokenizer.json"),
                                    " has 576 token ids, more than the model's vocab_size 300")));
  // Without tokenizer.json, token ids still load and text does not.
  std::filesystem::remove(gpt2.dir.Path("tokenizer.json"));
  gpt2.config.vocab_size = 576;
  EXPECT_TRUE(gpt2.Load("{\"input_ids\": [1, 2]}\n").ok());
  EXPECT_EQ(gpt2.Load("{\"input_ids\": [1, 2]}\n\n{\"text\": \"x\"}\n").status().message(),
            absl::StrCat("data.train: ", path, ": line 3: text records need ",
                         gpt2.dir.Path("tokenizer.json"), ", which does not exist"));
  EXPECT_THAT(gpt2.Load(R"({"instruction": "x", "output": "y"})"),
              StatusIs(absl::StatusCode::kInvalidArgument, "line 1: instruction records need "));
  // A tokenizer.json that Lathe cannot read: its own error, after the line.
  gpt2.dir.Write("tokenizer.json", "{\"model\": {\"type\": \"Unigram\"}}");
  EXPECT_THAT(gpt2.Load(R"({"text": "x"})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       absl::StrCat("line 1: ", gpt2.dir.Path("tokenizer.json"))));
}

}  // namespace
}  // namespace lathe
