// The Communicator contract (worker/comm/communicator.h), run against every backend: the
// fake in-process group and gloo over a MemoryKvStore on 127.0.0.1, for groups of 1 to 4
// ranks (threads). Built with LATHE_CONTRACT_CUDA (the gpu-labelled cuda_contract_test) it
// runs against the backends of device memory instead, through host-staging adapters: NCCL,
// one GPU per rank (a group larger than the GPUs the machine has is skipped); the CUDA
// single-rank communicator; and the fake group staged through pinned host memory
// (cuda_communicator.h), every rank on GPU 0.
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/comm/comm_test_util.h"
#include "tests/testing/status_matchers.h"
#include "worker/comm/communicator.h"
#include "worker/comm/fake_communicator.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/memory_kv_store.h"
#ifdef LATHE_CONTRACT_CUDA
#include <cuda_runtime_api.h>

#include "tests/comm/host_staged_communicator.h"
#include "worker/comm/cuda_communicator.h"
#include "worker/comm/nccl_communicator.h"
#endif

namespace lathe {
namespace {

using ::lathe::testing::ConnectGlooRanks;
using ::lathe::testing::RunRanks;
using ::lathe::testing::StatusIs;

using Group = std::vector<std::unique_ptr<Communicator>>;

struct Backend {
  std::string name;
  // A group of world_size ranks whose calls give up after `timeout`.
  std::function<Group(int world_size, absl::Duration timeout)> make;
  // Why a group of world_size cannot be made on this machine; empty when it can.
  std::function<std::string(int world_size)> unavailable = [](int) { return std::string(); };
};

struct ContractParam {
  Backend backend;
  int world_size;
};

std::string ParamName(const ::testing::TestParamInfo<ContractParam>& info) {
  return absl::StrCat(info.param.backend.name, "_", info.param.world_size, "ranks");
}

class CommunicatorContractTest : public ::testing::TestWithParam<ContractParam> {
 protected:
  void SetUp() override {
    const std::string unavailable = GetParam().backend.unavailable(world_size());
    if (!unavailable.empty()) GTEST_SKIP() << unavailable;
    group_ = GetParam().backend.make(world_size(), lathe::testing::kWaitLimit);
    ASSERT_EQ(group_.size(), static_cast<size_t>(world_size()));
  }

  int world_size() const { return GetParam().world_size; }
  Communicator& comm(int rank) { return *group_[rank]; }

  // Runs fn(rank, communicator) on every rank at once.
  void OnEveryRank(const std::function<void(int, Communicator&)>& fn) {
    RunRanks(world_size(), [&](int rank) { fn(rank, comm(rank)); });
  }

  Group group_;
};

TEST_P(CommunicatorContractTest, KnowsItsRankAndWorldSize) {
  for (int r = 0; r < world_size(); ++r) {
    EXPECT_EQ(comm(r).rank(), r);
    EXPECT_EQ(comm(r).world_size(), world_size());
  }
}

// Inputs are integer-valued (or halves) and small, so every summation order is exact.
TEST_P(CommunicatorContractTest, AllReduceSumsFloat32) {
  const int n = world_size();
  for (size_t count : {size_t{1}, size_t{7}, size_t{1000003}}) {
    OnEveryRank([&](int rank, Communicator& c) {
      std::vector<float> data(count);
      for (size_t i = 0; i < count; ++i) data[i] = static_cast<float>((rank + 1) * (i % 251));
      ASSERT_TRUE(c.AllReduceSum(data.data(), count, CommDType::kFloat32).ok());
      const float ranks_sum = static_cast<float>(n * (n + 1) / 2);
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(data[i], ranks_sum * static_cast<float>(i % 251))
            << "count " << count << " i " << i;
      }
    });
  }
}

TEST_P(CommunicatorContractTest, AllReduceSumsFloat64) {
  const int n = world_size();
  for (size_t count : {size_t{1}, size_t{7}, size_t{1000003}}) {
    OnEveryRank([&](int rank, Communicator& c) {
      std::vector<double> data(count);
      for (size_t i = 0; i < count; ++i) {
        data[i] = (rank + 0.5) * static_cast<double>(i % 1009) - static_cast<double>(i);
      }
      ASSERT_TRUE(c.AllReduceSum(data.data(), count, CommDType::kFloat64).ok());
      for (size_t i = 0; i < count; ++i) {
        const double expected = (n * (n - 1) / 2.0 + 0.5 * n) * static_cast<double>(i % 1009) -
                                n * static_cast<double>(i);
        ASSERT_EQ(data[i], expected) << "count " << count << " i " << i;
      }
    });
  }
}

TEST_P(CommunicatorContractTest, AllReduceSumsInt64BeyondThirtyTwoBits) {
  const int n = world_size();
  for (size_t count : {size_t{1}, size_t{7}, size_t{1000003}}) {
    OnEveryRank([&](int rank, Communicator& c) {
      std::vector<int64_t> data(count);
      for (size_t i = 0; i < count; ++i) {
        data[i] = (int64_t{rank + 1} << 40) - static_cast<int64_t>(i) * (rank + 1) - 7;
      }
      ASSERT_TRUE(c.AllReduceSum(data.data(), count, CommDType::kInt64).ok());
      const int64_t ranks_sum = int64_t{n} * (n + 1) / 2;
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(data[i], (ranks_sum << 40) - static_cast<int64_t>(i) * ranks_sum - 7 * n)
            << "count " << count << " i " << i;
      }
    });
  }
}

