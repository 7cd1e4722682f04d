// A KvStore backed by the coordinator's lathe.v1.RendezvousService: the store through
// which the trainer ranks of one attempt rendezvous (docs/architecture.md, "The path of a job").
// Every key lives in the scope of one job and generation; the coordinator refuses a stale
// generation with FAILED_PRECONDITION, which this store passes on.
//
// Each RPC carries a deadline: `rpc_timeout` for Set, Get and Add, the caller's timeout
// plus `rpc_timeout` for Wait (the server's own wait is bounded by timeout_ms). RPCs wait
// for the channel to be ready rather than failing fast, and a Set, Get or Add that fails
// with a code the retry policy retries (common/rpc/retry_policy.h) is tried again within
// its deadline, so a coordinator that is briefly unreachable shows up as DEADLINE_EXCEEDED
// at the deadline. Wait is not retried: its DEADLINE_EXCEEDED is the server's answer. Get polls for
// a missing key with Wait, as gloo's store contract needs. Other codes are the server's (absl and
// gRPC codes coincide), with the call and key prepended to the message.
//
// Thread-safety: thread-safe (gRPC stubs are).
#ifndef LATHE_WORKER_COMM_GRPC_KV_STORE_H_
#define LATHE_WORKER_COMM_GRPC_KV_STORE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "common/rpc/retry_policy.h"
#include "grpcpp/channel.h"
#include "lathe/v1/coordinator.grpc.pb.h"
#include "worker/comm/kv_store.h"

namespace lathe {

struct GrpcKvStoreOptions {
  std::string job_id;
  int64_t generation = 0;
  // Deadline of one Set, Get or Add call, and the slack added to a Wait's own timeout.
  absl::Duration rpc_timeout = absl::Seconds(10);
  RetryOptions retry;
  std::string token;  // a worker's bearer token (common/rpc/auth.h); none when empty
};

class GrpcKvStore final : public KvStore {
 public:
  // REQUIRES: `channel` is not null and reaches a RendezvousService.
  GrpcKvStore(std::shared_ptr<grpc::ChannelInterface> channel, GrpcKvStoreOptions options);

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;

 private:
  // One Get RPC: NOT_FOUND when the key is absent.
  absl::StatusOr<std::string> GetOnce(absl::string_view key);
  void FillScope(v1::RendezvousScope* scope) const;
  absl::Status Annotate(const absl::Status& status, absl::string_view call,
                        absl::string_view key) const;

  const std::unique_ptr<v1::RendezvousService::Stub> stub_;
  const GrpcKvStoreOptions options_;
};

}  // namespace lathe

#endif  // LATHE_WORKER_COMM_GRPC_KV_STORE_H_
