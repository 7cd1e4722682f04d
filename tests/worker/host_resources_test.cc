#include "worker/agent/host_resources.h"

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/agent/fake_process_launcher.h"

namespace lathe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(HostResourcesTest, ParsesMemTotal) {
  absl::StatusOr<uint64_t> bytes =
      ParseMemTotalBytes("MemFree:  100 kB\nMemTotal:       16318412 kB\nSwapTotal: 0 kB\n");
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, 16318412ull * 1024);
  EXPECT_EQ(ParseMemTotalBytes("MemFree: 1 kB\n").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ParseMemTotalBytes("MemTotal: lots\n").status().message(), HasSubstr("lots"));
}

TEST(HostResourcesTest, ReadsThisHostsMemory) {
  absl::StatusOr<uint64_t> bytes = HostMemoryBytes();
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_GT(*bytes, 0u);
}

TEST(HostResourcesTest, ParsesNvidiaSmi) {
  absl::StatusOr<std::vector<GpuInfo>> gpus = ParseNvidiaSmiGpus(
      "0, GPU-aaaa, NVIDIA H200, 143771, 0\n"
      "1, GPU-bbbb, NVIDIA H200, 143771, 60241\n");
  ASSERT_TRUE(gpus.ok()) << gpus.status();
  ASSERT_EQ(gpus->size(), 2u);
  EXPECT_EQ((*gpus)[1].index, 1);
  EXPECT_EQ((*gpus)[1].uuid, "GPU-bbbb");
  EXPECT_EQ((*gpus)[1].name, "NVIDIA H200");
  EXPECT_EQ((*gpus)[1].memory_bytes, 143771ull << 20);
  EXPECT_EQ((*gpus)[1].memory_used_bytes, 60241ull << 20);
  for (const char* bad_csv : {"NVIDIA-SMI has failed\n", "0, GPU-aaaa, NVIDIA H200, 143771\n",
                              "0, GPU-aaaa, NVIDIA H200, 143771, [N/A]\n"}) {
    absl::Status bad = ParseNvidiaSmiGpus(bad_csv).status();
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad_csv;
    EXPECT_THAT(bad.message(), HasSubstr(absl::StripAsciiWhitespace(bad_csv))) << bad_csv;
  }
}

// Plays nvidia-smi for the launcher's `n`-th launch (0-based), on its own thread: prints
// `csv` and exits with `code`.
std::thread AnswerNvidiaSmi(FakeProcessLauncher& launcher, int n, std::string csv, int code) {
  return std::thread([&launcher, n, csv = std::move(csv), code] {
    ASSERT_TRUE(launcher.WaitForLaunches(n + 1, absl::Seconds(10)));
    std::shared_ptr<FakeProcess> child = launcher.process(n);
    EXPECT_EQ(child->options().argv[0], "nvidia-smi");
    for (absl::string_view line : absl::StrSplit(csv, '\n', absl::SkipEmpty())) {
      child->EmitStdout(line);
    }
    child->Exit(ExitStatus::Exited(code));
  });
}

TEST(HostResourcesTest, ProbesEachSlotsGpuMemoryInUseAtMostOncePerMaxAge) {
  FakeProcessLauncher launcher;
  FakeClock clock;
  GpuMemoryProbe probe(&launcher, {"GPU-bbbb", "0", "7"}, &clock, absl::Seconds(5));
  std::thread answer = AnswerNvidiaSmi(
      launcher, 0, "0, GPU-aaaa, NVIDIA H200, 143771, 10\n1, GPU-bbbb, NVIDIA H200, 143771, 20\n",
      0);
  EXPECT_THAT(probe.UsedBytes(), ElementsAre(20ull << 20, 10ull << 20, std::nullopt));
  answer.join();
  clock.Advance(absl::Seconds(4));  // still fresh: no second nvidia-smi
  EXPECT_THAT(probe.UsedBytes(), ElementsAre(20ull << 20, 10ull << 20, std::nullopt));
  EXPECT_EQ(launcher.launch_count(), 1);

  clock.Advance(absl::Seconds(1));  // failing nvidia-smi: nothing known
  answer = AnswerNvidiaSmi(launcher, 1, "", 9);
  EXPECT_THAT(probe.UsedBytes(), ElementsAre(std::nullopt, std::nullopt, std::nullopt));
  answer.join();
  clock.Advance(absl::Seconds(5));  // missing nvidia-smi likewise
  launcher.FailNextLaunch(absl::NotFoundError("nvidia-smi: not found"));
  EXPECT_THAT(probe.UsedBytes(), ElementsAre(std::nullopt, std::nullopt, std::nullopt));
  clock.Advance(absl::Seconds(5));  // and back
  answer = AnswerNvidiaSmi(launcher, 2, "0, GPU-aaaa, NVIDIA H200, 143771, 30\n", 0);
  EXPECT_THAT(probe.UsedBytes(), ElementsAre(std::nullopt, 30ull << 20, std::nullopt));
  answer.join();
}

TEST(HostResourcesTest, SlotsFollowCudaVisibleDevices) {
  EXPECT_THAT(*SlotCudaDevices("", 2), ElementsAre("0", "1"));
  EXPECT_THAT(*SlotCudaDevices("3, 5,7", 2), ElementsAre("3", "5"));
  EXPECT_THAT(*SlotCudaDevices("GPU-bbbb", 1), ElementsAre("GPU-bbbb"));
  absl::Status short_list = SlotCudaDevices("3", 2).status();
  EXPECT_EQ(short_list.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_list.message(), HasSubstr("names only 1"));
}

// Issue #29: a cuda agent without --slots offers each GPU it may use as a slot.
TEST(HostResourcesTest, ACudaAgentHasASlotPerGpuByDefault) {
  const std::vector<GpuInfo> eight(8);
  EXPECT_EQ(DefaultCudaSlots("", eight), 8);
  EXPECT_EQ(DefaultCudaSlots("2, 5", eight), 2);  // CUDA_VISIBLE_DEVICES narrows them
  EXPECT_EQ(DefaultCudaSlots("GPU-aaaa", {}), 1);
  EXPECT_EQ(DefaultCudaSlots("", {}), 1);  // nvidia-smi failed: one, as before
}

TEST(HostResourcesTest, DescribesSlotDevices) {
  std::vector<GpuInfo> gpus = {{0, "GPU-aaaa", "NVIDIA A100", 80ull << 30},
                               {1, "GPU-bbbb", "NVIDIA H200", 141ull << 30}};
  std::vector<v1::DeviceInfo> cuda = SlotDevices(v1::DEVICE_CUDA, 2, {"GPU-bbbb", "7"}, gpus, 0);
  ASSERT_EQ(cuda.size(), 2u);
  EXPECT_EQ(cuda[0].index(), 0);
  EXPECT_EQ(cuda[0].name(), "NVIDIA H200");
  EXPECT_EQ(cuda[0].memory_bytes(), 141ull << 30);
  EXPECT_EQ(cuda[1].name(), "cuda");  // GPU 7 unknown to nvidia-smi
  EXPECT_EQ(cuda[1].memory_bytes(), 0u);

  std::vector<v1::DeviceInfo> cpu = SlotDevices(v1::DEVICE_CPU, 4, {}, {}, 64ull << 30);
  ASSERT_EQ(cpu.size(), 4u);
  EXPECT_EQ(cpu[3].index(), 3);
  EXPECT_EQ(cpu[3].name(), "cpu");
  EXPECT_EQ(cpu[3].memory_bytes(), 16ull << 30);
}

}  // namespace
}  // namespace lathe
