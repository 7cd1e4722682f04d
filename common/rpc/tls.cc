#include "common/rpc/tls.h"

#include <cstdlib>
#include <filesystem>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace lathe {
namespace {

// The PEM text of `path`, read for `flag`.
absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view flag) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return Annotate(text.status(), absl::StrCat("--", flag));
  if (!absl::StrContains(*text, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", path, " is not PEM"));
  }
  return text;
}

absl::Status CheckPair(const std::string& cert, const std::string& key) {
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(cert.empty() ? "--tls-key" : "--tls-cert",
                                                   " needs ",
                                                   cert.empty() ? "--tls-cert" : "--tls-key"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTlsFiles& files) {
  LATHE_RETURN_IF_ERROR(CheckPair(files.cert, files.key));
  if (files.cert.empty()) {
    if (!files.client_ca.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
    }
    return grpc::InsecureServerCredentials();
  }
  grpc::SslServerCredentialsOptions options;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  LATHE_ASSIGN_OR_RETURN(pair.cert_chain, ReadPem(files.cert, "tls-cert"));
  LATHE_ASSIGN_OR_RETURN(pair.private_key, ReadPem(files.key, "tls-key"));
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!files.client_ca.empty()) {
    LATHE_ASSIGN_OR_RETURN(options.pem_root_certs, ReadPem(files.client_ca, "tls-client-ca"));
    options.client_certificate_request = GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ClientTlsFiles& files) {
  LATHE_RETURN_IF_ERROR(CheckPair(files.cert, files.key));
  if (files.ca.empty()) {
    if (!files.cert.empty()) {
      return absl::InvalidArgumentError("--tls-cert and --tls-key need --tls-ca");
    }
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions options;
  LATHE_ASSIGN_OR_RETURN(options.pem_root_certs, ReadPem(files.ca, "tls-ca"));
  if (!files.cert.empty()) {
    LATHE_ASSIGN_OR_RETURN(options.pem_cert_chain, ReadPem(files.cert, "tls-cert"));
    LATHE_ASSIGN_OR_RETURN(options.pem_private_key, ReadPem(files.key, "tls-key"));
  }
  return grpc::SslCredentials(options);
}

ClientTlsFiles ClientTlsFilesFromEnv() {
  auto get = [](const char* name) {
    const char* value = std::getenv(name);
    return std::string(value == nullptr ? "" : value);
  };
  return {get(kTlsEnvCa), get(kTlsEnvCert), get(kTlsEnvKey)};
}

ClientTlsFiles ClientTlsFilesFrom(const ParsedFlags& flags) {
  ClientTlsFiles tls = ClientTlsFilesFromEnv();
  for (auto [flag, file] : {std::pair{"tls-ca", &tls.ca}, std::pair{"tls-cert", &tls.cert},
                            std::pair{"tls-key", &tls.key}}) {
    if (flags.Has(flag)) *file = flags.Get(flag);
    if (!file->empty()) *file = std::filesystem::absolute(*file).string();
  }
  return tls;
}

}  // namespace lathe
