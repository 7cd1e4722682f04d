// Who may call the coordinator (issues #12 and #27, docs/services.md "Authentication"):
// bearer tokens with roles and names. A `client` token may submit, plan, list, watch and
// cancel its own jobs and list workers; a `worker` token may register, heartbeat, report
// progress and use the rendezvous store for the worker ids it names; an `admin` token may do
// whatever a client may, on every job, and drain and remove workers. Neither client nor admin
// may make a worker's calls, nor a worker a client's.
//
// The server side (Authenticator) reads a token file; the client side (AttachToken,
// ResolveToken) sends `authorization: Bearer <token>` with every call. Tokens are compared
// in constant time (their SHA-256 digests, every entry checked) and never logged or echoed
// in errors.
//
// Thread-safety: an Authenticator is immutable after construction; the functions are pure
// except ResolveToken, which reads a file and the environment.
#ifndef LATHE_COMMON_RPC_AUTH_H_
#define LATHE_COMMON_RPC_AUTH_H_

#include <initializer_list>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/client_context.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"

namespace lathe {

enum class Role { kClient, kWorker, kAdmin };

absl::string_view RoleName(Role role);

// The roles of each kind of call.
inline constexpr std::initializer_list<Role> kClientCall = {Role::kClient, Role::kAdmin};
inline constexpr std::initializer_list<Role> kWorkerCall = {Role::kWorker};
inline constexpr std::initializer_list<Role> kAdminCall = {Role::kAdmin};

// Who made a call that Check let through.
struct Caller {
  bool authenticated = false;  // false with authentication off: anyone may do anything
  Role role = Role::kAdmin;
  std::string name;  // the token's name; empty when not authenticated
  // A worker token's ids: each one id, or a prefix ending in '*' ("lathe-worker-*").
  std::vector<std::string> worker_ids;

  // Whether a worker's call may be made for `worker_id` (always when not authenticated).
  bool MayActFor(absl::string_view worker_id) const;
  // A client sees and changes only its own jobs; an admin, or anyone when not
  // authenticated, every job.
  bool SeesEveryJob() const { return !authenticated || role == Role::kAdmin; }
  // "alice (client)", or "anyone (authentication is off)": who changed a job, in its history.
  std::string Describe() const;
};

class Authenticator {
 public:
  // Lets every call through: `--insecure-no-auth`.
  static Authenticator AllowAll();

  // A token file's text: one `<role> <name> <token> [<worker ids>]` per line (role client,
  // worker or admin; name 1-63 characters of A-Z a-z 0-9 . _ -, for logs and job owners;
  // token at least 16 printable characters without spaces; worker ids, for worker tokens
  // only: a comma-separated list of ids, each a name that may end in '*' to stand for every
  // id with that prefix, by default the token's name alone), blank lines and `#` comments
  // ignored. INVALID_ARGUMENT "<source>:<line>: <problem>" (never quoting a token) for a bad
  // line, a repeated token, deploy/'s example token ("replace-me...") or a file without
  // tokens.
  static absl::StatusOr<Authenticator> FromText(absl::string_view text, absl::string_view source);
  // FromText of the file at `path`; NOT_FOUND / INTERNAL naming the path.
  static absl::StatusOr<Authenticator> FromFile(const std::string& path);

  bool enabled() const { return enabled_; }

  // Mutual TLS for workers (common/rpc/tls.h): from now on a worker's call must also come
  // over a connection whose client certificate the server verified. Call before serving.
  void RequireWorkerCertificates() { worker_certificates_ = true; }

  // OK when the call carries the token of a role in `allowed`, and then `*caller` (when not
  // null) says whose token it is. UNAUTHENTICATED without a bearer token or with an unknown
  // one, or for a worker call without a verified client certificate when
  // RequireWorkerCertificates was called (also with auth off); PERMISSION_DENIED naming the
  // token's name and role and `method` for a token of another role.
  grpc::Status Check(const grpc::ServerContextBase& context, std::initializer_list<Role> allowed,
                     absl::string_view method, Caller* caller = nullptr) const;

 private:
  struct Entry {
    std::string digest;  // SHA-256 of the token, hex
    Caller caller;
  };
  Authenticator() = default;

  bool enabled_ = true;
  bool worker_certificates_ = false;
  std::vector<Entry> entries_;
};

// Adds `authorization: Bearer <token>` to the call; nothing when `token` is empty.
void AttachToken(grpc::ClientContext* context, const std::string& token);

// A client's token: `flag_token` when given, else the contents of `flag_file` (trimmed)
// when given, else the environment variable `env` (may be unset: ""). INVALID_ARGUMENT /
// NOT_FOUND naming `file_flag_name` and the file for an unreadable or empty file.
absl::StatusOr<std::string> ResolveToken(const std::string& flag_token,
                                         const std::string& flag_file,
                                         absl::string_view file_flag_name, const char* env);

}  // namespace lathe

#endif  // LATHE_COMMON_RPC_AUTH_H_
