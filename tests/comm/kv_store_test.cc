// The KvStore contract (worker/comm/kv_store.h), run against MemoryKvStore, PrefixKvStore
// and GrpcKvStore (over an in-process RendezvousService), then what is particular to each.
#include "worker/comm/kv_store.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/comm/comm_test_util.h"
#include "tests/comm/rendezvous_server.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "worker/comm/file_kv_store.h"
#include "worker/comm/grpc_kv_store.h"
#include "worker/comm/memory_kv_store.h"
#include "worker/comm/prefix_kv_store.h"

namespace lathe {
namespace {

using ::lathe::testing::kWaitLimit;
using ::lathe::testing::RendezvousServer;
using ::lathe::testing::RunRanks;
using ::lathe::testing::StatusIs;

// Short: these tests wait this long only when a key is meant to be missing.
constexpr absl::Duration kMissingKeyWait = absl::Milliseconds(50);

// A store under test with whatever it needs kept alive.
class StoreUnderTest {
 public:
  virtual ~StoreUnderTest() = default;
  virtual KvStore& store() = 0;
};

class MemoryUnderTest final : public StoreUnderTest {
 public:
  KvStore& store() override { return store_; }

 private:
  MemoryKvStore store_;
};

class PrefixUnderTest final : public StoreUnderTest {
 public:
  KvStore& store() override { return prefixed_; }

 private:
  MemoryKvStore base_;
  PrefixKvStore prefixed_{&base_, "attempt-1"};
};

class FileUnderTest final : public StoreUnderTest {
 public:
  KvStore& store() override { return *store_; }

 private:
  testing::TempDir dir_;
  std::unique_ptr<FileKvStore> store_ = *FileKvStore::Open(dir_.Path("rendezvous"));
};

class GrpcUnderTest final : public StoreUnderTest {
 public:
  KvStore& store() override { return store_; }

 private:
  RendezvousServer server_;
  GrpcKvStore store_{server_.NewChannel(), {"job-1", 1, absl::Seconds(10), {}, ""}};
};

struct StoreParam {
  std::string name;
  std::function<std::unique_ptr<StoreUnderTest>()> make;
};

class KvStoreContractTest : public ::testing::TestWithParam<StoreParam> {
 protected:
  void SetUp() override { under_test_ = GetParam().make(); }
  KvStore& store() { return under_test_->store(); }

  std::unique_ptr<StoreUnderTest> under_test_;
};

TEST_P(KvStoreContractTest, GetReturnsWhatSetStored) {
  const std::string value("bytes\0with a NUL", 16);
  ASSERT_TRUE(store().Set("k", value).ok());
  absl::StatusOr<std::string> got = store().Get("k", absl::ZeroDuration());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, value);
}

TEST_P(KvStoreContractTest, SetReplacesTheValue) {
  ASSERT_TRUE(store().Set("k", "one").ok());
  ASSERT_TRUE(store().Set("k", "two").ok());
  EXPECT_EQ(store().Get("k", absl::ZeroDuration()).value_or(""), "two");
}

TEST_P(KvStoreContractTest, GetOfAMissingKeyTimesOutNamingIt) {
  absl::StatusOr<std::string> got = store().Get("absent-key", kMissingKeyWait);
  EXPECT_THAT(got.status(), StatusIs(absl::StatusCode::kDeadlineExceeded, "absent-key"));
}

TEST_P(KvStoreContractTest, GetWaitsForAKeySetLater) {
  absl::StatusOr<std::string> got;
  std::thread getter([&] { got = store().Get("late", kWaitLimit); });
  ASSERT_TRUE(store().Set("late", "here").ok());
  getter.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "here");
}

TEST_P(KvStoreContractTest, WaitReturnsOnceEveryKeyExists) {
  absl::Status waited;
  std::thread waiter([&] { waited = store().Wait({"a", "b"}, kWaitLimit); });
  ASSERT_TRUE(store().Set("a", "1").ok());
  ASSERT_TRUE(store().Set("b", "2").ok());
  waiter.join();
  EXPECT_TRUE(waited.ok()) << waited;
}

TEST_P(KvStoreContractTest, WaitTimesOutNamingTheMissingKeys) {
  ASSERT_TRUE(store().Set("present", "1").ok());
  absl::Status s = store().Wait({"present", "missing"}, kMissingKeyWait);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDeadlineExceeded, "missing"));
}

TEST_P(KvStoreContractTest, WaitForNoKeysReturnsAtOnce) {
  EXPECT_TRUE(store().Wait({}, absl::ZeroDuration()).ok());
}

TEST_P(KvStoreContractTest, AddCountsFromZeroAndGetSeesDecimalText) {
  EXPECT_EQ(store().Add("n", 1).value_or(-1), 1);
  EXPECT_EQ(store().Add("n", 5).value_or(-1), 6);
  EXPECT_EQ(store().Add("n", -10).value_or(-1), -4);
  EXPECT_EQ(store().Get("n", absl::ZeroDuration()).value_or(""), "-4");
}

