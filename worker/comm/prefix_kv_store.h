// A KvStore decorator that puts every key under "<prefix>/", so that several users of one
// store (communicators, attempts, retries of a connect) cannot see each other's keys, as
// c10d's PrefixStore does.
//
// Thread-safety: as thread-safe as the store it wraps (every KvStore is).
#ifndef LATHE_WORKER_COMM_PREFIX_KV_STORE_H_
#define LATHE_WORKER_COMM_PREFIX_KV_STORE_H_

#include <string>

#include "worker/comm/kv_store.h"

namespace lathe {

class PrefixKvStore final : public KvStore {
 public:
  // REQUIRES: `base` is not null and outlives this store. Stores into base under
  // prefix + "/" + key; prefixes nest (a PrefixKvStore of a PrefixKvStore).
  PrefixKvStore(KvStore* base, std::string prefix);

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;

  const std::string& prefix() const { return prefix_; }

 private:
  std::string Qualify(absl::string_view key) const;

  KvStore* const base_;
  const std::string prefix_;
};

}  // namespace lathe

#endif  // LATHE_WORKER_COMM_PREFIX_KV_STORE_H_
