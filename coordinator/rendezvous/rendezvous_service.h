// lathe.v1.RendezvousService over a RendezvousStore: the thin gRPC adapter through which the
// trainer ranks of one attempt meet (worker/comm/grpc_kv_store.h is its client). Each handler
// checks that the caller's token acts for a worker the attempt is placed on (issue #27: a
// worker token read and wrote another job's keys), converts its request, calls the store and
// converts the status.
//
// Thread-safety: thread-safe (the store is).
#ifndef LATHE_COORDINATOR_RENDEZVOUS_RENDEZVOUS_SERVICE_H_
#define LATHE_COORDINATOR_RENDEZVOUS_RENDEZVOUS_SERVICE_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/rpc/auth.h"
#include "coordinator/rendezvous/rendezvous_store.h"
#include "grpcpp/grpcpp.h"
#include "lathe/v1/coordinator.grpc.pb.h"

namespace lathe {

class RendezvousServiceImpl final : public v1::RendezvousService::Service {
 public:
  // The workers an attempt (job id, generation) is placed on; NOT_FOUND when unknown.
  using PlacedWorkers =
      std::function<absl::StatusOr<std::vector<std::string>>(absl::string_view, int64_t)>;

  // REQUIRES: `store` and `auth` outlive the service. Every call is a worker's (the trainers
  // carry their agent's token).
  RendezvousServiceImpl(RendezvousStore* store, const Authenticator* auth,
                        PlacedWorkers placed_workers)
      : store_(store), auth_(auth), placed_workers_(std::move(placed_workers)) {}

  grpc::Status Set(grpc::ServerContext* context, const v1::RendezvousSetRequest* request,
                   v1::RendezvousSetResponse* response) override;
  grpc::Status Get(grpc::ServerContext* context, const v1::RendezvousGetRequest* request,
                   v1::RendezvousGetResponse* response) override;
  // Waits at most the request's timeout_ms, and never past the client's own deadline.
  grpc::Status Wait(grpc::ServerContext* context, const v1::RendezvousWaitRequest* request,
                    v1::RendezvousWaitResponse* response) override;
  grpc::Status Add(grpc::ServerContext* context, const v1::RendezvousAddRequest* request,
                   v1::RendezvousAddResponse* response) override;

 private:
  // The caller's role, then that it acts for a worker `scope` is placed on: PERMISSION_DENIED.
  grpc::Status Admit(const grpc::ServerContext& context, const v1::RendezvousScope& scope,
                     const char* method) const;

  RendezvousStore* const store_;
  const Authenticator* const auth_;
  const PlacedWorkers placed_workers_;
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_RENDEZVOUS_RENDEZVOUS_SERVICE_H_
