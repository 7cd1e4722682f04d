// Group commit: batched, durable writes to the store.
//
// A caller stages each of its changes as a batch (the newest records of some jobs and
// workers, and the workers deleted) and gets the batch's sequence (1, 2, ...). Whoever needs
// a batch durable calls WaitDurable: it writes every batch staged so far, merged into one
// transaction (one fsync), unless another caller is already writing, in which case it waits
// for that write (which may hold its batch) and writes what is left. So a burst of changes
// from many threads costs a few transactions, not one each.
//
// A failed write leaves its batches staged, in order, ahead of any staged since: the next
// WaitDurable writes them with the new ones. Batches are merged in the order they were
// staged (the newest record of a job or worker wins; a deletion is a worker's record too),
// so a caller must stage its changes in the order it made them (the Scheduler stages under
// its own lock).
//
// Thread-safety: thread-safe. One mutex, never held during the store's write and never held
// while taking another lock; a caller may hold its own lock around Stage and NextSequence
// (the Scheduler does: its mutex is taken before this one), never around WaitDurable.
#ifndef LATHE_COORDINATOR_SCHEDULER_GROUP_COMMIT_H_
#define LATHE_COORDINATOR_SCHEDULER_GROUP_COMMIT_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/store/store.h"

namespace lathe {

class GroupCommit {
 public:
  // REQUIRES: `store` outlives this object.
  explicit GroupCommit(Store* store) : store_(store) {}

  // Stages `batch` (nothing when it is empty); returns the sequence that is durable once
  // everything staged so far is (the batch's own, or the last one staged before it).
  uint64_t Stage(StoreBatch batch) ABSL_LOCKS_EXCLUDED(mu_);
  // The sequence the next non-empty batch staged will get.
  uint64_t NextSequence() const ABSL_LOCKS_EXCLUDED(mu_);
  // Returns once every batch up to `sequence` is durable, writing what is staged (with any
  // batches staged after it) unless another caller already is; the store's error when the
  // write fails (its batches stay staged), INTERNAL for a sequence never staged.
  absl::Status WaitDurable(uint64_t sequence) ABSL_LOCKS_EXCLUDED(mu_);
  // Every batch up to this sequence is durable. Lock-free (heartbeats read it).
  uint64_t Durable() const { return durable_.load(); }

 private:
  Store* const store_;
  mutable absl::Mutex mu_;
  uint64_t staged_sequence_ ABSL_GUARDED_BY(mu_) = 0;  // the last batch staged
  std::deque<std::pair<uint64_t, StoreBatch>> staged_ ABSL_GUARDED_BY(mu_);  // not yet written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // a caller is in the store's Write
  std::atomic<uint64_t> durable_{0};           // written under mu_
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_SCHEDULER_GROUP_COMMIT_H_
