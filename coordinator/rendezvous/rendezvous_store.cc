#include "coordinator/rendezvous/rendezvous_store.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lathe {

RendezvousStore::RendezvousStore(std::function<bool(absl::string_view, int64_t)> is_active)
    : is_active_(std::move(is_active)) {}

absl::Status RendezvousStore::CheckActive(absl::string_view job_id, int64_t generation) {
  if (is_active_(job_id, generation)) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  // Drop every scope that has ended, this one included.
  for (auto it = values_.begin(); it != values_.end();) {
    it = is_active_(it->first.first, it->first.second) ? std::next(it) : values_.erase(it);
  }
  return absl::FailedPreconditionError(absl::StrCat("rendezvous: job ", job_id, " generation ",
                                                    generation, " is not an active attempt"));
}

absl::Status RendezvousStore::Set(absl::string_view job_id, int64_t generation,
                                  absl::string_view key, std::string value) {
  if (absl::Status s = CheckActive(job_id, generation); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  values_[{std::string(job_id), generation}][std::string(key)] = std::move(value);
  return absl::OkStatus();
}

absl::StatusOr<std::string> RendezvousStore::Get(absl::string_view job_id, int64_t generation,
                                                 absl::string_view key) {
  if (absl::Status s = CheckActive(job_id, generation); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto scope = values_.find({std::string(job_id), generation});
  if (scope != values_.end()) {
    if (auto it = scope->second.find(key); it != scope->second.end()) return it->second;
  }
  return absl::NotFoundError(absl::StrCat("rendezvous: key \"", key, "\" not set"));
}

absl::Status RendezvousStore::Wait(absl::string_view job_id, int64_t generation,
                                   const std::vector<std::string>& keys, absl::Time deadline) {
  if (absl::Status s = CheckActive(job_id, generation); !s.ok()) return s;
  const Scope scope{std::string(job_id), generation};
  auto all_set = [this, &scope, &keys]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = values_.find(scope);
    if (it == values_.end()) return keys.empty();
    for (const std::string& key : keys) {
      if (!it->second.count(key)) return false;
    }
    return true;
  };
  absl::MutexLock lock(&mu_);
  if (mu_.AwaitWithDeadline(absl::Condition(&all_set), deadline)) return absl::OkStatus();
  std::vector<std::string> missing;
  auto it = values_.find(scope);
  for (const std::string& key : keys) {
    if (it == values_.end() || !it->second.count(key)) missing.push_back(key);
  }
  return absl::DeadlineExceededError(
      absl::StrCat("rendezvous: timed out waiting for ", absl::StrJoin(missing, ", ")));
}

absl::StatusOr<int64_t> RendezvousStore::Add(absl::string_view job_id, int64_t generation,
                                             absl::string_view key, int64_t delta) {
  if (absl::Status s = CheckActive(job_id, generation); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  std::string& value = values_[{std::string(job_id), generation}][std::string(key)];
  int64_t current = 0;
  if (!value.empty() && !absl::SimpleAtoi(value, &current)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous: key \"", key, "\" does not hold an integer"));
  }
  current += delta;
  value = absl::StrCat(current);
  return current;
}

}  // namespace lathe
