// Helpers shared by the collectives' tests: ranks in threads, the coordinator's
// RendezvousService on 127.0.0.1, and a gloo group connected over a store.
#ifndef LATHE_TESTS_COMM_COMM_TEST_UTIL_H_
#define LATHE_TESTS_COMM_COMM_TEST_UTIL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "coordinator/rendezvous/rendezvous_service.h"
#include "coordinator/rendezvous/rendezvous_store.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
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

// The coordinator's own RendezvousService and RendezvousStore served on 127.0.0.1 at a free
// port, with a generation below min_generation counting as a stale attempt (the scheduler's
// IsActiveAttempt in the coordinator). Stops in its destructor.
class RendezvousServer {
 public:
  RendezvousServer() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~RendezvousServer() { Shutdown(); }

  void Shutdown() {
    if (server_ == nullptr) return;
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    server_->Wait();
    server_.reset();
  }

  bool started() const { return server_ != nullptr && port_ > 0; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  std::shared_ptr<grpc::Channel> NewChannel() const {
    return grpc::CreateChannel(address(), grpc::InsecureChannelCredentials());
  }
  void set_min_generation(int64_t generation) { min_generation_.store(generation); }
  RendezvousStore& store() { return store_; }

 private:
  std::atomic<int64_t> min_generation_{0};
  RendezvousStore store_{[this](absl::string_view, int64_t generation) {
    return generation >= min_generation_.load();
  }};
  const Authenticator auth_ = Authenticator::AllowAll();
  // Authentication is off: every caller acts for every worker, so no placement is looked up.
  RendezvousServiceImpl service_{&store_, &auth_, [](absl::string_view, int64_t) {
                                   return absl::StatusOr<std::vector<std::string>>();
                                 }};
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace lathe::testing

#endif  // LATHE_TESTS_COMM_COMM_TEST_UTIL_H_
