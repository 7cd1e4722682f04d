// The one conversion between absl::Status (every module boundary in Lathe) and grpc::Status
// (the wire). Codes are the same numbers in both (absl mirrors gRPC's canonical codes), so a
// code chosen by the domain (docs/architecture.md, "Errors, retries, time") reaches the caller
// unchanged.
//
// Thread-safety: pure functions.
#ifndef LATHE_COMMON_RPC_GRPC_STATUS_H_
#define LATHE_COMMON_RPC_GRPC_STATUS_H_

#include <cstddef>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace lathe {

// The code and message of `status` as a grpc::Status (OK for OK). A message longer than
// kMaxWireMessageBytes keeps its head and tail: it travels in a header, and a client refuses
// headers over 8 KiB (RESOURCE_EXHAUSTED instead of the real error), while messages may quote
// what a caller sent (a 300 KB job id).
inline constexpr size_t kMaxWireMessageBytes = 2048;
grpc::Status ToGrpcStatus(const absl::Status& status);

// The code and message of `status` as an absl::Status (OK for OK).
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace lathe

#endif  // LATHE_COMMON_RPC_GRPC_STATUS_H_
