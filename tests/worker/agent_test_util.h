// Helpers shared by the agent's tests: trainer scripts and an event recorder.
#ifndef LATHE_TESTS_WORKER_AGENT_TEST_UTIL_H_
#define LATHE_TESTS_WORKER_AGENT_TEST_UTIL_H_

#include <filesystem>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "tests/testing/temp_dir.h"
#include "worker/agent/trainer_supervisor.h"

namespace lathe::testing {

// Long enough for a loaded CI machine; tests never wait this long when things work.
inline constexpr absl::Duration kWaitLimit = absl::Seconds(60);

// Writes an executable shell script to dir/name and returns its path.
inline std::string WriteScript(const TempDir& dir, const std::string& name,
                               const std::string& body) {
  std::string path = dir.Write(name, "#!/bin/sh\n" + body);
  std::filesystem::permissions(path, std::filesystem::perms::owner_all);
  return path;
}

// JSON lines as `lathe-worker train --output json` prints them.
inline std::string StartLine(int steps) {
  return R"({"event": "start", "job": "t", "steps": )" + std::to_string(steps) +
         R"(, "micro_batch": 1, "global_batch": 2})";
}
inline std::string StepLine(int step, int steps, const std::string& loss) {
  return R"({"event": "step", "step": )" + std::to_string(step) + R"(, "steps": )" +
         std::to_string(steps) + R"(, "loss": )" + loss +
         R"(, "lr": 0.001, "grad_norm": 0.5, "tokens": 64, "tokens_per_s": 1000.0})";
}
inline std::string DoneLine(int steps, const std::string& final_loss, const std::string& adapter) {
  return R"({"event": "done", "steps": )" + std::to_string(steps) + R"(, "final_loss": )" +
         final_loss + R"(, "eval_loss": null, "adapter": ")" + adapter +
         R"(", "model": null, "seconds": 1.5, "tokens_per_s": 900.0, "peak_rss_bytes": 1000})";
}

// Records a supervisor's events.
class EventRecorder {
 public:
  TrainerSupervisor::EventCallback Callback() {
    return [this](const TrainerEvent& event) {
      absl::MutexLock lock(&mu_);
      events_.push_back(event);
    };
  }

  // The terminal event, once there is one; an UNSPECIFIED event after kWaitLimit.
  TrainerEvent WaitForEnd() {
    absl::MutexLock lock(&mu_);
    auto ended = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !events_.empty() && IsEnd(events_.back().kind);
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&ended), kWaitLimit)) return TrainerEvent();
    return events_.back();
  }

  // True once an event of `kind` has arrived.
  bool WaitFor(v1::RankEvent kind) {
    absl::MutexLock lock(&mu_);
    auto seen = [this, kind]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const TrainerEvent& e : events_) {
        if (e.kind == kind) return true;
      }
      return false;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&seen), kWaitLimit);
  }

  std::vector<TrainerEvent> events() const {
    absl::MutexLock lock(&mu_);
    return events_;
  }

  std::vector<v1::RankEvent> kinds() const {
    absl::MutexLock lock(&mu_);
    std::vector<v1::RankEvent> kinds;
    for (const TrainerEvent& e : events_) kinds.push_back(e.kind);
    return kinds;
  }

 private:
  static bool IsEnd(v1::RankEvent kind) {
    return kind == v1::RANK_EVENT_SUCCEEDED || kind == v1::RANK_EVENT_FAILED ||
           kind == v1::RANK_EVENT_CANCELLED;
  }

  mutable absl::Mutex mu_;
  std::vector<TrainerEvent> events_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lathe::testing

#endif  // LATHE_TESTS_WORKER_AGENT_TEST_UTIL_H_
