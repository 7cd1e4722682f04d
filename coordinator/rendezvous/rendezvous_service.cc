#include "coordinator/rendezvous/rendezvous_service.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/rpc/grpc_status.h"

namespace lathe {

grpc::Status RendezvousServiceImpl::Admit(const grpc::ServerContext& context,
                                          const v1::RendezvousScope& scope,
                                          const char* method) const {
  Caller caller;
  if (grpc::Status denied = auth_->Check(context, kWorkerCall, method, &caller); !denied.ok()) {
    return denied;
  }
  if (!caller.authenticated) return grpc::Status::OK;
  absl::StatusOr<std::vector<std::string>> workers =
      placed_workers_(scope.job_id(), scope.generation());
  if (!workers.ok()) return ToGrpcStatus(workers.status());
  for (const std::string& worker : *workers) {
    if (caller.MayActFor(worker)) return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      absl::StrCat(caller.Describe(), " acts for no worker of attempt ",
                                   scope.generation(), " of job ", scope.job_id().substr(0, 64)));
}

grpc::Status RendezvousServiceImpl::Set(grpc::ServerContext* context,
                                        const v1::RendezvousSetRequest* request,
                                        v1::RendezvousSetResponse*) {
  if (grpc::Status denied = Admit(*context, request->scope(), "Set"); !denied.ok()) {
    return denied;
  }
  return ToGrpcStatus(store_->Set(request->scope().job_id(), request->scope().generation(),
                                  request->key(), request->value()));
}

grpc::Status RendezvousServiceImpl::Get(grpc::ServerContext* context,
                                        const v1::RendezvousGetRequest* request,
                                        v1::RendezvousGetResponse* response) {
  if (grpc::Status denied = Admit(*context, request->scope(), "Get"); !denied.ok()) {
    return denied;
  }
  absl::StatusOr<std::string> value =
      store_->Get(request->scope().job_id(), request->scope().generation(), request->key());
  if (value.ok()) response->set_value(*std::move(value));
  return ToGrpcStatus(value.status());
}

grpc::Status RendezvousServiceImpl::Wait(grpc::ServerContext* context,
                                         const v1::RendezvousWaitRequest* request,
                                         v1::RendezvousWaitResponse*) {
  if (grpc::Status denied = Admit(*context, request->scope(), "Wait"); !denied.ok()) {
    return denied;
  }
  // The server's own bound: no caller holds a thread here for longer, whatever it asks.
  constexpr int64_t kMaxWaitMs = 10 * 60 * 1000;
  absl::Time deadline =
      absl::Now() + absl::Milliseconds(std::clamp<int64_t>(request->timeout_ms(), 0, kMaxWaitMs));
  const absl::Time client_deadline = absl::FromChrono(context->deadline());
  if (client_deadline < deadline) deadline = client_deadline;
  std::vector<std::string> keys(request->keys().begin(), request->keys().end());
  return ToGrpcStatus(
      store_->Wait(request->scope().job_id(), request->scope().generation(), keys, deadline));
}

grpc::Status RendezvousServiceImpl::Add(grpc::ServerContext* context,
                                        const v1::RendezvousAddRequest* request,
                                        v1::RendezvousAddResponse* response) {
  if (grpc::Status denied = Admit(*context, request->scope(), "Add"); !denied.ok()) {
    return denied;
  }
  absl::StatusOr<int64_t> value = store_->Add(
      request->scope().job_id(), request->scope().generation(), request->key(), request->delta());
  if (value.ok()) response->set_value(*value);
  return ToGrpcStatus(value.status());
}

}  // namespace lathe