TEST_P(CommunicatorContractTest, EmptyCallsReturnAtOnce) {
  // Each rank alone: an empty call must not wait for the others.
  for (int r = 0; r < world_size(); ++r) {
    EXPECT_TRUE(comm(r).AllReduceSum(nullptr, 0, CommDType::kFloat32).ok());
    EXPECT_TRUE(comm(r).Broadcast(nullptr, 0, 0).ok());
    EXPECT_TRUE(comm(r).AllGather(nullptr, nullptr, 0).ok());
  }
}

TEST_P(CommunicatorContractTest, BroadcastsFromEveryRoot) {
  auto pattern = [](size_t i, int root) { return static_cast<uint8_t>(i * 31 + root * 7 + 1); };
  for (size_t bytes : {size_t{1}, size_t{7}, size_t{1000003}}) {
    for (int root = 0; root < world_size(); ++root) {
      OnEveryRank([&](int rank, Communicator& c) {
        std::vector<uint8_t> data(bytes, 0xEE);
        if (rank == root) {
          for (size_t i = 0; i < bytes; ++i) data[i] = pattern(i, root);
        }
        ASSERT_TRUE(c.Broadcast(data.data(), bytes, root).ok());
        for (size_t i = 0; i < bytes; ++i) {
          ASSERT_EQ(data[i], pattern(i, root)) << "bytes " << bytes << " root " << root;
        }
      });
    }
  }
}

TEST_P(CommunicatorContractTest, AllGathersInRankOrder) {
  const int n = world_size();
  auto pattern = [](size_t i, int rank) { return static_cast<uint8_t>(i * 13 + rank * 101 + 3); };
  for (size_t bytes : {size_t{1}, size_t{7}, size_t{1000003}}) {
    OnEveryRank([&](int rank, Communicator& c) {
      std::vector<uint8_t> in(bytes);
      for (size_t i = 0; i < bytes; ++i) in[i] = pattern(i, rank);
      std::vector<uint8_t> out(bytes * n, 0xEE);
      ASSERT_TRUE(c.AllGather(in.data(), out.data(), bytes).ok());
      for (int r = 0; r < n; ++r) {
        for (size_t i = 0; i < bytes; ++i) {
          ASSERT_EQ(out[r * bytes + i], pattern(i, r)) << "bytes " << bytes << " from rank " << r;
        }
      }
    });
  }
}

TEST_P(CommunicatorContractTest, AllGathersInPlace) {
  const int n = world_size();
  const size_t bytes = 7;
  OnEveryRank([&](int rank, Communicator& c) {
    std::vector<uint8_t> out(bytes * n, 0xEE);
    for (size_t i = 0; i < bytes; ++i) out[rank * bytes + i] = static_cast<uint8_t>(rank * 10 + i);
    ASSERT_TRUE(c.AllGather(out.data() + rank * bytes, out.data(), bytes).ok());
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(out[r * bytes + i], r * 10 + i);
    }
  });
}

