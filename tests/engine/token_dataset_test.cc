#include "worker/engine/token_dataset.h"

#include <algorithm>
#include <numeric>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace lathe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
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

TEST(AutoMicroBatch, LargestDivisorWithinTokenBudget) {
  EXPECT_EQ(AutoMicroBatch(64, 1024), 8);
  EXPECT_EQ(AutoMicroBatch(12, 1024), 6);
  EXPECT_EQ(AutoMicroBatch(7, 4096), 1);
  EXPECT_EQ(AutoMicroBatch(4, 32), 4);
  EXPECT_EQ(AutoMicroBatch(1, 100000), 1);
}

}  // namespace
}  // namespace lathe
