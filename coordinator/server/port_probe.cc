#include "coordinator/server/port_probe.h"

#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/channel_arguments.h"

namespace lathe {
namespace {

// grpc/health/v1/health.proto, without its generated code: the request names no service
// (the server as a whole), which encodes as no bytes; the answer's field 1, `status`, is
// SERVING (1).
constexpr char kHealthCheck[] = "/grpc.health.v1.Health/Check";
constexpr char kServing[] = "\x08\x01";

std::shared_ptr<grpc::ChannelCredentials> Credentials(const std::string& roots) {
  if (roots.empty()) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions options;
  // Roots of its own, so that the probe does not depend on the system's.
  options.set_certificate_provider(
      std::make_shared<grpc::experimental::StaticDataCertificateProvider>(roots));
  options.watch_root_certs();
  options.set_verify_server_certs(false);
  options.set_certificate_verifier(std::make_shared<grpc::experimental::NoOpCertificateVerifier>());
  options.set_check_call_host(false);
  return grpc::experimental::TlsCredentials(options);
}

}  // namespace

absl::Status PortProbe::Check() {
  absl::MutexLock lock(&mu_);
  if (absl::Now() - checked_at_ < options_.keep_answer) return answer_;
  answer_ = CheckNow();
  checked_at_ = absl::Now();
  return answer_;
}

absl::Status PortProbe::CheckNow() const {
  grpc::ChannelArguments args;
  // A connection of its own, not one shared with another channel to the same address: the
  // check is whether the port takes new ones.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  grpc::GenericStub stub(
      grpc::CreateCustomChannel(options_.target, Credentials(options_.tls_roots), args));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.deadline));
  grpc::Slice empty;
  const grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer response;
  grpc::Status status;
  absl::Notification done;
  stub.UnaryCall(&context, kHealthCheck, grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  std::string why;
  if (!status.ok()) {
    why = absl::StrCat("its health check (deadline ", absl::FormatDuration(options_.deadline),
                       ") failed: ", status.error_message());
  } else {
    std::vector<grpc::Slice> slices;
    std::string answer;
    if (response.Dump(&slices).ok()) {
      for (const grpc::Slice& slice : slices) {
        answer.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
      }
    }
    if (answer == kServing) return absl::OkStatus();
    why = "its health check does not answer SERVING";
  }
  const std::string more = options_.explain ? options_.explain() : "";
  return absl::UnavailableError(absl::StrCat(
      "the gRPC port ", options_.target, " does not serve: ", why, more.empty() ? "" : "; ", more));
}

}  // namespace lathe
