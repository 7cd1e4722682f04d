#include "coordinator/rendezvous/rendezvous_store.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lathe {

RendezvousStore::RendezvousStore(std::function<bool(absl::string_view, int64_t)> is_active)
    : is_active_(std::move(is_active)) {}

void RendezvousStore::DropEndedLocked() {
  for (auto it = scopes_.begin(); it != scopes_.end();) {
    it = is_active_(it->first.first, it->first.second) ? std::next(it) : scopes_.erase(it);
  }
}

void RendezvousStore::DropEnded() {
  absl::MutexLock lock(&mu_);
  DropEndedLocked();
}

int64_t RendezvousStore::BytesHeld() {
  absl::MutexLock lock(&mu_);
  int64_t bytes = 0;
  for (const auto& [scope, values] : scopes_) bytes += values.bytes;
  return bytes;
}

absl::Status RendezvousStore::CheckActive(absl::string_view job_id, int64_t generation) {
  if (is_active_(job_id, generation)) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  DropEndedLocked();  // this scope among them
  return absl::FailedPreconditionError(absl::StrCat("rendezvous: job ", job_id, " generation ",
                                                    generation, " is not an active attempt"));
}

absl::Status RendezvousStore::Put(const Scope& scope, absl::string_view key, std::string value) {
  Values& values = scopes_[scope];
  auto it = values.values.find(key);
  const int64_t old_bytes =
      it == values.values.end() ? 0 : static_cast<int64_t>(key.size() + it->second.size());
  const int64_t new_bytes = static_cast<int64_t>(key.size() + value.size());
  if (it == values.values.end() && static_cast<int64_t>(values.values.size()) >= kMaxKeysPerScope) {
    return absl::ResourceExhaustedError(absl::StrCat("rendezvous: job ", scope.first,
                                                     " already holds ", kMaxKeysPerScope,
                                                     " keys, the most one attempt may"));
  }
  if (values.bytes - old_bytes + new_bytes > kMaxBytesPerScope) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "rendezvous: job ", scope.first, " would hold ", values.bytes - old_bytes + new_bytes,
        " bytes, over the ", kMaxBytesPerScope, " one attempt may"));
  }
  values.bytes += new_bytes - old_bytes;
  if (it == values.values.end()) {
    values.values.emplace(std::string(key), std::move(value));
  } else {
    it->second = std::move(value);
  }
  return absl::OkStatus();
}

absl::Status RendezvousStore::Set(absl::string_view job_id, int64_t generation,
                                  absl::string_view key, std::string value) {
  if (absl::Status s = CheckActive(job_id, generation); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  return Put({std::string(job_id), generation}, key, std::move(value));
}

absl::StatusOr<std::string> RendezvousStore::Get(absl::string_view job_id, int64_t generation,
                                                 absl::string_view key) {
  if (absl::Status s = CheckActive(job_id, generation); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto scope = scopes_.find({std::string(job_id), generation});
  if (scope != scopes_.end()) {
    if (auto it = scope->second.values.find(key); it != scope->second.values.end()) {
      return it->second;
    }
  }
  return absl::NotFoundError(absl::StrCat("rendezvous: key \"", key, "\" not set"));
}

absl::Status RendezvousStore::Wait(absl::string_view job_id, int64_t generation,
                                   const std::vector<std::string>& keys, absl::Time deadline) {
  if (absl::Status s = CheckActive(job_id, generation); !s.ok()) return s;
  const Scope scope{std::string(job_id), generation};
  auto has = [this, &scope](const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = scopes_.find(scope);
    return it != scopes_.end() && it->second.values.count(key) > 0;
  };
  auto all_set = [&keys, &has]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const std::string& key : keys) {
      if (!has(key)) return false;
    }
    return true;
  };
  absl::MutexLock lock(&mu_);
  if (mu_.AwaitWithDeadline(absl::Condition(&all_set), deadline)) return absl::OkStatus();
  std::vector<std::string> missing;
  for (const std::string& key : keys) {
    if (!has(key)) missing.push_back(key);
  }
  return absl::DeadlineExceededError(
      absl::StrCat("rendezvous: timed out waiting for ", absl::StrJoin(missing, ", ")));
}

absl::StatusOr<int64_t> RendezvousStore::Add(absl::string_view job_id, int64_t generation,
                                             absl::string_view key, int64_t delta) {
  if (absl::Status s = CheckActive(job_id, generation); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  const Scope scope{std::string(job_id), generation};
  int64_t current = 0;
  if (auto it = scopes_.find(scope); it != scopes_.end()) {
    if (auto value = it->second.values.find(key); value != it->second.values.end()) {
      if (!value->second.empty() && !absl::SimpleAtoi(value->second, &current)) {
        return absl::InvalidArgumentError(
            absl::StrCat("rendezvous: key \"", key, "\" does not hold an integer"));
      }
    }
  }
  current += delta;
  if (absl::Status s = Put(scope, key, absl::StrCat(current)); !s.ok()) return s;
  return current;
}

}  // namespace lathe
