// The CPU backend of Communicator: gloo's TCP transport, with the ranks finding each other
// through a KvStore (the coordinator's RendezvousService in production, a MemoryKvStore in
// tests).
//
// ConnectGloo creates a TCP device bound to `hostname` (or `interface`), publishes this
// rank's pair addresses under "<key_prefix>/" in the store, waits for every other rank's,
// and connects the full mesh. The collectives are gloo's ring all-reduce, broadcast,
// all-gather and barrier, and a ring reduce-scatter over gloo's point-to-point buffers.
// Every call, synchronous or started, runs on the communicator's own thread in issue order
// (ordered_executor.h), so a started all-gather overlaps the caller's computation. gloo's
// exceptions stop at this boundary and become statuses (see communicator.h for the codes).
//
// A world of one needs no store and no networking: ConnectGloo then returns the
// single-rank communicator.
//
// Thread-safety: the returned communicator serializes its calls (communicator.h).
#ifndef LATHE_WORKER_COMM_GLOO_COMMUNICATOR_H_
#define LATHE_WORKER_COMM_GLOO_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"
#include "worker/comm/kv_store.h"

namespace lathe {

struct GlooOptions {
  // The address this rank listens on and advertises to its peers. Ignored when `interface`
  // is set.
  std::string hostname = "127.0.0.1";
  // A network interface ("eth0") whose address to use instead of `hostname`.
  std::string interface;
  // Bounds the rendezvous (each store wait) and each collective. Caveat from gloo: a peer
  // that published its address but never connects is given 5 x timeout (gloo's own rule
  // for the initial TCP connect) before connect fails.
  absl::Duration timeout = absl::Seconds(60);
  // Namespace of this communicator's keys in the store: one per communicator sharing a store.
  std::string key_prefix = "gloo";
};

// Connects rank `rank` of a group of `world_size`. Blocks until every rank has joined.
// Returns INVALID_ARGUMENT for a bad rank, world size, timeout, store or interface;
// DEADLINE_EXCEEDED when some rank did not join within options.timeout; the store's own
// error (e.g. FAILED_PRECONDITION for a stale generation) when a store call fails; ABORTED
// when the transport broke while connecting; FAILED_PRECONDITION when Lathe was built
// without gloo and world_size > 1.
// REQUIRES: `store` outlives this call (it is not used afterwards); may be null when
// world_size is 1.
absl::StatusOr<std::unique_ptr<Communicator>> ConnectGloo(KvStore* store, int rank, int world_size,
                                                          const GlooOptions& options);

}  // namespace lathe

#endif  // LATHE_WORKER_COMM_GLOO_COMMUNICATOR_H_
