#include "common/rpc/auth.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"
#include "common/sha256.h"

namespace lathe {
namespace {

constexpr absl::string_view kBearer = "Bearer ";
constexpr size_t kMinTokenLength = 16;

bool IsName(absl::string_view name) {
  if (name.empty() || name.size() > 63) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '_' && c != '-') return false;
  }
  return true;
}

bool IsToken(absl::string_view token) {
  if (token.size() < kMinTokenLength) return false;
  for (char c : token) {
    if (!absl::ascii_isgraph(c)) return false;
  }
  return true;
}

// Equal digests, in time that does not depend on where they differ.
bool SameDigest(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

bool Caller::MayActFor(absl::string_view worker_id) const {
  if (!authenticated) return true;
  if (role != Role::kWorker) return false;
  for (absl::string_view id : worker_ids) {
    if (absl::ConsumeSuffix(&id, "*") ? absl::StartsWith(worker_id, id) : worker_id == id) {
      return true;
    }
  }
  return false;
}

std::string Caller::Describe() const {
  if (!authenticated) return "anyone (authentication is off)";
  return absl::StrCat(name, " (", RoleName(role), ")");
}

absl::string_view RoleName(Role role) {
  switch (role) {
    case Role::kClient:
      return "client";
    case Role::kWorker:
      return "worker";
    case Role::kAdmin:
      return "admin";
  }
  return "?";
}

Authenticator Authenticator::AllowAll() {
  Authenticator auth;
  auth.enabled_ = false;
  return auth;
}

absl::StatusOr<Authenticator> Authenticator::FromText(absl::string_view text,
                                                      absl::string_view source) {
  Authenticator auth;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || absl::StartsWith(line, "#")) continue;
    auto error = [&](absl::string_view problem) {
      return absl::InvalidArgumentError(absl::StrCat(source, ":", line_number, ": ", problem));
    };
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipWhitespace());
    if (fields.size() != 3 && !(fields.size() == 4 && fields[0] == "worker")) {
      return error(absl::StrCat(
          "expected \"<role> <name> <token>\" (a worker's may add \"<worker ids>\"), got ",
          fields.size(), fields.size() == 1 ? " field" : " fields"));
    }
    Entry entry;
    Caller& caller = entry.caller;
    caller.authenticated = true;
    if (fields[0] == "client") {
      caller.role = Role::kClient;
    } else if (fields[0] == "worker") {
      caller.role = Role::kWorker;
    } else if (fields[0] == "admin") {
      caller.role = Role::kAdmin;
    } else {
      return error(absl::StrCat("unknown role \"", fields[0], "\" (client, worker or admin)"));
    }
    if (!IsName(fields[1])) {
      return error("the name must be 1 to 63 characters from A-Z a-z 0-9 . _ -");
    }
    if (!IsToken(fields[2])) {
      return error(absl::StrCat("the token of ", fields[1], " must be at least ", kMinTokenLength,
                                " printable characters"));
    }
    // deploy/k8s ships placeholders; applied as they are, anyone who read the manifests
    // would hold every role (issue #32).
    if (absl::StartsWithIgnoreCase(fields[2], "replace-me")) {
      return error(
          absl::StrCat("the token of ", fields[1],
                       " is the example value from deploy/: replace it with one of your own"));
    }
    caller.name = std::string(fields[1]);
    entry.digest = Sha256Hex(fields[2]);
    if (caller.role == Role::kWorker) {
      if (fields.size() == 3) {
        caller.worker_ids.push_back(caller.name);
      } else {
        for (absl::string_view id : absl::StrSplit(fields[3], ',')) {
          absl::string_view prefix = id;
          if (!IsName(id) &&
              !(absl::ConsumeSuffix(&prefix, "*") && (prefix.empty() || IsName(prefix)))) {
            return error(absl::StrCat("the worker ids of ", caller.name,
                                      " must be names (A-Z a-z 0-9 . _ -, 1 to 63) separated by "
                                      "commas, each may end in '*'; got \"",
                                      id.substr(0, 64), "\""));
          }
          caller.worker_ids.emplace_back(id);
        }
      }
    }
    for (const Entry& other : auth.entries_) {
      if (other.digest == entry.digest) {
        return error(
            absl::StrCat("the token of ", caller.name, " is also ", other.caller.name, "'s"));
      }
    }
    auth.entries_.push_back(std::move(entry));
  }
  if (auth.entries_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": holds no tokens"));
  }
  return auth;
}

absl::StatusOr<Authenticator> Authenticator::FromFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  return FromText(*text, path);
}

grpc::Status Authenticator::Check(const grpc::ServerContextBase& context,
                                  std::initializer_list<Role> allowed, absl::string_view method,
                                  Caller* caller) const {
  if (worker_certificates_ &&
      std::find(allowed.begin(), allowed.end(), Role::kWorker) != allowed.end()) {
    const auto peer = context.auth_context();
    if (peer == nullptr || !peer->IsPeerAuthenticated()) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          absl::StrCat(method,
                                       " needs a client certificate signed by the "
                                       "coordinator's --tls-client-ca (mutual TLS)"));
    }
  }
  if (!enabled_) {
    if (caller != nullptr) *caller = Caller();
    return grpc::Status::OK;
  }
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "no bearer token (give the CLI --token, --token-file or $LATHE_TOKEN)");
  }
  const absl::string_view value(it->second.data(), it->second.size());
  if (!absl::StartsWith(value, kBearer)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "the authorization header is not \"Bearer <token>\"");
  }
  const std::string digest = Sha256Hex(value.substr(kBearer.size()));
  const Entry* found = nullptr;
  for (const Entry& entry : entries_) {  // every entry, whatever matches
    if (SameDigest(entry.digest, digest)) found = &entry;
  }
  if (found == nullptr) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "unknown token");
  }
  for (Role role : allowed) {
    if (role == found->caller.role) {
      if (caller != nullptr) *caller = found->caller;
      return grpc::Status::OK;
    }
  }
  std::vector<absl::string_view> names;
  for (Role role : allowed) names.push_back(RoleName(role));
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      absl::StrCat(found->caller.Describe(), " may not call ", method, " (",
                                   absl::StrJoin(names, " or "), " only)"));
}

void AttachToken(grpc::ClientContext* context, const std::string& token) {
  if (!token.empty()) context->AddMetadata("authorization", absl::StrCat(kBearer, token));
}

absl::StatusOr<std::string> ResolveToken(const std::string& flag_token,
                                         const std::string& flag_file,
                                         absl::string_view file_flag_name, const char* env) {
  if (!flag_token.empty()) return flag_token;
  if (!flag_file.empty()) {
    absl::StatusOr<std::string> text = ReadFile(flag_file);
    if (!text.ok()) {
      return absl::Status(text.status().code(),
                          absl::StrCat(file_flag_name, ": ", text.status().message()));
    }
    const std::string token(absl::StripAsciiWhitespace(*text));
    if (token.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(file_flag_name, ": ", flag_file, " is empty"));
    }
    return token;
  }
  const char* value = std::getenv(env);
  return value != nullptr ? std::string(absl::StripAsciiWhitespace(value)) : std::string();
}

}  // namespace lathe