// Rank r contributes (r + 1) * f(i) at element i of the whole buffer; block b of the sum is
// then n(n+1)/2 * f(b * count + i). Integer-valued, so every summation order is exact.
template <typename T>
void ExpectReduceScatterSums(Communicator& c, int rank, int n, size_t count, CommDType dtype,
                             bool in_place) {
  auto f = [](size_t i) { return static_cast<T>(static_cast<int64_t>(i % 997) - 300); };
  std::vector<T> in(count * n);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<T>(rank + 1) * f(i);
  const std::vector<T> before = in;
  std::vector<T> separate(count, static_cast<T>(-1));
  T* out = in_place ? in.data() + static_cast<size_t>(rank) * count : separate.data();
  ASSERT_TRUE(c.ReduceScatterSum(in.data(), out, count, dtype).ok());
  const T ranks_sum = static_cast<T>(n * (n + 1) / 2);
  for (size_t i = 0; i < count; ++i) {
    ASSERT_EQ(out[i], ranks_sum * f(static_cast<size_t>(rank) * count + i))
        << "count " << count << " i " << i;
  }
  if (!in_place) {
    EXPECT_EQ(in, before) << "the input was modified";
  }
}

TEST_P(CommunicatorContractTest, ReduceScattersEveryDtypeAndOddSizes) {
  const int n = world_size();
  for (size_t count : {size_t{1}, size_t{7}, size_t{100003}}) {
    OnEveryRank([&](int rank, Communicator& c) {
      ExpectReduceScatterSums<float>(c, rank, n, count, CommDType::kFloat32, false);
      ExpectReduceScatterSums<double>(c, rank, n, count, CommDType::kFloat64, false);
      ExpectReduceScatterSums<int64_t>(c, rank, n, count, CommDType::kInt64, false);
    });
  }
}

TEST_P(CommunicatorContractTest, ReduceScattersInPlace) {
  const int n = world_size();
  OnEveryRank([&](int rank, Communicator& c) {
    ExpectReduceScatterSums<float>(c, rank, n, 5, CommDType::kFloat32, true);
  });
}

// Started collectives complete in the order they were issued, synchronous ones in between
// included, and their buffers are theirs until Wait.
TEST_P(CommunicatorContractTest, StartedCollectivesCompleteInOrder) {
  const int n = world_size();
  OnEveryRank([&](int rank, Communicator& c) {
    for (int round = 0; round < 5; ++round) {
      std::vector<int64_t> mine(3, rank + round);
      std::vector<int64_t> gathered(3 * n, -1);
      std::unique_ptr<CommWork> gather =
          c.StartAllGather(mine.data(), gathered.data(), mine.size() * sizeof(int64_t));
      std::vector<double> whole(2 * n);
      for (size_t i = 0; i < whole.size(); ++i) whole[i] = rank + static_cast<double>(i);
      std::vector<double> part(2);
      std::unique_ptr<CommWork> scatter =
          c.StartReduceScatterSum(whole.data(), part.data(), 2, CommDType::kFloat64);
      int64_t counter = 1;
      ASSERT_TRUE(c.AllReduceSum(&counter, 1, CommDType::kInt64).ok());
      std::vector<float> summed(4, static_cast<float>(rank));
      std::unique_ptr<CommWork> reduce =
          c.StartAllReduceSum(summed.data(), summed.size(), CommDType::kFloat32);
      ASSERT_TRUE(reduce->Wait().ok());
      ASSERT_TRUE(scatter->Wait().ok());
      ASSERT_TRUE(gather->Wait().ok());
      EXPECT_EQ(counter, n);
      for (int r = 0; r < n; ++r) {
        for (int i = 0; i < 3; ++i) ASSERT_EQ(gathered[r * 3 + i], r + round);
      }
      const double ranks = n * (n - 1) / 2.0;
      for (int i = 0; i < 2; ++i) ASSERT_EQ(part[i], ranks + n * static_cast<double>(rank * 2 + i));
      for (float v : summed) ASSERT_EQ(v, static_cast<float>(n * (n - 1) / 2));
    }
  });
}

