// An in-process communicator group for unit tests of callers (the shard layer, the
// trainer): N members, one per rank, meant to be driven from N threads of one process.
// Each collective meets in shared memory: the last rank to arrive computes the result
// from every rank's buffers while the others wait, then each copies its part out. Sums
// add ranks in rank order, so results are deterministic.
//
// Beyond the real backends it checks the cross-rank contract: when the ranks of one round
// disagree (different calls, counts, dtypes or roots) every one of them gets
// INVALID_ARGUMENT naming the disagreement. Break() injects a failure (a vanished peer).
//
// Thread-safety: thread-safe. A member, like every Communicator, serializes its own calls;
// the group is shared by its members and stays alive as long as any of them.
#ifndef LATHE_WORKER_COMM_FAKE_COMMUNICATOR_H_
#define LATHE_WORKER_COMM_FAKE_COMMUNICATOR_H_

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"

namespace lathe {

struct FakeGroupOptions {
  // How long a rank waits for the others in one collective before DEADLINE_EXCEEDED (which
  // breaks the group, as it would a real one).
  absl::Duration timeout = absl::Seconds(60);
};

class FakeGroup {
 public:
  // REQUIRES: world_size >= 1.
  static std::shared_ptr<FakeGroup> Create(int world_size, FakeGroupOptions options = {});
  virtual ~FakeGroup() = default;

  // One communicator per rank, in rank order. Call once.
  virtual std::vector<std::unique_ptr<Communicator>> Members() = 0;

  // Fails every waiting and later collective of every member with `status`, as a vanished
  // peer fails a real group. REQUIRES: !status.ok().
  virtual void Break(absl::Status status) = 0;
};

// FakeGroup::Create(world_size, options)->Members().
std::vector<std::unique_ptr<Communicator>> MakeFakeGroup(int world_size,
                                                         FakeGroupOptions options = {});

}  // namespace lathe

#endif  // LATHE_WORKER_COMM_FAKE_COMMUNICATOR_H_
