// TLS for every gRPC connection of Lathe (docs/services.md, "TLS").
//
// The coordinator serves TLS with a certificate and key (--tls-cert, --tls-key); with a
// client CA (--tls-client-ca) it also asks each client for a certificate and verifies any
// it gets against that CA: mutual TLS. A client certificate is optional at the handshake,
// so that the CLI can connect with a token alone; worker calls then require one
// (Authenticator::RequireWorkerCertificates). Clients (the CLI, the agent, the trainers'
// rendezvous store) connect with TLS when given the CA that signed the server's certificate
// (--tls-ca), and present a certificate of their own with --tls-cert and --tls-key.
//
// The agent hands its files down to its trainers in the environment (kTlsEnv*), as it does
// its token.
//
// Thread-safety: pure functions (they read the named files).
#ifndef LATHE_COMMON_RPC_TLS_H_
#define LATHE_COMMON_RPC_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/command_line.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace lathe {

// PEM files; empty paths are absent.
struct ServerTlsFiles {
  std::string cert;       // the server's certificate chain
  std::string key;        // its private key
  std::string client_ca;  // verify client certificates against these roots (mutual TLS)
};

struct ClientTlsFiles {
  std::string ca;    // roots that signed the server's certificate; empty: no TLS
  std::string cert;  // this client's certificate, for mutual TLS
  std::string key;   // its private key
};

inline constexpr char kTlsEnvCa[] = "LATHE_TLS_CA";
inline constexpr char kTlsEnvCert[] = "LATHE_TLS_CERT";
inline constexpr char kTlsEnvKey[] = "LATHE_TLS_KEY";

// Insecure credentials when `files` names nothing. INVALID_ARGUMENT naming the flag when
// only one of cert and key is given or a client CA comes without them; NOT_FOUND /
// INVALID_ARGUMENT naming the flag and the file when a file is unreadable, empty or not
// PEM.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTlsFiles& files);

// Insecure credentials when `files.ca` is empty (then cert and key must be empty too); the
// same errors as MakeServerCredentials.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ClientTlsFiles& files);

// The files named by the kTlsEnv* variables (unset: empty).
ClientTlsFiles ClientTlsFilesFromEnv();

// --tls-ca, --tls-cert and --tls-key, each falling back to its kTlsEnv* variable, as absolute
// paths (an agent hands them to trainers that run in other directories).
ClientTlsFiles ClientTlsFilesFrom(const ParsedFlags& flags);

}  // namespace lathe

#endif  // LATHE_COMMON_RPC_TLS_H_