TEST_P(KvStoreContractTest, ConcurrentAddsEachSeeADistinctValue) {
  constexpr int kThreads = 4;
  constexpr int kAddsPerThread = 25;
  std::vector<std::vector<int64_t>> seen(kThreads);
  RunRanks(kThreads, [&](int t) {
    for (int i = 0; i < kAddsPerThread; ++i) {
      absl::StatusOr<int64_t> v = store().Add("counter", 1);
      ASSERT_TRUE(v.ok()) << v.status();
      seen[t].push_back(*v);
    }
  });
  std::set<int64_t> all;
  for (const auto& values : seen) all.insert(values.begin(), values.end());
  EXPECT_EQ(all.size(), static_cast<size_t>(kThreads * kAddsPerThread));
  EXPECT_EQ(*all.begin(), 1);
  EXPECT_EQ(*all.rbegin(), kThreads * kAddsPerThread);
}

TEST_P(KvStoreContractTest, AddToANonIntegerIsInvalidArgument) {
  ASSERT_TRUE(store().Set("text", "hello").ok());
  absl::StatusOr<int64_t> v = store().Add("text", 1);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
}

INSTANTIATE_TEST_SUITE_P(
    Stores, KvStoreContractTest,
    ::testing::Values(StoreParam{"Memory", [] { return std::make_unique<MemoryUnderTest>(); }},
                      StoreParam{"Prefix", [] { return std::make_unique<PrefixUnderTest>(); }},
                      StoreParam{"File", [] { return std::make_unique<FileUnderTest>(); }},
                      StoreParam{"Grpc", [] { return std::make_unique<GrpcUnderTest>(); }}),
    [](const ::testing::TestParamInfo<StoreParam>& param_info) { return param_info.param.name; });

TEST(PrefixKvStoreTest, KeepsUsersOfOneStoreApart) {
  MemoryKvStore base;
  PrefixKvStore a(&base, "a");
  PrefixKvStore b(&base, "b");
  PrefixKvStore nested(&a, "inner");
  ASSERT_TRUE(a.Set("k", "from a").ok());
  ASSERT_TRUE(nested.Set("k", "from nested").ok());
  EXPECT_EQ(b.Get("k", absl::ZeroDuration()).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(base.Get("a/k", absl::ZeroDuration()).value_or(""), "from a");
  EXPECT_EQ(base.Get("a/inner/k", absl::ZeroDuration()).value_or(""), "from nested");
  EXPECT_TRUE(a.Wait({"inner/k"}, absl::ZeroDuration()).ok());
  EXPECT_EQ(a.Add("n", 2).value_or(-1), 2);
  EXPECT_EQ(base.Get("a/n", absl::ZeroDuration()).value_or(""), "2");
}

TEST(GrpcKvStoreTest, KeysAreScopedByJobAndGeneration) {
  RendezvousServer server;
  ASSERT_TRUE(server.started());
  GrpcKvStore attempt1(server.NewChannel(), {"job-1", 1, absl::Seconds(10), {}, ""});
  GrpcKvStore attempt2(server.NewChannel(), {"job-1", 2, absl::Seconds(10), {}, ""});
  GrpcKvStore other_job(server.NewChannel(), {"job-2", 1, absl::Seconds(10), {}, ""});
  ASSERT_TRUE(attempt1.Set("k", "v1").ok());
  EXPECT_EQ(attempt2.Get("k", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(other_job.Get("k", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(server.store().Get("job-1", 1, "k").value_or(""), "v1");
}

TEST(GrpcKvStoreTest, StaleGenerationIsFailedPreconditionNamingTheScope) {
  RendezvousServer server;
  ASSERT_TRUE(server.started());
  server.set_min_generation(2);
  GrpcKvStore stale(server.NewChannel(), {"job-1", 1, absl::Seconds(10), {}, ""});
  for (absl::Status s : {stale.Set("k", "v"), stale.Get("k", absl::Seconds(1)).status(),
                         stale.Wait({"k"}, absl::Seconds(1)), stale.Add("k", 1).status()}) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kFailedPrecondition, "job job-1 generation 1"));
  }
}

TEST(GrpcKvStoreTest, UnreachableCoordinatorMeetsTheCallDeadline) {
  std::string address;
  {
    RendezvousServer server;  // a port that nothing listens on once it stops
    address = server.address();
  }
  GrpcKvStore store(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()),
                    {"job-1", 1, absl::Milliseconds(200), {}, ""});
  absl::Status s = store.Set("k", "v");
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDeadlineExceeded, "rendezvous Set k"));
}

}  // namespace
}  // namespace lathe
