// The coordinator's RendezvousService on 127.0.0.1, for the tests of the stores and of gloo
// over the coordinator's store.
#ifndef LATHE_TESTS_COMM_RENDEZVOUS_SERVER_H_
#define LATHE_TESTS_COMM_RENDEZVOUS_SERVER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "coordinator/rendezvous/rendezvous_service.h"
#include "coordinator/rendezvous/rendezvous_store.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"

namespace lathe::testing {

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

#endif  // LATHE_TESTS_COMM_RENDEZVOUS_SERVER_H_
