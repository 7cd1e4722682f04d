#include "worker/comm/grpc_kv_store.h"

#include <algorithm>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/rpc/auth.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/retry_policy.h"
#include "grpcpp/client_context.h"

namespace lathe {
namespace {

// Keeps deadline arithmetic finite for callers that pass absl::InfiniteDuration().
constexpr absl::Duration kLongestWait = absl::Hours(24 * 7);

absl::Duration Clamp(absl::Duration timeout) {
  return std::clamp(timeout, absl::ZeroDuration(), kLongestWait);
}

void PrepareContext(grpc::ClientContext* context, absl::Time deadline, const std::string& token) {
  context->set_deadline(absl::ToChronoTime(deadline));
  context->set_wait_for_ready(true);
  AttachToken(context, token);
}

// Runs `rpc` (one call on a fresh context) under the retry policy, every try ending by
// `deadline`.
absl::Status Call(const GrpcKvStoreOptions& options, absl::Time deadline,
                  const std::function<grpc::Status(grpc::ClientContext*)>& rpc) {
  return RetryCall(options.retry, deadline, [&] {
    grpc::ClientContext context;
    PrepareContext(&context, deadline, options.token);
    return FromGrpcStatus(rpc(&context));
  });
}

}  // namespace

GrpcKvStore::GrpcKvStore(std::shared_ptr<grpc::ChannelInterface> channel,
                         GrpcKvStoreOptions options)
    : stub_(v1::RendezvousService::NewStub(channel)), options_(std::move(options)) {}

void GrpcKvStore::FillScope(v1::RendezvousScope* scope) const {
  scope->set_job_id(options_.job_id);
  scope->set_generation(options_.generation);
}

absl::Status GrpcKvStore::Annotate(const absl::Status& status, absl::string_view call,
                                   absl::string_view key) const {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat("rendezvous ", call, " ", key, " (job ", options_.job_id,
                                   " generation ", options_.generation, "): ", status.message()));
}

absl::Status GrpcKvStore::Set(absl::string_view key, absl::string_view value) {
  v1::RendezvousSetRequest request;
  FillScope(request.mutable_scope());
  request.set_key(std::string(key));
  request.set_value(std::string(value));
  v1::RendezvousSetResponse response;
  return Annotate(Call(options_, absl::Now() + options_.rpc_timeout,
                       [&](grpc::ClientContext* c) { return stub_->Set(c, request, &response); }),
                  "Set", key);
}

absl::StatusOr<std::string> GrpcKvStore::GetOnce(absl::string_view key) {
  v1::RendezvousGetRequest request;
  FillScope(request.mutable_scope());
  request.set_key(std::string(key));
  v1::RendezvousGetResponse response;
  absl::Status status =
      Call(options_, absl::Now() + options_.rpc_timeout,
           [&](grpc::ClientContext* c) { return stub_->Get(c, request, &response); });
  if (!status.ok()) return Annotate(status, "Get", key);
  return std::move(*response.mutable_value());
}

absl::StatusOr<std::string> GrpcKvStore::Get(absl::string_view key, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + Clamp(timeout);
  const std::string keys[] = {std::string(key)};
  while (true) {
    absl::StatusOr<std::string> value = GetOnce(key);
    if (value.status().code() != absl::StatusCode::kNotFound) return value;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return Annotate(absl::DeadlineExceededError(
                          absl::StrCat("not set within ", absl::FormatDuration(Clamp(timeout)))),
                      "Get", key);
    }
    // Wait returns once the key exists; the next Get then finds it.
    if (absl::Status s = Wait(keys, left); !s.ok()) return s;
  }
}

absl::Status GrpcKvStore::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  if (keys.empty()) return absl::OkStatus();
  timeout = Clamp(timeout);
  v1::RendezvousWaitRequest request;
  FillScope(request.mutable_scope());
  for (const std::string& key : keys) request.add_keys(key);
  request.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  v1::RendezvousWaitResponse response;
  // Not retried: the server's DEADLINE_EXCEEDED is the answer ("not set in time").
  grpc::ClientContext context;
  PrepareContext(&context, absl::Now() + timeout + options_.rpc_timeout, options_.token);
  return Annotate(FromGrpcStatus(stub_->Wait(&context, request, &response)), "Wait",
                  absl::StrJoin(keys, ", "));
}

absl::StatusOr<int64_t> GrpcKvStore::Add(absl::string_view key, int64_t delta) {
  v1::RendezvousAddRequest request;
  FillScope(request.mutable_scope());
  request.set_key(std::string(key));
  request.set_delta(delta);
  v1::RendezvousAddResponse response;
  absl::Status status =
      Call(options_, absl::Now() + options_.rpc_timeout,
           [&](grpc::ClientContext* c) { return stub_->Add(c, request, &response); });
  if (!status.ok()) return Annotate(status, "Add", key);
  return response.value();
}

}  // namespace lathe
