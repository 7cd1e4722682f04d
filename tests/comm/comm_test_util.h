// Helpers shared by the collectives' tests: ranks in threads and a gloo group connected over
// a store (no gRPC: the engine-only build's CUDA contract test uses them too).
#ifndef LATHE_TESTS_COMM_COMM_TEST_UTIL_H_
#define LATHE_TESTS_COMM_COMM_TEST_UTIL_H_

#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/comm/communicator.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/kv_store.h"
#include "worker/comm/memory_kv_store.h"

namespace lathe::testing {

// Long enough for a loaded CI machine; tests never wait this long when things work.
inline constexpr absl::Duration kWaitLimit = absl::Seconds(60);

// Runs fn(rank) for every rank, each in its own thread, and joins them.
template <typename Fn>
void RunRanks(int world_size, Fn fn) {
  std::vector<std::thread> threads;
  threads.reserve(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&fn, rank] { fn(rank); });
  }
  for (std::thread& t : threads) t.join();
}

// Connects `world_size` gloo ranks (threads) on 127.0.0.1 through `store`. Each entry is
// that rank's result.
inline std::vector<absl::StatusOr<std::unique_ptr<Communicator>>> ConnectGlooRanks(
    KvStore* store, int world_size, GlooOptions options = {}) {
  std::vector<absl::StatusOr<std::unique_ptr<Communicator>>> results;
  for (int rank = 0; rank < world_size; ++rank) results.emplace_back(absl::UnknownError("not run"));
  RunRanks(world_size,
           [&](int rank) { results[rank] = ConnectGloo(store, rank, world_size, options); });
  return results;
}

}  // namespace lathe::testing

#endif  // LATHE_TESTS_COMM_COMM_TEST_UTIL_H_
