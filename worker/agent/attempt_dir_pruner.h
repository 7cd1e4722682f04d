// Removes the folders of finished attempts from the agent's work directory, so that it does
// not keep one folder per rank forever (issue #32).
//
// Each rank runs in `<work_dir>/<job>-g<generation>-r<rank>/` (TrainerSupervisor). Once the
// agent is done with one (its trainer has ended and its log has been shipped to the
// coordinator, or declared lost), it tells the pruner (Ended), and Prune removes the folder
// `keep` later. The coordinator keeps the log (`lathe logs`); the folder is only the local
// copy. At start, SweepLeftovers removes the folders a previous run of the agent left whose
// newest entry is older than `keep`.
//
// Only entries of work_dir itself whose name is an attempt folder's, and that are real
// directories (a symbolic link is never followed nor removed), are ever removed; nothing is
// removed while `in_use` says the agent runs (or is about to run) that rank.
//
// Thread-safety: thread-compatible (the agent calls it from its Run thread only).
#ifndef LATHE_WORKER_AGENT_ATTEMPT_DIR_PRUNER_H_
#define LATHE_WORKER_AGENT_ATTEMPT_DIR_PRUNER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace lathe {

class AttemptDirPruner {
 public:
  // Whether the agent holds the rank whose folder is `name`: such a folder is kept.
  using InUse = std::function<bool(const std::string& name)>;
  // Whether what still reads an ended attempt's folder (its log shipper) is done with it.
  using Released = std::function<bool()>;

  // `keep`: how long a finished attempt's folder stays (0: removed at the first Prune after
  // it is released). REQUIRES: `clock` outlives the pruner.
  AttemptDirPruner(std::string work_dir, absl::Duration keep, const Clock* clock);

  // `<job_id>-g<generation>-r<rank>`, the folder TrainerSupervisor runs the rank in.
  static std::string DirName(absl::string_view job_id, int64_t generation, int64_t rank);
  // True for a name DirName can return for a job id that is a safe file name (letters,
  // digits, '-', '_', '.'; not "." nor ".."), a generation and a rank >= 0.
  static bool IsAttemptDirName(absl::string_view name);

  // The trainer of folder `name` has ended. Its `keep` starts at the first Prune at which
  // `released` returns true. A name that is not an attempt folder's is ignored.
  void Ended(const std::string& name, Released released);

  // Removes the ended attempts' folders whose `keep` has passed and that are not in use;
  // logs one line for each. Call it periodically. Returns how many it removed.
  int Prune(const InUse& in_use);

  // Removes the attempt folders in work_dir that this agent does not track (a previous run
  // left them) whose newest entry (the folder or a file directly in it) was modified more than
  // `keep` ago, and that are not in use. Returns how many it removed.
  int SweepLeftovers(const InUse& in_use);

  // Ended attempts whose folder has not been removed yet.
  size_t tracked() const { return ended_.size(); }

 private:
  struct Attempt {
    Released released;
    bool is_released = false;
    absl::Time since;  // when `released` first held
  };

  // Removes work_dir/name when it is a real directory; logs why. True when it removed it.
  bool Remove(const std::string& name, const std::string& why);

  const std::string work_dir_;
  const absl::Duration keep_;
  const Clock* const clock_;
  std::map<std::string, Attempt> ended_;
};

}  // namespace lathe

#endif  // LATHE_WORKER_AGENT_ATTEMPT_DIR_PRUNER_H_
