#include "worker/comm/memory_kv_store.h"

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lathe {

absl::Status MemoryKvStore::Set(absl::string_view key, absl::string_view value) {
  absl::MutexLock lock(&mu_);
  values_[std::string(key)] = std::string(value);
  return absl::OkStatus();
}

absl::StatusOr<std::string> MemoryKvStore::Get(absl::string_view key, absl::Duration timeout) {
  const std::string keys[] = {std::string(key)};
  if (absl::Status s = Wait(keys, timeout); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  return values_.find(key)->second;
}

absl::Status MemoryKvStore::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  auto all_set = [this, keys]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const std::string& key : keys) {
      if (values_.find(key) == values_.end()) return false;
    }
    return true;
  };
  absl::MutexLock lock(&mu_);
  if (mu_.AwaitWithTimeout(absl::Condition(&all_set), timeout)) return absl::OkStatus();
  std::vector<absl::string_view> missing;
  for (const std::string& key : keys) {
    if (values_.find(key) == values_.end()) missing.push_back(key);
  }
  return absl::DeadlineExceededError(absl::StrCat("key-value store: timed out after ",
                                                  absl::FormatDuration(timeout), " waiting for ",
                                                  absl::StrJoin(missing, ", ")));
}

absl::StatusOr<int64_t> MemoryKvStore::Add(absl::string_view key, int64_t delta) {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(key);
  int64_t current = 0;
  if (it != values_.end() && !absl::SimpleAtoi(it->second, &current)) {
    return absl::InvalidArgumentError(
        absl::StrCat("key-value store: key \"", key, "\" does not hold an integer"));
  }
  current += delta;
  values_[std::string(key)] = absl::StrCat(current);
  return current;
}

}  // namespace lathe
