// CheckDataFile: the bounded check of a data file's first lines at submit (issue #32).
#include "common/data_check.h"

#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace lathe {
namespace {

using testing::StatusIs;
using testing::TempDir;

constexpr int64_t kVocab = 64;

class DataCheckTest : public ::testing::Test {
 protected:
  DataCheckTest() { std::filesystem::create_directories(dir_.Path("model")); }

  absl::Status Check(const std::string& contents, DataCheckLimits limits = {}) {
    const std::string path = dir_.Write("d.jsonl", contents);
    return CheckDataFile(path, "data.train", kVocab, dir_.Path("model"), limits);
  }
  // The message for a bad line `line`.
  std::string At(int line, const std::string& what) {
    return absl::StrCat("data.train: ", dir_.Path("d.jsonl"), ": line ", line, ": ", what);
  }

  TempDir dir_;
};

TEST_F(DataCheckTest, GoodRecordsOfEveryKindPass) {
  dir_.Write("model/tokenizer.json", "{}");
  EXPECT_TRUE(Check("{\"input_ids\": [0, 1, 63]}\n"
                    "\n"
                    "{\"input_ids\": [5, 6], \"labels\": [-100, 6], \"id\": \"x\"}\n"
                    "{\"text\": \"hello\"}\n"
                    "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, "
                    "{\"role\": \"assistant\", \"content\": \"b\"}]}\n"
                    "{\"instruction\": \"a\", \"input\": null, \"output\": \"b\"}")
                  .ok());
}

TEST_F(DataCheckTest, BadLinesAreRefusedNamingTheLine) {
  EXPECT_THAT(Check("{\"input_ids\": [1]}\n{\"input_ids\": [1,\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, At(2, "not valid JSON")));
  EXPECT_THAT(Check("{\"input_ids\": [1]}\n\n{\"input_ids\": [1, 2, 3, 64]}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       At(3,
                          "input_ids[3]: token id 64 is outside the vocabulary (vocab_size "
                          "64)")));
  EXPECT_THAT(Check("{\"input_ids\": [-1]}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, std::string("token id -1")));
  EXPECT_THAT(
      Check("{\"input_ids\": [1.5]}\n"),
      StatusIs(absl::StatusCode::kInvalidArgument, At(1, "input_ids[0] is not an integer: 1.5")));
  EXPECT_THAT(Check("{\"input_ids\": []}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, At(1, "input_ids is empty")));
  EXPECT_THAT(Check("{\"input_ids\": [1, 2], \"labels\": [1]}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       At(1, "labels has 1 entries but input_ids has 2")));
  EXPECT_THAT(Check("{\"input_ids\": [1, 2], \"labels\": [1, 99]}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       At(1, "labels[1]: 99 is neither -100 nor a token id below 64")));
  EXPECT_THAT(Check("[1, 2]\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, At(1, "not a JSON object")));
  EXPECT_THAT(Check("{\"ids\": [1]}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, std::string("no \"input_ids\"")));
  EXPECT_THAT(Check("{\"input_ids\": [1], \"text\": \"a\"}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       std::string("has both \"input_ids\" and \"text\"")));
  EXPECT_THAT(Check("{\"text\": \"\\u00e9\xff\"}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, At(1, "invalid UTF-8 at byte 16")));
  EXPECT_THAT(Check("\n \n"),
              StatusIs(absl::StatusCode::kInvalidArgument, std::string("the data set is empty")));
}

TEST_F(DataCheckTest, TextRecordsAreCheckedForShapeAndATokenizerFile) {
  EXPECT_THAT(Check("{\"text\": \"hello\"}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       At(1, absl::StrCat("text records need ", dir_.Path("model"),
                                          "/tokenizer.json, which does not exist"))));
  dir_.Write("model/tokenizer.json", "{}");
  EXPECT_THAT(Check("{\"text\": \"\"}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, At(1, "text is empty")));
  EXPECT_THAT(Check("{\"text\": \"a\", \"labels\": [1]}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       std::string("\"labels\" go with \"input_ids\" only")));
  EXPECT_THAT(Check("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, std::string("no assistant turn")));
  EXPECT_THAT(Check("{\"messages\": [{\"role\": \"bot\", \"content\": \"a\"}]}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       std::string("messages[0].role: \"bot\" is not one of")));
  EXPECT_THAT(Check("{\"instruction\": \"a\"}\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, At(1, "no \"output\"")));
}

TEST_F(DataCheckTest, TheLineBoundIsRespected) {
  std::string lines;
  for (int i = 0; i < 10; ++i) lines += "{\"input_ids\": [1, 2]}\n";
  const std::string bad = "{\"input_ids\": [1, 64]}\n";
  EXPECT_THAT(Check(lines + bad, {.max_lines = 11}),
              StatusIs(absl::StatusCode::kInvalidArgument, std::string(": line 11: ")));
  EXPECT_TRUE(Check(lines + bad, {.max_lines = 10}).ok());
  EXPECT_TRUE(Check(lines + "not json\n", {.max_lines = 10}).ok());
  // The default: 1000 lines.
  std::string many;
  for (int i = 0; i < 1000; ++i) many += "{\"input_ids\": [1, 2]}\n";
  EXPECT_TRUE(Check(many + bad).ok());
  EXPECT_THAT(Check(many.substr(22) + bad),
              StatusIs(absl::StatusCode::kInvalidArgument, std::string(": line 1000: ")));
}

TEST_F(DataCheckTest, TheByteBoundIsRespectedAndACutLineIsNotChecked) {
  const std::string good = "{\"input_ids\": [1, 2]}\n";  // 22 bytes
  const std::string bad = "{\"input_ids\": [1, 64]}\n";
  // The bad line ends at byte 45: inside a 45-byte bound, cut by a 44-byte one.
  EXPECT_THAT(Check(good + bad, {.max_bytes = 45}),
              StatusIs(absl::StatusCode::kInvalidArgument, std::string(": line 2: ")));
  EXPECT_TRUE(Check(good + bad, {.max_bytes = 44}).ok());
  EXPECT_TRUE(Check(good + good + bad, {.max_bytes = 44}).ok());
  // A first line longer than the bound leaves nothing checked, and is not "empty".
  EXPECT_TRUE(Check(bad, {.max_bytes = 10}).ok());
  // A last line without a newline is checked when the file ends inside the bound.
  EXPECT_THAT(Check(good + "{\"input_ids\": [64]}", {.max_bytes = 100}),
              StatusIs(absl::StatusCode::kInvalidArgument, std::string(": line 2: ")));
}

TEST_F(DataCheckTest, AMissingFileIsNotFound) {
  EXPECT_THAT(CheckDataFile(dir_.Path("nope.jsonl"), "data.eval", kVocab, dir_.Path("model")),
              StatusIs(absl::StatusCode::kNotFound, std::string("data.eval: ")));
}

}  // namespace
}  // namespace lathe
