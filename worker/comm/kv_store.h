// The rendezvous key-value store through which the ranks of one attempt find each other
// before they can talk directly (gloo's pair addresses, later NCCL's unique id), in the
// manner of c10d's Store.
//
// Implementations: MemoryKvStore (in-process, for tests and single-process groups),
// GrpcKvStore (the coordinator's RendezvousService, scoped by job and generation) and the
// PrefixKvStore decorator (a namespace per communicator or per attempt) and FileKvStore (a
// directory, for trainers started without a coordinator).
//
// Values are arbitrary bytes. Keys are never deleted while a store is in use; a key set
// twice keeps the later value.
//
// Thread-safety: every implementation is thread-safe.
#ifndef LATHE_WORKER_COMM_KV_STORE_H_
#define LATHE_WORKER_COMM_KV_STORE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace lathe {

class KvStore {
 public:
  virtual ~KvStore() = default;

  // Sets `key` to `value`, replacing an earlier value, and wakes the callers waiting on it.
  virtual absl::Status Set(absl::string_view key, absl::string_view value) = 0;

  // Returns the value at `key`, waiting up to `timeout` for another rank to set it (gloo's
  // Store::get blocks the same way). DEADLINE_EXCEEDED naming the key when it is still
  // absent then; a timeout of zero only looks.
  virtual absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) = 0;

  // Returns once every key in `keys` exists (at once for none); DEADLINE_EXCEEDED naming the
  // missing keys after `timeout`.
  virtual absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) = 0;

  // Adds `delta` to the integer at `key` (0 when absent) and returns the new value. The
  // integer is kept as decimal text, so Get returns e.g. "5". INVALID_ARGUMENT when the key
  // holds something else.
  virtual absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) = 0;
};

}  // namespace lathe

#endif  // LATHE_WORKER_COMM_KV_STORE_H_