TEST_P(CommunicatorContractTest, StartedCallsReportBadArgumentsFromWait) {
  std::vector<float> whole(4 * world_size());
  EXPECT_EQ(comm(0)
                .StartReduceScatterSum(whole.data(), whole.data() + 1, 4, CommDType::kFloat32)
                ->Wait()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(comm(0).StartAllReduceSum(nullptr, 3, CommDType::kFloat32)->Wait().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(comm(0).StartAllGather(nullptr, nullptr, 0)->Wait().ok());
}

TEST_P(CommunicatorContractTest, BarrierWaitsForEveryRank) {
  std::atomic<int> entered{0};
  OnEveryRank([&](int, Communicator& c) {
    entered.fetch_add(1);
    ASSERT_TRUE(c.Barrier().ok());
    EXPECT_EQ(entered.load(), world_size());
  });
}

TEST_P(CommunicatorContractTest, RunsAMixedSequenceOfCalls) {
  const int n = world_size();
  OnEveryRank([&](int rank, Communicator& c) {
    for (int step = 0; step < 20; ++step) {
      int64_t counters[3] = {1, rank, step};
      ASSERT_TRUE(c.AllReduceSum(counters, 3, CommDType::kInt64).ok());
      ASSERT_EQ(counters[0], n);
      ASSERT_EQ(counters[1], int64_t{n} * (n - 1) / 2);
      ASSERT_EQ(counters[2], int64_t{step} * n);

      const int root = step % n;
      double value = rank == root ? step + 0.25 : -1.0;
      ASSERT_TRUE(c.Broadcast(&value, sizeof(value), root).ok());
      ASSERT_EQ(value, step + 0.25);

      int32_t mine = rank * 1000 + step;
      std::vector<int32_t> all(n);
      ASSERT_TRUE(c.AllGather(&mine, all.data(), sizeof(mine)).ok());
      for (int r = 0; r < n; ++r) ASSERT_EQ(all[r], r * 1000 + step);

      ASSERT_TRUE(c.Barrier().ok());
    }
  });
}

TEST_P(CommunicatorContractTest, RejectsBadArgumentsWithoutCommunicating) {
  const int n = world_size();
  for (int r = 0; r < n; ++r) {
    Communicator& c = comm(r);
    char byte = 0;
    absl::Status s = c.Broadcast(&byte, 1, n);
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, "root"));
    EXPECT_EQ(c.Broadcast(&byte, 1, -1).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(c.Broadcast(nullptr, 1, 0).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(c.AllReduceSum(nullptr, 5, CommDType::kFloat64).code(),
              absl::StatusCode::kInvalidArgument);
    std::vector<char> out(4 * n);
    // Overlaps the output but is not this rank's own slot.
    const char* wrong = out.data() + (r == 0 ? 1 : 0);
    s = c.AllGather(wrong, out.data(), 4);
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, "overlaps"));
  }
  // The group is still usable.
  OnEveryRank([&](int, Communicator& c) {
    float one = 1.0f;
    ASSERT_TRUE(c.AllReduceSum(&one, 1, CommDType::kFloat32).ok());
    EXPECT_EQ(one, static_cast<float>(n));
  });
}

// A peer that never takes part fails the others' call within the timeout: no rank hangs.
class CommunicatorTimeoutTest : public ::testing::TestWithParam<Backend> {};

TEST_P(CommunicatorTimeoutTest, AMissingPeerIsDeadlineExceededWithinTheTimeout) {
  const std::string unavailable = GetParam().unavailable(2);
  if (!unavailable.empty()) GTEST_SKIP() << unavailable;
  const absl::Duration timeout = absl::Milliseconds(300);
  Group group = GetParam().make(2, timeout);
  ASSERT_EQ(group.size(), 2u);
  for (int call = 0; call < 2; ++call) {
    const absl::Time start = absl::Now();
    float value = 1.0f;
    std::vector<float> gathered(2);
    const absl::Status status =
        call == 0 ? group[0]->AllReduceSum(&value, 1, CommDType::kFloat32)
                  : group[0]->StartAllGather(&value, gathered.data(), sizeof(value))->Wait();
    // The first call breaks the group; the second may fail at once for that reason.
    EXPECT_THAT(status.code(),
                ::testing::AnyOf(absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kAborted))
        << status;
    if (call == 0) {
      EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
    }
    EXPECT_LT(absl::Now() - start, timeout + lathe::testing::kWaitLimit / 4);
  }
}

#ifdef LATHE_CONTRACT_CUDA
int VisibleGpus() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  return devices;
}

// Each device communicator behind the adapter that lets the suite pass host buffers.
Group OverHost(std::vector<absl::StatusOr<std::unique_ptr<Communicator>>> results,
               const std::vector<int>& devices) {
  Group group;
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_TRUE(results[r].ok()) << results[r].status();
    if (!results[r].ok()) return {};
    group.push_back(std::make_unique<lathe::testing::HostStagedCommunicator>(*std::move(results[r]),
                                                                             devices[r]));
  }
  return group;
}

