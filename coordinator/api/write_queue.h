// The write side of a server stream's reactor: gRPC allows one write in flight, so what is
// offered meanwhile waits here, and the stream finishes exactly once, after the write in
// flight. WatchJob (the newest status only) and the heartbeat stream (every answer, in order)
// share it. It knows nothing of gRPC's reactor: each call says what the reactor must do
// next (start writing Current(), Finish with a status), and the reactor does it after the
// call, outside the queue's lock.
//
//   Offer(item)   idle: `item` becomes Current() and the reactor starts writing it; a write
//                 in flight: it waits (kEvery: in a FIFO; kNewest: it replaces the waiting
//                 one); ending: dropped.
//   WriteDone(ok) the next waiting item, or the finish once ending; a failed write ends the
//                 stream with `write_failed`; a written `last` item ends it OK.
//   End(status)   ends the stream: Finish at once when no write is in flight, else after it.
//                 The first end wins.
//
// Thread-safety: thread-safe. One mutex, a leaf: never held while calling out. Current() is
// read without it by the one who was told to write it, and changes only while no write is in
// flight.
#ifndef LATHE_COORDINATOR_API_WRITE_QUEUE_H_
#define LATHE_COORDINATOR_API_WRITE_QUEUE_H_

#include <deque>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/status.h"

namespace lathe {

template <typename T>
class WriteQueue {
 public:
  enum class Keep {
    kEvery,   // every item is written, in order
    kNewest,  // of the items offered during a write, only the newest is written after it
  };
  // What the reactor does after WriteDone: start writing Current(), finish, or neither.
  struct Next {
    bool write = false;
    std::optional<grpc::Status> finish;
  };

  WriteQueue(Keep keep, grpc::Status write_failed)
      : keep_(keep), write_failed_(std::move(write_failed)) {}

  // Offers an item; true: it is Current() now and the caller starts writing it. `last`: the
  // stream finishes OK once it is written.
  bool Offer(T item, bool last = false) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (ending_) return false;
    if (writing_) {
      if (keep_ == Keep::kNewest) waiting_.clear();
      waiting_.emplace_back(std::move(item), last);
      return false;
    }
    current_ = std::move(item);
    current_last_ = last;
    writing_ = true;
    return true;
  }

  // The write of Current() completed (`ok`) or failed.
  Next WriteDone(bool ok) ABSL_LOCKS_EXCLUDED(mu_) {
    Next next;
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok && !ending_) ending_ = write_failed_;
    if (ok && current_last_ && !ending_) ending_ = grpc::Status::OK;
    if (!ending_ && !waiting_.empty()) {
      current_ = std::move(waiting_.front().first);
      current_last_ = waiting_.front().second;
      waiting_.pop_front();
      writing_ = next.write = true;
    }
    if (ending_ && !writing_ && !finished_) {
      finished_ = true;
      next.finish = *ending_;
    }
    return next;
  }

  // Ends the stream with `status`: returns it when the caller must Finish now (no write in
  // flight); otherwise WriteDone returns it. Nothing after the first call.
  std::optional<grpc::Status> End(grpc::Status status) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (ending_) return std::nullopt;
    ending_ = std::move(status);
    if (writing_ || finished_) return std::nullopt;
    finished_ = true;
    return ending_;
  }

  // The item being written. REQUIRES: the caller was told to write it (Offer returned true,
  // or WriteDone's write), and its write has not completed.
  const T& Current() const { return current_; }

 private:
  const Keep keep_;
  const grpc::Status write_failed_;
  absl::Mutex mu_;
  T current_;  // written under mu_, only while no write is in flight
  bool current_last_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<std::pair<T, bool>> waiting_ ABSL_GUARDED_BY(mu_);  // (item, last)
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> ending_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace lathe

#endif  // LATHE_COORDINATOR_API_WRITE_QUEUE_H_
