// Helpers shared by the collectives' tests: ranks in threads, an in-process
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
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "lathe/v1/coordinator.grpc.pb.h"
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

// A RendezvousService over a MemoryKvStore, with the coordinator's semantics: keys scoped
// by job and generation, NOT_FOUND from Get for an absent key, a server-side Wait bounded
// by timeout_ms and the client's deadline, and FAILED_PRECONDITION for a generation below
// min_generation (a stale attempt).
class FakeRendezvousService final : public v1::RendezvousService::Service {
 public:
  void set_min_generation(int64_t generation) { min_generation_ = generation; }

  // The value stored for a scoped key, or NOT_FOUND.
  absl::StatusOr<std::string> Peek(const std::string& job_id, int64_t generation,
                                   const std::string& key) {
    return store_.Get(Scoped(job_id, generation, key), absl::ZeroDuration());
  }

  grpc::Status Set(grpc::ServerContext*, const v1::RendezvousSetRequest* request,
                   v1::RendezvousSetResponse*) override {
    if (grpc::Status s = CheckScope(request->scope()); !s.ok()) return s;
    return ToGrpc(store_.Set(Scoped(request->scope(), request->key()), request->value()));
  }

  grpc::Status Get(grpc::ServerContext*, const v1::RendezvousGetRequest* request,
                   v1::RendezvousGetResponse* response) override {
    if (grpc::Status s = CheckScope(request->scope()); !s.ok()) return s;
    absl::StatusOr<std::string> value =
        store_.Get(Scoped(request->scope(), request->key()), absl::ZeroDuration());
    if (!value.ok()) return grpc::Status(grpc::StatusCode::NOT_FOUND, "key not set");
    response->set_value(*value);
    return grpc::Status::OK;
  }

  grpc::Status Wait(grpc::ServerContext* context, const v1::RendezvousWaitRequest* request,
                    v1::RendezvousWaitResponse*) override {
    if (grpc::Status s = CheckScope(request->scope()); !s.ok()) return s;
    std::vector<std::string> keys;
    for (const std::string& key : request->keys()) keys.push_back(Scoped(request->scope(), key));
    absl::Duration timeout = absl::Milliseconds(request->timeout_ms());
    timeout = std::min(timeout, absl::FromChrono(context->deadline()) - absl::Now());
    return ToGrpc(store_.Wait(keys, timeout));
  }

  grpc::Status Add(grpc::ServerContext*, const v1::RendezvousAddRequest* request,
                   v1::RendezvousAddResponse* response) override {
    if (grpc::Status s = CheckScope(request->scope()); !s.ok()) return s;
    absl::StatusOr<int64_t> value =
        store_.Add(Scoped(request->scope(), request->key()), request->delta());
    if (!value.ok()) return ToGrpc(value.status());
    response->set_value(*value);
    return grpc::Status::OK;
  }

 private:
  static std::string Scoped(const std::string& job_id, int64_t generation, const std::string& key) {
    return absl::StrCat(job_id, "\x1f", generation, "\x1f", key);
  }
  static std::string Scoped(const v1::RendezvousScope& scope, const std::string& key) {
    return Scoped(scope.job_id(), scope.generation(), key);
  }
  static grpc::Status ToGrpc(const absl::Status& status) {
    if (status.ok()) return grpc::Status::OK;
    return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                        std::string(status.message()));
  }
  grpc::Status CheckScope(const v1::RendezvousScope& scope) const {
    if (scope.generation() >= min_generation_) return grpc::Status::OK;
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("job ", scope.job_id(), " generation ", scope.generation(),
                                     " is not an active attempt"));
  }

  MemoryKvStore store_;
  std::atomic<int64_t> min_generation_{0};
};

// FakeRendezvousService served on 127.0.0.1 at a free port. Stops in its destructor.
class FakeRendezvousServer {
 public:
  FakeRendezvousServer() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~FakeRendezvousServer() { Shutdown(); }

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
  FakeRendezvousService& service() { return service_; }

 private:
  FakeRendezvousService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace lathe::testing

#endif  // LATHE_TESTS_COMM_COMM_TEST_UTIL_H_
