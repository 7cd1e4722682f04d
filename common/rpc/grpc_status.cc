#include "common/rpc/grpc_status.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace lathe {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  std::string message(status.message());
  if (message.size() > kMaxWireMessageBytes) {
    // (Non-ASCII bytes are percent-encoded on the wire: at most three times this.)
    const size_t tail = kMaxWireMessageBytes / 4;
    const size_t head = kMaxWireMessageBytes - tail - 64;
    message = absl::StrCat(message.substr(0, head), " ... (", message.size() - head - tail,
                           " bytes cut) ... ", message.substr(message.size() - tail));
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::move(message));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace lathe
