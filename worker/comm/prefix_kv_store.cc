#include "worker/comm/prefix_kv_store.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace lathe {

PrefixKvStore::PrefixKvStore(KvStore* base, std::string prefix)
    : base_(base), prefix_(std::move(prefix)) {}

std::string PrefixKvStore::Qualify(absl::string_view key) const {
  return absl::StrCat(prefix_, "/", key);
}

absl::Status PrefixKvStore::Set(absl::string_view key, absl::string_view value) {
  return base_->Set(Qualify(key), value);
}

absl::StatusOr<std::string> PrefixKvStore::Get(absl::string_view key, absl::Duration timeout) {
  return base_->Get(Qualify(key), timeout);
}

absl::Status PrefixKvStore::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  std::vector<std::string> qualified;
  qualified.reserve(keys.size());
  for (const std::string& key : keys) qualified.push_back(Qualify(key));
  return base_->Wait(qualified, timeout);
}

absl::StatusOr<int64_t> PrefixKvStore::Add(absl::string_view key, int64_t delta) {
  return base_->Add(Qualify(key), delta);
}

}  // namespace lathe
