#include "worker/agent/host_resources.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

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
  absl::StatusOr<std::vector<GpuInfo>> gpus =
      ParseNvidiaSmiGpus("0, GPU-aaaa, NVIDIA H200, 143771\n1, GPU-bbbb, NVIDIA H200, 143771\n");
  ASSERT_TRUE(gpus.ok()) << gpus.status();
  ASSERT_EQ(gpus->size(), 2u);
  EXPECT_EQ((*gpus)[1].index, 1);
  EXPECT_EQ((*gpus)[1].uuid, "GPU-bbbb");
  EXPECT_EQ((*gpus)[1].name, "NVIDIA H200");
  EXPECT_EQ((*gpus)[1].memory_bytes, 143771ull << 20);
  absl::Status bad = ParseNvidiaSmiGpus("NVIDIA-SMI has failed\n").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("NVIDIA-SMI has failed"));
}

TEST(HostResourcesTest, SlotsFollowCudaVisibleDevices) {
  EXPECT_THAT(*SlotCudaDevices("", 2), ElementsAre("0", "1"));
  EXPECT_THAT(*SlotCudaDevices("3, 5,7", 2), ElementsAre("3", "5"));
  EXPECT_THAT(*SlotCudaDevices("GPU-bbbb", 1), ElementsAre("GPU-bbbb"));
  absl::Status short_list = SlotCudaDevices("3", 2).status();
  EXPECT_EQ(short_list.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_list.message(), HasSubstr("names only 1"));
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