// Ranks are threads, rank r on GPU r.
Group MakeNcclGroup(int world_size, absl::Duration timeout) {
  MemoryKvStore store;
  std::vector<absl::StatusOr<std::unique_ptr<Communicator>>> results;
  for (int r = 0; r < world_size; ++r) results.emplace_back(absl::UnknownError("not run"));
  RunRanks(world_size, [&](int rank) {
    NcclOptions options;
    options.device = rank;
    options.timeout = timeout;
    results[rank] = ConnectNccl(&store, rank, world_size, options);
  });
  std::vector<int> devices;
  for (int r = 0; r < world_size; ++r) devices.push_back(r);
  return OverHost(std::move(results), devices);
}

std::string NcclUnavailable(int world_size) {
  const int devices = VisibleGpus();
  if (devices >= world_size) return "";
  return absl::StrCat("NCCL: ", world_size, " ranks need ", world_size, " GPUs, ", devices,
                      " visible");
}

// The fake in-process group, each rank's calls staged through pinned host memory, every
// rank on GPU 0 (as two ranks sharing a GPU over gloo).
Group MakeCudaStagedGroup(int world_size, absl::Duration timeout) {
  FakeGroupOptions options;
  options.timeout = timeout;
  std::vector<absl::StatusOr<std::unique_ptr<Communicator>>> results;
  for (std::unique_ptr<Communicator>& host : MakeFakeGroup(world_size, options)) {
    results.push_back(MakeCudaStagedCommunicator(std::move(host), {}));
  }
  return OverHost(std::move(results), std::vector<int>(world_size, 0));
}

std::string NeedsAGpu(int) { return VisibleGpus() > 0 ? "" : "no GPU visible"; }

std::vector<ContractParam> AllBackends() {
  const Backend nccl{"Nccl", MakeNcclGroup, NcclUnavailable};
  const Backend staged{"CudaStaged", MakeCudaStagedGroup, NeedsAGpu};
  const Backend single{"CudaSingleRank",
                       [](int, absl::Duration) {
                         std::vector<absl::StatusOr<std::unique_ptr<Communicator>>> one;
                         one.push_back(MakeCudaSingleRankCommunicator({}));
                         return OverHost(std::move(one), {0});
                       },
                       NeedsAGpu};
  std::vector<ContractParam> params = {{single, 1}};
  for (const Backend& backend : {nccl, staged}) {
    for (int n : {1, 2, 3, 4}) params.push_back({backend, n});
  }
  return params;
}
#else
Group MakeGlooGroup(int world_size, absl::Duration timeout) {
  MemoryKvStore store;
  GlooOptions options;
  options.timeout = timeout;
  Group group;
  for (auto& result : ConnectGlooRanks(&store, world_size, options)) {
    EXPECT_TRUE(result.ok()) << result.status();
    if (!result.ok()) return {};
    group.push_back(*std::move(result));
  }
  return group;
}

std::vector<ContractParam> AllBackends() {
  const Backend fake{"Fake", [](int n, absl::Duration timeout) {
                       FakeGroupOptions options;
                       options.timeout = timeout;
                       return MakeFakeGroup(n, options);
                     }};
  const Backend gloo{"Gloo", MakeGlooGroup};
  std::vector<ContractParam> params;
  for (const Backend& backend : {fake, gloo}) {
    for (int n : {1, 2, 3, 4}) params.push_back({backend, n});
  }
  return params;
}
#endif

INSTANTIATE_TEST_SUITE_P(Backends, CommunicatorContractTest, ::testing::ValuesIn(AllBackends()),
                         ParamName);

// One backend per kind that makes groups of two (the single-rank ones cannot miss a peer).
std::vector<Backend> EachBackend() {
  std::vector<Backend> backends;
  for (const ContractParam& param : AllBackends()) {
    if (param.world_size == 2) backends.push_back(param.backend);
  }
  return backends;
}

INSTANTIATE_TEST_SUITE_P(Backends, CommunicatorTimeoutTest, ::testing::ValuesIn(EachBackend()),
                         [](const ::testing::TestParamInfo<Backend>& param) {
                           return param.param.name;
                         });

}  // namespace
}  // namespace lathe
